//! A failover slot (`walbox init-slot --failover`, Postgres 17+) on a real
//! primary/standby pair: after the primary dies and the standby is
//! promoted, walbox, pointed at both hosts, resumes from the synchronized
//! slot on the new primary and no event is lost. Runs where the test
//! Postgres is 17 or later (scripts/test's Postgres 17 pass).

use std::process::Command;
use std::time::Duration;

use walbox_test_harness::kafka::TestKafka;
use walbox_test_harness::migrations::apply_migrations;
use walbox_test_harness::pg::{connect, PgServer};
use walbox_test_harness::slot::{
    confirmed_flush_lsn, current_wal_lsn, wait_confirmed_at_least, write_wal_elsewhere,
};
use walbox_test_harness::wait::wait_for;

use crate::support::{expect_all, insert_events, spawn_run_with, stop, succeeded, wait_exit};

fn walbox_to(url: &str, args: &[&str]) -> Command {
    let mut c = Command::new(walbox_e2e::walbox_bin());
    c.args(args)
        .env("WALBOX_PG_URL", url)
        .env("WALBOX_LOG", "info");
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_slot_survives_promotion_of_the_standby() {
    let mut primary = PgServer::builder()
        .start()
        .unwrap_or_else(|e| panic!("{e}"));
    let admin = connect(&primary.config("postgres")).await.unwrap();
    let version = walbox_test_harness::pg::server_version_num(&admin).await;
    if version < 170_000 {
        eprintln!(
            "Postgres {version} has no failover slots: test not run (scripts/test runs it on 17)"
        );
        return;
    }
    // Logical decoding waits for the standby, so the synced slot is never
    // behind what walbox was sent (a setting of 17+, hence set here).
    for sql in [
        "ALTER SYSTEM SET synchronized_standby_slots = 'walbox_standby'",
        "SELECT pg_reload_conf()",
    ] {
        admin.batch_execute(sql).await.unwrap();
    }
    apply_migrations(&admin).await;
    let one = |port: u16| {
        format!("host=127.0.0.1 port={port} user=postgres dbname=postgres sslmode=disable")
    };
    let init = walbox_to(&one(primary.port()), &["init-slot", "--failover"])
        .output()
        .unwrap();
    succeeded(&init);

    let standby = PgServer::standby_of(&primary, "walbox_standby")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let on_standby = connect(&standby.config("postgres")).await.unwrap();
    let both = format!(
        "host=127.0.0.1,127.0.0.1 port={},{} user=postgres dbname=postgres sslmode=disable target_session_attrs=primary",
        primary.port(),
        standby.port()
    );
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(2).await;
    // walbox doctor on the pair: the failover slot is not synchronized to
    // the standby yet (a promotion now would lose it).
    let doctor = || {
        let out = walbox_to(
            &one(primary.port()),
            &["doctor", "--json", "--kafka-brokers", &kafka.bootstrap()],
        )
        .args(["--mapping-topic-template", &topic])
        .args(["--standby-url", &one(standby.port())])
        .output()
        .unwrap();
        let (checks, stdout) = crate::support::doctor_checks(&out, "postgres.");
        let verdict = |check: &str| crate::support::verdicts_of(&checks, check);
        (
            verdict("postgres.failover"),
            verdict("postgres.standby"),
            stdout,
        )
    };
    let (failover, before_sync, stdout) = tokio::task::block_in_place(doctor);
    assert_eq!(failover, ["pass"], "{stdout}");
    assert_eq!(before_sync, ["fail"], "{stdout}");
    let mut relay = spawn_run_with(
        walbox_to(&both, &[]),
        &kafka,
        &["--mapping-topic-template", &topic],
    );
    insert_events(&admin, 0, 200, |k| 1 + k % 7, 10).await;
    expect_all(&kafka, &topic, 200).await;
    // A synced slot stays temporary until the primary's slot has moved past
    // where the standby began: walbox's confirmations just did that.
    wait_for("the standby to sync the failover slot", Duration::from_secs(90), || {
        let c = &on_standby;
        async move {
            let row = c
                .query_opt(
                    "SELECT synced AND NOT temporary FROM pg_replication_slots WHERE slot_name = 'walbox'",
                    &[],
                )
                .await
                .map_err(|e| e.to_string())?;
            match row.map(|r| r.get::<_, bool>(0)) {
                Some(true) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        }
    })
    .await;
    let (_, synced, stdout) = tokio::task::block_in_place(doctor);
    assert_eq!(synced, ["pass"], "{stdout}");

    // The primary dies; the standby is promoted; the application goes on there.
    tokio::task::block_in_place(|| primary.stop_immediate());
    on_standby
        .execute("SELECT pg_promote(true, 60)", &[])
        .await
        .unwrap();
    insert_events(&on_standby, 200, 400, |k| 1 + k % 7, 10).await;
    let duplicates = expect_all(&kafka, &topic, 400).await;
    eprintln!("after promotion: all 400 events, {duplicates} duplicates");
    stop(&mut relay).await;
}

/// A synchronous standby is down: commits wait for it, invisible to every
/// snapshot, while logical decoding already follows them. An `ALTER
/// PUBLICATION … DROP TABLE` in that window hides the outbox from the
/// stream but not yet from the catalog. walbox sees the change committed
/// and not visible, confirms nothing past the readings before it, however
/// far the WAL moves on; once the standby is back the change is visible and
/// walbox stops with the slot before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_held_by_a_stopped_synchronous_standby_is_never_confirmed_past() {
    let primary = PgServer::builder()
        .start()
        .unwrap_or_else(|e| panic!("{e}"));
    let admin = connect(&primary.config("postgres")).await.unwrap();
    let version = walbox_test_harness::pg::server_version_num(&admin).await;
    if version < 150_000 {
        eprintln!("the harness makes standbys on Postgres 15 and later: test not run on {version}");
        return;
    }
    apply_migrations(&admin).await;
    let url = format!(
        "host=127.0.0.1 port={} user=postgres dbname=postgres sslmode=disable",
        primary.port()
    );
    succeeded(&walbox_to(&url, &["init-slot"]).output().unwrap());
    let mut standby = PgServer::standby_of(&primary, "walbox_standby")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    for sql in [
        "ALTER SYSTEM SET synchronous_standby_names = 'walbox_standby'",
        "SELECT pg_reload_conf()",
    ] {
        admin.batch_execute(sql).await.unwrap();
    }
    wait_one(
        &admin,
        "the standby to be synchronous",
        "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'",
    )
    .await;
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(1).await;
    let mut relay = spawn_run_with(
        walbox_to(&url, &[]),
        &kafka,
        &["--mapping-topic-template", &topic],
    );
    insert_events(&admin, 0, 20, |_| 5, 2).await;
    let head = current_wal_lsn(&admin).await;
    wait_confirmed_at_least(&admin, "walbox", head, Duration::from_secs(30)).await;
    assert_eq!(expect_all(&kafka, &topic, 20).await, 0);

    // The standby stops; the DDL commits in the WAL and waits for it.
    standby = tokio::task::spawn_blocking(move || {
        standby.stop();
        standby
    })
    .await
    .unwrap();
    let ddl = connect(&primary.config("postgres")).await.unwrap();
    let held = tokio::spawn(async move {
        let _ = ddl
            .batch_execute("ALTER PUBLICATION walbox_outbox DROP TABLE outbox_events")
            .await;
    });
    wait_one(
        &admin,
        "the ALTER to wait for the standby",
        "SELECT count(*) FROM pg_stat_activity
          WHERE wait_event = 'SyncRep' AND query LIKE 'ALTER PUBLICATION%'",
    )
    .await;
    let after_ddl = current_wal_lsn(&admin).await;
    // The application writes on, not waiting for the standby; WAL moves.
    let app = connect(&primary.config("postgres")).await.unwrap();
    app.batch_execute("SET synchronous_commit = local")
        .await
        .unwrap();
    insert_events(&app, 20, 40, |_| 5, 2).await;
    write_wal_elsewhere(&app, "elsewhere", 1 << 20).await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    let confirmed = confirmed_flush_lsn(&admin, "walbox").await.unwrap();
    assert!(
        confirmed < after_ddl,
        "the slot ({confirmed}) stayed before the held change (committed before {after_ddl})\n{}",
        relay.log()
    );
    assert!(relay.running(), "{}", relay.log());

    // The standby is back: the change becomes visible, walbox stops at it.
    standby = tokio::task::spawn_blocking(move || {
        standby.start().unwrap();
        standby
    })
    .await
    .unwrap();
    held.await.unwrap();
    let (status, log) = wait_exit(&mut relay).await;
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(log.contains("does not include table"), "{log}");
    let confirmed = confirmed_flush_lsn(&admin, "walbox").await.unwrap();
    assert!(confirmed < after_ddl, "{confirmed} < {after_ddl}");
    drop(standby);
}

/// Waits until `count_sql` (a `SELECT count(*)`) counts 1.
async fn wait_one(client: &tokio_postgres::Client, what: &str, count_sql: &str) {
    wait_for(what, Duration::from_secs(30), || async move {
        let n: i64 = client
            .query_one(count_sql, &[])
            .await
            .map_err(|e| e.to_string())?
            .get(0);
        if n == 1 {
            Ok(())
        } else {
            Err(format!("{n}"))
        }
    })
    .await;
}
