//! A Tansu broker process, on SQLite storage (it survives `kill -9`) or in
//! memory, for tests that kill or cut off a real broker. The binary comes from
//! `WALBOX_TANSU_BIN` (scripts/test builds it once).

use crate::port::free_port;
use std::process::{Child, Command};

/// A running (or killed) Tansu broker.
pub struct Tansu {
    bin: String,
    dir: tempfile::TempDir,
    port: u16,
    advertised: u16,
    storage: &'static str,
    authentication: bool,
    child: Option<Child>,
}

/// Storage that survives `kill -9` (and is slow: seconds to fetch a large
/// partition from offset 0).
pub const SQLITE: &str = "sqlite://tansu.db";
/// Storage in memory: fast, gone with the process.
pub const MEMORY: &str = "memory://tansu/";

impl Tansu {
    /// The binary named by `WALBOX_TANSU_BIN`, if set.
    pub fn bin_from_env() -> Option<String> {
        std::env::var("WALBOX_TANSU_BIN")
            .ok()
            .filter(|b| !b.is_empty())
    }

    /// Starts a broker listening on a free port, advertising it.
    pub fn start(bin: &str) -> Tansu {
        let port = free_port();
        Self::start_advertising(bin, port, port)
    }

    /// Starts a broker on `port` that tells clients to connect to
    /// `advertised` (a proxy in front of it), on SQLite storage.
    pub fn start_advertising(bin: &str, port: u16, advertised: u16) -> Tansu {
        Self::start_with(bin, port, advertised, SQLITE)
    }

    /// Starts a broker on `port`, advertising `advertised`, with `storage`
    /// ([`SQLITE`] or [`MEMORY`]).
    pub fn start_with(bin: &str, port: u16, advertised: u16, storage: &'static str) -> Tansu {
        let mut t = Tansu {
            bin: bin.to_owned(),
            dir: tempfile::tempdir().expect("a temp dir"),
            port,
            advertised,
            storage,
            authentication: false,
            child: None,
        };
        t.up();
        t
    }

    /// Starts the process again (after [`Tansu::kill9`]), on the same data.
    pub fn up(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("tansu.log"))
            .expect("open the tansu log");
        self.child = Some(
            Command::new(&self.bin)
                .args(["broker", "--listener-url"])
                .arg(format!("tcp://127.0.0.1:{}", self.port))
                .arg("--advertised-listener-url")
                .arg(format!("tcp://127.0.0.1:{}", self.advertised))
                .args(["--storage-engine", self.storage])
                .args(self.authentication.then_some("--authentication"))
                .current_dir(self.dir.path())
                .stdout(log.try_clone().expect("clone the log handle"))
                .stderr(log)
                .spawn()
                .expect("start tansu"),
        );
    }

    /// From the next [`Tansu::up`] on, clients must authenticate with SASL
    /// SCRAM (users made with [`Tansu::create_scram_user`] before, on
    /// [`SQLITE`] storage so that they survive the restart).
    pub fn require_authentication(&mut self) {
        self.authentication = true;
    }

    /// Creates a SCRAM user (`mechanism` `scram256` or `scram512`) through
    /// the broker's own command line. Only works while authentication is off.
    pub fn create_scram_user(&self, name: &str, password: &str, mechanism: &str) {
        let out = Command::new(&self.bin)
            .args(["user", "create", "--broker"])
            .arg(format!("tcp://127.0.0.1:{}", self.port))
            .args(["--mechanism", mechanism, name, password])
            .output()
            .expect("run tansu user create");
        assert!(
            out.status.success(),
            "tansu user create {name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Kills the process with SIGKILL and reaps it.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The address clients bootstrap from (the advertised one).
    pub fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.advertised)
    }

    /// The broker's own port.
    pub fn port(&self) -> u16 {
        self.port
    }
}

impl Drop for Tansu {
    fn drop(&mut self) {
        self.kill9();
    }
}
