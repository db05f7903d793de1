//! Postgres for tests: a private server started from local binaries, or the
//! server named by `WALBOX_TEST_PG_URL`, and a fresh database per test.
//!
//! # Lifetime of a private server
//!
//! The `postgres` process is spawned from a supervisor thread that lives as long
//! as the server and waits on it. The child asks the kernel for a parent-death
//! signal (`PR_SET_PDEATHSIG` = `SIGQUIT`, Postgres' immediate shutdown), so
//! whatever ends the test process — a normal exit, a panic, `kill -9` — also
//! ends the server: no orphan `postgres` processes. [`PgServer`]'s `Drop` and,
//! for the process-wide [`shared`] server, an `atexit` hook stop it cleanly and
//! remove its directory.
//!
//! `initdb` runs once per binary version and user into a template directory
//! under the system temp dir; each server copies it, which is much faster than
//! a fresh `initdb` in every test process.
//!
//! The parts: `template.rs` (finding the binaries, the `initdb` template),
//! `server.rs` (a private server's process), `shared.rs` (the process-wide
//! server, private or `WALBOX_TEST_PG_URL`'s) and `database.rs` (a fresh
//! database per test); this module holds the connection helpers.

mod database;
mod server;
mod shared;
mod template;

use std::fmt::Write as _;
use std::time::Duration;

use tokio_postgres::config::Host;
use tokio_postgres::{Client, Config, NoTls};

pub use database::{fresh_db, fresh_db_on, TestDb};
pub use server::{log_lines_matching, PgServer, PgServerBuilder};
pub use shared::{shared, try_shared, SharedPg};
pub use template::find_bin_dir;

/// Settings every private server gets: logical decoding, room for many slots,
/// a short `wal_sender_timeout` so a stuck client is noticed in tests, and no
/// fsync (a test server's data need not survive an OS crash).
pub const DEFAULT_SETTINGS: &[(&str, &str)] = &[
    ("listen_addresses", "127.0.0.1"),
    ("wal_level", "logical"),
    ("max_replication_slots", "20"),
    ("max_wal_senders", "20"),
    ("wal_sender_timeout", "10s"),
    ("max_connections", "100"),
    ("fsync", "off"),
    ("full_page_writes", "off"),
    ("max_prepared_transactions", "10"),
];

/// The superuser of private servers.
pub const SUPERUSER: &str = "postgres";

/// How long a server may take to accept connections or to stop.
const START_TIMEOUT: Duration = Duration::from_secs(60);
const STOP_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a configured server (`WALBOX_TEST_PG_URL`) may take to answer.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Builds a libpq keyword/value connection string (`host=… port=… …`) from
/// tokio-postgres settings; values are quoted, so any password works. Usable
/// by walbox, tokio-postgres, psql and pg_recvlogical alike.
pub fn conninfo(config: &Config) -> String {
    let mut out = String::new();
    let mut push = |key: &str, value: &str| {
        if !out.is_empty() {
            out.push(' ');
        }
        let escaped = value.replace('\\', "\\\\").replace('\'', "\\'");
        let _ = write!(out, "{key}='{escaped}'");
    };
    if let Some(host) = config.get_hosts().first() {
        match host {
            Host::Tcp(h) => push("host", h),
            Host::Unix(p) => push("host", &p.to_string_lossy()),
        }
    }
    if let Some(port) = config.get_ports().first() {
        push("port", &port.to_string());
    }
    if let Some(user) = config.get_user() {
        push("user", user);
    }
    if let Some(password) = config.get_password() {
        push("password", &String::from_utf8_lossy(password));
    }
    if let Some(dbname) = config.get_dbname() {
        push("dbname", dbname);
    }
    out
}

/// Describes a connection target without its password, for messages.
pub fn describe(config: &Config) -> String {
    let host = match config.get_hosts().first() {
        Some(Host::Tcp(h)) => h.clone(),
        Some(Host::Unix(p)) => p.display().to_string(),
        None => "localhost".into(),
    };
    format!(
        "host={host} port={} user={} dbname={}",
        config.get_ports().first().copied().unwrap_or(5432),
        config.get_user().unwrap_or("?"),
        config.get_dbname().unwrap_or("?"),
    )
}

/// The server's `server_version_num` (e.g. 170004), for tests whose
/// expectations depend on the Postgres version.
///
/// # Panics
///
/// When the query fails.
pub async fn server_version_num(client: &Client) -> i32 {
    client
        .query_one("SELECT current_setting('server_version_num')::int", &[])
        .await
        .expect("read server_version_num")
        .get(0)
}

/// Connects and spawns the connection task on the current tokio runtime.
pub async fn connect(config: &Config) -> Result<Client, tokio_postgres::Error> {
    let (client, connection) = config.connect(NoTls).await?;
    tokio::spawn(async move {
        // The error, if any, also fails the client's next query; nothing to add here.
        let _ = connection.await;
    });
    Ok(client)
}

/// Checks that a server can run walbox tests: it answers within 10 s, has
/// `wal_level=logical`, and the user may replicate. The error is one line that
/// says what to change. `source` names where the target came from.
pub async fn check_server(config: &Config, source: &str) -> Result<(), String> {
    let target = describe(config);
    let client = match tokio::time::timeout(CONNECT_TIMEOUT, connect(config)).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => {
            let cause = std::error::Error::source(&e)
                .map(|s| format!(": {s}"))
                .unwrap_or_default();
            return Err(format!(
                "{source} ({target}) did not accept a connection: {e}{cause}"
            ));
        }
        Err(_) => {
            return Err(format!(
                "{source} ({target}) did not answer within {CONNECT_TIMEOUT:?}"
            ))
        }
    };
    let row = client
        .query_one(
            "SELECT current_setting('wal_level'), \
                    (SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user), \
                    current_setting('max_replication_slots')::int",
            &[],
        )
        .await
        .map_err(|e| format!("{source} ({target}): query server settings: {e}"))?;
    let wal_level: String = row.get(0);
    let may_replicate: bool = row.get(1);
    let max_slots: i32 = row.get(2);
    if wal_level != "logical" {
        return Err(format!(
            "{source} ({target}) has wal_level={wal_level}; walbox tests need wal_level=logical \
             (set it in postgresql.conf and restart the server)"
        ));
    }
    if !may_replicate {
        return Err(format!(
            "{source} ({target}): the user may not replicate; grant it with ALTER ROLE … REPLICATION"
        ));
    }
    if max_slots < 10 {
        return Err(format!(
            "{source} ({target}) has max_replication_slots={max_slots}; walbox tests need at least 10"
        ));
    }
    Ok(())
}
