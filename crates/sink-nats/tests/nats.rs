//! sink-nats against a real nats-server with JetStream (the harness's),
//! read back by the NATS project's client: every record stored once in
//! order, re-sends dropped by `Nats-Msg-Id`, what no stream takes and
//! what is too large refused for good, a server gone a retriable failure.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use sink_core::{Delivered, Deliveries, DeliveryErrorKind, Destination, Origin, Record};
use sink_nats::{Acks, NatsConfig, NatsUrl, Publisher};
use walbox_test_harness::nats::NatsServer;

fn config(server: &NatsServer) -> NatsConfig {
    NatsConfig {
        url: NatsUrl::parse(&server.url()).unwrap(),
        ca_file: None,
        max_in_flight: 10_000,
        max_in_flight_bytes: 64 << 20,
        ack_timeout: Duration::from_secs(5),
        connection_name: "walbox-test".into(),
    }
}

fn record(n: u64, subject: &str) -> Record<u64> {
    Record::new(
        subject,
        Some(Bytes::from(format!("agg-{}", n % 7))),
        Some(Bytes::from(format!("{{\"n\":{n}}}"))),
        n,
    )
    .with_header("id", Bytes::from(format!("e-{n}")))
    .with_origin(Origin {
        stream: Arc::from("walbox"),
        history: 0,
        position: 0x100 + n / 10,
        index: n % 10,
        commit_time: 0,
    })
}

async fn send(p: &Publisher<u64>, r: Record<u64>) {
    let permit = p.reserve(r.size()).await;
    p.send(permit, r).await;
}

async fn reports(acks: &mut Acks<u64>, n: usize) -> Vec<sink_core::Report<u64>> {
    let mut out = Vec::new();
    while out.len() < n {
        out.push(
            tokio::time::timeout(Duration::from_secs(30), acks.next())
                .await
                .expect("a report within 30 s")
                .expect("open"),
        );
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_once_in_order_resends_dropped_refusals_for_good() {
    let mut server = NatsServer::start();
    let client = async_nats::connect(server.url()).await.unwrap();
    let js = async_nats::jetstream::new(client.clone());
    let mut stream = js
        .create_stream(async_nats::jetstream::stream::Config {
            name: "ORDERS".into(),
            subjects: vec!["orders.>".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    let (publisher, mut acks) = Publisher::<u64>::connect(config(&server)).await.unwrap();

    for n in 0..1_000 {
        send(&publisher, record(n, "orders.placed")).await;
    }
    let got = reports(&mut acks, 1_000).await;
    for (i, r) in got.iter().enumerate() {
        assert_eq!(r.token, i as u64, "reports in publish order");
        match &r.result {
            Ok(Delivered::Nats {
                stream,
                sequence,
                duplicate,
            }) => {
                assert_eq!(
                    (stream.as_str(), *sequence, *duplicate),
                    ("ORDERS", i as u64 + 1, false)
                );
            }
            other => panic!("{i}: {other:?}"),
        }
    }
    // Re-sent (the same origins): acknowledged as duplicates, not stored.
    for n in 900..1_000 {
        send(&publisher, record(n, "orders.placed")).await;
    }
    for r in reports(&mut acks, 100).await {
        assert!(
            matches!(
                r.result,
                Ok(Delivered::Nats {
                    duplicate: true,
                    ..
                })
            ),
            "{:?}",
            r.result
        );
    }
    assert_eq!(stream.info().await.unwrap().state.messages, 1_000);

    // Read back by the NATS client: order, headers, key, message id.
    let consumer = stream
        .create_consumer(async_nats::jetstream::consumer::pull::Config {
            durable_name: Some("check".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    let mut messages = consumer
        .fetch()
        .max_messages(1_000)
        .messages()
        .await
        .unwrap();
    let mut n = 0u64;
    while let Some(m) = messages.next().await {
        let m = m.unwrap();
        let headers = m.headers.clone().unwrap();
        assert_eq!(m.payload, Bytes::from(format!("{{\"n\":{n}}}")));
        assert_eq!(headers.get("id").unwrap().as_str(), format!("e-{n}"));
        assert_eq!(
            headers.get("walbox.key").unwrap().as_str(),
            format!("agg-{}", n % 7)
        );
        assert_eq!(
            headers
                .get(async_nats::header::NATS_MESSAGE_ID)
                .unwrap()
                .as_str(),
            format!("walbox/0/{:X}/{}", 0x100 + n / 10, n % 10)
        );
        n += 1;
    }
    assert_eq!(n, 1_000);

    // No stream takes the subject; too large for the server: for good.
    send(&publisher, record(2_000, "invoices.placed")).await;
    let mut big = record(2_001, "orders.big");
    big.value = Some(Bytes::from(vec![b'x'; 2 << 20]));
    send(&publisher, big).await;
    let refused = reports(&mut acks, 2).await;
    let why = |r: &sink_core::Report<u64>| match &r.result {
        Err(f) => (f.kind, f.message.clone()),
        ok => panic!("{ok:?}"),
    };
    let (kind, text) = why(&refused[0]);
    assert_eq!(kind, DeliveryErrorKind::Permanent);
    assert!(
        text.contains("no JetStream stream takes subject \"invoices.placed\""),
        "{text}"
    );
    let (kind, text) = why(&refused[1]);
    assert_eq!(kind, DeliveryErrorKind::Permanent);
    assert!(text.contains("its max_payload"), "{text}");

    // The server gone: a retriable failure, reported, not a hang.
    server.kill9();
    send(&publisher, record(3_000, "orders.placed")).await;
    let (kind, _) = why(&reports(&mut acks, 1).await[0]);
    assert_eq!(kind, DeliveryErrorKind::RetriableExhausted);
    server.restart();
}

/// A wrong password and a server without JetStream are refused for good,
/// in one line, without the password; the right one connects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_is_definite_and_shows_no_secret() {
    let server = NatsServer::start_with(&["-js", "--user", "walbox", "--pass", "Zq9-nats-pass"]);
    let at = |creds: &str| {
        let mut c = config(&server);
        c.url =
            NatsUrl::parse(&server.url().replace("nats://", &format!("nats://{creds}@"))).unwrap();
        c
    };
    let wrong = Publisher::<u64>::connect(at("walbox:Zq9-wrong-pass"))
        .await
        .err()
        .expect("refused");
    let text = wrong.to_string();
    assert!(!wrong.is_transient(), "{text}");
    assert!(text.contains("refused the connection"), "{text}");
    assert!(!text.contains("Zq9"), "{text}");
    assert_eq!(text.lines().count(), 1, "{text}");
    let (p, _acks) = Publisher::<u64>::connect(at("walbox:Zq9-nats-pass"))
        .await
        .unwrap();
    let port = server.url().rsplit(':').next().unwrap().to_owned();
    assert_eq!(p.url(), format!("nats://walbox@127.0.0.1:{port}"));

    let plain = NatsServer::start_with(&[]);
    let e = Publisher::<u64>::connect(config(&plain))
        .await
        .err()
        .expect("refused");
    assert!(!e.is_transient(), "{e}");
    assert!(e.to_string().contains("JetStream is not available"), "{e}");

    // Nobody listening: an outage, tried again by the caller.
    let mut gone = config(&plain);
    gone.url = NatsUrl::parse(&format!(
        "nats://127.0.0.1:{}",
        walbox_test_harness::port::free_port()
    ))
    .unwrap();
    let e = Publisher::<u64>::connect(gone)
        .await
        .err()
        .expect("no server");
    assert!(e.is_transient(), "{e}");
}

/// What one read handed over: (subject, sequence, key, id).
type Seen = Vec<(String, i64, String, String)>;

fn seen(r: &dyn sink_core::readback::ReadBack, into: &mut Seen) {
    let text = |v: Option<&[u8]>| String::from_utf8_lossy(v.unwrap_or_default()).into_owned();
    into.push((
        r.topic().to_owned(),
        r.offset(),
        text(r.key()),
        text(r.header("id")),
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_back_without_consuming_in_stream_order_only_the_subjects_asked() {
    use sink_core::readback::ReadFrom;
    let server = NatsServer::start();
    let client = async_nats::connect(server.url()).await.unwrap();
    let js = async_nats::jetstream::new(client.clone());
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "ORDERS".into(),
        subjects: vec!["orders.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "JOBS".into(),
        subjects: vec!["jobs".into()],
        retention: async_nats::jetstream::stream::RetentionPolicy::WorkQueue,
        ..Default::default()
    })
    .await
    .unwrap();
    let (publisher, mut acks) = Publisher::<u64>::connect(config(&server)).await.unwrap();
    for n in 0..300 {
        let subject = if n % 3 == 0 {
            "orders.paid"
        } else {
            "orders.placed"
        };
        send(&publisher, record(n, subject)).await;
    }
    reports(&mut acks, 300).await;
    let stall = Duration::from_secs(10);
    let subjects = vec!["orders.placed".to_owned(), "nowhere".to_owned()];

    // Twice: the first read took nothing away.
    for _ in 0..2 {
        let mut got = Seen::new();
        let summary = sink_nats::read_streams(
            &config(&server),
            &subjects,
            ReadFrom::Beginning,
            stall,
            |r| {
                seen(r, &mut got);
                Ok(())
            },
        )
        .await
        .unwrap();
        assert_eq!(summary.absent_topics, vec!["nowhere".to_owned()]);
        assert!(summary.truncated.is_empty());
        assert_eq!(summary.records, 200);
        let want: Seen = (0..300u64)
            .filter(|n| n % 3 != 0)
            .map(|n| {
                (
                    "orders.placed".to_owned(),
                    n as i64 + 1,
                    format!("agg-{}", n % 7),
                    format!("e-{n}"),
                )
            })
            .collect();
        assert_eq!(got, want);
    }
    // From a time after every message: nothing.
    let later = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
        + 60_000;
    let mut got = Seen::new();
    sink_nats::read_streams(
        &config(&server),
        &subjects,
        ReadFrom::Time(later),
        stall,
        |r| {
            seen(r, &mut got);
            Ok(())
        },
    )
    .await
    .unwrap();
    assert!(got.is_empty(), "{got:?}");

    // A range of sequences, every subject, clamped to the stream's end.
    let mut got = Seen::new();
    let range = sink_nats::read_range(&config(&server), "ORDERS", (295, 400), stall, |r| {
        seen(r, &mut got)
    })
    .await
    .unwrap();
    assert_eq!((range.low, range.read_to), (1, 301));
    let sequences: Vec<i64> = got.iter().map(|s| s.1).collect();
    assert_eq!(sequences, vec![295, 296, 297, 298, 299, 300]);

    // A work queue forgets what was consumed: refused, by name.
    let err = sink_nats::read_streams(
        &config(&server),
        &["jobs".to_owned()],
        ReadFrom::Beginning,
        stall,
        |_| Ok(()),
    )
    .await
    .unwrap_err();
    assert!(err.contains("JOBS") && err.contains("workqueue"), "{err}");
}

/// tls:// to a server with a certificate from a CA the test makes: trusted
/// through `ca_file`, stored; another CA, or the system's roots, refused
/// for good in one line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_verifies_the_server_by_the_ca_file() {
    let certs = walbox_test_harness::tls::Certificates::generate();
    let cert = certs.server_cert().display().to_string();
    let key = certs.server_key().display().to_string();
    let server = NatsServer::start_with(&["-js", "--tls", "--tlscert", &cert, "--tlskey", &key]);
    let at = |host: &str, ca: Option<std::path::PathBuf>| {
        let mut c = config(&server);
        let port = server.url().rsplit(':').next().unwrap().to_owned();
        c.url = NatsUrl::parse(&format!("tls://{host}:{port}")).unwrap();
        c.ca_file = ca;
        c
    };
    client_stream(&server, &certs).await;
    for host in ["localhost", "127.0.0.1"] {
        let (p, mut acks) = Publisher::<u64>::connect(at(host, Some(certs.ca())))
            .await
            .unwrap();
        send(&p, record(1, "secure.orders")).await;
        let got = reports(&mut acks, 1).await;
        assert!(
            matches!(got[0].result, Ok(Delivered::Nats { .. })),
            "{host}: {:?}",
            got[0].result
        );
    }
    for ca in [Some(certs.other_ca()), None] {
        let e = Publisher::<u64>::connect(at("localhost", ca.clone()))
            .await
            .err()
            .expect("refused");
        let text = e.to_string();
        assert!(!e.is_transient(), "{ca:?}: {text}");
        assert_eq!(text.lines().count(), 1, "{text}");
    }
    // A plain nats:// client to a server that requires TLS: refused.
    let e = Publisher::<u64>::connect(config(&server))
        .await
        .err()
        .expect("refused");
    assert!(e.to_string().to_lowercase().contains("tls"), "{e}");
}

/// The stream `SECURE` for `secure.>`, created over TLS by the NATS client.
async fn client_stream(server: &NatsServer, certs: &walbox_test_harness::tls::Certificates) {
    let url = server.url().replace("nats://", "tls://");
    // async-nats' own TLS setup asks rustls for a process default, which
    // two providers in the tree make it panic on: ring, named.
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_file_iter(certs.ca()).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let tls = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let client = async_nats::ConnectOptions::new()
        .require_tls(true)
        .tls_client_config(tls)
        .connect(url.replace("127.0.0.1", "localhost"))
        .await
        .unwrap();
    async_nats::jetstream::new(client)
        .create_stream(async_nats::jetstream::stream::Config {
            name: "SECURE".into(),
            subjects: vec!["secure.>".into()],
            ..Default::default()
        })
        .await
        .unwrap();
}
