//! Apache Kafka itself, in KRaft mode, as plain `java` processes: one
//! broker for most tests, three for the failover tests. The jars come from
//! `WALBOX_KAFKA_LIBS` (scripts/install-kafka resolves them once from Maven
//! Central). Each node is a combined controller and broker on two free
//! ports, with its own data directory; the harness owns start, graceful
//! stop, `kill -9`, restart and readiness (metadata that lists every
//! running broker, polled, never a fixed sleep).
//!
//! The processes die with the test: each is spawned by a supervisor thread
//! and gets a parent-death signal (SIGKILL) from it.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};

use crate::kafka::TestKafka;
use crate::port::free_port;

/// A cluster id (16 bytes, base64url): every test cluster may share it,
/// they never meet.
const CLUSTER_ID: &str = "d2FsYm94LXRlc3QtY2x1cw";
/// How long a node may take to join (a JVM start on a busy 2-core machine).
const START_TIMEOUT: Duration = Duration::from_secs(90);

/// The directory of Kafka's jars named by `WALBOX_KAFKA_LIBS`, if set.
pub fn libs_from_env() -> Option<String> {
    std::env::var("WALBOX_KAFKA_LIBS")
        .ok()
        .filter(|d| !d.is_empty() && Path::new(d).is_dir())
}

/// A running Apache Kafka cluster.
pub struct KafkaCluster {
    libs: String,
    dir: tempfile::TempDir,
    nodes: Vec<Node>,
    /// `name=value` lines added to every node's `server.properties`.
    extra: Vec<(String, String)>,
    /// A secured listener for clients beside the harness' own plaintext one.
    secured: Option<SecuredListener>,
    /// Classes of the test's own on the brokers' class path
    /// ([`KafkaCluster::start_msk_iam`]'s validator).
    classes: Option<PathBuf>,
}

/// A secured client listener ([`KafkaCluster::start_secured`]): TLS with the
/// harness' certificates, optionally requiring client certificates, and
/// optionally SASL (SCRAM-SHA-256, SCRAM-SHA-512 and PLAIN, each of
/// `users`), optionally with the standard authorizer (ACLs; the harness'
/// own plaintext listener, whose clients are `User:ANONYMOUS`, is a super
/// user, so topics and ACLs are made through it).
pub struct Secured<'a> {
    /// The server certificate and the CA clients trust.
    pub certs: &'a crate::tls::Certificates,
    /// Client certificates required (mutual TLS).
    pub client_auth: bool,
    /// SASL over TLS (`SASL_SSL`) instead of TLS alone (`SSL`).
    pub sasl: bool,
    /// `(user, password)` for SCRAM (both mechanisms) and PLAIN.
    pub users: &'a [(&'a str, &'a str)],
    /// ACLs enforced by `StandardAuthorizer`.
    pub authorizer: bool,
}

struct SecuredListener {
    port: u16,
    /// `SSL`, `SASL_SSL` or `SASL_PLAINTEXT`.
    protocol: &'static str,
    sasl: bool,
    users: Vec<(String, String)>,
    properties: Vec<(String, String)>,
}

struct Node {
    id: usize,
    role: Role,
    port: u16,
    controller_port: u16,
    process: Option<Process>,
}

impl Node {
    /// The one node of a single-node cluster.
    fn combined() -> Node {
        Node {
            id: 1,
            role: Role::Combined,
            port: free_port(),
            controller_port: free_port(),
            process: None,
        }
    }
}

/// What a node runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    /// A controller and a broker in one process.
    Combined,
    /// A broker only.
    Broker,
    /// A KRaft controller only (serves no clients).
    Controller,
}

/// A `java` process and the thread that waits for it.
pub(crate) struct Process {
    pub(crate) pid: u32,
    pub(crate) exited: mpsc::Receiver<()>,
}

impl KafkaCluster {
    /// Starts `nodes` nodes (1 or 3) with the jars of `WALBOX_KAFKA_LIBS`
    /// and waits until every broker serves metadata.
    ///
    /// # Panics
    ///
    /// With one line when the jars are missing or a node does not start
    /// (its log's last lines included).
    pub fn start(nodes: usize) -> KafkaCluster {
        Self::start_with(nodes, &[])
    }

    /// [`KafkaCluster::start`] with `extra` broker settings.
    pub fn start_with(nodes: usize, extra: &[(&str, &str)]) -> KafkaCluster {
        let roles = vec![Role::Combined; nodes];
        Self::start_roles(&roles, extra)
    }

    /// `brokers` brokers beside one dedicated KRaft controller (node id
    /// 100), which stays up whatever happens to the brokers: with two of
    /// three brokers down the cluster still moves leadership and shrinks
    /// in-sync replica sets, so producers meet `NOT_ENOUGH_REPLICAS`. Node
    /// `i` (0-based) is broker `i + 1`; the controller is the last node.
    pub fn start_brokers(brokers: usize, extra: &[(&str, &str)]) -> KafkaCluster {
        let mut roles = vec![Role::Broker; brokers];
        roles.push(Role::Controller);
        Self::start_roles(&roles, extra)
    }

    fn start_roles(roles: &[Role], extra: &[(&str, &str)]) -> KafkaCluster {
        let libs = libs_from_env().unwrap_or_else(|| {
            panic!("WALBOX_KAFKA_LIBS is not set to Kafka's jars: run scripts/install-kafka (scripts/test does)")
        });
        let mut cluster = KafkaCluster {
            libs,
            dir: tempfile::tempdir().expect("a temp dir"),
            nodes: roles
                .iter()
                .enumerate()
                .map(|(i, role)| Node {
                    id: if *role == Role::Controller {
                        100 + i
                    } else {
                        i + 1
                    },
                    role: *role,
                    port: free_port(),
                    controller_port: free_port(),
                    process: None,
                })
                .collect(),
            extra: extra
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            secured: None,
            classes: None,
        };
        cluster.format_and_start();
        cluster
    }

    /// One node with a listener that takes Amazon MSK's IAM authentication
    /// (`SASL_PLAINTEXT`, OAUTHBEARER) beside the harness' plaintext one;
    /// [`KafkaCluster::secured_bootstrap`] names it. Its validator
    /// (`java/MskIamValidator.java`, compiled here with `javac`) accepts a
    /// token only when it is a SigV4-presigned `kafka-cluster:Connect` URL
    /// for `region`, signed by one of `keys` (`(access key, secret key)`) or
    /// by credentials the STS stand-in whose state `sts_state` serves
    /// (moto's `/moto-api/data.json`) issued, within its time window. Each
    /// decision is a line of [`KafkaCluster::msk_iam_decisions`].
    pub fn start_msk_iam(
        region: &str,
        keys: &[(&str, &str)],
        sts_state: Option<&str>,
        extra: &[(&str, &str)],
    ) -> KafkaCluster {
        let libs = libs_from_env().unwrap_or_else(|| {
            panic!("WALBOX_KAFKA_LIBS is not set to Kafka's jars: run scripts/install-kafka (scripts/test does)")
        });
        let dir = tempfile::tempdir().expect("a temp dir");
        let classes = dir.path().join("classes");
        let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("java/MskIamValidator.java");
        let javac = java_bin().with_file_name("javac");
        let out = Command::new(&javac)
            .arg("-cp")
            .arg(format!("{libs}/*"))
            .arg("-d")
            .arg(&classes)
            .arg(&source)
            .output()
            .unwrap_or_else(|e| panic!("run {}: {e} (is a JDK 17+ installed?)", javac.display()));
        assert!(
            out.status.success(),
            "javac MskIamValidator.java: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let keys: Vec<String> = keys.iter().map(|(a, s)| format!("{a}:{s}")).collect();
        let mut jaas = format!(
            "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule required unsecuredLoginStringClaim_sub=\"broker\" region=\"{region}\" keys=\"{}\"",
            keys.join(",")
        );
        if let Some(state) = sts_state {
            jaas.push_str(&format!(" sts_state=\"{state}\""));
        }
        jaas.push(';');
        let listener = "listener.name.external";
        let properties = vec![
            (
                format!("{listener}.sasl.enabled.mechanisms"),
                "OAUTHBEARER".to_owned(),
            ),
            (format!("{listener}.oauthbearer.sasl.jaas.config"), jaas),
            (
                format!("{listener}.oauthbearer.sasl.server.callback.handler.class"),
                "MskIamValidator".to_owned(),
            ),
        ];
        let mut cluster = KafkaCluster {
            libs,
            dir,
            nodes: vec![Node::combined()],
            extra: extra
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            classes: Some(classes),
            secured: Some(SecuredListener {
                port: free_port(),
                protocol: "SASL_PLAINTEXT",
                sasl: true,
                users: Vec::new(),
                properties,
            }),
        };
        cluster.format_and_start();
        cluster
    }

    /// The MSK IAM validator's decisions so far
    /// ([`KafkaCluster::start_msk_iam`]), in order: `accepted AKID signed
    /// 20261125T120000Z` or `refused: reason`.
    pub fn msk_iam_decisions(&self) -> Vec<String> {
        let log = std::fs::read_to_string(self.node_dir(0).join("stdout.log")).unwrap_or_default();
        log.lines()
            .filter_map(|l| l.strip_prefix("msk-iam: "))
            .map(str::to_owned)
            .collect()
    }

    /// One node with a secured listener for clients ([`Secured`]) beside
    /// the harness' plaintext one; [`KafkaCluster::secured_bootstrap`] names it.
    pub fn start_secured(secured: Secured<'_>) -> KafkaCluster {
        let libs = libs_from_env().unwrap_or_else(|| {
            panic!("WALBOX_KAFKA_LIBS is not set to Kafka's jars: run scripts/install-kafka (scripts/test does)")
        });
        let dir = tempfile::tempdir().expect("a temp dir");
        let certs = secured.certs;
        // Kafka reads a PEM key store: the private key (PKCS#8) and its chain.
        let keystore = dir.path().join("server-keystore.pem");
        let mut pem = std::fs::read_to_string(certs.server_key()).expect("read the server key");
        pem.push_str(
            &std::fs::read_to_string(certs.server_cert()).expect("read the server certificate"),
        );
        std::fs::write(&keystore, pem).expect("write the key store");
        let listener = "listener.name.external";
        let mut properties = vec![
            (format!("{listener}.ssl.keystore.type"), "PEM".to_owned()),
            (
                format!("{listener}.ssl.keystore.location"),
                keystore.display().to_string(),
            ),
            (format!("{listener}.ssl.truststore.type"), "PEM".to_owned()),
            (
                format!("{listener}.ssl.truststore.location"),
                certs.ca().display().to_string(),
            ),
            (
                format!("{listener}.ssl.client.auth"),
                if secured.client_auth {
                    "required"
                } else {
                    "none"
                }
                .to_owned(),
            ),
        ];
        if secured.sasl {
            let plain_users: String = secured
                .users
                .iter()
                .map(|(u, p)| format!(" user_{u}=\"{p}\""))
                .collect();
            properties.extend([
                (
                    format!("{listener}.sasl.enabled.mechanisms"),
                    "SCRAM-SHA-256,SCRAM-SHA-512,PLAIN".to_owned(),
                ),
                (
                    format!("{listener}.scram-sha-256.sasl.jaas.config"),
                    "org.apache.kafka.common.security.scram.ScramLoginModule required;".to_owned(),
                ),
                (
                    format!("{listener}.scram-sha-512.sasl.jaas.config"),
                    "org.apache.kafka.common.security.scram.ScramLoginModule required;".to_owned(),
                ),
                (
                    format!("{listener}.plain.sasl.jaas.config"),
                    format!("org.apache.kafka.common.security.plain.PlainLoginModule required{plain_users};"),
                ),
            ]);
        }
        if secured.authorizer {
            properties.extend([
                (
                    "authorizer.class.name".to_owned(),
                    "org.apache.kafka.metadata.authorizer.StandardAuthorizer".to_owned(),
                ),
                ("super.users".to_owned(), "User:ANONYMOUS".to_owned()),
                (
                    "allow.everyone.if.no.acl.found".to_owned(),
                    "false".to_owned(),
                ),
            ]);
        }
        let mut cluster = KafkaCluster {
            libs,
            dir,
            nodes: vec![Node::combined()],
            extra: Vec::new(),
            classes: None,
            secured: Some(SecuredListener {
                port: free_port(),
                protocol: if secured.sasl { "SASL_SSL" } else { "SSL" },
                sasl: secured.sasl,
                users: secured
                    .users
                    .iter()
                    .map(|(u, p)| (u.to_string(), p.to_string()))
                    .collect(),
                properties,
            }),
        };
        cluster.format_and_start();
        cluster
    }

    /// The secured listener's address ([`KafkaCluster::start_secured`]).
    pub fn secured_bootstrap(&self) -> String {
        let s = self.secured.as_ref().expect("a secured cluster");
        format!("127.0.0.1:{}", s.port)
    }

    /// Allows `principal` (`User:name`) `operation` (`Write`, `Describe`,
    /// `IdempotentWrite`, …) on `resource` (`--topic T`, `--cluster`,
    /// `--transactional-id ID`, with its name) through Kafka's own ACL tool.
    pub fn allow(&self, principal: &str, operation: &str, resource: &[&str]) {
        let bootstrap = self.bootstrap();
        let mut args = vec![
            "--bootstrap-server",
            &bootstrap,
            "--add",
            "--allow-principal",
            principal,
            "--operation",
            operation,
        ];
        args.extend(resource);
        self.tool("org.apache.kafka.tools.AclCommand", &args, b"");
    }

    /// The storage tool's `--add-scram` arguments for the secured
    /// listener's users (SCRAM-SHA-256 and -512 each).
    fn scram_credentials(&self) -> Vec<String> {
        let Some(sec) = self.secured.as_ref().filter(|s| s.sasl) else {
            return Vec::new();
        };
        sec.users
            .iter()
            .flat_map(|(u, p)| {
                ["SCRAM-SHA-256", "SCRAM-SHA-512"].map(|m| {
                    [
                        "--add-scram".to_owned(),
                        format!("{m}=[name={u},password={p}]"),
                    ]
                })
            })
            .flatten()
            .collect()
    }

    /// Formats every node's storage (side by side: a JVM start each),
    /// starts them and waits until they serve.
    ///
    /// A node that cannot bind its port (another test's server took it
    /// between [`free_port`] and the bind: the suite runs many at once)
    /// makes the whole start again on new ports, twice at most.
    fn format_and_start(&mut self) {
        for attempt in 1..=3 {
            let started = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.format_and_start_once();
            }));
            match started {
                Ok(()) => return,
                Err(panic) if attempt < 3 && self.port_taken() => {
                    eprintln!("Apache Kafka: a port was taken by another process; starting again on other ports");
                    let _ = panic;
                    for i in 0..self.nodes.len() {
                        self.kill9(i);
                        let _ = std::fs::remove_dir_all(self.node_dir(i));
                        self.nodes[i].port = free_port();
                        self.nodes[i].controller_port = free_port();
                    }
                    if let Some(s) = &mut self.secured {
                        s.port = free_port();
                    }
                }
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
    }

    /// Whether a node's log says it could not bind its port.
    fn port_taken(&self) -> bool {
        (0..self.nodes.len()).any(|i| self.log_tail(i, 200).contains("Address already in use"))
    }

    fn format_and_start_once(&mut self) {
        let nodes = self.nodes.len();
        let cluster = self;
        let formats: Vec<_> = (0..nodes).map(|i| cluster.format(i)).collect();
        for (i, f) in formats.into_iter().enumerate() {
            let out = f.wait_with_output().expect("wait for Kafka's storage tool");
            assert!(
                out.status.success(),
                "kafka.tools.StorageTool format (node {}): {}{}",
                i + 1,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        for i in 0..nodes {
            cluster.spawn(i);
        }
        cluster.wait_ready();
    }

    /// The bootstrap list (every broker's port).
    pub fn bootstrap(&self) -> String {
        self.nodes
            .iter()
            .filter(|n| n.role != Role::Controller)
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// This cluster as the harness' broker (topics, consumers).
    pub fn kafka(&self) -> TestKafka {
        TestKafka::External {
            bootstrap: self.bootstrap(),
        }
    }

    /// How many nodes the cluster has (running or not).
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether the cluster has no nodes (never: it starts with one or more).
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Node `i`'s broker id (`node.id`).
    pub fn node_id(&self, i: usize) -> i32 {
        self.nodes[i].id as i32
    }

    /// The index of the node whose `node.id` is `id`.
    pub fn index_of(&self, id: i32) -> usize {
        self.nodes
            .iter()
            .position(|n| n.id as i32 == id)
            .unwrap_or_else(|| panic!("no node with id {id}"))
    }

    /// Kills node `i` with SIGKILL and reaps it.
    pub fn kill9(&mut self, i: usize) {
        if let Some(p) = self.nodes[i].process.take() {
            signal(p.pid, libc::SIGKILL);
            let _ = p.exited.recv();
        }
    }

    /// Stops node `i` with SIGTERM (a controlled shutdown: leadership moves
    /// first) and waits for it to exit.
    pub fn stop(&mut self, i: usize) {
        if let Some(p) = self.nodes[i].process.take() {
            signal(p.pid, libc::SIGTERM);
            if p.exited.recv_timeout(Duration::from_secs(60)).is_err() {
                signal(p.pid, libc::SIGKILL);
                let _ = p.exited.recv();
            }
        }
    }

    /// The process id of node `i`, while it runs (for its CPU time).
    pub fn pid(&self, i: usize) -> Option<u32> {
        self.nodes[i].process.as_ref().map(|p| p.pid)
    }

    /// Stops node `i` with SIGSTOP (a black hole: connections stay open,
    /// nothing answers) until [`KafkaCluster::resume`].
    pub fn pause(&self, i: usize) {
        if let Some(p) = &self.nodes[i].process {
            signal(p.pid, libc::SIGSTOP);
        }
    }

    /// Resumes node `i` after [`KafkaCluster::pause`].
    pub fn resume(&self, i: usize) {
        if let Some(p) = &self.nodes[i].process {
            signal(p.pid, libc::SIGCONT);
        }
    }

    /// Starts node `i` again on its data (after a stop or kill) and waits
    /// until every running broker serves metadata.
    pub fn restart(&mut self, i: usize) {
        assert!(self.nodes[i].process.is_none(), "node {i} is running");
        self.spawn(i);
        self.wait_ready();
    }

    /// Waits until the metadata lists every running node's broker.
    pub fn wait_ready(&mut self) {
        let serving = |n: &&Node| n.process.is_some() && n.role != Role::Controller;
        let running: Vec<i32> = self
            .nodes
            .iter()
            .filter(serving)
            .map(|n| n.id as i32)
            .collect();
        if running.is_empty() {
            return;
        }
        let bootstrap = self
            .nodes
            .iter()
            .filter(serving)
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect::<Vec<_>>()
            .join(",");
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .set("reconnect.backoff.max.ms", "200")
            .set("log_level", "0")
            .create()
            .expect("a metadata client");
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            for i in 0..self.nodes.len() {
                self.check_alive(i);
            }
            if let Ok(md) = consumer.fetch_metadata(None, Duration::from_secs(2)) {
                let mut seen: Vec<i32> = md.brokers().iter().map(|b| b.id()).collect();
                seen.sort_unstable();
                if running.iter().all(|id| seen.contains(id)) {
                    return;
                }
            }
            if Instant::now() > deadline {
                panic!(
                    "Apache Kafka (nodes {running:?}) not ready within {START_TIMEOUT:?}; last log lines:\n{}",
                    self.log_tail(0, 20)
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The last `lines` lines of node `i`'s log.
    pub fn log_tail(&self, i: usize, lines: usize) -> String {
        let mut text = String::new();
        for name in ["server.log", "stdout.log"] {
            let path = self.node_dir(i).join(name);
            let all = std::fs::read_to_string(&path).unwrap_or_default();
            let v: Vec<&str> = all.lines().collect();
            let from = v.len().saturating_sub(lines);
            text.push_str(&format!(
                "--- {}\n{}\n",
                path.display(),
                v[from..].join("\n")
            ));
        }
        text
    }

    /// Runs one of Kafka's command-line tools (a main class from the same
    /// jars, e.g. `org.apache.kafka.tools.ConsoleProducer`) with `args`,
    /// `stdin` on its standard input; returns its standard output.
    ///
    /// # Panics
    ///
    /// When the tool fails, with its standard error.
    pub fn tool(&self, main_class: &str, args: &[&str], stdin: &[u8]) -> String {
        use std::io::Write;
        let mut child = self
            .java()
            .arg(main_class)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start java");
        let mut input = child.stdin.take().expect("stdin");
        let data = stdin.to_vec();
        let writer = std::thread::spawn(move || {
            let _ = input.write_all(&data);
        });
        let out = child.wait_with_output().expect("wait for java");
        let _ = writer.join();
        assert!(
            out.status.success(),
            "{main_class} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn node_dir(&self, i: usize) -> PathBuf {
        self.dir.path().join(format!("node-{}", self.nodes[i].id))
    }

    /// A `java` command with the jars on the class path and a small heap.
    fn java(&self) -> Command {
        let heap = std::env::var("WALBOX_KAFKA_HEAP").unwrap_or_else(|_| "512m".into());
        let mut c = Command::new(java_bin());
        c.arg(format!("-Xmx{heap}"))
            .arg("-Xms128m")
            .arg("-XX:+UseSerialGC")
            .arg("-Djava.awt.headless=true")
            .arg("-cp")
            .arg(match &self.classes {
                Some(classes) => format!("{}/*:{}", self.libs, classes.display()),
                None => format!("{}/*", self.libs),
            });
        c
    }

    fn properties(&self, i: usize) -> String {
        let n = &self.nodes[i];
        let voters = self
            .nodes
            .iter()
            .filter(|n| n.role != Role::Broker)
            .map(|n| format!("{}@127.0.0.1:{}", n.id, n.controller_port))
            .collect::<Vec<_>>()
            .join(",");
        let brokers = self
            .nodes
            .iter()
            .filter(|n| n.role != Role::Controller)
            .count();
        let replication = brokers.min(3);
        let min_isr = if brokers >= 3 { 2 } else { 1 };
        let dir = self.node_dir(i);
        let (roles, listeners, advertised) = match n.role {
            Role::Combined => (
                "broker,controller",
                format!(
                    "PLAINTEXT://127.0.0.1:{},CONTROLLER://127.0.0.1:{}",
                    n.port, n.controller_port
                ),
                format!("PLAINTEXT://127.0.0.1:{}", n.port),
            ),
            Role::Broker => (
                "broker",
                format!("PLAINTEXT://127.0.0.1:{}", n.port),
                format!("PLAINTEXT://127.0.0.1:{}", n.port),
            ),
            Role::Controller => (
                "controller",
                format!("CONTROLLER://127.0.0.1:{}", n.controller_port),
                String::new(),
            ),
        };
        let mut p = format!(
            "process.roles={roles}\n\
             node.id={id}\n\
             controller.quorum.voters={voters}\n\
             listeners={listeners}\n\
             controller.listener.names=CONTROLLER\n\
             listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT\n\
             log.dirs={data}\n\
             num.partitions=1\n\
             default.replication.factor={replication}\n\
             min.insync.replicas={min_isr}\n\
             offsets.topic.replication.factor={replication}\n\
             offsets.topic.num.partitions=5\n\
             transaction.state.log.replication.factor={replication}\n\
             transaction.state.log.min.isr={min_isr}\n\
             transaction.state.log.num.partitions=5\n\
             group.initial.rebalance.delay.ms=0\n\
             num.network.threads=2\n\
             num.io.threads=4\n\
             replica.lag.time.max.ms=5000\n\
             broker.session.timeout.ms=6000\n\
             broker.heartbeat.interval.ms=1000\n\
             auto.create.topics.enable=false\n",
            id = n.id,
            data = dir.join("data").display(),
        );
        if n.role != Role::Controller {
            p.push_str(&format!(
                "advertised.listeners={advertised}\ninter.broker.listener.name=PLAINTEXT\n"
            ));
        }
        if let Some(sec) = &self.secured {
            // The clients' listener beside the harness' plaintext one.
            let protocol = sec.protocol;
            let external = format!("EXTERNAL://127.0.0.1:{}", sec.port);
            p = p
                .replace(
                    &format!("listeners={listeners}\n"),
                    &format!("listeners={listeners},{external}\n"),
                )
                .replace(
                    &format!("advertised.listeners={advertised}\n"),
                    &format!("advertised.listeners={advertised},{external}\n"),
                )
                .replace(
                    "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT\n",
                    &format!("listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,EXTERNAL:{protocol}\n"),
                );
            for (k, v) in &sec.properties {
                p.push_str(&format!("{k}={v}\n"));
            }
        }
        for (k, v) in &self.extra {
            p.push_str(&format!("{k}={v}\n"));
        }
        p
    }

    /// Writes node `i`'s configuration and starts formatting its storage.
    fn format(&self, i: usize) -> std::process::Child {
        let dir = self.node_dir(i);
        std::fs::create_dir_all(&dir).expect("a node dir");
        std::fs::write(dir.join("server.properties"), self.properties(i))
            .expect("write properties");
        std::fs::write(
            dir.join("log4j2.properties"),
            log4j2_to_file(
                &dir.join("server.log"),
                "logger.kafka.name=kafka\n\
                 logger.kafka.level=INFO\n\
                 logger.state.name=state.change.logger\n\
                 logger.state.level=WARN\n",
            ),
        )
        .expect("write log4j2.properties");
        self.java()
            .arg(format!(
                "-Dlog4j2.configurationFile={}",
                dir.join("log4j2.properties").display()
            ))
            .args(["kafka.tools.StorageTool", "format", "-t", CLUSTER_ID, "-c"])
            .arg(dir.join("server.properties"))
            .args(self.scram_credentials())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("start Kafka's storage tool: {e} (is a JDK 17+ installed?)"))
    }

    fn spawn(&mut self, i: usize) {
        let dir = self.node_dir(i);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("stdout.log"))
            .expect("open the node's stdout log");
        let mut cmd = self.java();
        cmd.arg(format!(
            "-Dlog4j2.configurationFile={}",
            dir.join("log4j2.properties").display()
        ))
        .arg("kafka.Kafka")
        .arg(dir.join("server.properties"))
        .current_dir(&dir)
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("clone the log handle"))
        .stderr(log);
        self.nodes[i].process = Some(supervise(cmd));
    }

    /// Panics with the log when node `i` should run and exited.
    fn check_alive(&self, i: usize) {
        if let Some(p) = &self.nodes[i].process {
            if p.exited.try_recv().is_ok() {
                panic!(
                    "Apache Kafka node {} exited; last log lines:\n{}",
                    self.nodes[i].id,
                    self.log_tail(i, 30)
                );
            }
        }
    }
}

impl Drop for KafkaCluster {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            self.kill9(i);
        }
    }
}

/// A log4j2 configuration writing INFO and above to `log`, then `extra`
/// (more `logger.*` lines): for the Java processes the harness starts.
pub(crate) fn log4j2_to_file(log: &Path, extra: &str) -> String {
    format!(
        "rootLogger.level=INFO\n\
         rootLogger.appenderRef.f.ref=F\n\
         appender.f.type=File\n\
         appender.f.name=F\n\
         appender.f.fileName={}\n\
         appender.f.layout.type=PatternLayout\n\
         appender.f.layout.pattern=[%d] %p %m (%c)%n\n{extra}",
        log.display()
    )
}

/// `$JAVA_HOME/bin/java`, else `java` on PATH.
pub(crate) fn java_bin() -> PathBuf {
    match std::env::var_os("JAVA_HOME") {
        Some(home) if Path::new(&home).join("bin/java").exists() => {
            Path::new(&home).join("bin/java")
        }
        _ => PathBuf::from("java"),
    }
}

pub(crate) fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: kill(2) with a pid this harness spawned and has not reaped.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

/// Spawns `cmd` from a thread that lives until the process exits, with a
/// parent-death signal (SIGKILL) tied to that thread.
pub(crate) fn supervise(mut cmd: Command) -> Process {
    use std::os::unix::process::CommandExt;
    let parent = std::process::id();
    // SAFETY: the closure runs in the forked child before exec and only
    // makes async-signal-safe system calls (prctl, getppid, _exit).
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() as u32 != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }
    let (pid_tx, pid_rx) = mpsc::channel();
    let (exit_tx, exited) = mpsc::channel();
    std::thread::Builder::new()
        .name("apache-kafka".into())
        .spawn(move || match cmd.spawn() {
            Err(e) => {
                let _ = pid_tx.send(Err(e));
            }
            Ok(mut child) => {
                let _ = pid_tx.send(Ok(child.id()));
                let _ = child.wait();
                let _ = exit_tx.send(());
            }
        })
        .expect("spawn a supervisor thread");
    let pid = pid_rx
        .recv()
        .expect("the supervisor thread")
        .unwrap_or_else(|e| panic!("start java: {e} (is a JDK 17+ installed?)"));
    Process { pid, exited }
}
