//! Sending the core's waiting records: readied (serialized, claim-checked)
//! and sent while there is room, each with its place in the stream.

use std::sync::Arc;

use futures_util::FutureExt;
use sink_core::{Origin, Permit};
use tokio::time::Instant;

use super::Session;
use crate::relay::{Deliveries, Destination, RunError, Token, Transactional};

impl<D, X, R> Session<'_, D, X, R>
where
    D: Destination<Token>,
    X: Transactional<Token>,
    R: Deliveries<Token>,
{
    /// Sends waiting records while there is room right now: the common case
    /// costs no extra turn of the loop. Whatever must wait for room is left
    /// to the loop's `reserve` branch.
    pub(super) async fn send_while_room(&mut self) -> Result<(), RunError> {
        loop {
            self.prepare_front().await?;
            let Some(size) = self.core.waiting() else {
                return Ok(());
            };
            let Some(permit) = self.destination.reserve(size).now_or_never() else {
                return Ok(());
            };
            self.send_front(permit).await?;
        }
    }

    /// Readies the first waiting record for the broker: its value
    /// serialized with its schema (`format = "avro"`), then stored in the
    /// object store when oversized.
    pub(super) async fn prepare_front(&mut self) -> Result<(), RunError> {
        self.skip_found().await?;
        self.serialize_front().await?;
        self.claim_check_front().await
    }

    /// At a start (`skip_delivered`): the first waiting records the broker
    /// holds already are skipped, each topic read back the first time a
    /// replayed record for it comes up (see `core/resume.rs`).
    pub(super) async fn skip_found(&mut self) -> Result<(), RunError> {
        let Some(tails) = self.tails else {
            return Ok(());
        };
        while let Some((topic, query)) = self.core.check_front(Instant::now())? {
            let began = Instant::now();
            let tail = tails.read_tail(&topic, &query).await;
            let micros = u64::try_from(began.elapsed().as_micros()).unwrap_or(u64::MAX);
            self.core.on_tail(topic, tail, micros);
        }
        Ok(())
    }

    /// Serializes the first waiting record's value with its subject's
    /// schema (see [`crate::schema_registry`]); one that does not fit
    /// follows the failure policy.
    pub(super) async fn serialize_front(&mut self) -> Result<(), RunError> {
        let config = self.config;
        let Some(registry) = &config.schema_registry else {
            return Ok(());
        };
        let Some(record) = self.core.front_to_serialize() else {
            return Ok(());
        };
        match registry.encode(record).await {
            Ok(_) => {
                record.token.serialized();
                Ok(())
            }
            Err(e @ crate::schema_registry::SchemaError::Invalid { .. }) => {
                self.core.front_invalid(e)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Claim-check (see [`crate::claim_check`]): stores the value of the
    /// first waiting record in the object store when it is oversized, and
    /// makes the record point to it.
    pub(super) async fn claim_check_front(&mut self) -> Result<(), RunError> {
        let config = self.config;
        let Some(check) = &config.claim_check else {
            return Ok(());
        };
        let Some(record) = self.core.front_mut() else {
            return Ok(());
        };
        if !check.needs(record) {
            return Ok(());
        }
        let bytes = check.store(record).await?;
        self.metrics.claim_checks.inc();
        self.metrics.claim_check_bytes.inc_by(bytes as u64);
        Ok(())
    }

    /// Sends the first waiting record with the room reserved for it (in
    /// exactly-once mode, inside the open Kafka transaction).
    pub(super) async fn send_front(&mut self, permit: Permit) -> Result<(), RunError> {
        let mut send = self
            .core
            .take_send(Instant::now())
            .expect("a record is waiting");
        let token = &send.record.token;
        send.record.origin = Some(Origin {
            stream: Arc::clone(&self.config.stream),
            history: self.core.history_id(),
            position: token.commit_lsn.as_u64(),
            index: token.index,
            commit_time: token.origin_time(),
        });
        if send.begin_transaction {
            if let Err(e) = self.transactions().begin() {
                return Err(self.core.on_begin_failed(e));
            }
        }
        self.destination.send(permit, send.record).await;
        Ok(())
    }
}
