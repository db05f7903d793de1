//! The scenarios, how each is run and judged, and the results table.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pgoutput_decoder::Lsn;
use rdkafka::types::RDKafkaRespErr;

use crate::check::{tally, Expect, Tally};
use crate::world::{no_aggregate_id, Broker, BrokerKind, Load, LoadShape, World, KEYS};

/// How hard the scenarios push.
pub(crate) struct Scale {
    kills: usize,
    fault: Duration,
    rate: u32,
    big_tx: usize,
    /// How long the idle outbox watches another database's writes.
    idle: Duration,
}

impl Scale {
    pub(crate) fn quick() -> Scale {
        Scale {
            kills: 3,
            fault: Duration::from_secs(5),
            rate: 1_000,
            big_tx: 50_000,
            idle: Duration::from_secs(60),
        }
    }

    pub(crate) fn full() -> Scale {
        Scale {
            kills: 10,
            fault: Duration::from_secs(20),
            rate: 3_000,
            big_tx: 1_000_000,
            idle: Duration::from_secs(600),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Kill9,
    SigtermMidTx,
    SecondSigterm,
    BrokerDown,
    BrokerKill9,
    BrokerBlackhole,
    RefusedTopic,
    PgFastRestart,
    PgCrash,
    PgBlackhole,
    DriftRecreate,
    DriftUnpublish,
    DriftColumns,
    DriftRename,
    BigTxKilled,
    BigPayloads,
    PgRestoreSameTimeline,
    HealKilled,
    ShardsNullIds,
    LeaderKill9,
    LeaderBlackhole,
    RollingRestart,
    IdleOutbox,
}

#[derive(Clone)]
pub(crate) struct Scenario {
    pub(crate) name: &'static str,
    pub(crate) fault: &'static str,
    pub(crate) quick: bool,
    pub(crate) broker: BrokerKind,
    /// `delivery = "exactly-once"`: a `read_committed` consumer must see
    /// no duplicates.
    pub(crate) exactly_once: bool,
    pub(crate) kind: Kind,
}

pub(crate) fn all() -> Vec<Scenario> {
    use Kind::*;
    let s = |name, fault, quick, on_kafka: bool, kind| Scenario {
        name,
        fault,
        quick,
        broker: if on_kafka {
            BrokerKind::Kafka
        } else {
            BrokerKind::Mock
        },
        exactly_once: false,
        kind,
    };
    // On three Apache Kafka brokers, in both delivery modes.
    let three = |name, fault, quick, exactly_once, kind| Scenario {
        name,
        fault,
        quick,
        broker: BrokerKind::Kafka3,
        exactly_once,
        kind,
    };
    vec![
        s("kill-9", "walbox killed with SIGKILL and restarted, repeatedly (no duplicates allowed: skip_delivered)", true, false, Kill9),
        s("sigterm-mid-tx", "SIGTERM inside 200-event transactions, then a restart (no duplicates allowed)", true, false, SigtermMidTx),
        s("second-sigterm", "SIGTERM, and another one 50 ms later: exit at once", true, false, SecondSigterm),
        s("broker-down", "every broker down (MockCluster), then up", true, false, BrokerDown),
        s("broker-kill-9", "the broker process (Apache Kafka, one node) killed with SIGKILL and restarted on its data", false, true, BrokerKill9),
        s("broker-blackhole", "the broker (Apache Kafka, one node) frozen with SIGSTOP: connections stay open, nothing answers; then SIGCONT", false, true, BrokerBlackhole),
        s("refused-topic", "events of one aggregate type go to a topic the broker refuses for good", true, false, RefusedTopic),
        s("pg-fast-restart", "Postgres fast shutdown and start while walbox runs", true, false, PgFastRestart),
        s("pg-crash", "Postgres immediate shutdown (crash recovery) and start", false, false, PgCrash),
        s("pg-blackhole", "walbox's Postgres connections stop forwarding without closing, then resume", false, false, PgBlackhole),
        s("drift-recreate", "outbox table dropped and recreated; after walbox stops, added to the publication, `walbox resync --drift`, walbox restarted", false, false, DriftRecreate),
        s("drift-unpublish", "table removed from the publication while walbox runs with on_drift = heal, added back seconds later", true, false, DriftUnpublish),
        s("drift-columns", "a column added and one before the payload dropped, while streaming", true, false, DriftColumns),
        s("drift-rename", "table renamed; after walbox stops, renamed back and walbox restarted", false, false, DriftRename),
        s("big-tx-kill-9", "one huge transaction, walbox killed with SIGKILL half-way through it", true, false, BigTxKilled),
        s("big-payloads", "100 KB payloads against the 8 MiB in-flight byte bound", false, false, BigPayloads),
        s("pg-restore", "Postgres stopped, its data directory restored to a copy taken seconds earlier (same system id and timeline, WAL behind what walbox delivered), started", true, false, PgRestoreSameTimeline),
        s("shards-kill-9", "two shards (two slots, two processes), a tenth of the events with a NULL or empty aggregate id, both processes killed with SIGKILL and restarted, repeatedly", true, false, ShardsNullIds),
        three("kafka3-leader-kill-9", "three Apache Kafka brokers (replication 3, min.insync.replicas 2): the leader of partition 0 killed with SIGKILL, restarted later", true, false, LeaderKill9),
        three("kafka3-leader-kill-9-eos", "as kafka3-leader-kill-9, exactly-once (no duplicates allowed for read_committed)", true, true, LeaderKill9),
        three("kafka3-blackhole", "three brokers: the leader of partition 0 frozen with SIGSTOP, then SIGCONT", false, false, LeaderBlackhole),
        three("kafka3-blackhole-eos", "as kafka3-blackhole, exactly-once", false, true, LeaderBlackhole),
        three("kafka3-rolling-restart", "three brokers restarted one after another (SIGTERM, start, wait until it serves)", false, false, RollingRestart),
        three("kafka3-rolling-restart-eos", "as kafka3-rolling-restart, exactly-once", false, true, RollingRestart),
        s("idle-outbox", "the outbox idle for 10 minutes while another database of the server is written without pause: the slot must follow it within seconds and what it retains must not grow", false, false, IdleOutbox),
        s("heal-kill-9", "walbox resync killed with SIGKILL at each step of its heal (recorded, old slot dropped, new slot made, rows copied), each time resumed by walbox run", true, false, HealKilled),
    ]
}

/// One scenario's result.
pub(crate) struct Row {
    name: &'static str,
    fault: &'static str,
    tally: Option<Tally>,
    peak_rss_mib: f64,
    pub(crate) passed: bool,
    note: String,
}

impl Row {
    pub(crate) fn skipped(s: &Scenario, why: &str) -> Row {
        Row {
            name: s.name,
            fault: s.fault,
            tally: None,
            peak_rss_mib: 0.0,
            passed: true,
            note: format!("skipped: {why}"),
        }
    }

    pub(crate) fn failed(s: &Scenario, why: &str) -> Row {
        Row {
            name: s.name,
            fault: s.fault,
            tally: None,
            peak_rss_mib: 0.0,
            passed: false,
            note: format!("FAILED: {}", why.lines().next().unwrap_or(why)),
        }
    }

    pub(crate) fn summary(&self) -> String {
        match &self.tally {
            Some(t) => format!(
                "written {} delivered {} dead-lettered {} missing {} duplicates {} order {} confirmed-past {} peak RSS {:.0} MiB; {}",
                t.written, t.delivered, t.dead_lettered, t.missing, t.duplicates,
                t.order_violations, t.confirmed_past, self.peak_rss_mib, self.note
            ),
            None => self.note.clone(),
        }
    }
}

/// What a scenario's fault phase concluded.
#[derive(Default)]
struct Outcome {
    notes: Vec<String>,
    failures: Vec<String>,
    /// No duplicates are promised here.
    duplicates_forbidden: bool,
    /// Events the scenario wrote itself, beside the load.
    extra: Vec<(i64, Lsn)>,
    /// For the confirmed-past check, the slot's highest position when
    /// walbox stopped by itself (what the user fixes afterwards may let the
    /// slot pass events the stream never carried).
    confirmed_at_stop: Option<Lsn>,
    /// The database was restored to an earlier copy: the events committed
    /// after the copy are gone with it (delivered or not), and the truth is
    /// what the table holds at the end, every row of which must arrive.
    restored: bool,
    /// The outbox table was dropped and recreated: the old one's delivered
    /// rows are in no table.
    table_replaced: bool,
}

impl Outcome {
    fn check(&mut self, ok: bool, failure: impl Into<String>) {
        if !ok {
            self.failures.push(failure.into());
        }
    }
}

pub(crate) async fn run(s: &Scenario, scale: &Scale, walbox: &str) -> Row {
    if s.kind == Kind::IdleOutbox {
        return idle_outbox(s, scale, walbox).await;
    }
    let extra: &[&str] = match s.kind {
        Kind::DriftColumns => &["--mapping-event-type", ""],
        Kind::DriftUnpublish => &["--on-drift", "heal"],
        _ => &[],
    };
    // A million events need room on the mock cluster: ~16,000 per partition.
    let partitions = if s.kind == Kind::BigTxKilled { 64 } else { 3 };
    let shards = if s.kind == Kind::ShardsNullIds { 2 } else { 1 };
    let mut w = World::new(walbox, s.broker, partitions, extra, shards).await;
    if s.exactly_once {
        w.exactly_once().await;
    }
    w.start_walbox();
    let shape = match s.kind {
        Kind::SigtermMidTx => LoadShape {
            rate: scale.rate * 4,
            tx_size: 200,
            payload_bytes: 200,
            null_ids: false,
        },
        Kind::BigPayloads => LoadShape {
            rate: 200,
            tx_size: 1,
            payload_bytes: 100_000,
            null_ids: false,
        },
        Kind::BrokerKill9 => LoadShape {
            rate: scale.rate.min(500),
            tx_size: 5,
            payload_bytes: 200,
            null_ids: false,
        },
        _ => LoadShape {
            rate: scale.rate,
            tx_size: 5,
            payload_bytes: 200,
            null_ids: s.kind == Kind::ShardsNullIds,
        },
    };
    let load = Load::start(w.admin(), w.topic.clone(), 0, shape);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut o = Outcome::default();
    if s.exactly_once {
        o.duplicates_forbidden = true;
        o.notes
            .push("exactly-once, read back with read_committed".into());
    } else if matches!(
        s.kind,
        Kind::Kill9 | Kind::BigTxKilled | Kind::ShardsNullIds
    ) {
        // Killed walboxes, the broker's log kept: each restart reads the
        // topics back and skips what is there (skip_delivered).
        o.duplicates_forbidden = true;
        o.notes.push("skip_delivered: no duplicates allowed".into());
    }
    fault(s.kind, scale, &mut w, &mut o).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let written = load.stop().await;

    if !w.running() {
        o.notes.push("restarted walbox after the fault".into());
        w.start_walbox();
    }
    let caught_up = w.wait_caught_up(Duration::from_secs(120)).await;
    o.check(caught_up, "the slot did not catch up within 120 s");
    // The audit, while walbox runs (it confirms past the audit's snapshot);
    // nothing is written after this, so it sees what the checker will.
    let audit = w.audit().await;
    w.signal("TERM");
    let code = w.wait_exit(Duration::from_secs(40)).await;
    o.check(code == Some(0), format!("the final SIGTERM: exit {code:?}"));

    // The truth: what the load committed, and what the table holds (an
    // insert whose commit outcome was lost with the connection).
    let mut truth: BTreeMap<i64, Lsn> = if o.restored {
        BTreeMap::new()
    } else {
        written.iter().map(|e| (e.n, e.upper)).collect()
    };
    truth.extend(o.extra.iter().copied());
    let client = w.client().await;
    if let Ok(rows) = client
        .query(
            "SELECT (payload->>'n')::int8 FROM outbox_events WHERE payload ? 'n'",
            &[],
        )
        .await
    {
        for r in rows {
            truth.entry(r.get(0)).or_insert(Lsn::new(u64::MAX));
        }
    }
    let max_confirmed = o
        .confirmed_at_stop
        .unwrap_or_else(|| w.samples.lock().unwrap().max_confirmed);
    // Sharded: each event is judged against its own shard's slot (the
    // shard filter's hash, computed by Postgres) and those without an
    // aggregate id belong on the dead-letter topic.
    let mut shard_of: BTreeMap<i64, usize> = BTreeMap::new();
    let per_shard = w.samples.lock().unwrap().max_confirmed_per_shard.clone();
    if w.shards > 1 {
        let rows = client
            .query(
                "SELECT (payload->>'n')::int8, (hashtext(COALESCE(aggregate_id::text, '')) & 2147483647) % $1::int4 FROM outbox_events WHERE payload ? 'n'",
                &[&(w.shards as i32)],
            )
            .await
            .expect("read each event's shard");
        shard_of = rows
            .iter()
            .map(|r| (r.get(0), r.get::<_, i32>(1) as usize))
            .collect();
    }
    let confirmed = |n: i64| match shard_of.get(&n) {
        Some(&i) if o.confirmed_at_stop.is_none() => {
            per_shard.get(i).copied().unwrap_or(max_confirmed)
        }
        _ => max_confirmed,
    };
    let null_ids = s.kind == Kind::ShardsNullIds;
    let dead_letter = |n: i64| no_aggregate_id(n).is_some();
    let t = tally(
        w.broker.kafka(),
        &w.topic,
        &w.dead_letters,
        &truth,
        Expect {
            confirmed: &confirmed,
            dead_letter: null_ids.then_some(&dead_letter as &dyn Fn(i64) -> bool),
        },
    )
    .await;
    o.check(t.order_violations == 0, "per-key order violated");
    if null_ids {
        let without = truth.keys().filter(|n| dead_letter(**n)).count();
        o.notes.push(format!(
            "{without} events without an aggregate id, each expected on the dead-letter topic"
        ));
    }
    o.check(
        t.misrouted == 0,
        "events on the wrong topic (dead-lettered with an aggregate id, or delivered without one)",
    );
    o.check(
        t.confirmed_past == 0,
        "the slot was confirmed past an undelivered event",
    );
    o.check(t.wrong_payloads == 0, "records with a wrong key or payload");
    o.check(t.missing == 0, "events missing");
    if o.duplicates_forbidden {
        o.check(t.duplicates == 0, "duplicates where none are promised");
    }
    agrees(&mut o, audit, &t);
    let peak = w.samples.lock().unwrap().peak_rss_kib as f64 / 1024.0;
    let passed = o.failures.is_empty();
    let mut note = o.notes.join("; ");
    if !passed {
        note = format!("FAILED: {}. {note}", o.failures.join("; "));
        let log = w.log();
        let tail: Vec<&str> = log.lines().rev().take(15).collect();
        eprintln!("walbox log (last lines):");
        for l in tail.iter().rev() {
            eprintln!("  {l}");
        }
    }
    Row {
        name: s.name,
        fault: s.fault,
        tally: Some(t),
        peak_rss_mib: peak,
        passed,
        note,
    }
}

/// `walbox audit` finds what the checker found: the same missing events,
/// duplicates, order violations and dead letters, and nothing on the
/// broker that the table does not hold (except after a restore, which
/// took delivered rows out of the table).
fn agrees(o: &mut Outcome, audit: Result<serde_json::Value, String>, t: &Tally) {
    let report = match audit {
        Ok(r) => r,
        Err(e) => {
            o.check(false, format!("walbox audit failed: {e}"));
            return;
        }
    };
    let n = |k: &str| {
        report["total"][k]
            .as_u64()
            .map_or(usize::MAX, |v| v as usize)
    };
    // With the table replaced, the audit sees the duplicates of the new
    // table's rows only: no more than the checker's (checked below).
    let duplicates = if o.table_replaced {
        n("duplicates")
    } else {
        t.duplicates
    };
    let pairs = [
        ("missing", n("missing"), t.missing),
        ("duplicates", n("duplicates"), duplicates),
        ("out of order", n("out_of_order"), t.order_violations),
        ("dead-lettered", n("dead_lettered"), t.dead_lettered),
        ("misrouted", n("misrouted"), 0),
        ("unconfirmed", n("unconfirmed"), 0),
    ];
    let differ: Vec<String> = pairs
        .iter()
        .filter(|(_, audit, checker)| audit != checker)
        .map(|(what, audit, checker)| format!("{what}: audit {audit}, checker {checker}"))
        .collect();
    o.check(
        differ.is_empty(),
        format!(
            "walbox audit disagrees with the checker ({})",
            differ.join(", ")
        ),
    );
    let unknown = n("unknown");
    if o.restored {
        o.notes.push(format!(
            "audit: {unknown} delivered events no longer in the restored table"
        ));
    } else if o.table_replaced {
        o.check(
            n("duplicates") <= t.duplicates,
            format!(
                "walbox audit found more duplicates ({}) than the checker ({})",
                n("duplicates"),
                t.duplicates
            ),
        );
        o.notes.push(format!(
            "audit: {unknown} delivered events of the dropped table, {} duplicates among the new table's rows",
            n("duplicates")
        ));
    } else {
        o.check(
            unknown == 0,
            format!("walbox audit found {unknown} unknown records"),
        );
    }
    if differ.is_empty() {
        o.notes.push(format!(
            "walbox audit agrees ({} rows, {} duplicates)",
            n("rows"),
            n("duplicates")
        ));
    }
}

/// The value of `name=value` in a log line.
fn field<'l>(line: &'l str, name: &str) -> Option<&'l str> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(name)?.strip_prefix('='))
}

async fn sql(w: &World, sql: &str) {
    w.client()
        .await
        .batch_execute(sql)
        .await
        .unwrap_or_else(|e| match e.as_db_error() {
            Some(db) => panic!("{sql}: {}: {}", db.code().code(), db.message()),
            None => panic!("{sql}: {e}"),
        });
}

/// Waits for walbox to stop by itself; checks it said `needle`.
async fn expect_stop(w: &mut World, o: &mut Outcome, needle: &str) {
    let code = w.wait_exit(Duration::from_secs(30)).await;
    o.check(
        code == Some(1),
        format!("walbox did not stop with exit 1 (got {code:?})"),
    );
    let log = w.log();
    let last = log
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or_default();
    o.check(
        last.contains(needle),
        format!("the last line does not say {needle:?}: {last}"),
    );
    o.notes.push(format!("walbox stopped: {}", last.trim()));
    let client = w.client().await;
    let now = walbox_test_harness::slot::confirmed_flush_lsn(&client, crate::world::SLOT).await;
    // (The scenarios that stop walbox by itself run one process, on SLOT.)
    let seen = w.samples.lock().unwrap().max_confirmed;
    o.confirmed_at_stop = Some(now.unwrap_or(seen).max(seen));
}

async fn fault(kind: Kind, scale: &Scale, w: &mut World, o: &mut Outcome) {
    match kind {
        // Run by [`idle_outbox`], without the load.
        Kind::IdleOutbox => unreachable!("the idle outbox has its own run"),
        Kind::Kill9 | Kind::ShardsNullIds => {
            for _ in 0..scale.kills {
                tokio::time::sleep(Duration::from_secs(2)).await;
                w.kill9();
                w.start_walbox();
            }
            o.notes.push(format!("{} kills", scale.kills));
        }
        Kind::SigtermMidTx => {
            tokio::time::sleep(Duration::from_secs(2)).await;
            let t0 = Instant::now();
            w.signal("TERM");
            let code = w.wait_exit(Duration::from_secs(30)).await;
            o.check(code == Some(0), format!("SIGTERM: exit {code:?}"));
            o.notes
                .push(format!("exited {:.1?} after SIGTERM", t0.elapsed()));
            o.duplicates_forbidden = true;
            w.start_walbox();
        }
        Kind::SecondSigterm => {
            tokio::time::sleep(Duration::from_secs(2)).await;
            // The broker stops answering so the drain would wait its full bound.
            if let Broker::Mock(k) = &w.broker {
                k.mock_cluster().unwrap().broker_down(1).unwrap();
            }
            w.signal("TERM");
            tokio::time::sleep(Duration::from_millis(50)).await;
            let t0 = Instant::now();
            w.signal("TERM");
            let code = w.wait_exit(Duration::from_secs(30)).await;
            let took = t0.elapsed();
            o.check(code == Some(0), format!("second SIGTERM: exit {code:?}"));
            o.check(
                took < Duration::from_secs(3),
                format!("exit took {took:?} after the second SIGTERM"),
            );
            o.notes.push(format!(
                "exited {took:.1?} after the second SIGTERM with the broker down"
            ));
            if let Broker::Mock(k) = &w.broker {
                k.mock_cluster().unwrap().broker_up(1).unwrap();
            }
            w.start_walbox();
        }
        Kind::BrokerDown => {
            let Broker::Mock(k) = &w.broker else {
                unreachable!()
            };
            let mock = k.mock_cluster().unwrap();
            mock.broker_down(1).unwrap();
            tokio::time::sleep(scale.fault).await;
            mock.broker_up(1).unwrap();
            o.check(w.running(), "walbox exited during the outage");
            o.notes.push(format!("{:?} outage", scale.fault));
        }
        Kind::BrokerKill9 => {
            let cluster = w.broker.cluster();
            tokio::task::block_in_place(|| cluster.kill9(0));
            tokio::time::sleep(Duration::from_secs(3)).await;
            let cluster = w.broker.cluster();
            tokio::task::block_in_place(|| cluster.restart(0));
            o.check(w.running(), "walbox exited while the broker was down");
        }
        Kind::BrokerBlackhole => {
            w.broker.cluster().pause(0);
            tokio::time::sleep(scale.fault).await;
            w.broker.cluster().resume(0);
            o.check(w.running(), "walbox exited during the black hole");
            o.notes.push(format!("{:?} black hole", scale.fault));
        }
        Kind::LeaderKill9 => {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let i = w.leader_of_partition_0();
            let cluster = w.broker.cluster();
            tokio::task::block_in_place(|| cluster.kill9(i));
            tokio::time::sleep(scale.fault).await;
            let cluster = w.broker.cluster();
            tokio::task::block_in_place(|| cluster.restart(i));
            o.check(w.running(), "walbox exited while a broker was down");
            o.notes.push(format!(
                "broker {} (leader of partition 0) down {:?}",
                i + 1,
                scale.fault
            ));
        }
        Kind::LeaderBlackhole => {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let i = w.leader_of_partition_0();
            w.broker.cluster().pause(i);
            tokio::time::sleep(scale.fault).await;
            w.broker.cluster().resume(i);
            o.check(w.running(), "walbox exited while a broker was frozen");
            o.notes.push(format!(
                "broker {} (leader of partition 0) frozen {:?}",
                i + 1,
                scale.fault
            ));
        }
        Kind::RollingRestart => {
            for i in 0..3 {
                tokio::time::sleep(Duration::from_secs(1)).await;
                let cluster = w.broker.cluster();
                tokio::task::block_in_place(|| {
                    cluster.stop(i);
                    cluster.restart(i);
                });
            }
            o.check(w.running(), "walbox exited during the rolling restart");
            o.notes
                .push("each of the three brokers stopped and started in turn".into());
        }
        Kind::RefusedTopic => {
            let refused = format!("{}-refused", w.topic);
            if let Broker::Mock(k) = &w.broker {
                k.mock_cluster()
                    .unwrap()
                    .topic_error(
                        &refused,
                        RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART,
                    )
                    .unwrap();
            }
            let client = w.client().await;
            for n in 10_000_000..10_000_010i64 {
                client
                    .batch_execute(&format!(
                        "INSERT INTO outbox_events (aggregate_type, aggregate_id, payload) \
                         VALUES ('{refused}', 'refused-{}', '{{\"n\": {n}}}')",
                        n % KEYS
                    ))
                    .await
                    .unwrap();
                let upper = walbox_test_harness::slot::current_wal_lsn(&client).await;
                o.extra.push((n, upper));
            }
            tokio::time::sleep(Duration::from_secs(3)).await;
            o.check(
                w.running(),
                "walbox stopped on a refused topic despite a dead-letter topic",
            );
        }
        Kind::PgFastRestart | Kind::PgCrash => {
            tokio::time::sleep(Duration::from_secs(2)).await;
            tokio::task::block_in_place(|| {
                if kind == Kind::PgCrash {
                    w.pg.stop_immediate();
                } else {
                    w.pg.stop();
                }
                w.pg.start().expect("restart Postgres");
            });
            tokio::time::sleep(Duration::from_secs(2)).await;
            o.check(w.running(), "walbox exited instead of reconnecting");
        }
        Kind::PgBlackhole => {
            // Longer than walbox's receive timeout (30 s): it must notice by
            // itself, not wait for the network to come back.
            let hole = scale.fault.max(Duration::from_secs(40));
            w.pg_proxy.blackhole(true);
            tokio::time::sleep(hole).await;
            w.pg_proxy.blackhole(false);
            o.check(w.running(), "walbox exited during the black hole");
            o.check(
                w.log().contains("presumed dead"),
                "walbox did not notice the dead connection by itself",
            );
            o.notes.push(format!(
                "{hole:?} black hole, noticed by walbox's receive timeout"
            ));
        }
        Kind::DriftRecreate => {
            sql(
                w,
                "BEGIN; ALTER TABLE outbox_events RENAME TO outbox_old;
                    CREATE TABLE outbox_events (LIKE outbox_old INCLUDING ALL);
                    ALTER SEQUENCE outbox_events_seq_seq OWNED BY outbox_events.seq;
                    DROP TABLE outbox_old; COMMIT",
            )
            .await;
            expect_stop(w, o, "does not include table").await;
            sql(w, "ALTER PUBLICATION walbox_outbox ADD TABLE outbox_events").await;
            // The rows inserted into the new table before it joined the
            // publication are in the table, not in the stream: resync
            // --drift republishes them before walbox streams on.
            w.start_walbox_as("resync", &["--drift"], &[]);
            let code = w.wait_exit(Duration::from_secs(120)).await;
            o.check(
                code == Some(0),
                format!("walbox resync --drift: exit {code:?}"),
            );
            let log = w.log();
            let said = |needle: &str| {
                log.lines()
                    .rev()
                    .find(|l| l.contains(needle))
                    .map(str::trim)
            };
            match (
                said("republishing the outbox rows since the drift"),
                said("backfill published"),
            ) {
                (Some(copied), Some(_)) => o.notes.push(format!(
                    "walbox resync --drift republished {} rows",
                    field(copied, "rows").unwrap_or("?")
                )),
                _ => o.check(
                    false,
                    "walbox resync --drift did not say what it republished",
                ),
            }
            // The old table's rows went with it: the audit sees their
            // records as unknown, and counts duplicates among the new
            // table's rows only.
            o.table_replaced = true;
            w.start_walbox();
        }
        Kind::DriftUnpublish => {
            sql(
                w,
                "ALTER PUBLICATION walbox_outbox DROP TABLE outbox_events",
            )
            .await;
            let waiting = w
                .wait_log(
                    "waiting for the publication to cover",
                    Duration::from_secs(30),
                )
                .await;
            o.check(waiting, "walbox did not say it waits for the publication");
            tokio::time::sleep(Duration::from_secs(2)).await;
            o.check(w.running(), "walbox exited with on_drift = heal");
            sql(w, "ALTER PUBLICATION walbox_outbox ADD TABLE outbox_events").await;
            let healed = w
                .wait_log("publication drift healed", Duration::from_secs(60))
                .await;
            o.check(healed, "walbox did not heal the drift");
            if let Some(line) = w
                .log()
                .lines()
                .find(|l| l.contains("publication drift healed"))
            {
                o.notes.push(format!(
                    "walbox waited for the fix, then republished {} rows",
                    field(line, "republished").unwrap_or("?")
                ));
            }
        }
        Kind::DriftColumns => {
            tokio::time::sleep(Duration::from_secs(1)).await;
            sql(
                w,
                "ALTER TABLE outbox_events ADD COLUMN tenant text;
                    ALTER TABLE outbox_events DROP COLUMN event_type",
            )
            .await;
            tokio::time::sleep(Duration::from_secs(3)).await;
            o.check(w.running(), "walbox stopped on a compatible schema change");
        }
        Kind::DriftRename => {
            sql(w, "ALTER TABLE outbox_events RENAME TO outbox_renamed").await;
            expect_stop(w, o, "no longer exists").await;
            sql(w, "ALTER TABLE outbox_renamed RENAME TO outbox_events").await;
            w.start_walbox();
        }
        Kind::BigTxKilled => {
            let client = w.client().await;
            let from = 20_000_000i64;
            let to = from + scale.big_tx as i64;
            client
                .batch_execute(&format!(
                    "INSERT INTO outbox_events (aggregate_type, aggregate_id, payload)
                     SELECT '{}', 'big-' || (n % 1000), jsonb_build_object('n', n)
                       FROM generate_series({from}, {} ) AS n",
                    w.topic,
                    to - 1
                ))
                .await
                .unwrap();
            let upper = walbox_test_harness::slot::current_wal_lsn(&client).await;
            o.extra.extend((from..to).map(|n| (n, upper)));
            // Half-way: some of it is on the broker, the slot is not past it.
            tokio::time::sleep(Duration::from_millis(1500)).await;
            w.kill9();
            w.start_walbox();
            o.notes
                .push(format!("{} events in one transaction", scale.big_tx));
        }
        Kind::BigPayloads => {
            tokio::time::sleep(scale.fault).await;
        }
        Kind::PgRestoreSameTimeline => {
            // A disk snapshot, taken with Postgres stopped.
            tokio::task::block_in_place(|| {
                w.pg.stop();
                w.pg.snapshot("torture").expect("copy the data directory");
                w.pg.start().expect("start Postgres");
            });
            // Events delivered past the snapshot, then the restore: the
            // load's events committed since are gone with the database,
            // but were delivered; what it writes next lands at WAL
            // positions below them.
            tokio::time::sleep(Duration::from_secs(3)).await;
            tokio::task::block_in_place(|| {
                w.pg.stop();
                w.pg.restore("torture").expect("restore the data directory");
                w.pg.start().expect("start Postgres");
            });
            tokio::time::sleep(Duration::from_secs(3)).await;
            o.check(w.running(), "walbox exited instead of reconnecting");
            o.check(
                w.log().contains("restored on the same timeline"),
                "walbox did not see the WAL go back",
            );
            o.restored = true;
            o.notes.push("restored to a copy 3 s old while walbox ran; written: the rows the restored table holds (those committed after the copy went with it)".into());
        }
        Kind::HealKilled => {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let since: String = w
                .client()
                .await
                .query_one("SELECT (now() - interval '1 second')::text", &[])
                .await
                .expect("read the time")
                .get(0);
            w.signal("TERM");
            let code = w.wait_exit(Duration::from_secs(30)).await;
            o.check(code == Some(0), format!("SIGTERM: exit {code:?}"));
            let steps = [
                ("resync", "heal.recorded"),
                ("run", "backfill.slot_dropped"),
                ("run", "backfill.slot_created"),
                ("run", "backfill.copied"),
            ];
            for (subcommand, point) in steps {
                let args: &[&str] = if subcommand == "resync" {
                    &["--since", &since]
                } else {
                    &[]
                };
                w.start_walbox_as(subcommand, args, &[("WALBOX_TEST_PAUSE_AT", point)]);
                let paused = w
                    .wait_log(
                        &format!("paused at test point {point}"),
                        Duration::from_secs(60),
                    )
                    .await;
                o.check(paused, format!("walbox {subcommand} never reached {point}"));
                w.kill9();
            }
            w.start_walbox();
            o.notes.push(format!(
                "heal from {since} killed at {} steps, each resumed by walbox run",
                steps.len()
            ));
        }
    }
}

/// The results as a Markdown table.
pub(crate) fn table(rows: &[Row], quick: bool) -> String {
    let mut out = format!(
        "Run: `scripts/torture{}`, {}.\n\n\
         | scenario | fault | written | delivered | dead-lettered | missing | duplicates | key order violations | confirmed past an undelivered event | peak RSS | result |\n\
         |---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n",
        if quick { " --quick" } else { "" },
        std::env::var("WALBOX_TORTURE_MACHINE").unwrap_or_else(|_| "this machine".into())
    );
    for r in rows {
        match &r.tally {
            Some(t) => out.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.0} MiB | {}{} |\n",
                r.name,
                r.fault,
                t.written,
                t.delivered,
                t.dead_lettered,
                t.missing,
                t.duplicates,
                t.order_violations,
                t.confirmed_past,
                r.peak_rss_mib,
                if r.passed { "pass" } else { "**FAIL**" },
                if r.note.is_empty() {
                    String::new()
                } else {
                    format!(": {}", r.note.replace('|', "\\|"))
                }
            )),
            None => out.push_str(&format!(
                "| {} | {} | | | | | | | | | {} |\n",
                r.name, r.fault, r.note
            )),
        }
    }
    out
}

/// The outbox idle while another database of the same server is written
/// without pause for `scale.idle`: every 5 s the slot's unconfirmed WAL
/// (`pg_current_wal_lsn() - confirmed_flush_lsn`) and retained WAL
/// (`- restart_lsn`) are sampled, and how long the slot takes to pass the
/// current WAL position (what `walbox audit` waits for) is timed. The
/// slot must keep neither growing: the largest retained WAL stays under
/// 256 MiB however much is written, and each time to pass under 5 s.
async fn idle_outbox(s: &Scenario, scale: &Scale, walbox: &str) -> Row {
    const MIB: f64 = 1024.0 * 1024.0;
    let mut w = World::new(walbox, s.broker, 1, &[], 1).await;
    w.start_walbox();
    let admin = w.client().await;
    admin
        .batch_execute("INSERT INTO outbox_events (aggregate_type, aggregate_id, payload) SELECT 'idle', 'k' || i, '{}' FROM generate_series(1, 10) i")
        .await
        .expect("write ten events");
    admin
        .batch_execute("CREATE DATABASE busy")
        .await
        .expect("create another database");
    let busy_config = w.pg.config("busy");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let stop = Arc::clone(&stop);
        tokio::spawn(async move {
            let busy = walbox_test_harness::pg::connect(&busy_config)
                .await
                .expect("connect to the busy database");
            busy.batch_execute("CREATE TABLE t (id bigint, filler text)")
                .await
                .expect("create the busy table");
            let mut rounds = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                busy.batch_execute(
                    "INSERT INTO t SELECT i, repeat('x', 200) FROM generate_series(1, 2000) i; \
                     DELETE FROM t WHERE id % 2 = 0",
                )
                .await
                .expect("write to the busy database");
                rounds += 1;
            }
            rounds
        })
    };
    let started = Instant::now();
    let first = walbox_test_harness::slot::current_wal_lsn(&admin).await;
    let (mut max_unconfirmed, mut max_follow) = (0i64, Duration::ZERO);
    let mut retained: Vec<i64> = Vec::new();
    let mut failures = Vec::new();
    while started.elapsed() < scale.idle {
        tokio::time::sleep(Duration::from_secs(5)).await;
        let (unconfirmed, kept) = slot_wal(&admin).await;
        max_unconfirmed = max_unconfirmed.max(unconfirmed);
        retained.push(kept);
        if retained.len() % 6 == 0 {
            max_follow = max_follow.max(time_to_pass(&admin).await);
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let rounds = writer.await.unwrap_or(0);
    let written = walbox_test_harness::slot::current_wal_lsn(&admin)
        .await
        .bytes_since(first);
    // Once the other database is quiet, what the slot keeps falls back:
    // Postgres moves restart_lsn at its next running-transactions record
    // (every 15 s while WAL is written), past what walbox confirmed.
    let settle = Instant::now();
    let mut after = i64::MAX;
    while settle.elapsed() < Duration::from_secs(90) {
        tokio::time::sleep(Duration::from_secs(5)).await;
        after = slot_wal(&admin).await.1;
        if (after as f64) < 64.0 * MIB {
            break;
        }
    }
    if !w.running() {
        failures.push("walbox exited".to_owned());
    }
    w.signal("TERM");
    let code = w.wait_exit(Duration::from_secs(40)).await;
    if code != Some(0) {
        failures.push(format!("the final SIGTERM: exit {code:?}"));
    }
    let third = (retained.len() / 3).max(1);
    let max_of = |xs: &[i64]| xs.iter().copied().max().unwrap_or(0);
    let median_of = |xs: &[i64]| {
        let mut v = xs.to_vec();
        v.sort_unstable();
        v.get(v.len() / 2).copied().unwrap_or(0)
    };
    let (early, late) = (
        &retained[..third.min(retained.len())],
        &retained[retained.len().saturating_sub(third)..],
    );
    let mib = |b: i64| b as f64 / MIB;
    if max_unconfirmed as f64 > 16.0 * MIB {
        failures.push(format!(
            "the slot's unconfirmed WAL reached {:.1} MiB",
            mib(max_unconfirmed)
        ));
    }
    if max_follow > Duration::from_secs(5) {
        failures.push(format!(
            "the slot took {max_follow:?} to pass the WAL written"
        ));
    }
    if max_of(late) > max_of(early) + 128 * 1024 * 1024 {
        failures.push(format!(
            "the retained WAL grew: largest {:.0} MiB in the first third, {:.0} MiB in the last",
            mib(max_of(early)),
            mib(max_of(late))
        ));
    }
    if after as f64 >= 64.0 * MIB {
        failures.push(format!(
            "the slot still retained {:.0} MiB 90 s after the writes stopped",
            mib(after)
        ));
    }
    let note = format!(
        "{:.0} MiB of WAL written elsewhere in {:?} ({rounds} transactions); unconfirmed at most {:.1} MiB; retained (restart_lsn, Postgres' own decoding restart point) median {:.0} MiB, largest {:.0} MiB in the first third and {:.0} MiB in the last ({} samples), {:.1} MiB once the writes stopped; the slot passed the current WAL within {:.1} s at most",
        mib(written as i64),
        scale.idle,
        mib(max_unconfirmed),
        mib(median_of(&retained)),
        mib(max_of(early)),
        mib(max_of(late)),
        retained.len(),
        mib(after),
        max_follow.as_secs_f64()
    );
    let peak = w.samples.lock().unwrap().peak_rss_kib as f64 / 1024.0;
    let passed = failures.is_empty();
    Row {
        name: s.name,
        fault: s.fault,
        tally: None,
        peak_rss_mib: peak,
        passed,
        note: match passed {
            true => note,
            false => format!("FAILED: {}. {note}", failures.join("; ")),
        },
    }
}

/// The slot's unconfirmed and retained WAL, in bytes.
async fn slot_wal(admin: &tokio_postgres::Client) -> (i64, i64) {
    let row = admin
        .query_one(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::int8,
                    pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::int8
               FROM pg_replication_slots WHERE slot_name = 'walbox'",
            &[],
        )
        .await
        .expect("sample the slot");
    (row.get(0), row.get(1))
}

/// How long the slot takes to be confirmed past the current WAL position
/// (what `walbox audit` waits for); at most 30 s.
async fn time_to_pass(admin: &tokio_postgres::Client) -> Duration {
    let now = walbox_test_harness::slot::current_wal_lsn(admin).await;
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(30) {
        let confirmed = walbox_test_harness::slot::confirmed_flush_lsn(admin, crate::world::SLOT)
            .await
            .unwrap_or(Lsn::ZERO);
        if confirmed >= now {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    t0.elapsed()
}
