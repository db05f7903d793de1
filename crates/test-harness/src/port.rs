//! Free local ports for servers the tests start (Postgres,
//! Apache Kafka, Prometheus).
//!
//! A port found free by binding port 0 lies in the kernel's ephemeral range,
//! the one it also gives every outgoing connection a local port from. Between
//! the test choosing it and the server binding it, any connection on the
//! machine (the suite runs many at once) can take it, and the server then
//! fails with "Address already in use". Ports chosen below the ephemeral range
//! are never handed out that way: only another test choosing the same one
//! could collide, and the bind check below makes that rare.
//!
//! A server that can bind port 0 itself and report the port (walbox's
//! metrics endpoint does) needs none of this.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::net::TcpListener;

/// Where chosen ports come from when the ephemeral range leaves no room
/// below it: Linux's default ephemeral range starts at 32768.
const LOWEST: u16 = 10_000;

/// A TCP port on 127.0.0.1 that nothing listens on now, outside the
/// kernel's ephemeral range when there is room for it.
pub fn free_port() -> u16 {
    let below = ephemeral_start().unwrap_or(32_768);
    if below > LOWEST + 1_000 {
        for _ in 0..200 {
            let port = LOWEST + (random() % u64::from(below - LOWEST)) as u16;
            if TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return port;
            }
        }
    }
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free local port")
}

/// The first port of `/proc/sys/net/ipv4/ip_local_port_range`.
fn ephemeral_start() -> Option<u16> {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// A random number from the standard library's per-process hash keys and
/// the clock (no test needs to replay a port).
fn random() -> u64 {
    let mut h = RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    h.finish()
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_chosen_port_can_be_bound_and_lies_below_the_ephemeral_range() {
        let port = super::free_port();
        std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
        if let Some(start) = super::ephemeral_start() {
            if start > super::LOWEST + 1_000 {
                assert!((super::LOWEST..start).contains(&port), "{port}");
            }
        }
    }
}
