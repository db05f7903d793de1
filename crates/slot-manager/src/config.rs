//! Connection settings: a libpq-style URL or keyword string, with the full
//! set of `sslmode`s.
//!
//! Parsing is tokio-postgres' own, except for `sslmode`, `sslrootcert`,
//! `sslcert` and `sslkey`: tokio-postgres knows only
//! `disable`/`prefer`/`require` and no certificates, so those are taken out
//! first and handled here.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use tokio_postgres::config::Host;

use crate::error::Error;

/// Idle time before TCP keepalives start, unless `keepalives_idle` says.
pub(crate) const KEEPALIVE_IDLE: std::time::Duration = std::time::Duration::from_secs(30);
/// How long written data may stay unacknowledged, unless `tcp_user_timeout` says.
pub(crate) const TCP_USER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Which of several hosts (`host=a,b`) will do, as libpq's
/// `target_session_attrs`: walbox's slot lives on the primary, so after a
/// failover `read-write` or `primary` finds the new one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TargetSession {
    /// The first host that accepts the connection.
    #[default]
    Any,
    /// A server that accepts writes (not in recovery, not read-only by default).
    ReadWrite,
    /// A server not in recovery.
    Primary,
}

impl FromStr for TargetSession {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        Ok(match s {
            "any" => TargetSession::Any,
            "read-write" => TargetSession::ReadWrite,
            "primary" => TargetSession::Primary,
            other => {
                return Err(Error::Config(format!(
                    "target_session_attrs {other:?}: walbox streams from the primary; use any, read-write or primary"
                )))
            }
        })
    }
}

/// How TLS is negotiated and verified, as in libpq.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SslMode {
    /// Never TLS.
    Disable,
    /// TLS when the server offers it, without verification (libpq's default).
    #[default]
    Prefer,
    /// TLS or fail; the certificate is not verified (unless `sslrootcert` is
    /// set, which makes it `verify-ca`, as libpq does).
    Require,
    /// TLS; the certificate must chain to `sslrootcert`.
    VerifyCa,
    /// TLS; the certificate must chain to `sslrootcert` and name the host.
    VerifyFull,
}

impl FromStr for SslMode {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        Ok(match s {
            "disable" => SslMode::Disable,
            "prefer" | "allow" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            other => {
                return Err(Error::Config(format!(
                "sslmode {other:?} is not one of disable, prefer, require, verify-ca, verify-full"
            )))
            }
        })
    }
}

impl fmt::Display for SslMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        })
    }
}

/// Where and how to connect. `Debug` and [`PgConfig::describe`] never show the password.
#[derive(Clone)]
pub struct PgConfig {
    inner: tokio_postgres::Config,
    ssl_mode: SslMode,
    ssl_root_cert: Option<PathBuf>,
    ssl_client_cert: Option<(PathBuf, PathBuf)>,
    target_session: TargetSession,
}

/// libpq's default client certificate, `~/.postgresql/postgresql.crt` and
/// `.key`, when both exist.
fn default_client_cert(home: Option<String>) -> Option<(PathBuf, PathBuf)> {
    let dir = PathBuf::from(home?).join(".postgresql");
    let (cert, key) = (dir.join("postgresql.crt"), dir.join("postgresql.key"));
    (cert.is_file() && key.is_file()).then_some((cert, key))
}

impl PgConfig {
    /// Parses `postgres://user:password@host:port/db?sslmode=verify-full&sslrootcert=ca.pem`
    /// or `host=… port=… user=… password=… dbname=… sslmode=…`.
    pub fn parse(input: &str) -> Result<PgConfig, Error> {
        PgConfig::parse_with_env(input, |_| None)
    }

    /// [`PgConfig::parse`], with what the string leaves out taken from the
    /// libpq environment as `env` reads it (normally `std::env::var`):
    /// `PGHOST`, `PGPORT`, `PGUSER`, `PGDATABASE`, `PGPASSWORD`,
    /// `PGPASSFILE` (else `~/.pgpass`), `PGSSLMODE`, `PGSSLROOTCERT`,
    /// `PGSSLCERT`, `PGSSLKEY`, `PGAPPNAME`, `PGCONNECT_TIMEOUT`. A value in
    /// the string wins over the environment, as in libpq.
    pub fn parse_with_env(
        input: &str,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<PgConfig, Error> {
        let env = |name: &str| env(name).filter(|v| !v.is_empty());
        let (rest, mut tls) = take_walbox_params(crate::conninfo::parse(input)?);
        tls.mode = tls.mode.or_else(|| env("PGSSLMODE"));
        tls.root = tls.root.or_else(|| env("PGSSLROOTCERT"));
        if tls.cert.is_none() && tls.key.is_none() {
            (tls.cert, tls.key) = (env("PGSSLCERT"), env("PGSSLKEY"));
        }
        let target_session = match tls.session.or_else(|| env("PGTARGETSESSIONATTRS")) {
            Some(t) => t.parse()?,
            None => TargetSession::Any,
        };
        let (ssl_mode, ssl_root_cert) = (tls.mode, tls.root);
        let ssl_client_cert = match (tls.cert, tls.key) {
            (Some(cert), Some(key)) => Some((PathBuf::from(cert), PathBuf::from(key))),
            (None, None) => default_client_cert(env("HOME")),
            _ => {
                return Err(Error::Config(
                    "sslcert and sslkey go together: give both, or neither".into(),
                ))
            }
        };
        // Every keyword and value was checked by conninfo; tokio-postgres'
        // messages never include the password either.
        let mut inner: tokio_postgres::Config = crate::conninfo::keyword_string(&rest)
            .parse()
            .map_err(|e| {
                let cause = std::error::Error::source(&e)
                    .map(|c| format!(": {c}"))
                    .unwrap_or_default();
                Error::Config(format!("{e}{cause}"))
            })?;
        let tls_mode_given = ssl_mode.is_some();
        let mut ssl_mode = match ssl_mode {
            Some(m) => m.parse()?,
            None => SslMode::Prefer,
        };
        if ssl_root_cert.as_deref() == Some("system") {
            // libpq: the system's roots are only worth it with the host name
            // checked; verify-full is the default, anything weaker an error.
            match (tls_mode_given, ssl_mode) {
                (false, _) | (true, SslMode::VerifyFull) => ssl_mode = SslMode::VerifyFull,
                (true, weak) => {
                    return Err(Error::Config(format!(
                        "sslmode={weak} may not be used with sslrootcert=system (use verify-full)"
                    )))
                }
            }
        }
        if ssl_mode == SslMode::Require && ssl_root_cert.is_some() {
            ssl_mode = SslMode::VerifyCa;
        }
        if matches!(ssl_mode, SslMode::VerifyCa | SslMode::VerifyFull) && ssl_root_cert.is_none() {
            return Err(Error::Config(format!(
                "sslmode={ssl_mode} needs sslrootcert=<file with the CA certificate(s) in PEM>"
            )));
        }
        inner.ssl_mode(match ssl_mode {
            SslMode::Disable => tokio_postgres::config::SslMode::Disable,
            SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
            _ => tokio_postgres::config::SslMode::Require,
        });
        if inner.get_hosts().is_empty() {
            match env("PGHOST") {
                Some(hosts) => {
                    for h in hosts.split(',') {
                        inner.host(h.trim());
                    }
                }
                None => {
                    inner.host("localhost");
                }
            }
        }
        if inner.get_ports().is_empty() {
            if let Some(port) = env("PGPORT") {
                let port = port
                    .trim()
                    .parse()
                    .map_err(|_| Error::Config(format!("PGPORT {port:?} is not a port number")))?;
                inner.port(port);
            }
        }
        if inner.get_user().is_none() {
            if let Some(user) = env("PGUSER") {
                inner.user(&user);
            }
        }
        if inner.get_user().is_none() {
            return Err(Error::Config(
                "no user given (user=… or postgres://user@host/db, or PGUSER)".into(),
            ));
        }
        if inner.get_dbname().is_none() {
            if let Some(db) = env("PGDATABASE") {
                inner.dbname(&db);
            }
        }
        if inner.get_connect_timeout().is_none() {
            if let Some(t) = env("PGCONNECT_TIMEOUT") {
                let secs: u64 = t.trim().parse().map_err(|_| {
                    Error::Config(format!(
                        "PGCONNECT_TIMEOUT {t:?} is not a number of seconds"
                    ))
                })?;
                inner.connect_timeout(std::time::Duration::from_secs(secs));
            }
        }
        if inner.get_application_name().is_none() {
            let fallback = tls.fallback_application_name.as_deref().unwrap_or("walbox");
            inner.application_name(env("PGAPPNAME").as_deref().unwrap_or(fallback));
        }
        if inner.get_password().is_none() {
            if let Some(password) = env("PGPASSWORD") {
                inner.password(password);
            } else if let Some(file) = tls
                .passfile
                .clone()
                .or_else(|| env("PGPASSFILE"))
                .map(PathBuf::from)
                .or_else(|| env("HOME").map(|h| PathBuf::from(h).join(".pgpass")))
            {
                let host = match inner.get_hosts().first() {
                    Some(Host::Tcp(h)) => h.clone(),
                    _ => "localhost".to_owned(),
                };
                let user = inner.get_user().unwrap_or_default().to_owned();
                let dbname = inner.get_dbname().unwrap_or(&user).to_owned();
                let target = crate::pgpass::Target {
                    host: &host,
                    port: inner.get_ports().first().copied().unwrap_or(5432),
                    dbname: &dbname,
                    user: &user,
                };
                if let Some(password) = crate::pgpass::lookup(&file, &target) {
                    inner.password(password);
                }
            }
        }
        // A silent network (a firewall dropping packets) must show within
        // seconds, not after the kernel's ~15 minutes of retransmissions:
        // keepalives after 30 s idle (tokio-postgres' default is 2 hours),
        // and unacknowledged writes fail after 30 s. Both connections.
        if inner.get_keepalives_idle() == std::time::Duration::from_secs(2 * 60 * 60) {
            inner.keepalives_idle(KEEPALIVE_IDLE);
        }
        let user_timeout = match tls.user_timeout {
            Some(ms) => std::time::Duration::from_millis(ms.trim().parse().map_err(|_| {
                Error::Config(format!(
                    "tcp_user_timeout {ms:?} is not a number of milliseconds"
                ))
            })?),
            None => TCP_USER_TIMEOUT,
        };
        inner.tcp_user_timeout(user_timeout);
        if target_session != TargetSession::Any {
            // The control connection: tokio-postgres checks transaction_read_only.
            inner.target_session_attrs(tokio_postgres::config::TargetSessionAttrs::ReadWrite);
        }
        Ok(PgConfig {
            inner,
            ssl_mode,
            ssl_root_cert: ssl_root_cert.map(PathBuf::from),
            ssl_client_cert,
            target_session,
        })
    }

    /// The tokio-postgres settings (for ordinary SQL connections).
    pub fn tokio_config(&self) -> &tokio_postgres::Config {
        &self.inner
    }

    /// The TLS mode.
    pub fn ssl_mode(&self) -> SslMode {
        self.ssl_mode
    }

    /// The CA certificate file, for `verify-ca` and `verify-full`; the path
    /// `system` means the operating system's trust store.
    pub fn ssl_root_cert(&self) -> Option<&Path> {
        self.ssl_root_cert.as_deref()
    }

    /// The client certificate and its key (`sslcert`, `sslkey`; by default
    /// `~/.postgresql/postgresql.crt` and `.key` when both exist, as in libpq).
    pub fn ssl_client_cert(&self) -> Option<(&Path, &Path)> {
        self.ssl_client_cert
            .as_ref()
            .map(|(c, k)| (c.as_path(), k.as_path()))
    }

    /// Which host will do when there are several.
    pub fn target_session(&self) -> TargetSession {
        self.target_session
    }

    /// Every host with its port, in order (`host=a,b port=5432` gives both
    /// port 5432; `port=5432,5433` pairs them up).
    pub fn hosts(&self) -> Vec<(Host, u16)> {
        let hosts = self.inner.get_hosts();
        let ports = self.inner.get_ports();
        let hosts: Vec<Host> = if hosts.is_empty() {
            vec![Host::Tcp("localhost".into())]
        } else {
            hosts.to_vec()
        };
        hosts
            .into_iter()
            .enumerate()
            .map(|(i, h)| {
                let port = ports
                    .get(i)
                    .or_else(|| (ports.len() == 1).then(|| &ports[0]))
                    .copied()
                    .unwrap_or(5432);
                (h, port)
            })
            .collect()
    }

    /// The first host and port.
    pub fn host_port(&self) -> (Host, u16) {
        let host = self
            .inner
            .get_hosts()
            .first()
            .cloned()
            .unwrap_or(Host::Tcp("localhost".into()));
        let port = self.inner.get_ports().first().copied().unwrap_or(5432);
        (host, port)
    }

    /// The user name.
    pub fn user(&self) -> &str {
        self.inner.get_user().unwrap_or_default()
    }

    /// The database name (defaults to the user name, as in libpq).
    pub fn dbname(&self) -> &str {
        self.inner.get_dbname().unwrap_or_else(|| self.user())
    }

    /// The password, if any.
    pub fn password(&self) -> Option<&[u8]> {
        self.inner.get_password()
    }

    /// Where this points, without the password: `host=… port=… user=… dbname=… sslmode=…`.
    pub fn describe(&self) -> String {
        let hosts = self.hosts();
        let name = |h: &Host| match h {
            Host::Tcp(h) => h.clone(),
            Host::Unix(p) => p.display().to_string(),
        };
        let host = hosts
            .iter()
            .map(|(h, _)| name(h))
            .collect::<Vec<_>>()
            .join(",");
        let mut ports: Vec<String> = hosts.iter().map(|(_, p)| p.to_string()).collect();
        ports.dedup();
        format!(
            "host={host} port={} user={} dbname={} sslmode={}",
            ports.join(","),
            self.user(),
            self.dbname(),
            self.ssl_mode
        )
    }
}

impl PgConfig {
    /// [`PgConfig::describe`] and every other setting that shapes the
    /// connection, still without the password: the TLS files,
    /// `target_session_attrs`, `application_name`, `channel_binding`,
    /// `connect_timeout` (what `walbox config` shows).
    pub fn describe_fully(&self) -> String {
        let mut out = self.describe();
        let mut add = |k: &str, v: String| out.push_str(&format!(" {k}={v}"));
        if let Some(root) = &self.ssl_root_cert {
            add("sslrootcert", root.display().to_string());
        }
        if let Some((cert, key)) = self.ssl_client_cert() {
            add("sslcert", cert.display().to_string());
            add("sslkey", key.display().to_string());
        }
        add(
            "target_session_attrs",
            match self.target_session {
                TargetSession::Any => "any",
                TargetSession::ReadWrite => "read-write",
                TargetSession::Primary => "primary",
            }
            .to_owned(),
        );
        if let Some(name) = self.inner.get_application_name() {
            add("application_name", name.to_owned());
        }
        add(
            "channel_binding",
            match self.inner.get_channel_binding() {
                tokio_postgres::config::ChannelBinding::Disable => "disable",
                tokio_postgres::config::ChannelBinding::Require => "require",
                _ => "prefer",
            }
            .to_owned(),
        );
        if let Some(t) = self.inner.get_connect_timeout() {
            add("connect_timeout", t.as_secs().to_string());
        }
        out
    }
}

impl FromStr for PgConfig {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        PgConfig::parse(s)
    }
}

impl fmt::Debug for PgConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PgConfig({})", self.describe())
    }
}

/// The connection's keywords without the parameters walbox handles itself,
/// and those parameters.
type SslParams = (Vec<(String, String)>, TlsParams);

/// `sslmode`, `sslrootcert`, `sslcert`, `sslkey` and `target_session_attrs`
/// as given (tokio-postgres knows fewer values of each than libpq).
#[derive(Default)]
struct TlsParams {
    mode: Option<String>,
    root: Option<String>,
    cert: Option<String>,
    key: Option<String>,
    session: Option<String>,
    /// Milliseconds, as in libpq (tokio-postgres reads seconds).
    user_timeout: Option<String>,
    /// `~/.pgpass`'s stand-in.
    passfile: Option<String>,
    /// The application name when neither the string nor `PGAPPNAME` give one.
    fallback_application_name: Option<String>,
}

impl TlsParams {
    /// Takes `key`'s value if the key is one of ours; gives it back
    /// otherwise.
    fn take(&mut self, key: &str, value: String) -> Option<String> {
        let slot = match key {
            "sslmode" => &mut self.mode,
            "sslrootcert" => &mut self.root,
            "sslcert" => &mut self.cert,
            "sslkey" => &mut self.key,
            "target_session_attrs" => &mut self.session,
            "tcp_user_timeout" => &mut self.user_timeout,
            "passfile" => &mut self.passfile,
            "fallback_application_name" => &mut self.fallback_application_name,
            _ => return Some(value),
        };
        *slot = Some(value);
        None
    }
}

/// Takes out of `pairs` what walbox handles itself ([`TlsParams`]) and
/// what tokio-postgres does not know but libpq accepts with no effect here
/// (`gssencmode`, `sslcompression`, `sslsni`, `client_encoding`), turns
/// libpq's spellings into tokio-postgres' (`keepalives_count`,
/// `requiressl`), and keeps the rest for tokio-postgres.
fn take_walbox_params(pairs: Vec<(String, String)>) -> SslParams {
    let mut tls = TlsParams::default();
    let mut rest = Vec::with_capacity(pairs.len());
    for (key, value) in pairs {
        match key.as_str() {
            "gssencmode" | "sslcompression" | "sslsni" | "client_encoding" => {}
            "requiressl" => {
                if value == "1" && tls.mode.is_none() {
                    tls.mode = Some("require".to_owned());
                }
            }
            "keepalives_count" => rest.push(("keepalives_retries".to_owned(), value)),
            _ => {
                if let Some(value) = tls.take(&key, value) {
                    rest.push((key, value));
                }
            }
        }
    }
    (rest, tls)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn describe_fully_names_every_setting_but_the_password() {
        let c = PgConfig::parse(
            "postgres://walbox:s3cret@db:5432/app?sslmode=verify-full&sslrootcert=%2Fca.pem&target_session_attrs=read-write&application_name=pod-a&channel_binding=require&connect_timeout=7",
        )
        .unwrap();
        assert_eq!(
            c.describe_fully(),
            "host=db port=5432 user=walbox dbname=app sslmode=verify-full sslrootcert=/ca.pem target_session_attrs=read-write application_name=pod-a channel_binding=require connect_timeout=7"
        );
    }

    #[test]
    fn parses_urls_with_every_sslmode() {
        let c = PgConfig::parse("postgres://walbox:s3cret@db.example:6543/app?sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem&connect_timeout=5").unwrap();
        assert_eq!(c.ssl_mode(), SslMode::VerifyFull);
        assert_eq!(c.ssl_root_cert(), Some(Path::new("/etc/ca.pem")));
        assert_eq!(
            c.tokio_config().get_connect_timeout(),
            Some(&std::time::Duration::from_secs(5))
        );
        assert_eq!(
            (c.user(), c.dbname(), c.password()),
            ("walbox", "app", Some(&b"s3cret"[..]))
        );
        assert_eq!(
            c.describe(),
            "host=db.example port=6543 user=walbox dbname=app sslmode=verify-full"
        );
        assert!(!format!("{c:?}").contains("s3cret"));
    }

    #[test]
    fn parses_keyword_strings_with_quoting() {
        let c = PgConfig::parse(
            r"host=127.0.0.1 port = 5433 user=walbox password='p a\'ss' dbname=app sslmode=require",
        )
        .unwrap();
        assert_eq!(c.ssl_mode(), SslMode::Require);
        assert_eq!(c.password(), Some(&b"p a'ss"[..]));
        assert_eq!(c.host_port().1, 5433);
        let c =
            PgConfig::parse("host=h user=u sslmode=require sslrootcert='/tmp/my ca.pem'").unwrap();
        assert_eq!(
            c.ssl_mode(),
            SslMode::VerifyCa,
            "require with a root certificate verifies it, as libpq does"
        );
        assert_eq!(c.ssl_root_cert(), Some(Path::new("/tmp/my ca.pem")));
        assert_eq!(
            PgConfig::parse("host=h user=u").unwrap().ssl_mode(),
            SslMode::Prefer
        );
        assert_eq!(PgConfig::parse("host=h user=u").unwrap().dbname(), "u");
    }

    #[test]
    fn fills_what_the_string_leaves_out_from_the_libpq_environment() {
        let dir = tempfile::tempdir().unwrap();
        let pgpass = dir.path().join("pgpass");
        std::fs::write(&pgpass, "db.example:6543:app:walbox:from-file\n").unwrap();
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&pgpass, std::fs::Permissions::from_mode(0o600)).unwrap();
        }
        let pgpass = pgpass.display().to_string();
        let vars = [
            ("PGHOST", "db.example"),
            ("PGPORT", "6543"),
            ("PGUSER", "walbox"),
            ("PGDATABASE", "app"),
            ("PGSSLMODE", "require"),
            ("PGAPPNAME", "walbox-eu"),
            ("PGCONNECT_TIMEOUT", "7"),
            ("PGPASSFILE", pgpass.as_str()),
        ];
        let env = |k: &str| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| (*v).to_owned())
        };
        let c = PgConfig::parse_with_env("", env).unwrap();
        assert_eq!(
            c.describe(),
            "host=db.example port=6543 user=walbox dbname=app sslmode=require"
        );
        assert_eq!(c.password(), Some(&b"from-file"[..]));
        assert_eq!(c.tokio_config().get_application_name(), Some("walbox-eu"));
        assert_eq!(
            c.tokio_config().get_connect_timeout(),
            Some(&std::time::Duration::from_secs(7))
        );
        // The string wins; PGPASSWORD wins over the file.
        let c = PgConfig::parse_with_env("host=other user=u dbname=d sslmode=disable", |k| {
            if k == "PGPASSWORD" {
                Some("from-env".into())
            } else {
                env(k)
            }
        })
        .unwrap();
        assert_eq!(
            c.describe(),
            "host=other port=6543 user=u dbname=d sslmode=disable"
        );
        assert_eq!(c.password(), Some(&b"from-env"[..]));
        let e = PgConfig::parse_with_env("", |k| (k == "PGPORT").then(|| "x".into())).unwrap_err();
        assert!(e.to_string().contains("PGPORT"), "{e}");
    }

    #[test]
    fn a_silent_network_shows_within_a_minute_unless_told_otherwise() {
        let c = PgConfig::parse("host=h user=u").unwrap();
        assert_eq!(c.tokio_config().get_keepalives_idle(), KEEPALIVE_IDLE);
        assert_eq!(
            c.tokio_config().get_tcp_user_timeout(),
            Some(&TCP_USER_TIMEOUT)
        );
        let c =
            PgConfig::parse("host=h user=u keepalives_idle=600 tcp_user_timeout=90000").unwrap();
        assert_eq!(
            c.tokio_config().get_keepalives_idle(),
            std::time::Duration::from_secs(600)
        );
        assert_eq!(
            c.tokio_config().get_tcp_user_timeout(),
            Some(&std::time::Duration::from_secs(90))
        );
    }

    #[test]
    fn takes_client_certificates_from_both_forms() {
        let c =
            PgConfig::parse("host=h user=u sslmode=require sslcert=/c/u.crt sslkey='/c/u key.pem'")
                .unwrap();
        assert_eq!(
            c.ssl_client_cert(),
            Some((Path::new("/c/u.crt"), Path::new("/c/u key.pem")))
        );
        let c = PgConfig::parse(
            "postgres://u@h/db?sslcert=%2Fc%2Fu.crt&sslkey=%2Fc%2Fu.key&sslmode=require",
        )
        .unwrap();
        assert_eq!(
            c.ssl_client_cert(),
            Some((Path::new("/c/u.crt"), Path::new("/c/u.key")))
        );
        let e = PgConfig::parse("host=h user=u sslcert=/c/u.crt").unwrap_err();
        assert!(
            e.to_string().contains("sslcert and sslkey go together"),
            "{e}"
        );
    }

    #[test]
    fn rejects_bad_settings_without_leaking_the_password() {
        let e = PgConfig::parse("host=h user=u password=hunter2 sslmode=maybe").unwrap_err();
        assert!(e.to_string().contains("sslmode \"maybe\""), "{e}");
        let e = PgConfig::parse("host=h user=u sslmode=verify-full").unwrap_err();
        assert!(e.to_string().contains("needs sslrootcert"), "{e}");
        let e = PgConfig::parse("host=h password=hunter2").unwrap_err();
        assert!(e.to_string().contains("no user"), "{e}");
        let e = PgConfig::parse("host=h user=u password=hunter2 bogus=1").unwrap_err();
        assert!(!e.to_string().contains("hunter2"), "{e}");
        let e = PgConfig::parse("postgres://u:hunter2@h:notaport/db").unwrap_err();
        assert!(!e.to_string().contains("hunter2"), "{e}");
    }
}
