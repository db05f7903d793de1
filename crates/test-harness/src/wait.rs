//! Waiting for a condition, with a deadline.

use std::future::Future;
use std::time::{Duration, Instant};

/// Polls `check` until it returns `Some`, and returns that value.
///
/// Polls quickly at first (10 ms) and backs off to 250 ms. When `timeout`
/// passes first it panics with `timed out after …: waiting for {what}` and the
/// last state `check` reported through `describe`, so a failing test says what
/// it saw rather than hanging.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(10);
    loop {
        let last = match check().await {
            Ok(v) => return v,
            Err(state) => state,
        };
        let now = Instant::now();
        if now >= deadline {
            panic!("timed out after {timeout:?}: waiting for {what}; last seen: {last}");
        }
        tokio::time::sleep(pause.min(deadline - now)).await;
        pause = (pause * 2).min(Duration::from_millis(250));
    }
}

/// Like [`wait_for`] for a blocking check, from synchronous code.
pub fn wait_for_blocking<T>(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> Result<T, String>,
) -> Result<T, String> {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(10);
    loop {
        let last = match check() {
            Ok(v) => return Ok(v),
            Err(state) => state,
        };
        let now = Instant::now();
        if now >= deadline {
            return Err(format!(
                "timed out after {timeout:?} waiting for {what}: {last}"
            ));
        }
        std::thread::sleep(pause.min(deadline - now));
        pause = (pause * 2).min(Duration::from_millis(250));
    }
}
