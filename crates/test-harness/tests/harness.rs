//! The harness itself: broken environments fail fast with one line, servers
//! never outlive the test process, test databases are cleaned up.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use walbox_test_harness::pg::{self, check_server, fresh_db_on, PgServer};
use walbox_test_harness::wait::wait_for;

fn process_exists(pid: i32) -> bool {
    // A reaped process has no /proc entry; a zombie still shows "Z" state.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => false,
        Ok(stat) => !stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
    }
}

async fn wait_gone(pid: i32, what: &str) {
    wait_for(what, Duration::from_secs(20), || async move {
        if process_exists(pid) {
            Err(format!("postgres pid {pid} still runs"))
        } else {
            Ok(())
        }
    })
    .await;
}

#[tokio::test]
async fn a_server_that_refuses_fails_the_check_in_one_line() {
    // A port nobody listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let config: tokio_postgres::Config =
        format!("host=127.0.0.1 port={port} user=postgres password=s3cret dbname=postgres")
            .parse()
            .unwrap();
    let err = check_server(&config, "WALBOX_TEST_PG_URL")
        .await
        .unwrap_err();
    assert!(
        err.starts_with("WALBOX_TEST_PG_URL (host=127.0.0.1"),
        "{err}"
    );
    assert!(err.contains("did not accept a connection"), "{err}");
    assert!(!err.contains('\n'), "one line: {err}");
    assert!(!err.contains("s3cret"), "no password in errors: {err}");
}

#[tokio::test]
async fn a_server_that_never_answers_fails_the_check_instead_of_hanging() {
    // Accepts TCP connections (the kernel completes the handshake) but never speaks.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let config: tokio_postgres::Config =
        format!("host=127.0.0.1 port={port} user=postgres dbname=postgres")
            .parse()
            .unwrap();
    let started = Instant::now();
    let err = check_server(&config, "WALBOX_TEST_PG_URL")
        .await
        .unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "took {:?}",
        started.elapsed()
    );
    assert!(
        err.contains("did not answer within") || err.contains("did not accept"),
        "{err}"
    );
    assert!(!err.contains('\n'), "one line: {err}");
    drop(listener);
}

#[tokio::test]
async fn wal_level_replica_fails_the_check_with_what_to_change() {
    let server = PgServer::builder()
        .setting("wal_level", "replica")
        .start()
        .unwrap();
    let err = check_server(&server.config("postgres"), "the test Postgres")
        .await
        .unwrap_err();
    assert!(err.contains("wal_level=replica"), "{err}");
    assert!(err.contains("wal_level=logical"), "{err}");
    assert!(!err.contains('\n'), "one line: {err}");
}

#[tokio::test]
async fn a_bad_setting_fails_start_with_the_server_s_reason() {
    let err = PgServer::builder()
        .setting("wal_level", "bogus")
        .start()
        .unwrap_err();
    assert!(err.contains("did not start"), "{err}");
    assert!(err.contains("wal_level"), "{err}");
}

#[tokio::test]
async fn a_private_server_stops_when_dropped_and_can_restart() {
    let mut server = PgServer::start_default().unwrap();
    let pid = server.pid().expect("running");
    let data_dir = server.data_dir();
    let client = pg::connect(&server.config("postgres")).await.unwrap();
    client
        .batch_execute("CREATE TABLE kept (v int); INSERT INTO kept VALUES (7)")
        .await
        .unwrap();

    server.stop();
    assert!(server.pid().is_none());
    wait_gone(pid, "the stopped server to exit").await;
    server.start().unwrap();
    let client = pg::connect(&server.config("postgres")).await.unwrap();
    let v: i32 = client
        .query_one("SELECT v FROM kept", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(v, 7, "data survives a restart");

    let pid = server.pid().expect("running again");
    drop(server);
    wait_gone(pid, "the dropped server to exit").await;
    assert!(!data_dir.exists(), "the data directory is removed");
}

/// Starts `walbox-test-env postgres` and returns it with the server's pid.
fn start_holder() -> (std::process::Child, i32) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_walbox-test-env"))
        .arg("postgres")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let conninfo = lines.next().unwrap().unwrap();
    assert!(conninfo.contains("port="), "{conninfo}");
    let pid: i32 = lines
        .next()
        .unwrap()
        .unwrap()
        .strip_prefix("pid=")
        .unwrap()
        .parse()
        .unwrap();
    assert!(process_exists(pid));
    (child, pid)
}

#[tokio::test]
async fn no_orphan_postgres_after_the_owning_process_is_killed() {
    let (mut child, pid) = start_holder();
    // kill -9: no destructor and no atexit hook runs; the parent-death signal must.
    let holder_pid = child.id();
    child.kill().unwrap();
    child.wait().unwrap();
    wait_gone(pid, "postgres to die with its killed owner").await;

    // Its directory is swept by the next server start.
    let abandoned: Vec<_> = std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .flatten()
        .filter(|e| {
            std::fs::read_to_string(e.path().join("owner.pid"))
                .is_ok_and(|p| p.trim() == holder_pid.to_string())
        })
        .map(|e| e.path())
        .collect();
    assert_eq!(abandoned.len(), 1, "the killed holder's directory");
    let _next = PgServer::start_default().unwrap();
    assert!(!abandoned[0].exists(), "swept: {}", abandoned[0].display());
}

#[tokio::test]
async fn no_orphan_postgres_after_the_owner_exits() {
    let (mut child, pid) = start_holder();
    // SIGTERM: the holder drops the server and exits 0.
    let sent = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    assert!(child.wait().unwrap().success());
    wait_gone(pid, "postgres to stop with its owner").await;
}

/// Run only as a child of the next test: starts the shared server, prints its
/// pid, then panics.
#[tokio::test]
#[ignore = "helper: run by no_orphan_postgres_after_a_test_panics"]
async fn panicking_child() {
    if std::env::var("WALBOX_HARNESS_PANIC_CHILD").is_err() {
        return;
    }
    let shared = pg::shared();
    let pid = shared
        .private_server()
        .and_then(PgServer::pid)
        .expect("a private server");
    println!("shared-pid={pid}");
    panic!("deliberate panic with the shared server running");
}

#[tokio::test]
async fn no_orphan_postgres_after_a_test_panics() {
    if std::env::var("WALBOX_TEST_PG_URL").is_ok_and(|v| !v.is_empty()) {
        return; // the shared server is then not ours to stop
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "harness::panicking_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("WALBOX_HARNESS_PANIC_CHILD", "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "the child test panicked: {stdout}");
    // libtest prints the test's name on the same line as its output.
    let pid: i32 = stdout
        .split("shared-pid=")
        .nth(1)
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|digits| digits.parse().ok())
        .unwrap_or_else(|| panic!("child printed no pid: {stdout}"));
    wait_gone(pid, "the shared server to stop after the test panicked").await;
}

#[tokio::test]
async fn test_databases_on_an_external_server_are_dropped_with_their_slots() {
    let server = PgServer::start_default().unwrap();
    let admin = server.config("postgres");
    let db = fresh_db_on(&admin, true).await;
    let name = db.name().to_owned();
    let client = db.connect().await;
    client
        .batch_execute("SELECT pg_create_logical_replication_slot('leftover', 'pgoutput')")
        .await
        .unwrap();
    drop(client);
    drop(db);
    let admin_client = pg::connect(&admin).await.unwrap();
    let dbs: i64 = admin_client
        .query_one(
            "SELECT count(*) FROM pg_database WHERE datname = $1",
            &[&name],
        )
        .await
        .unwrap()
        .get(0);
    let slots: i64 = admin_client
        .query_one("SELECT count(*) FROM pg_replication_slots", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!((dbs, slots), (0, 0), "database and slot dropped");
}

#[tokio::test]
async fn conninfo_quotes_values_and_round_trips() {
    let mut config = tokio_postgres::Config::new();
    config
        .host("127.0.0.1")
        .port(5433)
        .user("o'brien")
        .password("p a\\ss'")
        .dbname("db");
    let text = pg::conninfo(&config);
    let back: tokio_postgres::Config = text.parse().unwrap();
    assert_eq!(back.get_user(), Some("o'brien"));
    assert_eq!(back.get_password(), Some(b"p a\\ss'".as_slice()));
    assert_eq!(back.get_ports(), &[5433]);
    assert!(
        !pg::describe(&config).contains("ss'"),
        "describe hides the password"
    );
}
