//! The "Shaped like published benchmarks" section of docs/benchmarks.md:
//! the `conduit` and `sequin` phases, each beside what its model
//! published, with the differences said.

use std::fmt::Write;

use super::{heading, name};
use crate::peers::{measured, RELAYS};
use crate::results::Results;
use crate::shapes::{CONDUIT_TX, SEQUIN_BATCH, SEQUIN_RATES};
use crate::Scale;

/// The phases of this section.
pub(crate) const PHASES: [&str; 2] = ["conduit", "sequin"];

pub(crate) fn section(r: &Results, scale: Scale) -> String {
    let mut s = heading(scale);
    conduit(&mut s, r);
    sequin(&mut s, r);
    s
}

fn conduit(s: &mut String, r: &Results) {
    if !r.has("conduit", "events") {
        return;
    }
    let _ = writeln!(
        s,
        "### Shaped like Conduit's Postgres → Kafka CDC run\n\n\
         **What Conduit published** ([ConduitIO/streaming-benchmarks](https://github.com/ConduitIO/streaming-benchmarks), `results/postgres-kafka/20250508`, May 2025): an AWS t2.xlarge (4 vCPUs, 16 GB) running Postgres, one Kafka broker and the tool in Docker; 16,000,000 rows of a small `employees` table inserted in transactions of 200 while the pipeline was stopped; the pipeline started and measured for 2 minutes (message rate, and CPU % and memory from `docker stats`). Conduit v0.13.2: **48,060 msg/s, 110 MB**, CPU 66% in its `aggregated-results.csv` (110% in its README's table, which repeats the memory figure); Kafka Connect 7.8.1 with Debezium's Postgres connector (10 GB heap): **44,889 msg/s, 147% CPU, 6,863 MB**. Both write a change event per row (CDC), not an outbox's events.\n\n\
         **The same shape here**: {} outbox rows of {} bytes on average, in transactions of {CONDUIT_TX}, written while the relays were stopped (each had its slot already); then each relay started on its own and timed from its launch until every event was on its topic (read back: every event id once), its start-up included as in Conduit's window. CPU % is the relay's CPU seconds over that time (100% = one core); mean RSS is sampled every 0.5 s, peak RSS is `VmHWM`. Not a 2-minute window: walbox drains the backlog in seconds.\n",
        r.stat("conduit", "events", 0, ""),
        r.stat("conduit", "row_bytes", 0, ""),
    );
    let _ = writeln!(
        s,
        "| relay | events/s | CPU % | CPU µs per event | mean RSS | peak RSS | drained in | duplicates |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|");
    for kind in measured(RELAYS) {
        let k = |m: &str| format!("{}_{m}", kind.slot());
        if !r.has("conduit", &k("eps")) {
            continue;
        }
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            name(kind),
            r.stat("conduit", &k("eps"), 0, ""),
            r.stat("conduit", &k("cpu_pct"), 0, "%"),
            r.stat("conduit", &k("cpu_us"), 2, ""),
            r.stat("conduit", &k("rss_mean_mib"), 0, " MiB"),
            r.stat("conduit", &k("rss_mib"), 0, " MiB"),
            r.stat("conduit", &k("s"), 1, " s"),
            r.stat("conduit", &k("duplicates"), 0, ""),
        );
    }
    let _ = writeln!(
        s,
        "\nOn half the cores of Conduit's machine (2 against 4), with Postgres and the broker on the same two. Nothing here measures Conduit: read the rows above beside its published figures, not as a run of both.\n"
    );
    if let Some(fig) = super::figures::ALL
        .iter()
        .find(|f| f.file == super::figures::RSS_OVER_TIME)
    {
        let _ = writeln!(s, "![{}](figures/{})\n", fig.alt, fig.file);
    }
}

fn sequin(s: &mut String, r: &Results) {
    if !r.has("sequin", "walbox_rss_mib") {
        return;
    }
    let _ = writeln!(
        s,
        "### Shaped like Sequin's sustained mixed workload\n\n\
         **What Sequin published** ([sequinstream.com/docs/performance](https://sequinstream.com/docs/performance), the workload in [sequin-vs-debezium-benchmark](https://github.com/sequinstream/sequin-vs-debezium-benchmark)): Postgres on AWS RDS `db.m5.8xlarge` (32 vCPUs), Amazon MSK with 4 brokers, the relay on its own EC2 instance; a generator commits transactions of 100 INSERTs, 100 UPDATEs and 100 DELETEs on one table; throughput is records delivered to Kafka per second, latency is from the row's `updated_at` to the Kafka record's creation timestamp. Sequin: **50,000 ops/s sustained, mean 55 ms, p99 253 ms**. Debezium on MSK Connect (8 MCUs): **6,000 ops/s, mean ≈258 ms, p99 ≈499 ms**; at 10,000 ops/s its latency grew without bound.\n\n\
         **The same shape here**: pgbench, 8 clients, each transaction {SEQUIN_BATCH} INSERTs of ~200-byte outbox rows, an UPDATE of {SEQUIN_BATCH} earlier rows and a DELETE of {SEQUIN_BATCH} earlier rows (rows written before walbox's slot existed), at 20 and 167 transactions/s asked (6,000 and 50,000 operations/s: Debezium's rate and Sequin's above), {} s each; each DELETE takes the next 100 rows, each UPDATE 100 at random among 200,000. Operations are Postgres's own counts (`pg_stat_user_tables`). walbox is an outbox relay: it publishes the INSERTs, one event each; the walsender decodes all three kinds and streams them, walbox reads the UPDATEs and DELETEs and skips them. Latency is from the row's `created_at` (`now()` in its transaction, like Sequin's `updated_at`) to the broker's append time (`LogAppendTime`, whole ms), which comes after a producer's creation timestamp: if anything, it overstates walbox's latency against Sequin's measure. Every event was read back.\n",
        r.stat("sequin", "seconds", 0, ""),
    );
    let _ = writeln!(
        s,
        "| asked | operations/s | of them INSERTs (events/s) | mean | p50 | p99 | max | walbox CPU % |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|");
    for rate in SEQUIN_RATES {
        let k = |m: &str| format!("walbox_{rate}_{m}");
        if !r.has("sequin", &k("ops_per_s")) {
            continue;
        }
        let _ = writeln!(
            s,
            "| {rate} transactions/s ({},{:03} operations/s) | {} | {} | {} | {} | {} | {} | {} |",
            rate * 300 / 1000,
            rate * 300 % 1000,
            r.stat("sequin", &k("ops_per_s"), 0, ""),
            r.stat("sequin", &k("eps"), 0, ""),
            r.stat("sequin", &k("mean_ms"), 1, " ms"),
            r.stat("sequin", &k("p50_ms"), 0, " ms"),
            r.stat("sequin", &k("p99_ms"), 0, " ms"),
            r.stat("sequin", &k("max_ms"), 0, " ms"),
            r.stat("sequin", &k("cpu_pct"), 0, "%"),
        );
    }
    let _ = writeln!(
        s,
        "\nwalbox's peak RSS over both points: {}. Operations/s below the asked rate mean the writer (pgbench on the same 2 cores as Postgres, the broker and walbox) fell behind its schedule: only what was written is claimed.\n",
        r.stat("sequin", "walbox_rss_mib", 0, " MiB"),
    );
}
