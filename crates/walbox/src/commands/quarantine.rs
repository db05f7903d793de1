//! `walbox quarantine list | show KEY | release KEY | drop KEY`: what
//! `on_failure = "quarantine"` holds (see [`crate::quarantine`]), and the
//! operator's word on it. A release or a drop is a request the running
//! `walbox run` carries out (it alone writes the held events, so nothing
//! races an event joining the quarantine); these commands wait for it to be
//! carried out, and say so when it was not.

use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::Serialize;
use slot_manager::connect_control;

use super::{loaded, CliError};
use crate::bookkeeping::quarantine as q;
use crate::config::{ConfigError, ConnectionFlags};
use crate::quarantine::Request;

/// Arguments of `walbox quarantine`.
#[derive(Debug, clap::Args)]
pub struct QuarantineArgs {
    #[command(subcommand)]
    action: Action,
}

#[derive(Debug, clap::Subcommand)]
enum Action {
    /// Lists the held aggregates: record key, events held, since when, the
    /// error that started the hold, a pending request, and why the last
    /// release failed.
    List(ListArgs),
    /// Shows an aggregate's held events in the order a release publishes
    /// them: place in the stream, topic, why held, event id, value.
    Show(ShowArgs),
    /// Asks the running `walbox run` to republish the aggregate's held
    /// events in order (events of it arriving meanwhile join them), then
    /// let it flow again; waits until that is done. Fix the cause first (the
    /// topic's permissions or size limit, or an unmappable event's value
    /// with SQL on walbox.quarantine).
    Release(RequestArgs),
    /// Asks the running `walbox run` to delete the aggregate's held events
    /// and let it flow again: they are never published. Waits until done.
    Drop(RequestArgs),
}

#[derive(Debug, clap::Args)]
struct ListArgs {
    /// One JSON array instead of text.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    settings: ConnectionFlags,
}

#[derive(Debug, clap::Args)]
struct ShowArgs {
    /// The aggregate: its record key as text (with format = debezium, the
    /// JSON string walbox publishes, quotes included).
    key: String,
    /// At most this many events.
    #[arg(long, value_name = "N", default_value_t = 50)]
    limit: u32,
    #[command(flatten)]
    settings: ConnectionFlags,
}

#[derive(Debug, clap::Args)]
struct RequestArgs {
    /// The aggregate: its record key as text (with format = debezium, the
    /// JSON string walbox publishes, quotes included).
    key: String,
    /// How long to wait for `walbox run` to carry the request out (0: do
    /// not wait).
    #[arg(long, value_name = "SECS", default_value_t = 60)]
    wait: u64,
    #[command(flatten)]
    settings: ConnectionFlags,
}

/// One held aggregate, as listed.
#[derive(Debug, Serialize)]
struct Listed {
    key: String,
    events: u64,
    since: String,
    error: String,
    request: Option<String>,
    last_release_error: Option<String>,
}

/// Runs the subcommand.
pub async fn run(args: QuarantineArgs) -> Result<(), CliError> {
    match args.action {
        Action::List(a) => list(a).await,
        Action::Show(a) => show(a).await,
        Action::Release(a) => request(a, Request::Release).await,
        Action::Drop(a) => request(a, Request::Drop).await,
    }
}

/// The slot's name and a control connection.
async fn connect(settings: &ConnectionFlags) -> Result<(String, tokio_postgres::Client), CliError> {
    let config = loaded(settings.load())?;
    let c = config.connection()?;
    if c.shards > 1 && c.shard.is_none() {
        return Err(ConfigError(format!(
            "shards = {}: say which shard's quarantine (--shard 0 to {})",
            c.shards,
            c.shards - 1
        ))
        .into());
    }
    let client = connect_control(&c.pg).await?;
    Ok((c.slot.clone(), client))
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A held value as text, or as hex (`0x…`) when it is not printable text:
/// a record held after it was serialized for a schema registry (`format =
/// "avro"`, …) opens with a zero byte.
fn value_text(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(s)
            if !s
                .chars()
                .any(|c| c.is_control() && !matches!(c, '\t' | '\n' | '\r')) =>
        {
            s.to_owned()
        }
        _ => {
            let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
            format!("0x{hex}")
        }
    }
}

async fn list(args: ListArgs) -> Result<(), CliError> {
    let (slot, client) = connect(&args.settings).await?;
    let listed: Vec<Listed> = q::list(&client, &slot)
        .await?
        .into_iter()
        .map(|l| Listed {
            key: text(&l.key),
            events: l.events,
            since: l.since,
            error: l.error,
            request: l.request,
            last_release_error: l.last_release_error,
        })
        .collect();
    if args.json {
        println!(
            "{}",
            serde_json::to_string(&listed).expect("plain data serializes")
        );
        return Ok(());
    }
    if listed.is_empty() {
        println!("slot {slot}: nothing held");
        return Ok(());
    }
    let events: u64 = listed.iter().map(|l| l.events).sum();
    println!(
        "slot {slot}: {} aggregates held, {events} events",
        listed.len()
    );
    for l in &listed {
        let mut line = format!(
            "{}\t{} events\tsince {}\t{}",
            l.key, l.events, l.since, l.error
        );
        if let Some(r) = &l.request {
            line.push_str(&format!("\t({r} requested)"));
        }
        if let Some(e) = &l.last_release_error {
            line.push_str(&format!("\tlast release failed: {e}"));
        }
        println!("{line}");
    }
    Ok(())
}

async fn show(args: ShowArgs) -> Result<(), CliError> {
    let (slot, client) = connect(&args.settings).await?;
    let key = Bytes::from(args.key.clone().into_bytes());
    let events = if q::exists(&client).await? {
        q::load(&client, &slot, &key, None, args.limit, i64::MAX).await?
    } else {
        Vec::new()
    };
    if events.is_empty() {
        println!("slot {slot}: nothing held for {:?}", args.key);
        return Ok(());
    }
    for e in events {
        let id = e
            .record
            .headers
            .iter()
            .find(|h| h.name == "id")
            .map(|h| text(&h.value))
            .unwrap_or_else(|| "-".into());
        let value = e
            .record
            .value
            .as_deref()
            .map(value_text)
            .unwrap_or_else(|| "NULL".into());
        println!(
            "{}/{}\tlsn {}\ttopic {}\tid {id}\t{}: {}\tvalue {value}",
            e.place.commit_lsn, e.place.index, e.lsn, e.record.topic, e.kind, e.error
        );
    }
    Ok(())
}

/// How often a waiting release or drop looks again.
const WAIT_POLL: Duration = Duration::from_millis(250);

async fn request(args: RequestArgs, request: Request) -> Result<(), CliError> {
    let (slot, client) = connect(&args.settings).await?;
    let key = args.key.as_bytes();
    let word = request.as_str();
    if !q::exists(&client).await? || !q::request(&client, &slot, key, request).await? {
        return Err(CliError::NotHeld {
            slot,
            key: args.key,
        });
    }
    if args.wait == 0 {
        println!(
            "{word} of {:?} requested: the running walbox carries it out within a second",
            args.key
        );
        return Ok(());
    }
    let deadline = Instant::now() + Duration::from_secs(args.wait);
    loop {
        match q::request_state(&client, &slot, key).await? {
            None => {
                let done = if request == Request::Release {
                    "released: it flows again"
                } else {
                    "dropped: its held events are deleted, and it flows again"
                };
                println!("{:?} {done}", args.key);
                return Ok(());
            }
            Some((None, last_release_error)) => {
                return Err(CliError::ReleaseFailed {
                    key: args.key,
                    error: last_release_error.unwrap_or_else(|| "the request was withdrawn".into()),
                });
            }
            Some(_) if Instant::now() >= deadline => {
                return Err(CliError::NotCarriedOut {
                    request: word,
                    key: args.key,
                    secs: args.wait,
                });
            }
            Some(_) => tokio::time::sleep(WAIT_POLL).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::value_text;

    #[test]
    fn a_serialized_value_is_shown_as_hex_and_json_as_it_is() {
        assert_eq!(value_text(br#"{"n": 1}"#), r#"{"n": 1}"#);
        assert_eq!(value_text("é\tx\n".as_bytes()), "é\tx\n");
        assert_eq!(value_text(&[0, 0, 0, 0, 7, 2]), "0x000000000702");
        assert_eq!(value_text(&[0xff, b'a']), "0xff61");
    }
}
