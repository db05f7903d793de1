//! `walbox run`: the relay from the slot to Kafka until SIGINT/SIGTERM.

use std::sync::Arc;
use std::time::Duration;

use sink_kafka::{CompactedTopicError, Sink};
use tokio::sync::watch;

use slot_manager::connect_control;

use super::{loaded, CliError};
use crate::backfill::Plan;
use crate::broker::{Broker, Patience};
use crate::config::{Connection, RunFlags, RunPlan, RunSettings};
use crate::mapping::OutboxMapping;
use crate::metrics::Metrics;
use crate::relay::{Destination, PostgresSource, RelayConfig, RunError, SourceError, Stop, Token};

/// Arguments of `walbox run`.
#[derive(Debug, clap::Args)]
pub struct RunArgs {
    #[command(flatten)]
    settings: RunFlags,
}

/// How long the check that the brokers run transactions may take.
const TXN_PROBE_TIMEOUT: Duration = Duration::from_secs(15);
/// With `on_drift = "heal"`, how often the publication is read while it
/// does not cover the outbox table.
const DRIFT_RECHECK: Duration = Duration::from_secs(2);
/// How long the producer may take to flush after the relay stopped.
const SINK_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);
/// How long delivery receipts are kept without a retention setting.
const RECEIPTS_KEPT: Duration = Duration::from_secs(3600);
/// How long the receipts still queued at exit may take to be written.
const RECEIPTS_DRAIN: Duration = Duration::from_secs(3);

/// The signals `run` answers:
/// - the first SIGTERM or SIGINT: a graceful shutdown (finish the open
///   transaction, wait for in-flight deliveries, confirm; bounded by
///   `shutdown_timeout_secs`);
/// - a second one: confirm what was acknowledged and exit at once;
/// - SIGHUP: logged and ignored (the configuration is read at start only);
///   without a handler it would kill the process.
async fn signals(stop: watch::Sender<Stop>) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int), Ok(mut hup)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
        signal(SignalKind::hangup()),
    ) else {
        tracing::error!("cannot install signal handlers; stop walbox with SIGKILL");
        return;
    };
    let mut level = Stop::No;
    loop {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
            _ = hup.recv() => {
                tracing::info!("SIGHUP ignored: walbox reads its configuration at start; restart it to apply changes");
                continue;
            }
        }
        level = match level {
            Stop::No => {
                tracing::info!("shutting down: finishing the open transaction and in-flight deliveries (signal again to stop at once)");
                Stop::Graceful
            }
            _ => {
                tracing::warn!("second signal: stopping now; what was not acknowledged is sent again after restart");
                Stop::Now
            }
        };
        let _ = stop.send(level);
    }
}

/// What the stall watch reads of a sink each second.
struct Stall {
    stalled_for: Duration,
    waiting: usize,
    problem: Option<String>,
}

/// Reports deliveries that stopped moving (see [`crate::stall`]), as
/// `probe` reads them once a second, until aborted.
async fn watch_stalls(broker: &Broker<Token>, metrics: &Metrics) -> std::convert::Infallible {
    use crate::stall::{StallEvent, StallWatch};
    let mut watch = StallWatch::default();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        broker.observe(metrics);
        let stall = Stall {
            stalled_for: broker.stalled_for(),
            waiting: broker.in_flight(),
            problem: broker.problem(),
        };
        metrics
            .delivery_stalled_seconds
            .set(i64::try_from(stall.stalled_for.as_secs()).unwrap_or(i64::MAX));
        match watch.observe(stall.stalled_for, std::time::Instant::now()) {
            Some(StallEvent::Stalled(d)) => {
                tracing::warn!(
                    stalled_for = ?Duration::from_secs(d.as_secs()),
                    waiting = stall.waiting,
                    last_broker_problem = stall.problem.as_deref().unwrap_or("none reported"),
                    "deliveries stalled: no acknowledgement from the broker; what waits is sent again without end (a broker down or unreachable; on Kafka also NOT_ENOUGH_REPLICAS below min.insync.replicas, a leader election), and the slot is not confirmed past it"
                );
            }
            Some(StallEvent::Resumed(d)) => {
                tracing::info!(stalled_for = ?Duration::from_secs(d.as_secs()), "deliveries moving again");
            }
            None => {}
        }
        metrics.set_stalled(watch.is_stalled());
    }
}

/// How often lines suppressed by the log rate limit are summed up.
const REPEATS_REPORT_EVERY: Duration = Duration::from_secs(5);

/// The effective settings on one line, `key=value` separated by spaces,
/// secrets redacted: what the startup line shows.
fn startup_settings(config: &crate::config::Config) -> String {
    config
        .effective()
        .into_iter()
        .map(|(key, value, _)| format!("{key}={value}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Streams until a signal (exit 0) or a definite error.
pub async fn run(args: RunArgs) -> Result<(), CliError> {
    let config = loaded(args.settings.load())?;
    let RunPlan {
        connection: c,
        mapping,
        settings,
    } = config.for_run()?;

    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        librdkafka = %sink_kafka::librdkafka_version(),
        config = %startup_settings(&config),
        "walbox run starting"
    );
    for warning in config.warnings() {
        tracing::warn!("{warning}");
    }
    let (stop, shutdown) = watch::channel(Stop::No);
    tokio::spawn(signals(stop));
    tokio::spawn(async {
        let mut tick = tokio::time::interval(REPEATS_REPORT_EVERY);
        loop {
            tick.tick().await;
            crate::logging::report_repeats();
        }
    });

    let metrics = Metrics::new();
    if let Some(addr) = settings.metrics_addr {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| CliError::Metrics(addr, e))?;
        // Port 0 asks the system for a free port: the log names the one bound.
        let addr = listener.local_addr().unwrap_or(addr);
        tracing::info!(%addr, "serving /metrics, /healthz, /readyz");
        let m = Arc::clone(&metrics);
        tokio::spawn(async move {
            if let Err(e) = crate::metrics::serve(listener, m).await {
                tracing::error!(error = %e, "metrics endpoint stopped");
            }
        });
    }

    let retention = match (settings.retention, &mapping.timestamp) {
        // Checked by `Config::for_run`.
        (None, _) | (Some(_), None) => None,
        // With shards, shard 0 deletes for all, bounded by every shard's
        // delivered position.
        (Some(_), Some(_)) if c.shard.as_ref().is_some_and(|s| s.index > 0) => None,
        (Some(keep), Some(column)) => {
            let slots = c.all_shards().into_iter().map(|s| s.slot).collect();
            let r = crate::retention::Retention {
                pg: c.pg.clone(),
                slots,
                table: c.table("retention")?.clone(),
                column: column.clone(),
                keep,
                margin: settings.margin,
            };
            tracing::info!(retention = ?keep, "retention: deleting outbox rows older than this once delivered");
            Some(tokio::spawn(r.run(Arc::clone(&metrics))))
        }
    };
    let spans = match &settings.otlp_endpoint {
        None => None,
        Some(endpoint) => {
            let spans =
                crate::spans::Spans::new(endpoint.as_str()).map_err(crate::config::ConfigError)?;
            let endpoint = crate::config::redact_userinfo(endpoint.as_str());
            tracing::info!(%endpoint, "exporting a span per event over OTLP");
            Some(spans)
        }
    };
    // The configuration refuses audit.interval where it cannot be read.
    let readback = crate::readback::Readback::of(&settings.sink).ok();
    let audited = settings.audit_interval.zip(readback);
    let audit = audited.map(|(interval, readback)| {
        let tap = crate::continuous_audit::Tap::new();
        tracing::info!(
            ?interval,
            "continuous audit: reading an acknowledged event back from the broker every interval"
        );
        let task = tokio::spawn(crate::continuous_audit::run(
            Arc::clone(&tap),
            readback,
            interval,
            settings.exactly_once.is_some(),
            Arc::clone(&metrics),
        ));
        (tap, task)
    });
    let receipts = if settings.receipts {
        let client = slot_manager::connect_control(&c.pg).await?;
        let columns = crate::receipts::Columns::for_broker(settings.sink.name());
        if !crate::receipts::installed(&client, columns).await? {
            return Err(crate::config::ConfigError(crate::receipts::NOT_INSTALLED.into()).into());
        }
        let (recorder, queue) = crate::receipts::Recorder::new(Arc::clone(&metrics));
        let keep = settings.retention.unwrap_or(RECEIPTS_KEPT);
        tracing::info!(kept = ?keep, "delivery receipts: written to walbox.receipts after each acknowledgement");
        let task = tokio::spawn(crate::receipts::run(
            queue,
            c.pg.clone(),
            columns,
            keep,
            Arc::clone(&metrics),
        ));
        Some((recorder, task))
    } else {
        None
    };
    // The budget is enforced in Postgres: refused where it cannot be.
    if settings.backlog.is_set() {
        let client = slot_manager::connect_control(&c.pg).await?;
        if !crate::backlog::installed(&client).await? {
            return Err(crate::config::ConfigError(crate::backlog::NOT_INSTALLED.into()).into());
        }
    }
    let backlog = tokio::spawn(crate::backlog::run(
        c.pg.clone(),
        c.slot.clone(),
        settings.backlog,
        Arc::clone(&metrics),
    ));
    let observers = Observers {
        spans,
        audit: audit.as_ref().map(|(tap, _)| Arc::clone(tap)),
        receipts: receipts.as_ref().map(|(recorder, _)| recorder.clone()),
    };
    let result =
        stream_until_stopped(&c, &mapping, &settings, &shutdown, &metrics, &observers).await;
    if let Some(task) = retention {
        task.abort();
    }
    backlog.abort();
    if let Some((_, task)) = audit {
        task.abort();
    }
    if let Some((recorder, task)) = receipts {
        // The queue closes with its last sender: the writer writes what
        // waits, then ends (bounded, like every shutdown step).
        drop(observers.receipts);
        drop(recorder);
        if tokio::time::timeout(RECEIPTS_DRAIN, task).await.is_err() {
            tracing::warn!(
                "receipts not all written at exit (the database slow); those events were delivered"
            );
        }
    }
    if let Some(spans) = observers.spans {
        spans.shutdown().await;
    }
    log_exact(&metrics.commit_to_ack_exact, "commit to ack");
    log_exact(&metrics.commit_to_read_exact, "commit to read");
    if let Some(split) = metrics.read_to_ack_split.summary() {
        for (what, s) in [
            ("read to send", split.read_to_send),
            ("read to ack", split.read_to_ack),
            ("the broker client's part", split.client),
            ("walbox's own part", split.walbox),
        ] {
            if let Some(s) = s {
                log_summary(&s, what);
            }
        }
    }
    if settings.exactly_once.is_some() {
        tracing::info!(
            committed = metrics.transactions_committed.get(),
            aborted = metrics.transactions_aborted.get(),
            "Kafka transactions since start"
        );
    }
    result
}

/// Logs an exact latency's percentiles since start, if any event had one.
fn log_exact(latency: &crate::metrics::latency::ExactLatency, what: &str) {
    if let Some(s) = latency.summary() {
        log_summary(&s, what);
    }
}

fn log_summary(s: &crate::metrics::latency::LatencySummary, what: &str) {
    tracing::info!(
        events = s.events,
        p50_ms = s.p50_ms,
        p99_ms = s.p99_ms,
        p999_ms = s.p999_ms,
        max_ms = s.max_ms,
        "{what} since start (exact)"
    );
}

/// What watches each event besides the relay: spans, the continuous
/// audit, delivery receipts.
struct Observers {
    spans: Option<crate::spans::Spans>,
    audit: Option<Arc<crate::continuous_audit::Tap>>,
    receipts: Option<crate::receipts::Recorder>,
}

/// Streams, recreating the slot when it is found invalidated (with
/// `on_slot_invalidated = "recreate"`), until a signal or a definite error.
async fn stream_until_stopped(
    c: &Connection,
    mapping: &OutboxMapping,
    settings: &RunSettings,
    shutdown: &watch::Receiver<Stop>,
    metrics: &Arc<Metrics>,
    observers: &Observers,
) -> Result<(), CliError> {
    let mut waiting_reported = false;
    let mut backoff = crate::relay::Backoff::new();
    loop {
        // A backfill to finish or a slot to recreate may take long: a
        // signal stops it (its progress is saved; the next start resumes).
        let mut signalled = shutdown.clone();
        let prepared = tokio::select! {
            prepared = prepare_slot(c, mapping, settings, metrics) => prepared?,
            _ = signalled.wait_for(|s| *s != Stop::No) => {
                tracing::info!("stopped before streaming; what the backfill did not finish, the next start does");
                return Ok(());
            }
        };
        if prepared == Prepared::PeerBusy {
            // Another instance finishes the backfill or heal; this one
            // streams after it (or takes the heal over if that one dies:
            // its lock goes with its connection).
            if !waiting_reported {
                tracing::info!(slot = %c.slot, "another walbox instance is backfilling or healing the slot; waiting for it to finish");
                waiting_reported = true;
            }
            metrics.set_standby(true);
            if wait_or_stopped(shutdown, crate::relay::STANDBY_POLL).await {
                return Ok(());
            }
            continue;
        }
        if let Prepared::DriftUnfixed(gap) = &prepared {
            if !waiting_reported {
                tracing::error!(%gap, slot = %c.slot, "on_drift = heal: waiting for the publication to cover the outbox table again before republishing what the stream did not carry");
                waiting_reported = true;
            }
            // Not a standby: nothing streams (not ready;
            // WalboxNotStreaming fires if it lasts).
            if wait_or_stopped(shutdown, DRIFT_RECHECK).await {
                return Ok(());
            }
            continue;
        }
        waiting_reported = false;
        match stream(
            c,
            mapping,
            settings,
            shutdown.clone(),
            Arc::clone(metrics),
            observers,
        )
        .await
        {
            Err(RunError::Postgres(slot_manager::Error::SlotInvalidated { .. }))
                if settings.recreate_margin.is_some() && *shutdown.borrow() == Stop::No =>
            {
                tracing::warn!("the slot was invalidated while streaming; recreating it");
            }
            Err(RunError::Drift(drift)) => {
                metrics.drift_unhealed.set(1);
                // Healing starts from the record: without one, stop. The
                // record serves `walbox resync --drift` and the heal, which
                // republish one table: none is kept for several.
                if c.tables.single().is_none()
                    || !record_drift(c, &drift).await
                    || settings.drift_heal_margin.is_none()
                {
                    return Err(RunError::Drift(drift).into());
                }
                tracing::error!(error = %drift, "on_drift = heal: walbox stays up, and once the publication covers the table again it republishes from the table what the stream did not carry, then streams on");
            }
            Err(e) if e.is_transient() => {
                // Before streaming (the relay retries its own with the same
                // step): the exactly-once checks found no broker answering,
                // or an aborted probe. A new producer tries again.
                if crate::relay::wait_to_retry(&e, &mut backoff, metrics, shutdown).await {
                    return Ok(());
                }
            }
            Err(e @ RunError::Source(SourceError::BackfillPending { .. })) => {
                // A heal another instance began between this one's checks:
                // finished (or waited for) before streaming again.
                tracing::warn!(error = %e, "not streaming");
                if wait_or_stopped(shutdown, crate::relay::STANDBY_POLL).await {
                    return Ok(());
                }
            }
            result => {
                result?;
                tracing::info!("stopped");
                return Ok(());
            }
        }
    }
}

/// True when a signal came before `delay` passed.
async fn wait_or_stopped(shutdown: &watch::Receiver<Stop>, delay: Duration) -> bool {
    let mut signalled = shutdown.clone();
    tokio::select! {
        () = tokio::time::sleep(delay) => false,
        _ = signalled.wait_for(|s| *s != Stop::No) => true,
    }
}

/// Records a stop for drift in `walbox.drift_stops`, where `walbox resync
/// --drift` and `on_drift = "heal"` find it; a failure is logged (the
/// operator can still republish with `walbox resync --since`) and `false`.
async fn record_drift(c: &Connection, drift: &crate::relay::DriftError) -> bool {
    let recorded = async {
        let control = connect_control(&c.pg).await?;
        crate::bookkeeping::drift::record(
            &control,
            &c.slot,
            drift.held(),
            drift.committed(),
            &drift.to_string(),
        )
        .await
    };
    match recorded.await {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(error = %e, "could not record the drift stop in walbox.drift_stops: `walbox resync --drift` and on_drift = \"heal\" will not know it; republish with `walbox resync --drift --since TIME` (a time before the stop)");
            false
        }
    }
}

/// What [`prepare_slot`] left.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Prepared {
    /// Nothing (left) to do before streaming, or Postgres unreachable (the
    /// relay retries, and its checks hold it back).
    Ready,
    /// Another instance holds the slot's backfill lock: it is finishing a
    /// backfill or heal.
    PeerBusy,
    /// `on_drift = "heal"` after a drift stop: the publication does not
    /// cover the table yet (the gap, with its fix).
    DriftUnfixed(String),
}

/// Before streaming: finishes an unfinished backfill or heal (in whatever
/// state it was interrupted: its record says what to do), and recreates an
/// invalidated slot when `on_slot_invalidated = "recreate"`. With Postgres
/// unreachable it does nothing: the relay retries, and its checks stop it
/// on either condition.
async fn prepare_slot(
    c: &Connection,
    mapping: &OutboxMapping,
    settings: &RunSettings,
    metrics: &Metrics,
) -> Result<Prepared, CliError> {
    let mut control = match connect_control(&c.pg).await {
        Ok(control) => control,
        Err(e) if e.is_transient() => {
            // Said now: the broker's check comes next and may wait long,
            // and both being down is worth knowing at once.
            tracing::warn!(error = %crate::error_text::chain(&e), "Postgres unreachable; streaming starts when it answers");
            return Ok(Prepared::Ready);
        }
        Err(e) => return Err(e.into()),
    };
    if let Ok(row) = control
        .query_one("SELECT current_setting('server_version')", &[])
        .await
    {
        tracing::info!(postgres = %row.get::<_, String>(0), slot = %c.slot, "connected to Postgres");
    }
    // Backfills, heals and drift records belong to one table; with several
    // there are none (their commands refuse).
    let Some(table) = c.tables.single() else {
        metrics.drift_unhealed.set(0);
        return Ok(Prepared::Ready);
    };
    let plan = Plan {
        pg: &c.pg,
        slot: &c.slot,
        failover: false,
        table,
        mapping,
        settings,
    };
    let finished = async {
        if let Some(request) = crate::bookkeeping::backfills::resumable(&control, &c.slot).await? {
            tracing::info!(slot = %c.slot, condition = %request.condition, "finishing the interrupted backfill or heal before streaming");
            crate::backfill::backfill(plan, &mut control, &request).await?;
        }
        if let Some(margin) = settings.recreate_margin {
            let lost = slot_manager::slot_status(&control, &c.slot)
                .await?
                .is_some_and(|s| s.wal_status.as_deref() == Some("lost"));
            if lost {
                crate::backfill::heal(plan, &mut control, margin).await?;
            }
        }
        heal_drift_stop(c, plan, &mut control, settings, metrics).await
    };
    match finished.await {
        Ok(Some(gap)) => Ok(Prepared::DriftUnfixed(gap)),
        Ok(None) => Ok(Prepared::Ready),
        Err(crate::backfill::BackfillError::Busy(_)) => Ok(Prepared::PeerBusy),
        Err(e) => Err(e.into()),
    }
}

/// A drift stop recorded for the slot: with `on_drift = "heal"`, once the
/// publication covers the table again, the rows the stream did not carry
/// are republished (the slot streams on after them); until then, the gap
/// is returned. With `stop`, a warning says how to republish them.
async fn heal_drift_stop(
    c: &Connection,
    plan: Plan<'_>,
    control: &mut tokio_postgres::Client,
    settings: &RunSettings,
    metrics: &Metrics,
) -> Result<Option<String>, crate::backfill::BackfillError> {
    use crate::backfill::BackfillError;
    let Some(stop) = crate::bookkeeping::drift::load(control, &c.slot).await? else {
        metrics.drift_unhealed.set(0);
        return Ok(None);
    };
    metrics.drift_unhealed.set(1);
    let Some(margin) = settings.drift_heal_margin else {
        tracing::warn!(slot = %c.slot, held = %stop.held, stopped_at = %stop.stopped_at, "walbox stopped for publication drift before: the rows inserted while the publication did not cover the outbox table are in the table, not in the stream; `walbox resync --drift` republishes them (or set on_drift = \"heal\")");
        return Ok(None);
    };
    let reading = slot_manager::coverage(control, &c.publication, plan.table, None).await?;
    if let Some(gap) = reading.gap {
        return Ok(Some(gap));
    }
    let since = stop
        .since(margin)
        .ok_or_else(|| BackfillError::NoDriftTime(c.slot.clone()))?;
    tracing::info!(slot = %c.slot, held = %stop.held, since = %since, "the publication covers the outbox table again: republishing what the stream did not carry");
    if let crate::backfill::Outcome::Published {
        total,
        dead_lettered,
        ..
    } = crate::backfill::heal_drift(plan, control, &since).await?
    {
        tracing::info!(slot = %c.slot, republished = total, dead_lettered, "publication drift healed; streaming on from the slot");
    }
    metrics.drift_unhealed.set(0);
    Ok(None)
}

/// One run of the relay on a connection of its own to the configured
/// broker, until a signal or a definite error; then the broker is given a
/// little time for what is in flight (what it does not acknowledge in that
/// time was never confirmed to the slot either: the next start sends it
/// again).
async fn stream(
    c: &Connection,
    mapping: &OutboxMapping,
    settings: &RunSettings,
    shutdown: watch::Receiver<Stop>,
    metrics: Arc<Metrics>,
    observers: &Observers,
) -> Result<(), RunError> {
    let patience = Patience::UntilStopped(&shutdown);
    let Some((broker, mut reports)) = Broker::connect(&settings.sink, patience, &metrics).await?
    else {
        tracing::info!("stopped before streaming, while waiting for the brokers");
        return Ok(());
    };
    let transactions = match &settings.exactly_once {
        None => None,
        Some(eos) => Some(exactly_once_ready(&broker, settings, eos).await?),
    };
    let mut source = PostgresSource::new(c.clone(), mapping);
    let relay = relay_config(c, mapping, settings, observers, &broker)?;
    let urgency = shutdown.clone();
    let ends = crate::relay::Ends {
        destination: &broker,
        transactions,
        tails: broker.tail_reader(),
    };
    let result = tokio::select! {
        result = crate::relay::run(&relay, &mut source, ends, &mut reports, shutdown, Arc::clone(&metrics)) => result,
        never = watch_stalls(&broker, &metrics) => match never {},
    };
    metrics.delivery_stalled_seconds.set(0);
    // Exactly-once: what counts committed (and was flushed by its commit);
    // a transaction left open is aborted by the next start, not flushed.
    let within = if *urgency.borrow() == Stop::Now || settings.exactly_once.is_some() {
        Duration::ZERO
    } else {
        SINK_SHUTDOWN_TIMEOUT
    };
    let left = broker.close(reports, within).await;
    if left > 0 {
        tracing::info!(
            count = left,
            "records the broker had not acknowledged at shutdown (not confirmed; sent again after a restart)"
        );
    }
    result
}

/// Exactly-once: the progress topic is there and compacted, and the
/// brokers take transactions; the producer that writes them.
async fn exactly_once_ready<'b>(
    broker: &'b Broker<Token>,
    settings: &RunSettings,
    eos: &crate::exactly_once::ExactlyOnce,
) -> Result<&'b Sink<Token>, RunError> {
    let (Some(sink), Some(config)) = (broker.transactional(), settings.sink.kafka()) else {
        return Err(RunError::Transactions(
            crate::relay::TransactionsError::Unsupported {
                id: eos.transactional_id.clone(),
                error: sink_core::TxnError::new(
                    sink_core::TxnErrorKind::Unsupported,
                    format!(
                        "exactly-once delivery is Kafka's (its transactions); sink = \"{}\" has none",
                        settings.sink.name()
                    ),
                ),
            },
        ));
    };
    sink.ensure_compacted_topic(&eos.progress_topic)
        .await
        .map_err(|e| match e {
            CompactedTopicError::Unanswered(why) => RunError::ProgressTopicUnchecked(why),
            CompactedTopicError::Refused(why) => {
                RunError::Transactions(crate::relay::TransactionsError::ProgressTopic(why))
            }
        })?;
    sink_kafka::probe_transactions(config, &eos.progress_topic, TXN_PROBE_TIMEOUT)
        .await
        .map_err(|e| RunError::from_txn(&eos.transactional_id, e))?;
    tracing::info!(transactional_id = %eos.transactional_id, progress_topic = %eos.progress_topic, "delivery: exactly-once (Kafka transactions; consumers read with isolation.level=read_committed)");
    Ok(sink)
}

/// What the relay runs with, whatever the broker.
fn relay_config(
    c: &Connection,
    mapping: &OutboxMapping,
    settings: &RunSettings,
    observers: &Observers,
    broker: &Broker<crate::relay::Token>,
) -> Result<RelayConfig, RunError> {
    Ok(RelayConfig {
        stream: Arc::from(c.slot.as_str()),
        tables: c.tables.clone(),
        mapping: mapping.clone(),
        source: c.source,
        message_prefix: settings.message_prefix.clone(),
        dead_letters: settings.dead_letters.clone(),
        quarantine: settings.quarantine,
        status_interval: settings.status_interval,
        shutdown_timeout: settings.shutdown_timeout,
        exactly_once: settings.exactly_once.clone(),
        skip_delivered: settings.skip_delivered,
        save_positions: settings.recreate_margin.is_some()
            || settings.retention.is_some()
            || settings.drift_heal_margin.is_some(),
        spans: observers.spans.clone(),
        audit: observers.audit.clone(),
        receipts: observers.receipts.clone(),
        claim_check: broker.claim_check(settings.claim_check.as_ref())?,
        schema_registry: settings
            .schema_registry
            .as_ref()
            .map(crate::schema_registry::SchemaRegistry::new)
            .transpose()
            .map_err(RunError::from)?,
    })
}
