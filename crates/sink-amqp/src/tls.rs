//! TLS for `amqps://`: rustls with the ring provider (as for Postgres), the
//! system's trusted roots or a CA file, the server's name verified, and a
//! client certificate when the broker asks for one (mutual TLS).
//!
//! The files are read at each connection, not once: a certificate renewed
//! on disk (cert-manager, Vault) is the one the next reconnect presents.
//! No error quotes a file's content, only its path.

use std::path::PathBuf;
use std::sync::Arc;

use amqprs::tls::TlsAdaptor;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore};

/// Where the TLS material is, for `amqps://`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// PEM certificates to trust instead of the system's.
    pub ca_file: Option<PathBuf>,
    /// The client's PEM certificate chain (with `key_file`).
    pub cert_file: Option<PathBuf>,
    /// The client's PEM private key, unencrypted (with `cert_file`).
    pub key_file: Option<PathBuf>,
    /// The name the server's certificate must be for, when it is not the
    /// URL's host (a broker reached through an address its certificate
    /// does not name).
    pub server_name: Option<String>,
}

/// Why TLS cannot be set up: a file that is missing or not what it should
/// be. Names the path, never the content.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct TlsError(String);

impl TlsFiles {
    /// Reads the files into a client configuration: what `walbox config`
    /// checks up front and each connection does again.
    pub fn client_config(&self) -> Result<ClientConfig, TlsError> {
        let builder = sink_core::tls::builder(self.roots()?).map_err(TlsError)?;
        match (&self.cert_file, &self.key_file) {
            (None, None) => Ok(builder.with_no_client_auth()),
            (Some(cert), Some(key)) => {
                let chain =
                    sink_core::tls::certificates(cert, "rabbitmq.cert_file").map_err(TlsError)?;
                let key = PrivateKeyDer::from_pem_file(key).map_err(|e| {
                    TlsError(format!(
                        "rabbitmq.key_file {}: no unencrypted private key in PEM (PKCS#8, PKCS#1 or SEC1; an encrypted key must be decrypted first, e.g. openssl pkey -in key.pem -out plain.pem): {}",
                        key.display(),
                        sink_core::tls::pem_reason(&e)
                    ))
                })?;
                builder.with_client_auth_cert(chain, key).map_err(|e| {
                    TlsError(format!(
                        "rabbitmq.cert_file and rabbitmq.key_file do not make a client certificate: {e}"
                    ))
                })
            }
            (Some(_), None) => Err(TlsError(
                "rabbitmq.cert_file needs rabbitmq.key_file (the client certificate's private key)"
                    .into(),
            )),
            (None, Some(_)) => Err(TlsError(
                "rabbitmq.key_file needs rabbitmq.cert_file (the client certificate)".into(),
            )),
        }
    }

    /// The name verified against the server's certificate.
    pub fn server_name<'a>(&'a self, host: &'a str) -> Result<&'a str, TlsError> {
        let name = self.server_name.as_deref().unwrap_or(host);
        ServerName::try_from(name).map_err(|_| {
            TlsError(match &self.server_name {
                Some(_) => "rabbitmq.server_name: not a DNS name or an IP address".into(),
                None => "the URL's host is not a DNS name or an IP address".into(),
            })
        })?;
        Ok(name)
    }

    /// What amqprs opens a TLS connection with.
    pub(crate) fn adaptor(&self, host: &str) -> Result<TlsAdaptor, TlsError> {
        let config = self.client_config()?;
        let name = self.server_name(host)?.to_owned();
        Ok(TlsAdaptor::new(
            tokio_rustls::TlsConnector::from(Arc::new(config)),
            name,
        ))
    }

    fn roots(&self) -> Result<RootCertStore, TlsError> {
        let (roots, problem) =
            sink_core::tls::roots(self.ca_file.as_deref(), "rabbitmq.ca_file").map_err(TlsError)?;
        if roots.is_empty() {
            return Err(TlsError(format!(
                "amqps://: no trusted certificate in the system's store{}; install the ca-certificates package or set rabbitmq.ca_file",
                problem.map(|p| format!(" ({p})")).unwrap_or_default()
            )));
        }
        Ok(roots)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &tempfile::TempDir, name: &str, text: &str) -> PathBuf {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn bad_files_are_named_without_their_content() {
        let dir = tempfile::tempdir().unwrap();
        let garbage = write(&dir, "garbage.pem", "Zq9secret not pem\n");
        let broken = write(
            &dir,
            "broken.pem",
            "-----BEGIN PRIVATE KEY-----\nZq9secret!!\n-----END PRIVATE KEY-----\n",
        );
        let missing = dir.path().join("missing.pem");
        let cases = [
            (
                TlsFiles {
                    ca_file: Some(missing.clone()),
                    ..TlsFiles::default()
                },
                "rabbitmq.ca_file",
            ),
            (
                TlsFiles {
                    ca_file: Some(garbage.clone()),
                    ..TlsFiles::default()
                },
                "no PEM certificate",
            ),
            (
                TlsFiles {
                    cert_file: Some(garbage.clone()),
                    ..TlsFiles::default()
                },
                "needs rabbitmq.key_file",
            ),
            (
                TlsFiles {
                    key_file: Some(garbage.clone()),
                    ..TlsFiles::default()
                },
                "needs rabbitmq.cert_file",
            ),
            (
                TlsFiles {
                    cert_file: Some(garbage.clone()),
                    key_file: Some(broken.clone()),
                    ..TlsFiles::default()
                },
                "rabbitmq.cert_file",
            ),
        ];
        for (files, says) in cases {
            let e = files.client_config().unwrap_err();
            assert!(e.to_string().contains(says), "{files:?}: {e}");
            assert!(!e.to_string().contains("Zq9secret"), "{e}");
        }
    }

    #[test]
    fn the_verified_name_is_the_hosts_unless_one_is_set() {
        let plain = TlsFiles::default();
        assert_eq!(plain.server_name("rabbit.internal"), Ok("rabbit.internal"));
        assert_eq!(plain.server_name("10.0.0.7"), Ok("10.0.0.7"));
        let named = TlsFiles {
            server_name: Some("rabbit.example".into()),
            ..TlsFiles::default()
        };
        assert_eq!(named.server_name("10.0.0.7"), Ok("rabbit.example"));
        let bad = TlsFiles {
            server_name: Some("not a name".into()),
            ..TlsFiles::default()
        };
        let e = bad.server_name("h").unwrap_err().to_string();
        assert!(e.contains("rabbitmq.server_name"), "{e}");
    }
}
