//! Each authentication method the replication connection supports.

use slot_manager::{Error, PgConfig, ReplicationClient};
use walbox_test_harness::pg::{self, PgServer};

const HBA: &str = "\
local all all trust
host all postgres 127.0.0.1/32 trust
host all trusted 127.0.0.1/32 trust
host all plain 127.0.0.1/32 password
host all md5user 127.0.0.1/32 md5
host all scramuser 127.0.0.1/32 scram-sha-256
";

async fn server() -> PgServer {
    let server = PgServer::builder().hba(HBA).start().unwrap();
    let client = pg::connect(&server.config("postgres")).await.unwrap();
    client
        .batch_execute(
            "CREATE ROLE trusted LOGIN REPLICATION;
             CREATE ROLE plain LOGIN REPLICATION PASSWORD 'plain pass';
             SET password_encryption = 'md5';
             CREATE ROLE md5user LOGIN REPLICATION PASSWORD 'md5 p''ass';
             SET password_encryption = 'scram-sha-256';
             CREATE ROLE scramuser LOGIN REPLICATION PASSWORD 's3cret \\ pass';",
        )
        .await
        .unwrap();
    server
}

fn config(server: &PgServer, user: &str, password: Option<&str>) -> PgConfig {
    let mut s = format!(
        "host=127.0.0.1 port={} user={user} dbname=postgres sslmode=disable",
        server.port()
    );
    if let Some(p) = password {
        s.push_str(&format!(
            " password='{}'",
            p.replace('\\', "\\\\").replace('\'', "\\'")
        ));
    }
    PgConfig::parse(&s).unwrap()
}

#[tokio::test]
async fn trust_cleartext_md5_and_scram_authenticate() {
    let server = server().await;
    for (user, password) in [
        ("trusted", None),
        ("plain", Some("plain pass")),
        ("md5user", Some("md5 p'ass")),
        ("scramuser", Some("s3cret \\ pass")),
    ] {
        let mut client = ReplicationClient::connect(&config(&server, user, password))
            .await
            .unwrap_or_else(|e| panic!("{user}: {e}"));
        let system = client.identify_system().await.unwrap();
        assert_eq!(system.dbname.as_deref(), Some("postgres"), "{user}");
        assert!(system.xlogpos > pgoutput_decoder::Lsn::ZERO);
        assert!(client.backend_pid().is_some());
    }
    // pg_hba forces md5 and scram-sha-256 for these users, and their stored
    // passwords are of that kind, so those exchanges are what succeeded.
    let client = pg::connect(&server.config("postgres")).await.unwrap();
    let methods: Vec<String> = client
        .query(
            "SELECT rolname || ':' || CASE WHEN rolpassword LIKE 'md5%' THEN 'md5' WHEN rolpassword LIKE 'SCRAM-SHA-256$%' THEN 'scram' END \
               FROM pg_authid WHERE rolname IN ('md5user', 'scramuser') ORDER BY 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(methods, ["md5user:md5", "scramuser:scram"]);
}

#[tokio::test]
async fn a_wrong_password_is_a_definite_error_without_the_password() {
    let server = server().await;
    for user in ["plain", "md5user", "scramuser"] {
        let e = ReplicationClient::connect(&config(&server, user, Some("wrong-secret")))
            .await
            .unwrap_err();
        assert_eq!(e.sqlstate(), Some("28P01"), "{user}: {e}");
        assert!(!e.is_transient(), "{user}");
        assert!(
            e.to_string().contains("password authentication failed"),
            "{e}"
        );
        assert!(!e.to_string().contains("wrong-secret"));
    }
    let e = ReplicationClient::connect(&config(&server, "scramuser", None))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e}");
    assert!(e.to_string().contains("asks for a password"), "{e}");
}

#[tokio::test]
async fn an_unreachable_server_is_a_transient_error_within_the_timeout() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let config = PgConfig::parse(&format!(
        "host=127.0.0.1 port={port} user=u sslmode=disable connect_timeout=2"
    ))
    .unwrap();
    let e = ReplicationClient::connect(&config).await.unwrap_err();
    assert!(e.is_transient(), "{e}");
    assert!(e.to_string().contains(&format!("127.0.0.1:{port}")), "{e}");
}

/// The password from libpq's password file (`PGPASSFILE`), escapes and all.
#[tokio::test]
async fn a_password_from_the_password_file_authenticates() {
    use std::os::unix::fs::PermissionsExt;
    let server = server().await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("pgpass");
    std::fs::write(
        &file,
        format!(
            "# walbox\n127.0.0.1:{}:postgres:scramuser:s3cret \\\\ pass\n",
            server.port()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let file = file.display().to_string();
    let config = PgConfig::parse_with_env(
        &format!(
            "host=127.0.0.1 port={} user=scramuser dbname=postgres sslmode=disable",
            server.port()
        ),
        |k| (k == "PGPASSFILE").then(|| file.clone()),
    )
    .unwrap();
    let mut client = ReplicationClient::connect(&config)
        .await
        .unwrap_or_else(|e| panic!("password from PGPASSFILE: {e}"));
    client.identify_system().await.unwrap();
}

/// `host=a,b,c target_session_attrs=read-write`: past a host that does not
/// answer and one that is read-only, to the one that fits, as after a
/// failover; `any` takes the first that answers.
#[tokio::test]
async fn several_hosts_lead_to_the_one_target_session_attrs_asks_for() {
    let read_only = PgServer::builder()
        .setting("default_transaction_read_only", "on")
        .hba("local all all trust\nhost all all 127.0.0.1/32 trust\n")
        .start()
        .unwrap();
    let writable = PgServer::builder()
        .hba("local all all trust\nhost all all 127.0.0.1/32 trust\n")
        .start()
        .unwrap();
    let dead = walbox_test_harness::port::free_port();
    let system_id = |server: &PgServer| {
        let config = server.config("postgres");
        async move {
            let c = pg::connect(&config).await.unwrap();
            let id: i64 = c
                .query_one("SELECT system_identifier FROM pg_control_system()", &[])
                .await
                .unwrap()
                .get(0);
            id.to_string()
        }
    };
    let hosts = format!(
        "host=127.0.0.1,127.0.0.1,127.0.0.1 port={dead},{},{} user=postgres dbname=postgres sslmode=disable",
        read_only.port(),
        writable.port()
    );
    for (attrs, expected) in [
        ("read-write", system_id(&writable).await),
        ("primary", system_id(&read_only).await),
        ("any", system_id(&read_only).await),
    ] {
        let config = PgConfig::parse(&format!("{hosts} target_session_attrs={attrs}")).unwrap();
        let mut client = ReplicationClient::connect(&config)
            .await
            .unwrap_or_else(|e| panic!("{attrs}: {e}"));
        let system = client.identify_system().await.unwrap();
        assert_eq!(system.system_id, expected, "{attrs}");
    }
    // None fits: a transient error naming each host and why.
    let config = PgConfig::parse(&format!(
        "host=127.0.0.1,127.0.0.1 port={dead},{} user=postgres dbname=postgres sslmode=disable target_session_attrs=read-write",
        read_only.port()
    ))
    .unwrap();
    let e = ReplicationClient::connect(&config).await.unwrap_err();
    assert!(e.is_transient(), "{e}");
    let text = e.to_string();
    assert!(
        text.starts_with("no host will do")
            && text.contains("read-only")
            && text.contains(&dead.to_string()),
        "{text}"
    );
    assert!(PgConfig::parse("host=h user=u target_session_attrs=standby").is_err());
}

/// The replication socket has TCP keepalives armed (a peer that vanished
/// without closing shows within about a minute, not after the kernel's
/// retransmissions). Read from /proc/net/tcp: timer 2 is the keepalive timer.
#[cfg(target_os = "linux")]
#[tokio::test]
async fn the_replication_socket_keeps_alive() {
    let server = server().await;
    let mut client = ReplicationClient::connect(&config(&server, "trusted", None))
        .await
        .unwrap();
    client.identify_system().await.unwrap();
    let port = format!("{:04X}", server.port());
    let tcp = std::fs::read_to_string("/proc/net/tcp").unwrap();
    let ours: Vec<&str> = tcp
        .lines()
        .skip(1)
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // remote address ends with the server's port; 01 = ESTABLISHED
            f.len() > 5 && f[2].ends_with(&format!(":{port}")) && f[3] == "01"
        })
        .collect();
    assert!(!ours.is_empty(), "our connection in /proc/net/tcp:\n{tcp}");
    assert!(
        ours.iter().all(|l| l
            .split_whitespace()
            .nth(5)
            .is_some_and(|t| t.starts_with("02:"))),
        "keepalive timer armed: {ours:?}"
    );
}
