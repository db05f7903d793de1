//! sink-webhook over https:// against Python's own HTTPS server (ssl and
//! http.server, not walbox's code) with a certificate from a CA the test
//! makes: trusted through `ca_file`, delivered; another CA, or no CA file
//! (the system's roots), refused for good at once in one line, not
//! retried forever.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use sink_core::{Delivered, Deliveries, DeliveryErrorKind, Destination, Record};
use sink_webhook::{Publisher, WebhookConfig};
use walbox_test_harness::tls::Certificates;

const SERVER: &str = r#"
import http.server, ssl, sys
class Hook(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Hook)
context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain(sys.argv[2], sys.argv[3])
server.socket = context.wrap_socket(server.socket, server_side=True)
server.serve_forever()
"#;

struct Endpoint(Child);

impl Drop for Endpoint {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn endpoint(certs: &Certificates) -> (Endpoint, u16) {
    let port = walbox_test_harness::port::free_port();
    let child = Command::new("python3")
        .args(["-c", SERVER, &port.to_string()])
        .arg(certs.server_cert())
        .arg(certs.server_key())
        .stdout(Stdio::null())
        .spawn()
        .expect("python3 (Debian's) for the HTTPS endpoint");
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "the HTTPS endpoint did not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    (Endpoint(child), port)
}

async fn post_one(
    port: u16,
    host: &str,
    ca_file: Option<std::path::PathBuf>,
) -> sink_core::Report<u32> {
    let config = WebhookConfig {
        url: format!("https://{host}:{port}/hook?token=s3cret-token")
            .parse()
            .unwrap(),
        secret: Some("signing".into()),
        ca_file,
        timeout: Duration::from_secs(5),
        concurrency: 4,
        max_in_flight: 10,
        max_in_flight_bytes: 1 << 20,
    };
    let (publisher, mut answers) = Publisher::<u32>::new(config).unwrap();
    let permit = publisher.reserve(16).await;
    let record = Record::new(
        "orders",
        Some(Bytes::from_static(b"k")),
        Some(Bytes::from_static(b"{}")),
        7,
    );
    publisher.send(permit, record).await;
    tokio::time::timeout(Duration::from_secs(15), answers.next())
        .await
        .expect("an answer within 15 s: a TLS failure is not retried")
        .expect("open")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_verifies_the_endpoint_by_the_ca_file_and_stops_on_an_untrusted_one() {
    let certs = Certificates::generate();
    let (_server, port) = endpoint(&certs);

    let ok = post_one(port, "localhost", Some(certs.ca())).await;
    assert_eq!(ok.result, Ok(Delivered::Http { status: 200 }));
    let by_ip = post_one(port, "127.0.0.1", Some(certs.ca())).await;
    assert_eq!(by_ip.result, Ok(Delivered::Http { status: 200 }));

    for ca in [Some(certs.other_ca()), None] {
        let refused = post_one(port, "localhost", ca.clone()).await;
        let e = refused.result.unwrap_err();
        assert_eq!(e.kind, DeliveryErrorKind::Fatal, "{ca:?}: {e}");
        let text = e.to_string();
        assert!(text.contains("not trusted or not for its host"), "{text}");
        assert!(!text.contains("s3cret-token"), "{text}");
        assert_eq!(text.lines().count(), 1, "{text}");
    }
}
