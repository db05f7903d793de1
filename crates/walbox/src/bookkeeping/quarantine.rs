//! The quarantine's tables (`walbox.quarantine`, `walbox.quarantined_keys`)
//! and every statement on them: what `walbox run` writes and reads as it
//! holds and releases aggregates (see [`crate::quarantine`]), and what
//! `walbox quarantine` lists and requests.
//!
//! One row per held event, keyed by its place in the stream (its
//! transaction's commit position and its index there), so a replayed event
//! is held once and a release reads the aggregate's events in stream order.
//! One row per held aggregate (its record key), with the operator's request
//! (`release` or `drop`), which only the running walbox carries out: it is
//! the one writer of the held events, so a request never races an event
//! joining the quarantine.

use bytes::Bytes;
use pgoutput_decoder::Lsn;
use slot_manager::Error;
use tokio_postgres::{Client, GenericClient};

use crate::bookkeeping;
use crate::quarantine::{HeldEvent, HeldKey, Place, Request};

/// The tables, created on first use (see [`crate::bookkeeping`]).
const TABLES: &str = "
CREATE TABLE IF NOT EXISTS walbox.quarantine (
    slot text NOT NULL,
    commit_lsn pg_lsn NOT NULL,
    idx int8 NOT NULL,
    lsn pg_lsn NOT NULL,
    key bytea NOT NULL,
    topic text NOT NULL,
    value bytea,
    header_names text[] NOT NULL,
    header_values bytea[] NOT NULL,
    timestamp_ms int8,
    kind text NOT NULL,
    error text NOT NULL,
    held_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (slot, commit_lsn, idx)
);
CREATE INDEX IF NOT EXISTS quarantine_by_key ON walbox.quarantine (slot, key, commit_lsn, idx);
CREATE TABLE IF NOT EXISTS walbox.quarantined_keys (
    slot text NOT NULL,
    key bytea NOT NULL,
    since timestamptz NOT NULL DEFAULT now(),
    error text NOT NULL,
    request text CHECK (request IN ('release', 'drop')),
    requested_at timestamptz,
    last_release_error text,
    PRIMARY KEY (slot, key)
);
GRANT SELECT ON walbox.quarantine, walbox.quarantined_keys TO PUBLIC;";

const BOTH: [&str; 2] = ["walbox.quarantine", "walbox.quarantined_keys"];

/// Creates the tables if missing.
pub async fn ensure(client: &Client) -> Result<(), Error> {
    if !bookkeeping::exist(client, &BOTH).await? {
        bookkeeping::create(client, TABLES, "create walbox.quarantine").await?;
    }
    Ok(())
}

/// Whether the tables exist.
pub async fn exists(client: &Client) -> Result<bool, Error> {
    bookkeeping::exist(client, &BOTH).await
}

fn lsn_of(text: String) -> Lsn {
    text.parse().unwrap_or(Lsn::ZERO)
}

/// Holds `events` of `slot` in one transaction, with their aggregates
/// (an event already held, as after a replay, is held once). Returns how
/// many events were new.
pub async fn hold(client: &mut Client, slot: &str, events: &[HeldEvent]) -> Result<u64, Error> {
    let tx = client
        .transaction()
        .await
        .map_err(Error::sql("hold events in walbox.quarantine"))?;
    let insert = tx
        .prepare(
            "INSERT INTO walbox.quarantine (slot, commit_lsn, idx, lsn, key, topic, value,
                 header_names, header_values, timestamp_ms, kind, error)
             VALUES ($1, $2::text::pg_lsn, $3, $4::text::pg_lsn, $5, $6, $7, $8, $9, $10, $11, $12)
             ON CONFLICT DO NOTHING",
        )
        .await
        .map_err(Error::sql("hold events in walbox.quarantine"))?;
    let key = tx
        .prepare(
            "INSERT INTO walbox.quarantined_keys (slot, key, error) VALUES ($1, $2, $3)
             ON CONFLICT DO NOTHING",
        )
        .await
        .map_err(Error::sql("hold events in walbox.quarantine"))?;
    let mut new = 0;
    for e in events {
        let names: Vec<&str> = e.record.headers.iter().map(|h| &*h.name).collect();
        let values: Vec<&[u8]> = e.record.headers.iter().map(|h| &h.value[..]).collect();
        let key_bytes: &[u8] = &e.key;
        new += tx
            .execute(
                &insert,
                &[
                    &slot,
                    &e.place.commit_lsn.to_string(),
                    &(e.place.index as i64),
                    &e.lsn.to_string(),
                    &key_bytes,
                    &&*e.record.topic,
                    &e.record.value.as_deref(),
                    &names,
                    &values,
                    &e.record.timestamp_ms,
                    &e.kind,
                    &e.error,
                ],
            )
            .await
            .map_err(Error::sql("hold events in walbox.quarantine"))?;
        tx.execute(&key, &[&slot, &key_bytes, &e.error])
            .await
            .map_err(Error::sql("hold events in walbox.quarantine"))?;
    }
    tx.commit()
        .await
        .map_err(Error::sql("hold events in walbox.quarantine"))?;
    Ok(new)
}

/// The held aggregates of `slot`, with their requests, and the number of
/// held events (nothing when the tables do not exist).
pub async fn held(client: &Client, slot: &str) -> Result<(Vec<HeldKey>, u64), Error> {
    if !exists(client).await? {
        return Ok((Vec::new(), 0));
    }
    let events: i64 = client
        .query_one(
            "SELECT count(*) FROM walbox.quarantine WHERE slot = $1",
            &[&slot],
        )
        .await
        .map_err(Error::sql("read walbox.quarantine"))?
        .get(0);
    Ok((keys(client, slot, false).await?, events as u64))
}

/// The held aggregates of `slot` with a request: read every second while
/// walbox holds any (so the tables exist).
pub async fn requests(client: &Client, slot: &str) -> Result<Vec<HeldKey>, Error> {
    keys(client, slot, true).await
}

/// The held aggregates of `slot` (only those with a request when
/// `requested`), oldest first.
async fn keys(client: &Client, slot: &str, requested: bool) -> Result<Vec<HeldKey>, Error> {
    let rows = client
        .query(
            "SELECT key, request FROM walbox.quarantined_keys
              WHERE slot = $1 AND (NOT $2 OR request IS NOT NULL) ORDER BY since, key",
            &[&slot, &requested],
        )
        .await
        .map_err(Error::sql("read walbox.quarantined_keys"))?;
    Ok(rows
        .into_iter()
        .map(|r| HeldKey {
            key: Bytes::from(r.get::<_, Vec<u8>>(0)),
            request: r
                .get::<_, Option<String>>(1)
                .and_then(|s| Request::parse(&s)),
        })
        .collect())
}

/// Up to `limit` held events of `key` after `after`, in stream order, and
/// no more than about `budget` bytes of them (at least one).
pub async fn load(
    client: &Client,
    slot: &str,
    key: &[u8],
    after: Option<Place>,
    limit: u32,
    budget: i64,
) -> Result<Vec<HeldEvent>, Error> {
    let (commit, index) = match after {
        Some(p) => (p.commit_lsn.to_string(), p.index as i64),
        None => ("0/0".to_owned(), -1),
    };
    let rows = client
        .query(
            "SELECT commit_lsn::text, idx, lsn::text, topic, value, header_names,
                    header_values, timestamp_ms, kind, error
               FROM (SELECT *, row_number() OVER w AS nth,
                            sum(coalesce(octet_length(value), 0) + 100) OVER w AS running
                       FROM walbox.quarantine
                      WHERE slot = $1 AND key = $2 AND (commit_lsn, idx) > ($3::text::pg_lsn, $4)
                     WINDOW w AS (ORDER BY commit_lsn, idx)
                      ORDER BY commit_lsn, idx LIMIT $5) held
              WHERE nth = 1 OR running <= $6
              ORDER BY commit_lsn, idx",
            &[&slot, &key, &commit, &index, &i64::from(limit), &budget],
        )
        .await
        .map_err(Error::sql("read walbox.quarantine"))?;
    Ok(rows
        .into_iter()
        .map(|r| {
            let names: Vec<String> = r.get(5);
            let values: Vec<Vec<u8>> = r.get(6);
            let mut record = sink_core::Record::new(
                r.get::<_, String>(3),
                Some(Bytes::copy_from_slice(key)),
                r.get::<_, Option<Vec<u8>>>(4).map(Bytes::from),
                (),
            );
            for (name, value) in names.into_iter().zip(values) {
                record = record.with_header(name, value);
            }
            record.timestamp_ms = r.get(7);
            HeldEvent {
                place: Place {
                    commit_lsn: lsn_of(r.get(0)),
                    index: r.get::<_, i64>(1) as u64,
                },
                lsn: lsn_of(r.get(2)),
                key: Bytes::copy_from_slice(key),
                record,
                kind: r.get(8),
                error: r.get(9),
            }
        })
        .collect())
}

/// Deletes `key`'s held events up to `through`, released; returns how many.
pub async fn released(
    client: &Client,
    slot: &str,
    key: &[u8],
    through: Place,
) -> Result<u64, Error> {
    client
        .execute(
            "DELETE FROM walbox.quarantine
              WHERE slot = $1 AND key = $2 AND (commit_lsn, idx) <= ($3::text::pg_lsn, $4)",
            &[
                &slot,
                &key,
                &through.commit_lsn.to_string(),
                &(through.index as i64),
            ],
        )
        .await
        .map_err(Error::sql("delete released events from walbox.quarantine"))
}

/// Forgets `key` and whatever is still held of it (a finished release, or
/// a drop); returns how many events were deleted.
pub async fn forget_key(client: &mut Client, slot: &str, key: &[u8]) -> Result<u64, Error> {
    let tx = client
        .transaction()
        .await
        .map_err(Error::sql("forget a held aggregate"))?;
    let deleted = tx
        .execute(
            "DELETE FROM walbox.quarantine WHERE slot = $1 AND key = $2",
            &[&slot, &key],
        )
        .await
        .map_err(Error::sql("forget a held aggregate"))?;
    tx.execute(
        "DELETE FROM walbox.quarantined_keys WHERE slot = $1 AND key = $2",
        &[&slot, &key],
    )
    .await
    .map_err(Error::sql("forget a held aggregate"))?;
    tx.commit()
        .await
        .map_err(Error::sql("forget a held aggregate"))?;
    Ok(deleted)
}

/// A release that failed: the request is withdrawn, with why.
pub async fn release_failed(
    client: &Client,
    slot: &str,
    key: &[u8],
    error: &str,
) -> Result<(), Error> {
    client
        .execute(
            "UPDATE walbox.quarantined_keys
                SET request = NULL, requested_at = NULL, last_release_error = $3
              WHERE slot = $1 AND key = $2",
            &[&slot, &key, &error],
        )
        .await
        .map_err(Error::sql("record a failed release"))?;
    Ok(())
}

/// Asks the running walbox to release or drop `key`; false when `slot`
/// holds no such aggregate.
pub async fn request(
    client: &impl GenericClient,
    slot: &str,
    key: &[u8],
    request: Request,
) -> Result<bool, Error> {
    let n = client
        .execute(
            "UPDATE walbox.quarantined_keys
                SET request = $3, requested_at = now(), last_release_error = NULL
              WHERE slot = $1 AND key = $2",
            &[&slot, &key, &request.as_str()],
        )
        .await
        .map_err(Error::sql("request a release from walbox.quarantined_keys"))?;
    Ok(n > 0)
}

/// Where `key`'s request stands: `None` when `slot` no longer holds it
/// (carried out), else its pending request and why the last release
/// failed.
pub async fn request_state(
    client: &Client,
    slot: &str,
    key: &[u8],
) -> Result<Option<(Option<String>, Option<String>)>, Error> {
    let row = client
        .query_opt(
            "SELECT request, last_release_error FROM walbox.quarantined_keys
              WHERE slot = $1 AND key = $2",
            &[&slot, &key],
        )
        .await
        .map_err(Error::sql("read walbox.quarantined_keys"))?;
    Ok(row.map(|r| (r.get(0), r.get(1))))
}

/// One held aggregate as `walbox quarantine list` shows it.
#[derive(Clone, Debug)]
pub struct Listed {
    /// The record key.
    pub key: Bytes,
    /// Events held.
    pub events: u64,
    /// Since when, as text.
    pub since: String,
    /// The error that started the hold.
    pub error: String,
    /// The pending request, if any.
    pub request: Option<String>,
    /// Why the last release failed, if it did.
    pub last_release_error: Option<String>,
}

/// Every held aggregate of `slot`, oldest first.
pub async fn list(client: &Client, slot: &str) -> Result<Vec<Listed>, Error> {
    if !exists(client).await? {
        return Ok(Vec::new());
    }
    let rows = client
        .query(
            "SELECT k.key, (SELECT count(*) FROM walbox.quarantine q WHERE q.slot = k.slot AND q.key = k.key),
                    date_trunc('second', k.since)::text, k.error, k.request, k.last_release_error
               FROM walbox.quarantined_keys k WHERE k.slot = $1 ORDER BY k.since, k.key",
            &[&slot],
        )
        .await
        .map_err(Error::sql("read walbox.quarantined_keys"))?;
    Ok(rows
        .into_iter()
        .map(|r| Listed {
            key: Bytes::from(r.get::<_, Vec<u8>>(0)),
            events: r.get::<_, i64>(1) as u64,
            since: r.get(2),
            error: r.get(3),
            request: r.get(4),
            last_release_error: r.get(5),
        })
        .collect())
}
