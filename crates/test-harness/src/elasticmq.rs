//! An SQS-API server of the test's own: ElasticMQ (jars from
//! `WALBOX_ELASTICMQ_LIBS`, resolved by `scripts/install-elasticmq`) on a
//! free local port, its queues in memory with SQS's FIFO semantics
//! (message groups, deduplication ids remembered five minutes, consumed
//! or not). It can be frozen ([`ElasticMq::freeze`], SIGSTOP) as an
//! unreachable service is: connections open, nothing answered, nothing
//! lost. It dies with the test process.
//!
//! Chosen over moto's server (which the claim-check tests use for S3):
//! moto took 49 s for 1,000 FIFO messages in batches of 10 here (7.7 s
//! for a standard queue; ElasticMQ under 1.1 s for either, on the same
//! loaded machine), and forgets a deduplication id once its message is
//! consumed (SQS and ElasticMQ remember it five minutes).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::apache_kafka::{java_bin, signal, supervise, Process};

/// A running server; killed when dropped.
pub struct ElasticMq {
    process: Process,
    dir: tempfile::TempDir,
    port: u16,
}

impl ElasticMq {
    /// Starts a server and waits until it answers (60 s at most).
    ///
    /// # Panics
    ///
    /// With one line when the jars are missing or it does not start (its
    /// log's last lines included).
    pub fn start() -> ElasticMq {
        let libs = std::env::var("WALBOX_ELASTICMQ_LIBS").unwrap_or_else(|_| {
            panic!("WALBOX_ELASTICMQ_LIBS is not set: run scripts/install-elasticmq (scripts/test does) and export the directory it prints")
        });
        let dir = tempfile::tempdir().expect("temp dir");
        let port = crate::port::free_port();
        let conf = dir.path().join("elasticmq.conf");
        std::fs::write(
            &conf,
            format!(
                "include classpath(\"application.conf\")\n\
                 node-address {{ protocol = http, host = 127.0.0.1, port = {port}, context-path = \"\" }}\n\
                 rest-sqs {{ enabled = true, bind-port = {port}, bind-hostname = \"127.0.0.1\", sqs-limits = strict }}\n\
                 rest-stats {{ enabled = false }}\n"
            ),
        )
        .expect("write elasticmq.conf");
        let log = std::fs::File::create(dir.path().join("elasticmq.log")).expect("log file");
        let mut c = std::process::Command::new(java_bin());
        c.arg("-Xmx1g")
            .arg("-XX:+UseSerialGC")
            .arg(format!("-Dconfig.file={}", conf.display()))
            .arg("-cp")
            .arg(format!("{libs}/*"))
            .arg("org.elasticmq.server.Main")
            .current_dir(dir.path())
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone().expect("log file"))
            .stderr(log);
        let server = ElasticMq {
            process: supervise(c),
            dir,
            port,
        };
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(60) {
            if server.log().contains("started in") {
                return server;
            }
            if server.process.exited.try_recv().is_ok() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let log = server.log();
        let tail: Vec<&str> = log.lines().rev().take(20).collect();
        panic!(
            "ElasticMQ did not start on port {port}; its log ends:\n{}",
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }

    /// `http://127.0.0.1:PORT`, the SQS endpoint.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Stops (true) or resumes (false) the server: frozen, it keeps its
    /// connections and queues and answers nothing.
    pub fn freeze(&self, on: bool) {
        signal(
            self.process.pid,
            if on { libc::SIGSTOP } else { libc::SIGCONT },
        );
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("elasticmq.log")
    }
}

impl Drop for ElasticMq {
    fn drop(&mut self) {
        signal(self.process.pid, libc::SIGKILL);
        let _ = self.process.exited.recv_timeout(Duration::from_secs(10));
    }
}
