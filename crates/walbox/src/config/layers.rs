//! The environment and the command line as configuration layers.
//!
//! Both are turned into nested figment dictionaries keyed like the file, by
//! the one table of settings, so a value has the same name and type from
//! every source. A value that does not fit its setting is refused here, with
//! the variable or flag named (never the value: it may be a secret).

use std::collections::BTreeMap;
use std::path::PathBuf;

use figment::value::{Dict, Map, Value};
use figment::{Metadata, Profile, Provider};
use serde::Deserialize;

use super::table::{setting, Kind, Setting, SETTINGS};
use super::ConfigError;

/// Per-property variables: `WALBOX_KAFKA_PROPERTY_SASL_PASSWORD` → `sasl.password`.
const KAFKA_PROPERTY_PREFIX: &str = "WALBOX_KAFKA_PROPERTY_";
/// Any variable `X_FILE` gives setting `X` the content of that file.
const FILE_SUFFIX: &str = "_FILE";

/// Variables of earlier builds, refused with their new name rather than
/// ignored.
const RENAMED: &[(&str, &str)] = &[
    ("WALBOX_TOPIC_TEMPLATE", "WALBOX_MAPPING_TOPIC_TEMPLATE"),
    ("WALBOX_COLUMN_ID", "WALBOX_MAPPING_ID"),
    (
        "WALBOX_COLUMN_AGGREGATE_TYPE",
        "WALBOX_MAPPING_AGGREGATE_TYPE",
    ),
    ("WALBOX_COLUMN_AGGREGATE_ID", "WALBOX_MAPPING_AGGREGATE_ID"),
    ("WALBOX_COLUMN_EVENT_TYPE", "WALBOX_MAPPING_EVENT_TYPE"),
    ("WALBOX_COLUMN_PAYLOAD", "WALBOX_MAPPING_PAYLOAD"),
    ("WALBOX_COLUMN_HEADERS", "WALBOX_MAPPING_HEADERS"),
    ("WALBOX_COLUMN_TIMESTAMP", "WALBOX_MAPPING_TIMESTAMP"),
];

/// The refusal of a command-line argument that is an old flag name
/// (`--topic-template`, `--column-id=x`), naming the new one: clap would
/// only guess at the nearest spelling.
pub fn renamed_flag(arg: &str) -> Option<String> {
    let flag = |var: &str| {
        format!(
            "--{}",
            var.trim_start_matches("WALBOX_")
                .to_ascii_lowercase()
                .replace('_', "-")
        )
    };
    let given = arg.split('=').next()?;
    let renamed =
        |old: String, new: String| (given == old).then(|| format!("{old} is now called {new}"));
    RENAMED
        .iter()
        .find_map(|(old, new)| renamed(flag(old), flag(new)))
        .or_else(|| renamed("--header-column".into(), "--mapping-header-column".into()))
}

/// One layer of settings, named for errors and `walbox config` (the file
/// by its path).
#[derive(Clone, Debug)]
pub(crate) struct Layer {
    name: &'static str,
    file: Option<PathBuf>,
    pub(crate) dict: Dict,
}

impl Provider for Layer {
    fn metadata(&self) -> Metadata {
        match &self.file {
            Some(path) => Metadata::from(self.name, figment::Source::File(path.clone())),
            None => Metadata::named(self.name),
        }
    }

    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
        Ok(Profile::Default.collect(self.dict.clone()))
    }
}

/// The TOML file as a layer: read once, checked against the settings' types
/// (so an error names its line), then handed to figment as it was written.
pub(crate) fn file(path: &std::path::Path) -> Result<Layer, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError(format!("read {}: {e}", path.display())))?;
    let at_line = |e: toml::de::Error| {
        let msg = e.message().to_owned();
        let line = e.span().map(|s| text[..s.start].matches('\n').count() + 1);
        ConfigError(match line {
            Some(l) => format!("{}: line {l}: {msg}", path.display()),
            None => format!("{}: {msg}", path.display()),
        })
    };
    let document = toml::de::DeTable::parse(&text).map_err(at_line)?;
    let dict =
        Dict::deserialize(toml::de::Deserializer::from(document.clone())).map_err(at_line)?;
    // Known before the values are checked: a refusal may quote one.
    register_secrets(&dict);
    super::Raw::deserialize(toml::de::Deserializer::from(document)).map_err(at_line)?;
    Ok(Layer {
        name: "file",
        file: Some(path.to_owned()),
        dict,
    })
}

/// Registers the secrets a layer holds with [`crate::redaction`], as the
/// layer is made and before its values are checked: each secret setting's
/// value, each secret Kafka property's, and the passwords any value carries.
fn register_secrets(dict: &Dict) {
    fn walk(prefix: &str, value: &Value) {
        match value {
            Value::Dict(_, dict) => {
                for (k, v) in dict {
                    let key = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    walk(&key, v);
                }
            }
            Value::Array(_, values) => values.iter().for_each(|v| walk(prefix, v)),
            Value::String(_, text) => {
                let secret = setting(prefix).is_some_and(|s| s.secret);
                crate::redaction::register_setting(prefix, text, secret);
            }
            _ => {}
        }
    }
    for (k, v) in dict {
        walk(k, v);
    }
}

/// Puts `value` at `key` (`section.key`) in `dict`.
fn insert(dict: &mut Dict, key: &str, value: Value) {
    match key.split_once('.') {
        None => {
            dict.insert(key.to_owned(), value);
        }
        Some((section, rest)) => {
            let entry = dict
                .entry(section.to_owned())
                .or_insert_with(|| Value::from(Dict::new()));
            if let Value::Dict(_, inner) = entry {
                insert(inner, rest, value);
            }
        }
    }
}

/// A `KEY=VALUE` pair.
fn pair(text: &str, what: &str) -> Result<(String, String), ConfigError> {
    text.split_once('=')
        .filter(|(k, _)| !k.trim().is_empty())
        .map(|(k, v)| (k.trim().to_owned(), v.to_owned()))
        .ok_or_else(|| ConfigError(format!("{what}: expected KEY=VALUE")))
}

/// A map from `KEY=VALUE` items, or an error naming `what`.
fn map_of<'a>(items: impl Iterator<Item = &'a str>, what: &str) -> Result<Value, ConfigError> {
    let mut map = Dict::new();
    for item in items {
        let (k, v) = pair(item, what)?;
        map.insert(k, Value::from(v));
    }
    Ok(Value::from(map))
}

/// The value of `setting` from text, or an error naming `what`.
fn typed(setting: &Setting, text: &str, what: &str) -> Result<Value, ConfigError> {
    match setting.kind {
        Kind::Text => Ok(Value::from(text.to_owned())),
        Kind::Number => text
            .trim()
            .parse::<u64>()
            .map(Value::from)
            .map_err(|_| ConfigError(format!("{what}: expected a whole number, got {text:?}"))),
        Kind::Choice(words) => {
            if words.contains(&text) {
                Ok(Value::from(text.to_owned()))
            } else {
                Err(ConfigError(format!(
                    "{what}: expected one of {}, got {text:?}",
                    words.join(", ")
                )))
            }
        }
        Kind::Bool => match text.trim() {
            "true" => Ok(Value::from(true)),
            "false" => Ok(Value::from(false)),
            other => Err(ConfigError(format!(
                "{what}: expected true or false, got {other:?}"
            ))),
        },
        Kind::Map => map_of(text.split(',').filter(|i| !i.trim().is_empty()), what),
    }
}

/// The environment layer from `vars` (normally `std::env::vars()`): each
/// setting's `WALBOX_*` variable, `WALBOX_KAFKA_PROPERTY_*` variables, and
/// `…_FILE` variables naming a file that holds the value (for secrets).
/// Other `WALBOX_*` variables (`WALBOX_LOG`, `WALBOX_CONFIG`) are not settings.
pub(crate) fn environment(
    vars: impl IntoIterator<Item = (String, String)>,
) -> Result<Layer, ConfigError> {
    let vars: BTreeMap<String, String> = vars
        .into_iter()
        .filter(|(k, _)| k.starts_with("WALBOX_"))
        .collect();
    if let Some((old, new)) = RENAMED.iter().find(|(old, _)| vars.contains_key(*old)) {
        return Err(ConfigError(format!("{old} is now called {new}")));
    }
    let mut dict = Dict::new();
    let mut properties = Dict::new();
    for (name, raw) in &vars {
        let (stem, value) = match name.strip_suffix(FILE_SUFFIX) {
            Some(stem) if is_setting_variable(stem) => {
                if vars.contains_key(stem) {
                    return Err(ConfigError(format!(
                        "both {stem} and {name} are set; keep one"
                    )));
                }
                super::files::private(name, std::path::Path::new(raw))?;
                let text = std::fs::read_to_string(raw).map_err(|e| {
                    ConfigError(format!(
                        "{name}: cannot read {}: {e}",
                        PathBuf::from(raw).display()
                    ))
                })?;
                (stem, text.trim_end_matches(['\n', '\r']).to_owned())
            }
            _ => (name.as_str(), raw.clone()),
        };
        if let Some(property) = stem.strip_prefix(KAFKA_PROPERTY_PREFIX) {
            let key = property.to_ascii_lowercase().replace('_', ".");
            if key.is_empty() {
                return Err(ConfigError(format!("{name}: names no property")));
            }
            properties.insert(key, Value::from(value));
        } else if let Some(s) = SETTINGS.iter().find(|s| s.env() == stem) {
            insert(&mut dict, s.key, typed(s, &value, name)?);
        }
    }
    if let Some(e) = vars.keys().find_map(|name| misspelt(name)) {
        return Err(e);
    }
    if !properties.is_empty() {
        // Per-property variables win over the list variable.
        let mut merged = match dict
            .get("kafka")
            .and_then(|k| k.as_dict())
            .and_then(|k| k.get("properties"))
        {
            Some(Value::Dict(_, d)) => d.clone(),
            _ => Dict::new(),
        };
        merged.extend(properties);
        insert(&mut dict, "kafka.properties", Value::from(merged));
    }
    register_secrets(&dict);
    Ok(Layer {
        name: "environment",
        file: None,
        dict,
    })
}

/// `WALBOX_*` variables walbox reads that are not settings, and those
/// walbox's own scripts, tests and benchmarks set for the walbox they start:
/// `WALBOX_BIN` names the binary (two edits from `WALBOX_SINK`: without it
/// here, every walbox they start would refuse it as a typo), the others
/// the real brokers they run (in a setting's family: each walbox would warn
/// of them as ignored).
const NOT_SETTINGS: &[&str] = &[
    "WALBOX_LOG",
    "WALBOX_CONFIG",
    "WALBOX_BIN",
    // `walbox doctor --standby-url`'s (a secret: it may carry a password).
    "WALBOX_STANDBY_URL",
    "WALBOX_KAFKA_LIBS",
    "WALBOX_KAFKA_HEAP",
    "WALBOX_RABBITMQ_BIN",
    "WALBOX_NATS_SERVER",
];

/// How many edits away from a setting's variable an unknown `WALBOX_*`
/// variable is taken for a typo of it (`WALBOX_SLOTT`, `WALBOX_KAFKA_BROKER`)
/// and refused: read as unknown, it would leave its setting at the default
/// (another slot, another broker). Variables further away (a script's own,
/// such as `WALBOX_TEST_PG_URL`) are not walbox's business.
const TYPO_DISTANCE: usize = 2;

/// `name` without its `_FILE` suffix when neither it nor that stem is a
/// variable walbox knows (a setting's, or one of [`NOT_SETTINGS`]).
fn unknown(name: &str) -> Option<&str> {
    let known = |n: &str| is_setting_variable(n) || NOT_SETTINGS.contains(&n);
    let stem = name.strip_suffix(FILE_SUFFIX).unwrap_or(name);
    (!known(name) && !known(stem)).then_some(stem)
}

/// The `WALBOX_*` variables of `vars` that are in a setting's family but
/// none of its settings ([`unread`]): warned of, as read as nothing.
pub(crate) fn unread_variables(vars: &[(String, String)]) -> Vec<String> {
    let mut names: Vec<&str> = vars
        .iter()
        .map(|(k, _)| k.as_str())
        .filter(|k| k.starts_with("WALBOX_"))
        .collect();
    names.sort_unstable();
    names.into_iter().filter_map(unread).collect()
}

/// The warning for `name` when it is no setting's variable, too far from
/// any to be refused as a typo, but in a setting's family
/// (`WALBOX_METRICS_PORT` beside `WALBOX_METRICS_ADDR`): read as nothing,
/// it would be silently ignored.
fn unread(name: &str) -> Option<String> {
    let stem = unknown(name)?;
    if stem.starts_with(KAFKA_PROPERTY_PREFIX) {
        return None;
    }
    let family = &stem[..stem.rfind('_')?];
    if family == "WALBOX" {
        return None;
    }
    let (_, nearest) = SETTINGS
        .iter()
        .map(|s| s.env())
        .filter(|env| env.starts_with(&format!("{family}_")))
        .map(|env| (edit_distance(stem, &env), env))
        .min()?;
    Some(format!(
        "{name} is not a walbox setting and is ignored: did you mean {nearest}? (docs/configuration.md lists them all)"
    ))
}

/// The refusal of `name` when it is no setting's variable but one edit or
/// two away from one.
fn misspelt(name: &str) -> Option<ConfigError> {
    let stem = unknown(name)?;
    let (distance, nearest) = SETTINGS
        .iter()
        .map(|s| s.env())
        .map(|env| (edit_distance(stem, &env), env))
        .min()?;
    (distance <= TYPO_DISTANCE).then(|| {
        ConfigError(format!(
            "{name} is not a walbox setting: did you mean {nearest}{}? (a misspelt variable would leave its setting at the default)",
            if stem == name { "" } else { FILE_SUFFIX }
        ))
    })
}

/// Levenshtein distance between two ASCII names.
fn edit_distance(a: &str, b: &str) -> usize {
    let b = b.as_bytes();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.bytes().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let substitute = diagonal + usize::from(ca != *cb);
            diagonal = row[j + 1];
            row[j + 1] = substitute.min(row[j] + 1).min(row[j + 1] + 1);
        }
    }
    row[b.len()]
}

fn is_setting_variable(name: &str) -> bool {
    name.starts_with(KAFKA_PROPERTY_PREFIX) || SETTINGS.iter().any(|s| s.env() == name)
}

/// The command-line layer: `(key, values)` for each flag given.
pub(crate) fn flags<'a>(
    given: impl IntoIterator<Item = (&'static str, Vec<&'a str>)>,
) -> Result<Layer, ConfigError> {
    let mut dict = Dict::new();
    for (key, values) in given {
        let s = setting(key).expect("flags come from the table");
        let what = format!("--{}", s.flag());
        let value = match s.kind {
            Kind::Map => map_of(values.into_iter(), &what)?,
            _ => typed(s, values.last().copied().unwrap_or_default(), &what)?,
        };
        insert(&mut dict, key, value);
    }
    register_secrets(&dict);
    Ok(Layer {
        name: "command line",
        file: None,
        dict,
    })
}
