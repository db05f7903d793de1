//! The broker's URL, as RabbitMQ's URI spec writes it:
//! `amqp://user:password@host:port/vhost`. The user, the password and the
//! virtual host are percent-decoded; no path is the default virtual host
//! `/` (written `%2F` in a path). The password is never shown.

/// A parsed `amqp://` URL.
#[derive(Clone, PartialEq, Eq)]
pub struct AmqpUrl {
    /// Host.
    pub host: String,
    /// Port (5672 by default).
    pub port: u16,
    /// User (`guest` by default, as RabbitMQ's clients do).
    pub user: String,
    /// Password (`guest` by default).
    pub password: String,
    /// Virtual host.
    pub vhost: String,
}

/// Why a URL is not one walbox can use. It never quotes the URL: a
/// malformed one may hold its password anywhere (`u:pw@host`,
/// `amqp://u:pw:host`, `amqp//u:pw@host`), where no redaction can find it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct UrlError(String);

impl AmqpUrl {
    /// Parses `text`.
    pub fn parse(text: &str) -> Result<AmqpUrl, UrlError> {
        let bad = |why: &str| UrlError(why.to_owned());
        let rest = match text.split_once("://") {
            Some(("amqp", rest)) => rest,
            Some(("amqps", _)) => {
                return Err(bad(
                    "amqps:// (TLS) is not supported yet; use amqp:// on a trusted network, or a TLS tunnel",
                ))
            }
            _ => return Err(bad("expected amqp://user:password@host:port/vhost")),
        };
        let (authority, path) = match rest.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (rest, None),
        };
        if path.is_some_and(|p| p.contains(['/', '?', '#'])) {
            return Err(bad(
                "the path is one virtual host (write / as %2F); no query",
            ));
        }
        let (userinfo, hostport) = match authority.rsplit_once('@') {
            Some((u, h)) => (Some(u), h),
            None => (None, authority),
        };
        let (user, password) = match userinfo {
            None => ("guest".to_owned(), "guest".to_owned()),
            Some(u) => {
                let (user, password) = u.split_once(':').unwrap_or((u, ""));
                (
                    decode(user).ok_or_else(|| bad("bad percent-encoding in the user"))?,
                    decode(password).ok_or_else(|| bad("bad percent-encoding in the password"))?,
                )
            }
        };
        let (host, port) = match hostport.rsplit_once(':') {
            Some((h, p)) if !h.ends_with(']') || hostport.starts_with('[') => (
                h,
                p.parse::<u16>()
                    .map_err(|_| bad("the port is not a number from 1 to 65535"))?,
            ),
            _ => (hostport, 5672),
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() || port == 0 {
            return Err(bad("no host"));
        }
        let vhost = match path {
            None | Some("") => "/".to_owned(),
            Some(p) => decode(p).ok_or_else(|| bad("bad percent-encoding in the virtual host"))?,
        };
        if vhost.len() > 255 {
            return Err(bad("the virtual host is longer than AMQP's 255 bytes"));
        }
        Ok(AmqpUrl {
            host: host.to_owned(),
            port,
            user,
            password,
            vhost,
        })
    }
}

impl std::fmt::Display for AmqpUrl {
    /// `amqp://user@host:port/vhost`: no password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let vhost = if self.vhost == "/" {
            String::new()
        } else {
            encode(&self.vhost)
        };
        write!(
            f,
            "amqp://{}@{}:{}/{vhost}",
            self.user, self.host, self.port
        )
    }
}

impl std::fmt::Debug for AmqpUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self}")
    }
}

fn decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_rabbitmqs_uri_spec() {
        let u = AmqpUrl::parse("amqp://walbox:p%40ss@rabbit:5673/prod%2Fevents").unwrap();
        assert_eq!(
            (
                u.user.as_str(),
                u.password.as_str(),
                u.host.as_str(),
                u.port,
                u.vhost.as_str()
            ),
            ("walbox", "p@ss", "rabbit", 5673, "prod/events")
        );
        assert_eq!(u.to_string(), "amqp://walbox@rabbit:5673/prod%2Fevents");
        let d = AmqpUrl::parse("amqp://rabbit").unwrap();
        assert_eq!(
            (d.user.as_str(), d.port, d.vhost.as_str()),
            ("guest", 5672, "/")
        );
        assert_eq!(AmqpUrl::parse("amqp://h/%2F").unwrap().vhost, "/");
        assert_eq!(AmqpUrl::parse("amqp://[::1]:5672").unwrap().host, "::1");
    }

    #[test]
    fn a_bad_url_is_refused_without_its_password() {
        for (url, says) in [
            ("amqps://u:hunter2@h", "amqps:// (TLS) is not supported yet"),
            ("http://u:hunter2@h", "expected amqp://"),
            ("amqp://u:hunter2@h:x", "the port is not a number"),
            ("amqp://u:hunter2@h/a/b", "the path is one virtual host"),
            ("amqp://u:hunter2@", "no host"),
            // Malformed where no redaction could find the password.
            ("u:hunter2@rabbit:5672", "expected amqp://"),
            ("amqp//u:hunter2@rmq:5672/%2F", "expected amqp://"),
            ("amqp://u:hunter2:host", "the port is not a number"),
            ("amqp://u:hunter2:host/%2F", "the port is not a number"),
            ("amqp://u%zzhunter2@h", "bad percent-encoding in the user"),
            (
                "amqp://u:hunter2%zz@h",
                "bad percent-encoding in the password",
            ),
            (
                &format!("amqp://u:hunter2@h/{}", "v".repeat(256)),
                "longer than AMQP's 255 bytes",
            ),
        ] {
            let e = AmqpUrl::parse(url).unwrap_err().to_string();
            assert!(e.contains(says), "{url}: {e}");
            assert!(!e.contains("hunter2"), "{e}");
        }
    }
}
