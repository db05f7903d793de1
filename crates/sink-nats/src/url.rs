//! The server's URL: `nats://[user:password@|token@]host[:port]`, or
//! `tls://…` for TLS (port 4222 by default). Parsed by the `url` crate;
//! no error quotes the URL, and it is shown without its credentials.

/// How walbox authenticates.
#[derive(Clone, PartialEq, Eq)]
pub enum Auth {
    /// No credentials.
    None,
    /// A token (`nats://token@host`).
    Token(String),
    /// A user and a password.
    UserPassword(String, String),
}

/// A parsed NATS URL.
#[derive(Clone, PartialEq, Eq)]
pub struct NatsUrl {
    /// `tls://`: TLS required.
    pub tls: bool,
    /// Host.
    pub host: String,
    /// Port.
    pub port: u16,
    /// Credentials.
    pub auth: Auth,
}

/// Why a URL is not one walbox can use; it never quotes the URL.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct UrlError(String);

const EXPECTED: &str = "expected nats://[user:password@]host[:port] (or tls:// for TLS)";

impl NatsUrl {
    /// Parses `text`.
    pub fn parse(text: &str) -> Result<NatsUrl, UrlError> {
        let bad = |why: &str| UrlError(why.to_owned());
        let tls = match text.split_once("://").map(|(s, _)| s.to_ascii_lowercase()) {
            Some(s) if s == "nats" => false,
            Some(s) if s == "tls" => true,
            _ => return Err(bad(EXPECTED)),
        };
        let url = ::url::Url::parse(text).map_err(|e| {
            UrlError(match e {
                ::url::ParseError::InvalidPort => "the port is not a number from 1 to 65535".into(),
                ::url::ParseError::EmptyHost => "no host".into(),
                other => format!("{other}; {EXPECTED}"),
            })
        })?;
        if url.query().is_some() || url.fragment().is_some() || !matches!(url.path(), "" | "/") {
            return Err(bad(
                "no path, query or fragment: one server, nats://host:port",
            ));
        }
        let host = match url.host() {
            None | Some(::url::Host::Domain("")) => return Err(bad("no host")),
            Some(::url::Host::Ipv6(ip)) => ip.to_string(),
            Some(h) => h.to_string(),
        };
        let port = match url.port() {
            Some(0) => return Err(bad("the port is not a number from 1 to 65535")),
            Some(p) => p,
            None => 4222,
        };
        let decode = |s: &str, what: &str| {
            sink_core::percent::decode(s)
                .ok_or_else(|| UrlError(format!("bad percent-encoding in the {what}")))
        };
        let auth = match (url.username(), url.password()) {
            ("", None) => Auth::None,
            (token, None) => Auth::Token(decode(token, "token")?),
            (user, Some(password)) => {
                Auth::UserPassword(decode(user, "user")?, decode(password, "password")?)
            }
        };
        Ok(NatsUrl {
            tls,
            host,
            port,
            auth,
        })
    }

    /// The address the client connects to, without credentials.
    pub fn server_addr(&self) -> String {
        let scheme = if self.tls { "tls" } else { "nats" };
        if self.host.contains(':') {
            format!("{scheme}://[{}]:{}", self.host, self.port)
        } else {
            format!("{scheme}://{}:{}", self.host, self.port)
        }
    }
}

impl std::fmt::Display for NatsUrl {
    /// The server address, with the user but no password or token.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let addr = self.server_addr();
        match &self.auth {
            Auth::UserPassword(user, _) => {
                let (scheme, rest) = addr.split_once("://").expect("a scheme");
                write!(f, "{scheme}://{user}@{rest}")
            }
            _ => f.write_str(&addr),
        }
    }
}

impl std::fmt::Debug for NatsUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_nats_urls_and_shows_no_secret() {
        let u = NatsUrl::parse("nats://walbox:s%40cret@nats.internal:4223").unwrap();
        assert_eq!(
            (u.tls, u.host.as_str(), u.port),
            (false, "nats.internal", 4223)
        );
        assert!(u.auth == Auth::UserPassword("walbox".into(), "s@cret".into()));
        assert_eq!(u.to_string(), "nats://walbox@nats.internal:4223");
        assert_eq!(u.server_addr(), "nats://nats.internal:4223");
        let t = NatsUrl::parse("tls://Zq9token@nats").unwrap();
        assert!(t.tls && t.port == 4222 && t.auth == Auth::Token("Zq9token".into()));
        assert_eq!(t.to_string(), "tls://nats:4222");
        assert_eq!(
            NatsUrl::parse("nats://[::1]").unwrap().server_addr(),
            "nats://[::1]:4222"
        );
    }

    #[test]
    fn a_bad_url_is_refused_without_its_secret() {
        for (url, says) in [
            ("http://u:hunter2@h", "expected nats://"),
            ("u:hunter2@h:4222", "expected nats://"),
            ("nats://u:hunter2@h:x", "the port is not a number"),
            ("nats://u:hunter2:h", "the port is not a number"),
            ("nats://u:hunter2@h/x", "no path"),
            ("nats://u:hunter2@h?x=1", "no path"),
            ("nats://u:hunter2@", "no host"),
            (
                "nats://u:hunter2%zz@h",
                "bad percent-encoding in the password",
            ),
            ("nats://hunter2%zz@h", "bad percent-encoding in the token"),
        ] {
            let e = NatsUrl::parse(url).unwrap_err().to_string();
            assert!(e.contains(says), "{url}: {e}");
            assert!(!e.contains("hunter2"), "{e}");
        }
    }
}
