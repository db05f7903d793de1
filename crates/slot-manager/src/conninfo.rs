//! libpq's connection strings, read as libpq reads them: a URI
//! (`postgres[ql]://[user[:password]@][host[:port][,…]][/dbname][?k=v&…]`)
//! or keywords (`k=v k = 'quoted \' value' …`), into keyword–value pairs,
//! each keyword checked.
//!
//! A refusal names the keyword and the reason, in libpq's words where libpq
//! has them (`invalid connection option "foo"`, `invalid integer value "abc"
//! for connection option "port"`), and never quotes a password: this is the
//! one place that reads the string, so a malformed one (`postgress://…`, a
//! JDBC URL, an unquoted value with a space) is refused here without its
//! text.

use crate::error::Error;

/// What walbox does with a libpq keyword.
enum Known {
    /// Taken (and its value checked by the given rule).
    Taken(Value),
    /// libpq's, but refused by walbox, for the reason given.
    Refused(&'static str),
}

/// The shape a keyword's value must have.
#[derive(Clone, Copy)]
enum Value {
    /// Any text.
    Text,
    /// A secret: any text, never quoted back.
    Secret,
    /// Whole numbers, comma-separated (`port=5432,5433`).
    Ports,
    /// A whole number.
    Integer,
    /// One of a few words.
    OneOf(&'static [&'static str]),
}

/// Every keyword libpq 18 knows, and what walbox does with it.
fn known(keyword: &str) -> Option<Known> {
    use Known::{Refused, Taken};
    use Value::*;
    Some(match keyword {
        "host" | "hostaddr" | "dbname" | "user" | "options" | "application_name"
        | "fallback_application_name" | "sslrootcert" | "sslcert" | "sslkey" | "passfile" => {
            Taken(Text)
        }
        "password" => Taken(Secret),
        "port" => Taken(Ports),
        "connect_timeout" | "keepalives_idle" | "keepalives_interval" | "keepalives_count"
        | "tcp_user_timeout" => Taken(Integer),
        "keepalives" | "sslcompression" => Taken(OneOf(&["0", "1"])),
        // Their values are checked where they are read ([`crate::SslMode`],
        // [`crate::TargetSession`]), with walbox's reasons.
        "sslmode" | "target_session_attrs" => Taken(Text),
        "channel_binding" => Taken(OneOf(&["disable", "prefer", "require"])),
        "load_balance_hosts" => Taken(OneOf(&["disable", "random"])),
        "sslnegotiation" => Taken(OneOf(&["postgres", "direct"])),
        // walbox never asks for GSSAPI encryption: `prefer` falls back to
        // TLS or plain as libpq does without GSSAPI credentials.
        "gssencmode" => Taken(OneOf(&["disable", "prefer"])),
        "sslsni" => Taken(OneOf(&["1"])),
        "client_encoding" => Taken(OneOf(&["UTF8", "utf8", "auto"])),
        "requiressl" => Taken(OneOf(&["0", "1"])),
        "krbsrvname" | "gsslib" | "gssdelegation" => {
            Refused("GSSAPI (Kerberos) authentication is not supported: use a password, SCRAM or a client certificate")
        }
        "sslpassword" => Refused(
            "encrypted client keys are not supported: give sslkey a key without a passphrase (openssl pkey -in client.key -out client-plain.key) and keep the file private",
        ),
        "sslcrl" | "sslcrldir" => {
            Refused("certificate revocation lists are not supported (walbox checks the chain and the host name)")
        }
        "sslcertmode" => Refused("is not supported: give sslcert and sslkey to present a certificate, or neither"),
        "ssl_min_protocol_version" | "ssl_max_protocol_version" => {
            Refused("is not supported: walbox speaks TLS 1.2 and 1.3 only")
        }
        "sslkeylogfile" => Refused("is not supported"),
        "service" | "servicefile" => Refused(
            "connection service files (pg_service.conf) are not supported: give the settings in the string itself",
        ),
        "require_auth" => Refused(
            "is not supported: channel_binding=require insists on SCRAM with channel binding",
        ),
        "replication" => Refused("is set by walbox on its replication connection"),
        "min_protocol_version" | "max_protocol_version" => Refused("is not supported"),
        "oauth_issuer" | "oauth_client_id" | "oauth_client_secret" | "oauth_scope" => {
            Refused("OAuth authentication is not supported")
        }
        _ => return None,
    })
}

/// The keyword–value pairs of `input`, a URI or a keyword string, each
/// keyword known and its value of the right shape; a later value of a
/// keyword replaces an earlier one, as in libpq.
pub(crate) fn parse(input: &str) -> Result<Vec<(String, String)>, Error> {
    let pairs = if let Some(rest) = input
        .strip_prefix("postgresql://")
        .or_else(|| input.strip_prefix("postgres://"))
    {
        uri(rest)?
    } else {
        refuse_other_schemes(input)?;
        keywords(input)?
    };
    let mut checked: Vec<(String, String)> = Vec::with_capacity(pairs.len());
    for (keyword, value) in pairs {
        check(&keyword, &value)?;
        checked.retain(|(k, _)| *k != keyword);
        checked.push((keyword, value));
    }
    Ok(checked)
}

/// A URI of another scheme, a JDBC URL: refused by what it is, not as a
/// keyword string missing its `=` (which would quote it).
fn refuse_other_schemes(input: &str) -> Result<(), Error> {
    let trimmed = input.trim_start();
    if trimmed.starts_with("jdbc:") {
        return Err(config(
            "a JDBC URL: drop jdbc: (postgres://host:port/dbname) and give the user and password before the host, as user:password@",
        ));
    }
    let scheme_end = trimmed
        .find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.')))
        .unwrap_or(trimmed.len());
    if scheme_end > 0
        && trimmed[scheme_end..].starts_with(':')
        && !trimmed[..scheme_end].contains('=')
    {
        let scheme = &trimmed[..scheme_end];
        if trimmed[scheme_end..].starts_with("://") && scheme.len() <= 20 {
            return Err(config(&format!(
                "unknown URI scheme \"{scheme}\": use postgres:// or postgresql://, or key=value keywords"
            )));
        }
        if !trimmed[..scheme_end].contains(char::is_whitespace) && !trimmed.contains('=') {
            return Err(config(
                "not a connection string: use postgres://user:password@host:port/dbname or key=value keywords (host=… user=… dbname=…)",
            ));
        }
    }
    Ok(())
}

fn config(text: &str) -> Error {
    Error::Config(text.to_owned())
}

/// Checks `keyword` is known and taken, and its value of the right shape.
fn check(keyword: &str, value: &str) -> Result<(), Error> {
    let shape = match known(keyword) {
        None => return Err(config(&format!("invalid connection option \"{keyword}\""))),
        Some(Known::Refused(reason)) => {
            return Err(config(&format!("{keyword}: {reason}")));
        }
        Some(Known::Taken(shape)) => shape,
    };
    let integer = |v: &str| v.trim().parse::<u32>().is_ok();
    let ok = match shape {
        Value::Text | Value::Secret => true,
        Value::Integer => integer(value),
        Value::Ports => value
            .split(',')
            .all(|p| p.is_empty() || p.trim().parse::<u16>().is_ok_and(|n| n > 0)),
        Value::OneOf(words) => words.contains(&value),
    };
    if ok {
        return Ok(());
    }
    let what = match shape {
        Value::OneOf(words) => format!(" (one of {})", words.join(", ")),
        _ => String::new(),
    };
    Err(config(&match shape {
        // Not quoted: a URI's password typed with `:` for `@` lands here.
        Value::Ports => format!(
            "invalid integer value for connection option \"{keyword}\" (a port from 1 to 65535 for each host)"
        ),
        Value::Integer => format!(
            "invalid integer value \"{value}\" for connection option \"{keyword}\""
        ),
        _ => format!("invalid {keyword} value: \"{value}\"{what}"),
    }))
}

/// Splits `text` (a URI's part) at the first of `stops`.
fn until<'a>(text: &'a str, stops: &[char]) -> (&'a str, &'a str) {
    match text.find(stops) {
        Some(i) => (&text[..i], &text[i..]),
        None => (text, ""),
    }
}

/// `text` percent-decoded, `what` naming the part for the refusal (the text
/// itself is never quoted: it may be a password).
fn decoded(text: &str, what: &str) -> Result<String, Error> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let byte = text
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| {
                    config(&format!(
                        "invalid percent-encoded token in the URI's {what}"
                    ))
                })?;
            out.push(byte);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| config(&format!("the URI's {what} is not UTF-8")))
}

/// The pairs of a URI, after its scheme.
fn uri(rest: &str) -> Result<Vec<(String, String)>, Error> {
    let mut pairs = Vec::new();
    // User information: up to an `@` met before any `/` (libpq's rule).
    let rest = match rest.find(['@', '/']) {
        Some(at) if rest.as_bytes()[at] == b'@' => {
            let userinfo = &rest[..at];
            let (user, password) = match userinfo.split_once(':') {
                Some((u, p)) => (u, Some(p)),
                None => (userinfo, None),
            };
            if !user.is_empty() {
                pairs.push(("user".to_owned(), decoded(user, "user name")?));
            }
            if let Some(p) = password {
                pairs.push(("password".to_owned(), decoded(p, "password")?));
            }
            &rest[at + 1..]
        }
        _ => rest,
    };
    let (hostspec, rest) = until(rest, &['/', '?']);
    let (mut hosts, mut ports) = (Vec::new(), Vec::new());
    for spec in hostspec.split(',') {
        let (host, port) = if let Some(inner) = spec.strip_prefix('[') {
            let close = inner.find(']').ok_or_else(|| {
                config("end of string reached when looking for matching \"]\" in IPv6 host address in URI")
            })?;
            let after = &inner[close + 1..];
            let port = match after.strip_prefix(':') {
                Some(p) => p,
                None if after.is_empty() => "",
                None => {
                    return Err(config(
                        "unexpected character after an IPv6 host address in URI (expected \":\" and a port)",
                    ))
                }
            };
            (&inner[..close], port)
        } else {
            spec.split_once(':').unwrap_or((spec, ""))
        };
        hosts.push(decoded(host, "host")?);
        ports.push(decoded(port, "port")?);
    }
    if hosts.iter().any(|h| !h.is_empty()) {
        pairs.push(("host".to_owned(), hosts.join(",")));
    }
    if ports.iter().any(|p| !p.is_empty()) {
        pairs.push(("port".to_owned(), ports.join(",")));
    }
    let (path, query) = until(rest, &['?']);
    if let Some(db) = path.strip_prefix('/').filter(|d| !d.is_empty()) {
        pairs.push(("dbname".to_owned(), decoded(db, "database name")?));
    }
    for parameter in query
        .trim_start_matches('?')
        .split('&')
        .filter(|p| !p.is_empty())
    {
        let (key, value) = parameter
            .split_once('=')
            .ok_or_else(|| config("missing key/value separator \"=\" in URI query parameter"))?;
        let key = decoded(key, "query")?;
        let value = decoded(value, &format!("parameter {key}"))?;
        // JDBC's spelling, which libpq takes too.
        if key == "ssl" && value == "true" {
            pairs.push(("sslmode".to_owned(), "require".to_owned()));
            continue;
        }
        if known(&key).is_none() {
            return Err(config(&format!("invalid URI query parameter: \"{key}\"")));
        }
        pairs.push((key, value));
    }
    Ok(pairs)
}

/// The pairs of a keyword string: `key = value`, a value quoted with `'`
/// when it holds spaces (`\` escapes the next character).
fn keywords(input: &str) -> Result<Vec<(String, String)>, Error> {
    let mut pairs: Vec<(String, String)> = Vec::new();
    let mut chars = input.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.peek().is_none() {
            return Ok(pairs);
        }
        let mut key = String::new();
        while let Some(c) = chars.next_if(|c| *c != '=' && !c.is_whitespace()) {
            key.push(c);
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.next_if(|c| *c == '=').is_none() {
            // A word without `=`: most often the rest of a value that held
            // a space. Quoted back only when it is a keyword's name: any
            // other word may be part of a password.
            let after = match pairs.last() {
                Some((last, _)) => format!(" after the value of {last}"),
                None => " at the start".to_owned(),
            };
            return Err(if known(&key).is_some() {
                config(&format!(
                    "missing \"=\" after \"{key}\" in connection info string"
                ))
            } else {
                config(&format!(
                    "a word without \"=\"{after} in connection info string: quote a value that holds spaces (key='a b')"
                ))
            });
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        if chars.next_if(|c| *c == '\'').is_some() {
            loop {
                match chars.next() {
                    Some('\\') => value.extend(chars.next()),
                    Some('\'') => break,
                    Some(c) => value.push(c),
                    None => {
                        return Err(config(&format!(
                        "unterminated quoted string in connection info string (the value of {key})"
                    )))
                    }
                }
            }
        } else {
            while let Some(c) = chars.next_if(|c| !c.is_whitespace()) {
                if c == '\\' {
                    value.extend(chars.next());
                } else {
                    value.push(c);
                }
            }
        }
        pairs.push((key, value));
    }
}

/// `pairs` as a keyword string tokio-postgres reads back exactly: every
/// value quoted, `'` and `\` escaped.
pub(crate) fn keyword_string(pairs: &[(String, String)]) -> String {
    let mut out = String::new();
    for (key, value) in pairs {
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(key);
        out.push_str("='");
        for c in value.chars() {
            if matches!(c, '\'' | '\\') {
                out.push('\\');
            }
            out.push(c);
        }
        out.push('\'');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(input: &str) -> Vec<(String, String)> {
        parse(input).unwrap_or_else(|e| panic!("{input}: {e}"))
    }

    fn refusal(input: &str) -> String {
        match parse(input) {
            Ok(p) => panic!("{input} was taken: {p:?}"),
            Err(e) => e.to_string(),
        }
    }

    fn kv(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn reads_a_uri_as_libpq_does() {
        assert_eq!(
            pairs("postgresql://u%40x:p%3Aw@h1:5433,[::1]:5434,h3/app%2Fdb?sslmode=require&application_name=a%20b"),
            kv(&[
                ("user", "u@x"),
                ("password", "p:w"),
                ("host", "h1,::1,h3"),
                ("port", "5433,5434,"),
                ("dbname", "app/db"),
                ("sslmode", "require"),
                ("application_name", "a b"),
            ])
        );
        assert_eq!(
            pairs("postgres://%2Fvar%2Frun%2Fpostgresql/db"),
            kv(&[("host", "/var/run/postgresql"), ("dbname", "db")])
        );
        assert_eq!(pairs("postgres://"), kv(&[]));
        assert_eq!(
            pairs("postgres://h/db?ssl=true&host=other"),
            kv(&[("dbname", "db"), ("sslmode", "require"), ("host", "other")])
        );
    }

    #[test]
    fn reads_keywords_as_libpq_does() {
        assert_eq!(
            pairs(r"host = h  port=5433 password='a \'b\\ c' user=u\ v user=w"),
            kv(&[
                ("host", "h"),
                ("port", "5433"),
                ("password", r"a 'b\ c"),
                ("user", "w"),
            ])
        );
        assert_eq!(pairs(""), kv(&[]));
    }

    #[test]
    fn each_refusal_names_the_keyword_and_the_reason() {
        for (input, want) in [
            (
                "host=h port=abc",
                "invalid integer value for connection option \"port\"",
            ),
            (
                "postgres://u@h:abc/db",
                "invalid integer value for connection option \"port\"",
            ),
            (
                "postgres://u@h/db?foo=bar",
                "invalid URI query parameter: \"foo\"",
            ),
            ("host=h foo=bar", "invalid connection option \"foo\""),
            (
                "host=h gssencmode=require",
                "invalid gssencmode value: \"require\" (one of disable, prefer)",
            ),
            (
                "host=h sslpassword=x",
                "sslpassword: encrypted client keys are not supported",
            ),
            (
                "host=h service=foo",
                "service: connection service files (pg_service.conf) are not supported",
            ),
            (
                "jdbc:postgresql://h:5432/db?user=u",
                "a JDBC URL: drop jdbc: (postgres://host:port/dbname)",
            ),
            ("postgress://u:pw@h/db", "unknown URI scheme \"postgress\""),
            (
                "host=h connect_timeout=x",
                "invalid integer value \"x\" for connection option \"connect_timeout\"",
            ),
            (
                "host=h keepalives=yes",
                "invalid keepalives value: \"yes\" (one of 0, 1)",
            ),
            (
                "postgres://u@[::1/db",
                "matching \"]\" in IPv6 host address",
            ),
            (
                "host=h user=u stray",
                "a word without \"=\" after the value of user",
            ),
            ("host=h user", "missing \"=\" after \"user\""),
            (
                "host='h",
                "unterminated quoted string in connection info string (the value of host)",
            ),
            ("postgres://h/db?sslmode", "missing key/value separator"),
            (
                "host=h krbsrvname=postgres",
                "krbsrvname: GSSAPI (Kerberos) authentication is not supported",
            ),
            (
                "host=h replication=database",
                "replication: is set by walbox",
            ),
        ] {
            let e = refusal(input);
            assert!(e.contains(want), "{input}: {e}");
        }
        assert!(parse("host=h gssencmode=disable sslcompression=0 sslsni=1").is_ok());
    }

    #[test]
    fn a_refusal_never_quotes_a_password() {
        for input in [
            "postgress://walbox:S3cretPW@127.0.0.1:55432/app",
            "host=h user=u password=S3cretPW stray",
            "host=h user=u password=S3cret PW",
            "host=h password='S3cretPW",
            "postgres://u:S3cret%zzPW@h/db",
            "postgres://u:S3cretPW@h:abc/db",
            "postgres://u:S3cretPW@h/db?bogus=1",
            "jdbc:postgresql://h/db?user=u&password=S3cretPW",
            "postgres://h/db?password=S3cret%zz",
            "S3cretPW",
            "postgres://u:S3cretPW:h/db",
            "mysql://u:S3cretPW@h/db",
        ] {
            let e = refusal(input);
            assert!(!e.contains("S3cret"), "{input}: {e}");
        }
    }

    #[test]
    fn the_keyword_string_is_read_back_as_written() {
        let original = kv(&[("password", r"a 'b\ c"), ("host", "h1,h2"), ("dbname", "")]);
        let text = keyword_string(&original);
        let config: tokio_postgres::Config = text.parse().unwrap();
        assert_eq!(config.get_password(), Some(&br"a 'b\ c"[..]));
        assert_eq!(config.get_hosts().len(), 2);
        assert_eq!(pairs(&text), original);
    }
}
