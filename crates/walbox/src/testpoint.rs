//! Named points in walbox's multi-step operations where a test can hold the
//! process, to kill it there and show that the next start resumes, or to
//! make a race happen on purpose: with `WALBOX_TEST_PAUSE_AT=NAME[,NAME…]`
//! the process logs `paused at test point NAME` when it reaches one and
//! waits there until it is killed (or a signal ends the operation around
//! it); `NAME:SECS` waits that many seconds and goes on. Unset, a point
//! costs one environment lookup on a path that runs once per session, heal
//! or backfill.
//!
//! The points, in the order a heal (`on_slot_invalidated = "recreate"`,
//! `walbox resync`) passes them:
//!
//! | point | state left behind |
//! |---|---|
//! | `heal.recorded` | the heal recorded in `walbox.backfills` (`snapshot`); the old slot still there |
//! | `backfill.slot_dropped` | the old slot dropped; no slot |
//! | `backfill.slot_created` | the new slot made, its snapshot's rows not copied |
//! | `backfill.copied` | the rows copied (`publishing`), none published |
//!
//! Healing publication drift (`on_drift = "heal"`, `walbox resync --drift`)
//! passes one: `drift_heal.copied`, the rows copied (`publishing`) and the
//! drift stop forgotten, none published; the slot kept.
//!
//! And two in `walbox run`: `stream.checked`, after a session checked that
//! the slot has no unfinished backfill or heal and before it starts
//! streaming from the slot; `quarantine.acked`, when the broker
//! acknowledged a batch of a release (`walbox quarantine release`) and its
//! held events are not deleted yet.

/// The environment variable naming the points to pause at.
pub const PAUSE_AT: &str = "WALBOX_TEST_PAUSE_AT";

/// Waits forever if `name` is one of the points [`PAUSE_AT`] names.
pub async fn reached(name: &str) {
    let Ok(points) = std::env::var(PAUSE_AT) else {
        return;
    };
    for point in points.split(',') {
        let (point, secs) = match point.trim().split_once(':') {
            Some((point, secs)) => (point, secs.parse::<u64>().ok()),
            None => (point.trim(), None),
        };
        if point != name {
            continue;
        }
        tracing::warn!(point = name, "paused at test point {name}");
        match secs {
            Some(secs) => tokio::time::sleep(std::time::Duration::from_secs(secs)).await,
            None => std::future::pending::<()>().await,
        }
        tracing::warn!(point = name, "going on from test point {name}");
    }
}
