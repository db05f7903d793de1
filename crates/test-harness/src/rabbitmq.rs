//! A RabbitMQ broker of the test's own: Debian's `rabbitmq-server` run as a
//! plain process (no service manager) with its own node name, AMQP and
//! distribution ports, database, logs and Erlang cookie in a temporary
//! directory, the consistent-hash exchange plugin enabled offline. It can
//! be killed (`kill -9`) and started again on the same ports and database:
//! durable queues and persistent messages survive, as on a real restart.
//!
//! `WALBOX_RABBITMQ_BIN` names the directory of `rabbitmq-server`,
//! `rabbitmqctl` and `rabbitmq-plugins` (default `/usr/lib/rabbitmq/bin`,
//! the scripts that run as the calling user, not Debian's wrappers that
//! switch to the `rabbitmq` user).

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A running (or killed) broker.
pub struct RabbitMq {
    child: Option<Child>,
    dir: tempfile::TempDir,
    node: String,
    port: u16,
    dist_port: u16,
    tls_port: Option<u16>,
}

fn bin(name: &str) -> PathBuf {
    let dir =
        std::env::var("WALBOX_RABBITMQ_BIN").unwrap_or_else(|_| "/usr/lib/rabbitmq/bin".into());
    Path::new(&dir).join(name)
}

impl RabbitMq {
    /// Starts a broker and waits until it takes AMQP connections (60 s at most).
    pub fn start() -> RabbitMq {
        RabbitMq::start_with(None)
    }

    /// Starts a broker with a TLS listener besides the plain one: its
    /// certificate `certs.server_cert()`, and a client certificate signed by
    /// `certs.ca()` required (`verify_peer`, `fail_if_no_peer_cert`).
    pub fn start_with_tls(certs: &crate::tls::Certificates) -> RabbitMq {
        RabbitMq::start_with(Some(certs))
    }

    fn start_with(tls: Option<&crate::tls::Certificates>) -> RabbitMq {
        let dir = tempfile::tempdir().expect("temp dir");
        let node = format!(
            "{}@localhost",
            crate::unique_name("walbox").replace('_', "-")
        );
        let mut broker = RabbitMq {
            child: None,
            dir,
            node,
            port: crate::port::free_port(),
            dist_port: crate::port::free_port(),
            tls_port: tls.map(|_| crate::port::free_port()),
        };
        let mut conf = format!(
            "listeners.tcp.default = {}\nloopback_users = none\n",
            broker.port
        );
        if let (Some(certs), Some(port)) = (tls, broker.tls_port) {
            conf.push_str(&format!(
                "listeners.ssl.default = {port}\n\
                 ssl_options.cacertfile = {}\n\
                 ssl_options.certfile = {}\n\
                 ssl_options.keyfile = {}\n\
                 ssl_options.verify = verify_peer\n\
                 ssl_options.fail_if_no_peer_cert = true\n",
                certs.ca().display(),
                certs.server_cert().display(),
                certs.server_key().display(),
            ));
        }
        std::fs::write(broker.dir.path().join("rabbitmq.conf"), conf).expect("write rabbitmq.conf");
        let out = broker
            .command("rabbitmq-plugins")
            .args(["enable", "--offline", "rabbitmq_consistent_hash_exchange"])
            .output()
            .expect(
                "run rabbitmq-plugins (is rabbitmq-server installed? scripts/test installs it)",
            );
        assert!(
            out.status.success(),
            "rabbitmq-plugins: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        broker.boot();
        broker
    }

    /// A command of RabbitMQ's with this broker's environment.
    fn command(&self, name: &str) -> Command {
        let d = self.dir.path();
        let mut c = Command::new(bin(name));
        // The Erlang VM writes erl_crash.dump into its working directory
        // when it cannot start: the broker's own, not the caller's.
        c.current_dir(d)
            .env("HOME", d)
            .env("RABBITMQ_NODENAME", &self.node)
            .env("RABBITMQ_NODE_PORT", self.port.to_string())
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env("RABBITMQ_MNESIA_BASE", d.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", d.join("log"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", d.join("enabled_plugins"))
            .env("RABBITMQ_CONFIG_FILE", d.join("rabbitmq"))
            .env("RABBITMQ_PID_FILE", d.join("rabbitmq.pid"));
        c
    }

    fn boot(&mut self) {
        let log = std::fs::File::create(self.dir.path().join("server.out")).expect("log file");
        // A process group of its own: the script starts the Erlang VM as
        // its child (which names the node only in its environment), and a
        // kill must reach both.
        let child = self
            .command("rabbitmq-server")
            .process_group(0)
            .stdout(Stdio::from(log.try_clone().expect("log")))
            .stderr(Stdio::from(log))
            .spawn()
            .expect("start rabbitmq-server");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        let listening = |port: u16| std::net::TcpStream::connect(("127.0.0.1", port)).is_ok();
        while !listening(self.port) || self.tls_port.is_some_and(|p| !listening(p)) {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!("rabbitmq-server exited ({status}): {}", self.log());
            }
            assert!(
                Instant::now() < deadline,
                "RabbitMQ did not start within 60 s: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The server's output so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.out")).unwrap_or_default()
    }

    /// Its AMQP URL (user `guest`, allowed beyond loopback here).
    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2F", self.port)
    }

    /// Its AMQP port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Its AMQP-over-TLS port ([`RabbitMq::start_with_tls`]).
    pub fn tls_port(&self) -> u16 {
        self.tls_port.expect("a broker started with TLS")
    }

    /// Runs `rabbitmqctl` with `args` against it.
    pub fn ctl(&self, args: &[&str]) -> Output {
        self.command("rabbitmqctl")
            .args(["-n", &self.node])
            .args(args)
            .output()
            .expect("run rabbitmqctl")
    }

    /// Kills the broker (`kill -9` of its process group: the script, the
    /// Erlang VM and its helpers; epmd stays, it serves every node):
    /// nothing flushed, no goodbye to clients.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-s", "KILL", "--", &format!("-{}", child.id())])
                .status();
            let _ = child.wait();
            // Until its port is free (the VM may take a moment to go).
            let deadline = Instant::now() + Duration::from_secs(10);
            while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok()
                && Instant::now() < deadline
            {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    /// Starts it again, same ports and database.
    pub fn restart(&mut self) {
        self.kill9();
        self.boot();
    }
}

impl Drop for RabbitMq {
    fn drop(&mut self) {
        self.kill9();
    }
}
