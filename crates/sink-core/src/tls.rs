//! TLS trust for the brokers walbox reaches over rustls (RabbitMQ, NATS):
//! a CA file's certificates or the system's store, on the ring provider.
//! The provider is named rather than left to rustls' process default,
//! which the other TLS stacks in walbox (the AWS SDK's aws-lc-rs) make
//! ambiguous. No error quotes a file's content, only the setting and the
//! path.

use std::path::Path;
use std::sync::Arc;

use rustls::client::WantsClientCert;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use rustls::{ClientConfig, ConfigBuilder, RootCertStore};

/// The certificates to trust: `ca_file`'s (named by `setting` in errors),
/// else the system's store. `Ok` with an empty store when the system has
/// none: whether that is an error is the caller's (a connection that may
/// stay plain), with the store's first problem.
pub fn roots(
    ca_file: Option<&Path>,
    setting: &str,
) -> Result<(RootCertStore, Option<String>), String> {
    let mut roots = RootCertStore::empty();
    match ca_file {
        Some(path) => {
            for cert in certificates(path, setting)? {
                roots.add(cert).map_err(|e| {
                    format!(
                        "{setting} {}: not a CA certificate rustls can use: {e}",
                        path.display()
                    )
                })?;
            }
            Ok((roots, None))
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            // Like OpenSSL, pass over what cannot be parsed.
            roots.add_parsable_certificates(found.certs);
            Ok((roots, found.errors.first().map(ToString::to_string)))
        }
    }
}

/// A client configuration trusting `roots`, on the ring provider, waiting
/// for its client certificate (or none).
pub fn builder(
    roots: RootCertStore,
) -> Result<ConfigBuilder<ClientConfig, WantsClientCert>, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?
        .with_root_certificates(roots))
}

/// The PEM certificates in `path` (at least one), `setting` naming it.
pub fn certificates(path: &Path, setting: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let unreadable = |e: rustls::pki_types::pem::Error| {
        format!("{setting} {}: {}", path.display(), pem_reason(&e))
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(unreadable)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(unreadable)?;
    if certs.is_empty() {
        return Err(format!(
            "{setting} {}: no PEM certificate in it",
            path.display()
        ));
    }
    Ok(certs)
}

/// A PEM error's reason, without any of the file's bytes.
pub fn pem_reason(e: &rustls::pki_types::pem::Error) -> String {
    use rustls::pki_types::pem::Error;
    match e {
        Error::Io(io) => io.to_string(),
        Error::NoItemsFound => "nothing of that kind in it".into(),
        Error::MissingSectionEnd { .. } | Error::IllegalSectionStart { .. } => {
            "a PEM section is not closed".into()
        }
        Error::Base64Decode(_) => "bad base64 in a PEM section".into(),
        _ => "not PEM".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_ca_file_is_named_without_its_content() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ca.pem");
        std::fs::write(&path, "-----BEGIN CERTIFICATE-----\nc2VjcmV0LWJ5dGVz\n").unwrap();
        let e = roots(Some(&path), "x.ca_file").unwrap_err();
        assert!(e.starts_with("x.ca_file "), "{e}");
        assert!(e.contains("a PEM section is not closed"), "{e}");
        assert!(!e.contains("c2VjcmV0"), "{e}");
        std::fs::write(&path, "nothing here\n").unwrap();
        let e = roots(Some(&path), "x.ca_file").unwrap_err();
        assert!(e.contains("no PEM certificate in it"), "{e}");
        let e = roots(Some(&dir.path().join("missing.pem")), "x.ca_file").unwrap_err();
        assert!(e.contains("missing.pem"), "{e}");
    }
}
