//! `sink = "webhook"` against an HTTP endpoint the test runs (axum), not
//! walbox's code: 1,500 events over 37 aggregates through two kill -9s of
//! walbox, every 25th request answered 503 (tried again): every event
//! received with a valid `Walbox-Signature` (checked with RustCrypto's
//! HMAC, as an endpoint would), never two requests of one aggregate at
//! once, each aggregate's first arrivals in commit order, the same
//! `Idempotency-Key` on a re-send; an event the endpoint refuses with 422
//! dead-lettered (POSTed with the dead-letter topic) with the reason.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use hmac::{Hmac, KeyInit, Mac};
use walbox_test_harness::pg::fresh_db;
use walbox_test_harness::wait::wait_for;

use crate::support::*;

const TOTAL: usize = 1_500;
const AGGREGATES: usize = 37;
const SECRET: &str = "Zq9-webhook-signing-key";

/// A request the endpoint took (answered 2xx).
#[derive(Clone, Debug)]
struct Got {
    topic: String,
    key: String,
    idempotency: String,
    event_type: String,
    error: Option<String>,
    n: usize,
}

#[derive(Default)]
struct Endpoint {
    requests: usize,
    taken: Vec<Got>,
    bad_signatures: usize,
    in_flight: HashSet<String>,
    overlaps: usize,
}

type Shared = Arc<Mutex<Endpoint>>;

fn header(h: &HeaderMap, name: &str) -> String {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

fn signed(h: &HeaderMap, body: &[u8]) -> bool {
    let sig = header(h, "walbox-signature");
    let Some((t, v1)) = sig
        .split_once(',')
        .and_then(|(t, v)| Some((t.strip_prefix("t=")?, v.strip_prefix("v1=")?)))
    else {
        return false;
    };
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(SECRET.as_bytes()).unwrap();
    mac.update(format!("{t}.").as_bytes());
    mac.update(body);
    let want: String = mac
        .finalize()
        .into_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    want == v1
}

/// A request of `key` in the handler; dropped, it is not any more.
struct Out {
    shared: Shared,
    key: String,
}

impl Drop for Out {
    fn drop(&mut self) {
        self.shared.lock().unwrap().in_flight.remove(&self.key);
    }
}

async fn hook(
    State(s): State<Shared>,
    h: HeaderMap,
    body: axum::body::Bytes,
) -> (StatusCode, String) {
    let key = header(&h, "walbox-key");
    let topic = header(&h, "walbox-topic");
    {
        let mut e = s.lock().unwrap();
        e.requests += 1;
        if !signed(&h, &body) {
            e.bad_signatures += 1;
            return (StatusCode::UNAUTHORIZED, "bad signature".into());
        }
        if !e.in_flight.insert(key.clone()) {
            e.overlaps += 1;
        }
    }
    // A little time in flight, so that overlaps would show. The key is
    // out again when the handler ends, or when the server drops it (the
    // client gone: a walbox killed mid-request), never left behind.
    let out = Out {
        shared: Arc::clone(&s),
        key: key.clone(),
    };
    tokio::time::sleep(Duration::from_millis(2)).await;
    drop(out);
    let mut e = s.lock().unwrap();
    if key == "agg-bad" && topic != "walbox.dead" {
        return (
            StatusCode::UNPROCESSABLE_ENTITY,
            "amount must be positive".into(),
        );
    }
    if e.requests % 25 == 0 {
        return (StatusCode::SERVICE_UNAVAILABLE, "busy".into());
    }
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    e.taken.push(Got {
        topic,
        key,
        idempotency: header(&h, "idempotency-key"),
        event_type: header(&h, "walbox-header-event_type"),
        error: h
            .get("walbox-header-walbox.error")
            .map(|v| v.to_str().unwrap().to_owned()),
        n: v["n"].as_u64().unwrap_or(u64::MAX) as usize,
    });
    (StatusCode::NO_CONTENT, String::new())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_is_posted_signed_in_order_per_aggregate_through_kills() {
    let shared: Shared = Arc::default();
    let app = axum::Router::new()
        .route("/hook", axum::routing::post(hook))
        .with_state(Arc::clone(&shared));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!(
        "http://{}/hook?token=Zq9-url-token",
        listener.local_addr().unwrap()
    );
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let secrets = tempfile::tempdir().unwrap();
    let secret_file = secrets.path().join("secret");
    walbox_test_harness::secret_file::write(&secret_file, SECRET);

    let db = fresh_db().await;
    let client = init(&db).await;
    let start = || {
        let mut c = walbox(
            &db,
            &[
                "run",
                "--sink",
                "webhook",
                "--dead-letter-topic",
                "walbox.dead",
            ],
        );
        c.env("WALBOX_WEBHOOK_URL", &url)
            .env("WALBOX_WEBHOOK_SECRET_FILE", &secret_file);
        spawn_logged(c)
    };
    let mut relay = start();
    wait_log(&relay, "POSTing events to a webhook").await;
    let mut logs = String::new();
    let writer = spawn_writer(
        db.connect().await,
        20,
        TOTAL / 20,
        Duration::from_millis(150),
        |chunk, k| 1 + (chunk * 7 + k * 13) % 50,
        AGGREGATES,
    );
    for _ in 0..2 {
        tokio::time::sleep(Duration::from_millis(900)).await;
        logs.push_str(&relay.log());
        relay.kill9();
        relay = start();
    }
    writer.await.unwrap();
    client
        .batch_execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('order', 'agg-bad', 'Refused', '{\"n\": 99999}')",
        )
        .await
        .unwrap();

    let got = wait_for("every event posted", Duration::from_secs(120), || {
        let taken = shared.lock().unwrap().taken.clone();
        async move {
            let n = taken
                .iter()
                .filter(|g| g.topic != "walbox.dead")
                .map(|g| g.n)
                .collect::<HashSet<_>>()
                .len();
            let dead = taken.iter().any(|g| g.topic == "walbox.dead");
            match (n, dead) {
                (TOTAL, true) => Ok(taken),
                _ => Err(format!("{n} of {TOTAL}, dead letter {dead}")),
            }
        }
    })
    .await;
    logs.push_str(&stop(&mut relay).await);
    let e = shared.lock().unwrap();
    assert_eq!(e.bad_signatures, 0, "every request signed with the secret");
    assert_eq!(e.overlaps, 0, "never two requests of one aggregate at once");
    let mut last: HashMap<&str, usize> = HashMap::new();
    let mut ids: HashMap<usize, &str> = HashMap::new();
    for g in got.iter().filter(|g| g.topic != "walbox.dead") {
        assert_eq!(g.topic, "outbox.event.order");
        assert_eq!(g.key, format!("agg-{}", g.n % AGGREGATES));
        assert_eq!(g.event_type, format!("E{}", g.n));
        assert!(g.idempotency.starts_with("walbox/"), "{g:?}");
        match ids.insert(g.n, &g.idempotency) {
            Some(earlier) => assert_eq!(earlier, g.idempotency, "a re-send keeps its key"),
            None => {
                let prev = last.insert(&g.key, g.n);
                assert!(
                    prev.is_none_or(|p| p < g.n),
                    "{}: {} after {prev:?}",
                    g.key,
                    g.n
                );
            }
        }
    }
    let dead = got.iter().find(|g| g.topic == "walbox.dead").unwrap();
    assert_eq!(dead.key, "agg-bad");
    let why = dead.error.as_deref().unwrap_or_default();
    assert!(
        why.contains("HTTP 422") && why.contains("amount must be positive"),
        "{why}"
    );
    eprintln!(
        "{} duplicates after two kill -9s; {} requests for {} events",
        got.len() - TOTAL - 1,
        e.requests,
        TOTAL + 1
    );
    for secret in ["Zq9-webhook-signing-key", "Zq9-url-token"] {
        assert!(!logs.contains(secret), "{secret} in the log");
    }
}
