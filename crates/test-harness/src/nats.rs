//! A NATS server of the test's own: the NATS project's `nats-server` (Go,
//! `go install github.com/nats-io/nats-server/v2`; scripts/test installs
//! it), run as a plain process with JetStream on and its store in a
//! temporary directory. It can be killed (`kill -9`) and started again on
//! the same port and store: streams keep what they stored.
//!
//! `WALBOX_NATS_SERVER` names the binary (default: `nats-server` on the
//! PATH, else `~/.cache/walbox/go/bin/nats-server`).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running (or killed) server.
pub struct NatsServer {
    child: Option<Child>,
    dir: tempfile::TempDir,
    port: u16,
    args: Vec<String>,
}

fn binary() -> PathBuf {
    if let Some(b) = std::env::var_os("WALBOX_NATS_SERVER") {
        return b.into();
    }
    let cached =
        std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/walbox/go/bin/nats-server"));
    match cached {
        Some(c) if c.exists() => c,
        _ => "nats-server".into(),
    }
}

impl NatsServer {
    /// Starts a server with JetStream and waits until it takes connections.
    pub fn start() -> NatsServer {
        NatsServer::start_with(&["-js"])
    }

    /// Starts a server with `args` (`-js` for JetStream, `--user`,
    /// `--pass`, …) besides its address, port and store.
    pub fn start_with(args: &[&str]) -> NatsServer {
        let mut server = NatsServer {
            child: None,
            dir: tempfile::tempdir().expect("temp dir"),
            port: crate::port::free_port(),
            args: args.iter().map(|a| (*a).to_owned()).collect(),
        };
        server.boot();
        server
    }

    fn boot(&mut self) {
        let log = std::fs::File::create(self.dir.path().join("server.log")).expect("log file");
        let child = Command::new(binary())
            .args(&self.args)
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string(), "-sd"])
            .arg(self.dir.path().join("store"))
            .stdout(Stdio::from(log.try_clone().expect("log")))
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "start nats-server ({}): {e}; scripts/test installs it with go install",
                    binary().display()
                )
            });
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.log().contains("Server is ready") {
            assert!(
                Instant::now() < deadline,
                "nats-server did not start within 30 s: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The server's output so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
    }

    /// Its URL.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// `kill -9`: nothing flushed beyond what JetStream synced.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again, same port and store.
    pub fn restart(&mut self) {
        self.kill9();
        let _ = std::fs::remove_file(self.dir.path().join("server.log"));
        self.boot();
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill9();
    }
}
