//! The broker's URL, as RabbitMQ's URI spec writes it:
//! `amqp://user:password@host:port/vhost`, or `amqps://` for TLS (port
//! 5671 by default). Parsed by the `url` crate (WHATWG URL parsing, the
//! parser of the Rust ecosystem); the user, the password and the virtual
//! host are percent-decoded; no path is the default virtual host `/`
//! (written `%2F` in a path). The password is never shown.

use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use sink_core::percent::decode;

/// Bytes a virtual host keeps unencoded when shown: RFC 3986's unreserved.
const VHOST_SHOWN: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// A parsed `amqp://` or `amqps://` URL.
#[derive(Clone, PartialEq, Eq)]
pub struct AmqpUrl {
    /// `amqps://`: TLS.
    pub tls: bool,
    /// Host (an IPv6 address without its brackets).
    pub host: String,
    /// Port (5672 by default, 5671 with TLS).
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

const EXPECTED: &str = "expected amqp://user:password@host:port/vhost (or amqps:// for TLS)";

impl AmqpUrl {
    /// Parses `text`.
    pub fn parse(text: &str) -> Result<AmqpUrl, UrlError> {
        let bad = |why: &str| UrlError(why.to_owned());
        // Only the scheme's spelling is looked at before the parser: a
        // text without "scheme://" is refused whatever else it holds.
        let tls = match text.split_once("://").map(|(scheme, _)| scheme) {
            Some(s) if s.eq_ignore_ascii_case("amqp") => false,
            Some(s) if s.eq_ignore_ascii_case("amqps") => true,
            _ => return Err(bad(EXPECTED)),
        };
        let url = url::Url::parse(text).map_err(|e| {
            UrlError(match e {
                url::ParseError::InvalidPort => {
                    "the port is not a number from 1 to 65535".to_owned()
                }
                url::ParseError::EmptyHost => "no host".to_owned(),
                url::ParseError::InvalidIpv6Address => "not an IPv6 address in [ ]".to_owned(),
                // The parser's own words quote nothing of the input.
                other => format!("{other}; {EXPECTED}"),
            })
        })?;
        if url.query().is_some() || url.fragment().is_some() {
            return Err(bad(
                "no query or fragment: TLS files and the password are settings of their own (rabbitmq.ca_file, rabbitmq.password, …)",
            ));
        }
        let host = match url.host() {
            None => return Err(bad("no host")),
            Some(url::Host::Ipv6(ip)) => ip.to_string(),
            Some(url::Host::Ipv4(ip)) => ip.to_string(),
            Some(url::Host::Domain("")) => return Err(bad("no host")),
            Some(url::Host::Domain(d)) => {
                decode(d).ok_or_else(|| bad("bad percent-encoding in the host"))?
            }
        };
        let port = match url.port() {
            Some(0) => return Err(bad("the port is not a number from 1 to 65535")),
            Some(p) => p,
            None if tls => 5671,
            None => 5672,
        };
        let (user, password) = match (url.username(), url.password()) {
            ("", None) => ("guest".to_owned(), "guest".to_owned()),
            (user, password) => (
                decode(user).ok_or_else(|| bad("bad percent-encoding in the user"))?,
                decode(password.unwrap_or(""))
                    .ok_or_else(|| bad("bad percent-encoding in the password"))?,
            ),
        };
        let path = url.path().strip_prefix('/').unwrap_or(url.path());
        if path.contains('/') {
            return Err(bad("the path is one virtual host (write / as %2F)"));
        }
        if path.contains(['@', ':']) {
            // `amqp://user/password@host`: shown as a virtual host, the
            // password would be in every log line naming the broker.
            return Err(bad(
                "an unencoded @ or : in the virtual host (write %40, %3A); is the user:password@ part malformed?",
            ));
        }
        let vhost = match path {
            "" => "/".to_owned(),
            p => decode(p).ok_or_else(|| bad("bad percent-encoding in the virtual host"))?,
        };
        if vhost.len() > 255 {
            return Err(bad("the virtual host is longer than AMQP's 255 bytes"));
        }
        Ok(AmqpUrl {
            tls,
            host,
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
        let scheme = if self.tls { "amqps" } else { "amqp" };
        let vhost = if self.vhost == "/" {
            String::new()
        } else {
            utf8_percent_encode(&self.vhost, VHOST_SHOWN).to_string()
        };
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        let user = utf8_percent_encode(&self.user, VHOST_SHOWN);
        write!(f, "{scheme}://{user}@{host}:{}/{vhost}", self.port)
    }
}

impl std::fmt::Debug for AmqpUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(u: &AmqpUrl) -> (bool, &str, &str, &str, u16, &str) {
        (
            u.tls,
            u.user.as_str(),
            u.password.as_str(),
            u.host.as_str(),
            u.port,
            u.vhost.as_str(),
        )
    }

    #[test]
    fn parses_rabbitmqs_uri_spec() {
        let u = AmqpUrl::parse("amqp://walbox:p%40ss@rabbit:5673/prod%2Fevents").unwrap();
        assert_eq!(
            parts(&u),
            (false, "walbox", "p@ss", "rabbit", 5673, "prod/events")
        );
        assert_eq!(u.to_string(), "amqp://walbox@rabbit:5673/prod%2Fevents");
        let d = AmqpUrl::parse("amqp://rabbit").unwrap();
        assert_eq!(parts(&d), (false, "guest", "guest", "rabbit", 5672, "/"));
        assert_eq!(AmqpUrl::parse("amqp://h/%2F").unwrap().vhost, "/");
        assert_eq!(AmqpUrl::parse("amqp://h/").unwrap().vhost, "/");
        let v6 = AmqpUrl::parse("amqp://[::1]:5672").unwrap();
        assert_eq!(v6.host, "::1");
        assert_eq!(v6.to_string(), "amqp://guest@[::1]:5672/");
        // A user without a password, as RabbitMQ's spec allows.
        assert_eq!(
            parts(&AmqpUrl::parse("amqp://u@h").unwrap()),
            (false, "u", "", "h", 5672, "/")
        );
    }

    #[test]
    fn amqps_is_tls_on_5671_by_default() {
        // Amazon MQ's and CloudAMQP's shapes.
        let mq =
            AmqpUrl::parse("amqps://walbox:pw@b-1234.mq.eu-west-1.amazonaws.com:5671").unwrap();
        assert_eq!(
            parts(&mq),
            (
                true,
                "walbox",
                "pw",
                "b-1234.mq.eu-west-1.amazonaws.com",
                5671,
                "/"
            )
        );
        let cloud = AmqpUrl::parse("amqps://abcd:pw@rat.rmq2.cloudamqp.com/abcd").unwrap();
        assert_eq!(
            parts(&cloud),
            (true, "abcd", "pw", "rat.rmq2.cloudamqp.com", 5671, "abcd")
        );
        assert_eq!(
            cloud.to_string(),
            "amqps://abcd@rat.rmq2.cloudamqp.com:5671/abcd"
        );
        assert!(AmqpUrl::parse("AMQPS://h").unwrap().tls);
    }

    #[test]
    fn a_bad_url_is_refused_without_its_password() {
        for (url, says) in [
            ("http://u:hunter2@h", "expected amqp://"),
            ("amqp://u:hunter2@h:x", "the port is not a number"),
            ("amqp://u:hunter2@h:0", "the port is not a number"),
            ("amqp://u:hunter2@h:70000", "the port is not a number"),
            ("amqp://u:hunter2@h/a/b", "the path is one virtual host"),
            ("amqp://u:hunter2@h/v?heartbeat=10", "no query"),
            ("amqps://u:hunter2@h/v?cacertfile=/ca.pem", "no query"),
            ("amqp://u:hunter2@", "no host"),
            ("amqp://u:hunter2@[::1", "IPv6"),
            // Malformed where no redaction could find the password.
            ("u:hunter2@rabbit:5672", "expected amqp://"),
            ("amqp//u:hunter2@rmq:5672/%2F", "expected amqp://"),
            ("amqp:/u:hunter2@rmq:5672/%2F", "expected amqp://"),
            ("amqp://u:hunter2:host", "the port is not a number"),
            ("amqp://u:hunter2:host/%2F", "the port is not a number"),
            ("amqp://u%zzhunter2@h", "bad percent-encoding in the user"),
            (
                "amqp://u:hunter2%zz@h",
                "bad percent-encoding in the password",
            ),
            (
                "amqp://u:hunter2%ff@h",
                "bad percent-encoding in the password",
            ),
            (
                "amqp://u:hunter2@h/%zz",
                "bad percent-encoding in the virtual host",
            ),
            (
                &format!("amqp://u:hunter2@h/{}", "v".repeat(256)),
                "longer than AMQP's 255 bytes",
            ),
            ("amqp://u:hunter2@h h", "expected amqp://"),
            ("amqp://u/hunter2@h:5672", "unencoded @ or :"),
        ] {
            let e = AmqpUrl::parse(url).unwrap_err().to_string();
            assert!(e.contains(says), "{url}: {e}");
            assert!(!e.contains("hunter2"), "{e}");
        }
    }

    #[test]
    fn no_input_makes_the_parser_panic_or_show_a_password() {
        // Every cut and one-byte change of a valid URL: parsed or refused,
        // and a refusal never holds the password.
        let good = "amqps://user:Zq9secret@rabbit.example:5671/prod%2Fevents";
        let mut inputs: Vec<String> = (0..=good.len()).map(|n| good[..n].to_owned()).collect();
        for i in 0..good.len() {
            for b in [b'@', b':', b'/', b'%', b'[', b']', b'?', b'#', b' ', b'\\'] {
                let mut v = good.as_bytes().to_vec();
                v[i] = b;
                inputs.push(String::from_utf8(v).unwrap());
            }
        }
        for input in inputs {
            if let Err(e) = AmqpUrl::parse(&input) {
                for part in ["Zq9secret", "Zq9s", "secret"] {
                    assert!(!e.to_string().contains(part), "{input}: {e}");
                }
            }
        }
    }
}
