//! A TCP proxy that can be told to black-hole its connections: bytes stop
//! flowing in both directions but no connection is closed, as when a
//! firewall starts dropping packets or a network partitions. The faults a
//! closed socket cannot show (hangs, missed timeouts) show here.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A running proxy; dropped, it stops accepting (open connections end when
/// the runtime does).
pub struct Proxy {
    port: u16,
    blackholed: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Listens on a free port and forwards every connection to `target`.
    pub async fn start(target: String) -> Proxy {
        Self::start_on(0, target).await
    }

    /// Listens on `port` (0: any) and forwards every connection to `target`.
    pub async fn start_on(port: u16, target: String) -> Proxy {
        let listener = TcpListener::bind(("127.0.0.1", port))
            .await
            .expect("bind the proxy");
        let port = listener.local_addr().expect("an address").port();
        let blackholed = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&blackholed);
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let flag = Arc::clone(&flag);
                let target = target.clone();
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(&target).await else {
                        return;
                    };
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::join!(
                        pipe(cr, sw, Arc::clone(&flag)),
                        pipe(sr, cw, Arc::clone(&flag))
                    );
                });
            }
        });
        Proxy {
            port,
            blackholed,
            task,
        }
    }

    /// The port clients connect to.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Stops (true) or resumes (false) forwarding, on every connection.
    pub fn blackhole(&self, on: bool) {
        self.blackholed.store(on, Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    blackholed: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // While black-holed nothing is read, so nothing is acknowledged
        // beyond the socket buffers: the peer's writes stall, as on a dead link.
        while blackholed.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        while blackholed.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
