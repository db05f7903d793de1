//! `walbox run` against secured listeners of Apache Kafka itself (KRaft,
//! `WALBOX_KAFKA_LIBS`): TLS, mutual TLS with an encrypted client key, SASL
//! SCRAM-SHA-256/512 and PLAIN checked by the broker, and ACLs enforced by
//! its `StandardAuthorizer`, with certificates made by `openssl` for the
//! test. Each refusal must be one line that names the setting to check.
//!
//! Not testable here, and why (docs/configuration.md says so too):
//! OAUTHBEARER (no token endpoint that issues tokens is available
//! offline). It is built in and covered by the sink's producer-creation
//! tests.

use std::time::Duration;

use walbox_test_harness::apache_kafka::{KafkaCluster, Secured};
use walbox_test_harness::kafka::TestKafka;
use walbox_test_harness::pg::fresh_db;
use walbox_test_harness::tls::{Certificates, CLIENT_KEY_PASSWORD};

use crate::support::{
    doctor_checks, exit_within, expect_all, init, insert_events, spawn_run_with, stop, verdicts_of,
    wait_broker, wait_exit, wait_log, walbox, DoctorCheck,
};

/// A one-node Apache Kafka whose client listener is secured as `secured`
/// says, and the harness' view of it with `properties` (TLS settings are
/// added).
struct SecuredBroker {
    cluster: KafkaCluster,
    kafka: TestKafka,
}

fn secured_broker(secured: Secured<'_>, properties: &[(&str, &str)]) -> SecuredBroker {
    let ca = path(&secured.certs.ca());
    let (cert, key) = (
        path(&secured.certs.client_cert()),
        path(&secured.certs.client_key()),
    );
    let client_auth = secured.client_auth;
    let protocol = if secured.sasl { "SASL_SSL" } else { "SSL" };
    let cluster = tokio::task::block_in_place(|| KafkaCluster::start_secured(secured));
    let mut all = vec![
        ("security.protocol".to_owned(), protocol.to_owned()),
        ("ssl.ca.location".to_owned(), ca),
    ];
    if client_auth {
        all.extend([
            ("ssl.certificate.location".to_owned(), cert),
            ("ssl.key.location".to_owned(), key),
            (
                "ssl.key.password".to_owned(),
                CLIENT_KEY_PASSWORD.to_owned(),
            ),
        ]);
    }
    all.extend(
        properties
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string())),
    );
    let kafka = TestKafka::Secured {
        bootstrap: cluster.secured_bootstrap(),
        properties: all,
    };
    SecuredBroker { cluster, kafka }
}

/// TLS only: no client certificates, no SASL, no ACLs.
fn tls_only(certs: &Certificates) -> Secured<'_> {
    Secured {
        certs,
        client_auth: false,
        sasl: false,
        users: &[],
        authorizer: false,
    }
}

fn path(p: &std::path::Path) -> String {
    p.to_str().expect("a UTF-8 temp path").to_owned()
}

/// `--kafka-property k=v` for each pair.
fn property_flags(pairs: &[(&str, &str)]) -> Vec<String> {
    pairs
        .iter()
        .flat_map(|(k, v)| ["--kafka-property".to_owned(), format!("{k}={v}")])
        .collect()
}

/// Runs `walbox run` with `flags` and `env` until it exits by itself (it
/// must, within 40 s); returns its combined output.
async fn run_until_exit(
    db: &walbox_test_harness::pg::TestDb,
    kafka: &TestKafka,
    flags: &[String],
    env: &[(&str, &str)],
) -> (std::process::ExitStatus, String) {
    let mut command = walbox(db, &[]);
    command.envs(env.iter().copied());
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let mut relay = spawn_run_with(command, kafka, &flags);
    wait_exit(&mut relay).await
}

/// The last line, which must be walbox's one error line.
fn error_line(status: std::process::ExitStatus, log: &str) -> String {
    assert!(!status.success(), "walbox should have failed:\n{log}");
    let last = log.lines().last().unwrap_or_default().to_owned();
    assert!(last.starts_with("walbox: "), "one error line, got:\n{log}");
    last
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_delivers_every_event_and_an_untrusted_broker_is_one_line() {
    let certs = Certificates::generate();
    let broker = secured_broker(tls_only(&certs), &[]);
    let kafka = &broker.kafka;
    wait_broker(kafka).await;
    let topic = kafka.create_topic(2).await;
    let db = fresh_db().await;
    let client = init(&db).await;

    let ca = path(&certs.ca());
    let mut flags = property_flags(&[("security.protocol", "SSL"), ("ssl.ca.location", &ca)]);
    flags.extend(["--mapping-topic-template".to_owned(), topic.clone()]);
    let flag_refs: Vec<&str> = flags.iter().map(String::as_str).collect();
    let mut relay = spawn_run_with(walbox(&db, &[]), kafka, &flag_refs);
    insert_events(&client, 0, 200, |k| 1 + k % 7, 10).await;
    let duplicates = expect_all(kafka, &topic, 200).await;
    assert_eq!(duplicates, 0, "a clean run sends nothing twice");
    stop(&mut relay).await;

    // A CA that did not sign the broker's certificate: one line that names
    // the certificate problem and the setting to check, at once.
    let other = path(&certs.other_ca());
    let started = std::time::Instant::now();
    let (status, log) = run_until_exit(
        &db,
        kafka,
        &property_flags(&[("security.protocol", "SSL"), ("ssl.ca.location", &other)]),
        &[],
    )
    .await;
    let line = error_line(status, &log);
    assert!(
        line.contains("refused the connection") && line.contains("certificate verify failed"),
        "{line}"
    );
    assert!(line.contains("ssl.ca.location"), "{line}");
    assert!(
        started.elapsed() < Duration::from_secs(9),
        "a certificate problem stops walbox before the 10 s broker timeout: {:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_with_an_encrypted_client_key_delivers_every_event() {
    let certs = Certificates::generate();
    let broker = secured_broker(
        Secured {
            client_auth: true,
            ..tls_only(&certs)
        },
        &[],
    );
    let kafka = &broker.kafka;
    wait_broker(kafka).await;
    let topic = kafka.create_topic(1).await;
    let db = fresh_db().await;
    let client = init(&db).await;

    // The key's password comes from a file, as from a mounted secret.
    let secrets = tempfile::tempdir().unwrap();
    let password_file = secrets.path().join("key-password");
    walbox_test_harness::secret_file::write(&password_file, format!("{CLIENT_KEY_PASSWORD}\n"));
    let password_file = path(&password_file);
    let env = [(
        "WALBOX_KAFKA_PROPERTY_SSL_KEY_PASSWORD_FILE",
        password_file.as_str(),
    )];
    let (ca, cert, key) = (
        path(&certs.ca()),
        path(&certs.client_cert()),
        path(&certs.client_key()),
    );
    let mut flags = property_flags(&[
        ("security.protocol", "SSL"),
        ("ssl.ca.location", &ca),
        ("ssl.certificate.location", &cert),
        ("ssl.key.location", &key),
    ]);
    flags.extend(["--mapping-topic-template".to_owned(), topic.clone()]);
    let flag_refs: Vec<&str> = flags.iter().map(String::as_str).collect();
    let mut command = walbox(&db, &[]);
    command.envs(env);
    let mut relay = spawn_run_with(command, kafka, &flag_refs);
    insert_events(&client, 0, 100, |_| 10, 5).await;
    expect_all(kafka, &topic, 100).await;
    let log = stop(&mut relay).await;
    assert!(!log.contains(CLIENT_KEY_PASSWORD), "{log}");

    // Without a client certificate the listener refuses walbox.
    let (status, log) = run_until_exit(
        &db,
        kafka,
        &property_flags(&[("security.protocol", "SSL"), ("ssl.ca.location", &ca)]),
        &[],
    )
    .await;
    // Kafka's JVM answers a missing client certificate with TLS alert 42
    // ("bad certificate"); OpenSSL-based listeners with 116 ("certificate
    // required"). Either way the line names the settings to check.
    let line = error_line(status, &log);
    assert!(
        line.contains("refused the connection")
            && (line.contains("certificate required") || line.contains("bad certificate"))
            && line.contains("ssl.certificate.location"),
        "{line}"
    );

    // A wrong key password: one line, and the password is not in it.
    let (status, log) = run_until_exit(
        &db,
        kafka,
        &property_flags(&[
            ("security.protocol", "SSL"),
            ("ssl.ca.location", &ca),
            ("ssl.certificate.location", &cert),
            ("ssl.key.location", &key),
        ]),
        &[("WALBOX_KAFKA_PROPERTY_SSL_KEY_PASSWORD", "hunter2-wrong")],
    )
    .await;
    let line = error_line(status, &log);
    assert!(!log.contains("hunter2-wrong"), "{log}");
    assert!(line.contains("ssl.key"), "{line}");
    eprintln!("a wrong key password: {line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sasl_scram_over_tls_is_checked_by_the_broker() {
    let certs = Certificates::generate();
    let broker = secured_broker(
        Secured {
            sasl: true,
            users: &[("walbox512", "s3cret-512"), ("walbox256", "s3cret-256")],
            ..tls_only(&certs)
        },
        &[
            ("sasl.mechanism", "SCRAM-SHA-512"),
            ("sasl.username", "walbox512"),
            ("sasl.password", "s3cret-512"),
        ],
    );
    let ca = path(&certs.ca());
    let kafka = &broker.kafka;
    wait_broker(kafka).await;
    let topic = kafka.create_topic(2).await;
    let db = fresh_db().await;
    let client = init(&db).await;

    // SCRAM-SHA-512, the password from the environment.
    let scram = |mechanism: &str, user: &str| {
        let mut flags = property_flags(&[
            ("security.protocol", "SASL_SSL"),
            ("ssl.ca.location", &ca),
            ("sasl.mechanism", mechanism),
            ("sasl.username", user),
        ]);
        flags.extend(["--mapping-topic-template".to_owned(), topic.clone()]);
        flags
    };
    let flags = scram("SCRAM-SHA-512", "walbox512");
    let flag_refs: Vec<&str> = flags.iter().map(String::as_str).collect();
    let mut command = walbox(&db, &[]);
    command.env("WALBOX_KAFKA_PROPERTY_SASL_PASSWORD", "s3cret-512");
    let mut relay = spawn_run_with(command, kafka, &flag_refs);
    insert_events(&client, 0, 100, |k| 1 + k % 5, 10).await;
    expect_all(kafka, &topic, 100).await;
    stop(&mut relay).await;

    // SCRAM-SHA-256, another user, continuing from the same slot.
    let flags = scram("SCRAM-SHA-256", "walbox256");
    let flag_refs: Vec<&str> = flags.iter().map(String::as_str).collect();
    let mut command = walbox(&db, &[]);
    command.env("WALBOX_KAFKA_PROPERTY_SASL_PASSWORD", "s3cret-256");
    let mut relay = spawn_run_with(command, kafka, &flag_refs);
    insert_events(&client, 100, 150, |_| 10, 10).await;
    let duplicates = expect_all(kafka, &topic, 150).await;
    assert_eq!(
        duplicates, 0,
        "the second run starts where the first stopped"
    );
    stop(&mut relay).await;

    // A wrong password: refused at once, in one line, without the password.
    let (status, log) = run_until_exit(
        &db,
        kafka,
        &scram("SCRAM-SHA-512", "walbox512"),
        &[("WALBOX_KAFKA_PROPERTY_SASL_PASSWORD", "hunter2-wrong")],
    )
    .await;
    let line = error_line(status, &log);
    assert!(!log.contains("hunter2-wrong"), "{log}");
    assert!(
        line.contains("refused the connection") && line.contains("SASL authentication"),
        "{line}"
    );
    assert!(line.contains("sasl.password"), "{line}");
}

/// `--kafka-property k=v` flags of a SASL user over TLS, writing to `topic`.
fn sasl_flags(ca: &str, mechanism: &str, user: &str, topic: &str) -> Vec<String> {
    let mut flags = property_flags(&[
        ("security.protocol", "SASL_SSL"),
        ("ssl.ca.location", ca),
        ("sasl.mechanism", mechanism),
        ("sasl.username", user),
    ]);
    flags.extend(["--mapping-topic-template".to_owned(), topic.to_owned()]);
    flags
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sasl_plain_over_tls_is_checked_by_the_broker() {
    let certs = Certificates::generate();
    let broker = secured_broker(
        Secured {
            sasl: true,
            users: &[("plainuser", "pl4in-secret")],
            ..tls_only(&certs)
        },
        &[
            ("sasl.mechanism", "PLAIN"),
            ("sasl.username", "plainuser"),
            ("sasl.password", "pl4in-secret"),
        ],
    );
    let kafka = &broker.kafka;
    wait_broker(kafka).await;
    let topic = kafka.create_topic(2).await;
    let db = fresh_db().await;
    let client = init(&db).await;
    let ca = path(&certs.ca());
    let flags = sasl_flags(&ca, "PLAIN", "plainuser", &topic);
    let flag_refs: Vec<&str> = flags.iter().map(String::as_str).collect();
    let mut command = walbox(&db, &[]);
    command.env("WALBOX_KAFKA_PROPERTY_SASL_PASSWORD", "pl4in-secret");
    let mut relay = spawn_run_with(command, kafka, &flag_refs);
    insert_events(&client, 0, 100, |k| 1 + k % 5, 10).await;
    assert_eq!(expect_all(kafka, &topic, 100).await, 0);
    let log = stop(&mut relay).await;
    assert!(!log.contains("pl4in-secret"), "{log}");

    let (status, log) = run_until_exit(
        &db,
        kafka,
        &sasl_flags(&ca, "PLAIN", "plainuser", &topic),
        &[("WALBOX_KAFKA_PROPERTY_SASL_PASSWORD", "hunter2-wrong")],
    )
    .await;
    let line = error_line(status, &log);
    assert!(!log.contains("hunter2-wrong"), "{log}");
    assert!(
        line.contains("refused the connection") && line.contains("SASL authentication"),
        "{line}"
    );
    assert!(line.contains("sasl.password"), "{line}");
}

/// ACLs on Apache Kafka's `StandardAuthorizer`: a principal allowed to
/// write delivers; one without Write on the topic (but IdempotentWrite on
/// the cluster), one with neither (its idempotent producer gets no
/// producer id: since Kafka 3.0, Write on any topic or IdempotentWrite on
/// the cluster allows one), and (exactly-once) one without Write on its
/// transactional id each get a one-line refusal, and nothing is confirmed
/// past an undelivered event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acls_refuse_in_one_line_what_a_principal_may_not_do() {
    let certs = Certificates::generate();
    let users = [
        ("writer", "w-secret"),
        ("reader", "r-secret"),
        ("nowrite", "n-secret"),
        ("nocreate", "c-secret"),
        ("noread", "x-secret"),
    ];
    let broker = secured_broker(
        Secured {
            sasl: true,
            users: &users,
            authorizer: true,
            ..tls_only(&certs)
        },
        // The harness reads topics back as the writer (ACLs below).
        &[
            ("sasl.mechanism", "SCRAM-SHA-256"),
            ("sasl.username", "writer"),
            ("sasl.password", "w-secret"),
        ],
    );
    let cluster = &broker.cluster;
    // A topic nobody made, which nocreate may write but not create.
    let missing = walbox_test_harness::unique_name("never-created").replace('_', "-");
    // Topics are made through the harness' plaintext listener (a super user).
    let topic = cluster.kafka().create_topic(2).await;
    let progress = cluster
        .kafka()
        .create_topic_configured(1, 1, &[("cleanup.policy", "compact")])
        .await;
    tokio::task::block_in_place(|| {
        for user in ["writer", "reader", "nowrite"] {
            let principal = format!("User:{user}");
            for op in ["Describe", "Read"] {
                cluster.allow(&principal, op, &["--topic", &topic]);
                cluster.allow(&principal, op, &["--topic", &progress]);
                cluster.allow(&principal, op, &["--group", "*"]);
            }
        }
        // reader: no Write on the topic; nowrite: no Write anywhere, no
        // IdempotentWrite.
        cluster.allow("User:writer", "Write", &["--topic", &topic]);
        for op in ["Write", "Describe"] {
            cluster.allow("User:nocreate", op, &["--topic", &missing]);
        }
        for user in ["writer", "reader"] {
            cluster.allow(&format!("User:{user}"), "IdempotentWrite", &["--cluster"]);
        }
        cluster.allow("User:writer", "Write", &["--topic", &progress]);
        // noread: may write, not read back.
        for op in ["Write", "Describe"] {
            cluster.allow("User:noread", op, &["--topic", &topic]);
        }
    });
    let kafka = &broker.kafka;
    let db = fresh_db().await;
    let client = init(&db).await;
    let ca = path(&certs.ca());
    let run = |user: &str, password: &str, extra: &[&str]| {
        let target = if user == "nocreate" { &missing } else { &topic };
        let mut flags = sasl_flags(&ca, "SCRAM-SHA-256", user, target);
        flags.extend(extra.iter().map(|s| s.to_string()));
        let mut command = walbox(&db, &[]);
        command.env("WALBOX_KAFKA_PROPERTY_SASL_PASSWORD", password);
        (command, flags)
    };

    // walbox doctor sees each principal's rights as the broker evaluates
    // them, writing nothing: the refusals below, found before any run.
    let doctor = |user: &str, password: &str, extra: &[&str]| {
        let (mut command, flags) = run(user, password, extra);
        let out = command
            .args(["doctor", "--json", "--kafka-brokers", &kafka.bootstrap()])
            .args(&flags)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let (found, stdout) = doctor_checks(&out, "kafka.");
        assert!(!stdout.contains(password) && !stderr.contains(password));
        found
    };
    let verdicts = verdicts_of;
    let said = |found: &[DoctorCheck], check: &str| -> String {
        found
            .iter()
            .filter(|c| c.0 == check)
            .map(|c| c.2.clone())
            .collect::<Vec<_>>()
            .join(" | ")
    };
    let writer = tokio::task::block_in_place(|| doctor("writer", "w-secret", &[]));
    assert_eq!(verdicts(&writer, "kafka.connect"), ["pass"], "{writer:?}");
    assert_eq!(verdicts(&writer, "kafka.idempotent_write"), ["pass"]);
    assert_eq!(verdicts(&writer, "kafka.topic.rights"), ["pass"]);
    let reader = tokio::task::block_in_place(|| doctor("reader", "r-secret", &[]));
    assert_eq!(verdicts(&reader, "kafka.topic.rights"), ["fail"]);
    let reader_said = said(&reader, "kafka.topic.rights");
    assert!(reader_said.contains("lacks Write"), "{reader_said}");
    assert!(
        reader_said.contains(&format!("--operation Write --topic {topic}")),
        "{reader_said}"
    );
    let nowrite = tokio::task::block_in_place(|| doctor("nowrite", "n-secret", &[]));
    assert_eq!(
        verdicts(&nowrite, "kafka.idempotent_write"),
        ["fail"],
        "{nowrite:?}"
    );
    let noread = tokio::task::block_in_place(|| doctor("noread", "x-secret", &[]));
    assert_eq!(
        verdicts(&noread, "kafka.topic.rights"),
        ["warn"],
        "{noread:?}"
    );
    assert!(said(&noread, "kafka.topic.rights").contains("may not Read"));
    let nocreate = tokio::task::block_in_place(|| {
        doctor("nocreate", "c-secret", &["--topics-create", "true"])
    });
    assert_eq!(verdicts(&nocreate, "kafka.topic"), ["warn"], "{nocreate:?}");
    assert!(said(&nocreate, "kafka.topic").contains("--operation Create"));
    let eos = tokio::task::block_in_place(|| {
        doctor(
            "writer",
            "w-secret",
            &[
                "--delivery",
                "exactly-once",
                "--transactions-progress-topic",
                progress.as_str(),
            ],
        )
    });
    assert_eq!(
        verdicts(&eos, "kafka.topic.rights"),
        ["pass", "pass"],
        "{eos:?}"
    );
    // No DescribeConfigs right: the settings are not checked, and said so.
    assert_eq!(
        verdicts(&eos, "kafka.topic.settings"),
        ["unchecked", "unchecked"],
        "{eos:?}"
    );
    assert!(said(&eos, "kafka.topic.settings").contains("DescribeConfigs"));
    assert_eq!(verdicts(&eos, "kafka.transactional_id"), ["info"]);

    // Allowed: every event.
    let (command, flags) = run("writer", "w-secret", &[]);
    let flag_refs: Vec<&str> = flags.iter().map(String::as_str).collect();
    let mut relay = spawn_run_with(command, kafka, &flag_refs);
    insert_events(&client, 0, 50, |_| 5, 5).await;
    assert_eq!(expect_all(kafka, &topic, 50).await, 0);
    stop(&mut relay).await;

    // No Read: a start cannot look for what it may have delivered before
    // (events written while walbox was down); it says so and sends them
    // (skip_delivered's limit: duplicates, never loss).
    insert_events(&client, 50, 60, |_| 5, 5).await;
    let (command, flags) = run("noread", "x-secret", &[]);
    let flag_refs: Vec<&str> = flags.iter().map(String::as_str).collect();
    let mut relay = spawn_run_with(command, kafka, &flag_refs);
    wait_log(&relay, "could not read the topic back").await;
    let line = relay
        .log()
        .lines()
        .find(|l| l.contains("could not read the topic back"))
        .unwrap()
        .to_owned();
    assert!(line.contains("Describe and Read"), "{line}");
    assert_eq!(expect_all(kafka, &topic, 60).await, 0);
    stop(&mut relay).await;
    let confirmed = walbox_test_harness::slot::current_wal_lsn(&client).await;

    // No Write on the topic.
    insert_events(&client, 60, 70, |_| 5, 5).await;
    let mut refusals = Vec::new();
    for (user, password, extra, needle) in [
        ("reader", "r-secret", &[][..], "Write and Describe on topic"),
        ("nowrite", "n-secret", &[][..], "IdempotentWrite"),
        (
            "writer",
            "w-secret",
            &[
                "--delivery",
                "exactly-once",
                "--transactions-progress-topic",
                progress.as_str(),
            ][..],
            "transactional id",
        ),
        (
            "nocreate",
            "c-secret",
            &["--topics-create", "true"][..],
            "needs Create on the topic",
        ),
    ] {
        let (command, flags) = run(user, password, extra);
        let flag_refs: Vec<&str> = flags.iter().map(String::as_str).collect();
        let mut relay = spawn_run_with(command, kafka, &flag_refs);
        let status = exit_within(&mut relay, Duration::from_secs(40)).await;
        let log = relay.log();
        let line = error_line(status, &log);
        assert!(!log.contains(password), "{log}");
        assert!(line.contains("uthoriz"), "{user}: {line}");
        assert!(line.contains(needle), "{user}: {line}");
        refusals.push(format!("{user}: {line}"));
        let now = walbox_test_harness::slot::confirmed_flush_lsn(&client, "walbox")
            .await
            .unwrap();
        assert!(
            now <= confirmed,
            "{user}: the slot moved past refused events"
        );
    }
    for r in refusals {
        eprintln!("{r}");
    }
}

/// Certificates are read at start (docs/operations.md, "Rotating
/// certificates"): a running walbox streams on while its CA file is
/// replaced, and only a restart reads the new one: refused in one line when
/// the rotation went wrong, streaming when it is right, nothing lost or
/// repeated across either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_are_read_at_start_and_a_restart_takes_the_rotated_ones() {
    let certs = Certificates::generate();
    let broker = secured_broker(tls_only(&certs), &[]);
    let kafka = &broker.kafka;
    wait_broker(kafka).await;
    let topic = kafka.create_topic(2).await;
    let db = fresh_db().await;
    let client = init(&db).await;
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    std::fs::copy(certs.ca(), &ca).unwrap();
    let mut flags = property_flags(&[
        ("security.protocol", "SSL"),
        ("ssl.ca.location", &path(&ca)),
    ]);
    flags.extend(["--mapping-topic-template".to_owned(), topic.clone()]);
    let flag_refs: Vec<&str> = flags.iter().map(String::as_str).collect();
    let mut relay = spawn_run_with(walbox(&db, &[]), kafka, &flag_refs);
    insert_events(&client, 0, 100, |k| 1 + k % 5, 7).await;
    assert_eq!(expect_all(kafka, &topic, 100).await, 0);

    // A rotation gone wrong: the file now holds a CA that did not sign the
    // broker's certificate. The running walbox does not read it again.
    std::fs::copy(certs.other_ca(), &ca).unwrap();
    insert_events(&client, 100, 200, |k| 1 + k % 5, 7).await;
    assert_eq!(expect_all(kafka, &topic, 200).await, 0);
    stop(&mut relay).await;

    // A restart reads it: one line naming the setting.
    let (status, log) = run_until_exit(&db, kafka, &flags, &[]).await;
    let line = error_line(status, &log);
    assert!(line.contains("ssl.ca.location"), "{line}");

    // The right CA back, and the restart a renewal's hook makes.
    std::fs::copy(certs.ca(), &ca).unwrap();
    let mut relay = spawn_run_with(walbox(&db, &[]), kafka, &flag_refs);
    insert_events(&client, 200, 300, |k| 1 + k % 5, 7).await;
    assert_eq!(
        expect_all(kafka, &topic, 300).await,
        0,
        "nothing repeated across the restarts"
    );
    stop(&mut relay).await;
}
