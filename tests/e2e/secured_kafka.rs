//! `walbox run` against secured Kafka listeners: TLS, mutual TLS with an
//! encrypted client key, and SASL SCRAM checked by the broker. The broker is
//! Tansu (`WALBOX_TANSU_BIN`, set by scripts/test); TLS is terminated by
//! stunnel in front of it, with certificates made by `openssl` for the test.
//!
//! Not testable here, and why (docs/configuration.md says so too): SASL
//! PLAIN (Tansu closes the connection at the PLAIN handshake, and accepts
//! any password), OAUTHBEARER (no token endpoint or broker that checks
//! tokens is available offline). Both are built in and covered by the sink's
//! producer-creation tests.

use std::time::Duration;

use walbox_test_harness::kafka::TestKafka;
use walbox_test_harness::pg::fresh_db;
use walbox_test_harness::port::free_port;
use walbox_test_harness::stunnel::Stunnel;
use walbox_test_harness::tansu::{Tansu, MEMORY, SQLITE};
use walbox_test_harness::tls::{Certificates, CLIENT_KEY_PASSWORD};

use crate::support::{
    expect_all, init, insert_events, spawn_run_with, stop, wait_broker, wait_exit, walbox,
};

/// The Tansu binary, or `None` (the test says it did not run).
fn tansu_bin(test: &str) -> Option<String> {
    let bin = Tansu::bin_from_env();
    if bin.is_none() {
        eprintln!("{test}: WALBOX_TANSU_BIN is not set (scripts/test sets it): test not run");
    }
    bin
}

/// A broker whose only listener is stunnel's TLS port.
struct TlsBroker {
    kafka: TestKafka,
    _stunnel: Stunnel,
    tansu: Tansu,
}

fn tls_broker(
    bin: &str,
    certs: &Certificates,
    client_certificates: bool,
    storage: &'static str,
) -> TlsBroker {
    let tls_port = free_port();
    let tansu = Tansu::start_with(bin, free_port(), tls_port, storage);
    let stunnel = Stunnel::start(tls_port, tansu.port(), certs, client_certificates);
    let mut properties = vec![
        ("security.protocol".to_owned(), "SSL".to_owned()),
        ("ssl.ca.location".to_owned(), path(&certs.ca())),
    ];
    if client_certificates {
        properties.extend([
            (
                "ssl.certificate.location".to_owned(),
                path(&certs.client_cert()),
            ),
            ("ssl.key.location".to_owned(), path(&certs.client_key())),
            (
                "ssl.key.password".to_owned(),
                CLIENT_KEY_PASSWORD.to_owned(),
            ),
        ]);
    }
    TlsBroker {
        kafka: TestKafka::Secured {
            bootstrap: format!("127.0.0.1:{tls_port}"),
            properties,
        },
        _stunnel: stunnel,
        tansu,
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
    let Some(bin) = tansu_bin("tls") else { return };
    let certs = Certificates::generate();
    let broker = tls_broker(&bin, &certs, false, MEMORY);
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
    drop(broker.tansu);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_with_an_encrypted_client_key_delivers_every_event() {
    let Some(bin) = tansu_bin("mtls") else { return };
    let certs = Certificates::generate();
    let broker = tls_broker(&bin, &certs, true, MEMORY);
    let kafka = &broker.kafka;
    wait_broker(kafka).await;
    let topic = kafka.create_topic(1).await;
    let db = fresh_db().await;
    let client = init(&db).await;

    // The key's password comes from a file, as from a mounted secret.
    let secrets = tempfile::tempdir().unwrap();
    let password_file = secrets.path().join("key-password");
    std::fs::write(&password_file, format!("{CLIENT_KEY_PASSWORD}\n")).unwrap();
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
    let line = error_line(status, &log);
    assert!(
        line.contains("refused the connection") && line.contains("certificate required"),
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
    let Some(bin) = tansu_bin("sasl") else { return };
    let certs = Certificates::generate();
    let mut broker = tls_broker(&bin, &certs, false, SQLITE);
    // Users are made while the broker is open, then it restarts requiring them.
    wait_broker(&broker.kafka).await;
    broker
        .tansu
        .create_scram_user("walbox512", "s3cret-512", "scram512");
    broker
        .tansu
        .create_scram_user("walbox256", "s3cret-256", "scram256");
    broker.tansu.kill9();
    broker.tansu.require_authentication();
    broker.tansu.up();
    let ca = path(&certs.ca());
    let TestKafka::Secured { properties, .. } = &mut broker.kafka else {
        unreachable!()
    };
    properties[0].1 = "SASL_SSL".to_owned();
    properties.extend(
        [
            ("sasl.mechanism", "SCRAM-SHA-512"),
            ("sasl.username", "walbox512"),
            ("sasl.password", "s3cret-512"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned())),
    );
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
