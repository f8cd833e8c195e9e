//! Shared test machinery: a scripted stub upstream ([`stub`]), pare running in-process
//! ([`pare`]) and a raw HTTP/1.1 client for header-level checks ([`raw`]).

#![allow(dead_code)]

pub mod pare;
pub mod raw;
pub mod stub;

use std::time::Duration;

/// How long a test waits for an event before failing (never a sleep used as an assertion).
pub const WAIT: Duration = Duration::from_secs(10);

/// An HTTP client for talking to pare: no system proxy, no redirects, no pooling surprises.
pub fn client() -> reqwest::Client {
    ::pare::proxy::install_crypto_provider();
    reqwest::Client::builder()
        .no_proxy()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_secs(30))
        .build()
        .expect("test client")
}

/// Await `future`, failing the test after [`WAIT`].
pub async fn within<F: std::future::Future>(what: &str, future: F) -> F::Output {
    match tokio::time::timeout(WAIT, future).await {
        Ok(output) => output,
        Err(_) => panic!("timed out after {WAIT:?} waiting for {what}"),
    }
}

/// A response body parsed as JSON (reqwest's `json` feature is off in this crate).
pub async fn json(response: reqwest::Response) -> serde_json::Value {
    let bytes = response.bytes().await.expect("response body");
    serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("not json ({e}): {}", String::from_utf8_lossy(&bytes)))
}
