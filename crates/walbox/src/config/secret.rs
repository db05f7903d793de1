//! Values that must never be printed: held in [`Secret`], whose `Debug`
//! and serialized forms are `<redacted>`, and URLs shown only after
//! [`redact_userinfo`] (sink-kafka's, which its own messages need too).
//!
//! A newtype of our own rather than the `secrecy` crate: the settings are
//! serialized (figment's view of them, `walbox config`), and `secrecy`
//! leaves a secret unserializable unless it is marked serializable in the
//! clear, which is what this must never be.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

pub use sink_kafka::redact_userinfo;

/// What a secret is shown as.
pub(super) const REDACTED: &str = "<redacted>";

/// A secret string: `Debug`, `Display`-less, serialized as `<redacted>`.
/// Only [`Secret::expose`] gives the value, to the code that uses it.
#[derive(Clone, PartialEq, Eq)]
pub(super) struct Secret(String);

impl Secret {
    /// The value, for the one place that needs it.
    pub(super) fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(REDACTED)
    }
}

impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(REDACTED)
    }
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d).map(Secret)
    }
}

/// A URL shown with its user information redacted ([`redact_userinfo`])
/// by `Debug`: `otlp_endpoint`.
#[derive(Clone, PartialEq, Eq)]
pub struct Endpoint(pub(super) String);

impl Endpoint {
    /// The URL, to connect to.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", redact_userinfo(&self.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_is_never_shown() {
        let s: Secret = serde_json::from_str("\"hunter2\"").unwrap();
        assert_eq!(format!("{s:?}"), REDACTED);
        assert_eq!(serde_json::to_string(&s).unwrap(), "\"<redacted>\"");
        assert_eq!(s.expose(), "hunter2");
    }
}
