//! TLS: require, verify-full with the right and a wrong CA.

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use slot_manager::{connect_control, Error, PgConfig, ReplicationClient};
use walbox_test_harness::pg::PgServer;

struct Pki {
    ca_pem: String,
    cert_pem: String,
    key_pem: String,
}

fn pki() -> Pki {
    pki_for(&["localhost", "127.0.0.1"])
}

/// A test CA: its certificate (PEM) and what signs with it.
fn test_ca() -> (String, Issuer<'static, KeyPair>) {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "walbox test CA");
    let ca = ca_params.self_signed(&ca_key).unwrap();
    (ca.pem(), Issuer::new(ca_params, ca_key))
}

/// A certificate signed by `issuer`: subjectAltNames `sans`, common name
/// `cn` if given. Returns the certificate and its key, PEM.
fn signed(issuer: &Issuer<'static, KeyPair>, sans: &[&str], cn: Option<&str>) -> (String, String) {
    let key = KeyPair::generate().unwrap();
    let mut params =
        CertificateParams::new(sans.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>()).unwrap();
    if let Some(cn) = cn {
        params.distinguished_name.push(DnType::CommonName, cn);
    }
    let cert = params.signed_by(&key, issuer).unwrap();
    (cert.pem(), key.serialize_pem())
}

/// A CA and a server certificate for `names` signed by it.
fn pki_for(names: &[&str]) -> Pki {
    let (ca_pem, issuer) = test_ca();
    let (cert_pem, key_pem) = signed(&issuer, names, None);
    Pki {
        ca_pem,
        cert_pem,
        key_pem,
    }
}

/// A server with `pki`'s certificate and key, TLS on; pg_hba still to say.
fn tls_builder(pki: &Pki) -> walbox_test_harness::pg::PgServerBuilder {
    PgServer::builder()
        .file("server.crt", pki.cert_pem.as_bytes())
        .file("server.key", pki.key_pem.as_bytes())
        .setting("ssl", "on")
        .setting("ssl_cert_file", "server.crt")
        .setting("ssl_key_file", "server.key")
}

/// A server that accepts only TLS connections.
fn tls_server(pki: &Pki) -> PgServer {
    tls_builder(pki)
        .hba("local all all trust\nhostssl all all 127.0.0.1/32 trust\nhostnossl all all 127.0.0.1/32 reject\n")
        .start()
        .unwrap()
}

/// The superuser over the Unix socket (pg_hba's TCP rules vary by test).
async fn superuser(server: &PgServer) -> tokio_postgres::Client {
    let mut c = tokio_postgres::Config::new();
    c.host_path(server.socket_dir())
        .port(server.port())
        .user("postgres")
        .dbname("postgres");
    walbox_test_harness::pg::connect(&c).await.unwrap()
}

fn config(server: &PgServer, host: &str, ssl: &str) -> PgConfig {
    PgConfig::parse(&format!(
        "host={host} port={} user=postgres dbname=postgres {ssl}",
        server.port()
    ))
    .unwrap()
}

#[tokio::test]
async fn require_and_verify_full_connect_over_tls() {
    let pki = pki();
    let server = tls_server(&pki);
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, &pki.ca_pem).unwrap();

    for ssl in [
        "sslmode=require".to_owned(),
        format!("sslmode=verify-ca sslrootcert={}", ca.display()),
        format!("sslmode=verify-full sslrootcert={}", ca.display()),
    ] {
        for host in ["localhost", "127.0.0.1"] {
            let config = config(&server, host, &ssl);
            let mut client = ReplicationClient::connect(&config)
                .await
                .unwrap_or_else(|e| panic!("{ssl} {host}: {e}"));
            client.identify_system().await.unwrap();
            // The control connection uses the same TLS settings.
            let control = connect_control(&config)
                .await
                .unwrap_or_else(|e| panic!("control {ssl}: {e}"));
            let ssl_in_use: bool = control
                .query_one(
                    "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            assert!(ssl_in_use, "{ssl}");
        }
    }
    // Without TLS the server's pg_hba rejects the connection.
    let e = ReplicationClient::connect(&config(&server, "127.0.0.1", "sslmode=disable"))
        .await
        .unwrap_err();
    assert_eq!(e.sqlstate(), Some("28000"), "{e}");
}

#[tokio::test]
async fn verify_full_refuses_a_certificate_from_another_ca() {
    let pki = pki();
    let server = tls_server(&pki);
    let other = self::pki();
    let dir = tempfile::tempdir().unwrap();
    let wrong_ca = dir.path().join("wrong-ca.pem");
    std::fs::write(&wrong_ca, &other.ca_pem).unwrap();
    for mode in ["verify-full", "verify-ca"] {
        let config = config(
            &server,
            "localhost",
            &format!("sslmode={mode} sslrootcert={}", wrong_ca.display()),
        );
        let e = ReplicationClient::connect(&config).await.unwrap_err();
        assert!(matches!(e, Error::Tls(_)), "{mode}: {e}");
        assert!(!e.is_transient());
        assert!(connect_control(&config).await.is_err(), "{mode}");
    }
}

#[tokio::test]
async fn verify_full_checks_the_host_name_and_verify_ca_does_not() {
    // A certificate for another name, reached as 127.0.0.1.
    let pki = pki_for(&["db.walbox.test"]);
    let server = tls_server(&pki);
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, &pki.ca_pem).unwrap();
    let full = config(
        &server,
        "127.0.0.1",
        &format!("sslmode=verify-full sslrootcert={}", ca.display()),
    );
    let e = ReplicationClient::connect(&full).await.unwrap_err();
    assert!(matches!(e, Error::Tls(_)), "{e}");
    let ca_only = config(
        &server,
        "127.0.0.1",
        &format!("sslmode=verify-ca sslrootcert={}", ca.display()),
    );
    ReplicationClient::connect(&ca_only).await.unwrap();
}

/// A CA, a server certificate for localhost and a client certificate for
/// `user` (its common name, which `cert` authentication matches), all PEM.
fn pki_with_client(user: &str) -> (Pki, String, String) {
    let (ca_pem, issuer) = test_ca();
    let (cert_pem, key_pem) = signed(&issuer, &["localhost", "127.0.0.1"], None);
    let (client_cert, client_key) = signed(&issuer, &[], Some(user));
    (
        Pki {
            ca_pem,
            cert_pem,
            key_pem,
        },
        client_cert,
        client_key,
    )
}

#[tokio::test]
async fn a_client_certificate_authenticates_both_connections() {
    let (pki, client_cert, client_key) = pki_with_client("certuser");
    let server = tls_builder(&pki)
        .file("ca.crt", pki.ca_pem.as_bytes())
        .setting("ssl_ca_file", "ca.crt")
        .hba("local all all trust\nhostssl all certuser 127.0.0.1/32 cert\nhost all all 127.0.0.1/32 reject\n")
        .start()
        .unwrap();
    let admin = superuser(&server).await;
    admin
        .batch_execute("CREATE ROLE certuser LOGIN REPLICATION")
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = (
        dir.path().join("ca.pem"),
        dir.path().join("certuser.crt"),
        dir.path().join("certuser.key"),
    );
    std::fs::write(&ca, &pki.ca_pem).unwrap();
    std::fs::write(&cert, &client_cert).unwrap();
    std::fs::write(&key, &client_key).unwrap();
    let with_cert = PgConfig::parse(&format!(
        "host=localhost port={} user=certuser dbname=postgres sslmode=verify-full sslrootcert={} sslcert={} sslkey={}",
        server.port(),
        ca.display(),
        cert.display(),
        key.display()
    ))
    .unwrap();
    let mut replication = ReplicationClient::connect(&with_cert)
        .await
        .unwrap_or_else(|e| panic!("replication connection with a client certificate: {e}"));
    replication.identify_system().await.unwrap();
    let control = connect_control(&with_cert)
        .await
        .unwrap_or_else(|e| panic!("control connection with a client certificate: {e}"));
    let user: String = control
        .query_one("SELECT current_user::text", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(user, "certuser");

    // Without the certificate, `cert` authentication refuses: a definite error.
    let without = PgConfig::parse(&format!(
        "host=localhost port={} user=certuser dbname=postgres sslmode=verify-full sslrootcert={}",
        server.port(),
        ca.display()
    ))
    .unwrap();
    let e = ReplicationClient::connect(&without).await.unwrap_err();
    assert!(!e.is_transient(), "{e}");
    // A key file that is not a key: one line naming the file.
    let e = ReplicationClient::connect(
        &PgConfig::parse(&format!(
            "host=localhost port={} user=certuser dbname=postgres sslmode=verify-full sslrootcert={} sslcert={} sslkey={}",
            server.port(),
            ca.display(),
            cert.display(),
            ca.display()
        ))
        .unwrap(),
    )
    .await
    .unwrap_err();
    assert!(e.to_string().contains("read sslkey"), "{e}");
}

#[tokio::test]
async fn channel_binding_is_used_over_tls_and_required_when_asked() {
    let pki = pki();
    let server = tls_builder(&pki)
        .setting("password_encryption", "scram-sha-256")
        .hba("local all all trust\nhostssl all scramuser 127.0.0.1/32 scram-sha-256\nhost all trusted 127.0.0.1/32 trust\nhost all scramuser 127.0.0.1/32 scram-sha-256\n")
        .start()
        .unwrap();
    let admin = superuser(&server).await;
    admin
        .batch_execute(
            "CREATE ROLE scramuser LOGIN REPLICATION PASSWORD 'bind me';
             CREATE ROLE trusted LOGIN REPLICATION",
        )
        .await
        .unwrap();
    let config = |user: &str, rest: &str| {
        PgConfig::parse(&format!(
            "host=127.0.0.1 port={} user={user} password='bind me' dbname=postgres {rest}",
            server.port()
        ))
        .unwrap()
    };
    // SCRAM-SHA-256-PLUS, bound to the server's certificate: the server
    // checks the binding, so a wrong hash would fail here.
    for rest in ["sslmode=require channel_binding=require", "sslmode=require"] {
        let c = config("scramuser", rest);
        let mut client = ReplicationClient::connect(&c)
            .await
            .unwrap_or_else(|e| panic!("{rest}: {e}"));
        client.identify_system().await.unwrap();
        connect_control(&c)
            .await
            .unwrap_or_else(|e| panic!("control, {rest}: {e}"));
    }
    // Required, and impossible: refused before anything is sent, or after
    // an authentication that did not bind.
    let e = ReplicationClient::connect(&config(
        "scramuser",
        "sslmode=disable channel_binding=require",
    ))
    .await
    .unwrap_err();
    assert!(
        e.to_string().contains("channel_binding=require needs TLS"),
        "{e}"
    );
    let e = ReplicationClient::connect(&config(
        "trusted",
        "sslmode=require channel_binding=require",
    ))
    .await
    .unwrap_err();
    assert!(e.to_string().contains("without channel binding"), "{e}");
    assert!(!e.is_transient());
    // Without TLS, plain SCRAM still works when binding is not required.
    let mut client = ReplicationClient::connect(&config("scramuser", "sslmode=disable"))
        .await
        .unwrap();
    client.identify_system().await.unwrap();
}

/// A CA and a server certificate with no subjectAltName, naming `cn` in its
/// subject alone (older certificates, some private CAs).
fn pki_common_name_only(cn: &str) -> Pki {
    let (ca_pem, issuer) = test_ca();
    let (cert_pem, key_pem) = signed(&issuer, &[], Some(cn));
    Pki {
        ca_pem,
        cert_pem,
        key_pem,
    }
}

#[tokio::test]
async fn verify_full_falls_back_to_the_common_name_without_subject_alt_names() {
    for (cn, host, ok) in [
        ("localhost", "localhost", true),
        ("db.walbox.test", "localhost", false),
        ("*.localhost", "localhost", false),
    ] {
        let pki = pki_common_name_only(cn);
        let server = tls_server(&pki);
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, &pki.ca_pem).unwrap();
        let config = PgConfig::parse(&format!(
            "host={host} port={} user=postgres dbname=postgres sslmode=verify-full sslrootcert={}",
            server.port(),
            ca.display()
        ))
        .unwrap();
        let result = ReplicationClient::connect(&config).await;
        match (ok, result) {
            (true, Ok(mut c)) => {
                c.identify_system().await.unwrap();
            }
            (false, Err(e)) => assert!(matches!(e, Error::Tls(_)), "CN {cn}, host {host}: {e}"),
            (true, Err(e)) => panic!("CN {cn}, host {host}: {e}"),
            (false, Ok(_)) => panic!("CN {cn} accepted for host {host}"),
        }
    }
}

#[tokio::test]
async fn sslrootcert_system_uses_the_system_store_and_checks_the_name() {
    let pki = pki();
    let server = tls_server(&pki);
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("system-ca.pem");
    std::fs::write(&ca, &pki.ca_pem).unwrap();
    // The "system" store of this test process: rustls-native-certs reads
    // SSL_CERT_FILE first, as OpenSSL does (each test runs in its own process
    // under nextest; the variable only names a file).
    std::env::set_var("SSL_CERT_FILE", &ca);
    let config = PgConfig::parse(&format!(
        "host=localhost port={} user=postgres dbname=postgres sslrootcert=system",
        server.port()
    ))
    .unwrap();
    assert_eq!(config.ssl_mode(), slot_manager::SslMode::VerifyFull);
    let mut client = ReplicationClient::connect(&config)
        .await
        .unwrap_or_else(|e| panic!("sslrootcert=system: {e}"));
    client.identify_system().await.unwrap();
    let e = PgConfig::parse("host=h user=u sslrootcert=system sslmode=verify-ca").unwrap_err();
    assert!(
        e.to_string()
            .contains("may not be used with sslrootcert=system"),
        "{e}"
    );
}
