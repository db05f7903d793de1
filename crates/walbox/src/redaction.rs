//! What no output may show, owned in one place.
//!
//! Every line walbox writes passes [`redact`] on its way out: log lines in
//! text and JSON ([`Stderr`], the writer logging is built on), the line a
//! failed command ends with, a usage error, and `walbox config`'s table. An
//! error made anywhere (a parser quoting its input, a client library echoing
//! a property) is caught there, whatever its text.
//!
//! [`redact`] replaces:
//! - each secret the configuration holds. The configuration registers them
//!   ([`register_setting`], [`register_environment`]) from every layer as it
//!   is read, before any value is checked, so a value refused as malformed is
//!   known too. A secret is known in every form output may show it in: as
//!   given, percent-encoded or decoded, and escaped as JSON or Rust's `Debug`
//!   escape it;
//! - the user information of any URL (`scheme://user:password@host`),
//!   registered or not;
//! - the value of a `password=…` keyword (libpq's form, and a URL's query).
//!
//! What is a secret: a setting the table marks secret (`pg_url`,
//! `rabbitmq.password`, …), a Kafka property whose name says so
//! ([`sink_kafka::is_secret_property`]), libpq's and AWS's secret variables,
//! and, in any value, what sits where a URL or a connection string keeps a
//! password — even in a value too malformed to parse (`postgress://u:pw@h`,
//! `amqp//u:pw@h`, `amqp://u:pw:h`).

use std::borrow::Cow;
use std::io::Write;
use std::sync::RwLock;

/// What a secret is shown as.
pub const REDACTED: &str = "<redacted>";

/// Shorter values are not registered: replacing every single letter a
/// one-character password is made of would garble every line, and such a
/// password protects nothing.
const SHORTEST: usize = 2;

/// The registered secrets, longest first (a secret containing another is
/// replaced whole).
static SECRETS: RwLock<Vec<String>> = RwLock::new(Vec::new());

/// The setting whose URL may carry a token alone as its user information
/// (`nats://token@host`); elsewhere that is a user's name.
const TOKEN_URL: &str = "nats.url";

/// Variables outside `WALBOX_*` whose values are secrets.
const SECRET_VARIABLES: [&str; 4] = [
    "PGPASSWORD",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECRET_KEY",
];

/// Registers `value`, a secret, in every form output may show it in.
pub fn register(value: &str) {
    if value.chars().count() < SHORTEST {
        return;
    }
    let mut forms = vec![value.to_owned(), percent_encoded(value)];
    if let Ok(decoded) = percent_decoded(value) {
        forms.push(decoded);
    }
    let quoted = serde_json::to_string(value).unwrap_or_default();
    forms.push(quoted[1..quoted.len().saturating_sub(1)].to_owned());
    let debug = format!("{value:?}");
    forms.push(debug[1..debug.len() - 1].to_owned());
    let mut secrets = SECRETS.write().unwrap_or_else(|p| p.into_inner());
    for form in forms {
        if form.chars().count() >= SHORTEST && !secrets.contains(&form) {
            secrets.push(form);
        }
    }
    secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
}

/// Registers what setting `key` (`pg_url`, `kafka.properties.sasl.password`,
/// `mapping.topic_template`) holds that is secret: the whole value when the
/// setting is a secret, and in any value the passwords it carries.
pub fn register_setting(key: &str, value: &str, secret: bool) {
    let property_secret = key
        .strip_prefix("kafka.properties.")
        .is_some_and(sink_kafka::is_secret_property);
    if secret || property_secret {
        register(value.trim());
    }
    for candidate in passwords_in(value, secret, key == TOKEN_URL) {
        register(&candidate);
    }
}

/// Registers the secrets of the environment outside walbox's own
/// settings: libpq's `PGPASSWORD`, AWS's keys.
pub fn register_environment(env: &[(String, String)]) {
    for (name, value) in env {
        if SECRET_VARIABLES.contains(&name.as_str()) {
            register(value);
        }
    }
}

/// `text` with every secret, URL user information and `password=` value
/// replaced by [`REDACTED`].
pub fn redact(text: &str) -> Cow<'_, str> {
    let mut out = Cow::Borrowed(text);
    {
        let secrets = SECRETS.read().unwrap_or_else(|p| p.into_inner());
        for secret in secrets.iter() {
            if out.contains(secret.as_str()) {
                out = Cow::Owned(out.replace(secret.as_str(), REDACTED));
            }
        }
    }
    if out.contains("://") {
        out = Cow::Owned(sink_kafka::redact_url_passwords(&out));
    }
    if out.contains('=') {
        let lower = out.to_ascii_lowercase();
        if ["password", "secret", "token"]
            .iter()
            .any(|k| lower.contains(k))
        {
            out = Cow::Owned(keyword_values_redacted(&out));
        }
    }
    out
}

/// Where a value keeps passwords, found without parsing it (it may be
/// malformed): the user information of a URL-like authority, and
/// `password=` keywords. `secret`: the value is a secret setting's, where
/// `u:pw:host` is taken for `u:pw@host`. `token`: a user information
/// without `:` is a token (`nats://token@host`).
fn passwords_in(value: &str, secret: bool, token: bool) -> Vec<String> {
    let mut found = Vec::new();
    // The authority: after `scheme://` (or a scheme missing its colon,
    // `amqp//`), else from the start, up to the path, query or fragment.
    let start = value
        .find("://")
        .map(|i| i + 3)
        .or_else(|| value.find("//").map(|i| i + 2))
        .unwrap_or(0);
    let rest = &value[start..];
    let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
    match authority.rfind('@') {
        Some(at) => {
            let userinfo = &authority[..at];
            match userinfo.split_once(':') {
                Some((_, password)) => {
                    found.push(password.to_owned());
                    // A password holding `:` unencoded: its last part too.
                    if let Some((_, last)) = password.rsplit_once(':') {
                        found.push(last.to_owned());
                    }
                }
                None if token => found.push(userinfo.to_owned()),
                None => {}
            }
        }
        // `u:pw:host`: `@` typed as `:`. What lies between the first and
        // the last colon may be a password (not in `[::1]:5432` nor in a
        // list of hosts).
        None if secret && !authority.contains(['[', ',']) => {
            let parts: Vec<&str> = authority.split(':').collect();
            if parts.len() > 2 {
                found.extend(parts[1..parts.len() - 1].iter().map(|p| (*p).to_owned()));
            }
        }
        None => {}
    }
    found.extend(keyword_values(value, false).into_iter().map(|(_, v)| v));
    found.retain(|v| v.chars().count() >= SHORTEST);
    found
}

/// Whether a keyword or query parameter names a secret.
fn secret_keyword(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    k.ends_with("password") || k.ends_with("secret") || k.ends_with("token")
}

/// The secret `key=value` pairs of a libpq keyword string or a URL query,
/// each with the byte range of its value: `password=x`, `password = 'a b'`,
/// `?sslpassword=x&…`. `strict`: no space around `=` (in output, where
/// `walbox config`'s `key = value` rows are not keywords).
fn keyword_values(text: &str, strict: bool) -> Vec<(std::ops::Range<usize>, String)> {
    let mut found = Vec::new();
    let bytes = text.as_bytes();
    let mut search = 0;
    while let Some(eq) = text[search..].find('=').map(|i| i + search) {
        search = eq + 1;
        // The keyword: the word before `=` (spaces allowed around it).
        let spaced = |b: Option<&u8>| b.is_some_and(u8::is_ascii_whitespace);
        if strict && (spaced(bytes.get(eq + 1)) || eq > 0 && spaced(bytes.get(eq - 1))) {
            continue;
        }
        let before = text[..eq].trim_end();
        let key_start = before
            .rfind(|c: char| c.is_whitespace() || matches!(c, '?' | '&' | ';'))
            .map_or(0, |i| i + 1);
        if !secret_keyword(&before[key_start..]) {
            continue;
        }
        let mut i = eq + 1;
        while i < bytes.len() && bytes[i] == b' ' {
            i += 1;
        }
        let start = i;
        if bytes.get(i) == Some(&b'\'') {
            // Quoted: up to the closing quote not escaped by `\`.
            let mut value = String::new();
            let mut chars = text[i + 1..].char_indices();
            let (mut end, mut inside_end) = (text.len(), text.len());
            while let Some((j, c)) = chars.next() {
                match c {
                    '\\' => value.extend(chars.next().map(|(_, c)| c)),
                    '\'' => {
                        inside_end = i + 1 + j;
                        end = inside_end + 1;
                        break;
                    }
                    c => value.push(c),
                }
            }
            let inside = text[start + 1..inside_end].to_owned();
            found.push((start..end, value));
            found.push((start..end, inside));
            i = end;
        } else {
            while i < bytes.len()
                && !bytes[i].is_ascii_whitespace()
                && !matches!(bytes[i], b'&' | b'#')
            {
                i += 1;
            }
            found.push((start..i, text[start..i].to_owned()));
        }
        search = i.max(search);
    }
    found
}

/// `text` with the value of each secret keyword replaced.
fn keyword_values_redacted(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut last = 0;
    for (range, _) in keyword_values(text, true) {
        if range.start >= last && range.end > range.start {
            out.push_str(&text[last..range.start]);
            out.push_str(REDACTED);
            last = range.end;
        }
    }
    out.push_str(&text[last..]);
    out
}

/// Every byte but RFC 3986's unreserved ones.
const RESERVED: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// `value` percent-encoded as a URL's user information or query has it.
fn percent_encoded(value: &str) -> String {
    percent_encoding::utf8_percent_encode(value, RESERVED).to_string()
}

/// `value` percent-decoded, when it is well-formed UTF-8 once decoded.
fn percent_decoded(value: &str) -> Result<String, ()> {
    percent_encoding::percent_decode_str(value)
        .decode_utf8()
        .map(|d| d.into_owned())
        .map_err(|_| ())
}

/// Standard error, each line redacted: what logging writes to. The
/// formatter writes an event's line whole to one writer, which redacts and
/// writes it when dropped.
#[derive(Clone, Copy, Debug, Default)]
pub struct Stderr;

/// One line on its way to standard error.
#[derive(Default)]
pub struct Line(Vec<u8>);

impl Write for Line {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for Line {
    fn drop(&mut self) {
        let text = String::from_utf8_lossy(&self.0);
        let _ = std::io::stderr().write_all(redact(&text).as_bytes());
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Stderr {
    type Writer = Line;

    fn make_writer(&'a self) -> Line {
        Line::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registered(key: &str, value: &str, secret: bool) -> Vec<String> {
        let mut found = passwords_in(value, secret, key == TOKEN_URL);
        if secret
            || key
                .strip_prefix("kafka.properties.")
                .is_some_and(sink_kafka::is_secret_property)
        {
            found.push(value.to_owned());
        }
        found
    }

    #[test]
    fn a_password_is_found_where_a_malformed_value_keeps_it() {
        for (value, password) in [
            (
                "postgress://walbox:S3cretPW!@127.0.0.1:55432/app",
                "S3cretPW!",
            ),
            ("amqp//user:RabbitPW9@rmq:5672/%2F", "RabbitPW9"),
            ("u:pwd1@host:5672", "pwd1"),
            ("amqp://u:pwd2:host", "pwd2"),
            ("host=h user=u password=xyzzy port=abc", "xyzzy"),
            ("host=h user=u password = 'a b c'", "a b c"),
            ("jdbc:postgresql://h/db?user=u&password=Jdbc9&x=1", "Jdbc9"),
            ("postgres://h/db?sslpassword=KeyPw", "KeyPw"),
        ] {
            let found = registered("pg_url", value, true);
            assert!(found.iter().any(|f| f == password), "{value}: {found:?}");
        }
        assert!(registered("nats.url", "nats://Tok3n@host:4222", true).contains(&"Tok3n".into()));
        // Elsewhere a user information without a password is the user's
        // name, not a token; and hosts are not passwords.
        for value in [
            "postgres://walbox@127.0.0.1:1/app",
            "postgres://[::1]:5432,h2:5433/app",
            "mailto://ops@example.com",
        ] {
            assert!(passwords_in(value, true, false).is_empty(), "{value}");
        }
    }

    #[test]
    fn a_registered_secret_is_redacted_in_every_form_output_shows() {
        register("Sec\"ret/ü%1");
        for shown in ["Sec\"ret/ü%1", "Sec\\\"ret/ü%1", "Sec%22ret%2F%C3%BC%251"] {
            let line = format!("failed: {shown} refused");
            assert_eq!(redact(&line), "failed: <redacted> refused", "{shown}");
        }
    }

    #[test]
    fn urls_and_keywords_are_redacted_even_unregistered() {
        assert_eq!(
            redact("connect http://a:Unseen1@h:1/x failed"),
            "connect http://<redacted>@h:1/x failed"
        );
        assert_eq!(
            redact("host=h password='x y' user=u and ?password=z&a=1"),
            "host=h password=<redacted> user=u and ?password=<redacted>&a=1"
        );
        // A user's name is not a secret; `walbox config`'s rows are not
        // keywords.
        assert_eq!(
            redact("amqps://walbox@rmq:5671/"),
            "amqps://walbox@rmq:5671/"
        );
        assert_eq!(
            redact("webhook.secret = (none)  (default)"),
            "webhook.secret = (none)  (default)"
        );
        assert_eq!(
            redact("POST https://hook.example/x?token=T0k3n&v=1 failed"),
            "POST https://hook.example/x?token=<redacted>&v=1 failed"
        );
        assert_eq!(redact("nothing secret"), "nothing secret");
    }

    #[test]
    fn a_secret_property_with_a_mistyped_name_is_still_a_secret() {
        for key in ["sasl.passwd", "sasl.pass", "sasl.pwd", "ssl.key.password"] {
            let found = registered(&format!("kafka.properties.{key}"), "Hunter2pw", false);
            assert!(found.contains(&"Hunter2pw".to_owned()), "{key}");
        }
        assert!(registered("kafka.properties.linger.ms", "20", false).is_empty());
    }
}
