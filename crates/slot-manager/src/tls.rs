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
    let verifier: Arc<dyn ServerCertVerifier> = match config.ssl_mode() {
        SslMode::Disable => return Ok(None),
        // Encryption without authentication, as libpq does for these modes.
        SslMode::Prefer | SslMode::Require => Arc::new(AcceptAnyCertificate(provider())),
        mode @ (SslMode::VerifyCa | SslMode::VerifyFull) => {
            let path = config
                .ssl_root_cert()
                .ok_or_else(|| Error::Config(format!("sslmode={mode} needs sslrootcert")))?;
            let mut roots = RootCertStore::empty();
            let certs = CertificateDer::pem_file_iter(path)
                .map_err(|e| Error::Tls(format!("read sslrootcert {}: {e}", path.display())))?;
            for cert in certs {
                let cert = cert
                    .map_err(|e| Error::Tls(format!("read sslrootcert {}: {e}", path.display())))?;
                roots
                    .add(cert)
                    .map_err(|e| Error::Tls(format!("sslrootcert {}: {e}", path.display())))?;
            }
            if roots.is_empty() {
                return Err(Error::Tls(format!(
                    "sslrootcert {} holds no certificate",
                    path.display()
                )));
            }
            let webpki = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider())
                .build()
                .map_err(|e| Error::Tls(e.to_string()))?;
            if mode == SslMode::VerifyFull {
                webpki
            } else {
                Arc::new(IgnoreHostname(webpki))
            }
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

/// `verify-ca`: the chain must be valid; the name need not match.
#[derive(Debug)]
struct IgnoreHostname(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for IgnoreHostname {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}
