//! Reading a replication slot's state.

use pgoutput_decoder::Lsn;
use tokio_postgres::Client;

/// The slot's `confirmed_flush_lsn`, or `None` when the slot does not exist.
pub async fn confirmed_flush_lsn(client: &Client, slot: &str) -> Option<Lsn> {
    let row = client
        .query_opt(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .expect("query pg_replication_slots");
    row.map(|r| {
        let text: String = r.get(0);
        text.parse().expect("Postgres prints valid LSNs")
    })
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
    let row = client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .expect("query pg_current_wal_lsn");
    row.get::<_, String>(0).parse().expect("valid LSN")
}
