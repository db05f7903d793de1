//! TLS for both connections, with libpq's `sslmode` semantics.

use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};

use crate::config::{PgConfig, SslMode};
use crate::error::Error;

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The rustls client configuration for `config`'s `sslmode`, or `None` for
/// `disable`.
pub(crate) fn client_config(config: &PgConfig) -> Result<Option<Arc<ClientConfig>>, Error> {
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Tls(e.to_string()))?;
    let verifier: Arc<dyn ServerCertVerifier> =
        match config.ssl_mode() {
            SslMode::Disable => return Ok(None),
            // Encryption without authentication, as libpq does for these modes.
            SslMode::Prefer | SslMode::Require => Arc::new(AcceptAnyCertificate(provider())),
            mode @ (SslMode::VerifyCa | SslMode::VerifyFull) => {
                let path = config
                    .ssl_root_cert()
                    .ok_or_else(|| Error::Config(format!("sslmode={mode} needs sslrootcert")))?;
                let mut roots = RootCertStore::empty();
                if path == std::path::Path::new("system") {
                    let found = rustls_native_certs::load_native_certs();
                    if found.certs.is_empty() {
                        return Err(Error::Tls(format!(
                        "sslrootcert=system: no trusted certificate found in the system's store{}",
                        found.errors.first().map(|e| format!(" ({e})")).unwrap_or_default()
                    )));
                    }
                    // Like OpenSSL, skip what it cannot parse rather than fail.
                    roots.add_parsable_certificates(found.certs);
                } else {
                    let certs = CertificateDer::pem_file_iter(path).map_err(|e| {
                        Error::Tls(format!("read sslrootcert {}: {e}", path.display()))
                    })?;
                    for cert in certs {
                        let cert = cert.map_err(|e| {
                            Error::Tls(format!("read sslrootcert {}: {e}", path.display()))
                        })?;
                        roots.add(cert).map_err(|e| {
                            Error::Tls(format!("sslrootcert {}: {e}", path.display()))
                        })?;
                    }
                }
                if roots.is_empty() {
                    return Err(Error::Tls(format!(
                        "sslrootcert {} holds no certificate",
                        path.display()
                    )));
                }
                let webpki =
                    WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider())
                        .build()
                        .map_err(|e| Error::Tls(e.to_string()))?;
                Arc::new(ChainVerifier {
                    webpki,
                    names: if mode == SslMode::VerifyFull {
                        NameCheck::CommonNameFallback
                    } else {
                        NameCheck::Ignore
                    },
                })
            }
        };
    let builder = builder
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    let tls = match config.ssl_client_cert() {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => {
            let chain = CertificateDer::pem_file_iter(cert)
                .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                .map_err(|e| Error::Tls(format!("read sslcert {}: {e}", cert.display())))?;
            if chain.is_empty() {
                return Err(Error::Tls(format!(
                    "sslcert {} holds no certificate",
                    cert.display()
                )));
            }
            let private = PrivateKeyDer::from_pem_file(key).map_err(|e| {
                Error::Tls(format!(
                    "read sslkey {} (an unencrypted PEM key: PKCS#8, PKCS#1 or SEC1): {e}",
                    key.display()
                ))
            })?;
            builder.with_client_auth_cert(chain, private).map_err(|e| {
                Error::Tls(format!(
                    "sslcert {} with sslkey {}: {e}",
                    cert.display(),
                    key.display()
                ))
            })?
        }
    };
    Ok(Some(Arc::new(tls)))
}

/// The name to verify the server certificate against (`verify-full`).
pub(crate) fn server_name(host: &str) -> Result<ServerName<'static>, Error> {
    ServerName::try_from(host.to_owned())
        .map_err(|e| Error::Tls(format!("host {host:?} is not a valid TLS server name: {e}")))
}

/// `prefer`/`require`: encrypts, verifies nothing.
#[derive(Debug)]
struct AcceptAnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AcceptAnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// How [`ChainVerifier`] treats a certificate that does not name the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum NameCheck {
    /// `verify-ca`: the chain must be valid; the name need not match.
    Ignore,
    /// `verify-full`: the certificate must name the host in its
    /// subjectAltName or, as libpq allows, when it has none, in the
    /// subject's common name (`*.` wildcards as in libpq); webpki reads only
    /// subjectAltName.
    CommonNameFallback,
}

/// webpki's chain verification, with libpq's treatment of names.
#[derive(Debug)]
struct ChainVerifier {
    webpki: Arc<WebPkiServerVerifier>,
    names: NameCheck,
}

impl ServerCertVerifier for ChainVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self.webpki.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        ) {
            Err(rustls::Error::InvalidCertificate(
                e @ (CertificateError::NotValidForName
                | CertificateError::NotValidForNameContext { .. }),
            )) => {
                let accepted = match self.names {
                    NameCheck::Ignore => true,
                    NameCheck::CommonNameFallback => common_name_names(end_entity, server_name),
                };
                if accepted {
                    Ok(ServerCertVerified::assertion())
                } else {
                    Err(rustls::Error::InvalidCertificate(e))
                }
            }
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.webpki.supported_verify_schemes()
    }
}

/// True when `cert` has no subjectAltName and its common name matches the
/// DNS name `server_name` (exactly, or a `*.` wildcard for one label).
fn common_name_names(cert: &CertificateDer<'_>, server_name: &ServerName<'_>) -> bool {
    use x509_cert::der::Decode;
    const SUBJECT_ALT_NAME: &str = "2.5.29.17";
    const COMMON_NAME: &str = "2.5.4.3";
    let ServerName::DnsName(host) = server_name else {
        return false;
    };
    let host = host.as_ref().to_ascii_lowercase();
    let Ok(cert) = x509_cert::Certificate::from_der(cert.as_ref()) else {
        return false;
    };
    let tbs = &cert.tbs_certificate;
    let has_san = tbs
        .extensions
        .iter()
        .flatten()
        .any(|e| e.extn_id.to_string() == SUBJECT_ALT_NAME);
    if has_san {
        return false;
    }
    tbs.subject
        .0
        .iter()
        .flat_map(|rdn| rdn.0.iter())
        .filter(|atv| atv.oid.to_string() == COMMON_NAME)
        .filter_map(|atv| {
            use x509_cert::der::asn1::{PrintableStringRef, Utf8StringRef};
            atv.value
                .decode_as::<Utf8StringRef<'_>>()
                .map(|s| s.as_str().to_owned())
                .or_else(|_| {
                    atv.value
                        .decode_as::<PrintableStringRef<'_>>()
                        .map(|s| s.as_str().to_owned())
                })
                .ok()
        })
        .any(|cn| {
            let cn = cn.to_ascii_lowercase();
            match cn.strip_prefix("*.") {
                Some(suffix) => host
                    .split_once('.')
                    .is_some_and(|(first, rest)| !first.is_empty() && rest == suffix),
                None => cn == host,
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert(cn: &str, sans: &[&str]) -> CertificateDer<'static> {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params =
            rcgen::CertificateParams::new(sans.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>())
                .unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, cn);
        params.self_signed(&key).unwrap().der().clone()
    }

    fn names(cert: &CertificateDer<'_>, host: &str) -> bool {
        common_name_names(cert, &ServerName::try_from(host.to_owned()).unwrap())
    }

    #[test]
    fn the_common_name_counts_only_without_subject_alt_names() {
        assert!(names(&cert("db.example.com", &[]), "db.example.com"));
        assert!(names(&cert("DB.Example.com", &[]), "db.example.com"));
        assert!(!names(&cert("db.example.com", &[]), "other.example.com"));
        // A wildcard covers one label.
        assert!(names(&cert("*.example.com", &[]), "db.example.com"));
        assert!(!names(&cert("*.example.com", &[]), "a.db.example.com"));
        assert!(!names(&cert("*.example.com", &[]), "example.com"));
        // With subjectAltName present, the common name is not looked at.
        assert!(!names(
            &cert("db.example.com", &["other.example.com"]),
            "db.example.com"
        ));
        // Not for IP addresses.
        assert!(!common_name_names(
            &cert("127.0.0.1", &[]),
            &ServerName::try_from("127.0.0.1").unwrap()
        ));
    }
}
