//! Tuple data: the column values of a row, read lazily.

use bytes::Bytes;

use crate::error::{DecodeError, DecodeErrorKind};
use crate::reader::Reader;

/// One column's value in a tuple, borrowed from the message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Column<'a> {
    /// SQL NULL.
    Null,
    /// A TOASTed value the change did not touch; its value is not sent.
    UnchangedToast,
    /// The value in text format (the type's output function).
    Text(&'a [u8]),
    /// The value in binary format (the type's send function).
    Binary(&'a [u8]),
}

impl<'a> Column<'a> {
    /// The value as `&str` when it is text format and valid UTF-8; `None`
    /// for NULL, unchanged TOAST, binary or non-UTF-8 values.
    pub fn as_str(&self) -> Option<&'a str> {
        match self {
            Column::Text(b) => std::str::from_utf8(b).ok(),
            _ => None,
        }
    }

    /// The raw bytes of a text or binary value.
    pub fn as_bytes(&self) -> Option<&'a [u8]> {
        match self {
            Column::Text(b) | Column::Binary(b) => Some(b),
            _ => None,
        }
    }
}

/// The columns of one row, as sent in Insert, Update and Delete messages.
///
/// Decoding checks the whole tuple once (column count, kinds and every length)
/// and keeps a slice of the message; columns are then read on demand without
/// allocating, like `DataRowBody::ranges()` in postgres-protocol.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TupleData {
    pub(crate) count: u16,
    /// The column entries (kind bytes and values), after the count.
    pub(crate) data: Bytes,
}

impl TupleData {
    pub(crate) fn decode(r: &mut Reader) -> Result<TupleData, DecodeError> {
        let count = r.count(false, "tuple column count")?;
        let start = r.position();
        for _ in 0..count {
            let kind_at = r.position();
            match r.u8("tuple column kind")? {
                b'n' | b'u' => {}
                b't' | b'b' => {
                    r.skip_len_prefixed("tuple column value")?;
                }
                other => {
                    return Err(
                        r.error_at(kind_at, DecodeErrorKind::UnknownColumnKind(other as char))
                    )
                }
            }
        }
        Ok(TupleData {
            count: count as u16,
            data: r.slice_from(start),
        })
    }

    /// A tuple of text values (`None` for NULL), laid out as pgoutput sends
    /// an inserted row: for rows read with SQL (a snapshot backfill) that
    /// must map exactly like streamed ones. `None` when there are more than
    /// 65,535 columns or a value longer than 4 GiB.
    pub fn from_text<'v>(values: impl IntoIterator<Item = Option<&'v [u8]>>) -> Option<TupleData> {
        use bytes::BufMut;
        let mut data = bytes::BytesMut::new();
        let mut count: u16 = 0;
        for v in values {
            count = count.checked_add(1)?;
            match v {
                None => data.put_u8(b'n'),
                Some(v) => {
                    data.put_u8(b't');
                    data.put_u32(u32::try_from(v.len()).ok()?);
                    data.put_slice(v);
                }
            }
        }
        Some(TupleData {
            count,
            data: data.freeze(),
        })
    }

    /// Number of columns.
    pub fn len(&self) -> usize {
        usize::from(self.count)
    }

    /// True when the tuple has no columns.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The columns in order.
    pub fn iter(&self) -> Columns<'_> {
        Columns {
            data: &self.data,
            left: self.count,
        }
    }

    /// Column `index` (0-based), or `None` past the end. Walks the preceding
    /// columns: to read several, prefer one pass with [`TupleData::iter`].
    pub fn get(&self, index: usize) -> Option<Column<'_>> {
        self.iter().nth(index)
    }

    /// A text or binary value of column `index` as a slice of the message
    /// buffer, without copying (e.g. to hand a JSON payload to a producer).
    pub fn value_bytes(&self, index: usize) -> Option<Bytes> {
        let value = self.get(index)?.as_bytes()?;
        Some(self.data.slice_ref(value))
    }

    /// Wraps already encoded column entries; for encoders in tests.
    #[cfg(test)]
    pub(crate) fn from_raw(count: u16, data: Bytes) -> TupleData {
        TupleData { count, data }
    }
}

impl<'a> IntoIterator for &'a TupleData {
    type Item = Column<'a>;
    type IntoIter = Columns<'a>;

    fn into_iter(self) -> Columns<'a> {
        self.iter()
    }
}

/// Iterator over a tuple's columns.
#[derive(Clone, Debug)]
pub struct Columns<'a> {
    data: &'a [u8],
    left: u16,
}

impl<'a> Iterator for Columns<'a> {
    type Item = Column<'a>;

    fn next(&mut self) -> Option<Column<'a>> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        // The tuple was checked when decoded; the `?`s below never fire, and
        // end the iteration rather than panic if they somehow did.
        let (&kind, rest) = self.data.split_first()?;
        let (column, rest) = match kind {
            b'n' => (Column::Null, rest),
            b'u' => (Column::UnchangedToast, rest),
            b't' | b'b' => {
                let len_bytes: [u8; 4] = rest.get(..4)?.try_into().ok()?;
                let len = u32::from_be_bytes(len_bytes) as usize;
                let value = rest.get(4..4 + len)?;
                let rest = rest.get(4 + len..)?;
                (
                    if kind == b't' {
                        Column::Text(value)
                    } else {
                        Column::Binary(value)
                    },
                    rest,
                )
            }
            _ => return None,
        };
        self.data = rest;
        Some(column)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (0, Some(usize::from(self.left)))
    }
}
