//! Whole numbers that may be written as floats: `20.0` is 20. TOML written
//! by tools (Helm's `toToml`, which holds every YAML number as a float)
//! says `shutdown_timeout_secs = 20.0`; a fraction is still refused.

use serde::de::{Deserializer, Error, Unexpected, Visitor};

struct Whole;

impl Visitor<'_> for Whole {
    type Value = u64;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a whole number")
    }

    fn visit_u64<E: Error>(self, v: u64) -> Result<u64, E> {
        Ok(v)
    }

    fn visit_i64<E: Error>(self, v: i64) -> Result<u64, E> {
        u64::try_from(v).map_err(|_| E::invalid_value(Unexpected::Signed(v), &self))
    }

    fn visit_f64<E: Error>(self, v: f64) -> Result<u64, E> {
        // Exact in an f64 up to 2^53.
        if v.fract() == 0.0 && (0.0..=9_007_199_254_740_992.0).contains(&v) {
            Ok(v as u64)
        } else {
            Err(E::invalid_value(Unexpected::Float(v), &self))
        }
    }
}

/// A whole number.
pub(super) fn u64<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    d.deserialize_any(Whole)
}

/// An optional whole number.
pub(super) fn opt_u64<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    u64(d).map(Some)
}

/// A property value of `kafka.properties` or `topics.config`: a string, or
/// what a tool wrote for one: a whole number (`5`, or `5.0` from Helm's
/// `toToml`) as its digits, a boolean as `true`/`false`. A fraction is
/// refused rather than guessed at: quote it if it is meant (`"0.5"`).
struct Property;

impl Visitor<'_> for Property {
    type Value = String;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a string, a whole number or a boolean (quote a fraction: \"0.5\")")
    }

    fn visit_str<E: Error>(self, v: &str) -> Result<String, E> {
        Ok(v.to_owned())
    }

    fn visit_bool<E: Error>(self, v: bool) -> Result<String, E> {
        Ok(v.to_string())
    }

    fn visit_u64<E: Error>(self, v: u64) -> Result<String, E> {
        Ok(v.to_string())
    }

    fn visit_i64<E: Error>(self, v: i64) -> Result<String, E> {
        Ok(v.to_string())
    }

    fn visit_f64<E: Error>(self, v: f64) -> Result<String, E> {
        if v.fract() == 0.0 && v.abs() <= 9_007_199_254_740_992.0 {
            Ok((v as i64).to_string())
        } else {
            Err(E::invalid_value(Unexpected::Float(v), &self))
        }
    }
}

struct PropertyValue(String);

impl<'de> serde::Deserialize<'de> for PropertyValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(Property).map(PropertyValue)
    }
}

/// A map of properties (see [`Property`]).
pub(super) fn properties<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<std::collections::BTreeMap<String, String>, D::Error> {
    let map: std::collections::BTreeMap<String, PropertyValue> =
        serde::Deserialize::deserialize(d)?;
    Ok(map
        .into_iter()
        .map(|(k, PropertyValue(v))| (k, v))
        .collect())
}

/// A list of names, as one string (`a, b`) or a TOML array (`["a", "b"]`):
/// kept as the one comma-separated string the environment and flags give.
struct List;

impl<'de> Visitor<'de> for List {
    type Value = String;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a name, a comma-separated list of names, or an array of names")
    }

    fn visit_str<E: Error>(self, v: &str) -> Result<String, E> {
        Ok(v.to_owned())
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<String, A::Error> {
        let mut all: Vec<String> = Vec::new();
        while let Some(item) = seq.next_element::<String>()? {
            all.push(item);
        }
        Ok(all.join(", "))
    }
}

/// A list of names (see [`List`]).
pub(super) fn list<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    d.deserialize_any(List)
}
