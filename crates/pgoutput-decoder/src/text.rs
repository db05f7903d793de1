//! UTF-8 text that shares a message's buffer.

use std::fmt;

use bytes::Bytes;

/// A string slice of a message, checked to be UTF-8 once when decoded.
///
/// Cloning is cheap (a reference count); [`Text::as_str`] costs nothing.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Text(Bytes);

impl Text {
    /// Checks `bytes` for UTF-8 and wraps them.
    pub fn from_utf8(bytes: Bytes) -> Result<Text, std::str::Utf8Error> {
        std::str::from_utf8(&bytes)?;
        Ok(Text(bytes))
    }

    /// Wraps a static string.
    pub const fn from_static(s: &'static str) -> Text {
        Text(Bytes::from_static(s.as_bytes()))
    }

    /// The text.
    pub fn as_str(&self) -> &str {
        // SAFETY: every constructor checks (or is given) valid UTF-8, and the
        // bytes are immutable.
        #[allow(unsafe_code)]
        unsafe {
            std::str::from_utf8_unchecked(&self.0)
        }
    }

    /// The underlying bytes.
    pub fn as_bytes(&self) -> &Bytes {
        &self.0
    }
}

impl From<String> for Text {
    fn from(s: String) -> Self {
        Text(Bytes::from(s))
    }
}

impl From<&'static str> for Text {
    fn from(s: &'static str) -> Self {
        Text::from_static(s)
    }
}

impl std::ops::Deref for Text {
    type Target = str;

    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl PartialEq<str> for Text {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for Text {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl fmt::Debug for Text {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for Text {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
