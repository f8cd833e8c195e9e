//! A raw HTTP/1.1 exchange over TCP, for checks a normal client would tidy up (hop-by-hop headers,
//! `Host`, `Connection`).

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A response read off the wire.
#[derive(Debug)]
pub struct RawResponse {
    pub status: u16,
    /// Header lines as `(lowercase name, value)`.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl RawResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }
}

/// Send `head` (request line and headers, without the blank line) and `body`, then read until the
/// server closes the connection (send `Connection: close`).
pub async fn exchange(addr: SocketAddr, head: &str, body: &[u8]) -> RawResponse {
    super::within("a raw exchange", async {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        let mut request = head.replace('\n', "\r\n").trim_end().to_owned().into_bytes();
        request.extend_from_slice(b"\r\n\r\n");
        request.extend_from_slice(body);
        stream.write_all(&request).await.expect("write");
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await.expect("read");
        parse(&response)
    })
    .await
}

fn parse(bytes: &[u8]) -> RawResponse {
    let split = bytes.windows(4).position(|w| w == b"\r\n\r\n").expect("response head");
    let head = std::str::from_utf8(&bytes[..split]).expect("utf-8 head");
    let mut lines = head.split("\r\n");
    let status = lines.next().unwrap().split(' ').nth(1).unwrap().parse().unwrap();
    let headers = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    RawResponse { status, headers, body: bytes[split + 4..].to_vec() }
}
