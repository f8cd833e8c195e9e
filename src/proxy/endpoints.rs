//! pare's own endpoints under `/_pare/` (never forwarded upstream): `GET /_pare/health`.

use bytes::Bytes;
use http::request::Parts;
use http::{Method, Response, StatusCode};

use super::error::{ProxyError, json_response};
use super::handler::Proxy;

pub async fn handle(proxy: &Proxy, parts: &Parts) -> Response<Bytes> {
    match (&parts.method, parts.uri.path()) {
        (&Method::GET | &Method::HEAD, "/_pare/health") => health(proxy).await,
        _ => ProxyError::NotFound { path: parts.uri.path().to_owned() }.to_response(),
    }
}

async fn health(proxy: &Proxy) -> Response<Bytes> {
    let body = serde_json::json!({
        "status": "ok",
        "version": env!("CARGO_PKG_VERSION"),
        "upstream": { "url": proxy.upstream.base.display() },
    });
    json_response(StatusCode::OK, &body)
}
