//! The process-wide server: a private one, or the one `WALBOX_TEST_PG_URL`
//! names.

use std::sync::OnceLock;

use super::{check_server, PgServer};
use tokio_postgres::Config;

enum SharedKind {
    /// `WALBOX_TEST_PG_URL`.
    External,
    /// A private server owned by this process.
    Private(PgServer),
    #[cfg(feature = "docker")]
    Docker(crate::docker::Containers),
}

/// The Postgres server this test process uses: see [`shared`].
pub struct SharedPg {
    admin: Config,
    kind: SharedKind,
}

impl SharedPg {
    /// Settings for the maintenance database (`postgres`, or the URL's own).
    pub fn admin_config(&self) -> &Config {
        &self.admin
    }

    /// True when the server is the one named by `WALBOX_TEST_PG_URL`, shared
    /// with other processes: tests that restart or reconfigure the server must
    /// start a private one instead.
    pub fn is_external(&self) -> bool {
        matches!(self.kind, SharedKind::External)
    }

    /// The Kafka bootstrap list of the Docker Kafka container, when
    /// `WALBOX_TEST_DOCKER=1` supplied the environment.
    pub fn docker_kafka(&self) -> Option<&str> {
        match &self.kind {
            #[cfg(feature = "docker")]
            SharedKind::Docker(c) => Some(&c.kafka_bootstrap),
            _ => None,
        }
    }

    /// The private server, when this process started one.
    pub fn private_server(&self) -> Option<&PgServer> {
        match &self.kind {
            SharedKind::Private(s) => Some(s),
            _ => None,
        }
    }
}

static SHARED: OnceLock<Result<SharedPg, String>> = OnceLock::new();

/// Stops the shared private server when the process exits normally (also
/// after a test panicked). A killed process is covered by the parent-death signal.
extern "C" fn stop_shared_at_exit() {
    if let Some(Ok(SharedPg {
        kind: SharedKind::Private(server),
        ..
    })) = SHARED.get()
    {
        server.stop_at_exit();
    }
}

fn init_shared() -> Result<SharedPg, String> {
    #[cfg(feature = "docker")]
    if std::env::var("WALBOX_TEST_DOCKER").is_ok_and(|v| v == "1") {
        let (containers, admin) = crate::docker::start()?;
        return Ok(SharedPg {
            admin,
            kind: SharedKind::Docker(containers),
        });
    }
    #[cfg(not(feature = "docker"))]
    if std::env::var("WALBOX_TEST_DOCKER").is_ok_and(|v| v == "1") {
        return Err(
            "WALBOX_TEST_DOCKER=1 needs the harness built with its `docker` feature \
                    (cargo test --features walbox-test-harness/docker)"
                .to_owned(),
        );
    }
    let (admin, kind, source) = match std::env::var("WALBOX_TEST_PG_URL")
        .ok()
        .filter(|u| !u.is_empty())
    {
        Some(url) => {
            let admin: Config = url
                .parse()
                .map_err(|e| format!("WALBOX_TEST_PG_URL is not a valid connection string: {e}"))?;
            (admin, SharedKind::External, "WALBOX_TEST_PG_URL")
        }
        None => {
            let server = PgServer::start_default()?;
            // SAFETY: registers a plain extern "C" fn with no captured state.
            unsafe { libc::atexit(stop_shared_at_exit) };
            (
                server.config("postgres"),
                SharedKind::Private(server),
                "the private test Postgres",
            )
        }
    };
    let check_config = admin.clone();
    // This runs from inside test runtimes, where blocking on another runtime
    // is not allowed: check from a thread with its own.
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?
            .block_on(check_server(&check_config, source))
    })
    .join()
    .map_err(|_| "the server check panicked".to_owned())??;
    Ok(SharedPg { admin, kind })
}

/// The Postgres server of this test process, started or checked on first use.
///
/// `WALBOX_TEST_PG_URL` names an existing server (shared by every test
/// process); otherwise a private one starts. Either way it is checked once:
/// reachable, `wal_level=logical`, a user that may replicate.
///
/// # Panics
///
/// With one line saying what is wrong when the server cannot be had.
pub fn shared() -> &'static SharedPg {
    match try_shared() {
        Ok(s) => s,
        Err(e) => panic!("{e}"),
    }
}

/// [`shared`], returning the one-line error instead of panicking.
pub fn try_shared() -> Result<&'static SharedPg, String> {
    SHARED
        .get_or_init(init_shared)
        .as_ref()
        .map_err(Clone::clone)
}
