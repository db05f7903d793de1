//! Where Postgres is and what to stream: every command's settings, shards
//! included.

use super::{Config, ConfigError, EventSource};
use slot_manager::{OutboxTables, PgConfig, ShardFilter, TableName};

/// Where Postgres is and what to stream: every command's settings.
#[derive(Clone, Debug)]
pub struct Connection {
    /// Postgres.
    pub pg: PgConfig,
    /// Slot.
    pub slot: String,
    /// Publication.
    pub publication: String,
    /// The outbox tables: one, a list, or patterns.
    pub tables: OutboxTables,
    /// Where events come from.
    pub source: EventSource,
    /// How many shards the outbox is split over (1: not sharded).
    pub shards: u32,
    /// The shard this connection streams (its slot and publication are the
    /// shard's); `None` when not sharded, or for every shard.
    pub shard: Option<ShardFilter>,
    /// The names shards derive theirs from, when sharded.
    shard_base: Option<ShardBase>,
}

/// What every shard's names and filter derive from.
#[derive(Clone, Debug)]
struct ShardBase {
    slot: String,
    publication: String,
    /// The column shards hash: the aggregate id.
    column: String,
}

impl Connection {
    /// The outbox table, for what works on one (`what`): refused when
    /// `table` names several or a pattern.
    pub fn table(&self, what: &str) -> Result<&TableName, ConfigError> {
        self.tables.single().ok_or_else(|| {
            ConfigError(format!(
                "table = {} names several outbox tables; {what} works on one table: run it with --table naming one",
                self.tables
            ))
        })
    }

    /// The connections this one stands for: itself when not sharded or when
    /// it names its shard; otherwise every shard's.
    pub fn selected_shards(&self) -> Vec<Connection> {
        match self.shard {
            Some(_) => vec![self.clone()],
            None => self.all_shards(),
        }
    }

    /// Every shard's connection (itself when not sharded).
    pub fn all_shards(&self) -> Vec<Connection> {
        let Some(base) = &self.shard_base else {
            return vec![self.clone()];
        };
        (0..self.shards)
            .map(|index| Connection {
                slot: shard_name(&base.slot, index),
                publication: shard_name(&base.publication, index),
                shard: Some(ShardFilter {
                    index,
                    count: self.shards,
                    column: base.column.clone(),
                }),
                ..self.clone()
            })
            .collect()
    }

    /// The oldest server (`server_version_num`) the source and sharding
    /// stream from, and what to say to an older one: the one owner of that
    /// rule (slot-manager knows what the protocol itself needs).
    pub fn least_server(&self) -> (i32, &'static str) {
        let (least, why) = if self.source.messages() {
            (
                140_000,
                "logical decoding messages as events (source = messages or both) need Postgres 14 or later (pgoutput's messages option); use source = table",
            )
        } else {
            slot_manager::LEAST_SERVER
        };
        if self.shards > 1 && least < slot_manager::LEAST_SHARDED_SERVER {
            return (
                slot_manager::LEAST_SHARDED_SERVER,
                "sharded streaming (shards > 1) needs Postgres 15 or later (publication row filters)",
            );
        }
        (least, why)
    }
}

/// A shard's slot or publication: the name with `_index` appended.
pub(super) fn shard_name(name: &str, index: u32) -> String {
    format!("{name}_{index}")
}

impl Config {
    /// Postgres, slot, publication and table, checked.
    pub fn connection(&self) -> Result<Connection, ConfigError> {
        let r = &self.raw;
        let env = |name: &str| {
            self.pg_env
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        };
        // Without pg_url, libpq's variables alone may say where to connect.
        let libpq_only = ["PGHOST", "PGUSER", "PGDATABASE"]
            .iter()
            .any(|v| env(v).is_some_and(|v| !v.is_empty()));
        let pg_url = match r.pg_url.as_ref().map(|u| u.expose()) {
            Some(url) => url,
            None if libpq_only => "",
            None => {
                return Err(ConfigError(
                    "pg_url is required (--pg-url, WALBOX_PG_URL, WALBOX_PG_URL_FILE or pg_url in the file; or libpq's PGHOST, PGUSER, …)"
                        .into(),
                ))
            }
        };
        let pg = PgConfig::parse_with_env(pg_url, env)
            .map_err(|e| ConfigError(format!("pg_url: {e}")))?;
        super::files::check_pg(&pg)?;
        let slot_ok = !r.slot.is_empty()
            && r.slot.len() <= slot_manager::MAX_NAME_BYTES
            && r.slot
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
        if !slot_ok {
            return Err(ConfigError(format!(
                "slot {:?}: slot names are 1-63 lower-case letters, digits and underscores",
                r.slot
            )));
        }
        if r.publication.is_empty() {
            return Err(ConfigError("publication: must not be empty".into()));
        }
        if r.publication.len() > slot_manager::MAX_NAME_BYTES {
            return Err(ConfigError(format!(
                "publication {:?}: {} bytes; Postgres names are at most {} (it would cut it silently)",
                r.publication,
                r.publication.len(),
                slot_manager::MAX_NAME_BYTES
            )));
        }
        let tables =
            OutboxTables::parse(&r.table).map_err(|e| ConfigError(format!("table: {e}")))?;
        let connection = Connection {
            pg,
            slot: r.slot.clone(),
            publication: r.publication.clone(),
            tables,
            source: r.source,
            shards: 1,
            shard: None,
            shard_base: None,
        };
        self.sharded(connection)
    }

    /// `connection` with the shard settings applied: checked, and the
    /// shard's names when it names one.
    fn sharded(&self, mut c: Connection) -> Result<Connection, ConfigError> {
        let r = &self.raw;
        let max = slot_manager::MAX_SHARDS;
        let shards = match u32::try_from(r.shards) {
            Ok(n @ 1..) if n <= max => n,
            _ => {
                return Err(ConfigError(format!(
                    "shards: {} is not a shard count from 1 to {max}",
                    r.shards
                )))
            }
        };
        if shards == 1 {
            return match r.shard {
                None | Some(0) => Ok(c),
                Some(i) => Err(ConfigError(format!(
                    "shard: {i} given, but shards is 1 (set shards to the number of shards)"
                ))),
            };
        }
        if !c.source.table() || c.source.messages() {
            return Err(ConfigError(
                "shards > 1 needs source = table: row filters split table rows, not logical decoding messages".into(),
            ));
        }
        if c.tables.single().is_none() {
            return Err(ConfigError(format!(
                "shards > 1 needs one outbox table, and table = {} names several",
                c.tables
            )));
        }
        let suffix = shard_name("", shards - 1).len();
        for (what, name) in [("slot", &c.slot), ("publication", &c.publication)] {
            if name.len() + suffix > slot_manager::MAX_NAME_BYTES {
                return Err(ConfigError(format!(
                    "{what} {name:?}: with shards = {shards} its shards' names would exceed {} bytes",
                    slot_manager::MAX_NAME_BYTES
                )));
            }
        }
        c.shards = shards;
        c.shard_base = Some(ShardBase {
            slot: c.slot.clone(),
            publication: c.publication.clone(),
            column: self.mapping()?.aggregate_id,
        });
        if let Some(i) = r.shard {
            let index = u32::try_from(i)
                .ok()
                .filter(|i| *i < shards)
                .ok_or_else(|| {
                    ConfigError(format!(
                        "shard: {i} is not one of the {shards} shards (0 to {})",
                        shards - 1
                    ))
                })?;
            c = c
                .all_shards()
                .into_iter()
                .nth(index as usize)
                .expect("index checked");
        }
        Ok(c)
    }
}
