//! Reading a replication slot's state.

use pgoutput_decoder::Lsn;
use tokio_postgres::Client;

/// The slot's `confirmed_flush_lsn`, or `None` when the slot does not exist.
///
/// # Panics
///
/// When the query fails (see [`try_confirmed_flush_lsn`]).
pub async fn confirmed_flush_lsn(client: &Client, slot: &str) -> Option<Lsn> {
    try_confirmed_flush_lsn(client, slot)
        .await
        .expect("query pg_replication_slots")
}

/// [`confirmed_flush_lsn`] for callers that outlive servers (samplers): a
/// closed connection is an error, not a panic.
pub async fn try_confirmed_flush_lsn(
    client: &Client,
    slot: &str,
) -> Result<Option<Lsn>, tokio_postgres::Error> {
    let row = client
        .query_opt(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    Ok(row.map(|r| {
        let text: String = r.get(0);
        text.parse().expect("Postgres prints valid LSNs")
    }))
}

/// WAL the slot keeps on disk: `pg_current_wal_lsn() - restart_lsn`, in bytes.
pub async fn retained_wal_bytes(client: &Client, slot: &str) -> Option<i64> {
    let row = client
        .query_opt(
            "SELECT (pg_current_wal_lsn() - restart_lsn)::bigint FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .expect("query pg_replication_slots");
    row.map(|r| r.get(0))
}

/// The server's current WAL insert position.
pub async fn current_wal_lsn(client: &Client) -> Lsn {
    try_current_wal_lsn(client)
        .await
        .expect("query pg_current_wal_lsn")
}

/// The server's current WAL insert position, or the error of a server that
/// went away (a load running across a Postgres restart).
pub async fn try_current_wal_lsn(client: &Client) -> Result<Lsn, tokio_postgres::Error> {
    let row = client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await?;
    Ok(row.get::<_, String>(0).parse().expect("valid LSN"))
}

/// Waits until the slot's `confirmed_flush_lsn` is at least `lsn`.
///
/// # Panics
///
/// After `timeout`, with the last position seen.
pub async fn wait_confirmed_at_least(
    client: &Client,
    slot: &str,
    lsn: Lsn,
    timeout: std::time::Duration,
) {
    crate::wait::wait_for(
        &format!("slot {slot} to confirm {lsn}"),
        timeout,
        || async move {
            match confirmed_flush_lsn(client, slot).await {
                Some(l) if l >= lsn => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
}

/// Writes at least `bytes` of WAL to `table` (created here: `id bigint,
/// filler text`), which should be outside any publication. Returns the WAL
/// bytes written.
pub async fn write_wal_elsewhere(client: &Client, table: &str, bytes: u64) -> u64 {
    client
        .batch_execute(&format!("CREATE TABLE {table} (id bigint, filler text)"))
        .await
        .expect("create the table to write to");
    let start = current_wal_lsn(client).await;
    while current_wal_lsn(client).await.bytes_since(start) < bytes {
        client
            .batch_execute(&format!(
                "INSERT INTO {table} SELECT g, md5(g::text) || md5((g + 1)::text) FROM generate_series(1, 100000) g"
            ))
            .await
            .expect("write WAL");
    }
    current_wal_lsn(client).await.bytes_since(start)
}

/// Waits until the slot retains less than `bytes` of WAL and returns what it
/// retains then.
///
/// # Panics
///
/// After `timeout`, with the last amount seen.
pub async fn wait_retained_below(
    client: &Client,
    slot: &str,
    bytes: i64,
    timeout: std::time::Duration,
) -> i64 {
    crate::wait::wait_for(
        &format!("slot {slot} to retain under {} MB", bytes >> 20),
        timeout,
        || async move {
            match retained_wal_bytes(client, slot).await {
                Some(b) if b < bytes => Ok(b),
                other => Err(format!("{} MB", other.unwrap_or(-1) >> 20)),
            }
        },
    )
    .await
}

/// A private server whose slots may keep at most 32 MB of WAL
/// (`max_slot_wal_keep_size`): [`write_wal_past_the_slot`] invalidates them.
pub fn server_that_loses_slots() -> crate::pg::PgServer {
    crate::pg::PgServer::builder()
        .setting("max_slot_wal_keep_size", "32MB")
        .setting("max_wal_size", "64MB")
        .setting("min_wal_size", "32MB")
        .start()
        .expect("start a Postgres server")
}

/// Writes and checkpoints WAL (80 MB in 8 segments' switches) so that a
/// slot keeping more than `max_slot_wal_keep_size` (32 MB on
/// [`server_that_loses_slots`]) is invalidated; returns the slot's
/// `wal_status` afterwards.
pub async fn write_wal_past_the_slot(client: &Client, slot: &str) -> Option<String> {
    client
        .batch_execute("CREATE TABLE IF NOT EXISTS walbox_test_busy (v text)")
        .await
        .expect("create the busy table");
    for _ in 0..8 {
        client
            .batch_execute(
                "INSERT INTO walbox_test_busy SELECT md5(g::text) || md5((g + 1)::text) FROM generate_series(1, 100000) g;
                 SELECT pg_switch_wal();",
            )
            .await
            .expect("write WAL");
        client
            .batch_execute("CHECKPOINT")
            .await
            .expect("checkpoint");
    }
    client
        .query_one(
            "SELECT wal_status::text FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .expect("read the slot")
        .get(0)
}
