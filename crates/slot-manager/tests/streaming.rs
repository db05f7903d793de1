//! Streaming from a slot, confirming positions, and riding a server restart.

use std::time::{Duration, Instant};

use pgoutput_decoder::{
    Decoder, LogicalMessage, Lsn, PgTimestamp, RelationCache, ReplicationMessage,
    StandbyStatusUpdate,
};
use slot_manager::{
    connect_control, ensure_publication, ensure_slot, LogicalReplicationStream, PgConfig,
    ReplicationClient, ReplicationOptions, TableName,
};
use tokio_postgres::Client;
use walbox_test_harness::migrations::apply_migrations;
use walbox_test_harness::pg::{self, fresh_db, PgServer};
use walbox_test_harness::slot::{
    confirmed_flush_lsn, retained_wal_bytes, wait_retained_below, write_wal_elsewhere,
};
use walbox_test_harness::wait::wait_for;

use crate::pg_config;

/// What these tests confirm, reported by hand: deciding what may be
/// confirmed is the caller's job (walbox's `progress` module); slot-manager
/// only carries the status update.
struct Positions {
    received: Lsn,
    confirmed: Lsn,
    last_sent: Option<(Instant, Lsn)>,
}

impl Positions {
    const INTERVAL: Duration = Duration::from_secs(1);

    fn new(confirmed: Lsn) -> Self {
        Positions {
            received: confirmed,
            confirmed,
            last_sent: None,
        }
    }

    fn received(&mut self, lsn: Lsn) {
        self.received = self.received.max(lsn);
    }

    fn confirm(&mut self, lsn: Lsn) {
        self.confirmed = self.confirmed.max(lsn);
    }

    fn update(&self) -> StandbyStatusUpdate {
        StandbyStatusUpdate {
            write: self.received.max(self.confirmed),
            flush: self.confirmed,
            apply: self.confirmed,
            client_time: PgTimestamp::now(),
            reply_requested: false,
        }
    }

    fn next_due(&self) -> Instant {
        self.last_sent
            .map_or_else(Instant::now, |(t, _)| t + Self::INTERVAL)
    }

    /// An update if one is due: asked for, periodic, or the position moved.
    fn poll(&mut self, reply: bool) -> Option<StandbyStatusUpdate> {
        let now = Instant::now();
        let due = reply
            || self
                .last_sent
                .is_none_or(|(t, flush)| now >= t + Self::INTERVAL || self.confirmed > flush);
        due.then(|| {
            self.last_sent = Some((now, self.confirmed));
            self.update()
        })
    }
}

async fn init(client: &Client, config: &PgConfig, slot: &str) {
    let outbox = TableName::parse("outbox_events").unwrap();
    ensure_publication(
        &connect_control(config).await.unwrap(),
        "walbox_outbox",
        &outbox,
        None,
    )
    .await
    .unwrap();
    ensure_slot(client, slot, false).await.unwrap();
}

async fn start(config: &PgConfig, slot: &str) -> LogicalReplicationStream {
    ReplicationClient::connect(config)
        .await
        .unwrap()
        .start_logical_replication(slot, Lsn::ZERO, &ReplicationOptions::new("walbox_outbox"))
        .await
        .unwrap()
}

/// A transaction as the stream delivered it.
#[derive(Debug)]
struct Tx {
    aggregate_ids: Vec<String>,
    end_lsn: Lsn,
}

/// Reads until `n` transactions committed, answering keepalives with
/// `feedback` (which the caller controls) along the way.
async fn read_transactions(
    stream: &mut LogicalReplicationStream,
    feedback: &mut Positions,
    n: usize,
) -> Vec<Tx> {
    let mut decoder = Decoder::new(1).unwrap();
    let mut relations = RelationCache::new();
    let mut open: Option<(Lsn, Vec<String>)> = None;
    let mut done = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while done.len() < n {
        assert!(Instant::now() < deadline, "timed out; got {done:?}");
        let msg = tokio::time::timeout(Duration::from_secs(30), stream.next_message())
            .await
            .expect("a message within 30 s")
            .unwrap();
        match msg {
            ReplicationMessage::XLogData(x) => {
                feedback.received(x.wal_end());
                match decoder.decode(x.into_data()).unwrap() {
                    LogicalMessage::Begin(b) => {
                        assert!(open.is_none(), "nested Begin");
                        open = Some((b.final_lsn(), Vec::new()));
                    }
                    LogicalMessage::Relation(r) => relations.insert(r),
                    LogicalMessage::Insert(i) => {
                        let row = relations.resolve(i.relation_oid(), i.tuple()).unwrap();
                        open.as_mut()
                            .unwrap()
                            .1
                            .push(row.text("aggregate_id").unwrap().to_owned());
                    }
                    LogicalMessage::Commit(c) => {
                        let (final_lsn, aggregate_ids) = open.take().unwrap();
                        assert_eq!(c.commit_lsn(), final_lsn);
                        done.push(Tx {
                            aggregate_ids,
                            end_lsn: c.end_lsn(),
                        });
                    }
                    other => panic!("unexpected {other:?}"),
                }
            }
            ReplicationMessage::PrimaryKeepalive(k) => {
                feedback.received(k.wal_end());
                if let Some(update) = feedback.poll(k.reply_requested()) {
                    stream.send_standby_status_update(update).await.unwrap();
                }
            }
            _ => {}
        }
    }
    done
}

async fn insert(client: &Client, aggregate_ids: &[&str]) {
    let tx = aggregate_ids
        .iter()
        .map(|a| format!("INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', '{a}', 'E', '{{}}');"))
        .collect::<String>();
    client
        .batch_execute(&format!("BEGIN; {tx} COMMIT;"))
        .await
        .unwrap();
}

#[tokio::test]
async fn streams_committed_inserts_and_confirms_exactly_what_the_caller_confirms() {
    let db = fresh_db().await;
    let client = db.connect().await;
    apply_migrations(&client).await;
    let config = pg_config(&db);
    init(&client, &config, "walbox").await;
    let start_lsn = confirmed_flush_lsn(&client, "walbox").await.unwrap();

    let mut stream = start(&config, "walbox").await;
    let mut feedback = Positions::new(start_lsn);
    insert(&client, &["order-1", "order-2"]).await;
    client
        .batch_execute("BEGIN; INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', 'rolled-back', 'E', '{}'); ROLLBACK;")
        .await
        .unwrap();
    insert(&client, &["order-3"]).await;

    let txs = read_transactions(&mut stream, &mut feedback, 2).await;
    assert_eq!(txs[0].aggregate_ids, ["order-1", "order-2"]);
    assert_eq!(txs[1].aggregate_ids, ["order-3"]);

    // Status updates went out (keepalive replies), but nothing was confirmed.
    let update = feedback.update();
    stream.send_standby_status_update(update).await.unwrap();
    assert_eq!(
        confirmed_flush_lsn(&client, "walbox").await,
        Some(start_lsn)
    );

    // Confirm the first transaction: the slot moves to exactly its end.
    feedback.confirm(txs[0].end_lsn);
    stream
        .send_standby_status_update(feedback.update())
        .await
        .unwrap();
    let want = txs[0].end_lsn;
    wait_for(
        "confirmed_flush_lsn to reach the first commit",
        Duration::from_secs(10),
        || {
            let client = &client;
            async move {
                match confirmed_flush_lsn(client, "walbox").await {
                    Some(lsn) if lsn == want => Ok(()),
                    other => Err(format!("{other:?}")),
                }
            }
        },
    )
    .await;
    // More updates without a new confirmation leave it there.
    for _ in 0..3 {
        stream
            .send_standby_status_update(feedback.update())
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(300)).await; // give the walsender time to (wrongly) move it
    assert_eq!(confirmed_flush_lsn(&client, "walbox").await, Some(want));

    // A new session resumes after the confirmed transaction.
    drop(stream);
    wait_for("the slot to be released", Duration::from_secs(10), || {
        let client = &client;
        async move {
            let active: bool = client
                .query_one(
                    "SELECT active FROM pg_replication_slots WHERE slot_name = 'walbox'",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            if active {
                Err("active".into())
            } else {
                Ok(())
            }
        }
    })
    .await;
    let mut stream = start(&config, "walbox").await;
    let mut feedback = Positions::new(want);
    let again = read_transactions(&mut stream, &mut feedback, 1).await;
    assert_eq!(
        again[0].aggregate_ids,
        ["order-3"],
        "resumes after the confirmed position"
    );
}

#[tokio::test]
async fn a_server_restart_mid_stream_is_a_transient_error() {
    let mut server = PgServer::start_default().unwrap();
    let admin = server.config("postgres");
    let client = pg::connect(&admin).await.unwrap();
    apply_migrations(&client).await;
    let config = PgConfig::parse(&format!("{} sslmode=disable", pg::conninfo(&admin))).unwrap();
    init(&client, &config, "walbox").await;
    let mut stream = start(&config, "walbox").await;
    insert(&client, &["before"]).await;
    let mut feedback = Positions::new(Lsn::ZERO);
    read_transactions(&mut stream, &mut feedback, 1).await;
    drop(client);

    // Stop the server (fast shutdown) while the stream keeps being read, as
    // the relay would: the walsender ends the session.
    let stopping = tokio::task::spawn_blocking(move || {
        server.stop();
        server
    });
    let e = loop {
        match tokio::time::timeout(Duration::from_secs(30), stream.next_message())
            .await
            .unwrap()
        {
            Ok(ReplicationMessage::PrimaryKeepalive(k)) if k.reply_requested() => {
                stream
                    .send_standby_status_update(feedback.update())
                    .await
                    .unwrap();
            }
            Ok(_) => continue,
            Err(e) => break e,
        }
    };
    assert!(e.is_transient(), "{e}");
    let mut server = stopping.await.unwrap();

    server.start().unwrap();
    let client = pg::connect(&admin).await.unwrap();
    insert(&client, &["after"]).await;
    let mut stream = start(&config, "walbox").await;
    let txs = read_transactions(&mut stream, &mut feedback, 2).await;
    // Nothing was confirmed: the restart re-sends "before", then "after".
    assert_eq!(txs[0].aggregate_ids, ["before"]);
    assert_eq!(txs[1].aggregate_ids, ["after"]);
}

/// Streams `slot` until `stop`, confirming each commit and, when
/// `advance_on_keepalive`, the `wal_end` of keepalives that arrive outside a
/// transaction — what keeps an idle slot from holding WAL.
async fn idle_consumer(
    config: PgConfig,
    slot: &'static str,
    advance_on_keepalive: bool,
    stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut stream = start(&config, slot).await;
    let mut decoder = Decoder::new(1).unwrap();
    let mut feedback = Positions::new(Lsn::ZERO);
    let mut in_transaction = false;
    loop {
        if *stop.borrow() {
            break;
        }
        let msg = tokio::select! {
            m = stream.next_message() => m.unwrap(),
            _ = tokio::time::sleep_until(feedback.next_due().into()) => {
                if let Some(u) = feedback.poll(false) {
                    stream.send_standby_status_update(u).await.unwrap();
                }
                continue;
            }
        };
        let mut reply = false;
        match msg {
            ReplicationMessage::XLogData(x) => {
                feedback.received(x.wal_end());
                match decoder.decode(x.into_data()).unwrap() {
                    LogicalMessage::Begin(_) => in_transaction = true,
                    LogicalMessage::Commit(c) => {
                        in_transaction = false;
                        feedback.confirm(c.end_lsn());
                    }
                    _ => {}
                }
            }
            ReplicationMessage::PrimaryKeepalive(k) => {
                feedback.received(k.wal_end());
                if advance_on_keepalive && !in_transaction {
                    feedback.confirm(k.wal_end());
                }
                reply = k.reply_requested();
            }
            _ => {}
        }
        if let Some(u) = feedback.poll(reply) {
            stream.send_standby_status_update(u).await.unwrap();
        }
    }
    stream.close().await;
}

#[tokio::test]
async fn an_idle_outbox_slot_releases_wal_when_keepalives_are_confirmed() {
    const MB: i64 = 1024 * 1024;
    let db = fresh_db().await;
    let client = db.connect().await;
    apply_migrations(&client).await;
    let config = pg_config(&db);
    init(&client, &config, "advancing").await;
    ensure_slot(&client, "holding", false).await.unwrap();

    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let advancing = tokio::spawn(idle_consumer(
        config.clone(),
        "advancing",
        true,
        stop.clone(),
    ));
    let holding = tokio::spawn(idle_consumer(config.clone(), "holding", false, stop));

    // 100 MB of WAL on a table outside the publication.
    let written = write_wal_elsewhere(&client, "busy", 100 * MB as u64).await;

    let started = Instant::now();
    let retained =
        wait_retained_below(&client, "advancing", 32 * MB, Duration::from_secs(30)).await;
    let holding_retained = retained_wal_bytes(&client, "holding").await.unwrap();
    eprintln!(
        "wrote {} MB; advancing slot retains {} MB after {:?}; holding slot retains {} MB",
        written / MB as u64,
        retained / MB,
        started.elapsed(),
        holding_retained / MB
    );
    // Before Postgres 15, pgoutput sends the other table's transactions as
    // empty Begin/Commit pairs, and confirming those moves even the holding
    // slot: the contrast only shows from 15 on.
    let version = walbox_test_harness::pg::server_version_num(&client).await;
    if version >= 150_000 {
        assert!(
            holding_retained > 100 * MB,
            "without keepalive advancement the slot holds the WAL"
        );
    }
    stop_tx.send(true).unwrap();
    insert(&client, &["wake"]).await; // wake the consumers so they see `stop`
    let _ = tokio::time::timeout(Duration::from_secs(15), advancing).await;
    let _ = tokio::time::timeout(Duration::from_secs(15), holding).await;
}

/// The replication grammar has no `E''` strings: a publication name with a
/// backslash (and a quote) must still reach START_REPLICATION intact.
#[tokio::test]
async fn a_publication_name_with_a_backslash_and_a_quote_streams() {
    let db = fresh_db().await;
    let client = db.connect().await;
    apply_migrations(&client).await;
    let config = pg_config(&db);
    let publication = r"it's a \ pub";
    ensure_publication(
        &connect_control(&config).await.unwrap(),
        publication,
        &TableName::parse("outbox_events").unwrap(),
        None,
    )
    .await
    .unwrap();
    ensure_slot(&client, "odd_names", false).await.unwrap();
    let mut stream = ReplicationClient::connect(&config)
        .await
        .unwrap()
        .start_logical_replication(
            "odd_names",
            Lsn::ZERO,
            &ReplicationOptions::new(publication),
        )
        .await
        .unwrap_or_else(|e| panic!("START_REPLICATION with publication {publication:?}: {e}"));
    insert(&client, &["a-1"]).await;
    let mut feedback = Positions::new(Lsn::ZERO);
    let txs = read_transactions(&mut stream, &mut feedback, 1).await;
    assert_eq!(txs[0].aggregate_ids, ["a-1"]);
}
