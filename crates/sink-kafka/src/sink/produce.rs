//! One record into librdkafka's queue, the cheap way.
//!
//! rust-rdkafka's `send` names the topic by a `CString` made per record,
//! and librdkafka looks that name up under its handle's write lock, each
//! time. Here a topic handle is made once per topic ([`TopicHandle`], kept
//! with the topics the sink has checked) and the record goes in through
//! `rd_kafka_produceva` with it: no allocation for the name, no lock taken
//! to find the topic. The rest is what rust-rdkafka does: the key and value
//! copied by librdkafka (`RD_KAFKA_MSG_F_COPY`), the headers handed over,
//! the delivery opaque boxed, read back by the same delivery callback.
//!
//! This module is the producer's only FFI: each `unsafe` says what it
//! relies on.
#![allow(unsafe_code)]

use std::ffi::{c_void, CString};
use std::ptr::{self, NonNull};
use std::sync::Arc;

use rdkafka::bindings as rd;
use rdkafka::error::RDKafkaErrorCode;

/// librdkafka's handle of one topic, shared by the records produced to it.
/// It must not outlive the producer it was made by: the sink drops its
/// handles before its producer.
#[derive(Clone)]
pub(crate) struct TopicHandle(Arc<RawTopic>);

struct RawTopic(NonNull<rd::rd_kafka_topic_t>);

// SAFETY: librdkafka's topic handles are thread-safe (refcounted, their
// state behind their own locks); walbox only passes the pointer to
// librdkafka calls.
unsafe impl Send for RawTopic {}
unsafe impl Sync for RawTopic {}

impl Drop for RawTopic {
    fn drop(&mut self) {
        // SAFETY: made by `rd_kafka_topic_new`, destroyed once. Records in
        // flight hold references of their own.
        unsafe { rd::rd_kafka_topic_destroy(self.0.as_ptr()) }
    }
}

impl TopicHandle {
    /// The handle of `name` on the producer `rk`: `None` for a name with a
    /// NUL byte or one librdkafka refuses (it then refuses the record too,
    /// and the caller produces by name to get that refusal).
    ///
    /// # Safety
    ///
    /// `rk` is a live producer, and the handle is dropped before it.
    pub(crate) unsafe fn new(rk: *mut rd::rd_kafka_t, name: &str) -> Option<TopicHandle> {
        let name = CString::new(name).ok()?;
        // The topic's settings come from the producer's (a null conf).
        let raw = rd::rd_kafka_topic_new(rk, name.as_ptr(), ptr::null_mut());
        NonNull::new(raw).map(|p| TopicHandle(Arc::new(RawTopic(p))))
    }
}

/// A record's headers as librdkafka holds them, destroyed on drop unless
/// produced (librdkafka then owns them).
pub(crate) struct Headers(NonNull<rd::rd_kafka_headers_t>);

// SAFETY: a header list is plain memory owned by whoever holds it.
unsafe impl Send for Headers {}

impl Headers {
    pub(crate) fn with_capacity(n: usize) -> Headers {
        // SAFETY: returns a fresh list (librdkafka aborts when out of memory).
        let raw = unsafe { rd::rd_kafka_headers_new(n) };
        Headers(NonNull::new(raw).expect("rd_kafka_headers_new returns a list"))
    }

    /// Appends a header; the name need not be NUL-terminated (its length is
    /// passed), and both are copied.
    pub(crate) fn add(&mut self, name: &str, value: &[u8]) {
        // SAFETY: the list is ours and writable; the pointers are valid for
        // the lengths given. Adding fails only on a read-only list.
        unsafe {
            rd::rd_kafka_header_add(
                self.0.as_ptr(),
                name.as_ptr().cast(),
                name.len() as isize,
                value.as_ptr().cast(),
                value.len() as isize,
            );
        }
    }
}

impl Drop for Headers {
    fn drop(&mut self) {
        // SAFETY: still ours (a produced list is forgotten, not dropped).
        unsafe { rd::rd_kafka_headers_destroy(self.0.as_ptr()) }
    }
}

/// One record, borrowed for the call (librdkafka copies key and value).
pub(crate) struct Message<'a> {
    pub(crate) key: Option<&'a [u8]>,
    pub(crate) value: Option<&'a [u8]>,
    /// Milliseconds since the Unix epoch; 0: the producer stamps it.
    pub(crate) timestamp_ms: i64,
}

/// Enqueues `message` for `topic` on the producer `rk`, with `headers` and
/// the delivery opaque `opaque` (read back by the delivery callback).
/// On success librdkafka owns both; on a refusal they are handed back.
///
/// # Safety
///
/// `rk` is the live producer `topic` was made by, and `opaque` is what the
/// producer's delivery callback takes back (`IntoOpaque::into_ptr` of its
/// `DeliveryOpaque`).
pub(crate) unsafe fn produce(
    rk: *mut rd::rd_kafka_t,
    topic: &TopicHandle,
    message: &Message<'_>,
    headers: Headers,
    opaque: *mut c_void,
) -> Result<(), (RDKafkaErrorCode, Headers)> {
    let mem = |b: Option<&[u8]>| match b {
        Some(b) => rd::rd_kafka_vu_s__bindgen_ty_1__bindgen_ty_1 {
            ptr: b.as_ptr() as *mut c_void,
            size: b.len(),
        },
        None => rd::rd_kafka_vu_s__bindgen_ty_1__bindgen_ty_1 {
            ptr: ptr::null_mut(),
            size: 0,
        },
    };
    use rd::rd_kafka_vtype_t as V;
    let vu = |vtype, u| rd::rd_kafka_vu_t { vtype, u };
    let vus = [
        vu(
            V::RD_KAFKA_VTYPE_RKT,
            rd::rd_kafka_vu_s__bindgen_ty_1 {
                rkt: topic.0 .0.as_ptr(),
            },
        ),
        vu(
            V::RD_KAFKA_VTYPE_PARTITION,
            rd::rd_kafka_vu_s__bindgen_ty_1 {
                // RD_KAFKA_PARTITION_UA: the partitioner chooses.
                i32_: -1,
            },
        ),
        vu(
            V::RD_KAFKA_VTYPE_MSGFLAGS,
            rd::rd_kafka_vu_s__bindgen_ty_1 {
                i: rd::RD_KAFKA_MSG_F_COPY,
            },
        ),
        vu(
            V::RD_KAFKA_VTYPE_VALUE,
            rd::rd_kafka_vu_s__bindgen_ty_1 {
                mem: mem(message.value),
            },
        ),
        vu(
            V::RD_KAFKA_VTYPE_KEY,
            rd::rd_kafka_vu_s__bindgen_ty_1 {
                mem: mem(message.key),
            },
        ),
        vu(
            V::RD_KAFKA_VTYPE_OPAQUE,
            rd::rd_kafka_vu_s__bindgen_ty_1 { ptr: opaque },
        ),
        vu(
            V::RD_KAFKA_VTYPE_TIMESTAMP,
            rd::rd_kafka_vu_s__bindgen_ty_1 {
                i64_: message.timestamp_ms,
            },
        ),
        vu(
            V::RD_KAFKA_VTYPE_HEADERS,
            rd::rd_kafka_vu_s__bindgen_ty_1 {
                headers: headers.0.as_ptr(),
            },
        ),
    ];
    let error = rd::rd_kafka_produceva(rk, vus.as_ptr(), vus.len());
    if error.is_null() {
        // librdkafka owns the headers now, and frees them with the record.
        std::mem::forget(headers);
        return Ok(());
    }
    // After a fatal error produceva names the error's own cause (say
    // CLUSTER_AUTHORIZATION_FAILED) where producev says __FATAL: the
    // latter is what the sink reads the cause for (`with_fatal_cause`).
    let code = if rd::rd_kafka_error_is_fatal(error) != 0 {
        RDKafkaErrorCode::Fatal
    } else {
        RDKafkaErrorCode::from(rd::rd_kafka_error_code(error))
    };
    rd::rd_kafka_error_destroy(error);
    Err((code, headers))
}
