//! A TLS listener in front of a plain TCP service, from Debian's `stunnel4`:
//! with it, the Tansu broker (which serves plain TCP here) becomes a real
//! TLS or mutual-TLS Kafka listener.

use std::process::{Child, Command};
use std::time::Duration;

use crate::tls::Certificates;

/// A running stunnel; killed when dropped.
pub struct Stunnel {
    child: Child,
    port: u16,
    dir: tempfile::TempDir,
}

/// The stunnel binary: `WALBOX_STUNNEL_BIN`, else `stunnel4`, else `stunnel`.
fn binary() -> String {
    if let Some(b) = std::env::var("WALBOX_STUNNEL_BIN")
        .ok()
        .filter(|b| !b.is_empty())
    {
        return b;
    }
    for candidate in ["stunnel4", "stunnel"] {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {candidate}")])
            .output()
            .is_ok_and(|o| o.status.success());
        if found {
            return candidate.to_owned();
        }
    }
    panic!("stunnel not found (apt-get install stunnel4; scripts/test installs it)")
}

impl Stunnel {
    /// Accepts TLS on `port` with the server certificate of `certs` and
    /// forwards to `127.0.0.1:target`. With `client_certificates`, a client
    /// must present a certificate signed by the CA of `certs`.
    pub fn start(
        port: u16,
        target: u16,
        certs: &Certificates,
        client_certificates: bool,
    ) -> Stunnel {
        let dir = tempfile::tempdir().expect("a temp dir");
        let mut conf = format!(
            "foreground = yes\npid =\ndebug = 4\noutput = {log}\n[kafka]\naccept = 127.0.0.1:{port}\nconnect = 127.0.0.1:{target}\ncert = {cert}\nkey = {key}\n",
            log = dir.path().join("stunnel.log").display(),
            cert = certs.server_cert().display(),
            key = certs.server_key().display(),
        );
        if client_certificates {
            conf.push_str(&format!(
                "CAfile = {}\nverifyChain = yes\nrequireCert = yes\n",
                certs.ca().display()
            ));
        }
        let path = dir.path().join("stunnel.conf");
        std::fs::write(&path, conf).expect("write stunnel.conf");
        let child = Command::new(binary())
            .arg(&path)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start stunnel");
        let mut s = Stunnel { child, port, dir };
        s.wait_listening();
        s
    }

    fn wait_listening(&mut self) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "stunnel exited ({status}): {}",
                    std::fs::read_to_string(self.dir.path().join("stunnel.log"))
                        .unwrap_or_default()
                );
            }
            assert!(
                std::time::Instant::now() < deadline,
                "stunnel did not listen on {} within 10 s",
                self.port
            );
            std::thread::sleep(Duration::from_millis(50)); // polling a local port
        }
    }

    /// The TLS port.
    pub fn port(&self) -> u16 {
        self.port
    }
}

impl Drop for Stunnel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
