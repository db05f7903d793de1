//! The sending task: lanes of waiting messages, one `SendMessageBatch` on
//! its way per lane, and each answer turned into reports or into messages
//! sent again.
//!
//! A message's lane is fixed by its message group (FIFO queues) so that a
//! group's batches go one after another; messages to be sent again go back
//! to the front of their lane in their order, and the lane waits out its
//! backoff before sending anything else.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use aws_sdk_sqs::operation::send_message_batch::SendMessageBatchOutput;
use aws_sdk_sqs::primitives::Blob;
use aws_sdk_sqs::types::{MessageAttributeValue, SendMessageBatchRequestEntry};
use aws_sdk_sqs::Client;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::batch::{self, Waiting};
use crate::message::{Attribute, Checked};
use crate::queue::{describe, Class, QueueInfo};
use sink_core::worker::{Command, Job};

use crate::{Failure, Message, QueueRole, Refusal, Report, Stored};

/// The first wait before sending again, doubled up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// The queues messages go to.
pub(crate) struct Queues {
    pub(crate) events: QueueInfo,
    pub(crate) dead_letters: Option<QueueInfo>,
}

/// Counters the sink reads.
pub(crate) struct Counters {
    pub(crate) in_flight: Arc<AtomicUsize>,
}

/// A message checked and waiting in its lane.
struct Ready<T> {
    pending: Box<Job<Message, T>>,
    checked: Checked,
    group: String,
}

impl<T> Waiting for Ready<T> {
    fn group(&self) -> &str {
        &self.group
    }
    fn size(&self) -> usize {
        self.checked.size
    }
}

struct Lane<T> {
    queue: QueueInfo,
    waiting: VecDeque<Ready<T>>,
    busy: bool,
    /// Not before this (a backoff after a failure).
    not_before: Option<Instant>,
    backoff: Duration,
    /// Batches of one message to send before batching again (after SQS
    /// found a batch too long).
    singles: usize,
}

type Answer = Result<
    SendMessageBatchOutput,
    aws_sdk_sqs::error::SdkError<aws_sdk_sqs::operation::send_message_batch::SendMessageBatchError>,
>;

/// A request's outcome, with its lane and messages back.
struct Done<T> {
    lane: usize,
    batch: Vec<Ready<T>>,
    answer: Answer,
}

pub(crate) struct Sender<T> {
    client: Client,
    lanes: Vec<Lane<T>>,
    /// Lanes of the events' queue (the dead-letter lane, if any, is last).
    event_lanes: usize,
    commands: mpsc::UnboundedReceiver<Command<Message, T>>,
    reports: mpsc::UnboundedSender<Report<T>>,
    counters: Counters,
    requests: JoinSet<Done<T>>,
    /// SQS failing since (for one warning per outage).
    failing: Option<Instant>,
    /// Send nothing after a refusal.
    gapless: bool,
    /// A message was refused, and the sink is gapless: nothing more is
    /// sent.
    halted: bool,
}

impl<T: Send + 'static> Sender<T> {
    pub(crate) fn new(
        client: Client,
        queues: Queues,
        lanes: usize,
        gapless: bool,
        commands: mpsc::UnboundedReceiver<Command<Message, T>>,
        reports: mpsc::UnboundedSender<Report<T>>,
        counters: Counters,
    ) -> Self {
        let lane = |queue: &QueueInfo| Lane {
            queue: queue.clone(),
            waiting: VecDeque::new(),
            busy: false,
            not_before: None,
            backoff: FIRST_BACKOFF,
            singles: 0,
        };
        let event_lanes = lanes.max(1);
        let mut all: Vec<Lane<T>> = (0..event_lanes).map(|_| lane(&queues.events)).collect();
        if let Some(dl) = &queues.dead_letters {
            all.push(lane(dl));
        }
        Sender {
            client,
            lanes: all,
            event_lanes,
            commands,
            reports,
            counters,
            requests: JoinSet::new(),
            failing: None,
            gapless,
            halted: false,
        }
    }

    pub(crate) async fn run(mut self) {
        let mut closing: Option<(Instant, oneshot::Sender<usize>)> = None;
        loop {
            self.send_ready();
            if closing.is_some() && self.unreported() == 0 {
                break;
            }
            let wake = self.lanes.iter().filter_map(|l| l.not_before).min();
            let deadline = closing.as_ref().map(|(d, _)| *d);
            tokio::select! {
                command = self.commands.recv(), if closing.is_none() => match command {
                    Some(Command::Publish(p)) => self.accept(p),
                    Some(Command::Close(within, tx)) => {
                        closing = Some((Instant::now() + within, tx));
                    }
                    // Every sink handle is gone without a close.
                    None => break,
                },
                Some(done) = self.requests.join_next(), if !self.requests.is_empty() => {
                    match done {
                        Ok(done) => self.finish(done),
                        // A request's task panicked: its messages are
                        // unreported, and so never confirmed.
                        Err(e) => tracing::error!(error = %e, "an SQS request failed unexpectedly"),
                    }
                }
                () = sleep_until(wake), if wake.is_some() => {}
                () = sleep_until(deadline), if deadline.is_some() => break,
            }
        }
        self.requests.abort_all();
        let left = self.unreported();
        if let Some((_, tx)) = closing {
            let _ = tx.send(left);
        }
    }

    /// Messages not reported yet (waiting or on their way).
    fn unreported(&self) -> usize {
        self.counters.in_flight.load(Ordering::Relaxed)
    }

    /// Checks a new message and puts it in its lane, or reports it refused.
    fn accept(&mut self, pending: Box<Job<Message, T>>) {
        if self.halted {
            return self.report(*pending, Err(Failure::Withheld), false);
        }
        let lane = match pending.message.queue {
            QueueRole::DeadLetters if self.lanes.len() > self.event_lanes => self.event_lanes,
            QueueRole::DeadLetters => {
                let why = Failure::Stopped(
                    "a dead-letter message, and no dead-letter queue is set (sqs.dead_letter_queue_url)".into(),
                );
                return self.report(*pending, Err(why), false);
            }
            QueueRole::Events => 0,
        };
        let group = pending.message.group_id();
        let lane = match lane {
            0 => (fnv1a(group.as_bytes()) as usize) % self.event_lanes,
            dl => dl,
        };
        let max = self.lanes[lane].queue.max_message_bytes;
        let mut checked = pending.message.check(max);
        if let (QueueRole::DeadLetters, Err(Refusal::TooLarge { size, .. })) =
            (pending.message.queue, &checked)
        {
            checked = pending.message.without_body(*size, max).check(max);
        }
        match checked {
            Ok(checked) => self.lanes[lane].waiting.push_back(Ready {
                pending,
                checked,
                group,
            }),
            Err(refusal) => self.report(*pending, Err(Failure::Refused(refusal)), true),
        }
    }

    /// Starts a batch on every idle lane that has messages and no backoff
    /// to wait out.
    fn send_ready(&mut self) {
        if self.halted {
            return;
        }
        let now = Instant::now();
        for (i, lane) in self.lanes.iter_mut().enumerate() {
            if lane.busy || lane.waiting.is_empty() || lane.not_before.is_some_and(|t| t > now) {
                continue;
            }
            lane.not_before = None;
            let max_entries = if lane.singles > 0 {
                lane.singles -= 1;
                1
            } else {
                batch::MAX_ENTRIES
            };
            let taken = batch::take(
                &mut lane.waiting,
                lane.queue.fifo,
                max_entries,
                lane.queue.max_message_bytes,
            );
            lane.busy = true;
            let request = request(&self.client, &lane.queue, &taken);
            self.requests.spawn(async move {
                let answer = request.send().await;
                Done {
                    lane: i,
                    batch: taken,
                    answer,
                }
            });
        }
    }

    /// Turns an answer into reports, and what must go again back into its
    /// lane.
    fn finish(&mut self, done: Done<T>) {
        let Done {
            lane,
            batch,
            answer,
        } = done;
        self.lanes[lane].busy = false;
        let mut again: Vec<Ready<T>> = Vec::new();
        let mut why_again = String::new();
        match answer {
            Ok(out) => {
                let failed: HashMap<&str, _> = out.failed().iter().map(|f| (f.id(), f)).collect();
                let stored: HashMap<&str, _> =
                    out.successful().iter().map(|s| (s.id(), s)).collect();
                let mut outcomes = Vec::with_capacity(batch.len());
                for (i, ready) in batch.into_iter().enumerate() {
                    let id = i.to_string();
                    let outcome = match failed.get(id.as_str()) {
                        Some(f) if f.sender_fault() => Some(Err(Refusal::Refused {
                            code: f.code().to_owned(),
                            text: f.message().unwrap_or("").to_owned(),
                        })),
                        Some(f) => {
                            why_again = format!("{}: {}", f.code(), f.message().unwrap_or(""));
                            None
                        }
                        None => match stored.get(id.as_str()) {
                            Some(s) => Some(Ok(Stored {
                                message_id: s.message_id().to_owned(),
                                sequence_number: s.sequence_number().map(str::to_owned),
                            })),
                            None => {
                                why_again = "an entry SQS did not answer for".into();
                                None
                            }
                        },
                    };
                    outcomes.push((ready, outcome));
                }
                for (ready, outcome) in outcomes {
                    match outcome {
                        Some(Ok(stored)) => self.report(*ready.pending, Ok(stored), false),
                        Some(Err(r)) => self.report(*ready.pending, Err(Failure::Refused(r)), true),
                        None => again.push(ready),
                    }
                }
            }
            Err(e) => match Class::of(&e) {
                Class::Transient => {
                    why_again = describe(&e);
                    again = batch;
                }
                Class::BatchTooLong if batch.len() > 1 => {
                    self.lanes[lane].singles = batch.len();
                    again = batch;
                }
                Class::BatchTooLong => {
                    let refusal = Refusal::Refused {
                        code: "BatchRequestTooLong".into(),
                        text: describe(&e),
                    };
                    for ready in batch {
                        self.report(*ready.pending, Err(Failure::Refused(refusal.clone())), true);
                    }
                }
                Class::Definite => {
                    let why = format!("SQS queue {}: {}", self.lanes[lane].queue.url, describe(&e));
                    tracing::error!(error = %why, "SQS refused a request for good; stopping");
                    for ready in batch {
                        self.report(*ready.pending, Err(Failure::Stopped(why.clone())), false);
                    }
                }
            },
        }
        if self.halted {
            // A refusal in this batch halted the sink: what would go again
            // is withheld with the rest.
            for ready in again {
                self.report(*ready.pending, Err(Failure::Withheld), false);
            }
            return;
        }
        let lane = &mut self.lanes[lane];
        if again.is_empty() {
            lane.backoff = FIRST_BACKOFF;
            if let Some(since) = self.failing.take() {
                tracing::info!(after = ?since.elapsed(), "SQS takes messages again");
            }
            return;
        }
        if self.failing.is_none() {
            self.failing = Some(Instant::now());
            tracing::warn!(error = %why_again, messages = again.len(), retry_in = ?lane.backoff, "SQS did not take a batch; sending it again (nothing is skipped)");
        } else {
            tracing::debug!(error = %why_again, messages = again.len(), retry_in = ?lane.backoff, "SQS still failing");
        }
        for ready in again.into_iter().rev() {
            lane.waiting.push_front(ready);
        }
        lane.not_before = Some(Instant::now() + lane.backoff);
        lane.backoff = (lane.backoff * 2).min(MAX_BACKOFF);
    }

    fn report(&mut self, job: Job<Message, T>, result: Result<Stored, Failure>, keep: bool) {
        if self.gapless && !self.halted && matches!(result, Err(Failure::Refused(_))) {
            self.halt();
        }
        self.counters.in_flight.fetch_sub(1, Ordering::Relaxed);
        // The room is given back when the caller receives the report.
        let _ = self.reports.send(job.answer(result, keep));
    }
}

impl<T: Send + 'static> Sender<T> {
    /// A message was refused and the sink is gapless: what waits is
    /// withheld, and nothing more is sent.
    fn halt(&mut self) {
        self.halted = true;
        let waiting: Vec<Ready<T>> = self
            .lanes
            .iter_mut()
            .flat_map(|l| l.waiting.drain(..))
            .collect();
        if !waiting.is_empty() {
            tracing::info!(
                count = waiting.len(),
                "a message was refused: the messages after it are not sent (resent after a restart)"
            );
        }
        for ready in waiting {
            self.report(*ready.pending, Err(Failure::Withheld), false);
        }
    }
}

/// The SendMessageBatch request for `batch`, entries named by their index.
fn request<T>(
    client: &Client,
    queue: &QueueInfo,
    batch: &[Ready<T>],
) -> aws_sdk_sqs::operation::send_message_batch::builders::SendMessageBatchFluentBuilder {
    let mut request = client.send_message_batch().queue_url(&queue.url);
    for (i, ready) in batch.iter().enumerate() {
        let mut entry = SendMessageBatchRequestEntry::builder()
            .id(i.to_string())
            .message_body(ready.checked.body.clone());
        if queue.fifo {
            entry = entry
                .message_group_id(ready.group.clone())
                .message_deduplication_id(ready.pending.message.dedup_id());
        }
        for (name, value) in &ready.checked.attributes {
            let value = match value {
                Attribute::String(s) => MessageAttributeValue::builder()
                    .data_type("String")
                    .string_value(s.clone()),
                Attribute::Binary(b) => MessageAttributeValue::builder()
                    .data_type("Binary")
                    .binary_value(Blob::new(b.to_vec())),
            };
            entry = entry.message_attributes(name.clone(), value.build().expect("data type set"));
        }
        request = request.entries(entry.build().expect("id and body set"));
    }
    request
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// 32-bit FNV-1a: a group's lane.
fn fnv1a(bytes: &[u8]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in bytes {
        h ^= u32::from(*b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

#[cfg(test)]
mod tests {
    use aws_sdk_sqs::config::{BehaviorVersion, Region};
    use aws_sdk_sqs::error::SdkError;
    use aws_sdk_sqs::types::{BatchResultErrorEntry, SendMessageBatchResultEntry};
    use bytes::Bytes;

    use super::*;
    use sink_core::worker::Worker;

    fn sender(gapless: bool) -> (Sender<u32>, crate::Reports<u32>, Worker<Message, u32>) {
        let config = aws_sdk_sqs::Config::builder()
            .behavior_version(BehaviorVersion::latest())
            .region(Region::new("us-east-1"))
            .build();
        let (worker, commands_rx) = Worker::new(100, 1 << 20);
        let (reports, rx) = crate::Reports::channel();
        let queue = QueueInfo {
            url: "https://sqs.us-east-1.amazonaws.com/1/q.fifo".into(),
            fifo: true,
            max_message_bytes: 262_144,
        };
        let sender = Sender::new(
            Client::from_conf(config),
            Queues {
                events: queue,
                dead_letters: None,
            },
            1,
            gapless,
            commands_rx,
            reports,
            Counters {
                in_flight: Arc::new(AtomicUsize::new(0)),
            },
        );
        (sender, rx, worker)
    }

    /// Messages 0..5 of groups a, b, c, a, b, accepted in order.
    async fn accept_five(s: &mut Sender<u32>, worker: &Worker<Message, u32>) {
        for (n, key) in ["a", "b", "c", "a", "b"].into_iter().enumerate() {
            let message = Message {
                queue: QueueRole::Events,
                body: Bytes::from(format!("{{\"n\":{n}}}")),
                key: Some(Bytes::from_static(key.as_bytes())),
                dedup: format!("e-{n}"),
                attributes: vec![],
            };
            worker.publish(worker.reserve(1).await, message, n as u32);
            let Some(Command::Publish(job)) = s.commands.recv().await else {
                panic!("the job")
            };
            s.counters.in_flight.fetch_add(1, Ordering::Relaxed);
            s.accept(job);
        }
    }

    fn next_batch(s: &mut Sender<u32>) -> Vec<Ready<u32>> {
        let lane = &mut s.lanes[0];
        batch::take(&mut lane.waiting, true, batch::MAX_ENTRIES, 262_144)
    }

    fn waiting(s: &Sender<u32>) -> Vec<u32> {
        s.lanes[0].waiting.iter().map(|r| r.pending.token).collect()
    }

    fn drain(rx: &mut crate::Reports<u32>) -> Vec<(u32, Result<(), Failure>)> {
        std::iter::from_fn(|| rx.try_next())
            .map(|r| (r.token, r.result.map(|_| ())))
            .collect()
    }

    /// Entry 0 stored, entry 1 failed at SQS's fault, entry 2 refused.
    #[allow(clippy::result_large_err)] // the SDK's answer, as it comes
    fn partial() -> Answer {
        let failed = |id: &str, sender_fault: bool, code: &str| {
            BatchResultErrorEntry::builder()
                .id(id)
                .sender_fault(sender_fault)
                .code(code)
                .message("m")
                .build()
                .unwrap()
        };
        Ok(SendMessageBatchOutput::builder()
            .successful(
                SendMessageBatchResultEntry::builder()
                    .id("0")
                    .message_id("x")
                    .md5_of_message_body("y")
                    .build()
                    .unwrap(),
            )
            .failed(failed("1", false, "InternalError"))
            .failed(failed("2", true, "InvalidParameterValue"))
            .build()
            .unwrap())
    }

    #[tokio::test]
    async fn a_partial_failure_reports_each_entry_and_sends_the_rest_again_first_in_order() {
        let (mut s, mut rx, worker) = sender(false);
        accept_five(&mut s, &worker).await;
        let batch = next_batch(&mut s);
        assert_eq!(
            batch.iter().map(|r| r.pending.token).collect::<Vec<_>>(),
            [0, 1, 2],
            "one message per group"
        );
        s.lanes[0].busy = true;
        s.finish(Done {
            lane: 0,
            batch,
            answer: partial(),
        });
        let reports = drain(&mut rx);
        assert_eq!(reports[0], (0, Ok(())));
        assert_eq!(reports[1].0, 2);
        assert!(
            matches!(&reports[1].1, Err(Failure::Refused(Refusal::Refused { code, .. })) if code == "InvalidParameterValue"),
            "{reports:?}"
        );
        assert_eq!(reports.len(), 2, "the failed entry is not reported");
        // Message 1 goes again ahead of b's later message, after a backoff.
        assert_eq!(waiting(&s), [1, 3, 4]);
        assert!(!s.lanes[0].busy && s.lanes[0].not_before.is_some());
        assert_eq!(s.unreported(), 3);
    }

    #[tokio::test]
    async fn a_gapless_sink_withholds_everything_after_a_refusal() {
        let (mut s, mut rx, worker) = sender(true);
        accept_five(&mut s, &worker).await;
        let batch = next_batch(&mut s);
        s.finish(Done {
            lane: 0,
            batch,
            answer: partial(),
        });
        let reports = drain(&mut rx);
        let mut withheld: Vec<u32> = reports
            .iter()
            .filter(|(_, r)| *r == Err(Failure::Withheld))
            .map(|(t, _)| *t)
            .collect();
        withheld.sort_unstable();
        assert_eq!(
            withheld,
            [1, 3, 4],
            "the failed entry too: nothing goes again"
        );
        assert!(waiting(&s).is_empty());
        assert_eq!(s.unreported(), 0);
    }

    #[tokio::test]
    async fn a_request_without_answer_is_sent_again_whole_and_in_order() {
        let (mut s, mut rx, worker) = sender(false);
        accept_five(&mut s, &worker).await;
        let batch = next_batch(&mut s);
        s.finish(Done {
            lane: 0,
            batch,
            answer: Err(SdkError::timeout_error("no answer within 10 s")),
        });
        assert!(drain(&mut rx).is_empty());
        assert_eq!(waiting(&s), [0, 1, 2, 3, 4]);
        let backoff = s.lanes[0].backoff;
        assert_eq!(backoff, FIRST_BACKOFF * 2, "the next wait doubles");
    }
}
