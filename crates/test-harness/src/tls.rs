//! Certificates for TLS tests, made with the `openssl` command: a CA, a
//! server certificate for `localhost`/`127.0.0.1` signed by it, a client
//! certificate (for mutual TLS) whose key is encrypted with a password, and
//! an unrelated CA that trusts neither.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The password of [`Certificates::client_key`].
pub const CLIENT_KEY_PASSWORD: &str = "hunter2-client-key";

/// A directory of PEM files; removed when dropped.
pub struct Certificates {
    dir: tempfile::TempDir,
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| {
            panic!("run openssl (apt-get install openssl; scripts/test installs it): {e}")
        });
    assert!(
        out.status.success(),
        "openssl {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Certificates {
    /// Generates every file (RSA 2048, valid for two days).
    pub fn generate() -> Certificates {
        let dir = tempfile::tempdir().expect("a temp dir");
        let d = dir.path();
        for (name, cn) in [("ca", "walbox test CA"), ("other-ca", "unrelated CA")] {
            openssl(
                d,
                &[
                    "req",
                    "-x509",
                    "-newkey",
                    "rsa:2048",
                    "-nodes",
                    "-days",
                    "2",
                    "-keyout",
                    &format!("{name}.key"),
                    "-out",
                    &format!("{name}.pem"),
                    "-subj",
                    &format!("/CN={cn}"),
                ],
            );
        }
        std::fs::write(
            d.join("server.ext"),
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
        )
        .expect("write server.ext");
        std::fs::write(d.join("client.ext"), "extendedKeyUsage=clientAuth\n")
            .expect("write client.ext");
        for (name, cn) in [("server", "localhost"), ("client", "walbox")] {
            openssl(
                d,
                &[
                    "req",
                    "-newkey",
                    "rsa:2048",
                    "-nodes",
                    "-keyout",
                    &format!("{name}.key"),
                    "-out",
                    &format!("{name}.csr"),
                    "-subj",
                    &format!("/CN={cn}"),
                ],
            );
            openssl(
                d,
                &[
                    "x509",
                    "-req",
                    "-in",
                    &format!("{name}.csr"),
                    "-CA",
                    "ca.pem",
                    "-CAkey",
                    "ca.key",
                    "-CAcreateserial",
                    "-days",
                    "2",
                    "-out",
                    &format!("{name}.pem"),
                    "-extfile",
                    &format!("{name}.ext"),
                ],
            );
        }
        // The client key as users often have it: encrypted (ssl.key.password).
        openssl(
            d,
            &[
                "pkey",
                "-in",
                "client.key",
                "-aes256",
                "-out",
                "client-encrypted.key",
                "-passout",
                &format!("pass:{CLIENT_KEY_PASSWORD}"),
            ],
        );
        // Keys as they are kept: readable by their owner only (walbox, like
        // libpq, refuses a key others can read).
        for key in std::fs::read_dir(d).expect("list the certificates") {
            let key = key.expect("list the certificates").path();
            if key.extension().is_some_and(|e| e == "key") {
                crate::secret_file::owner_only(&key);
            }
        }
        Certificates { dir }
    }

    fn file(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The CA that signed the server and client certificates.
    pub fn ca(&self) -> PathBuf {
        self.file("ca.pem")
    }
    /// A CA that signed nothing here.
    pub fn other_ca(&self) -> PathBuf {
        self.file("other-ca.pem")
    }
    /// The server certificate.
    pub fn server_cert(&self) -> PathBuf {
        self.file("server.pem")
    }
    /// The server key (unencrypted).
    pub fn server_key(&self) -> PathBuf {
        self.file("server.key")
    }
    /// The client certificate.
    pub fn client_cert(&self) -> PathBuf {
        self.file("client.pem")
    }
    /// The client key, encrypted with [`CLIENT_KEY_PASSWORD`].
    pub fn client_key(&self) -> PathBuf {
        self.file("client-encrypted.key")
    }
    /// The client key, unencrypted.
    pub fn client_key_plain(&self) -> PathBuf {
        self.file("client.key")
    }
}
