//! The grants each command needs, as docs/operations.md lists them: a DBA
//! sets up the table, publication and slot; walbox runs as a role with
//! REPLICATION and nothing else.

use std::process::Command;

use walbox_test_harness::kafka::TestKafka;
use walbox_test_harness::pg::{conninfo, fresh_db, TestDb};

use crate::support::{expect_all, init, insert_events, spawn_run_with, stop, succeeded, wait_exit};

/// `walbox` connecting as `user` (no password: the test server trusts local TCP).
fn walbox_as(db: &TestDb, user: &str, args: &[&str]) -> Command {
    let mut config = db.config().clone();
    config.user(user);
    let mut c = Command::new(walbox_e2e::walbox_bin());
    c.args(args)
        .env(
            "WALBOX_PG_URL",
            format!("{} sslmode=disable", conninfo(&config)),
        )
        .env("WALBOX_LOG", "info");
    c
}

/// A role with LOGIN and REPLICATION, and nothing on the outbox.
async fn replication_only_role(db: &TestDb, dba: &tokio_postgres::Client) -> String {
    let relay = format!("relay_{}", db.name());
    dba.batch_execute(&format!(
        "CREATE ROLE {relay} LOGIN REPLICATION;
         REVOKE ALL ON outbox_events FROM PUBLIC"
    ))
    .await
    .unwrap();
    relay
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_needs_replication_and_nothing_else() {
    let db = fresh_db().await;
    // The DBA: the table (migrations), the publication and the slot.
    let dba = init(&db).await;
    let relay = replication_only_role(&db, &dba).await;
    // Not superuser, not the owner, and no SELECT on the outbox.
    let mut config = db.config().clone();
    config.user(&relay);
    let as_relay = walbox_test_harness::pg::connect(&config).await.unwrap();
    let denied = as_relay
        .simple_query("SELECT count(*) FROM outbox_events")
        .await
        .unwrap_err();
    assert_eq!(
        denied.code(),
        Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE),
        "{denied}"
    );
    let (superuser, owner): (bool, String) = {
        let row = dba
            .query_one(
                "SELECT r.rolsuper, pg_get_userbyid(c.relowner)::text
                   FROM pg_roles r, pg_class c
                  WHERE r.rolname = $1 AND c.oid = 'outbox_events'::regclass",
                &[&relay],
            )
            .await
            .unwrap();
        (row.get(0), row.get(1))
    };
    assert!(!superuser && owner != relay);

    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(2).await;
    let mut run = spawn_run_with(
        walbox_as(&db, &relay, &[]),
        &kafka,
        &["--mapping-topic-template", &topic],
    );
    insert_events(&dba, 0, 100, |k| 1 + k % 9, 10).await;
    expect_all(&kafka, &topic, 100).await;

    // `status` needs no more either.
    let status = walbox_as(&db, &relay, &["status"]).output().unwrap();
    succeeded(&status);
    assert!(String::from_utf8_lossy(&status.stdout).contains("active"));
    stop(&mut run).await;

    // `drop-slot` needs REPLICATION; dropping the publication too needs its
    // owner (the DBA), and says so.
    let out = walbox_as(&db, &relay, &["drop-slot", "--drop-publication"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("must be owner of publication"), "{text}");
    let out = walbox_as(&db, &relay, &["drop-slot"]).output().unwrap();
    succeeded(&out);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_the_server_refuses_replication_gets_one_line_with_the_grant() {
    let db = fresh_db().await;
    let dba = init(&db).await;
    let app = format!("app_{}", db.name());
    dba.batch_execute(&format!("CREATE ROLE {app} LOGIN"))
        .await
        .unwrap();
    let kafka = TestKafka::from_env();
    let mut run = spawn_run_with(walbox_as(&db, &app, &[]), &kafka, &[]);
    let (exit, log) = wait_exit(&mut run).await;
    assert!(!exit.success(), "{log}");
    let last = log.lines().last().unwrap_or_default();
    assert!(
        last.starts_with(&format!("walbox: role \"{app}\" may not use replication")),
        "{log}"
    );
    assert!(
        last.contains(&format!("ALTER ROLE \"{app}\" REPLICATION"))
            && last.contains(&format!("GRANT rds_replication TO \"{app}\"")),
        "{last}"
    );
}

/// A DBA switches over with a backfill (it needs `CREATE` for walbox's
/// bookkeeping schema); walbox then runs with REPLICATION only, reading
/// that the backfill is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_dbas_backfill_run_still_needs_replication_only() {
    let db = fresh_db().await;
    let dba = db.connect().await;
    walbox_test_harness::migrations::apply_migrations(&dba).await;
    insert_events(&dba, 0, 50, |_| 10, 10).await;
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(2).await;
    let mut backfill = Command::new(walbox_e2e::walbox_bin());
    backfill
        .args([
            "init-slot",
            "--backfill",
            "true",
            "--kafka-brokers",
            &kafka.bootstrap(),
        ])
        .args(["--mapping-topic-template", &topic])
        .env(
            "WALBOX_PG_URL",
            format!("{} sslmode=disable", conninfo(db.config())),
        );
    let out = backfill.output().unwrap();
    succeeded(&out);
    let relay = replication_only_role(&db, &dba).await;
    let mut run = spawn_run_with(
        walbox_as(&db, &relay, &[]),
        &kafka,
        &["--mapping-topic-template", &topic],
    );
    insert_events(&dba, 50, 100, |_| 10, 10).await;
    assert_eq!(expect_all(&kafka, &topic, 100).await, 0);
    let status = walbox_as(&db, &relay, &["status"]).output().unwrap();
    let shown = String::from_utf8_lossy(&status.stdout);
    assert!(
        shown.contains("backfill:            done: 50 events"),
        "{shown}"
    );
    stop(&mut run).await;
}

/// The outbox table's owner without `CREATE` on the database cannot create
/// the publication, and init-slot says what to grant. What a failed
/// init-slot made stays and a rerun finishes the rest: the publication
/// made, then the slot refused for want of REPLICATION, then made once
/// granted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn init_slot_says_what_the_owner_lacks_and_a_rerun_finishes() {
    let db = fresh_db().await;
    let dba = db.connect().await;
    walbox_test_harness::migrations::apply_migrations(&dba).await;
    let owner = format!("owner_{}", db.name());
    let database: String = dba
        .query_one("SELECT current_database()", &[])
        .await
        .unwrap()
        .get(0);
    dba.batch_execute(&format!(
        "CREATE ROLE {owner} LOGIN; ALTER TABLE outbox_events OWNER TO {owner}"
    ))
    .await
    .unwrap();
    let init_slot = || walbox_as(&db, &owner, &["init-slot"]).output().unwrap();

    let out = init_slot();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.contains("creating publication \"walbox_outbox\" was refused")
            && last.contains(&format!(
                "GRANT CREATE ON DATABASE \"{database}\" TO \"{owner}\""
            )),
        "{last}"
    );

    dba.batch_execute(&format!(
        "GRANT CREATE ON DATABASE \"{database}\" TO {owner}"
    ))
    .await
    .unwrap();
    let out = init_slot();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stdout}{stderr}");
    assert!(
        stdout.contains("publication \"walbox_outbox\": created"),
        "{stdout}"
    );
    assert!(stderr.contains("may not use replication"), "{stderr}");

    dba.batch_execute(&format!("ALTER ROLE {owner} REPLICATION"))
        .await
        .unwrap();
    let out = init_slot();
    let stdout = succeeded(&out);
    assert!(
        stdout.contains("publication \"walbox_outbox\": already present")
            && stdout.contains("slot \"walbox\": created"),
        "{stdout}"
    );
}
