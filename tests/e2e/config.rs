//! `walbox config`: the effective settings, secrets never shown, and exit
//! status 2 for every configuration error, whichever command meets it.

use std::process::{Command, Output};

fn walbox(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(walbox_e2e::walbox_bin());
    c.args(args);
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("WALBOX_")) {
        c.env_remove(k);
    }
    c.envs(env.iter().copied()).output().unwrap()
}

#[test]
fn config_shows_every_setting_with_its_source_and_no_secret() {
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("kafka-password");
    walbox_test_harness::secret_file::write(&secret, "s3cret-from-file\n");
    let file = dir.path().join("walbox.toml");
    std::fs::write(
        &file,
        "slot = \"from_file\"\n[mapping]\npreset = \"debezium\"\n",
    )
    .unwrap();
    let out = walbox(
        &[
            "config",
            "--config",
            file.to_str().unwrap(),
            "--kafka-property",
            "linger.ms=20",
        ],
        &[
            ("WALBOX_PG_URL", "postgres://walbox:hunter2@db:5432/app"),
            ("WALBOX_KAFKA_BROKERS", "kafka:9092"),
            (
                "WALBOX_KAFKA_PROPERTY_SASL_PASSWORD_FILE",
                secret.to_str().unwrap(),
            ),
            // A password inside a URL: user information is never shown.
            (
                "WALBOX_OTLP_ENDPOINT",
                "http://otel:in-url-s3cret@collector:4318",
            ),
            (
                "WALBOX_KAFKA_PROPERTY_SASL_OAUTHBEARER_TOKEN_ENDPOINT_URL",
                "https://client:in-url-s3cret@idp.example/token",
            ),
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    for secret in ["hunter2", "s3cret-from-file", "in-url-s3cret"] {
        assert!(
            !stdout.contains(secret) && !stderr.contains(secret),
            "{stdout}{stderr}"
        );
    }
    let line = |key: &str| {
        stdout
            .lines()
            .find(|l| l.split_whitespace().next() == Some(key))
            .unwrap_or_else(|| panic!("no {key} in:\n{stdout}"))
            .to_owned()
    };
    assert!(
        line("pg_url").contains("host=db port=5432 user=walbox dbname=app")
            && line("pg_url").ends_with("(environment)")
    );
    assert!(
        line("slot").contains("= from_file") && line("slot").ends_with("walbox.toml)"),
        "{}",
        line("slot")
    );
    assert!(
        line("mapping.aggregate_id").contains("= aggregateid"),
        "the preset's column"
    );
    assert!(line("kafka.properties.linger.ms").ends_with("= 20  (command line)"));
    assert!(line("kafka.properties.sasl.password").contains("<redacted>  (environment)"));
    assert!(line("publication").ends_with("(default)"));
}

#[test]
fn every_configuration_error_exits_2_in_one_line_without_the_secret() {
    let pg = ("WALBOX_PG_URL", "postgres://walbox:hunter2@127.0.0.1:1/app");
    /// Arguments, environment, and what the error line must say.
    type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], &'a str);
    let cases: &[Case<'_>] = &[
        (&["config"], &[], "pg_url is required"),
        (&["config"], &[pg], "kafka.brokers is required"),
        (
            &["run", "--kafka-brokers", "k:1", "--metrics-addr", "nowhere"],
            &[pg],
            "metrics_addr \"nowhere\"",
        ),
        (
            &["status", "--slot", "Bad Slot"],
            &[pg],
            "slot \"Bad Slot\"",
        ),
        (
            &["init-slot", "--mapping-id", ""],
            &[pg],
            "mapping.id: must not be empty",
        ),
        (
            &["drop-slot"],
            &[pg, ("WALBOX_SHUTDOWN_TIMEOUT_SECS", "soon")],
            "WALBOX_SHUTDOWN_TIMEOUT_SECS: expected a whole number",
        ),
        (
            &["config"],
            &[pg, ("WALBOX_PG_URL_FILE", "/nonexistent")],
            "both WALBOX_PG_URL and WALBOX_PG_URL_FILE",
        ),
        // A typo must not leave the slot at its default.
        (
            &["run", "--kafka-brokers", "k:1"],
            &[pg, ("WALBOX_SLOTT", "orders")],
            "WALBOX_SLOTT is not a walbox setting: did you mean WALBOX_SLOT?",
        ),
        // migrate cannot make another table than its own: not ignored.
        (
            &["migrate", "--table", "app.events"],
            &[pg],
            "table \"app\".\"events\": migrate creates walbox's own outbox table",
        ),
        // What only `run` used to find (exit 1 after connecting), `config`
        // finds too, and both call it a configuration error.
        (
            &["config", "--kafka-brokers", "k:1", "--kafka-property", "acks=1"],
            &[pg],
            "acks=1 would break walbox's delivery guarantees",
        ),
        (
            &["run", "--kafka-brokers", "k:1", "--kafka-property", "acks=1"],
            &[pg],
            "acks=1 would break walbox's delivery guarantees",
        ),
        (
            &["config", "--kafka-brokers", "k:1", "--kafka-property", "lingr.ms=5"],
            &[pg],
            "No such configuration property: \"lingr.ms\"",
        ),
        (
            &["config", "--kafka-brokers", "k:1", "--kafka-property", "ssl.ca.location=/nonexistent/ca.pem"],
            &[pg],
            "kafka.properties.ssl.ca.location: cannot read /nonexistent/ca.pem",
        ),
        (
            &["config", "--kafka-brokers", "k:1"],
            &[("WALBOX_PG_URL", "postgres://walbox:hunter2@127.0.0.1:1/app?sslmode=verify-full&sslrootcert=/nonexistent/root.pem")],
            "pg_url sslrootcert: cannot read /nonexistent/root.pem",
        ),
        (
            &["config", "--kafka-brokers", "k:1", "--shards", "4"],
            &[pg],
            "shards = 4: say which shard this process streams",
        ),
    ];
    for (args, env, want) in cases {
        let out = walbox(args, env);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
        assert!(!stderr.contains("hunter2"), "{args:?}: {stderr}");
    }
    // A flag's value the command line itself refuses: clap's usage error, also 2.
    let out = walbox(&["migrate", "--log-format", "xml"], &[pg]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid value 'xml'"));
}

/// `walbox run` until it exits, or until it says it waits for brokers that
/// do not answer (which it does as long as it takes), then SIGTERM: its
/// exit status and everything it printed.
fn run_until_it_waits_or_exits(
    args: &[&str],
    env: &[(&str, &str)],
) -> (std::process::ExitStatus, String) {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let mut c = Command::new(walbox_e2e::walbox_bin());
    c.args(args);
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("WALBOX_")) {
        c.env_remove(k);
    }
    let file = std::fs::File::create(&log).unwrap();
    let mut child = c
        .envs(env.iter().copied())
        .stdout(file.try_clone().unwrap())
        .stderr(file)
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    let mut signalled = false;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return (status, std::fs::read_to_string(&log).unwrap());
        }
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if !signalled && text.contains("Kafka unreachable") {
            Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status()
                .unwrap();
            signalled = true;
        }
        assert!(
            started.elapsed() < std::time::Duration::from_secs(60),
            "{args:?}: neither exited nor waited for the brokers:\n{text}"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// A Kafka secret given every way there is never reaches walbox's output,
/// whatever error librdkafka or walbox meets.
#[test]
fn a_kafka_secret_never_appears_on_any_error_path() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("password");
    walbox_test_harness::secret_file::write(&file, "hunter2\n");
    let file = file.to_str().unwrap().to_owned();
    let pg = ("WALBOX_PG_URL", "postgres://walbox@127.0.0.1:1/app");
    let brokers = ["--kafka-brokers", "127.0.0.1:1"];
    /// Flags, and extra environment.
    type Case<'a> = (Vec<&'a str>, Vec<(&'a str, &'a str)>);
    let cases: Vec<Case<'_>> = vec![
        // librdkafka refuses the property (this build, or this value).
        (vec!["--kafka-property", "ssl.key.password=hunter2"], vec![]),
        (
            vec!["--kafka-property", "ssl.keystore.password=hunter2"],
            vec![],
        ),
        (vec!["--kafka-property", "ssl.key.pem=hunter2"], vec![]),
        (vec!["--kafka-property", "sasl.jaas.config=hunter2"], vec![]),
        (
            vec!["--kafka-property", "sasl.oauthbearer.client.secret=hunter2"],
            vec![],
        ),
        (
            vec![
                "--kafka-property",
                "sasl.oauthbearer.config=principal=hunter2",
            ],
            vec![],
        ),
        // Another property is wrong; the secret rides along.
        (
            vec!["--kafka-property", "linger.ms=soon"],
            vec![("WALBOX_KAFKA_PROPERTY_SASL_PASSWORD", "hunter2")],
        ),
        (
            vec!["--kafka-property", "sasl.mechanism=NOPE"],
            vec![("WALBOX_KAFKA_PROPERTY_SASL_PASSWORD_FILE", file.as_str())],
        ),
        (
            vec!["--kafka-property", "security.protocol=SASL_SSL"],
            vec![("WALBOX_KAFKA_PROPERTY_SASL_PASSWORD", "hunter2")],
        ),
        // The pinned settings refused.
        (
            vec!["--kafka-property", "acks=1"],
            vec![("WALBOX_KAFKA_PROPERTY_SASL_PASSWORD", "hunter2")],
        ),
        // A broker that does not answer.
        (
            vec![
                "--kafka-property",
                "security.protocol=SASL_PLAINTEXT",
                "--kafka-property",
                "sasl.mechanism=PLAIN",
                "--kafka-property",
                "sasl.username=walbox",
            ],
            vec![("WALBOX_KAFKA_PROPERTY_SASL_PASSWORD", "hunter2")],
        ),
    ];
    for (flags, env) in cases {
        let mut args = vec!["run"];
        args.extend(brokers);
        args.extend(flags.iter().copied());
        let mut all_env = vec![pg];
        all_env.extend(env.iter().copied());
        let (status, text) = run_until_it_waits_or_exits(&args, &all_env);
        assert!(!text.contains("hunter2"), "{args:?} {env:?}:\n{text}");
        if text.contains("Kafka unreachable") {
            // No broker answers: waited for (with librdkafka's reason
            // logged), until the signal.
            assert!(status.success(), "{args:?}: {text}");
        } else {
            assert!(!status.success(), "{args:?}: {text}");
            let last = text.lines().last().unwrap_or_default();
            assert!(last.starts_with("walbox: "), "one error line: {last}");
        }
    }
    let out = walbox(
        &[
            "config",
            "--kafka-brokers",
            "127.0.0.1:1",
            "--kafka-property",
            "sasl.oauthbearer.client.secret=hunter2",
        ],
        &[
            pg,
            ("WALBOX_KAFKA_PROPERTY_SSL_KEY_PASSWORD", "hunter2"),
            ("WALBOX_KAFKA_PROPERTY_SASL_PASSWORD_FILE", file.as_str()),
        ],
    );
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(!text.contains("hunter2"), "{text}");
    assert_eq!(text.matches("<redacted>").count(), 3, "{text}");
}

/// `--help` groups the flags under headings, and each command lists only
/// the settings it reads.
#[test]
fn help_groups_the_flags_and_shows_each_command_its_own() {
    let help = |command: &str| {
        let out = walbox(&[command, "--help"], &[]);
        assert!(out.status.success());
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let headings = |text: &str| -> Vec<String> {
        text.lines()
            .filter(|l| !l.starts_with(' ') && l.ends_with(':'))
            .map(str::to_owned)
            .collect()
    };
    let run = help("run");
    assert_eq!(
        headings(&run),
        [
            "Options:",
            "Postgres and the outbox:",
            "Records (mapping and format):",
            "Brokers and delivery:",
            "Running (limits, recovery, observability):"
        ],
        "{run}"
    );
    let section = run.find("Brokers and delivery:").unwrap();
    let running = run.find("Running (limits").unwrap();
    // Every broker's settings in that section, none under Running.
    for flag in [
        "--sink ",
        "--kafka-brokers",
        "--rabbitmq-url",
        "--sqs-queue-url",
        "--nats-url",
        "--webhook-url",
    ] {
        let at = run.find(flag).unwrap_or_else(|| panic!("{flag}: {run}"));
        assert!(section < at && at < running, "{flag}: {run}");
    }
    for command in ["migrate", "status", "drop-slot"] {
        let text = help(command);
        assert!(!text.contains("--kafka-brokers"), "{command}: {text}");
        assert!(!text.contains("--mapping-id"), "{command}: {text}");
        assert!(text.contains("--pg-url"), "{command}: {text}");
    }
}

/// An old flag name is answered with its new name, not a spelling guess.
#[test]
fn an_old_flag_name_gets_the_rename() {
    for (args, want) in [
        (
            ["run", "--topic-template", "x"],
            "walbox: --topic-template is now called --mapping-topic-template",
        ),
        (
            ["init-slot", "--column-aggregate-id=agg", "--pg-url"],
            "walbox: --column-aggregate-id is now called --mapping-aggregate-id",
        ),
        (
            ["run", "--header-column", "a=b"],
            "walbox: --header-column is now called --mapping-header-column",
        ),
    ] {
        let out = walbox(&args, &[]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert_eq!(stderr.trim_end(), want);
    }
}

/// Each configuration `run` refuses, `config` refuses too, with the same
/// one line and exit status 2: what `config` passes, `run` starts with.
#[test]
fn config_and_run_refuse_the_same_configurations_with_the_same_line() {
    let pg = ("WALBOX_PG_URL", "postgres://walbox@127.0.0.1:1/app");
    let kafka = ("WALBOX_KAFKA_BROKERS", "127.0.0.1:1");
    let sasl = |mechanism: &'static str| {
        vec![
            pg,
            kafka,
            ("WALBOX_KAFKA_PROPERTY_SECURITY_PROTOCOL", "SASL_SSL"),
            ("WALBOX_KAFKA_PROPERTY_SASL_MECHANISM", mechanism),
            ("WALBOX_KAFKA_PROPERTY_SASL_USERNAME", "walbox"),
        ]
    };
    let with = |mut base: Vec<(&'static str, &'static str)>,
                extra: &[(&'static str, &'static str)]| {
        base.extend_from_slice(extra);
        base
    };
    // The environment, and what the line must say.
    let cases: Vec<(Vec<(&str, &str)>, &str)> = vec![
        (sasl("PLAIN"), "sasl.mechanism=PLAIN needs sasl.password"),
        (
            with(
                sasl("GSSAPI"),
                &[("WALBOX_KAFKA_PROPERTY_SASL_PASSWORD", "x")],
            ),
            "No provider for SASL mechanism GSSAPI",
        ),
        (
            with(
                sasl("SCRAM-SHA-999"),
                &[("WALBOX_KAFKA_PROPERTY_SASL_PASSWORD", "x")],
            ),
            "sasl.mechanism=SCRAM-SHA-999 is not one of",
        ),
        (
            vec![
                pg,
                kafka,
                (
                    "WALBOX_KAFKA_PROPERTY_MAX_IN_FLIGHT_REQUESTS_PER_CONNECTION",
                    "20",
                ),
            ],
            "`max.in.flight` must be set <= 5 when `enable.idempotence` is true",
        ),
        (
            vec![
                pg,
                kafka,
                ("WALBOX_KAFKA_PROPERTY_BOOTSTRAP_SERVERS", "other:9092"),
            ],
            "bootstrap.servers is kafka.brokers",
        ),
        (
            vec![pg, kafka, ("WALBOX_KAFKA_PROPERTY_ACKS", "1")],
            "acks=1 would break walbox's delivery guarantees",
        ),
        (
            vec![pg, kafka, ("WALBOX_KAFKA_PROPERTY_SASL_PASSWD", "x")],
            "No such configuration property: \"sasl.passwd\" (property sasl.passwd)",
        ),
        (
            vec![
                pg,
                kafka,
                ("WALBOX_OTLP_ENDPOINT", "http://collector:notaport"),
            ],
            "otlp_endpoint: not a URL (invalid port number)",
        ),
        (
            vec![
                ("WALBOX_PG_URL", "host=127.0.0.1 user=walbox sslpassword=x"),
                kafka,
            ],
            "sslpassword: encrypted client keys are not supported",
        ),
        (
            vec![
                ("WALBOX_PG_URL", "host=127.0.0.1 user=walbox port=abc"),
                kafka,
            ],
            "invalid integer value for connection option \"port\"",
        ),
        (
            vec![pg, kafka, ("WALBOX_SHARDS", "4")],
            "shards = 4: say which shard this process streams",
        ),
        (
            vec![
                pg,
                ("WALBOX_SINK", "rabbitmq"),
                ("WALBOX_RABBITMQ_URL", "amqp://walbox@127.0.0.1:1/%2F"),
                ("WALBOX_RABBITMQ_EXCHANGE", "events"),
                ("WALBOX_DELIVERY", "exactly-once"),
            ],
            "exactly-once",
        ),
    ];
    for (env, want) in cases {
        let config = walbox(&["config"], &env);
        let run = walbox(&["run"], &env);
        let line = |out: &Output| String::from_utf8_lossy(&out.stderr).trim_end().to_owned();
        let (config_line, run_line) = (line(&config), line(&run));
        assert_eq!(
            config.status.code(),
            Some(2),
            "config {env:?}: {config_line}"
        );
        assert_eq!(run.status.code(), Some(2), "run {env:?}: {run_line}");
        assert_eq!(config_line.lines().count(), 1, "{env:?}: {config_line}");
        assert_eq!(config_line, run_line, "{env:?}");
        assert!(config_line.contains(want), "{env:?}: {config_line}");
    }
}

/// With Postgres and Kafka both down at start, both are reported, Postgres
/// first (it is tried first), while walbox waits for them; SIGTERM then
/// stops it with 0.
#[test]
fn with_postgres_and_kafka_both_down_both_are_reported() {
    let (status, text) = run_until_it_waits_or_exits(
        &["run", "--kafka-brokers", "127.0.0.1:1"],
        &[("WALBOX_PG_URL", "postgres://walbox@127.0.0.1:1/app")],
    );
    assert!(status.success(), "{text}");
    let postgres = text
        .find("Postgres unreachable")
        .unwrap_or_else(|| panic!("{text}"));
    let kafka = text
        .find("Kafka unreachable")
        .unwrap_or_else(|| panic!("{text}"));
    assert!(postgres < kafka, "{text}");
    assert!(
        text.contains("127.0.0.1 port=1") || text.contains("127.0.0.1:1"),
        "{text}"
    );
}
