//! `walbox-test-env`: the test environment from the command line.
//!
//! * `check`: checks what the test suite will use (WALBOX_TEST_PG_URL or the
//!   local Postgres binaries, WALBOX_TEST_KAFKA) and prints one line; exits 1
//!   with one line saying what to change when something is wrong. `scripts/test`
//!   runs it before the suite so a broken environment fails fast.
//! * `postgres`: starts a private Postgres, prints its connection string, and
//!   holds it until SIGINT/SIGTERM.
//! * `consume`: prints the first N messages of a topic.
//! * `mock-kafka`: starts an rdkafka MockCluster, prints its bootstrap list,
//!   and holds it until SIGINT/SIGTERM, so other processes can use it.
//! * `kafka`: starts Apache Kafka (KRaft, jars from `WALBOX_KAFKA_LIBS`),
//!   prints its bootstrap list, and holds it until SIGINT/SIGTERM.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use rdkafka::consumer::{BaseConsumer, Consumer};
use walbox_test_harness::kafka::TestKafka;
use walbox_test_harness::pg::{self, PgServer};

#[derive(Parser)]
#[command(
    name = "walbox-test-env",
    about = "Provision and check walbox's test environment"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Check the Postgres and Kafka the tests will use; one line, exit 1 on a problem.
    Check,
    /// Start a private Postgres; print its connection string; hold until signalled.
    Postgres {
        /// Extra server settings, `name=value` (repeatable).
        #[arg(long = "set", value_name = "NAME=VALUE")]
        settings: Vec<String>,
    },
    /// Start an in-process Kafka MockCluster; print its bootstrap list; hold until signalled.
    MockKafka {
        /// Number of brokers.
        #[arg(long, default_value_t = 3)]
        brokers: i32,
        /// A topic to create, NAME:PARTITIONS (repeatable).
        #[arg(long = "topic", value_name = "NAME:PARTITIONS")]
        topics: Vec<String>,
    },
    /// Start Apache Kafka (KRaft, jars from WALBOX_KAFKA_LIBS); print its bootstrap list; hold until signalled.
    Kafka {
        /// Number of nodes (each a controller and a broker).
        #[arg(long, default_value_t = 1)]
        nodes: usize,
    },
    /// Print the first COUNT messages of a topic (partition, offset, key, headers, value).
    Consume {
        /// Bootstrap list.
        #[arg(long)]
        bootstrap: String,
        /// Topic.
        #[arg(long)]
        topic: String,
        /// How many messages to wait for.
        #[arg(long)]
        count: usize,
        /// Give up after this many seconds.
        #[arg(long, default_value_t = 30)]
        timeout_secs: u64,
    },
}

/// The signals that end a hold, registered before anything is printed: a
/// SIGTERM sent as soon as the output appears must not meet the default
/// action (killing the process before it stops its server).
struct Hold {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Hold {
    fn install() -> Hold {
        use tokio::signal::unix::{signal, SignalKind};
        Hold {
            term: signal(SignalKind::terminate()).expect("SIGTERM handler"),
            int: signal(SignalKind::interrupt()).expect("SIGINT handler"),
        }
    }

    async fn wait(mut self) {
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.int.recv() => {}
        }
    }
}

async fn check() -> Result<String, String> {
    let shared = pg::try_shared()?;
    let pg_desc = if shared.is_external() {
        format!(
            "WALBOX_TEST_PG_URL ({})",
            pg::describe(shared.admin_config())
        )
    } else {
        let server = shared
            .private_server()
            .map(|s| s.bin_dir().display().to_string());
        format!(
            "private Postgres from {}",
            server.unwrap_or_else(|| "containers".into())
        )
    };
    let kafka_desc = match std::env::var("WALBOX_TEST_KAFKA")
        .ok()
        .filter(|b| !b.trim().is_empty())
    {
        None => "in-process MockCluster".to_owned(),
        Some(bootstrap) => {
            let kafka = TestKafka::External {
                bootstrap: bootstrap.clone(),
            };
            let config = kafka.client_config();
            tokio::task::spawn_blocking(move || {
                let consumer: BaseConsumer = config
                    .create()
                    .map_err(|e| format!("WALBOX_TEST_KAFKA={bootstrap}: {e}"))?;
                consumer
                    .fetch_metadata(None, Duration::from_secs(10))
                    .map_err(|e| {
                        format!("WALBOX_TEST_KAFKA={bootstrap} did not answer within 10s: {e}")
                    })?;
                Ok::<_, String>(format!("WALBOX_TEST_KAFKA={bootstrap}"))
            })
            .await
            .map_err(|e| e.to_string())??
        }
    };
    Ok(format!(
        "test environment ok: {pg_desc}; Kafka: {kafka_desc}"
    ))
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    match Cli::parse().command {
        Cmd::Check => match check().await {
            Ok(line) => {
                println!("{line}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("walbox-test-env: {e}");
                ExitCode::FAILURE
            }
        },
        Cmd::Postgres { settings } => {
            let mut builder = PgServer::builder();
            for s in &settings {
                let Some((k, v)) = s.split_once('=') else {
                    eprintln!("walbox-test-env: --set takes NAME=VALUE, got {s:?}");
                    return ExitCode::from(2);
                };
                builder = builder.setting(k, v);
            }
            let hold = Hold::install();
            let server = match builder.start() {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("walbox-test-env: {e}");
                    return ExitCode::FAILURE;
                }
            };
            println!("{}", pg::conninfo(&server.config("postgres")));
            println!("pid={}", server.pid().unwrap_or(0));
            hold.wait().await;
            drop(server);
            ExitCode::SUCCESS
        }
        Cmd::Kafka { nodes } => {
            let hold = Hold::install();
            let started = tokio::task::spawn_blocking(move || {
                std::panic::catch_unwind(|| {
                    walbox_test_harness::apache_kafka::KafkaCluster::start(nodes)
                })
            })
            .await
            .expect("the start thread");
            let cluster = match started {
                Ok(c) => c,
                // The panic's message is already on stderr.
                Err(_) => return ExitCode::FAILURE,
            };
            println!("{}", cluster.bootstrap());
            hold.wait().await;
            drop(cluster);
            ExitCode::SUCCESS
        }
        Cmd::Consume {
            bootstrap,
            topic,
            count,
            timeout_secs,
        } => {
            use rdkafka::message::Message;
            let kafka = TestKafka::External { bootstrap };
            match walbox_test_harness::kafka::consume_n(
                &kafka,
                &topic,
                count,
                Duration::from_secs(timeout_secs),
            )
            .await
            {
                Ok(mut messages) => {
                    messages.sort_by_key(|m| (m.partition(), m.offset()));
                    for m in &messages {
                        let mut headers: Vec<_> = walbox_test_harness::kafka::headers_of(m)
                            .into_iter()
                            .collect();
                        headers.sort();
                        let headers: Vec<String> =
                            headers.iter().map(|(k, v)| format!("{k}={v}")).collect();
                        println!(
                            "{topic} [{}@{}] key={} {} value={}",
                            m.partition(),
                            m.offset(),
                            String::from_utf8_lossy(m.key().unwrap_or_default()),
                            headers.join(" "),
                            String::from_utf8_lossy(m.payload().unwrap_or_default())
                        );
                    }
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("walbox-test-env: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Cmd::MockKafka { brokers, topics } => {
            let hold = Hold::install();
            let kafka = TestKafka::mock(brokers);
            let cluster = kafka.mock_cluster().expect("a mock cluster");
            for t in &topics {
                let (name, partitions) = match t.split_once(':') {
                    Some((n, p)) => (n, p.parse().unwrap_or(1)),
                    None => (t.as_str(), 1),
                };
                if let Err(e) = cluster.create_topic(name, partitions, 1) {
                    eprintln!("walbox-test-env: create topic {name}: {e}");
                    return ExitCode::FAILURE;
                }
            }
            println!("{}", kafka.bootstrap());
            hold.wait().await;
            ExitCode::SUCCESS
        }
    }
}
