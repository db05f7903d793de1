//! What SQS takes, checked before a message is sent: its body and
//! attributes as SQS counts them, the identifiers FIFO queues need, and
//! what a message is refused for.

use bytes::Bytes;
use sha2::{Digest, Sha256};

/// Most message attributes SQS takes per message.
pub const MAX_ATTRIBUTES: usize = 10;
/// Most characters in a message group or deduplication id.
const MAX_ID_CHARS: usize = 128;
/// The group of messages without a key (one group: they keep their order).
pub const NO_KEY_GROUP: &str = "walbox.no-key";

/// Which of the sink's queues a message goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QueueRole {
    /// The events' queue.
    Events,
    /// The dead-letter queue.
    DeadLetters,
}

/// One message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    /// Its queue.
    pub queue: QueueRole,
    /// Its body: SQS takes text (UTF-8, the characters XML allows).
    pub body: Bytes,
    /// Its key (the aggregate id): on a FIFO queue, its message group.
    pub key: Option<Bytes>,
    /// What identifies it across re-sends: on a FIFO queue, its
    /// deduplication id (SQS drops a second message with the same id
    /// within five minutes).
    pub dedup: String,
    /// Message attributes, each sent as a `String` attribute when it is
    /// text SQS takes, else as `Binary`; an empty value is not sent (SQS
    /// takes none).
    pub attributes: Vec<(String, Bytes)>,
}

/// Why SQS will not take a message: for good, as it is.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// Larger than the queue's `MaximumMessageSize`.
    #[error("message of {size} bytes (body and attributes): the queue takes at most {max} (its MaximumMessageSize)")]
    TooLarge {
        /// Its size as SQS counts it.
        size: usize,
        /// The queue's limit.
        max: usize,
    },
    /// Its body is empty, not UTF-8, or holds a character SQS rejects.
    #[error("message body {0}: SQS takes non-empty text (UTF-8 without control characters other than tab, CR and LF)")]
    Body(&'static str),
    /// More attributes than SQS takes.
    #[error("{0} message attributes (headers and the key): SQS takes at most 10")]
    TooManyAttributes(usize),
    /// An attribute name SQS rejects.
    #[error("message attribute name {0:?}: SQS takes 1 to 256 of A-Z a-z 0-9 _ - . (no leading, trailing or double period, no AWS. or Amazon. prefix)")]
    AttributeName(String),
    /// SQS refused it (a per-entry failure of SendMessageBatch at the
    /// sender's fault).
    #[error("SQS refused the message ({code}): {text}")]
    Refused {
        /// SQS's error code.
        code: String,
        /// Its message.
        text: String,
    },
}

/// A message as it will be sent: checked, its attributes typed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Checked {
    pub(crate) body: String,
    pub(crate) attributes: Vec<(String, Attribute)>,
    pub(crate) size: usize,
}

/// An attribute's value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Attribute {
    String(String),
    Binary(Bytes),
}

impl Message {
    /// Its size for the in-flight bound.
    pub fn size(&self) -> usize {
        self.body.len()
            + self
                .attributes
                .iter()
                .map(|(k, v)| k.len() + v.len())
                .sum::<usize>()
    }

    /// The message as SQS will take it, or why it will not.
    pub(crate) fn check(&self, max_size: usize) -> Result<Checked, Refusal> {
        let body = match std::str::from_utf8(&self.body) {
            Err(_) => return Err(Refusal::Body("is not UTF-8")),
            Ok("") => return Err(Refusal::Body("is empty")),
            Ok(s) if !s.chars().all(sqs_char) => {
                return Err(Refusal::Body("holds a character SQS does not take"))
            }
            Ok(s) => s.to_owned(),
        };
        let sent: Vec<&(String, Bytes)> = self
            .attributes
            .iter()
            .filter(|(_, v)| !v.is_empty())
            .collect();
        if sent.len() > MAX_ATTRIBUTES {
            return Err(Refusal::TooManyAttributes(sent.len()));
        }
        let mut size = body.len();
        let mut attributes = Vec::with_capacity(sent.len());
        for (name, value) in sent {
            if !attribute_name(name) {
                return Err(Refusal::AttributeName(name.clone()));
            }
            let value = match std::str::from_utf8(value) {
                Ok(s) if s.chars().all(sqs_char) => Attribute::String(s.to_owned()),
                _ => Attribute::Binary(value.clone()),
            };
            // SQS counts the name, the data type ("String"/"Binary") and
            // the value.
            size += name.len() + 6 + value.len();
            attributes.push((name.clone(), value));
        }
        if size > max_size {
            return Err(Refusal::TooLarge {
                size,
                max: max_size,
            });
        }
        Ok(Checked {
            body,
            attributes,
            size,
        })
    }

    /// This message with a note in place of its body of `size` bytes,
    /// which the queue's `max` does not take (for a dead-letter copy: its
    /// attributes say what it was and why it failed).
    pub(crate) fn without_body(&self, size: usize, max: usize) -> Message {
        let note = format!(
            "{{\"walbox.body_omitted\":\"the message was {size} bytes (body and attributes); the dead-letter queue takes at most {max}\"}}"
        );
        Message {
            body: Bytes::from(note),
            ..self.clone()
        }
    }

    /// Its message group on a FIFO queue: the key, or its SHA-256 when
    /// SQS would not take the key as a group id.
    pub fn group_id(&self) -> String {
        match &self.key {
            None => NO_KEY_GROUP.to_owned(),
            Some(k) if k.is_empty() => NO_KEY_GROUP.to_owned(),
            Some(k) => fifo_id(k),
        }
    }

    /// Its deduplication id on a FIFO queue.
    pub fn dedup_id(&self) -> String {
        fifo_id(self.dedup.as_bytes())
    }
}

impl Attribute {
    fn len(&self) -> usize {
        match self {
            Attribute::String(s) => s.len(),
            Attribute::Binary(b) => b.len(),
        }
    }
}

/// `bytes` as a FIFO group or deduplication id: as they are when SQS takes
/// them (1 to 128 of letters, digits and ASCII punctuation), else
/// `sha256:` and their SHA-256 in hex (the same bytes, the same id).
pub fn fifo_id(bytes: &[u8]) -> String {
    let valid = !bytes.is_empty()
        && bytes.len() <= MAX_ID_CHARS
        && bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || b.is_ascii_punctuation());
    if valid {
        // Checked ASCII above.
        return String::from_utf8_lossy(bytes).into_owned();
    }
    let digest = Sha256::digest(bytes);
    let mut out = String::with_capacity(7 + 64);
    out.push_str("sha256:");
    for b in digest {
        out.push_str(&format!("{b:02x}"));
    }
    out
}

/// A character SQS takes in a body or a string attribute (XML 1.0's).
fn sqs_char(c: char) -> bool {
    matches!(c, '\t' | '\n' | '\r') || (c >= ' ' && c != '\u{FFFE}' && c != '\u{FFFF}')
}

/// An attribute name SQS takes.
fn attribute_name(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    !name.is_empty()
        && name.len() <= 256
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
        && !name.starts_with('.')
        && !name.ends_with('.')
        && !name.contains("..")
        && !lower.starts_with("aws.")
        && !lower.starts_with("amazon.")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(body: &[u8], attributes: &[(&str, &[u8])]) -> Message {
        Message {
            queue: QueueRole::Events,
            body: Bytes::copy_from_slice(body),
            key: Some(Bytes::from_static(b"order-1")),
            dedup: "e-1".into(),
            attributes: attributes
                .iter()
                .map(|(k, v)| ((*k).to_owned(), Bytes::copy_from_slice(v)))
                .collect(),
        }
    }

    #[test]
    fn size_counts_body_names_types_and_values() {
        let m = message(b"{\"a\":1}", &[("id", b"e-1"), ("walbox.key", b"order-1")]);
        let c = m.check(1024).unwrap();
        assert_eq!(c.size, 7 + (2 + 6 + 3) + (10 + 6 + 7));
        assert_eq!(
            m.check(c.size - 1),
            Err(Refusal::TooLarge {
                size: c.size,
                max: c.size - 1
            })
        );
    }

    #[test]
    fn bodies_sqs_does_not_take_are_refused() {
        assert_eq!(
            message(b"", &[]).check(100).unwrap_err(),
            Refusal::Body("is empty")
        );
        assert_eq!(
            message(&[0xff, 0xfe], &[]).check(100).unwrap_err(),
            Refusal::Body("is not UTF-8")
        );
        assert_eq!(
            message(b"a\x01b", &[]).check(100).unwrap_err(),
            Refusal::Body("holds a character SQS does not take")
        );
        assert!(message("tab\there\r\n ünï".as_bytes(), &[])
            .check(100)
            .is_ok());
    }

    #[test]
    fn attributes_are_typed_named_and_counted() {
        let c = message(b"x", &[("bin", &[0, 1, 2]), ("empty", b""), ("t", b"v")])
            .check(100)
            .unwrap();
        assert_eq!(
            c.attributes,
            vec![
                (
                    "bin".to_owned(),
                    Attribute::Binary(Bytes::from_static(&[0, 1, 2]))
                ),
                ("t".to_owned(), Attribute::String("v".into())),
            ]
        );
        for bad in ["AWS.trace", "amazon.x", ".a", "a.", "a..b", "a b", ""] {
            assert_eq!(
                message(b"x", &[(bad, b"v")]).check(100).unwrap_err(),
                Refusal::AttributeName(bad.into()),
                "{bad}"
            );
        }
        let many: Vec<(String, Bytes)> = (0..11)
            .map(|i| (format!("h{i}"), Bytes::from_static(b"v")))
            .collect();
        let mut m = message(b"x", &[]);
        m.attributes = many;
        assert_eq!(m.check(1000).unwrap_err(), Refusal::TooManyAttributes(11));
    }

    #[test]
    fn fifo_ids_are_kept_when_valid_and_hashed_when_not() {
        assert_eq!(fifo_id(b"order-1:{x}"), "order-1:{x}");
        let long = fifo_id(&[b'a'; 129]);
        assert!(long.starts_with("sha256:") && long.len() == 71, "{long}");
        assert_eq!(fifo_id("ünï".as_bytes()), fifo_id("ünï".as_bytes()));
        assert_ne!(fifo_id("ünï".as_bytes()), fifo_id("üni".as_bytes()));
        assert_eq!(fifo_id(b"a b").len(), 71);
        let mut m = message(b"x", &[]);
        m.key = None;
        assert_eq!(m.group_id(), NO_KEY_GROUP);
        m.key = Some(Bytes::new());
        assert_eq!(m.group_id(), NO_KEY_GROUP);
    }
}
