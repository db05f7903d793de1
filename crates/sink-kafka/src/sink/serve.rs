//! Who serves the producer's main queue: delivery reports, client errors,
//! statistics, librdkafka's log lines and token refreshes.
//!
//! rust-rdkafka's `ThreadedProducer` serves it from a thread of its own.
//! Every record librdkafka copies (and its headers) is allocated on the
//! thread that produces it, and was freed on that polling thread after its
//! delivery callback: glibc's allocator then took the producing thread's
//! arena lock for each free and merged the chunks back, and a profile of a backlog drain put ~70%
//! of that thread's CPU in `_int_free` and `malloc_consolidate`.
//!
//! Here the queue is served by a task on the runtime that produces (on
//! walbox's current-thread runtime, the relay's own thread). librdkafka
//! calls [`queue_not_empty`] when the queue goes from empty to not empty;
//! that wakes the task, which serves what is queued, a bounded number of
//! events at a time. The callbacks (`super::context`) never wait, so
//! serving never blocks the runtime, with one exception: `AWS_MSK_IAM`'s
//! token refresh may wait for AWS credentials, so a producer with it (or
//! one made outside a runtime) is served by a thread of its own, as
//! before ([`Serving::Thread`]).
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::ops::Deref;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use rdkafka::bindings as rd;
use rdkafka::producer::{BaseProducer, Producer as _, ProducerContext};
use tokio::sync::Notify;

/// Events served before the task lets the runtime's other tasks run.
const SERVE_AT_MOST: usize = 64;

/// The producer and, when a task serves its queue, the queue's wake-up.
pub(super) struct Producer<C: ProducerContext + 'static> {
    // Dropped before `base`: librdkafka wants its queue handles destroyed
    // before the client.
    wake: Option<Wake>,
    base: BaseProducer<C>,
}

impl<C: ProducerContext + 'static> Deref for Producer<C> {
    type Target = BaseProducer<C>;

    fn deref(&self) -> &BaseProducer<C> {
        &self.base
    }
}

/// Stops the serving thread, if there is one, when dropped; drop it before
/// the producer.
pub(super) enum Serving {
    /// A task serves the queue; it ends with the producer.
    Task,
    /// A thread serves it (see the module docs).
    Thread {
        stop: Arc<AtomicBool>,
        thread: Option<std::thread::JoinHandle<()>>,
    },
}

impl Drop for Serving {
    fn drop(&mut self) {
        if let Serving::Thread { stop, thread } = self {
            stop.store(true, Ordering::Relaxed);
            if let Some(thread) = thread.take() {
                // It polls in slices of 100 ms.
                let _ = thread.join();
            }
        }
    }
}

/// How a thread that serves the queue waits for events.
const THREAD_POLL: Duration = Duration::from_millis(100);

/// Starts serving `base`'s main queue: on the current tokio runtime unless
/// `own_thread` (or there is no runtime), else on a thread.
pub(super) fn start<C>(base: BaseProducer<C>, own_thread: bool) -> (Arc<Producer<C>>, Serving)
where
    C: ProducerContext + Send + Sync + 'static,
{
    let runtime = tokio::runtime::Handle::try_current().ok();
    match runtime {
        Some(runtime) if !own_thread => {
            let notify = Arc::new(Notify::new());
            let wake = Wake::enable(base.client().native_ptr(), Arc::clone(&notify));
            let producer = Arc::new(Producer {
                wake: Some(wake),
                base,
            });
            runtime.spawn(serve(Arc::downgrade(&producer), notify));
            (producer, Serving::Task)
        }
        _ => {
            let producer = Arc::new(Producer { wake: None, base });
            let stop = Arc::new(AtomicBool::new(false));
            let thread = std::thread::Builder::new()
                .name("walbox-kafka-reports".into())
                .spawn({
                    let producer = Arc::clone(&producer);
                    let stop = Arc::clone(&stop);
                    move || {
                        while !stop.load(Ordering::Relaxed) {
                            producer.base.poll(THREAD_POLL);
                        }
                    }
                })
                .expect("a thread can be started");
            (
                producer,
                Serving::Thread {
                    stop,
                    thread: Some(thread),
                },
            )
        }
    }
}

/// The task: serves what is queued, then waits for librdkafka to say more
/// was. Ends once the producer is gone.
async fn serve<C>(producer: Weak<Producer<C>>, notify: Arc<Notify>)
where
    C: ProducerContext + Send + Sync + 'static,
{
    loop {
        let more = match producer.upgrade() {
            Some(p) => p.serve_queued(),
            None => return,
        };
        if more {
            tokio::task::yield_now().await;
        } else {
            // A wake-up that came after the queue was last found empty is
            // kept (`notify_one` stores it), so none is lost.
            notify.notified().await;
        }
    }
}

impl<C: ProducerContext + 'static> Producer<C> {
    /// Serves up to [`SERVE_AT_MOST`] events; true if more are queued.
    fn serve_queued(&self) -> bool {
        let Some(wake) = &self.wake else {
            return false;
        };
        for _ in 0..SERVE_AT_MOST {
            if wake.queued() == 0 {
                return false;
            }
            // One event, without waiting.
            self.base.poll(Duration::ZERO);
        }
        wake.queued() > 0
    }
}

/// A handle of the producer's main queue whose first event after it was
/// empty wakes the serving task.
struct Wake {
    queue: NonNull<rd::rd_kafka_queue_t>,
    /// Borrowed by librdkafka as the callback's opaque until disabled.
    notify: Arc<Notify>,
}

// SAFETY: librdkafka's queue handles are thread-safe (the queue has its own
// lock); walbox only passes the pointer to librdkafka calls.
unsafe impl Send for Wake {}
unsafe impl Sync for Wake {}

impl Wake {
    fn enable(rk: *mut rd::rd_kafka_t, notify: Arc<Notify>) -> Wake {
        // SAFETY: `rk` is a live producer; the queue handle returned is a
        // new reference, destroyed in `drop` (before the producer: see
        // `Producer`). The opaque points into `notify`, which `self` keeps
        // alive until the callback is disabled.
        unsafe {
            let queue =
                NonNull::new(rd::rd_kafka_queue_get_main(rk)).expect("a producer has a main queue");
            let opaque = Arc::as_ptr(&notify).cast_mut().cast::<c_void>();
            rd::rd_kafka_queue_cb_event_enable(queue.as_ptr(), Some(queue_not_empty), opaque);
            Wake { queue, notify }
        }
    }

    /// Events (ops) in the queue.
    fn queued(&self) -> usize {
        // SAFETY: a live queue handle (destroyed only in `drop`).
        unsafe { rd::rd_kafka_queue_length(self.queue.as_ptr()) }
    }
}

impl Drop for Wake {
    fn drop(&mut self) {
        // SAFETY: the handle is ours; once the callback is disabled
        // librdkafka no longer reads the opaque.
        unsafe {
            rd::rd_kafka_queue_cb_event_enable(self.queue.as_ptr(), None, std::ptr::null_mut());
            rd::rd_kafka_queue_destroy(self.queue.as_ptr());
        }
        // The task sees the producer gone and ends.
        self.notify.notify_one();
    }
}

/// librdkafka's callback when the queue goes from empty to not empty,
/// called on one of its threads with the queue's lock held: it only wakes
/// the task.
unsafe extern "C" fn queue_not_empty(_rk: *mut rd::rd_kafka_t, opaque: *mut c_void) {
    // SAFETY: the opaque is the `Notify` that `Wake` keeps alive until this
    // callback is disabled.
    let notify = unsafe { &*opaque.cast::<Notify>().cast_const() };
    notify.notify_one();
}
