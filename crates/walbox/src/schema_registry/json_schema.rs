//! A JSON payload checked against its JSON Schema, in Confluent's wire
//! format:
//!
//! ```text
//!   0x00 │ schema id (4 bytes, big-endian) │ the payload's JSON, as stored
//! ```
//!
//! The payload is validated as Confluent's JSON Schema serializers validate
//! it (the draft the schema's `$schema` names, draft 2020-12 without one); a
//! payload that does not validate is refused with the first violation and
//! where it is. References to other subjects are not resolved, nor remote
//! `$ref`s: a schema that needs them is refused when looked up.

use jsonschema::Validator;

use super::avro::MAGIC;

/// Compiles a schema the registry returned.
pub fn compile(schema: &str) -> Result<Validator, String> {
    let json: serde_json::Value =
        serde_json::from_str(schema).map_err(|e| format!("not JSON: {e}"))?;
    jsonschema::validator_for(&json).map_err(super::reason)
}

/// The value of a record: `payload` (JSON) checked against `validator`,
/// which the registry knows as `id`. The error is the first violation.
pub fn encode(validator: &Validator, id: u32, payload: &[u8]) -> Result<Vec<u8>, String> {
    let json: serde_json::Value =
        serde_json::from_slice(payload).map_err(|e| format!("the payload is not JSON: {e}"))?;
    if let Some(e) = validator.iter_errors(&json).next() {
        let at = e.instance_path().to_string();
        let at = if at.is_empty() { "/".to_owned() } else { at };
        return Err(super::reason(format!("{e} (at {at})")));
    }
    let mut out = Vec::with_capacity(5 + payload.len());
    out.push(MAGIC);
    out.extend_from_slice(&id.to_be_bytes());
    out.extend_from_slice(payload);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ORDER: &str = r#"{
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "object",
        "properties": {
            "order_id": {"type": "integer"},
            "status": {"enum": ["NEW", "PAID"]},
            "note": {"type": ["string", "null"]},
            "lines": {"type": "array", "items": {"type": "object",
                "properties": {"qty": {"type": "integer", "minimum": 1}}, "required": ["qty"]}}
        },
        "required": ["order_id", "status"],
        "additionalProperties": false
    }"#;

    #[test]
    fn a_valid_payload_goes_out_as_stored_behind_the_schema_id() {
        let v = compile(ORDER).unwrap();
        let payload = br#"{"order_id": 7, "status": "PAID", "note": null, "lines": [{"qty": 2}]}"#;
        let out = encode(&v, 0x0000_0102, payload).unwrap();
        assert_eq!(&out[..5], &[0, 0, 0, 1, 2]);
        assert_eq!(&out[5..], payload);
    }

    #[test]
    fn a_payload_that_does_not_validate_says_what_and_where() {
        let v = compile(ORDER).unwrap();
        for (payload, says) in [
            (&br#"{"order_id": "7", "status": "NEW"}"#[..], "/order_id"),
            (br#"{"order_id": 7}"#, "status"),
            (br#"{"order_id": 7, "status": "LOST"}"#, "/status"),
            (br#"{"order_id": 7, "status": "NEW", "x": 1}"#, "x"),
            (
                br#"{"order_id": 7, "status": "NEW", "lines": [{"qty": 0}]}"#,
                "/lines/0/qty",
            ),
            (br#"{"order_id": 7"#, "the payload is not JSON"),
        ] {
            let e = encode(&v, 1, payload).unwrap_err();
            assert!(e.contains(says), "{e}");
            assert!(!e.contains('\n'));
        }
    }

    #[test]
    fn a_bad_schema_is_refused() {
        assert!(compile("not json").is_err());
        assert!(compile(r#"{"type": "no-such-type"}"#).is_err());
    }
}
