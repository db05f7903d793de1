//! A JSON payload as an Avro datum in Confluent's wire format.
//!
//! ```text
//!   0x00 │ schema id (4 bytes, big-endian) │ the payload, Avro binary-encoded with that schema
//! ```
//!
//! The payload's JSON is resolved against the schema by Avro's own rules
//! (apache-avro's `Value::resolve`): an object becomes a record (fields the
//! schema does not name are left out, missing ones take their default), a
//! string an enum symbol, `bytes` or a `uuid`, an integer an `int`, `long`
//! or a timestamp, and a union takes the first branch the value fits. A
//! union value is written plainly (`"note": "x"`), not in Avro's JSON
//! encoding (`"note": {"string": "x"}`): that is what applications write.
//! A value that does not fit is refused with Avro's reason.

use apache_avro::types::Value;
use apache_avro::Schema;

/// The byte that opens every record in Confluent's wire format.
pub const MAGIC: u8 = 0;

/// The value of a record: `payload` (JSON) encoded with `schema`, which the
/// registry knows as `id`. The error is why the payload does not fit.
pub fn encode(schema: &Schema, id: u32, payload: &[u8]) -> Result<Vec<u8>, String> {
    let json: serde_json::Value =
        serde_json::from_slice(payload).map_err(|e| format!("the payload is not JSON: {e}"))?;
    // (A panic in the library is caught by the caller, `Registered::encode`.)
    let value = Value::from(json).resolve(schema).map_err(super::reason)?;
    let datum = apache_avro::to_avro_datum(schema, value).map_err(super::reason)?;
    let mut out = Vec::with_capacity(5 + datum.len());
    out.push(MAGIC);
    out.extend_from_slice(&id.to_be_bytes());
    out.extend_from_slice(&datum);
    Ok(out)
}

/// Parses a schema the registry returned.
pub fn parse(schema: &str) -> Result<Schema, String> {
    Schema::parse_str(schema).map_err(super::reason)
}

#[cfg(test)]
mod tests {
    use super::*;
    use apache_avro::from_avro_datum;

    const ORDER: &str = r#"{
        "type": "record", "name": "OrderPlaced", "namespace": "shop",
        "fields": [
            {"name": "order_id", "type": "long"},
            {"name": "qty", "type": "int"},
            {"name": "price", "type": "double"},
            {"name": "status", "type": {"type": "enum", "name": "Status", "symbols": ["NEW", "PAID"]}},
            {"name": "note", "type": ["null", "string"], "default": null},
            {"name": "tags", "type": {"type": "array", "items": "string"}},
            {"name": "attrs", "type": {"type": "map", "values": "long"}},
            {"name": "customer", "type": {"type": "record", "name": "Customer",
                "fields": [{"name": "name", "type": "string"}]}},
            {"name": "channel", "type": "string", "default": "web"}
        ]
    }"#;

    fn decode(schema: &Schema, bytes: &[u8]) -> Value {
        assert_eq!(bytes[0], MAGIC);
        let mut datum = &bytes[5..];
        from_avro_datum(schema, &mut datum, None).unwrap()
    }

    #[test]
    fn a_payload_becomes_the_wire_format_with_every_field() {
        let schema = parse(ORDER).unwrap();
        let payload = br#"{"order_id": 9007199254740993, "qty": 3, "price": 9.5,
            "status": "PAID", "note": "gift", "tags": ["a", "b"], "attrs": {"x": 1},
            "customer": {"name": "Ada"}, "ignored": true}"#;
        let bytes = encode(&schema, 0x0102_0304, payload).unwrap();
        assert_eq!(&bytes[..5], &[0, 1, 2, 3, 4]);
        let Value::Record(fields) = decode(&schema, &bytes) else {
            panic!("not a record")
        };
        let field = |n: &str| fields.iter().find(|(k, _)| k == n).unwrap().1.clone();
        assert_eq!(field("order_id"), Value::Long(9_007_199_254_740_993));
        assert_eq!(field("qty"), Value::Int(3));
        assert_eq!(field("price"), Value::Double(9.5));
        assert_eq!(field("status"), Value::Enum(1, "PAID".into()));
        assert_eq!(
            field("note"),
            Value::Union(1, Box::new(Value::String("gift".into())))
        );
        assert_eq!(
            field("tags"),
            Value::Array(vec![Value::String("a".into()), Value::String("b".into())])
        );
        assert_eq!(
            field("customer"),
            Value::Record(vec![("name".into(), Value::String("Ada".into()))])
        );
        // Missing: its default.
        assert_eq!(field("channel"), Value::String("web".into()));
        assert_eq!(fields.len(), 9, "the unknown field is left out");
    }

    #[test]
    fn a_payload_that_does_not_fit_is_refused_with_the_reason() {
        let schema = parse(ORDER).unwrap();
        for payload in [
            &br#"{"order_id": "nine"}"#[..],
            br#"{"order_id": 1, "qty": 1, "price": 1, "status": "LOST", "tags": [], "attrs": {}, "customer": {"name": "x"}}"#,
            br#"[1, 2]"#,
            br#"{"order_id": 1"#,
        ] {
            let e = encode(&schema, 1, payload).unwrap_err();
            assert!(!e.is_empty() && !e.contains('\n'), "{e}");
        }
        let e = encode(&schema, 1, br#"{"order_id": 1"#).unwrap_err();
        assert!(e.starts_with("the payload is not JSON"), "{e}");
    }

    #[test]
    fn a_long_reason_is_cut() {
        let schema =
            parse(r#"{"type": "record", "name": "R", "fields": [{"name": "a", "type": "int"}]}"#)
                .unwrap();
        let big = format!(r#"{{"a": "{}"}}"#, "x".repeat(100_000));
        let e = encode(&schema, 1, big.as_bytes()).unwrap_err();
        assert!(e.len() <= 1004, "{}", e.len());
    }

    #[test]
    fn a_bad_schema_is_refused() {
        assert!(parse(r#"{"type": "record"}"#).is_err());
        assert!(parse("not json").is_err());
    }
}
