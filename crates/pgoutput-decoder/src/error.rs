//! Decoding errors: where in the message, and what was expected.

/// A message could not be decoded.
///
/// Carries the message kind being decoded, the byte offset (from the start of
/// the message, tag included) where decoding stopped, and what was wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed {message} at byte {offset}: {kind}")]
pub struct DecodeError {
    message: &'static str,
    offset: usize,
    kind: DecodeErrorKind,
}

impl DecodeError {
    pub(crate) fn new(message: &'static str, offset: usize, kind: DecodeErrorKind) -> Self {
        DecodeError {
            message,
            offset,
            kind,
        }
    }

    /// The kind of message being decoded (`"Insert"`, `"XLogData"`, …).
    pub fn message(&self) -> &'static str {
        self.message
    }

    /// Byte offset from the start of the message where decoding stopped.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// What was wrong.
    pub fn kind(&self) -> &DecodeErrorKind {
        &self.kind
    }
}

/// What was wrong with a message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeErrorKind {
    /// The message ended before a field.
    #[error("expected {expected} ({need} bytes), {have} remain")]
    Truncated {
        /// The field that was being read.
        expected: &'static str,
        /// Bytes that field needs.
        need: usize,
        /// Bytes left in the message.
        have: usize,
    },
    /// A string field had no terminating NUL.
    #[error("expected {0} as a NUL-terminated string, found no NUL")]
    UnterminatedString(&'static str),
    /// A string field was not UTF-8.
    #[error("{0} is not valid UTF-8")]
    InvalidUtf8(&'static str),
    /// A length field was negative.
    #[error("negative length {length} for {field}")]
    NegativeLength {
        /// The length read.
        length: i32,
        /// The field it measures.
        field: &'static str,
    },
    /// The first byte named no known message.
    #[error("unknown message tag {0:?}")]
    UnknownTag(char),
    /// The message was empty.
    #[error("empty message")]
    Empty,
    /// A tuple column had an unknown kind byte.
    #[error("unknown tuple column kind {0:?} (expected 'n', 'u', 't' or 'b')")]
    UnknownColumnKind(char),
    /// A marker byte was not one of the expected values.
    #[error("unexpected marker {found:?}, expected {expected}")]
    UnexpectedMarker {
        /// The byte found.
        found: char,
        /// What was allowed there.
        expected: &'static str,
    },
    /// Bytes remained after the last field.
    #[error("{0} trailing bytes after the message")]
    TrailingBytes(usize),
    /// The message does not exist in the negotiated protocol version.
    #[error("not part of pgoutput protocol version {version} (needs {needs} or later)")]
    NotInVersion {
        /// The decoder's protocol version.
        version: u32,
        /// The first version that has the message.
        needs: u32,
    },
}
