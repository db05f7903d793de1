//! Claim-check (`claim_check.bucket`) through the relay loop, with
//! object_store's in-memory store: an oversized record's value is stored
//! before the record is sent, the record carries the pointer, and the slot
//! passes the event once the broker acknowledged it.

use std::sync::Arc;

use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};

use super::fakes::{header, key_of};
use super::*;
use crate::claim_check::{headers, sha256_hex, ClaimCheck, ClaimCheckConfig};

#[tokio::test(start_paused = true)]
async fn an_oversized_value_is_stored_before_its_record_which_points_to_it() {
    let mut fx = Fixture::new(DeadLetters::halt(), 100, 1024);
    let store = Arc::new(InMemory::new());
    let config = ClaimCheckConfig {
        bucket: "events".into(),
        endpoint: None,
        region: None,
        prefix: "walbox/".into(),
        threshold: 1024,
    };
    fx.config.claim_check = Some(ClaimCheck::with_store(
        config,
        Arc::clone(&store) as Arc<dyn ObjectStore>,
    ));
    let big = format!("{{\"pad\": \"{}\"}}", "x".repeat(2000));
    let digest = sha256_hex(big.as_bytes());
    let server = fx.source.session(10);
    let b = fx.broker.clone();
    let objects = Arc::clone(&store);
    let payload = big.clone();
    let result = fx
        .run(|stop| async move {
            server.send(relation());
            server.send(begin(190));
            server.send(insert(100, "e0", Some("a"), "{}"));
            server.send(insert(110, "e1", Some("a"), &payload));
            server.send(commit(190, 200));
            until("both sent", || b.pending() == 2).await;
            // Stored before it was sent: the object is there while the
            // record waits for its acknowledgement.
            let object = objects
                .get(&Path::from(format!(
                    "walbox/{}",
                    sha256_hex(payload.as_bytes())
                )))
                .await
                .unwrap()
                .bytes()
                .await
                .unwrap();
            assert_eq!(&object[..], payload.as_bytes());
            idle(2_000).await;
            assert!(server.confirmed() < 200, "nothing confirmed before the ack");
            b.ack_all();
            until("the slot past both", || server.confirmed() == 200).await;
            stop.send(Stop::Graceful).unwrap();
            until("a clean close", || server.closed()).await;
        })
        .await;
    result.unwrap();
    let delivered = fx.broker.delivered();
    assert_eq!(delivered.len(), 2);
    let (small, pointer) = (&delivered[0], &delivered[1]);
    assert_eq!(small.value.as_deref(), Some(&b"{}"[..]));
    assert!(header(small, headers::URL).is_none());
    assert_eq!(key_of(pointer), "a");
    assert_eq!(header(pointer, "id"), Some("e1"), "its own headers stay");
    let url = format!("s3://events/walbox/{digest}");
    assert_eq!(header(pointer, headers::URL), Some(url.as_str()));
    assert_eq!(header(pointer, headers::SHA256), Some(digest.as_str()));
    assert_eq!(
        header(pointer, headers::SIZE),
        Some(big.len().to_string().as_str())
    );
    let value: serde_json::Value = serde_json::from_slice(pointer.value.as_ref().unwrap()).unwrap();
    assert_eq!(value["claim_check"]["url"], url);
    assert_eq!(value["claim_check"]["size"], big.len());
    assert!(fx.metrics.encode().contains("walbox_claim_checks_total 1"));
}
