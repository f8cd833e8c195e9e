//! The proxy core against a stub upstream: pass-through, streaming, header rules, limits, errors,
//! fail-open, cancellation and graceful shutdown.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use pare::pipeline::{CompactInput, CompactOutput, CompactionSummary, ConversationCompactor};
use serde_json::json;
use tokio::sync::Notify;

use crate::support::pare::{self as pare_support, config_for};
use crate::support::stub::{self, PROBES, Recorded, Reply, Step, Stub};
use crate::support::{client, json as json_body, raw, within};

const CHAT_BODY: &str = r#"{"model":"stub-model","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi"}],"temperature":0.2,"x_unknown":{"kept":[1,2,3]}}"#;

fn stream_body() -> String {
    r#"{"model":"stub-model","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hi"}]}"#.to_owned()
}

async fn pare_for(stub: &Stub) -> pare_support::Pare {
    pare_support::start(config_for(stub)).await
}

#[tokio::test]
async fn models_are_passed_through_unchanged() {
    let stub = Stub::start(Stub::openai).await;
    let pare = pare_for(&stub).await;
    let direct = client().get(format!("{}/v1/models", stub.url())).send().await.unwrap().bytes().await.unwrap();
    let response = client().get(pare.url("/v1/models")).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "application/json");
    assert_eq!(response.bytes().await.unwrap(), direct);
    let requests = stub.requests();
    assert_eq!(requests.len(), 2);
    assert_eq!((requests[1].method.as_str(), requests[1].path.as_str()), ("GET", "/v1/models"));
    assert!(requests[1].body.is_empty());
    assert_eq!(requests[1].header("content-length"), None, "a GET without a body must not gain one");
}

#[tokio::test]
async fn non_stream_chat_round_trips_byte_for_byte() {
    let stub = Stub::start(Stub::openai).await;
    let pare = pare_for(&stub).await;
    let response = client()
        .post(pare.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(CHAT_BODY)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    // The identity pipeline reports a summary: pare's headers appear on chat responses.
    assert_eq!(response.headers()["x-pare-tokens-raw"], "0");
    assert!(response.headers().contains_key("x-pare-epoch"));
    let body = json_body(response).await;
    assert_eq!(body, stub::completion("stub-model", stub::ANSWER));
    let seen = stub.single();
    assert_eq!(seen.path, "/v1/chat/completions");
    assert_eq!(seen.body, CHAT_BODY.as_bytes());
    assert_eq!(seen.header("content-length"), Some(CHAT_BODY.len().to_string().as_str()));
}

#[tokio::test]
async fn streamed_chat_arrives_as_the_upstream_sent_it() {
    let stub = Stub::start(Stub::openai).await;
    let pare = pare_for(&stub).await;
    let response = client().post(pare.url("/v1/chat/completions")).body(stream_body()).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let text = response.text().await.unwrap();
    let expected: Vec<u8> = stub::stream_steps("stub-model", stub::ANSWER, true)
        .into_iter()
        .flat_map(|step| match step {
            Step::Send(bytes) => bytes.to_vec(),
            _ => Vec::new(),
        })
        .collect();
    assert_eq!(text.as_bytes(), expected.as_slice());
    assert!(text.ends_with("data: [DONE]\n\n"));
}

#[tokio::test]
async fn unknown_paths_and_probes_pass_through_to_the_upstream_root() {
    let stub = Stub::start(Stub::openai).await;
    // Configured with a trailing /v1: root paths must still reach the upstream's root.
    let pare = pare_for(&stub).await;
    for path in PROBES.iter().chain(&["/v1/embeddings", "/some/unknown/path"]) {
        let response = client().get(pare.url(path)).send().await.unwrap();
        assert_eq!(response.status(), 404, "{path}");
        let body = json_body(response).await;
        assert_eq!(body["error"]["message"], format!("no route for {path}"), "answered by the stub, not pare");
    }
    let paths: Vec<String> = stub.requests().into_iter().map(|r| r.path).collect();
    assert_eq!(
        paths,
        ["/api/v1/models", "/api/tags", "/v1/props", "/props", "/version", "/v1/embeddings", "/some/unknown/path"]
    );
}

#[tokio::test]
async fn upstream_without_v1_maps_paths_the_same_way() {
    let stub = Stub::start(Stub::openai).await;
    let mut config = config_for(&stub);
    config.upstream.url = stub.url();
    let pare = pare_support::start(config).await;
    assert_eq!(client().get(pare.url("/v1/models")).send().await.unwrap().status(), 200);
    client().get(pare.url("/props")).send().await.unwrap();
    let paths: Vec<String> = stub.requests().into_iter().map(|r| r.path).collect();
    assert_eq!(paths, ["/v1/models", "/props"]);
}

#[tokio::test]
async fn query_strings_are_forwarded_verbatim() {
    let stub = Stub::start(Stub::openai).await;
    let pare = pare_for(&stub).await;
    let query = "/v1/models?a=1&b=two%20words&empty=&flag";
    client().get(pare.url(query)).send().await.unwrap();
    assert_eq!(stub.single().path, query);
}

#[tokio::test]
async fn hop_by_hop_headers_are_dropped_and_host_rewritten() {
    let stub = Stub::start(Stub::openai).await;
    let pare = pare_for(&stub).await;
    let head = "GET /v1/models HTTP/1.1
Host: localhost:8787
Connection: close, x-hop-listed
X-Hop-Listed: secret-per-connection
Keep-Alive: timeout=5
TE: trailers
Proxy-Authorization: Basic cHJveHk6cHc=
Proxy-Connection: keep-alive
Authorization: Bearer agent-key
X-Custom: kept";
    let response = raw::exchange(pare.addr, head, b"").await;
    assert_eq!(response.status, 200);
    let seen = stub.single();
    for name in ["x-hop-listed", "keep-alive", "te", "proxy-authorization", "proxy-connection", "upgrade", "trailer"] {
        assert_eq!(seen.header(name), None, "{name} reached the upstream");
    }
    assert_ne!(seen.header("connection"), Some("close, x-hop-listed"));
    assert_eq!(seen.header("host"), Some(stub.addr.to_string().as_str()));
    assert_eq!(seen.header("authorization"), Some("Bearer agent-key"));
    assert_eq!(seen.header("x-custom"), Some("kept"));
}

#[tokio::test]
async fn hop_by_hop_response_headers_are_dropped() {
    let stub = Stub::start(|_: &Recorded| Reply::Full {
        status: 200,
        headers: vec![
            ("connection".into(), "x-upstream-hop".into()),
            ("x-upstream-hop".into(), "1".into()),
            ("keep-alive".into(), "timeout=5".into()),
            ("x-request-id".into(), "req-42".into()),
        ],
        body: Bytes::from_static(b"ok"),
    })
    .await;
    let pare = pare_for(&stub).await;
    let response = client().get(pare.url("/v1/anything")).send().await.unwrap();
    assert_eq!(response.headers()["x-request-id"], "req-42");
    assert!(!response.headers().contains_key("x-upstream-hop"));
    assert!(!response.headers().contains_key("keep-alive"));
    assert_eq!(response.text().await.unwrap(), "ok");
}

#[tokio::test]
async fn api_key_replaces_the_agents_authorization_and_pare_token_stays_local() {
    let stub = Stub::start(Stub::openai).await;
    let mut config = config_for(&stub);
    config.upstream.api_key = Some("sk-real".into());
    let pare = pare_support::start(config).await;
    client()
        .get(pare.url("/v1/models"))
        .header("authorization", "Bearer dummy")
        .header("x-pare-token", "local-secret")
        .send()
        .await
        .unwrap();
    let seen = stub.single();
    assert_eq!(seen.header("authorization"), Some("Bearer sk-real"));
    assert_eq!(seen.header("x-pare-token"), None);
}

#[tokio::test]
async fn upstream_errors_pass_through_unchanged() {
    let stub = Stub::start(|_: &Recorded| {
        let mut reply = Reply::error(429, "slow down");
        if let Reply::Full { headers, .. } = &mut reply {
            headers.push(("retry-after".into(), "7".into()));
        }
        reply
    })
    .await;
    let pare = pare_for(&stub).await;
    let response = client().post(pare.url("/v1/chat/completions")).body(CHAT_BODY).send().await.unwrap();
    assert_eq!(response.status(), 429);
    assert_eq!(response.headers()["retry-after"], "7");
    let body = json_body(response).await;
    assert_eq!(body["error"]["message"], "slow down");
    assert_eq!(stub.requests().len(), 1, "pare never retries on its own");
}

#[tokio::test]
async fn a_body_over_the_limit_gets_413_and_is_not_forwarded() {
    let stub = Stub::start(Stub::openai).await;
    let mut config = config_for(&stub);
    config.server.max_body = 1024;
    let pare = pare_support::start(config).await;

    let response = client().post(pare.url("/v1/chat/completions")).body(vec![b' '; 2048]).send().await.unwrap();
    assert_eq!(response.status(), 413);
    let body = json_body(response).await;
    assert_eq!(body["error"]["code"], "request_too_large");
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert!(body["error"]["message"].as_str().unwrap().contains("2048"));

    // Without a Content-Length the limit is enforced while reading.
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> = (0..4).map(|_| Ok(vec![b' '; 512])).collect();
    let streamed = reqwest::Body::wrap_stream(futures_util::stream::iter(chunks));
    let response = client().post(pare.url("/v1/chat/completions")).body(streamed).send().await.unwrap();
    assert_eq!(response.status(), 413);

    // Exactly at the limit is fine.
    let response = client().post(pare.url("/v1/chat/completions")).body(vec![b' '; 1024]).send().await.unwrap();
    assert_eq!(response.status(), 400, "forwarded; the stub rejects the blank body");
    assert_eq!(stub.requests().len(), 1);
}

#[tokio::test]
async fn an_unreachable_upstream_gets_502_naming_it() {
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = closed.local_addr().unwrap();
    drop(closed);
    let mut config = pare::config::Config::default();
    config.upstream.url = format!("http://{addr}/v1");
    let pare = pare_support::start(config).await;
    let response = client().post(pare.url("/v1/chat/completions?key=secret")).body(CHAT_BODY).send().await.unwrap();
    assert_eq!(response.status(), 502);
    let body = json_body(response).await;
    assert_eq!(body["error"]["type"], "upstream_error");
    assert_eq!(body["error"]["code"], "upstream_unreachable");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains(&format!("http://{addr}/v1/chat/completions")), "{message}");
    assert!(message.to_lowercase().contains("refused"), "{message}");
    assert!(!message.contains("secret"), "query strings never reach error bodies: {message}");
}

#[tokio::test]
async fn an_upstream_that_stalls_gets_504_and_is_cancelled() {
    let stub = Stub::start(|_: &Recorded| Reply::Stall).await;
    let mut config = config_for(&stub);
    config.upstream.timeout_secs = 1;
    let pare = pare_support::start(config).await;
    let response = client().post(pare.url("/v1/chat/completions")).body(CHAT_BODY).send().await.unwrap();
    assert_eq!(response.status(), 504);
    let body = json_body(response).await;
    assert_eq!(body["error"]["code"], "upstream_timeout");
    stub.wait_cancelled(1).await;
}

#[tokio::test]
async fn malformed_json_is_forwarded_unchanged() {
    let stub = Stub::start(Stub::openai).await;
    let pare = pare_for(&stub).await;
    let broken = br#"{"model": "stub-model", "messages": [{"role": "user", "content": "unterminated"#;
    let response = client()
        .post(pare.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(broken.to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400, "the upstream answers as it would have");
    let body = json_body(response).await;
    assert_eq!(body["error"]["message"], "we could not parse the JSON body of your request");
    assert_eq!(stub.single().body, broken.as_slice());
    assert_eq!(pare.pipeline.stats.unparseable.load(Ordering::Relaxed), 1);
}

struct FailingCompactor;

impl ConversationCompactor for FailingCompactor {
    fn compact(&self, _input: &CompactInput<'_>) -> anyhow::Result<CompactOutput> {
        anyhow::bail!("rule pack exploded")
    }
}

struct PanickingCompactor;

impl ConversationCompactor for PanickingCompactor {
    fn compact(&self, _input: &CompactInput<'_>) -> anyhow::Result<CompactOutput> {
        panic!("index out of bounds in a rule")
    }
}

/// Keeps only the last message: a rewrite whose body is shorter than the original.
struct LastMessageCompactor;

impl ConversationCompactor for LastMessageCompactor {
    fn compact(&self, input: &CompactInput<'_>) -> anyhow::Result<CompactOutput> {
        let last = pare::wire::Forward::Kept(input.messages.len().saturating_sub(1));
        let (body, _) = input.body.write(&[last]).unwrap();
        Ok(CompactOutput {
            body: Some(body),
            spans: None,
            summary: CompactionSummary { tokens_raw: 20, tokens_forwarded: 9, epoch: 1, ..Default::default() },
            late: None,
            lists: Default::default(),
        })
    }
}

#[tokio::test]
async fn compaction_errors_and_panics_fail_open() {
    for compactor in [Arc::new(FailingCompactor) as Arc<dyn ConversationCompactor>, Arc::new(PanickingCompactor)] {
        let stub = Stub::start(Stub::openai).await;
        let pare = pare_support::start_with_compactor(config_for(&stub), compactor).await;
        let response = client().post(pare.url("/v1/chat/completions")).body(CHAT_BODY).send().await.unwrap();
        assert_eq!(response.status(), 200);
        assert!(!response.headers().contains_key("x-pare-tokens-raw"), "no summary when compaction failed");
        let body = json_body(response).await;
        assert_eq!(body["choices"][0]["message"]["content"], stub::ANSWER);
        assert_eq!(stub.single().body, CHAT_BODY.as_bytes(), "the original bytes are forwarded");
        assert_eq!(pare.pipeline.stats.fail_open.load(Ordering::Relaxed), 1);
    }
}

/// Holds every compaction of a large body until released, and says when one is in progress.
struct HoldingCompactor {
    started: Notify,
    release: std::sync::Mutex<bool>,
    released: std::sync::Condvar,
}

impl ConversationCompactor for HoldingCompactor {
    fn compact(&self, input: &CompactInput<'_>) -> anyhow::Result<CompactOutput> {
        if input.raw.len() >= pare::pipeline::BLOCKING_COMPACTION_BYTES {
            self.started.notify_one();
            let guard = self.release.lock().unwrap();
            let (_guard, timeout) =
                self.released.wait_timeout_while(guard, Duration::from_secs(20), |released| !*released).unwrap();
            anyhow::ensure!(!timeout.timed_out(), "never released");
        }
        anyhow::bail!("forward unchanged")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn a_long_compaction_does_not_stall_other_requests() {
    // One runtime worker: if a large body's compaction ran on it, nothing else could be served
    // until it ended. The small request must be answered while the large one is still compacting.
    let stub = Stub::start(Stub::openai).await;
    let holding = Arc::new(HoldingCompactor {
        started: Notify::new(),
        release: std::sync::Mutex::new(false),
        released: std::sync::Condvar::new(),
    });
    let pare = pare_support::start_with_compactor(config_for(&stub), holding.clone()).await;
    let big = json!({"model": "m", "messages": [{"role": "user", "content": "x".repeat(400 * 1024)}]}).to_string();
    let started = holding.started.notified();
    let url = pare.url("/v1/chat/completions");
    let large = tokio::spawn(async move { client().post(url).body(big).send().await.map(|r| r.status()) });
    within("the large body's compaction to start", started).await;

    let small = within("the small request", client().post(pare.url("/v1/chat/completions")).body(CHAT_BODY).send())
        .await
        .unwrap();
    assert_eq!(small.status(), 200, "answered while the large body is still held in compaction");

    *holding.release.lock().unwrap() = true;
    holding.released.notify_all();
    assert_eq!(within("the large request", large).await.unwrap().unwrap(), 200);
}

#[tokio::test]
async fn a_rewritten_body_gets_its_own_content_length_and_pare_headers() {
    let stub = Stub::start(Stub::openai).await;
    let pare = pare_support::start_with_compactor(config_for(&stub), Arc::new(LastMessageCompactor)).await;
    let response = client().post(pare.url("/v1/chat/completions")).body(CHAT_BODY).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["x-pare-tokens-raw"], "20");
    assert_eq!(response.headers()["x-pare-tokens-forwarded"], "9");
    assert_eq!(response.headers()["x-pare-epoch"], "1");
    let seen = stub.single();
    let forwarded = seen.json();
    assert_eq!(forwarded["messages"], json!([{"role": "user", "content": "hi"}]));
    assert_eq!(forwarded["x_unknown"], json!({"kept": [1, 2, 3]}));
    assert!(seen.body.len() < CHAT_BODY.len());
    assert_eq!(seen.header("content-length"), Some(seen.body.len().to_string().as_str()));
}

#[tokio::test]
async fn streaming_is_not_buffered() {
    let gate = Arc::new(Notify::new());
    let script_gate = gate.clone();
    let stub = Stub::start(move |_: &Recorded| {
        Reply::sse(vec![
            Step::Send(stub::chunk_event("stub-model", json!({"content": "first"}), None)),
            Step::Gate(script_gate.clone()),
            Step::Send(stub::chunk_event("stub-model", json!({"content": "second"}), Some("stop"))),
            Step::Send(stub::sse_done()),
        ])
    })
    .await;
    let pare = pare_for(&stub).await;
    let mut response = client().post(pare.url("/v1/chat/completions")).body(stream_body()).send().await.unwrap();
    assert_eq!(response.status(), 200);
    // The stub cannot send "second" before the gate opens, so this only completes if pare
    // forwarded "first" on its own.
    let mut received = Vec::new();
    while !String::from_utf8_lossy(&received).contains("\n\n") {
        let chunk =
            within("the first chunk before the second exists", response.chunk()).await.unwrap().expect("more body");
        received.extend_from_slice(&chunk);
    }
    let first = String::from_utf8(received.clone()).unwrap();
    assert!(first.contains("first") && !first.contains("second"), "{first}");
    gate.notify_one();
    while let Some(chunk) = within("the rest of the stream", response.chunk()).await.unwrap() {
        received.extend_from_slice(&chunk);
    }
    let text = String::from_utf8(received).unwrap();
    assert!(text.contains("second") && text.ends_with("data: [DONE]\n\n"), "{text}");
    assert_eq!(stub.n_cancelled(), 0);
}

#[tokio::test]
async fn a_client_that_disconnects_cancels_the_upstream_request() {
    let stub = Stub::start(|_: &Recorded| {
        Reply::sse(vec![Step::Send(stub::chunk_event("stub-model", json!({"content": "first"}), None)), Step::Hold])
    })
    .await;
    let pare = pare_for(&stub).await;
    let client = client();
    let mut response = client.post(pare.url("/v1/chat/completions")).body(stream_body()).send().await.unwrap();
    let chunk = within("the first chunk", response.chunk()).await.unwrap().expect("a chunk");
    assert!(String::from_utf8_lossy(&chunk).contains("first"));
    assert_eq!(stub.n_cancelled(), 0);
    drop(response);
    drop(client);
    stub.wait_cancelled(1).await;
}

#[tokio::test]
async fn a_client_that_disconnects_while_waiting_for_headers_cancels_upstream() {
    let stub = Stub::start(|_: &Recorded| Reply::Stall).await;
    let pare = pare_for(&stub).await;
    let request = tokio::spawn(client().post(pare.url("/v1/chat/completions")).body(CHAT_BODY).send());
    stub.wait_requests(1).await;
    request.abort();
    stub.wait_cancelled(1).await;
}

#[tokio::test]
async fn graceful_shutdown_lets_an_in_flight_stream_finish() {
    let gate = Arc::new(Notify::new());
    let script_gate = gate.clone();
    let stub = Stub::start(move |_: &Recorded| {
        Reply::sse(vec![
            Step::Send(stub::chunk_event("stub-model", json!({"content": "before"}), None)),
            Step::Gate(script_gate.clone()),
            Step::Send(stub::chunk_event("stub-model", json!({"content": "after"}), Some("stop"))),
            Step::Send(stub::sse_done()),
        ])
    })
    .await;
    let mut pare = pare_for(&stub).await;
    let addr = pare.addr;
    let mut response = client().post(pare.url("/v1/chat/completions")).body(stream_body()).send().await.unwrap();
    let first = within("the first chunk", response.chunk()).await.unwrap().expect("a chunk");
    assert!(String::from_utf8_lossy(&first).contains("before"));

    pare.trigger_shutdown();
    // New connections are refused once the listener is closed.
    within("the listener to close", async {
        while tokio::net::TcpStream::connect(addr).await.is_ok() {
            tokio::task::yield_now().await;
        }
    })
    .await;

    // Give a non-draining `run` every chance to return before the stream is released.
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
    assert!(pare.is_running(), "run returned while a stream was still in flight");

    gate.notify_one();
    let mut rest = Vec::new();
    while let Some(chunk) = within("the rest of the stream", response.chunk()).await.unwrap() {
        rest.extend_from_slice(&chunk);
    }
    let rest = String::from_utf8(rest).unwrap();
    assert!(rest.contains("after") && rest.ends_with("data: [DONE]\n\n"), "{rest}");
    pare.shutdown().await.unwrap();
    assert_eq!(stub.n_cancelled(), 0);
}

#[tokio::test]
async fn h2c_prior_knowledge_is_served() {
    let stub = Stub::start(Stub::openai).await;
    let pare = pare_for(&stub).await;
    ::pare::outbound::install_crypto_provider();
    let h2 = reqwest::Client::builder().no_proxy().http2_prior_knowledge().build().unwrap();
    let response = h2.get(pare.url("/v1/models")).send().await.unwrap();
    assert_eq!(response.version(), reqwest::Version::HTTP_2);
    assert_eq!(response.status(), 200);
    let response = h2.post(pare.url("/v1/chat/completions")).body(CHAT_BODY).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(stub.requests()[1].body, CHAT_BODY.as_bytes());
}

#[tokio::test]
async fn pare_endpoints_are_answered_locally_and_never_forwarded() {
    let stub = Stub::start(Stub::openai).await;
    let pare = pare_for(&stub).await;
    let response = client().get(pare.url("/_pare/health")).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let health = json_body(response).await;
    assert_eq!(health["status"], "ok");
    assert_eq!(health["upstream"]["url"], format!("{}/v1", stub.url()));
    assert_eq!(health["memory"]["max_bytes"], pare::memory::DEFAULT_MAX_STATE_BYTES);
    assert_eq!(health["memory"]["evictions"], 0);
    let response = client().get(pare.url("/_pare/nothing-here")).send().await.unwrap();
    assert_eq!(response.status(), 404);
    let body = json_body(response).await;
    assert_eq!(body["error"]["code"], "not_found");
    assert!(stub.requests().is_empty());
}
