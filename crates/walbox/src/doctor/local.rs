//! walbox's own side: the metrics port free, and the certificates it is
//! given (Postgres' `sslrootcert` and `sslcert`, Kafka's `ssl.ca.location`
//! and `ssl.certificate.location`) valid for more than [`EXPIRY_WARNING_DAYS`].

use std::net::SocketAddr;
use std::path::Path;

use super::Finding;

/// A certificate that expires within this many days is a warning.
pub const EXPIRY_WARNING_DAYS: i64 = 30;

/// Whether walbox could serve metrics on `addr`: bound and released.
pub fn metrics_port(addr: Option<SocketAddr>) -> Finding {
    let check = "walbox.metrics_addr";
    let Some(addr) = addr else {
        return Finding::info(
            check,
            "metrics_addr is not set: no /metrics, /healthz or /readyz",
        );
    };
    match std::net::TcpListener::bind(addr) {
        Ok(_) => Finding::pass(check, format!("{addr} is free")),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => Finding::fail(
            check,
            format!("{addr} is in use (another walbox on this host, or another server): walbox run would stop at start"),
            "set metrics_addr to a free port",
        ),
        Err(e) => Finding::fail(
            check,
            format!("cannot bind {addr}: {e}"),
            "set metrics_addr to an address of this host",
        ),
    }
}

/// Every certificate in the PEM file at `path`, by when it expires;
/// `what` names the setting.
pub fn certificates(what: &str, path: &Path, now_unix: i64) -> Vec<Finding> {
    let check = "walbox.certificates";
    let data = match std::fs::read(path) {
        Ok(d) => d,
        Err(e) => {
            return vec![Finding::fail(
                check,
                format!("{what} {}: cannot read it: {e}", path.display()),
                format!("point {what} at a readable PEM file"),
            )]
        }
    };
    let mut out = Vec::new();
    let mut seen = 0;
    for pem in x509_parser::pem::Pem::iter_from_buffer(&data) {
        let Ok(pem) = pem else {
            break;
        };
        if pem.label != "CERTIFICATE" {
            continue;
        }
        seen += 1;
        let cert = match pem.parse_x509() {
            Ok(c) => c,
            Err(e) => {
                out.push(Finding::fail(
                    check,
                    format!(
                        "{what} {}: certificate {seen} is not valid X.509: {e}",
                        path.display()
                    ),
                    format!("point {what} at PEM certificates"),
                ));
                continue;
            }
        };
        let subject = cert.subject().to_string();
        let not_after = cert.validity().not_after;
        let days = (not_after.timestamp() - now_unix).div_euclid(86_400);
        let when = not_after
            .to_rfc2822()
            .unwrap_or_else(|_| not_after.to_string());
        let saw = format!("{what} {}: {subject}", path.display());
        out.push(match days {
            d if d < 0 => Finding::fail(
                check,
                format!("{saw} expired on {when}"),
                "renew the certificate",
            ),
            d if d < EXPIRY_WARNING_DAYS => Finding::warn(
                check,
                format!("{saw} expires in {d} days ({when})"),
                "renew the certificate",
            ),
            d => Finding::pass(check, format!("{saw} expires in {d} days")),
        });
    }
    if seen == 0 && out.is_empty() {
        out.push(Finding::fail(
            check,
            format!("{what} {}: no PEM certificate in it", path.display()),
            format!("point {what} at a file of PEM certificates (-----BEGIN CERTIFICATE-----)"),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::Verdict;
    use super::*;

    #[test]
    fn a_port_in_use_fails_and_a_free_one_passes() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        assert_eq!(metrics_port(Some(addr)).verdict, Verdict::Fail);
        drop(taken);
        assert_eq!(metrics_port(Some(addr)).verdict, Verdict::Pass);
        assert_eq!(metrics_port(None).verdict, Verdict::Info);
    }

    #[test]
    fn certificates_are_judged_by_their_expiry() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ca.pem");
        let mut params = rcgen::CertificateParams::new(vec!["db".into()]).unwrap();
        params.not_after = rcgen::date_time_ymd(2030, 1, 1);
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        std::fs::write(&path, cert.pem()).unwrap();
        let expiry = 1_893_456_000; // 2030-01-01T00:00:00Z
        let at = |days_before: i64| {
            certificates("sslrootcert", &path, expiry - days_before * 86_400)[0].verdict
        };
        assert_eq!(at(400), Verdict::Pass);
        assert_eq!(at(10), Verdict::Warn);
        assert_eq!(at(-1), Verdict::Fail);
        std::fs::write(&path, "not a certificate").unwrap();
        assert_eq!(at(400), Verdict::Fail);
        let missing = certificates("sslrootcert", &dir.path().join("nope.pem"), 0);
        assert_eq!(missing[0].verdict, Verdict::Fail);
    }
}
