//! Plain HTTP/1.0 requests to the servers the tests start (the relay's probes and metrics,
//! the example service), over a loopback `TcpStream`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// `method` `path` on `addr`, with a JSON `body` if given: the status code and the body;
/// `None` when nothing answers or the answer is not HTTP.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .ok()?;
    let mut head = format!("{method} {path} HTTP/1.0\r\nHost: {addr}\r\n");
    if let Some(body) = body {
        head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).ok()?;
    stream.write_all(body.unwrap_or_default().as_bytes()).ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    if !head.starts_with("HTTP/1.") {
        return None;
    }
    let code = head.split(' ').nth(1)?.parse().ok()?;
    Some((code, body.to_owned()))
}

/// `GET` `path` on `addr`: the status code and the body.
pub fn get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    request(addr, "GET", path, None)
}
