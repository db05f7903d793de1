//! A bounds-checked cursor over a message.

use bytes::Bytes;

use crate::error::{DecodeError, DecodeErrorKind};
use crate::lsn::Lsn;
use crate::text::Text;

/// Reads big-endian fields from a message, checking every length against the
/// bytes that remain. Slices share the message's buffer (no copies).
pub(crate) struct Reader {
    buf: Bytes,
    pos: usize,
    message: &'static str,
}

impl Reader {
    pub(crate) fn new(buf: Bytes, message: &'static str) -> Self {
        Reader {
            buf,
            pos: 0,
            message,
        }
    }

    /// Continues reading the same buffer as another message kind (after the
    /// tag told us which).
    pub(crate) fn rename(&mut self, message: &'static str) {
        self.message = message;
    }

    pub(crate) fn position(&self) -> usize {
        self.pos
    }

    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    pub(crate) fn error(&self, kind: DecodeErrorKind) -> DecodeError {
        DecodeError::new(self.message, self.pos, kind)
    }

    pub(crate) fn error_at(&self, offset: usize, kind: DecodeErrorKind) -> DecodeError {
        DecodeError::new(self.message, offset, kind)
    }

    fn take<const N: usize>(&mut self, expected: &'static str) -> Result<[u8; N], DecodeError> {
        let end = self.pos + N;
        match self.buf.get(self.pos..end) {
            Some(s) => {
                let mut out = [0u8; N];
                out.copy_from_slice(s);
                self.pos = end;
                Ok(out)
            }
            None => Err(self.error(DecodeErrorKind::Truncated {
                expected,
                need: N,
                have: self.remaining(),
            })),
        }
    }

    pub(crate) fn u8(&mut self, expected: &'static str) -> Result<u8, DecodeError> {
        Ok(self.take::<1>(expected)?[0])
    }

    pub(crate) fn i16(&mut self, expected: &'static str) -> Result<i16, DecodeError> {
        Ok(i16::from_be_bytes(self.take(expected)?))
    }

    pub(crate) fn i32(&mut self, expected: &'static str) -> Result<i32, DecodeError> {
        Ok(i32::from_be_bytes(self.take(expected)?))
    }

    pub(crate) fn u32(&mut self, expected: &'static str) -> Result<u32, DecodeError> {
        Ok(u32::from_be_bytes(self.take(expected)?))
    }

    pub(crate) fn i64(&mut self, expected: &'static str) -> Result<i64, DecodeError> {
        Ok(i64::from_be_bytes(self.take(expected)?))
    }

    pub(crate) fn lsn(&mut self, expected: &'static str) -> Result<Lsn, DecodeError> {
        Ok(Lsn::new(u64::from_be_bytes(self.take(expected)?)))
    }

    /// A count of following items (`Int16` or `Int32` on the wire, by
    /// `wide`). A negative count is an error; the count is not checked
    /// against the remaining bytes here, so callers must not allocate by it
    /// unbounded.
    pub(crate) fn count(&mut self, wide: bool, field: &'static str) -> Result<usize, DecodeError> {
        let at = self.pos;
        let n = if wide {
            self.i32(field)?
        } else {
            i32::from(self.i16(field)?)
        };
        if n < 0 {
            return Err(self.error_at(at, DecodeErrorKind::NegativeLength { length: n, field }));
        }
        Ok(n as usize)
    }

    /// `n` bytes, as a slice of the message.
    pub(crate) fn bytes(&mut self, n: usize, expected: &'static str) -> Result<Bytes, DecodeError> {
        let start = self.skip(n, expected)?;
        Ok(self.buf.slice(start..self.pos))
    }

    /// Passes over `n` bytes; where they start. Past the end is an error.
    fn skip(&mut self, n: usize, expected: &'static str) -> Result<usize, DecodeError> {
        if n > self.remaining() {
            return Err(self.error(DecodeErrorKind::Truncated {
                expected,
                need: n,
                have: self.remaining(),
            }));
        }
        let start = self.pos;
        self.pos += n;
        Ok(start)
    }

    /// A length-prefixed (`Int32`) byte string. A negative length is an error.
    pub(crate) fn len_prefixed(&mut self, expected: &'static str) -> Result<Bytes, DecodeError> {
        let len = self.count(true, expected)?;
        self.bytes(len, expected)
    }

    /// Checks and passes over a length-prefixed (`Int32`) byte string, as
    /// [`Reader::len_prefixed`] without making a `Bytes` of it: a tuple's
    /// columns are checked this way, once per column of every row, and a
    /// slice made and dropped there cost two atomic reference-count
    /// updates each.
    pub(crate) fn skip_len_prefixed(&mut self, expected: &'static str) -> Result<(), DecodeError> {
        let len = self.count(true, expected)?;
        self.skip(len, expected).map(|_| ())
    }

    /// A NUL-terminated UTF-8 string; the NUL is consumed, not returned.
    pub(crate) fn cstr(&mut self, expected: &'static str) -> Result<Text, DecodeError> {
        let at = self.pos;
        let rest = &self.buf[self.pos..];
        let Some(nul) = rest.iter().position(|&b| b == 0) else {
            return Err(self.error(DecodeErrorKind::UnterminatedString(expected)));
        };
        let raw = self.buf.slice(self.pos..self.pos + nul);
        let text = Text::from_utf8(raw)
            .map_err(|_| self.error_at(at, DecodeErrorKind::InvalidUtf8(expected)))?;
        self.pos += nul + 1;
        Ok(text)
    }

    /// Ends the message: any byte left is an error.
    pub(crate) fn finish(&self) -> Result<(), DecodeError> {
        match self.remaining() {
            0 => Ok(()),
            n => Err(self.error(DecodeErrorKind::TrailingBytes(n))),
        }
    }

    /// The bytes from `start` to the current position.
    pub(crate) fn slice_from(&self, start: usize) -> Bytes {
        self.buf.slice(start..self.pos)
    }
}
