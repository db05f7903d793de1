//! `sasl.mechanism = AWS_MSK_IAM` against Apache Kafka with a listener that
//! checks MSK IAM tokens itself (`crates/test-harness/java/MskIamValidator.java`:
//! it decodes the presigned URL and recomputes its SigV4 signature from the
//! secret key, so nothing of walbox's or the AWS SDK's signing code is on
//! the checking side). No Amazon MSK endpoint was reachable for these
//! tests; docs/configuration.md says so beside the recipe.
//!
//! Credentials come from each source of the AWS SDK's chain in turn:
//! environment keys; profiles with keys, assuming a role, or running a
//! `credential_process`; web identity (the assumed roles through STS:
//! moto's server, a real implementation of the STS API; the validator reads
//! the keys it issued from moto's state, as MSK asks IAM); and the ECS container and
//! EC2 instance (IMDSv2) endpoints, which a stand-in in this file serves
//! with the answers AWS documents (moto's metadata endpoint is IMDSv1
//! only, which the SDK does not use).

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use walbox_test_harness::apache_kafka::KafkaCluster;
use walbox_test_harness::kafka::TestKafka;
use walbox_test_harness::pg::fresh_db;

use crate::support::*;

const REGION: &str = "eu-west-1";
const ACCESS_KEY: &str = "AKIAWALBOXENVIRONMENT";
const SECRET_KEY: &str = "env/Secret+Key/walbox0123456789abcdefXYZ";
const PROFILE_KEY: (&str, &str) = (
    "AKIAWALBOXPROFILE0001",
    "profile/Secret+Key/0123456789abcdefXYZ",
);
const ECS_KEY: (&str, &str) = (
    "ASIAWALBOXECSTASK0001",
    "ecs/Secret+Key/0123456789abcdefXYZ",
);
const IMDS_KEY: (&str, &str) = (
    "ASIAWALBOXINSTANCE001",
    "imds/Secret+Key/0123456789abcdefXYZ",
);
const PROCESS_KEY: (&str, &str) = (
    "ASIAWALBOXPROCESS0001",
    "process/Secret+Key/0123456789abcdefXYZ",
);
const ROLE_ARN: &str = "arn:aws:iam::123456789012:role/walbox";
/// The role a `role_arn` profile assumes.
const PROFILE_ROLE_ARN: &str = "arn:aws:iam::123456789012:role/walbox-profile";

/// A walbox command with no AWS setting of this machine's: only what the
/// test gives (`env`) reaches the SDK's chain.
fn walbox_with_aws(
    db: &walbox_test_harness::pg::TestDb,
    home: &Path,
    env: &[(&str, String)],
) -> Command {
    let mut command = walbox(db, &[]);
    for (key, _) in std::env::vars() {
        if key.starts_with("AWS_") {
            command.env_remove(key);
        }
    }
    command
        .env("HOME", home)
        .env("AWS_CONFIG_FILE", home.join("aws-config"))
        .env("AWS_SHARED_CREDENTIALS_FILE", home.join("aws-credentials"))
        .env("AWS_EC2_METADATA_DISABLED", "true");
    for (key, value) in env {
        command.env(key, value);
    }
    command
}

/// `walbox run` to the cluster's IAM listener with MSK IAM.
fn spawn_iam(cluster: &KafkaCluster, command: Command, topic: &str, extra: &[&str]) -> Relay {
    let mut command = command;
    command
        .args(["run", "--kafka-brokers", &cluster.secured_bootstrap()])
        .args([
            "--kafka-property",
            "sasl.mechanism=AWS_MSK_IAM",
            "--kafka-property",
            "security.protocol=SASL_PLAINTEXT",
            "--kafka-aws-region",
            REGION,
            "--mapping-topic-template",
            topic,
        ])
        .args(extra);
    spawn_logged(command)
}

/// The harness reads through the cluster's plaintext listener.
fn plaintext(cluster: &KafkaCluster) -> TestKafka {
    TestKafka::External {
        bootstrap: cluster.bootstrap(),
    }
}

/// The signing times of the tokens of `access_key` the broker accepted.
fn accepted(cluster: &KafkaCluster, access_key: &str) -> Vec<String> {
    let prefix = format!("accepted {access_key} signed ");
    cluster
        .msk_iam_decisions()
        .iter()
        .filter_map(|d| d.strip_prefix(&prefix).map(str::to_owned))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn msk_iam_with_environment_keys_delivers_through_kill_9_and_a_wrong_key_is_one_line() {
    let cluster = tokio::task::block_in_place(|| {
        KafkaCluster::start_msk_iam(REGION, &[(ACCESS_KEY, SECRET_KEY)], None, &[])
    });
    let kafka = plaintext(&cluster);
    wait_broker(&kafka).await;
    let topic = format!("msk-iam-{}", std::process::id());
    let db = fresh_db().await;
    let client = init(&db).await;
    let home = tempfile::tempdir().unwrap();
    let env = [
        ("AWS_ACCESS_KEY_ID", ACCESS_KEY.to_owned()),
        ("AWS_SECRET_ACCESS_KEY", SECRET_KEY.to_owned()),
    ];
    // The topic does not exist: walbox's admin client creates it, through
    // the IAM listener too (a client that never serves librdkafka's token
    // refresh, given its token by walbox).
    let start = || {
        spawn_iam(
            &cluster,
            walbox_with_aws(&db, home.path(), &env),
            &topic,
            &["--topics-create", "true", "--topics-partitions", "3"],
        )
    };
    let relay = start();
    let writer = tokio::spawn({
        let client = client;
        async move {
            for k in 0..20 {
                insert_events(&client, k * 100, (k + 1) * 100, |t| 1 + t % 23, 13).await;
                tokio::time::sleep(Duration::from_millis(150)).await;
            }
            client
        }
    });
    let mut relay = kill_9_at_random_moments(relay, 2, (1_500, 1_000), 0x5eed_1a00, start).await;
    let client = writer.await.unwrap();
    let duplicates = expect_all(&kafka, &topic, 2_000).await;
    let log = stop(&mut relay).await;
    assert!(!log.contains(SECRET_KEY), "the secret key is never printed");
    let decisions = cluster.msk_iam_decisions();
    assert!(
        accepted(&cluster, ACCESS_KEY).len() >= 3,
        "each of the 3 runs authenticated with a signed token: {decisions:?}"
    );
    assert!(
        decisions.iter().all(|d| d.starts_with("accepted")),
        "no token was refused: {decisions:?}"
    );
    eprintln!(
        "2,000 events through 2 kill -9s: {duplicates} duplicates; {} tokens accepted",
        decisions.len()
    );

    // A wrong secret key: the broker refuses the signature, and walbox
    // stops at start in one line that says where to look, without the key.
    let wrong = "wrong/Secret+Key/0000000000000000000000";
    let env = [
        ("AWS_ACCESS_KEY_ID", ACCESS_KEY.to_owned()),
        ("AWS_SECRET_ACCESS_KEY", wrong.to_owned()),
    ];
    insert_events(&client, 2_000, 2_010, |_| 10, 13).await;
    let mut relay = spawn_iam(
        &cluster,
        walbox_with_aws(&db, home.path(), &env),
        &topic,
        &[],
    );
    let (status, log) = wait_exit(&mut relay).await;
    assert!(!status.success(), "{log}");
    let line = log.lines().last().unwrap_or_default();
    assert!(line.starts_with("walbox: "), "one error line:\n{log}");
    assert!(line.contains("AWS_MSK_IAM"), "{line}");
    assert!(line.contains("kafka-cluster:Connect"), "{line}");
    assert!(!log.contains(wrong), "the secret key is never printed");
    assert!(
        cluster
            .msk_iam_decisions()
            .iter()
            .any(|d| d == &format!("refused: {ACCESS_KEY}: the signature does not match")),
        "{:?}",
        cluster.msk_iam_decisions()
    );
    // Nothing was confirmed past the 10 events: with the key right, they arrive.
    let mut relay = spawn_iam(
        &cluster,
        walbox_with_aws(
            &db,
            home.path(),
            &[
                ("AWS_ACCESS_KEY_ID", ACCESS_KEY.to_owned()),
                ("AWS_SECRET_ACCESS_KEY", SECRET_KEY.to_owned()),
            ],
        ),
        &topic,
        &[],
    );
    expect_all(&kafka, &topic, 2_010).await;
    stop(&mut relay).await;
}

/// Tokens live 12 s here (`WALBOX_TEST_MSK_TOKEN_SECONDS`, a test knob; 15
/// min otherwise) and the broker makes every connection authenticate again
/// every 3 s (KIP-368, `connections.max.reauth.ms`), each time with the
/// token librdkafka holds then: an expired one is refused. So events flow
/// for 30 s only if librdkafka asks walbox for new tokens as they age.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_are_refreshed_before_they_expire_while_the_broker_reauthenticates() {
    let cluster = tokio::task::block_in_place(|| {
        KafkaCluster::start_msk_iam(
            REGION,
            &[(ACCESS_KEY, SECRET_KEY)],
            None,
            &[("connections.max.reauth.ms", "3000")],
        )
    });
    let kafka = plaintext(&cluster);
    wait_broker(&kafka).await;
    let topic = kafka.create_topic(2).await;
    let db = fresh_db().await;
    let client = init(&db).await;
    let home = tempfile::tempdir().unwrap();
    let env = [
        ("AWS_ACCESS_KEY_ID", ACCESS_KEY.to_owned()),
        ("AWS_SECRET_ACCESS_KEY", SECRET_KEY.to_owned()),
        ("WALBOX_TEST_MSK_TOKEN_SECONDS", "12".to_owned()),
    ];
    let mut relay = spawn_iam(
        &cluster,
        walbox_with_aws(&db, home.path(), &env),
        &topic,
        &[],
    );
    for second in 0..30 {
        insert_events(&client, second * 20, (second + 1) * 20, |_| 5, 11).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let Ok(duplicates) =
        tokio::time::timeout(Duration::from_secs(60), expect_all(&kafka, &topic, 600)).await
    else {
        panic!("the events did not arrive\n{}", relay.log());
    };
    stop(&mut relay).await;
    let decisions = cluster.msk_iam_decisions();
    assert!(
        decisions.iter().all(|d| d.starts_with("accepted")),
        "no token was refused (none had expired): {decisions:?}"
    );
    let mut signed = accepted(&cluster, ACCESS_KEY);
    signed.dedup();
    assert!(
        signed.len() >= 3,
        "30 s of 12 s tokens: at least 3 signed at different times: {decisions:?}"
    );
    eprintln!(
        "600 events over 30 s, {duplicates} duplicates; {} authentications with {} tokens",
        decisions.len(),
        signed.len()
    );
}

/// AWS's container credential endpoint (ECS, `AWS_CONTAINER_CREDENTIALS_FULL_URI`
/// with `AWS_CONTAINER_AUTHORIZATION_TOKEN`) and instance metadata
/// (IMDSv2: a session token first, then the role and its credentials), each
/// answering as AWS documents; every request is recorded.
struct MetadataEndpoints {
    addr: String,
    requests: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for MetadataEndpoints {
    fn drop(&mut self) {
        self.task.abort();
    }
}

const ECS_AUTHORIZATION: &str = "ecs-authorization-token-123";
const IMDS_SESSION: &str = "imds-session-token-456";

impl MetadataEndpoints {
    async fn start() -> MetadataEndpoints {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&requests);
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut socket, _)) = listener.accept().await else {
                    return;
                };
                let seen = Arc::clone(&seen);
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 4096];
                    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                        match socket.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    let head = String::from_utf8_lossy(&buf).into_owned();
                    let mut lines = head.lines();
                    let request = lines.next().unwrap_or_default().to_owned();
                    let headers: HashMap<String, String> = lines
                        .filter_map(|l| l.split_once(':'))
                        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
                        .collect();
                    seen.lock().unwrap().push(request.clone());
                    let (status, extra, body) = answer(&request, &headers);
                    let response = format!(
                        "HTTP/1.1 {status}\r\ncontent-length: {}\r\nconnection: close\r\n{extra}\r\n{body}",
                        body.len()
                    );
                    let _ = socket.write_all(response.as_bytes()).await;
                });
            }
        });
        MetadataEndpoints {
            addr,
            requests,
            task,
        }
    }

    fn requests(&self) -> Vec<String> {
        self.requests.lock().unwrap().clone()
    }
}

/// The credentials document both endpoints serve (the ECS one names the
/// role, the instance one its code and type).
fn credentials_json((access_key, secret): (&str, &str), extra: &str) -> String {
    let expiration =
        humantime::format_rfc3339_seconds(SystemTime::now() + Duration::from_secs(6 * 3600));
    format!(
        r#"{{{extra}"AccessKeyId":"{access_key}","SecretAccessKey":"{secret}","Token":"session-of-{access_key}","Expiration":"{expiration}"}}"#
    )
}

fn answer(request: &str, headers: &HashMap<String, String>) -> (&'static str, String, String) {
    let header = |k: &str| headers.get(k).map(String::as_str);
    let not_found = ("404 Not Found", String::new(), String::new());
    let refused = ("401 Unauthorized", String::new(), String::new());
    match request.split(' ').take(2).collect::<Vec<_>>()[..] {
        ["GET", "/ecs/credentials"] => {
            if header("authorization") != Some(ECS_AUTHORIZATION) {
                return refused;
            }
            (
                "200 OK",
                "content-type: application/json\r\n".into(),
                credentials_json(ECS_KEY, &format!(r#""RoleArn":"{ROLE_ARN}","#)),
            )
        }
        ["PUT", "/latest/api/token"] => match header("x-aws-ec2-metadata-token-ttl-seconds") {
            Some(_) => (
                "200 OK",
                "x-aws-ec2-metadata-token-ttl-seconds: 21600\r\n".into(),
                IMDS_SESSION.into(),
            ),
            None => ("400 Bad Request", String::new(), String::new()),
        },
        ["GET", path] if path.starts_with("/latest/meta-data/iam/security-credentials/") => {
            if header("x-aws-ec2-metadata-token") != Some(IMDS_SESSION) {
                return refused;
            }
            match &path["/latest/meta-data/iam/security-credentials/".len()..] {
                "" => ("200 OK", String::new(), "walbox-instance-role".into()),
                "walbox-instance-role" => (
                    "200 OK",
                    String::new(),
                    credentials_json(
                        IMDS_KEY,
                        r#""Code":"Success","LastUpdated":"2026-01-01T00:00:00Z","Type":"AWS-HMAC","#,
                    ),
                ),
                _ => not_found,
            }
        }
        _ => not_found,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_source_of_the_aws_credential_chain_authenticates() {
    let moto = MotoServer::start().await;
    let metadata = MetadataEndpoints::start().await;
    let sts_state = format!("{}/moto-api/data.json", moto.endpoint);
    let cluster = tokio::task::block_in_place(|| {
        KafkaCluster::start_msk_iam(
            REGION,
            &[PROFILE_KEY, PROCESS_KEY, ECS_KEY, IMDS_KEY],
            Some(&sts_state),
            &[],
        )
    });
    let kafka = plaintext(&cluster);
    wait_broker(&kafka).await;
    let topic = kafka.create_topic(2).await;
    let db = fresh_db().await;
    let client = init(&db).await;
    let home = tempfile::tempdir().unwrap();

    // A profile (AWS_PROFILE) in the shared credentials file.
    std::fs::write(
        home.path().join("aws-credentials"),
        format!(
            "[default]\naws_access_key_id = AKIANOTTHISONE\naws_secret_access_key = no\n\n\
             [walbox]\naws_access_key_id = {}\naws_secret_access_key = {}\n",
            PROFILE_KEY.0, PROFILE_KEY.1
        ),
    )
    .unwrap();
    // Web identity, as on EKS with IRSA: a token file and a role, through STS.
    let token_file = home.path().join("web-identity-token");
    std::fs::write(
        &token_file,
        "eyJhbGciOiJSUzI1NiJ9.walbox-service-account.signature",
    )
    .unwrap();
    // Profiles in the config file: one that assumes a role through STS
    // with a source profile's keys, one whose credentials a process prints.
    let process = home.path().join("credential-process");
    std::fs::write(
        &process,
        format!(
            "#!/bin/sh\necho '{{\"Version\": 1, \"AccessKeyId\": \"{}\", \"SecretAccessKey\": \"{}\"}}'\n",
            PROCESS_KEY.0, PROCESS_KEY.1
        ),
    )
    .unwrap();
    std::fs::set_permissions(
        &process,
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )
    .unwrap();
    std::fs::write(
        home.path().join("aws-config"),
        format!(
            "[profile walbox-role]\nrole_arn = {PROFILE_ROLE_ARN}\nsource_profile = walbox-base\nregion = {REGION}\n\n\
             [profile walbox-base]\naws_access_key_id = AKIAWALBOXSOURCEPROF\naws_secret_access_key = base/Secret/Key\n\n\
             [profile walbox-process]\ncredential_process = {}\n",
            process.display()
        ),
    )
    .unwrap();
    let sources: [(&str, Vec<(&str, String)>); 6] = [
        ("profile", vec![("AWS_PROFILE", "walbox".to_owned())]),
        (
            "profile assuming a role",
            vec![
                ("AWS_PROFILE", "walbox-role".to_owned()),
                ("AWS_ENDPOINT_URL_STS", moto.endpoint.clone()),
            ],
        ),
        (
            "credential_process profile",
            vec![("AWS_PROFILE", "walbox-process".to_owned())],
        ),
        (
            "web identity",
            vec![
                (
                    "AWS_WEB_IDENTITY_TOKEN_FILE",
                    token_file.display().to_string(),
                ),
                ("AWS_ROLE_ARN", ROLE_ARN.to_owned()),
                ("AWS_ROLE_SESSION_NAME", "walbox-e2e".to_owned()),
                ("AWS_REGION", REGION.to_owned()),
                ("AWS_ENDPOINT_URL_STS", moto.endpoint.clone()),
            ],
        ),
        (
            "ECS task",
            vec![
                (
                    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                    format!("http://{}/ecs/credentials", metadata.addr),
                ),
                (
                    "AWS_CONTAINER_AUTHORIZATION_TOKEN",
                    ECS_AUTHORIZATION.to_owned(),
                ),
            ],
        ),
        (
            "EC2 instance",
            vec![
                ("AWS_EC2_METADATA_DISABLED", "false".to_owned()),
                (
                    "AWS_EC2_METADATA_SERVICE_ENDPOINT",
                    format!("http://{}", metadata.addr),
                ),
            ],
        ),
    ];
    for (i, (source, env)) in sources.iter().enumerate() {
        let mut relay = spawn_iam(
            &cluster,
            walbox_with_aws(&db, home.path(), env),
            &topic,
            &[],
        );
        insert_events(&client, i * 50, (i + 1) * 50, |_| 10, 7).await;
        let all = (i + 1) * 50;
        let Ok(duplicates) =
            tokio::time::timeout(Duration::from_secs(60), expect_all(&kafka, &topic, all)).await
        else {
            panic!("{source}: the events did not arrive\n{}", relay.log());
        };
        let log = stop(&mut relay).await;
        assert_eq!(duplicates, 0, "{source}: a clean run sends nothing twice");
        if *source == "profile" {
            // The chain would find it before the sources after it.
            std::fs::remove_file(home.path().join("aws-credentials")).unwrap();
        }
        for secret in [
            PROFILE_KEY.1,
            PROCESS_KEY.1,
            "base/Secret/Key",
            ECS_KEY.1,
            IMDS_KEY.1,
            ECS_AUTHORIZATION,
            "walbox-service-account",
        ] {
            assert!(
                !log.contains(secret),
                "{source}: a secret was printed:\n{log}"
            );
        }
    }
    let decisions = cluster.msk_iam_decisions();
    assert!(
        !accepted(&cluster, PROFILE_KEY.0).is_empty(),
        "profile: {decisions:?}"
    );
    assert!(
        !accepted(&cluster, ECS_KEY.0).is_empty(),
        "ECS: {decisions:?}"
    );
    assert!(
        !accepted(&cluster, IMDS_KEY.0).is_empty(),
        "EC2: {decisions:?}"
    );
    assert!(
        !accepted(&cluster, PROCESS_KEY.0).is_empty(),
        "credential_process: {decisions:?}"
    );
    // The keys of the assumed roles are those STS issued for each role.
    let sts = moto_assumed_roles(&moto.endpoint);
    for role in [PROFILE_ROLE_ARN, ROLE_ARN] {
        let issued: Vec<_> = sts.iter().filter(|(_, r)| r == role).collect();
        assert_eq!(issued.len(), 1, "{role} assumed once: {sts:?}");
        assert!(
            !accepted(&cluster, &issued[0].0).is_empty(),
            "{role}: {decisions:?}"
        );
    }
    assert!(
        decisions.iter().all(|d| d.starts_with("accepted")),
        "no token was refused: {decisions:?}"
    );
    let requests = metadata.requests();
    assert!(
        requests
            .iter()
            .any(|r| r.starts_with("PUT /latest/api/token")),
        "IMDSv2's session token was asked for: {requests:?}"
    );
    assert!(
        requests
            .iter()
            .any(|r| r.starts_with("GET /ecs/credentials")),
        "{requests:?}"
    );
}

/// `(access key id, role)` of each role STS (moto) assumed.
fn moto_assumed_roles(endpoint: &str) -> Vec<(String, String)> {
    let out = Command::new(moto_python())
        .args([
            "-c",
            "import json, sys, urllib.request\n\
             state = json.load(urllib.request.urlopen(sys.argv[1] + '/moto-api/data.json'))\n\
             for r in state.get('sts', {}).get('AssumedRole', []):\n    print(r['access_key_id'], r['role_arn'])",
            endpoint,
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(k, r)| (k.to_owned(), r.to_owned()))
        .collect()
}
