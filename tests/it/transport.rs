//! The transports pare carries: a WebSocket upgrade (Codex's Responses WebSocket transport, which it
//! tries first with OpenAI's built-in provider) is refused with 426, on which Codex falls back to
//! HTTP at once; the HTTP request that follows is compacted and answered as usual.

use serde_json::{Value, json};

use crate::support::pare::{self as pare_support, config_for};
use crate::support::stub::{Reply, Stub};
use crate::support::{client, raw};

/// The handshake Codex sends for its Responses WebSocket transport (`GET …/v1/responses` with
/// `Upgrade: websocket` and its beta header).
fn codex_handshake(connection: &str) -> String {
    format!(
        "GET /v1/responses HTTP/1.1\nHost: 127.0.0.1\nConnection: {connection}\nUpgrade: websocket\n\
         Sec-WebSocket-Version: 13\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\n\
         OpenAI-Beta: responses_websockets=2026-02-06\nAuthorization: Bearer sk-test"
    )
}

/// Regression: the upgrade passed through as a plain `GET …/v1/responses` (the hop-by-hop
/// `Upgrade` removed); the upstream's 404 or 405 made Codex retry the handshake five times with
/// backoff (≈ 6 s) and print "Falling back from WebSockets to HTTPS transport".
#[tokio::test]
async fn a_websocket_upgrade_gets_426_and_never_reaches_the_upstream() {
    let stub = Stub::start(|_| Reply::json(200, json!({"object": "response", "output": []}))).await;
    let pare = pare_support::start(config_for(&stub)).await;
    for connection in ["Upgrade, close", "keep-alive, Upgrade, close"] {
        let response = raw::exchange(pare.addr, &codex_handshake(connection), b"").await;
        assert_eq!(response.status, 426, "{connection}");
        assert_eq!(response.header("upgrade"), None, "no switch offered");
        let body: Value = serde_json::from_slice(&response.body).unwrap();
        assert_eq!(body["error"]["code"], "websocket_not_supported");
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert!(body["error"]["message"].as_str().unwrap().contains("/v1/responses"), "{body}");
    }
    assert!(stub.requests().is_empty(), "the handshake is answered by pare");

    // What Codex sends next goes through as always.
    let request = r#"{"model":"stub-model","input":[{"type":"message","role":"user","content":"hi"}],"stream":false}"#;
    let response = client()
        .post(pare.url("/v1/responses"))
        .header("content-type", "application/json")
        .body(request)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(stub.single().path_only(), "/v1/responses");
}

/// A plain `GET …/v1/responses/{id}` (no upgrade) still passes through.
#[tokio::test]
async fn a_get_without_an_upgrade_passes_through() {
    let stub = Stub::start(Stub::openai).await;
    let pare = pare_support::start(config_for(&stub)).await;
    let response = client().get(pare.url("/v1/responses/resp_1")).send().await.unwrap();
    assert_ne!(response.status(), 426);
    assert_eq!(stub.single().path_only(), "/v1/responses/resp_1");
}
