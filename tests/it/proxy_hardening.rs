//! The proxy under upstream and client faults, with limits, the inbound token, and its own
//! health and metrics endpoints.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use pare::pipeline::{CompactInput, CompactOutput, CompactionSummary, ConversationCompactor};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::pare::{self as pare_support, config_for};
use crate::support::stub::{self, Recorded, Reply, Step, Stub};
use crate::support::{client, json as json_body, raw, within};

const CHAT_BODY: &str = r#"{"model":"stub-model","messages":[{"role":"user","content":"hi"}]}"#;
const STREAM_BODY: &str = r#"{"model":"stub-model","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;

fn first_then(rest: Vec<Step>) -> impl Fn(&Recorded) -> Reply + Send + Sync + 'static {
    move |_: &Recorded| {
        let mut steps = vec![Step::Send(stub::chunk_event("stub-model", json!({"content": "first"}), None))];
        steps.extend(rest.clone());
        Reply::sse(steps)
    }
}

/// Read a streamed body until it ends or fails; returns the bytes and whether it failed.
async fn drain(mut response: reqwest::Response) -> (Vec<u8>, bool) {
    let mut bytes = Vec::new();
    loop {
        match within("the body to end or fail", response.chunk()).await {
            Ok(Some(chunk)) => bytes.extend_from_slice(&chunk),
            Ok(None) => return (bytes, false),
            Err(_) => return (bytes, true),
        }
    }
}

#[tokio::test]
async fn an_upstream_reset_mid_stream_cuts_the_client_stream() {
    let stub = Stub::start(first_then(vec![Step::Abort])).await;
    let pare = pare_support::start(config_for(&stub)).await;
    let response = client().post(pare.url("/v1/chat/completions")).body(STREAM_BODY).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let (bytes, failed) = drain(response).await;
    assert!(String::from_utf8_lossy(&bytes).contains("first"));
    assert!(failed, "the client must see the stream break, not a clean end");
    // pare itself is fine afterwards.
    let next = client().get(pare.url("/v1/models")).send().await.unwrap();
    assert_eq!(next.status(), 200);
}

#[tokio::test]
async fn an_upstream_stalling_mid_stream_hits_the_timeout_and_is_cancelled() {
    let stub = Stub::start(first_then(vec![Step::Hold])).await;
    let mut config = config_for(&stub);
    config.upstream.timeout_secs = 1;
    let pare = pare_support::start(config).await;
    let response = client().post(pare.url("/v1/chat/completions")).body(STREAM_BODY).send().await.unwrap();
    let (bytes, failed) = drain(response).await;
    assert!(String::from_utf8_lossy(&bytes).contains("first"));
    assert!(failed);
    stub.wait_cancelled(1).await;
}

#[tokio::test]
async fn invalid_sse_is_passed_through_untouched() {
    let garbage = Bytes::from_static(b"data: {not json\n\nevent: weird\nid: 7\n\n: comment\n\ndata: [DONE]");
    let sent = garbage.clone();
    let stub = Stub::start(move |_: &Recorded| Reply::sse(vec![Step::Send(sent.clone())])).await;
    let pare = pare_support::start(config_for(&stub)).await;
    let response = client().post(pare.url("/v1/chat/completions")).body(STREAM_BODY).send().await.unwrap();
    assert_eq!(response.bytes().await.unwrap(), garbage);
}

#[tokio::test]
async fn upstream_5xx_pass_through_with_headers_and_body() {
    for status in [500u16, 502, 503] {
        let stub = Stub::start(move |_: &Recorded| {
            let mut reply = Reply::error(status, "model is loading");
            if let Reply::Full { headers, .. } = &mut reply {
                headers.push(("retry-after".into(), "3".into()));
            }
            reply
        })
        .await;
        let pare = pare_support::start(config_for(&stub)).await;
        let response = client().post(pare.url("/v1/chat/completions")).body(CHAT_BODY).send().await.unwrap();
        assert_eq!(response.status().as_u16(), status);
        assert_eq!(response.headers()["retry-after"], "3");
        let body = json_body(response).await;
        assert_eq!(body["error"]["message"], "model is loading", "the upstream's error, not pare's");
        assert_eq!(stub.requests().len(), 1);
    }
}

#[tokio::test]
async fn a_large_response_streams_through_whole() {
    const CHUNK: usize = 1 << 20;
    const N_CHUNKS: usize = 32;
    let stub = Stub::start(|_: &Recorded| {
        let chunk = Bytes::from(vec![b'x'; CHUNK]);
        Reply::Stream {
            status: 200,
            headers: vec![("content-type".into(), "application/octet-stream".into())],
            steps: (0..N_CHUNKS).map(|_| Step::Send(chunk.clone())).collect(),
        }
    })
    .await;
    let pare = pare_support::start(config_for(&stub)).await;
    let mut response = client().get(pare.url("/v1/files/big/content")).send().await.unwrap();
    let mut n_bytes = 0;
    let mut n_chunks = 0;
    while let Some(chunk) = within("the large body", response.chunk()).await.unwrap() {
        n_bytes += chunk.len();
        n_chunks += 1;
    }
    assert_eq!(n_bytes, CHUNK * N_CHUNKS);
    assert!(n_chunks > 1, "arrived as a stream of chunks");
}

#[tokio::test]
async fn a_client_leaving_mid_request_body_never_reaches_the_upstream() {
    let stub = Stub::start(Stub::openai).await;
    let pare = pare_support::start(config_for(&stub)).await;
    let mut stream = TcpStream::connect(pare.addr).await.unwrap();
    stream
        .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 1000\r\n\r\n{\"model\":")
        .await
        .unwrap();
    drop(stream);
    // pare keeps serving, and the half request was never forwarded.
    let response = client().post(pare.url("/v1/chat/completions")).body(CHAT_BODY).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(stub.single().body, CHAT_BODY.as_bytes());
}

#[tokio::test]
async fn a_slowloris_client_is_disconnected_after_the_header_timeout() {
    let stub = Stub::start(Stub::openai).await;
    let mut config = config_for(&stub);
    config.server.header_read_timeout_secs = 1;
    let pare = pare_support::start(config).await;
    let mut stream = TcpStream::connect(pare.addr).await.unwrap();
    stream.write_all(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nX-Slow: 1\r\n").await.unwrap();
    let mut rest = Vec::new();
    within("pare to close the slow connection", stream.read_to_end(&mut rest)).await.ok();
    assert!(stub.requests().is_empty());
}

#[tokio::test]
async fn pipelined_requests_on_one_connection_are_answered_in_order() {
    let stub = Stub::start(|request: &Recorded| Reply::json(200, json!({"path": request.path}))).await;
    let pare = pare_support::start(config_for(&stub)).await;
    let head = "GET /v1/first HTTP/1.1\nHost: localhost\n\nGET /v1/second HTTP/1.1\nHost: localhost\nConnection: close";
    let response = raw::exchange(pare.addr, head, b"").await;
    assert_eq!(response.status, 200);
    let text = String::from_utf8_lossy(&response.body);
    let first = text.find("/v1/first").expect("first answer");
    let second = text.find("/v1/second").expect("second answer");
    assert!(first < second, "{text}");
    let paths: Vec<String> = stub.requests().into_iter().map(|r| r.path).collect();
    assert_eq!(paths, ["/v1/first", "/v1/second"]);
}

#[tokio::test]
async fn concurrent_requests_share_one_h2_connection() {
    let stub = Stub::start(Stub::openai).await;
    let pare = pare_support::start(config_for(&stub)).await;
    ::pare::outbound::install_crypto_provider();
    let h2 = reqwest::Client::builder().no_proxy().http2_prior_knowledge().build().unwrap();
    let requests = (0..16).map(|_| h2.post(pare.url("/v1/chat/completions")).body(STREAM_BODY).send());
    let responses = within("16 concurrent requests", futures_util::future::join_all(requests)).await;
    for response in responses {
        let response = response.unwrap();
        assert_eq!(response.version(), reqwest::Version::HTTP_2);
        assert!(response.text().await.unwrap().ends_with("data: [DONE]\n\n"));
    }
    assert_eq!(stub.requests().len(), 16);
}

#[tokio::test]
async fn a_non_loopback_listener_is_refused_by_default() {
    let config = pare::config::Config::default();
    let err = pare::proxy::bind("0.0.0.0:0", &config).await.unwrap_err();
    assert!(matches!(err, pare::proxy::ServeError::NotLoopback { .. }), "{err}");
    assert!(pare::proxy::bind("127.0.0.1:0", &config).await.is_ok());
}

#[tokio::test]
async fn the_inbound_token_guards_everything_but_health() {
    let stub = Stub::start(Stub::openai).await;
    let mut config = config_for(&stub);
    config.server.auth_token = Some("pare-s3cret-pare-s3cret".into());
    config.server.owner_token = None;
    let pare = pare_support::start(config).await;

    let refused =
        crate::support::bare_client().post(pare.url("/v1/chat/completions")).body(CHAT_BODY).send().await.unwrap();
    assert_eq!(refused.status(), 401);
    let body = json_body(refused).await;
    assert_eq!(body["error"]["code"], "invalid_pare_token");
    let wrong = client().get(pare.url("/v1/models")).header("x-pare-token", "nope").send().await.unwrap();
    assert_eq!(wrong.status(), 401);
    let metrics = crate::support::bare_client().get(pare.url("/_pare/metrics")).send().await.unwrap();
    assert_eq!(metrics.status(), 401);
    assert!(stub.requests().is_empty(), "nothing reaches the upstream without the token");

    let health = client().get(pare.url("/_pare/health")).send().await.unwrap();
    assert_eq!(health.status(), 200);

    let allowed = client()
        .post(pare.url("/v1/chat/completions"))
        .header("x-pare-token", "pare-s3cret-pare-s3cret")
        .header("authorization", "Bearer agent-key")
        .body(CHAT_BODY)
        .send()
        .await
        .unwrap();
    assert_eq!(allowed.status(), 200);
    let seen = stub.single();
    assert_eq!(seen.header("authorization"), Some("Bearer agent-key"));
    assert_eq!(seen.header("x-pare-token"), None, "pare's token never leaves pare");
}

#[tokio::test]
async fn too_many_or_too_large_headers_get_431() {
    let stub = Stub::start(Stub::openai).await;
    let mut config = config_for(&stub);
    config.server.max_headers = 10;
    config.server.max_header_bytes = 16 * 1024;
    let pare = pare_support::start(config).await;

    let mut many = String::from("GET /v1/models HTTP/1.1\nHost: localhost\nConnection: close");
    for i in 0..20 {
        many.push_str(&format!("\nX-Extra-{i}: {i}"));
    }
    assert_eq!(raw::exchange(pare.addr, &many, b"").await.status, 431);

    let big = format!("GET /v1/models HTTP/1.1\nHost: localhost\nConnection: close\nX-Big: {}", "a".repeat(64 * 1024));
    let response = raw::exchange(pare.addr, &big, b"").await;
    assert_eq!(response.status, 431);
    let body: serde_json::Value = serde_json::from_slice(&response.body).unwrap();
    assert_eq!(body["error"]["code"], "request_headers_too_large");

    let fine = raw::exchange(pare.addr, "GET /v1/models HTTP/1.1\nHost: localhost\nConnection: close", b"").await;
    assert_eq!(fine.status, 200);
    assert_eq!(stub.requests().len(), 1);
}

#[tokio::test]
async fn health_reports_upstream_reachability() {
    let stub = Stub::start(Stub::openai).await;
    let pare = pare_support::start(config_for(&stub)).await;
    let health = json_body(client().get(pare.url("/_pare/health")).send().await.unwrap()).await;
    assert_eq!(health["status"], "ok");
    assert_eq!(health["upstream"]["reachable"], true);

    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = closed.local_addr().unwrap();
    drop(closed);
    let mut config = pare::config::Config::default();
    config.upstream.url = format!("http://{addr}/v1");
    config.server.owner_token = Some(crate::support::TOKEN.to_owned());
    let down = pare_support::start(config).await;
    let response = client().get(down.url("/_pare/health")).send().await.unwrap();
    assert_eq!(response.status(), 200, "pare itself is healthy");
    let health = json_body(response).await;
    assert_eq!(health["status"], "degraded");
    assert_eq!(health["upstream"]["reachable"], false);
    assert!(health["upstream"]["error"].as_str().unwrap().to_lowercase().contains("refused"), "{health}");
}

struct HalvingCompactor;

impl ConversationCompactor for HalvingCompactor {
    fn compact(&self, _input: &CompactInput<'_>) -> anyhow::Result<CompactOutput> {
        Ok(CompactOutput {
            body: None,
            spans: None,
            summary: CompactionSummary { tokens_raw: 1000, tokens_forwarded: 500, epoch: 1, ..Default::default() },
            late: None,
            lists: Default::default(),
        })
    }
}

struct FailingCompactor;

impl ConversationCompactor for FailingCompactor {
    fn compact(&self, _input: &CompactInput<'_>) -> anyhow::Result<CompactOutput> {
        anyhow::bail!("broken rule")
    }
}

fn series(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

#[tokio::test]
async fn metrics_count_requests_tokens_latency_and_fail_open() {
    let stub = Stub::start(Stub::openai).await;
    let pare = pare_support::start_with_compactor(config_for(&stub), Arc::new(HalvingCompactor)).await;
    for _ in 0..2 {
        client().post(pare.url("/v1/chat/completions")).body(CHAT_BODY).send().await.unwrap().bytes().await.unwrap();
    }
    client().get(pare.url("/props")).send().await.unwrap().bytes().await.unwrap();
    let response = client().get(pare.url("/_pare/metrics")).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert!(response.headers()["content-type"].to_str().unwrap().starts_with("application/openmetrics-text"));
    let text = response.text().await.unwrap();
    assert_eq!(series(&text, r#"pare_requests_total{route="chat_completions",status="200"}"#), Some(2.0), "{text}");
    assert_eq!(series(&text, r#"pare_requests_total{route="other",status="404"}"#), Some(1.0), "{text}");
    assert_eq!(series(&text, r#"pare_tokens_raw_total{model="stub-model",wire="chat"}"#), Some(2000.0), "{text}");
    assert_eq!(series(&text, r#"pare_tokens_forwarded_total{model="stub-model",wire="chat"}"#), Some(1000.0), "{text}");
    assert_eq!(series(&text, r#"pare_upstream_seconds_count{route="chat_completions"}"#), Some(2.0), "{text}");
    assert_eq!(series(&text, r#"pare_overhead_seconds_count{route="chat_completions"}"#), Some(2.0), "{text}");
    assert_eq!(series(&text, "pare_requests_in_flight"), Some(0.0), "{text}");
    assert_eq!(series(&text, "pare_fail_open_total"), Some(0.0), "{text}");
    assert!(text.trim_end().ends_with("# EOF"));

    let failing = pare_support::start_with_compactor(config_for(&stub), Arc::new(FailingCompactor)).await;
    client().post(failing.url("/v1/chat/completions")).body(CHAT_BODY).send().await.unwrap().bytes().await.unwrap();
    let text = client().get(failing.url("/_pare/metrics")).send().await.unwrap().text().await.unwrap();
    assert_eq!(series(&text, "pare_fail_open_total"), Some(1.0), "{text}");
}

#[tokio::test]
async fn in_flight_streams_are_visible_in_metrics() {
    let gate = Arc::new(tokio::sync::Notify::new());
    let script_gate = gate.clone();
    let stub = Stub::start(move |_: &Recorded| {
        Reply::sse(vec![
            Step::Send(stub::chunk_event("stub-model", json!({"content": "a"}), None)),
            Step::Gate(script_gate.clone()),
            Step::Send(stub::sse_done()),
        ])
    })
    .await;
    let pare = pare_support::start(config_for(&stub)).await;
    let mut response = client().post(pare.url("/v1/chat/completions")).body(STREAM_BODY).send().await.unwrap();
    within("the first chunk", response.chunk()).await.unwrap();
    let text = client().get(pare.url("/_pare/metrics")).send().await.unwrap().text().await.unwrap();
    assert_eq!(series(&text, "pare_requests_in_flight"), Some(1.0), "{text}");
    gate.notify_one();
    drain(response).await;
    // The completion runs when hyper drops the finished body: wait for it, bounded.
    within("the exchange to finish", async {
        loop {
            let text = client().get(pare.url("/_pare/metrics")).send().await.unwrap().text().await.unwrap();
            if series(&text, "pare_requests_in_flight") == Some(0.0) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
}

#[tokio::test]
async fn keys_never_appear_in_error_bodies() {
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = closed.local_addr().unwrap();
    drop(closed);
    let mut config = pare::config::Config::default();
    config.upstream.url = format!("http://{addr}/v1");
    config.upstream.api_key = Some("sk-upstream-secret".into());
    let pare = pare_support::start(config).await;
    let response = client()
        .post(pare.url("/v1/chat/completions?api-key=sk-query-secret"))
        .header("authorization", "Bearer sk-agent-secret")
        .body(CHAT_BODY)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 502);
    let text = response.text().await.unwrap();
    for secret in ["sk-upstream-secret", "sk-query-secret", "sk-agent-secret"] {
        assert!(!text.contains(secret), "{secret} leaked: {text}");
    }
}

fn archived_pipeline(
    config: &pare::config::Config,
    dir: &std::path::Path,
) -> (Arc<pare::config::Config>, Arc<pare::pipeline::Pipeline>) {
    let mut config = config.clone();
    config.archive.enabled = true;
    config.archive.dir = Some(dir.to_owned());
    let config = Arc::new(config);
    let archive = pare::archive::Archive::open(&config.archive);
    let pipeline = pare::pipeline::Pipeline::identity(config.clone()).with_archive(archive);
    (config, Arc::new(pipeline))
}

#[tokio::test]
async fn health_and_metrics_report_the_archive() {
    let stub = Stub::start(Stub::openai).await;
    let dir = tempfile::tempdir().unwrap();
    let (config, pipeline) = archived_pipeline(&config_for(&stub), dir.path());
    let pare = pare_support::start_with_pipeline(config, pipeline).await;
    client().post(pare.url("/v1/chat/completions")).body(CHAT_BODY).send().await.unwrap().bytes().await.unwrap();
    within("the archive to commit the exchange", async {
        loop {
            let text = client().get(pare.url("/_pare/metrics")).send().await.unwrap().text().await.unwrap();
            if series(&text, "pare_archive_committed_records_total").unwrap_or(0.0) >= 1.0 {
                assert_eq!(series(&text, "pare_archive_writable"), Some(1.0), "{text}");
                assert_eq!(series(&text, "pare_archive_lost_records_total"), Some(0.0), "{text}");
                assert!(series(&text, "pare_archive_queue_depth").is_some(), "{text}");
                assert!(series(&text, "pare_archive_commits_total").is_some_and(|n| n >= 1.0), "{text}");
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let health = json_body(client().get(pare.url("/_pare/health")).send().await.unwrap()).await;
    assert_eq!(health["status"], "ok");
    assert_eq!(health["archive"]["writable"], true);
    assert!(health["archive"]["commits"].as_u64().is_some_and(|n| n >= 1), "{health}");
}

#[tokio::test]
async fn an_unwritable_archive_makes_health_degraded() {
    let stub = Stub::start(Stub::openai).await;
    let not_a_dir = tempfile::NamedTempFile::new().unwrap();
    let (config, pipeline) = archived_pipeline(&config_for(&stub), &not_a_dir.path().join("archive"));
    let pare = pare_support::start_with_pipeline(config, pipeline).await;
    let response = client().post(pare.url("/v1/chat/completions")).body(CHAT_BODY).send().await.unwrap();
    assert_eq!(response.status(), 200, "a broken archive never blocks the agent");
    within("health to report the archive", async {
        loop {
            let health = json_body(client().get(pare.url("/_pare/health")).send().await.unwrap()).await;
            if health["archive"]["writable"] == false {
                assert_eq!(health["status"], "degraded");
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
}

/// A chat body of `n` tiny tool outputs: small in bytes, large in parsed messages.
fn tiny_outputs_body(n: usize) -> String {
    let mut messages = vec![json!({"role": "user", "content": "go"})];
    for k in 0..n {
        let call = format!("c{k}");
        messages.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": call, "type": "function",
            "function": {"name": "t", "arguments": "{}"}}]}));
        messages.push(json!({"role": "tool", "tool_call_id": call, "content": "ok"}));
    }
    json!({"model": "stub-model", "messages": messages}).to_string()
}

/// Regression (compaction's working set was bounded by nothing: one 27 MB body of tiny outputs
/// added 0.8 GB): the request budget holds a body's estimated working set from before compaction
/// starts, on the proxy path and `POST /v1/compress` alike. One that does not fit beside what other
/// requests hold gets 503 with `retry-after` and nothing of it is archived; alone, it goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compaction_that_does_not_fit_the_request_budget_gets_503_and_is_not_archived() {
    let stub = Stub::start(Stub::openai).await;
    let dir = tempfile::tempdir().unwrap();
    let mut config = config_for(&stub);
    config.server.max_body = 4 << 20;
    config.server.max_buffered_bytes = 4 << 20;
    let (config, pipeline) = archived_pipeline(&config, dir.path());
    let archive = Arc::clone(pipeline.archive().unwrap());
    let pare = pare_support::start_with_pipeline(config, pipeline).await;
    let body = tiny_outputs_body(3000);
    assert!(body.len() < 1 << 20 && pare::proxy::limits::working_set(body.as_bytes()) > 4 << 20);
    // Another client holds part of the budget with a body it has not finished sending.
    let mut holder = TcpStream::connect(pare.addr).await.unwrap();
    let head = "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 2000000\r\n\r\n";
    holder.write_all(head.as_bytes()).await.unwrap();
    holder.write_all(&vec![b' '; 500_000]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    for path in ["/v1/chat/completions", "/v1/compress"] {
        let refused = client().post(pare.url(path)).body(body.clone()).send().await.unwrap();
        assert_eq!(refused.status(), 503, "{path}");
        assert_eq!(refused.headers()["retry-after"], "1");
    }
    archive.flush().unwrap();
    assert_eq!(archive.health().committed_records, 0, "nothing of a refused request is archived");
    assert!(stub.requests().is_empty(), "nor forwarded");
    drop(holder);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let alone = client().post(pare.url("/v1/chat/completions")).body(body).send().await.unwrap();
    assert_eq!(alone.status(), 200, "alone, the body goes through");
    pare.shutdown().await.unwrap();
}
