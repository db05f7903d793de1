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
use walbox_test_harness::wait::wait_for;

use crate::support::{expect_all, insert_events, spawn_run_with, stop, succeeded};

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
