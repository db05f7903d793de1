//! `walbox doctor`: checks a deployment end to end with the configuration
//! `walbox run` uses, and prints one line per check (see [`crate::doctor`]).

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use slot_manager::{connect_control, PgConfig};

use super::{loaded, CliError};
use crate::config::{ConfigError, Connection, RunFlags, RunSettings, SinkSettings};
use crate::doctor::{brokers, kafka, local, postgres, Finding, Report};
use crate::mapping::OutboxMapping;

/// How long the brokers may take to answer one look.
const BROKER_TIMEOUT: Duration = Duration::from_secs(10);

/// Arguments of `walbox doctor`.
#[derive(Debug, clap::Args)]
pub struct DoctorArgs {
    /// Print one JSON object: {"checks": [{"check", "verdict", "saw",
    /// "fix"}], "summary", "exit_status"}.
    #[arg(long)]
    json: bool,
    /// A standby of the primary (a connection string like pg_url): checks
    /// that a failover slot is synchronized there (Postgres 17+). Also
    /// WALBOX_STANDBY_URL.
    #[arg(
        long,
        env = "WALBOX_STANDBY_URL",
        value_name = "URL",
        hide_env_values = true
    )]
    standby_url: Option<String>,
    /// Exit 0 when the worst finding is a warning (the Helm chart's doctor
    /// hook: a warning is said, and does not stop the install).
    #[arg(long)]
    allow_warnings: bool,
    #[command(flatten)]
    settings: RunFlags,
}

/// Runs every check and prints them; the exit status is the worst verdict
/// (0 pass, 1 a warning, 2 a failure, 3 a check not made).
pub async fn run(args: DoctorArgs) -> Result<(), CliError> {
    if let Some(url) = &args.standby_url {
        crate::redaction::register_setting("standby_url", url, true);
    }
    let config = loaded(args.settings.load())?;
    let mut report = Report::default();

    let connection = config.connection();
    let mapping = config.mapping();
    let settings = config.run();
    let mut config_errors: Vec<&ConfigError> = [
        connection.as_ref().err(),
        mapping.as_ref().err(),
        settings.as_ref().err(),
    ]
    .into_iter()
    .flatten()
    .collect();
    let cross = match (&connection, &mapping, &settings) {
        // Sharded without --shard: every shard is checked; the rest of
        // run's checks need one.
        (Ok(c), Ok(_), Ok(_)) if c.shards > 1 && c.shard.is_none() => None,
        (Ok(_), Ok(_), Ok(_)) => config.for_run().err(),
        _ => None,
    };
    config_errors.extend(cross.as_ref());
    match config_errors.is_empty() {
        true => report.extend([Finding::pass(
            "walbox.config",
            "the configuration passes the checks of walbox run",
        )]),
        false => report.extend(config_errors.iter().map(|e| {
            Finding::fail(
                "walbox.config",
                e.to_string(),
                "see docs/configuration.md (walbox config prints the effective settings)",
            )
        })),
    }
    for warning in config.warnings() {
        report.extend([Finding::warn_said("walbox.config", warning)]);
    }

    if let Ok(s) = &settings {
        report.extend([local::metrics_port(s.metrics_addr)]);
    }
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    for (what, path) in certificate_files(connection.as_ref().ok(), settings.as_ref().ok()) {
        report.extend(local::certificates(&what, std::path::Path::new(&path), now));
    }

    let mut tables = Vec::new();
    if let (Ok(c), Ok(m)) = (&connection, &mapping) {
        let status_interval = settings
            .as_ref()
            .map_or(Duration::from_secs(1), |s| s.status_interval);
        tables = check_postgres(
            &mut report,
            c,
            m,
            status_interval,
            args.standby_url.as_deref(),
        )
        .await;
    }

    if let (Ok(s), Ok(m)) = (&settings, &mapping) {
        check_broker(&mut report, s, m, &tables).await;
    }

    if args.json {
        println!("{}", report.json());
    } else {
        for f in report.findings() {
            println!("{}", f.line());
        }
    }
    match report.exit_status() {
        0 => Ok(()),
        1 if args.allow_warnings => Ok(()),
        status => Err(CliError::Doctor {
            status,
            summary: report.summary(),
        }),
    }
}

/// The certificate files the configuration names, with their setting.
fn certificate_files(
    connection: Option<&Connection>,
    settings: Option<&RunSettings>,
) -> Vec<(String, String)> {
    let mut files = Vec::new();
    if let Some(c) = connection {
        if let Some(root) = c.pg.ssl_root_cert().filter(|p| p.as_os_str() != "system") {
            files.push(("pg_url sslrootcert".into(), root.display().to_string()));
        }
        if let Some((cert, _)) = c.pg.ssl_client_cert() {
            files.push(("pg_url sslcert".into(), cert.display().to_string()));
        }
    }
    if let Some(kafka) = settings.and_then(|s| s.sink.kafka()) {
        for key in ["ssl.ca.location", "ssl.certificate.location"] {
            match kafka.properties.get(key) {
                Some(path) if path != "probe" && !std::path::Path::new(path).is_dir() => {
                    files.push((format!("kafka.properties.{key}"), path.clone()))
                }
                _ => {}
            }
        }
    }
    files
}

/// Postgres' checks, for each shard; gives the outbox tables found (for
/// the broker's checks).
async fn check_postgres(
    report: &mut Report,
    c: &Connection,
    mapping: &OutboxMapping,
    status_interval: Duration,
    standby_url: Option<&str>,
) -> Vec<postgres::Table> {
    let mut client = match connect_control(&c.pg).await {
        Ok(client) => client,
        Err(e) => {
            report.extend([Finding::fail(
                "postgres.connect",
                format!("cannot connect to {}: {e}", c.pg.describe()),
                "check pg_url (host, port, user, password, sslmode) and that the server accepts walbox's address (pg_hba.conf)",
            )]);
            return Vec::new();
        }
    };
    report.extend([Finding::pass(
        "postgres.connect",
        format!("connected to {}", c.pg.describe()),
    )]);
    let outbox = match postgres::gather_outbox(&mut client, c, mapping).await {
        Ok(outbox) => outbox,
        Err(e) => {
            report.extend([Finding::unchecked("postgres", e.to_string())]);
            return Vec::new();
        }
    };
    let mut primary = None;
    for shard in c.selected_shards() {
        let expected = postgres::Expected {
            slot: shard.slot.clone(),
            publication: shard.publication.clone(),
            least_server: shard.least_server(),
            tables: shard.source.table(),
            tables_written: shard.tables.to_string(),
            status_interval,
        };
        match postgres::gather(&mut client, &shard, &outbox).await {
            Ok(facts) => {
                report.extend(postgres::judge(&facts, &expected));
                primary = Some((facts.server, shard.slot.clone()));
            }
            Err(e) => report.extend([Finding::unchecked(
                "postgres",
                format!("slot {}: {e}", shard.slot),
            )]),
        }
    }
    if let (Some(url), Some((server, slot))) = (standby_url, primary) {
        report.extend(check_standby(url, &server, &slot).await);
    }
    outbox.tables
}

async fn check_standby(url: &str, primary: &postgres::Server, slot: &str) -> Vec<Finding> {
    let pg = match PgConfig::parse(url) {
        Ok(pg) => pg,
        Err(e) => {
            return vec![Finding::fail(
                "postgres.standby",
                format!("--standby-url: {e}"),
                "give a connection string like pg_url's",
            )]
        }
    };
    let client = match connect_control(&pg).await {
        Ok(client) => client,
        Err(e) => {
            return vec![Finding::unchecked(
                "postgres.standby",
                format!("cannot connect to the standby {}: {e}", pg.describe()),
            )]
        }
    };
    match postgres::gather_standby(&client, slot).await {
        Ok(standby) => postgres::judge_standby(&standby, primary, slot),
        Err(e) => vec![Finding::unchecked("postgres.standby", e.to_string())],
    }
}

/// The broker's checks: Kafka's by its admin API; the other brokers by
/// connecting as `walbox run` does ([`brokers`]).
async fn check_broker(
    report: &mut Report,
    settings: &RunSettings,
    mapping: &OutboxMapping,
    tables: &[postgres::Table],
) {
    let SinkSettings::Kafka(kafka_config) = &settings.sink else {
        let largest = tables
            .iter()
            .filter_map(|t| t.largest_payload.clone().ok().flatten())
            .max();
        let threshold = settings.claim_check.as_ref().map(|c| c.threshold);
        report.extend(brokers::check(&settings.sink, largest, threshold).await);
        return;
    };
    let (wanted, unsampled) = wanted_topics(settings, mapping, tables);
    let names: Vec<String> = wanted.iter().map(|w| w.name.clone()).collect();
    match sink_kafka::inspect::inspect(kafka_config, &names, BROKER_TIMEOUT).await {
        Ok((cluster, topics)) => {
            let expected = kafka::Expected {
                creates_topics: kafka_config.create_topics.is_some(),
                transactional_id: settings
                    .exactly_once
                    .as_ref()
                    .map(|e| e.transactional_id.clone()),
                reads_back: settings.skip_delivered.is_some(),
                claim_check_threshold: settings.claim_check.as_ref().map(|c| c.threshold),
                unsampled,
            };
            report.extend(kafka::judge(&cluster, &topics, &wanted, &expected));
        }
        Err(e) => report.extend([Finding::fail(
            "kafka.connect",
            format!(
                "{}: {e}",
                crate::redaction::redact(&kafka_config.bootstrap_servers)
            ),
            "check kafka.brokers and the security settings (security.protocol, sasl.*, ssl.*), docs/configuration.md",
        )]),
    }
}

/// The topics walbox will write, and the templates that could not be
/// filled in (no aggregate type sampled).
fn wanted_topics(
    settings: &RunSettings,
    mapping: &OutboxMapping,
    tables: &[postgres::Table],
) -> (Vec<kafka::Wanted>, Vec<String>) {
    let mut largest: BTreeMap<String, Option<i64>> = BTreeMap::new();
    let mut unsampled = Vec::new();
    for t in tables {
        let Ok(own) = mapping.for_table(t.table.schema(), t.table.name()) else {
            continue;
        };
        let template = own
            .topic_template
            .replace("{schema}", t.table.schema())
            .replace("{table}", t.table.name());
        let payload = t.largest_payload.clone().ok().flatten();
        let names: Vec<String> = match template.contains("{aggregate_type}") {
            false => vec![template.clone()],
            true => t
                .aggregate_types
                .iter()
                .map(|a| template.replace("{aggregate_type}", a))
                .collect(),
        };
        if names.is_empty() && !unsampled.contains(&template) {
            unsampled.push(template);
        }
        for name in names {
            let entry = largest.entry(name).or_insert(None);
            *entry = (*entry).max(payload);
        }
    }
    let mut wanted: Vec<kafka::Wanted> = largest
        .into_iter()
        .map(|(name, largest_payload)| kafka::Wanted {
            name,
            role: kafka::Role::Events,
            largest_payload,
        })
        .collect();
    if let Some(dlt) = settings.dead_letters.topic() {
        wanted.push(kafka::Wanted {
            name: dlt.to_owned(),
            role: kafka::Role::DeadLetter,
            largest_payload: None,
        });
    }
    if let Some(eos) = &settings.exactly_once {
        wanted.push(kafka::Wanted {
            name: eos.progress_topic.clone(),
            role: kafka::Role::Progress,
            largest_payload: None,
        });
    }
    (wanted, unsampled)
}
