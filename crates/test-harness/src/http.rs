//! A plain HTTP GET, for walbox's `/metrics` and health endpoints.

use std::io::{Read, Write};

/// `GET path` over HTTP/1.1; returns (status, body), or `None` when
/// nothing listens yet.
pub fn get(addr: &str, path: &str) -> Option<(u16, String)> {
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let status = out.split_whitespace().nth(1)?.parse().ok()?;
    Some((
        status,
        out.split_once("\r\n\r\n")
            .map_or(String::new(), |(_, b)| b.to_owned()),
    ))
}
