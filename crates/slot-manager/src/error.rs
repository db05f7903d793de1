//! Errors, split by what the caller should do about them.

use std::io;

use fallible_iterator::FallibleIterator;
use pgoutput_decoder::DecodeError;
use postgres_protocol::message::backend::ErrorResponseBody;

/// A failure of a Postgres operation.
///
/// [`Error::is_transient`] is the run loop's retry decision: transient
/// failures (network, server restart or shutdown, too many connections, a
/// slot held by another process) are worth retrying with backoff; the rest
/// (authentication, a missing slot or table, bad configuration) will not go
/// away by themselves and must stop the process with the message.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The connection string or a setting is invalid.
    #[error("invalid connection settings: {0}")]
    Config(String),
    /// TLS could not be set up or the handshake failed.
    #[error("TLS: {0}")]
    Tls(String),
    /// Network I/O failed or the server closed the connection.
    #[error("connection to {target} failed: {source}")]
    Io {
        /// `host:port` without credentials.
        target: String,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// The server ended the replication stream (it is shutting down or the
    /// walsender was terminated); reconnect and resume from the slot.
    #[error("the server ended the replication stream")]
    StreamEnded,
    /// The server answered with an error.
    #[error("server error {code}: {message}{}", detail.as_deref().map(|d| format!(" ({d})")).unwrap_or_default())]
    Server {
        /// The SQLSTATE code, e.g. `28P01`.
        code: String,
        /// The primary message.
        message: String,
        /// Detail, when sent.
        detail: Option<String>,
        /// Hint, when sent.
        hint: Option<String>,
    },
    /// The server broke the protocol (an unexpected message).
    #[error("protocol error: {0}")]
    Protocol(String),
    /// A replication message could not be decoded.
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// An error from the control connection (tokio-postgres).
    #[error("{context}: {source}")]
    Sql {
        /// What was being done.
        context: String,
        /// The error.
        #[source]
        source: tokio_postgres::Error,
    },
    /// The server is not set up for walbox; the message says what to change.
    #[error("{0}")]
    Precondition(String),
    /// The replication slot does not exist.
    #[error("replication slot {slot:?} does not exist: create it with `walbox init-slot`")]
    SlotMissing {
        /// The slot's name.
        slot: String,
    },
    /// The replication slot lost WAL it needed and can no longer stream.
    #[error(
        "replication slot {slot:?} is invalidated (wal_status = lost): the WAL it needed was removed. \
         Events written meanwhile may be missing: set on_slot_invalidated = \"recreate\" to let walbox recreate it and \
         republish from the outbox table, or republish from a time you know with `walbox resync --since TIME`"
    )]
    SlotInvalidated {
        /// The slot's name.
        slot: String,
    },
    /// The server refused replication to this role. Managed services grant
    /// it their own way, so walbox does not guess beforehand: the server
    /// decides, and this says how to grant it.
    #[error(
        "role {user:?} may not use replication: the server says \"{server}\". Grant it with \
         ALTER ROLE {quoted} REPLICATION (self-hosted, Cloud SQL, Azure, Supabase, Crunchy Bridge), or \
         GRANT rds_replication TO {quoted} on AWS RDS and Aurora (docs/operations.md, \"Managed Postgres\")",
        quoted = crate::sql::quote_ident(user)
    )]
    ReplicationRefused {
        /// The role walbox connected as.
        user: String,
        /// The server's message.
        server: String,
    },
    /// Of several hosts, none answered or none was what
    /// `target_session_attrs` asks for (a failover may be under way).
    #[error("no host will do: {0}")]
    NoSuitableHost(String),
    /// Another process is streaming from the slot.
    #[error("replication slot {slot:?} is in use by process {pid}")]
    SlotActive {
        /// The slot's name.
        slot: String,
        /// The backend pid holding it.
        pid: i32,
    },
}

/// The fields of a server error, from either connection.
#[derive(Default)]
struct ServerError {
    code: String,
    message: String,
    detail: Option<String>,
    hint: Option<String>,
}

impl From<ServerError> for Error {
    fn from(s: ServerError) -> Error {
        Error::Server {
            code: s.code,
            message: s.message,
            detail: s.detail,
            hint: s.hint,
        }
    }
}

/// SQLSTATE classes and codes that clear up by themselves.
fn transient_sqlstate(code: &str) -> bool {
    code.starts_with("08") // connection exception
        || code.starts_with("57P") // admin/crash shutdown, cannot connect now
        || code == "53300" // too many connections
        || code == "55006" // object in use: the slot is held by another process
        || code == "40001" // serialization failure
        || code == "40P01" // deadlock
}

impl Error {
    /// True when retrying later may succeed; see [`Error`].
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Io { .. }
            | Error::SlotActive { .. }
            | Error::StreamEnded
            | Error::NoSuitableHost(_) => true,
            Error::Server { code, .. } => transient_sqlstate(code),
            Error::Sql { source, .. } => match source.code() {
                Some(state) => transient_sqlstate(state.code()),
                // No SQLSTATE: the connection itself failed or closed.
                None => {
                    source.is_closed()
                        || std::error::Error::source(source).is_some_and(|s| s.is::<io::Error>())
                }
            },
            _ => false,
        }
    }

    /// The SQLSTATE, when the server sent one.
    pub fn sqlstate(&self) -> Option<&str> {
        match self {
            Error::Server { code, .. } => Some(code),
            Error::Sql { source, .. } => source.code().map(|c| c.code()),
            _ => None,
        }
    }

    /// The server's ErrorResponse on the replication connection.
    pub(crate) fn from_response(body: &ErrorResponseBody) -> Error {
        let mut server = ServerError::default();
        let mut fields = body.fields();
        while let Ok(Some(field)) = fields.next() {
            let value = String::from_utf8_lossy(field.value_bytes()).into_owned();
            match field.type_() {
                b'C' => server.code = value,
                b'M' => server.message = value,
                b'D' => server.detail = Some(value),
                b'H' => server.hint = Some(value),
                _ => {}
            }
        }
        server.into()
    }

    /// A control-connection error: the server's error when it sent one (so
    /// both connections report it alike), else `context` and the cause.
    pub(crate) fn from_db(e: tokio_postgres::Error, context: &str) -> Error {
        match e.as_db_error() {
            Some(db) => ServerError {
                code: db.code().code().to_owned(),
                message: db.message().to_owned(),
                detail: db.detail().map(str::to_owned),
                hint: db.hint().map(str::to_owned),
            }
            .into(),
            None => Error::sql(context)(e),
        }
    }

    /// Turns the server's refusal of replication to `user` (walsender start,
    /// slot creation or use) into a line that says how to grant it; other
    /// errors pass unchanged.
    pub fn explain_replication_refusal(self, user: &str) -> Error {
        let (code, message) = match &self {
            Error::Server { code, message, .. } => (code.as_str(), message.clone()),
            Error::Sql { source, .. } => match source.as_db_error() {
                Some(db) => (db.code().code(), db.message().to_owned()),
                None => return self,
            },
            _ => return self,
        };
        let lower = message.to_lowercase();
        let privilege = matches!(code, "42501" | "28000")
            && (lower.contains("replication role")
                || lower.contains("to start wal sender")
                || lower.contains("to use replication slots")
                || lower.contains("replication attribute"));
        if privilege {
            return Error::ReplicationRefused {
                user: user.to_owned(),
                server: message,
            };
        }
        self
    }

    /// Wraps a tokio-postgres error with what was being done.
    pub fn sql(context: impl Into<String>) -> impl FnOnce(tokio_postgres::Error) -> Error {
        let context = context.into();
        move |source| Error::Sql { context, source }
    }
}

/// Turns the server's answers about a slot into the errors callers act on.
pub(crate) fn classify_slot_error(slot: &str, e: Error) -> Error {
    let Error::Server {
        code,
        message,
        detail,
        ..
    } = &e
    else {
        return e;
    };
    let invalidated =
        |text: &str| text.contains("invalidated") || text.contains("no longer get changes");
    match code.as_str() {
        "42704" => Error::SlotMissing {
            slot: slot.to_owned(),
        },
        "55006" => {
            // "replication slot \"x\" is active for PID 1234"
            let pid = message
                .rsplit(' ')
                .next()
                .and_then(|p| p.parse().ok())
                .unwrap_or(0);
            Error::SlotActive {
                slot: slot.to_owned(),
                pid,
            }
        }
        // "can no longer get changes from replication slot" (PG 13/14), or
        // "cannot read from logical replication slot" with an "invalidated"
        // detail (PG 15+).
        "55000" if invalidated(message) || detail.as_deref().is_some_and(invalidated) => {
            Error::SlotInvalidated {
                slot: slot.to_owned(),
            }
        }
        _ => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(code: &str) -> Error {
        Error::Server {
            code: code.into(),
            message: "m".into(),
            detail: None,
            hint: None,
        }
    }

    #[test]
    fn classifies_server_errors() {
        for code in ["57P01", "57P03", "08006", "53300", "55006"] {
            assert!(server(code).is_transient(), "{code}");
        }
        for code in ["28P01", "28000", "42704", "3D000", "42501", "55000"] {
            assert!(!server(code).is_transient(), "{code}");
        }
        assert!(!Error::SlotMissing { slot: "s".into() }.is_transient());
        let refused = |code: &str, message: &str| {
            Error::Server {
                code: code.into(),
                message: message.into(),
                detail: None,
                hint: None,
            }
            .explain_replication_refusal("relay")
        };
        // Postgres 13-15, 16+, and slot functions.
        for (code, message) in [
            (
                "28000",
                "must be superuser or replication role to start walsender",
            ),
            ("42501", "permission denied to start WAL sender"),
            (
                "42501",
                "must be superuser or replication role to use replication slots",
            ),
            ("42501", "permission denied to use replication slots"),
        ] {
            let e = refused(code, message);
            assert!(matches!(e, Error::ReplicationRefused { .. }), "{message}");
            assert!(!e.is_transient());
            let text = e.to_string();
            assert!(
                text.contains("ALTER ROLE \"relay\" REPLICATION")
                    && text.contains("GRANT rds_replication TO \"relay\""),
                "{text}"
            );
        }
        assert!(matches!(
            refused("28P01", "password authentication failed for user \"relay\""),
            Error::Server { .. }
        ));
        assert!(Error::SlotActive {
            slot: "s".into(),
            pid: 1
        }
        .is_transient());
    }

    #[test]
    fn classifies_slot_errors() {
        let server = |code: &str, message: &str| Error::Server {
            code: code.into(),
            message: message.into(),
            detail: None,
            hint: None,
        };
        assert!(matches!(
            classify_slot_error(
                "s",
                server("42704", "replication slot \"s\" does not exist")
            ),
            Error::SlotMissing { .. }
        ));
        assert!(matches!(
            classify_slot_error(
                "s",
                server("55006", "replication slot \"s\" is active for PID 4242")
            ),
            Error::SlotActive { pid: 4242, .. }
        ));
        assert!(matches!(
            classify_slot_error(
                "s",
                server(
                    "55000",
                    "can no longer get changes from replication slot \"s\""
                )
            ),
            Error::SlotInvalidated { .. }
        ));
        let pg15 = Error::Server {
            code: "55000".into(),
            message: "cannot read from logical replication slot \"s\"".into(),
            detail: Some(
                "This slot has been invalidated because it exceeded the maximum reserved size."
                    .into(),
            ),
            hint: None,
        };
        assert!(matches!(
            classify_slot_error("s", pg15),
            Error::SlotInvalidated { .. }
        ));
    }
}
