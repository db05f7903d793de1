//! A running walbox process, as the end-to-end tests and the torture suite
//! start, signal, kill and watch it: its stderr goes to a log file that can
//! be read while it runs (one of its own, or one several processes append
//! to, such as the shards of one world).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// A walbox process and its log.
#[derive(Debug)]
pub struct WalboxProcess {
    child: Child,
    log: PathBuf,
    /// The directory of a log of its own.
    _dir: Option<tempfile::TempDir>,
}

impl WalboxProcess {
    /// Starts `command` (a walbox subcommand with its arguments), its
    /// stderr going to a log file of its own.
    pub fn spawn(command: Command) -> WalboxProcess {
        let dir = tempfile::tempdir().expect("a directory for walbox's log");
        let log = dir.path().join("walbox.log");
        let mut process = WalboxProcess::spawn_appending(command, &log);
        process._dir = Some(dir);
        process
    }

    /// Starts `command`, appending its stderr to `log`.
    pub fn spawn_appending(mut command: Command, log: &Path) -> WalboxProcess {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .expect("open walbox's log");
        let child = command
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .expect("start walbox");
        WalboxProcess {
            child,
            log: log.to_owned(),
            _dir: None,
        }
    }

    /// Its process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Where its log is.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// Sends `signal` (`TERM`, `INT`, `KILL`, `STOP`, …); false when it could
    /// not be sent (the process is gone).
    pub fn signal(&self, signal: &str) -> bool {
        Command::new("kill")
            .arg(format!("-{}", signal.trim_start_matches('-')))
            .arg(self.id().to_string())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// `kill -9`, and reaps it.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Its exit status, if it exited (reaping it).
    pub fn try_exit(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().expect("wait for walbox")
    }

    /// True while it runs.
    pub fn running(&mut self) -> bool {
        self.try_exit().is_none()
    }

    /// Waits for it to exit, however long that takes.
    pub fn wait(&mut self) -> ExitStatus {
        self.child.wait().expect("wait for walbox")
    }

    /// Waits up to `timeout` for it to exit; `None` if it still runs.
    pub async fn exit_within(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_exit() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits up to `timeout` for its log to have a line containing
    /// `needle`; returns that line.
    pub async fn wait_log(&self, needle: &str, timeout: Duration) -> Option<String> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(line) = self.log().lines().find(|l| l.contains(needle)) {
                return Some(line.to_owned());
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// A walbox still running when its handle goes (a test that failed before
/// stopping it) is killed, not left behind: `walbox run` waits for an
/// unreachable broker or Postgres for as long as it takes.
impl Drop for WalboxProcess {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            self.kill9();
        }
    }
}
