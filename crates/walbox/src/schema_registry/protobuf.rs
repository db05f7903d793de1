//! A JSON payload as a Protobuf message in Confluent's wire format:
//!
//! ```text
//!   0x00 │ schema id (4 bytes, big-endian) │ message indexes │ the message, Protobuf binary
//! ```
//!
//! The registry holds a `.proto` file; it is compiled here (protox, a
//! protobuf compiler in Rust; the well-known `google/protobuf/*` imports are
//! built in, other imports are refused). The message an event is written as
//! is the file's top-level message whose full name is the event type
//! (`shop.OrderPlaced`), else the file's first message. The message indexes
//! name it within the file as Confluent's serializers do: its position,
//! zig-zag varints after their count, and the first message as the single
//! byte `0`. The payload's JSON is read by Protobuf's JSON mapping (field
//! names as in the file or in lowerCamelCase, 64-bit integers as numbers or
//! strings, enums by name); a field the message does not have is refused.

use prost::Message as _;
use prost_reflect::{DescriptorPool, DeserializeOptions, DynamicMessage, MessageDescriptor};

use super::avro::MAGIC;

/// The name the registry's schema is compiled under.
const FILE: &str = "schema.proto";

/// A compiled `.proto` file: its top-level messages, in order.
#[derive(Debug)]
pub struct ProtoFile {
    messages: Vec<MessageDescriptor>,
}

/// Compiles a `.proto` file the registry returned.
pub fn compile(schema: &str) -> Result<ProtoFile, String> {
    let file = protox::file::File::from_source(FILE, schema).map_err(super::reason)?;
    let mut resolver = protox::file::ChainFileResolver::new();
    resolver.add(Single(file));
    resolver.add(protox::file::GoogleFileResolver::new());
    let mut compiler = protox::Compiler::with_file_resolver(resolver);
    compiler.open_file(FILE).map_err(super::reason)?;
    let pool: DescriptorPool = compiler.descriptor_pool();
    let messages: Vec<MessageDescriptor> = pool
        .get_file_by_name(FILE)
        .map(|f| f.messages().collect())
        .unwrap_or_default();
    if messages.is_empty() {
        return Err("the file declares no message".into());
    }
    Ok(ProtoFile { messages })
}

/// The registry's file, as the one file the compiler can open.
struct Single(protox::file::File);

impl protox::file::FileResolver for Single {
    fn open_file(&self, name: &str) -> Result<protox::file::File, protox::Error> {
        if name == FILE {
            Ok(self.0.clone())
        } else {
            Err(protox::Error::file_not_found(name))
        }
    }
}

/// The value of a record: `payload` (JSON) as the message `event_type`
/// names (else the file's first), with the file the registry knows as `id`.
pub fn encode(
    file: &ProtoFile,
    id: u32,
    event_type: Option<&str>,
    payload: &[u8],
) -> Result<Vec<u8>, String> {
    let (index, message) = file
        .messages
        .iter()
        .enumerate()
        .find(|(_, m)| Some(m.full_name()) == event_type)
        .unwrap_or((0, &file.messages[0]));
    let mut json = serde_json::Deserializer::from_slice(payload);
    let dynamic = DynamicMessage::deserialize_with_options(
        message.clone(),
        &mut json,
        &DeserializeOptions::new(),
    )
    .and_then(|m| json.end().map(|()| m))
    .map_err(|e| super::reason(format!("as {}: {e}", message.full_name())))?;
    let mut out = Vec::with_capacity(8 + dynamic.encoded_len());
    out.push(MAGIC);
    out.extend_from_slice(&id.to_be_bytes());
    write_indexes(&mut out, &[index as i64]);
    dynamic
        .encode(&mut out)
        .map_err(|e| format!("encoding {}: {e}", message.full_name()))?;
    Ok(out)
}

/// The message indexes as Confluent writes them: `[0]` as the one byte 0,
/// else the count and each index as zig-zag varints.
fn write_indexes(out: &mut Vec<u8>, indexes: &[i64]) {
    if indexes == [0] {
        out.push(0);
        return;
    }
    write_zigzag(out, indexes.len() as i64);
    for &i in indexes {
        write_zigzag(out, i);
    }
}

fn write_zigzag(out: &mut Vec<u8>, n: i64) {
    let mut v = ((n << 1) ^ (n >> 63)) as u64;
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHOP: &str = r#"
        syntax = "proto3";
        package shop;
        import "google/protobuf/timestamp.proto";
        message OrderPlaced {
            int64 order_id = 1;
            string customer_name = 2;
            Status status = 3;
            repeated string tags = 4;
            google.protobuf.Timestamp at = 5;
        }
        enum Status { NEW = 0; PAID = 1; }
        message OrderShipped { int64 order_id = 1; }
    "#;

    #[test]
    fn the_message_named_by_the_event_type_is_written_with_its_index() {
        let file = compile(SHOP).unwrap();
        let placed = br#"{"order_id": "9007199254740993", "customerName": "Ada", "status": "PAID",
                          "tags": ["a"], "at": "2026-11-25T10:00:00Z"}"#;
        let out = encode(&file, 3, Some("shop.OrderPlaced"), placed).unwrap();
        assert_eq!(
            &out[..6],
            &[0, 0, 0, 0, 3, 0],
            "magic, id 3, the first message"
        );
        let back = DynamicMessage::decode(file.messages[0].clone(), &out[6..]).unwrap();
        assert_eq!(
            back.get_field_by_name("order_id").unwrap().as_i64(),
            Some(9_007_199_254_740_993)
        );
        assert_eq!(
            back.get_field_by_name("customer_name").unwrap().as_str(),
            Some("Ada")
        );
        assert_eq!(
            back.get_field_by_name("status").unwrap().as_enum_number(),
            Some(1)
        );

        let shipped = encode(&file, 3, Some("shop.OrderShipped"), br#"{"order_id": 5}"#).unwrap();
        // [1]: count 1, index 1, zig-zag encoded.
        assert_eq!(&shipped[..7], &[0, 0, 0, 0, 3, 2, 2]);
        let back = DynamicMessage::decode(file.messages[1].clone(), &shipped[7..]).unwrap();
        assert_eq!(
            back.get_field_by_name("order_id").unwrap().as_i64(),
            Some(5)
        );
        // An event type the file does not name: its first message.
        let other = encode(&file, 3, Some("Else"), br#"{"order_id": 5}"#).unwrap();
        assert_eq!(other[5], 0);
    }

    #[test]
    fn a_payload_that_does_not_fit_is_refused_with_the_reason() {
        let file = compile(SHOP).unwrap();
        for payload in [
            &br#"{"order_id": "nine"}"#[..],
            br#"{"order_id": 1, "unknown": 2}"#,
            br#"{"status": "LOST"}"#,
            br#"[1]"#,
            br#"{"order_id": 1"#,
            br#"{"order_id": 1} trailing"#,
        ] {
            let e = encode(&file, 1, None, payload).unwrap_err();
            assert!(e.starts_with("as shop.OrderPlaced: "), "{e}");
            assert!(!e.contains('\n'));
        }
    }

    #[test]
    fn a_file_that_does_not_compile_or_imports_others_is_refused() {
        assert!(compile("syntax = \"proto3\"; message {").is_err());
        assert!(compile(
            "syntax = \"proto3\"; import \"other.proto\"; message A { other.B b = 1; }"
        )
        .is_err());
        assert!(compile("syntax = \"proto3\"; enum E { X = 0; }").is_err());
    }

    #[test]
    fn indexes_are_zigzag_varints_after_their_count() {
        let mut out = Vec::new();
        write_indexes(&mut out, &[0]);
        assert_eq!(out, [0]);
        out.clear();
        write_indexes(&mut out, &[2, 70]);
        assert_eq!(out, [4, 4, 0x8c, 0x01]);
    }
}
