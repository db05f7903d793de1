//! What a session does beside the stream: the quarantine's steps and the
//! delivered position saved.

use tokio::time::Instant;

use super::Session;
use crate::quarantine::Step;
use crate::relay::{
    Deliveries, Destination, Done, ReplicationStream, RunError, Token, Transactional,
};

impl<D, X, R> Session<'_, D, X, R>
where
    D: Destination<Token>,
    X: Transactional<Token>,
    R: Deliveries<Token>,
{
    /// Carries out the quarantine's steps due (see [`crate::quarantine`]):
    /// held events written (and then acknowledged), requests read, a
    /// release's batches read and deleted. Only the writes when
    /// `writes_only` (shutting down).
    pub(super) async fn quarantine_steps<S: ReplicationStream>(
        &mut self,
        stream: &mut S,
        writes_only: bool,
    ) -> Result<(), RunError> {
        while let Some(step) = self.core.quarantine_step(writes_only) {
            if let Step::Write = step {
                let (events, tokens) = self.core.take_held();
                let new = match stream.quarantine(&step, &events).await? {
                    Done::Written(new) => new,
                    _ => 0,
                };
                let handled = self.core.on_held_written(tokens, new, Instant::now());
                self.effects(stream).await?;
                handled?;
                continue;
            }
            if let Step::Released { .. } = step {
                crate::testpoint::reached("quarantine.acked").await;
            }
            match (&step, stream.quarantine(&step, &[]).await?) {
                (_, Done::Synced(keys, events)) => self.core.on_quarantine_synced(keys, events),
                (_, Done::Polled(requests)) => self.core.on_quarantine_polled(requests),
                (_, Done::Loaded(batch)) => {
                    self.core.on_release_loaded(batch);
                    self.send_while_room().await?;
                }
                (Step::Released { .. }, Done::Deleted(n)) => self.core.on_release_deleted(n),
                (Step::Forget { key }, Done::Deleted(n)) => self.core.on_key_forgotten(key, n),
                _ => self.core.on_release_failed_recorded(),
            }
            self.carry_out();
        }
        Ok(())
    }

    /// Saves the delivered position and its commit time when it moved
    /// (`save_positions`).
    pub(super) async fn save_position<S: ReplicationStream>(&mut self, stream: &mut S) {
        let Some((delivered, committed)) = self.core.position_to_save() else {
            return;
        };
        let result = stream.save_position(delivered, committed).await;
        self.core.on_position_saved(delivered, result);
        self.carry_out();
    }
}
