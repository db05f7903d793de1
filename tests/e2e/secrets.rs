//! No secret in any output: every secret-bearing setting, given in every
//! malformed shape we could think of, through `walbox config` and `walbox
//! run`, with text and JSON logs. Each case's secret is grepped for in
//! stdout and stderr.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How long a `run` that neither exits nor fails is left before SIGTERM:
/// long enough to meet Postgres and the broker unreachable and say so.
const RUN_FOR: Duration = Duration::from_secs(12);

/// One case: the secret, the environment that carries it (with the other
/// settings it needs), and whether `config` must refuse it (exit 2).
struct Case {
    secret: &'static str,
    env: Vec<(&'static str, String)>,
    refused: bool,
}

fn case(secret: &'static str, refused: bool, env: &[(&'static str, &str)]) -> Case {
    Case {
        secret,
        env: env.iter().map(|(k, v)| (*k, (*v).to_owned())).collect(),
        refused,
    }
}

const PG: (&str, &str) = ("WALBOX_PG_URL", "postgres://walbox@127.0.0.1:1/app");
const KAFKA: (&str, &str) = ("WALBOX_KAFKA_BROKERS", "127.0.0.1:1");

fn cases(dir: &std::path::Path) -> Vec<Case> {
    let file = dir.join("password");
    walbox_test_harness::secret_file::write(&file, "FileSecret5\n");
    let file: &'static str = Box::leak(file.display().to_string().into_boxed_str());
    let rabbit = |url: &'static str| -> Vec<(&'static str, &'static str)> {
        vec![
            PG,
            ("WALBOX_SINK", "rabbitmq"),
            ("WALBOX_RABBITMQ_URL", url),
            ("WALBOX_RABBITMQ_EXCHANGE", "events"),
        ]
    };
    let nats = |url: &'static str| -> Vec<(&'static str, &'static str)> {
        vec![PG, ("WALBOX_SINK", "nats"), ("WALBOX_NATS_URL", url)]
    };
    let webhook = |url: &'static str| -> Vec<(&'static str, &'static str)> {
        vec![PG, ("WALBOX_SINK", "webhook"), ("WALBOX_WEBHOOK_URL", url)]
    };
    let with = |mut base: Vec<(&'static str, &'static str)>,
                extra: &[(&'static str, &'static str)]| {
        base.extend_from_slice(extra);
        base
    };
    let pg = |url: &'static str| vec![("WALBOX_PG_URL", url), KAFKA];
    vec![
        // doctor's standby: unreachable, its password never shown (config
        // and run do not read it, and do not show it either).
        case(
            "StandbySecret9",
            false,
            &[
                PG,
                KAFKA,
                (
                    "WALBOX_STANDBY_URL",
                    "postgres://walbox:StandbySecret9@127.0.0.1:1/app",
                ),
            ],
        ),
        // The Postgres URL and its keyword form.
        case(
            "PgSecret1",
            true,
            &pg("postgress://walbox:PgSecret1@127.0.0.1:1/app"),
        ),
        case(
            "PgSecret1",
            true,
            &pg("postgres://walbox:PgSecret1@127.0.0.1:abc/app"),
        ),
        case(
            "PgSecret1",
            true,
            &pg("postgres://walbox:PgSecret1:127.0.0.1/app"),
        ),
        case(
            "PgSecret1",
            true,
            &pg("postgres://walbox:PgSecret1@127.0.0.1:1/app?foo=bar"),
        ),
        case(
            "PgSec",
            true,
            &pg("postgres://walbox:PgSec%zzret1@127.0.0.1:1/app"),
        ),
        case(
            "PgSecret1",
            true,
            &pg("postgresql//walbox:PgSecret1@127.0.0.1:1/app"),
        ),
        case(
            "PgSecret1",
            true,
            &pg("jdbc:postgresql://127.0.0.1:1/app?user=walbox&password=PgSecret1"),
        ),
        case("PgSecret1", true, &pg("PgSecret1")),
        case(
            "PgSecret1",
            true,
            &pg("host=127.0.0.1 user=walbox password=PgSecret1 port=abc"),
        ),
        case(
            "PgSecret1",
            true,
            &pg("host=127.0.0.1 user=walbox password=Pg PgSecret1"),
        ),
        case(
            "PgSecret1",
            true,
            &pg("host=127.0.0.1 user=walbox password='PgSecret1"),
        ),
        case(
            "PgSecret1",
            true,
            &pg("host=127.0.0.1 user=walbox password=PgSecret1 sslpassword=PgSecret1"),
        ),
        case(
            "PgSecret1",
            true,
            &pg("host=127.0.0.1 user=walbox password=PgSecret1 sslmode=verify-full"),
        ),
        case(
            "PgSecret1",
            false,
            &pg("postgres://walbox:PgSecret1@127.0.0.1:1/app"),
        ),
        case(
            "PgSecret1",
            false,
            &pg("host=127.0.0.1 port=1 user=walbox password='PgSecret1' dbname=app"),
        ),
        case(
            "PgSecret1",
            false,
            &[
                ("WALBOX_PG_URL", "host=127.0.0.1 port=1 user=walbox"),
                KAFKA,
                ("PGPASSWORD", "PgSecret1"),
            ],
        ),
        case(
            "PgSecret1",
            true,
            &[
                ("WALBOX_PG_URL", "host=127.0.0.1 port=abc user=walbox"),
                KAFKA,
                ("PGPASSWORD", "PgSecret1"),
            ],
        ),
        // Kafka properties: mistyped names, refused values, the password
        // beside another property's mistake, from a file.
        case(
            "KafkaPw2",
            true,
            &[PG, KAFKA, ("WALBOX_KAFKA_PROPERTY_SASL_PASSWD", "KafkaPw2")],
        ),
        case(
            "KafkaPw2",
            true,
            &[PG, KAFKA, ("WALBOX_KAFKA_PROPERTY_SASL_PASS", "KafkaPw2")],
        ),
        case(
            "KafkaPw2",
            true,
            &[PG, KAFKA, ("WALBOX_KAFKA_PROPERTY_SASL_PWD", "KafkaPw2")],
        ),
        case(
            "KafkaPw2",
            true,
            &[
                PG,
                KAFKA,
                ("WALBOX_KAFKA_PROPERTY_SSL_KEY_PASSWORD", "KafkaPw2"),
                ("WALBOX_KAFKA_PROPERTY_SASL_MECHANISM", "GSSAPI"),
                ("WALBOX_KAFKA_PROPERTY_SECURITY_PROTOCOL", "SASL_SSL"),
            ],
        ),
        case(
            "KafkaPw2",
            true,
            &[
                PG,
                KAFKA,
                (
                    "WALBOX_KAFKA_PROPERTY_SASL_OAUTHBEARER_CLIENT_SECRET",
                    "KafkaPw2",
                ),
                (
                    "WALBOX_KAFKA_PROPERTY_MAX_IN_FLIGHT_REQUESTS_PER_CONNECTION",
                    "20",
                ),
            ],
        ),
        case(
            "KafkaPw2",
            true,
            &[
                PG,
                KAFKA,
                ("WALBOX_KAFKA_PROPERTY_SASL_USERNAME", "u"),
                ("WALBOX_KAFKA_PROPERTY_SASL_PASSWORD", "KafkaPw2"),
                ("WALBOX_KAFKA_PROPERTY_SASL_MECHANISM", "SCRAM-SHA-999"),
                ("WALBOX_KAFKA_PROPERTY_SECURITY_PROTOCOL", "SASL_SSL"),
            ],
        ),
        case(
            "KafkaPw2",
            true,
            &[
                PG,
                KAFKA,
                ("WALBOX_KAFKA_PROPERTY_SASL_JAAS_CONFIG", "KafkaPw2"),
            ],
        ),
        case(
            "KafkaPw2",
            true,
            &[
                PG,
                KAFKA,
                ("WALBOX_KAFKA_PROPERTY_SSL_KEY_PEM", "KafkaPw2"),
                ("WALBOX_KAFKA_PROPERTY_SECURITY_PROTOCOL", "SSL"),
            ],
        ),
        case(
            "KafkaPw2",
            false,
            &[
                PG,
                KAFKA,
                ("WALBOX_KAFKA_PROPERTY_SASL_USERNAME", "u"),
                ("WALBOX_KAFKA_PROPERTY_SASL_PASSWORD", "KafkaPw2"),
                ("WALBOX_KAFKA_PROPERTY_SASL_MECHANISM", "PLAIN"),
                ("WALBOX_KAFKA_PROPERTY_SECURITY_PROTOCOL", "SASL_PLAINTEXT"),
            ],
        ),
        case(
            "FileSecret5",
            true,
            &[
                PG,
                KAFKA,
                ("WALBOX_KAFKA_PROPERTY_SASL_PASSWORD_FILE", file),
                ("WALBOX_KAFKA_PROPERTY_LINGER_MS", "soon"),
            ],
        ),
        case("FileSecret5", true, &[("WALBOX_PG_URL_FILE", file), KAFKA]),
        // RabbitMQ: the URL malformed every way, the password apart.
        case(
            "RabbitPW9",
            true,
            &rabbit("amqp//user:RabbitPW9@rmq:5672/%2F"),
        ),
        case("RabbitPW9", true, &rabbit("user:RabbitPW9@rmq:5672")),
        case("RabbitPW9", true, &rabbit("amqp://user:RabbitPW9:rmq")),
        case(
            "RabbitPW9",
            true,
            &rabbit("amqp://user:RabbitPW9@rmq:99999/x"),
        ),
        case("RabbitPW9", true, &rabbit("amqp://user:RabbitPW9%zz@rmq/x")),
        case(
            "RabbitPW9",
            true,
            &rabbit("amqps://user:RabbitPW9@rmq/x?cacertfile=/nonexistent"),
        ),
        case(
            "RabbitPW9",
            false,
            &rabbit("amqp://user:RabbitPW9@127.0.0.1:1/%2F"),
        ),
        case(
            "RabbitPW9",
            true,
            &with(
                rabbit("amqp://user@rmq:notaport/x"),
                &[("WALBOX_RABBITMQ_PASSWORD", "RabbitPW9")],
            ),
        ),
        // NATS: a token or a password in the URL.
        case("NatsTok9", true, &nats("nats://NatsTok9@127.0.0.1:abc")),
        case("NatsTok9", true, &nats("nats//NatsTok9@127.0.0.1:4222")),
        case("NatsPw9", true, &nats("nats://u:NatsPw9:127.0.0.1")),
        case("NatsPw9", false, &nats("nats://u:NatsPw9@127.0.0.1:1")),
        // Webhooks: a token in the URL's query, a user's password, the
        // signing secret beside a mistake.
        case(
            "HookTok9",
            true,
            &webhook("htps://hook.example/x?token=HookTok9"),
        ),
        case(
            "HookPw9",
            true,
            &webhook("https://u:HookPw9@hook.example:notaport/x"),
        ),
        case(
            "HookSecret9",
            true,
            &with(
                webhook("ftp://hook.example/x"),
                &[("WALBOX_WEBHOOK_SECRET", "HookSecret9")],
            ),
        ),
        case(
            "HookTok9",
            false,
            &webhook("http://127.0.0.1:1/x?token=HookTok9"),
        ),
        // SQS: AWS's keys from the environment.
        case(
            "AwsSecret9",
            true,
            &[
                PG,
                ("WALBOX_SINK", "sqs"),
                ("WALBOX_SQS_QUEUE_URL", "not a url"),
                ("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE"),
                ("AWS_SECRET_ACCESS_KEY", "AwsSecret9"),
            ],
        ),
        // The schema registry's basic auth.
        case(
            "RegPw9",
            true,
            &[
                PG,
                KAFKA,
                ("WALBOX_FORMAT", "avro"),
                (
                    "WALBOX_SCHEMA_REGISTRY_URL",
                    "http://u:RegPw9@registry:notaport",
                ),
            ],
        ),
        case(
            "RegPw9",
            true,
            &[
                PG,
                KAFKA,
                ("WALBOX_FORMAT", "avro"),
                ("WALBOX_SCHEMA_REGISTRY_URL", "registry//"),
                ("WALBOX_SCHEMA_REGISTRY_USERNAME", "u"),
                ("WALBOX_SCHEMA_REGISTRY_PASSWORD", "RegPw9"),
            ],
        ),
        // The OTLP endpoint's user information.
        case(
            "OtlpPw9",
            true,
            &[
                PG,
                KAFKA,
                (
                    "WALBOX_OTLP_ENDPOINT",
                    "http://u:OtlpPw9@collector:notaport",
                ),
            ],
        ),
        case(
            "OtlpPw9",
            false,
            &[
                PG,
                KAFKA,
                ("WALBOX_OTLP_ENDPOINT", "http://u:OtlpPw9@127.0.0.1:1"),
            ],
        ),
    ]
}

/// A child killed when dropped.
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs `args` with `env` (and no other `WALBOX_*`) until it exits, or
/// [`RUN_FOR`] and then SIGTERM: its exit code and all it printed.
fn output(args: &[&str], env: &[(&'static str, String)]) -> (Option<i32>, String) {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let file = std::fs::File::create(&log).unwrap();
    let mut c = Command::new(walbox_e2e::walbox_bin());
    c.args(args);
    for (k, _) in std::env::vars()
        .filter(|(k, _)| k.starts_with("WALBOX_") || k.starts_with("PG") || k.starts_with("AWS_"))
    {
        c.env_remove(k);
    }
    let child = c
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(file.try_clone().unwrap())
        .stderr(file)
        .spawn()
        .unwrap();
    // Killed if this thread panics: no walbox outlives the test.
    let mut child = Reaped(child);
    let child = &mut child.0;
    let started = Instant::now();
    let mut signalled = false;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return (status.code(), std::fs::read_to_string(&log).unwrap());
        }
        // doctor ends by itself (its broker look waits 10 s for an
        // unreachable one): a signal would hide its exit status.
        let limit = if args[0] == "doctor" {
            RUN_FOR * 3
        } else {
            RUN_FOR
        };
        if !signalled && started.elapsed() > limit {
            crate::support::signal_child(child, "-TERM");
            signalled = true;
        }
        assert!(
            started.elapsed() < RUN_FOR * 5,
            "{args:?}: did not stop after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn no_secret_appears_in_any_output_of_config_run_or_doctor() {
    let dir = tempfile::tempdir().unwrap();
    let cases = cases(dir.path());
    let commands: [&[&str]; 6] = [
        &["config"],
        &["config", "--log-format", "json"],
        &["run"],
        &["run", "--log-format", "json"],
        &["doctor"],
        &["doctor", "--json", "--log-format", "json"],
    ];
    let failures: Vec<String> = std::thread::scope(|scope| {
        let mut running = Vec::new();
        for case in &cases {
            for args in commands {
                running.push(scope.spawn(move || {
                    let (code, text) = output(args, &case.env);
                    let mut wrong = Vec::new();
                    if text.contains(case.secret) {
                        wrong.push(format!("the secret {:?} shown", case.secret));
                    }
                    if args[0] == "config" {
                        let want = if case.refused { 2 } else { 0 };
                        if code != Some(want) {
                            wrong.push(format!("exit {code:?}, not {want}"));
                        }
                    }
                    if case.refused && code != Some(2) {
                        wrong.push(format!("refused, but exit {code:?}"));
                    }
                    (!wrong.is_empty())
                        .then(|| format!("{args:?} {:?}: {}\n{text}", case.env, wrong.join("; ")))
                }));
            }
        }
        running
            .into_iter()
            .filter_map(|t| t.join().unwrap())
            .collect()
    });
    assert!(
        failures.is_empty(),
        "{} of {} outputs wrong:\n{}",
        failures.len(),
        cases.len() * commands.len(),
        failures.join("\n\n")
    );
}
