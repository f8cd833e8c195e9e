//! Token counting, window detection and the epoch state machine (`budget`).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use pare::budget::tokens::{
    CountTokens, CounterConfig, Encoding, REPLY_PRIMING, TokenCounter, request_tokens,
};
use pare::budget::window::{DetectConfig, ModelTable, WindowResolver};
use pare::config::Config;
use tiktoken_rs::{ChatCompletionRequestMessage, FunctionCall};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn counter(encoding: Encoding) -> TokenCounter {
    TokenCounter::new(&CounterConfig {
        encoding,
        ..CounterConfig::default()
    })
}

#[test]
fn token_counts_match_tiktoken_for_known_strings() {
    let c = counter(Encoding::O200kBase);
    // Reference values from OpenAI's tiktoken (o200k_base / cl100k_base).
    assert_eq!(c.text("hello world"), 2);
    assert_eq!(c.text("tiktoken is great!"), 6);
    assert_eq!(counter(Encoding::Cl100kBase).text("tiktoken is great!"), 6);
    assert_eq!(c.text(""), 0);
}

#[test]
fn message_counts_follow_openai_per_message_overhead() {
    let reference = vec![
        ChatCompletionRequestMessage {
            role: "system".into(),
            content: Some("You are a helpful assistant.".into()),
            ..Default::default()
        },
        ChatCompletionRequestMessage {
            role: "user".into(),
            content: Some("What is in src/main.rs?".into()),
            name: Some("alice".into()),
            ..Default::default()
        },
        ChatCompletionRequestMessage {
            role: "assistant".into(),
            tool_calls: vec![
                FunctionCall {
                    name: "read_file".into(),
                    arguments: r#"{"path":"src/main.rs"}"#.into(),
                },
                FunctionCall {
                    name: "terminal".into(),
                    arguments: r#"{"command":"ls -la"}"#.into(),
                },
            ],
            ..Default::default()
        },
        ChatCompletionRequestMessage {
            role: "tool".into(),
            content: Some("fn main() {\n    println!(\"hi\");\n}\n".into()),
            ..Default::default()
        },
    ];
    let ours = [
        r#"{"role":"system","content":"You are a helpful assistant."}"#,
        r#"{"role":"user","content":"What is in src/main.rs?","name":"alice"}"#,
        r#"{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"read_file","arguments":"{\"path\":\"src/main.rs\"}"}},{"id":"c2","type":"function","function":{"name":"terminal","arguments":"{\"command\":\"ls -la\"}"}}]}"#,
        r#"{"role":"tool","tool_call_id":"c1","content":"fn main() {\n    println!(\"hi\");\n}\n"}"#,
    ];
    for (encoding, model) in [
        (Encoding::O200kBase, "gpt-4o"),
        (Encoding::Cl100kBase, "gpt-4"),
    ] {
        let expected = tiktoken_rs::num_tokens_from_messages(model, &reference).unwrap() as u64;
        let c = counter(encoding);
        assert_eq!(request_tokens(&c, &ours, None), expected, "{model}");
    }
}

#[test]
fn text_parts_count_as_text_and_images_as_a_fixed_estimate() {
    let c = TokenCounter::new(&CounterConfig {
        image_tokens: 1000,
        ..CounterConfig::default()
    });
    let plain = c.message(r#"{"role":"user","content":"describe this picture"}"#);
    let parts =
        c.message(r#"{"role":"user","content":[{"type":"text","text":"describe this picture"}]}"#);
    assert_eq!(plain, parts);
    let long_data = "A".repeat(50_000);
    let with_image = c.message(&format!(
        r#"{{"role":"user","content":[{{"type":"text","text":"describe this picture"}},{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{long_data}"}}}}]}}"#
    ));
    assert_eq!(with_image, plain + 1000);
}

#[test]
fn warm_count_tokenizes_only_new_messages() {
    let c = counter(Encoding::O200kBase);
    let messages: Vec<String> = (0..50)
        .map(|i| {
            format!(r#"{{"role":"tool","tool_call_id":"c{i}","content":"output number {i}"}}"#)
        })
        .collect();
    let cold = request_tokens(&c, &messages[..40], None);
    assert_eq!(c.tokenizations(), 40);
    let warm = request_tokens(&c, &messages[..40], None);
    assert_eq!(warm, cold);
    assert_eq!(
        c.tokenizations(),
        40,
        "a repeated request tokenizes nothing"
    );
    request_tokens(&c, &messages, None);
    assert_eq!(
        c.tokenizations(),
        50,
        "an extended request tokenizes only the 10 new messages"
    );
}

#[test]
fn token_cache_is_bounded() {
    let c = TokenCounter::new(&CounterConfig {
        cache_entries: 4,
        ..CounterConfig::default()
    });
    let messages: Vec<String> = (0..8)
        .map(|i| format!(r#"{{"role":"user","content":"m{i}"}}"#))
        .collect();
    request_tokens(&c, &messages, None);
    request_tokens(&c, &messages[..4], None);
    assert_eq!(
        c.tokenizations(),
        12,
        "the first four were evicted and counted again"
    );
}

#[test]
fn tools_are_counted_once_per_distinct_schema() {
    let c = counter(Encoding::O200kBase);
    let a = r#"{"type":"function","function":{"name":"read_file","parameters":{"type":"object"}}}"#;
    let b = r#"{"type":"function","function":{"name":"terminal","parameters":{"type":"object"}}}"#;
    let both = c.tools(&format!("[{a},{b}]"));
    assert_eq!(both, c.text(a) + c.text(b));
    let before = c.tokenizations();
    c.tools(&format!("[{b},{a}]"));
    // The new array is one miss; its two schemas are already known.
    assert_eq!(c.tokenizations(), before + 1);
    assert_eq!(
        request_tokens(
            &c,
            &[r#"{"role":"user","content":"x"}"#],
            Some(&format!("[{a}]"))
        ),
        c.message(r#"{"role":"user","content":"x"}"#) + c.text(a) + REPLY_PRIMING
    );
}

// ---- window detection against in-test stubs ----

/// A one-route-per-path HTTP stub on 127.0.0.1:0 that counts the requests it gets.
struct Stub {
    url: String,
    hits: Arc<AtomicUsize>,
}

async fn stub(routes: Vec<(&'static str, &'static str, String)>) -> Stub {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let hits = Arc::new(AtomicUsize::new(0));
    let counted = hits.clone();
    tokio::spawn(async move {
        for _ in 0..200 {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            counted.fetch_add(1, Ordering::SeqCst);
            let routes = routes.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    let Ok(n) = socket.read(&mut chunk).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    let text = String::from_utf8_lossy(&buf).to_string();
                    if let Some(end) = text.find("\r\n\r\n") {
                        let length = text[..end]
                            .lines()
                            .find_map(|l| {
                                l.to_ascii_lowercase()
                                    .strip_prefix("content-length:")
                                    .map(|v| v.trim().parse::<usize>().unwrap_or(0))
                            })
                            .unwrap_or(0);
                        if buf.len() >= end + 4 + length {
                            break;
                        }
                    }
                }
                let text = String::from_utf8_lossy(&buf).to_string();
                let mut first = text.lines().next().unwrap_or("").split_whitespace();
                let (method, path) = (first.next().unwrap_or(""), first.next().unwrap_or(""));
                let (status, body) =
                    match routes.iter().find(|(m, p, _)| *m == method && *p == path) {
                        Some((_, _, body)) => ("200 OK", body.clone()),
                        None => ("404 Not Found", "{\"error\":\"not found\"}".to_owned()),
                    };
                let response = format!(
                    "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = socket.write_all(response.as_bytes()).await;
                let _ = socket.shutdown().await;
            });
        }
    });
    Stub { url, hits }
}

fn resolver(url: &str, yaml: &str) -> WindowResolver {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let config = Config::from_yaml(yaml).unwrap();
    WindowResolver::new(
        reqwest::Client::new(),
        url,
        ModelTable::from_config(&config).unwrap(),
        DetectConfig::from_budget(&config.budget),
    )
}

#[tokio::test]
async fn detects_vllm_max_model_len() {
    let s = stub(vec![("GET", "/v1/models", r#"{"object":"list","data":[{"id":"Qwen/Qwen2.5-14B","max_model_len":32768},{"id":"other","max_model_len":8192}]}"#.into())]).await;
    let r = resolver(&format!("{}/v1", s.url), "");
    assert_eq!(r.window(Some("Qwen/Qwen2.5-14B")).await, 32768);
}

#[tokio::test]
async fn detects_llama_cpp_n_ctx() {
    let s = stub(vec![(
        "GET",
        "/props",
        r#"{"default_generation_settings":{"n_ctx":16384,"params":{}},"total_slots":1}"#.into(),
    )])
    .await;
    let r = resolver(&s.url, "");
    assert_eq!(r.window(Some("anything")).await, 16384);
}

#[tokio::test]
async fn detects_ollama_context_length() {
    let s = stub(vec![(
        "POST",
        "/api/show",
        r#"{"model_info":{"general.architecture":"qwen2","qwen2.context_length":40960}}"#.into(),
    )])
    .await;
    let r = resolver(&s.url, "");
    assert_eq!(r.window(Some("qwen2.5:14b")).await, 40960);
}

#[tokio::test]
async fn detects_lm_studio_max_context_length() {
    let s = stub(vec![("GET", "/api/v0/models", r#"{"data":[{"id":"qwen2.5-14b-instruct","state":"not-loaded","max_context_length":24576}]}"#.into())]).await;
    let r = resolver(&s.url, "");
    assert_eq!(r.window(Some("qwen2.5-14b-instruct")).await, 24576);
}

#[tokio::test]
async fn config_wins_over_detection_and_default_applies_last() {
    let s = stub(vec![(
        "GET",
        "/props",
        r#"{"default_generation_settings":{"n_ctx":16384}}"#.into(),
    )])
    .await;
    let r = resolver(
        &s.url,
        "models:\n  - match: \"^qwen\"\n    context_window: 12000\nbudget:\n  default_context_window: 9000\n",
    );
    assert_eq!(r.window(Some("qwen-14b")).await, 12000);
    assert_eq!(
        s.hits.load(Ordering::SeqCst),
        0,
        "a configured window asks nothing upstream"
    );
    assert_eq!(r.window(Some("llama")).await, 16384);

    let silent = stub(vec![]).await;
    let r = resolver(&silent.url, "budget:\n  default_context_window: 9000\n");
    assert_eq!(r.window(Some("llama")).await, 9000);
    let r = resolver(
        &s.url,
        "budget:\n  default_context_window: 9000\n  detect_window: false\n",
    );
    assert_eq!(r.window(Some("llama")).await, 9000);
}

#[tokio::test]
async fn detection_is_cached_including_failures() {
    let found = stub(vec![(
        "GET",
        "/props",
        r#"{"default_generation_settings":{"n_ctx":16384}}"#.into(),
    )])
    .await;
    let r = resolver(&found.url, "");
    assert_eq!(r.window(Some("m")).await, 16384);
    let after_first = found.hits.load(Ordering::SeqCst);
    assert_eq!(after_first, 4, "one probe per server kind");
    assert_eq!(r.window(Some("m")).await, 16384);
    assert_eq!(found.hits.load(Ordering::SeqCst), after_first);

    let missing = stub(vec![]).await;
    let r = resolver(&missing.url, "budget:\n  default_context_window: 7000\n");
    assert_eq!(r.window(Some("m")).await, 7000);
    let after_first = missing.hits.load(Ordering::SeqCst);
    assert_eq!(r.window(Some("m")).await, 7000);
    assert_eq!(
        missing.hits.load(Ordering::SeqCst),
        after_first,
        "a failed detection is not retried at once"
    );
}

#[tokio::test]
async fn unreachable_upstream_falls_back_within_the_timeout() {
    // A listener that accepts and never answers.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let r = resolver(
        &url,
        "budget:\n  default_context_window: 5000\n  detect_timeout_ms: 200\n",
    );
    assert_eq!(r.window(Some("m")).await, 5000);
    drop(listener);
}
