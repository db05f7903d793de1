//! SCRAM channel binding (`tls-server-end-point`, RFC 5929): the hash of the
//! server's certificate, with the hash function of the certificate's
//! signature algorithm (MD5 and SHA-1 upgraded to SHA-256). A certificate
//! whose signature names no such hash (Ed25519, RSASSA-PSS) gives none, and
//! the connection then cannot bind, as with libpq.

use sha2::{Digest, Sha256, Sha384, Sha512};
use x509_cert::der::Decode;

/// The binding data for the server certificate `der`, if it can have one.
pub(crate) fn server_end_point(der: &[u8]) -> Option<Vec<u8>> {
    let cert = x509_cert::Certificate::from_der(der).ok()?;
    let oid = cert.signature_algorithm.oid.to_string();
    let digest = match oid.as_str() {
        // md5WithRSA, sha1WithRSA, sha256WithRSA, ecdsa-with-SHA1/SHA256.
        "1.2.840.113549.1.1.4"
        | "1.2.840.113549.1.1.5"
        | "1.2.840.113549.1.1.11"
        | "1.2.840.10045.4.1"
        | "1.2.840.10045.4.3.2" => Sha256::digest(der).to_vec(),
        // sha384WithRSA, ecdsa-with-SHA384.
        "1.2.840.113549.1.1.12" | "1.2.840.10045.4.3.3" => Sha384::digest(der).to_vec(),
        // sha512WithRSA, ecdsa-with-SHA512.
        "1.2.840.113549.1.1.13" | "1.2.840.10045.4.3.4" => Sha512::digest(der).to_vec(),
        _ => return None,
    };
    Some(digest)
}
