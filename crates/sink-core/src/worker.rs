//! A broker client that runs in a task of its own, behind channels: the
//! shape of the sinks whose client is not itself a queue with callbacks
//! (RabbitMQ's connection, SQS's batches).
//!
//! ```text
//!  Worker::reserve ─► Permit ─► Worker::publish(message, token) ─► Command::Publish(Job) ─► the task
//!                                                                                           │
//!  Answers::next ◄── Answer { token, result, refused } ◄── Job::answer ◄────────────────────┘
//! ```
//!
//! A [`Job`] carries its [`Permit`] to its [`Answer`], so the room is
//! given back when the caller receives the answer, not when the task sends
//! it: what waits in the channel still counts against the bound.

use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use crate::{Admission, Permit};

/// A message on its way, kept by the task until its answer.
#[derive(Debug)]
pub struct Job<M, T> {
    /// The message.
    pub message: M,
    /// What the caller gets back with its answer.
    pub token: T,
    permit: Permit,
}

impl<M, T> Job<M, T> {
    /// The job's answer: `result`, and the message when `keep` (a refusal,
    /// for the caller's dead-letter copy).
    pub fn answer<D, E>(self, result: Result<D, E>, keep: bool) -> Answer<M, T, D, E> {
        Answer {
            token: self.token,
            result,
            refused: keep.then_some(self.message),
            _permit: self.permit,
        }
    }
}

/// What the task is asked.
#[derive(Debug)]
pub enum Command<M, T> {
    /// Send this.
    Publish(Box<Job<M, T>>),
    /// Wait for every answer (at most the given time), then end, saying
    /// how many messages were left unanswered.
    Close(Duration, oneshot::Sender<usize>),
}

/// A message's fate.
#[derive(Debug)]
pub struct Answer<M, T, D, E> {
    /// The message's token.
    pub token: T,
    /// Where it landed, or why not.
    pub result: Result<D, E>,
    /// The message, when refused (for a dead-letter copy).
    pub refused: Option<M>,
    /// Its room, given back when the answer is dropped.
    _permit: Permit,
}

/// The caller's side: room, and messages handed to the task.
#[derive(Debug)]
pub struct Worker<M, T> {
    commands: mpsc::UnboundedSender<Command<M, T>>,
    admission: Admission,
}

impl<M, T> Worker<M, T> {
    /// A worker bounded to `max_records` messages and `max_bytes` bytes
    /// unanswered, and the task's end of its commands.
    pub fn new(
        max_records: usize,
        max_bytes: usize,
    ) -> (Self, mpsc::UnboundedReceiver<Command<M, T>>) {
        let (commands, rx) = mpsc::unbounded_channel();
        let admission = Admission::new(max_records, max_bytes);
        (
            Worker {
                commands,
                admission,
            },
            rx,
        )
    }

    /// Its in-flight bound.
    pub fn admission(&self) -> &Admission {
        &self.admission
    }

    /// Waits for room for a message of `size` bytes. Cancel-safe.
    pub async fn reserve(&self, size: usize) -> Permit {
        self.admission.reserve(size).await
    }

    /// Hands `message` to the task; its answer arrives on [`Answers`].
    pub fn publish(&self, permit: Permit, message: M, token: T) {
        let job = Job {
            message,
            token,
            permit,
        };
        // The task outlives every handle: it ends on `close`.
        let _ = self.commands.send(Command::Publish(Box::new(job)));
    }

    /// Messages handed over and not yet answered to the caller.
    pub fn in_flight(&self) -> usize {
        self.admission.in_flight()
    }

    /// Their bytes (in whole KiB).
    pub fn in_flight_bytes(&self) -> usize {
        self.admission.in_flight_bytes()
    }

    /// How long messages have waited without any answer (zero when none
    /// waits).
    pub fn stalled_for(&self) -> Duration {
        self.admission.stalled_for()
    }

    /// Waits up to `within` for the answers of what is in flight (they
    /// arrive meanwhile), then ends the task. Returns how many messages
    /// were left unanswered.
    pub async fn close(self, within: Duration) -> usize {
        let (tx, rx) = oneshot::channel();
        if self.commands.send(Command::Close(within, tx)).is_err() {
            return self.in_flight();
        }
        rx.await.unwrap_or_else(|_| self.in_flight())
    }
}

/// The caller's end of the answers: each message's, once.
#[derive(Debug)]
pub struct Answers<M, T, D, E> {
    rx: mpsc::UnboundedReceiver<Answer<M, T, D, E>>,
}

impl<M, T, D, E> Answers<M, T, D, E> {
    /// The answers' channel: the task's end, and the caller's.
    pub fn channel() -> (mpsc::UnboundedSender<Answer<M, T, D, E>>, Self) {
        let (tx, rx) = mpsc::unbounded_channel();
        (tx, Answers { rx })
    }

    /// The next answer; `None` once the task ended and every answer was
    /// received. Cancel-safe.
    pub async fn next(&mut self) -> Option<Answer<M, T, D, E>> {
        self.rx.recv().await
    }

    /// The next answer if one is there.
    pub fn try_next(&mut self) -> Option<Answer<M, T, D, E>> {
        self.rx.try_recv().ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_answer_holds_its_room_until_the_caller_drops_it() {
        let (worker, mut commands) = Worker::<&str, u32>::new(1, 1 << 20);
        let (tx, mut answers) = Answers::<&str, u32, (), String>::channel();
        let permit = worker.reserve(3).await;
        worker.publish(permit, "one", 1);
        let Some(Command::Publish(job)) = commands.recv().await else {
            panic!("a job")
        };
        tx.send(job.answer(Err("refused".to_owned()), true))
            .unwrap();
        assert_eq!(worker.in_flight(), 1, "sent, not received");
        let answer = answers.next().await.unwrap();
        assert_eq!((answer.token, answer.refused), (1, Some("one")));
        assert_eq!(worker.in_flight(), 1, "held while the answer is");
        drop(answer);
        assert_eq!(worker.in_flight(), 0, "received: the room is back");
    }
}
