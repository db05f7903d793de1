//! Producing 200-byte keyed records through the sink to librdkafka's
//! in-process MockCluster (which itself takes ~170k msg/s on this machine),
//! with delivery reports consumed as a relay would.
//!
//! `cargo bench -p sink-kafka` — reports records per second.

#![allow(missing_docs)] // criterion_group! generates an undocumented pub fn

use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use rdkafka::mocking::MockCluster;
use sink_kafka::{Record, Sink, SinkConfig};

const BATCH: u64 = 50_000;

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let mock = MockCluster::new(1).unwrap();
    mock.create_topic("bench", 6, 1).unwrap();
    let (sink, mut reports) = Sink::<u64>::new(&SinkConfig::new(mock.bootstrap_servers())).unwrap();
    let value = Bytes::from(vec![b'x'; 200 - 12]);
    let keys: Vec<Bytes> = (0..1000)
        .map(|i| Bytes::from(format!("order-{i:06}")))
        .collect();

    let mut group = c.benchmark_group("sink");
    group.throughput(Throughput::Elements(BATCH));
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(20));
    group.bench_function("produce_200b_mock_cluster", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                for _ in 0..iters {
                    let mut sent = 0u64;
                    let mut acked = 0u64;
                    while acked < BATCH {
                        tokio::select! {
                            biased;
                            r = reports.next() => {
                                r.unwrap().result.unwrap();
                                acked += 1;
                            }
                            permit = sink.reserve(200), if sent < BATCH => {
                                let key = keys[(sent % 1000) as usize].clone();
                                sink.send(permit, Record::new("bench", Some(key), Some(value.clone()), sent)).await;
                                sent += 1;
                            }
                        }
                    }
                }
                start.elapsed()
            })
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
