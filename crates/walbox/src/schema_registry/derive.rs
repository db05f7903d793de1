//! Schemas derived from the payloads themselves
//! (`schema_registry.schemas = "derived"`): for teams that have JSON events
//! and no schemas yet, walbox writes one per subject and registers it.
//!
//! - **A shape** is what the payloads of a subject were seen to hold: per
//!   value, the JSON kinds it took (null, boolean, integer, number, string,
//!   array, object), an array's items as one shape, an object's fields by
//!   name. Shapes only grow: a subject's schema is the merge of every
//!   payload seen, so each new version accepts every earlier payload and
//!   the next ones like them (a field never seen before, a field that was
//!   an integer and is now a number, widen it).
//! - **Every field is optional and may be null**: a payload may leave out
//!   any field it does not have. In JSON Schema: properties none of which is
//!   `required`, the object closed (`additionalProperties: false`) so that
//!   adding a field is a compatible change; in Avro: each field a union
//!   with `"null"` first and `"default": null`, the record named after the
//!   event type (`shop.OrderPlaced`; a type that is not an Avro name gives
//!   `walbox.Event`), nested records after their path.
//! - **Its own, and only its own**: a derived schema carries a marker
//!   ([`MARKER`], in `$comment` or the record's `doc`). A subject whose
//!   latest schema bears it is continued from it after a restart; one
//!   whose schema does not was registered by someone else, and walbox
//!   refuses to register over it.
//! - **Bounded**: a subject's shape holds at most [`MAX_FIELDS`] values
//!   and [`MAX_DEPTH`] levels; a payload that would grow it past them
//!   (data used as keys, such as `{"sku-123": 2}`) is refused for its own
//!   sake, naming the limit: such payloads need a registered schema (a map).

use std::collections::BTreeMap;

use serde_json::{json, Map, Value};

/// The marker of a schema walbox derived.
pub const MARKER: &str = "derived by walbox from the events' payloads";
/// Most values (fields and array items, at every level) in a subject's shape.
pub const MAX_FIELDS: usize = 2_000;
/// Deepest nesting of a shape.
pub const MAX_DEPTH: usize = 32;

/// What the values at one place of the payloads were seen to be.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Shape {
    null: bool,
    boolean: bool,
    integer: bool,
    number: bool,
    string: bool,
    /// The items of every array seen here, merged.
    array: Option<Box<Shape>>,
    /// The fields of every object seen here, merged.
    object: Option<BTreeMap<String, Shape>>,
}

impl Shape {
    /// The shape of one JSON value; `Err` when it is deeper than [`MAX_DEPTH`].
    pub fn of(value: &Value) -> Result<Shape, String> {
        Shape::of_at(value, 0)
    }

    fn of_at(value: &Value, depth: usize) -> Result<Shape, String> {
        if depth > MAX_DEPTH {
            return Err(format!(
                "the payload nests deeper than {MAX_DEPTH} levels, which walbox derives schemas for: register a schema"
            ));
        }
        let mut shape = Shape::default();
        match value {
            Value::Null => shape.null = true,
            Value::Bool(_) => shape.boolean = true,
            // (An integer past i64 is a double to Avro's JSON reader.)
            Value::Number(n) if n.is_i64() => shape.integer = true,
            Value::Number(_) => shape.number = true,
            Value::String(_) => shape.string = true,
            Value::Array(items) => {
                let mut merged = Shape::default();
                for item in items {
                    merged.merge(&Shape::of_at(item, depth + 1)?);
                }
                shape.array = Some(Box::new(merged));
            }
            Value::Object(fields) => {
                let mut out = BTreeMap::new();
                for (name, v) in fields {
                    out.insert(name.clone(), Shape::of_at(v, depth + 1)?);
                }
                shape.object = Some(out);
            }
        }
        Ok(shape)
    }

    /// Widens this shape to hold `other` too.
    pub fn merge(&mut self, other: &Shape) {
        self.null |= other.null;
        self.boolean |= other.boolean;
        self.integer |= other.integer;
        self.number |= other.number;
        self.string |= other.string;
        if let Some(items) = &other.array {
            self.array.get_or_insert_with(Box::default).merge(items);
        }
        if let Some(fields) = &other.object {
            let mine = self.object.get_or_insert_with(BTreeMap::new);
            for (name, shape) in fields {
                mine.entry(name.clone()).or_default().merge(shape);
            }
        }
    }

    /// Whether this shape already holds every value `other` holds (then
    /// the schema of this one fits a payload of that one).
    pub fn holds(&self, other: &Shape) -> bool {
        let kinds = (!other.null || self.null)
            && (!other.boolean || self.boolean)
            && (!other.integer || self.integer)
            && (!other.number || self.number)
            && (!other.string || self.string);
        let array = match (&self.array, &other.array) {
            (_, None) => true,
            (None, Some(_)) => false,
            (Some(mine), Some(theirs)) => mine.holds(theirs),
        };
        let object = match (&self.object, &other.object) {
            (_, None) => true,
            (None, Some(_)) => false,
            (Some(mine), Some(theirs)) => theirs
                .iter()
                .all(|(name, s)| mine.get(name).is_some_and(|m| m.holds(s))),
        };
        kinds && array && object
    }

    /// How many values (fields and array items, at every level) it holds.
    pub fn size(&self) -> usize {
        let items = self.array.as_ref().map_or(0, |a| 1 + a.size());
        let fields = self
            .object
            .as_ref()
            .map_or(0, |f| f.values().map(|s| 1 + s.size()).sum());
        items + fields
    }

    /// The JSON Schema (draft-07) of this shape, as the root of a subject's
    /// schema (with `$schema` and the [`MARKER`]).
    pub fn json_schema(&self) -> String {
        let mut root = self.json_schema_value();
        if let Value::Object(m) = &mut root {
            m.insert(
                "$schema".into(),
                "http://json-schema.org/draft-07/schema#".into(),
            );
            m.insert("$comment".into(), MARKER.into());
        }
        root.to_string()
    }

    fn json_schema_value(&self) -> Value {
        let mut types = Vec::new();
        for (seen, name) in [
            (self.null, "null"),
            (self.boolean, "boolean"),
            (self.integer, "integer"),
            (self.number, "number"),
            (self.string, "string"),
            (self.array.is_some(), "array"),
            (self.object.is_some(), "object"),
        ] {
            if seen {
                types.push(Value::from(name));
            }
        }
        let mut out = Map::new();
        match types.len() {
            // Only ever in an empty array: no value fits, and none was seen.
            0 => return json!(false),
            1 => out.insert("type".into(), types.remove(0)),
            _ => out.insert("type".into(), Value::Array(types)),
        };
        if let Some(items) = &self.array {
            out.insert("items".into(), items.json_schema_value());
        }
        if let Some(fields) = &self.object {
            let properties: Map<String, Value> = fields
                .iter()
                .map(|(name, s)| (name.clone(), s.json_schema_value()))
                .collect();
            out.insert("properties".into(), Value::Object(properties));
            out.insert("additionalProperties".into(), false.into());
        }
        Value::Object(out)
    }

    /// The shape a JSON Schema walbox derived describes (the inverse of
    /// [`Shape::json_schema`]); `None` for one it did not derive.
    pub fn from_json_schema(text: &str) -> Option<Shape> {
        let root: Value = serde_json::from_str(text).ok()?;
        (root.get("$comment")?.as_str()? == MARKER).then_some(())?;
        Shape::from_json_schema_value(&root, 0)
    }

    fn from_json_schema_value(v: &Value, depth: usize) -> Option<Shape> {
        if depth > MAX_DEPTH {
            return None;
        }
        let mut shape = Shape::default();
        if v == &Value::Bool(false) {
            return Some(shape);
        }
        let types: Vec<&str> = match v.get("type")? {
            Value::String(t) => vec![t.as_str()],
            Value::Array(ts) => ts.iter().filter_map(Value::as_str).collect(),
            _ => return None,
        };
        for t in types {
            match t {
                "null" => shape.null = true,
                "boolean" => shape.boolean = true,
                "integer" => shape.integer = true,
                "number" => shape.number = true,
                "string" => shape.string = true,
                "array" => {
                    let items = match v.get("items") {
                        Some(i) => Shape::from_json_schema_value(i, depth + 1)?,
                        None => Shape::default(),
                    };
                    shape.array = Some(Box::new(items));
                }
                "object" => {
                    let mut fields = BTreeMap::new();
                    if let Some(Value::Object(p)) = v.get("properties") {
                        for (name, s) in p {
                            fields
                                .insert(name.clone(), Shape::from_json_schema_value(s, depth + 1)?);
                        }
                    }
                    shape.object = Some(fields);
                }
                _ => return None,
            }
        }
        Some(shape)
    }

    /// The Avro schema of this shape, an object's, as the root record
    /// named `name` (a full name); `Err` for a shape Avro cannot write
    /// (not an object, a field name that is not an Avro name).
    pub fn avro_schema(&self, name: &str) -> Result<String, String> {
        let Some(fields) = self.object.as_ref().filter(|_| self.only_object()) else {
            return Err("walbox derives Avro schemas for payloads that are JSON objects".into());
        };
        let (namespace, local) = match name.rsplit_once('.') {
            Some((ns, local)) => (Some(ns), local),
            None => (None, name),
        };
        let mut root = Map::new();
        root.insert("type".into(), "record".into());
        root.insert("name".into(), local.into());
        if let Some(ns) = namespace {
            root.insert("namespace".into(), ns.into());
        }
        root.insert("doc".into(), MARKER.into());
        root.insert("fields".into(), avro_fields(fields, local)?);
        Ok(Value::Object(root).to_string())
    }

    fn only_object(&self) -> bool {
        !(self.null
            || self.boolean
            || self.integer
            || self.number
            || self.string
            || self.array.is_some())
    }

    /// The Avro type of a value of this shape: a union with `"null"` first
    /// (each value may be absent), or `"null"` alone for one only ever null
    /// or never seen. `path` names its records.
    fn avro_type(&self, path: &str) -> Result<Value, String> {
        let mut branches = vec![Value::from("null")];
        for (seen, name) in [
            (self.boolean, "boolean"),
            (self.integer, "long"),
            (self.number, "double"),
            (self.string, "string"),
        ] {
            if seen {
                branches.push(name.into());
            }
        }
        if let Some(items) = &self.array {
            branches
                .push(json!({"type": "array", "items": items.avro_type(&format!("{path}_item"))?}));
        }
        if let Some(fields) = &self.object {
            branches.push(json!({
                "type": "record",
                "name": path,
                "fields": avro_fields(fields, path)?,
            }));
        }
        Ok(match branches.len() {
            1 => branches.remove(0),
            _ => Value::Array(branches),
        })
    }

    /// The shape an Avro schema walbox derived describes (the inverse of
    /// [`Shape::avro_schema`]); `None` for one it did not derive.
    pub fn from_avro_schema(text: &str) -> Option<Shape> {
        let root: Value = serde_json::from_str(text).ok()?;
        (root.get("doc")?.as_str()? == MARKER).then_some(())?;
        Some(Shape {
            object: Some(from_avro_fields(root.get("fields")?, 0)?),
            ..Shape::default()
        })
    }

    fn from_avro_type(v: &Value, depth: usize) -> Option<Shape> {
        if depth > MAX_DEPTH {
            return None;
        }
        let mut shape = Shape::default();
        let branches: Vec<&Value> = match v {
            Value::Array(bs) => bs.iter().collect(),
            one => vec![one],
        };
        for b in branches {
            match b {
                Value::String(t) => match t.as_str() {
                    "null" => shape.null = true,
                    "boolean" => shape.boolean = true,
                    "long" => shape.integer = true,
                    "double" => shape.number = true,
                    "string" => shape.string = true,
                    _ => return None,
                },
                Value::Object(o) => match o.get("type")?.as_str()? {
                    "array" => {
                        shape.array =
                            Some(Box::new(Shape::from_avro_type(o.get("items")?, depth + 1)?))
                    }
                    "record" => shape.object = Some(from_avro_fields(o.get("fields")?, depth + 1)?),
                    _ => return None,
                },
                _ => return None,
            }
        }
        Some(shape)
    }
}

/// The fields of a derived record named `path`.
fn avro_fields(fields: &BTreeMap<String, Shape>, path: &str) -> Result<Value, String> {
    let mut out = Vec::with_capacity(fields.len());
    for (name, shape) in fields {
        if !is_avro_name(name) {
            return Err(format!(
                "field {name:?} is not an Avro name (a letter or _, then letters, digits or _): register a schema, or rename the field"
            ));
        }
        out.push(json!({
            "name": name,
            "type": shape.avro_type(&format!("{path}_{name}"))?,
            "default": null,
        }));
    }
    Ok(Value::Array(out))
}

fn from_avro_fields(fields: &Value, depth: usize) -> Option<BTreeMap<String, Shape>> {
    let mut out = BTreeMap::new();
    for f in fields.as_array()? {
        out.insert(
            f.get("name")?.as_str()?.to_owned(),
            Shape::from_avro_type(f.get("type")?, depth)?,
        );
    }
    Some(out)
}

/// Whether `name` is an Avro name: `[A-Za-z_][A-Za-z0-9_]*`.
pub fn is_avro_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    bytes
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// The root record's full name for subject `subject`: the subject itself
/// when it is an Avro full name (RecordNameStrategy's subjects are the
/// event types, `shop.OrderPlaced`), else `walbox.Event` (`orders-value`):
/// one name per subject, whichever event types share it.
pub fn avro_record_name(subject: &str) -> String {
    match subject.split('.').all(is_avro_name) {
        true => subject.to_owned(),
        false => "walbox.Event".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(v: Value) -> Shape {
        Shape::of(&v).unwrap()
    }

    #[test]
    fn shapes_merge_and_hold_what_they_merged() {
        let mut s = shape(json!({"id": 1, "tags": ["a"], "customer": {"name": "x"}}));
        let later = shape(json!({"id": 1.5, "note": null, "tags": [], "customer": {"vip": true}}));
        assert!(!s.holds(&later));
        s.merge(&later);
        assert!(s.holds(&later));
        assert!(s.holds(&shape(json!({"id": 2}))), "a field left out fits");
        assert!(!s.holds(&shape(json!({"id": "2"}))), "a string id is new");
        assert!(!s.holds(&shape(json!({"other": 1}))));
        assert_eq!(s.size(), 7, "id, note, tags, its item, customer, name, vip");
    }

    /// Payloads of one subject, varied, and their merged shape.
    fn three_payloads_merged() -> ([Value; 3], Shape) {
        let payloads = [
            json!({"id": 1, "tags": ["a", "b"], "customer": {"name": "x"}, "note": null}),
            json!({"id": 2.5, "tags": [], "customer": {"vip": true}, "lines": [{"qty": 1}, {"sku": "s"}]}),
            json!({"id": 3, "note": "n"}),
        ];
        let mut s = Shape::default();
        for p in &payloads {
            s.merge(&shape(p.clone()));
        }
        (payloads, s)
    }

    #[test]
    fn a_derived_json_schema_validates_every_payload_merged_and_reads_back() {
        let (payloads, s) = three_payloads_merged();
        let text = s.json_schema();
        let validator = super::super::json_schema::compile(&text).unwrap();
        for p in &payloads {
            assert!(validator.is_valid(p), "{p} against {text}");
        }
        assert!(!validator.is_valid(&json!({"id": "x"})), "a kind not seen");
        assert!(!validator.is_valid(&json!({"unseen": 1})), "closed");
        assert_eq!(Shape::from_json_schema(&text), Some(s));
        assert_eq!(
            Shape::from_json_schema(r#"{"type": "object"}"#),
            None,
            "not walbox's"
        );
    }

    #[test]
    fn a_derived_avro_schema_encodes_every_payload_merged_and_reads_back() {
        let (payloads, s) = three_payloads_merged();
        let text = s.avro_schema("shop.OrderPlaced").unwrap();
        let schema = super::super::avro::parse(&text).unwrap();
        for p in &payloads {
            super::super::avro::encode(&schema, 1, p.to_string().as_bytes())
                .unwrap_or_else(|e| panic!("{p}: {e}\n{text}"));
        }
        // Read back, "note" only ever seen null or a string.
        let back = Shape::from_avro_schema(&text).unwrap();
        assert_eq!(back.avro_schema("shop.OrderPlaced").unwrap(), text);
        assert!(back.holds(&shape(payloads[1].clone())));
        assert_eq!(
            Shape::from_avro_schema(r#"{"type": "record", "name": "R", "fields": []}"#),
            None
        );
    }

    #[test]
    fn what_avro_cannot_name_or_a_payload_too_deep_is_refused() {
        let e = shape(json!({"order-id": 1}))
            .avro_schema("walbox.Event")
            .unwrap_err();
        assert!(e.contains("field \"order-id\" is not an Avro name"), "{e}");
        let e = shape(json!([1])).avro_schema("walbox.Event").unwrap_err();
        assert!(e.contains("JSON objects"), "{e}");
        let mut deep = json!(1);
        for _ in 0..=MAX_DEPTH {
            deep = json!({ "a": deep });
        }
        assert!(Shape::of(&deep).unwrap_err().contains("deeper than 32"));
        assert_eq!(avro_record_name("shop.OrderPlaced"), "shop.OrderPlaced");
        assert_eq!(avro_record_name("orders-value"), "walbox.Event");
        assert_eq!(avro_record_name("orders-shop.Placed"), "walbox.Event");
    }
}
