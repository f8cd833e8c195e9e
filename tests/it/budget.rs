//! Token counting, window detection and the epoch state machine (`budget`).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use pare::budget::window::{DetectConfig, ModelTable, WindowResolver};
use pare::config::{Config, HistoryShare, Mode};
use pare::tokens::{CountTokens, CounterConfig, Encoding, REPLY_PRIMING, TokenCounter, request_tokens};
use tiktoken_rs::{ChatCompletionRequestMessage, FunctionCall};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn counter(encoding: Encoding) -> TokenCounter {
    TokenCounter::new(&CounterConfig { encoding, ..CounterConfig::default() })
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

/// Text the pre-tokenizers find hardest: code, whitespace runs, digit runs, contractions, non-ASCII.
fn tokenizer_text() -> impl proptest::strategy::Strategy<Value = String> {
    use proptest::prelude::*;
    let code = r#"[ \t\n]{0,6}[a-zA-Z_]{1,12}[ \t\n(){}.,:;'"0-9]{0,8}([ \t\n]*[a-zA-Z_0-9]{1,12}){0,40}"#;
    let pieces =
        r#"([ \n\r\t]{1,4}|[0-9]{1,7}|[\u{80}-\u{10FFFF}]{1,3}|'(s|t|re|ve|m|ll|d|S|T)|[A-Z][a-z]+|[!-/]{1,3}){1,60}"#;
    prop_oneof![
        any::<String>(),
        proptest::string::string_regex(code).expect("valid regex"),
        proptest::string::string_regex(pieces).expect("valid regex"),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

    /// o200k and cl100k are counted with bpe-openai's encoder behind pare's own split (`budget::bpe`);
    /// tiktoken-rs is the reference and they must agree.
    #[test]
    fn fast_counts_equal_tiktoken(text in tokenizer_text()) {
        for (encoding, reference) in [
            (Encoding::O200kBase, tiktoken_rs::o200k_base_singleton()),
            (Encoding::Cl100kBase, tiktoken_rs::cl100k_base_singleton()),
        ] {
            proptest::prop_assert_eq!(encoding.count(&text), reference.count_ordinary(&text), "{:?}", encoding);
        }
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

    /// A message's bound (what a deferred decision assumes) is never under its count, whatever its
    /// texts: content, parts, tool-call arguments, reasoning.
    #[test]
    fn a_messages_bound_is_at_least_its_count(text in tokenizer_text(), args in tokenizer_text()) {
        let messages = [
            serde_json::json!({"role": "tool", "tool_call_id": "call_1", "content": text}),
            serde_json::json!({"role": "user", "content": [{"type": "text", "text": text},
                {"type": "image_url", "image_url": {"url": "x"}}, {"type": "input_audio", "data": args}]}),
            serde_json::json!({"role": "assistant", "content": null, "reasoning_content": args, "name": text,
                "tool_calls": [{"id": "call_1", "type": "function",
                    "function": {"name": "terminal", "arguments": args}}]}),
        ];
        for encoding in [Encoding::O200kBase, Encoding::Cl100kBase] {
            let c = counter(encoding);
            for message in &messages {
                let raw = message.to_string();
                proptest::prop_assert!(c.message_bound(&raw) >= c.message(&raw), "{}", raw);
            }
        }
    }
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
                FunctionCall { name: "read_file".into(), arguments: r#"{"path":"src/main.rs"}"#.into() },
                FunctionCall { name: "terminal".into(), arguments: r#"{"command":"ls -la"}"#.into() },
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
    for (encoding, model) in [(Encoding::O200kBase, "gpt-4o"), (Encoding::Cl100kBase, "gpt-4")] {
        let expected = tiktoken_rs::num_tokens_from_messages(model, &reference).unwrap() as u64;
        let c = counter(encoding);
        assert_eq!(request_tokens(&c, &ours, None), expected, "{model}");
    }
}

#[test]
fn text_parts_count_as_text_and_images_as_a_fixed_estimate() {
    let c = TokenCounter::new(&CounterConfig {
        media: pare::tokens::MediaTokens { image: 1000, ..Default::default() },
        ..CounterConfig::default()
    });
    let plain = c.message(r#"{"role":"user","content":"describe this picture"}"#);
    let parts = c.message(r#"{"role":"user","content":[{"type":"text","text":"describe this picture"}]}"#);
    assert_eq!(plain, parts);
    let long_data = "A".repeat(50_000);
    let with_image = c.message(&format!(
        r#"{{"role":"user","content":[{{"type":"text","text":"describe this picture"}},{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{long_data}"}}}}]}}"#
    ));
    assert_eq!(with_image, plain + 1000);
}

/// Regression: a 400 KB image counted 370,094 tokens through Gemini (its `inlineData` base64 as
/// text) and ~6,800 through the other wires. On every wire, each media part counts its kind's
/// estimate: the same image is the same count whatever the wire.
#[test]
fn an_image_counts_its_estimate_on_every_wire() {
    let data = "iVBORw0KGgoAAAANSUhEUgAA".repeat(17_000);
    let url = format!("data:image/png;base64,{data}");
    let bodies = [
        (
            pare::wire::Wire::Chat,
            serde_json::json!({"model": "m", "messages": [{"role": "user", "content": [
                {"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": url}}]}]}),
        ),
        (
            pare::wire::Wire::Responses,
            serde_json::json!({"model": "m", "input": [{"role": "user", "content": [
                {"type": "input_text", "text": "what is this"}, {"type": "input_image", "image_url": url}]}]}),
        ),
        (
            pare::wire::Wire::Messages,
            serde_json::json!({"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "what is this"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}]}]}),
        ),
        (
            pare::wire::Wire::Gemini,
            serde_json::json!({"contents": [{"role": "user", "parts": [
                {"text": "what is this"}, {"inlineData": {"mimeType": "image/png", "data": data}}]}]}),
        ),
    ];
    let c = counter(Encoding::O200kBase);
    let image = pare::tokens::MediaTokens::default().image;
    for (wire, body) in bodies {
        let bytes = serde_json::to_vec(&body).unwrap();
        assert!(bytes.len() > 400_000);
        let parsed = pare::wire::parse(wire, &bytes).unwrap();
        let tokens = request_tokens(&c, &parsed.messages(), parsed.tools());
        assert!((image..image + 40).contains(&tokens), "{wire:?}: {tokens} tokens");
    }
}

#[test]
fn warm_count_tokenizes_only_new_messages() {
    let c = counter(Encoding::O200kBase);
    let messages: Vec<String> =
        (0..50).map(|i| format!(r#"{{"role":"tool","tool_call_id":"c{i}","content":"output number {i}"}}"#)).collect();
    let cold = request_tokens(&c, &messages[..40], None);
    assert_eq!(c.tokenizations(), 40);
    let warm = request_tokens(&c, &messages[..40], None);
    assert_eq!(warm, cold);
    assert_eq!(c.tokenizations(), 40, "a repeated request tokenizes nothing");
    request_tokens(&c, &messages, None);
    assert_eq!(c.tokenizations(), 50, "an extended request tokenizes only the 10 new messages");
}

#[test]
fn token_cache_is_bounded() {
    let c = TokenCounter::new(&CounterConfig { cache_entries: 4, ..CounterConfig::default() });
    let messages: Vec<String> = (0..8).map(|i| format!(r#"{{"role":"user","content":"m{i}"}}"#)).collect();
    request_tokens(&c, &messages, None);
    request_tokens(&c, &messages[..4], None);
    assert_eq!(c.tokenizations(), 12, "the first four were evicted and counted again");
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
        request_tokens(&c, &[r#"{"role":"user","content":"x"}"#], Some(&format!("[{a}]"))),
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
                let (status, body) = match routes.iter().find(|(m, p, _)| *m == method && *p == path) {
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

/// A probe's answer over `MAX_PROBE_BYTES` is not read: no window from it, the default applies.
#[tokio::test]
async fn a_probe_answer_over_the_bound_gives_no_window() {
    let padding = "x".repeat(pare::budget::window::MAX_PROBE_BYTES);
    let models =
        |pad: &str| format!(r#"{{"object":"list","pad":"{pad}","data":[{{"id":"m","max_model_len":32768}}]}}"#);
    let s = stub(vec![("GET", "/v1/models", models(&padding))]).await;
    let r = resolver(&format!("{}/v1", s.url), "budget:\n  default_context_window: 9000\n");
    assert_eq!(r.window(Some("m")).await, 9000);
    let s = stub(vec![("GET", "/v1/models", models("x"))]).await;
    let r = resolver(&format!("{}/v1", s.url), "budget:\n  default_context_window: 9000\n");
    assert_eq!(r.window(Some("m")).await, 32768, "the same answer within the bound is read");
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
    let s = stub(vec![(
        "GET",
        "/api/v0/models",
        r#"{"data":[{"id":"qwen2.5-14b-instruct","state":"not-loaded","max_context_length":24576}]}"#.into(),
    )])
    .await;
    let r = resolver(&s.url, "");
    assert_eq!(r.window(Some("qwen2.5-14b-instruct")).await, 24576);
}

#[tokio::test]
async fn config_wins_over_detection_and_default_applies_last() {
    let s = stub(vec![("GET", "/props", r#"{"default_generation_settings":{"n_ctx":16384}}"#.into())]).await;
    let r = resolver(
        &s.url,
        "models:\n  - match: \"^qwen\"\n    context_window: 12000\nbudget:\n  default_context_window: 9000\n",
    );
    assert_eq!(r.window(Some("qwen-14b")).await, 12000);
    assert_eq!(s.hits.load(Ordering::SeqCst), 0, "a configured window asks nothing upstream");
    assert_eq!(r.window(Some("llama")).await, 16384);

    let silent = stub(vec![]).await;
    let r = resolver(&silent.url, "budget:\n  default_context_window: 9000\n");
    assert_eq!(r.window(Some("llama")).await, 9000);
    let r = resolver(&s.url, "budget:\n  default_context_window: 9000\n  detect_window: false\n");
    assert_eq!(r.window(Some("llama")).await, 9000);
}

#[tokio::test]
async fn detection_is_cached_including_failures() {
    let found = stub(vec![("GET", "/props", r#"{"default_generation_settings":{"n_ctx":16384}}"#.into())]).await;
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
    assert_eq!(missing.hits.load(Ordering::SeqCst), after_first, "a failed detection is not retried at once");
}

#[tokio::test]
async fn unreachable_upstream_falls_back_within_the_timeout() {
    // A listener that accepts and never answers.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let r = resolver(&url, "budget:\n  default_context_window: 5000\n  detect_timeout_ms: 200\n");
    assert_eq!(r.window(Some("m")).await, 5000);
    drop(listener);
}

// ---- the epoch state machine ----

use std::sync::Mutex;

use crate::support::CodingAgent;
use bytes::Bytes;
use http::HeaderMap;
use pare::archive::read::BodyKind;
use pare::budget::replay::{replay_session, session_lines};
use pare::budget::{CompactEngine, EpochPolicy, SessionCompactor};
use pare::compact::report::Report;
use pare::compact::{CompactOptions, Compacted, Fate, HistoryBudget, HistoryFloor};
use pare::exchange::{Action, WindowSource};
use pare::memory::{BudgetStats, StateBudget};
use pare::neutral::View;
use pare::pipeline::CompactOutput;
use pare::pipeline::{Pipeline, StreamEnd};
use pare::wire::{ChatBody, Wire};
use serde_json::{Value, json};

/// A small engine with known behaviour: the last `tail_turns` assistant turns are protected; before
/// them every tool output becomes `[elided]` (idempotent, keeps tool-call pairing). Records the
/// targets it is given, and reports `fitted` as the real engine does: a target was given and the
/// masked request is still over it.
pub(crate) struct MaskEngine {
    tail_turns: usize,
    targets: Mutex<Vec<Option<u64>>>,
    histories: Mutex<Vec<Option<HistoryBudget>>>,
    ages: Mutex<Vec<Option<Vec<f64>>>>,
    fitted: Mutex<Vec<bool>>,
}

impl MaskEngine {
    pub(crate) fn new(tail_turns: usize) -> Arc<MaskEngine> {
        Arc::new(MaskEngine {
            tail_turns,
            targets: Mutex::new(Vec::new()),
            histories: Mutex::new(Vec::new()),
            ages: Mutex::new(Vec::new()),
            fitted: Mutex::new(Vec::new()),
        })
    }
    fn calls(&self) -> usize {
        self.targets.lock().unwrap().len()
    }
}

fn role(raw: &str) -> String {
    serde_json::from_str::<Value>(raw).unwrap()["role"].as_str().unwrap_or("").to_owned()
}

impl CompactEngine for MaskEngine {
    fn compact(&self, view: &View<'_>, options: &CompactOptions, counter: &dyn CountTokens) -> Compacted {
        self.targets.lock().unwrap().push(options.target_tokens);
        self.histories.lock().unwrap().push(options.history);
        self.ages.lock().unwrap().push(options.message_ages_secs.clone());
        let messages = view.messages.to_vec();
        let assistants: Vec<usize> = (0..messages.len()).filter(|i| role(messages[*i]) == "assistant").collect();
        let boundary =
            if assistants.len() >= self.tail_turns { assistants[assistants.len() - self.tail_turns] } else { 0 };
        let mut plan = Vec::new();
        let prefix = messages[..boundary]
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let mut v: Value = serde_json::from_str(m).unwrap();
                if v["role"] == "tool" && v["content"] != "[elided]" {
                    v["content"] = json!("[elided]");
                    plan.push(Fate::Rewritten { at: i, rules: Default::default() });
                    v.to_string()
                } else {
                    plan.push(Fate::Kept { at: i });
                    (*m).to_owned()
                }
            })
            .collect::<Vec<String>>();
        let tokens = prefix.iter().map(|m| counter.message(m)).sum::<u64>()
            + messages[boundary..].iter().map(|m| counter.message(m)).sum::<u64>()
            + view.tools.map_or(0, |t| counter.tools(t))
            + REPLY_PRIMING;
        let fitted = options.target_tokens.is_some_and(|target| tokens > target);
        self.fitted.lock().unwrap().push(fitted);
        Compacted {
            boundary,
            typed: vec![None; prefix.len()],
            prefix,
            report: Report { boundary, ..Report::default() },
            fitted,
            lists: Vec::new(),
            plan,
        }
    }
}

/// The shared coding session (`support::coding_session`) as chat request bodies.
fn coding_session(n_turns: usize, words: usize) -> Vec<Vec<u8>> {
    let agent = CodingAgent { model: "test-model", tool: "terminal", id_prefix: "call_", reasoning: None };
    crate::support::coding_session(&agent, n_turns, words).iter().map(|body| body.to_string().into_bytes()).collect()
}

fn compactor_with(yaml: &str, engine: Arc<dyn CompactEngine>) -> SessionCompactor {
    SessionCompactor::new(&Config::from_yaml(yaml).unwrap(), engine).unwrap()
}

fn run(
    compactor: &SessionCompactor,
    session: &str,
    requests: &[Vec<u8>],
    window: u64,
) -> Vec<(Vec<String>, CompactOutput)> {
    requests
        .iter()
        .map(|raw| {
            let body = ChatBody::parse(raw).unwrap();
            let out = compactor.compact_body(session, &body, Some(window));
            let forwarded = out.body.clone().unwrap_or_else(|| raw.clone());
            let fb = ChatBody::parse(&forwarded).unwrap();
            let messages = fb.messages().iter().map(|m| (*m).to_owned()).collect();
            (messages, out)
        })
        .collect()
}

const WINDOW: u64 = 8192;
const RESERVE_YAML: &str = "budget:\n  output_reserve: 1024\n  high_water: 0.75\n  low_water: 0.5\n";

#[test]
fn epoch_mode_is_append_only_between_epochs() {
    let compactor = compactor_with(RESERVE_YAML, MaskEngine::new(2));
    let results = run(&compactor, "s", &coding_session(40, 150), WINDOW);
    let epochs = results.last().unwrap().1.summary.epoch;
    assert!(epochs >= 2, "the session should need several epochs, got {epochs}");
    for pair in results.windows(2) {
        let ((before, out_before), (after, out_after)) = (&pair[0], &pair[1]);
        if out_before.summary.epoch == out_after.summary.epoch {
            assert!(after.len() >= before.len() && after[..before.len()] == before[..], "not a pure append");
        }
    }
}

/// With counts deferred, a request that surely appends is decided on upper bounds of its new
/// messages' tokens: it forwards the bytes counting first forwards, its late count gives the same
/// summary, and a late count that never ran (every third request here) leaves nothing wrong behind —
/// the next request counts those messages itself. Epochs and eager advances are never deferred.
#[test]
fn deferred_counts_forward_the_same_bytes_and_settle_to_the_same_summary() {
    // Eager advances every `polling` turns: every 3rd here, so that it has requests that append.
    for mode in ["epoch", "eager", "off"] {
        let yaml = format!("{RESERVE_YAML}  polling: 3\ncompaction:\n  mode: {mode}\n");
        let (at_once, deferred) =
            (compactor_with(&yaml, MaskEngine::new(2)), compactor_with(&yaml, MaskEngine::new(2)));
        let (mut late, mut compacted) = (0, 0);
        for (k, raw) in coding_session(40, 150).iter().enumerate() {
            let body = ChatBody::parse(raw).unwrap();
            let messages = pare::wire::WireBody::messages(&body);
            let hashes = pare::neutral::message_hashes(&messages);
            let want = at_once.compact_messages("s", &body, &messages, &hashes, Some(WINDOW), false);
            let got = deferred.compact_messages("s", &body, &messages, &hashes, Some(WINDOW), true);
            assert!(want.late.is_none(), "{mode}: nothing is deferred unless asked");
            assert_eq!(got.body, want.body, "{mode}, request {k}: the same bytes forwarded");
            let action = want.summary.report.as_ref().and_then(|r| r.action);
            match got.late {
                Some(count) => {
                    late += 1;
                    assert_ne!(action, Some(Action::Epoch), "{mode}, request {k}: an epoch is never deferred");
                    assert_ne!(action, Some(Action::Advance), "{mode}, request {k}: an advance is never deferred");
                    assert!(got.summary.tokens_raw >= want.summary.tokens_raw, "the bounds are upper bounds");
                    if k % 3 != 2 {
                        assert_eq!(count(got.summary), want.summary, "{mode}, request {k}: settled summary");
                    }
                }
                None => {
                    compacted += usize::from(action.is_some_and(|a| a != Action::Append));
                    assert_eq!(got.summary, want.summary, "{mode}, request {k}");
                }
            }
        }
        assert!(late > 10, "{mode}: most requests append and are deferred, got {late}");
        if mode != "off" {
            assert!(compacted > 0, "{mode}: the session also compacts (counted at once)");
        }
    }
}

#[test]
fn epoch_fires_at_high_water_and_lands_under_low_water() {
    let compactor = compactor_with(RESERVE_YAML, MaskEngine::new(2));
    let usable = (WINDOW - 1024) as f64;
    let results = run(&compactor, "s", &coding_session(40, 150), WINDOW);
    let mut previous_epoch = 0;
    for (k, (_, out)) in results.iter().enumerate() {
        let s = &out.summary;
        if s.epoch == 0 {
            assert!(out.body.is_none(), "request {k}: nothing compacted before the first epoch");
            assert_eq!(s.tokens_raw, s.tokens_forwarded);
        }
        if s.epoch > previous_epoch {
            assert_eq!(s.report.as_ref().unwrap().action, Some(Action::Epoch));
            assert!(s.tokens_forwarded as f64 <= 0.5 * usable, "request {k}: epoch landed at {}", s.tokens_forwarded);
        } else {
            assert!(s.tokens_forwarded as f64 <= 0.75 * usable, "request {k}: {} over high water", s.tokens_forwarded);
        }
        assert!(!s.over_window);
        previous_epoch = s.epoch;
    }
    assert!(
        results.iter().any(|(_, o)| o.summary.tokens_raw as f64 > usable),
        "raw must overflow for this test to mean something"
    );
}

#[test]
fn an_epoch_cuts_the_rules_output_only_when_the_rules_reach_low_water() {
    // Tool outputs dominate: masking them (the "rules") reaches low water; the engine is asked once
    // per epoch, with the low-water target, and the epoch keeps the lightest cut (see below).
    let low_water = ((WINDOW - 1024) as f64 * 0.5) as u64;
    let engine = MaskEngine::new(2);
    let compactor = compactor_with(RESERVE_YAML, engine.clone());
    let results = run(&compactor, "s", &coding_session(20, 150), WINDOW);
    let epochs = results.last().unwrap().1.summary.epoch as usize;
    assert!(epochs > 0);
    assert_eq!(engine.calls(), epochs, "one engine run per epoch");
    assert!(engine.targets.lock().unwrap().iter().all(|t| *t == Some(low_water)));
    assert!(engine.fitted.lock().unwrap().iter().all(|f| !f));

    // Assistant prose dominates: masking tool outputs cannot reach low water, so the engine fits the
    // whole request (tiers and elision in the real engine) and the epoch forwards that whole fit:
    // every tool output before the engine's tail is masked, none is kept whole by a cut.
    let engine = MaskEngine::new(2);
    let compactor = compactor_with(RESERVE_YAML, engine.clone());
    let results = run(&compactor, "s", &chatty_session(20, 5, 100), WINDOW);
    let targets = engine.targets.lock().unwrap().clone();
    assert_eq!(targets.last(), Some(&Some(low_water)), "{targets:?}");
    assert_eq!(engine.fitted.lock().unwrap().last(), Some(&true));
    let k = results.iter().position(|(_, o)| o.summary.epoch == 1).unwrap();
    let messages = &results[k].0;
    let assistants: Vec<usize> = (0..messages.len()).filter(|&i| role(&messages[i]) == "assistant").collect();
    let tail = assistants[assistants.len() - 2];
    let tools: Vec<&String> = messages[..tail].iter().filter(|m| role(m) == "tool").collect();
    assert!(!tools.is_empty());
    assert!(tools.iter().all(|m| m.contains("[elided]")), "the whole fit is forwarded");
}

/// [`coding_session`] with `thinking out loud` `note_repeats` times in every assistant message: the
/// rules do not shorten recent notes, so with short outputs they cannot reach low water and an
/// epoch fits.
fn chatty_session(n_turns: usize, words: usize, note_repeats: usize) -> Vec<Vec<u8>> {
    coding_session(n_turns, words)
        .into_iter()
        .map(|raw| {
            let mut v: Value = serde_json::from_slice(&raw).unwrap();
            for m in v["messages"].as_array_mut().unwrap() {
                if m["role"] == "assistant" {
                    m["content"] = json!("thinking out loud ".repeat(note_repeats));
                }
            }
            v.to_string().into_bytes()
        })
        .collect()
}

/// A fitted epoch keeps the head of the previous forwarded request, which the upstream holds
/// cached, byte-identical and fits only what follows. A fit of the whole request gives the oldest
/// turns the least room and rewrites the conversation from just after the task on; here every
/// epoch's request starts with more than the system prompt and task of the request before it, and
/// still lands under low water.
#[test]
fn a_fitted_epoch_keeps_the_head_the_upstream_holds_cached() {
    let engine = Arc::new(pare::compact::Engine::default_pack());
    let compactor = compactor_with("budget:\n  output_reserve: 1024\n  history_floor: null\n", engine.clone());
    let window = 16_384;
    let usable = (window - 1024) as f64;
    let session = chatty_session(150, 20, 50);
    let results = run(&compactor, "s", &session, window);
    let mut shared_at_epochs = Vec::new();
    for k in 1..results.len() {
        let summary = &results[k].1.summary;
        if !summary.epoch_started {
            continue;
        }
        let tiers = summary.report.as_ref().and_then(|r| r.engine.as_ref()).and_then(|e| e.tiers.clone()).unwrap();
        assert!(tiers.target_tokens.is_some_and(|t| tiers.tokens_after_rules > t), "request {k}: a fitted epoch");
        assert!(summary.tokens_forwarded as f64 <= 0.4 * usable, "request {k}: {}", summary.tokens_forwarded);
        let (before, after) = (&results[k - 1].0, &results[k].0);
        shared_at_epochs.push(before.iter().zip(after).take_while(|(a, b)| a == b).count());
    }
    assert!(shared_at_epochs.len() >= 3, "{shared_at_epochs:?}");
    assert!(shared_at_epochs.iter().all(|&shared| shared > 2), "{shared_at_epochs:?}");

    // The head reaches as far as the previous request, however its messages were counted.
    let deferred = compactor_with("budget:\n  output_reserve: 1024\n  history_floor: null\n", engine);
    for (k, raw) in session.iter().enumerate() {
        let body = ChatBody::parse(raw).unwrap();
        let messages = pare::wire::WireBody::messages(&body);
        let hashes = pare::neutral::message_hashes(&messages);
        let out = deferred.compact_messages("s", &body, &messages, &hashes, Some(window), true);
        assert_eq!(out.body, results[k].1.body, "request {k}");
    }
}

#[test]
fn epoch_compacts_only_as_much_as_needed() {
    let compactor = compactor_with(RESERVE_YAML, MaskEngine::new(2));
    let results = run(&compactor, "s", &coding_session(40, 150), WINDOW);
    let k = results.iter().position(|(_, o)| o.summary.epoch == 1).unwrap();
    let messages = &results[k].0;
    let tools_before_tail: Vec<&String> = messages[..messages.len() - 4].iter().filter(|m| role(m) == "tool").collect();
    let masked = tools_before_tail.iter().filter(|m| m.contains("[elided]")).count();
    assert!(masked > 0, "the epoch compacted something");
    assert!(masked < tools_before_tail.len(), "the newer outputs outside the engine's tail stay whole");
    assert!(results[k].1.summary.tokens_forwarded as f64 <= 0.5 * (WINDOW - 1024) as f64);
}

#[test]
fn compacted_prefix_is_sticky_across_requests() {
    let engine = MaskEngine::new(2);
    let compactor = compactor_with(RESERVE_YAML, engine.clone());
    let requests = coding_session(40, 150);
    let mut results = Vec::new();
    let mut epoch = 0;
    for raw in &requests {
        let calls_before = engine.calls();
        let out = run(&compactor, "s", std::slice::from_ref(raw), WINDOW).pop().unwrap();
        if out.1.summary.epoch == epoch {
            assert_eq!(engine.calls(), calls_before, "requests between epochs do not call the engine");
        }
        epoch = out.1.summary.epoch;
        results.push(out);
    }
    let first_epoch = results.iter().position(|(_, o)| o.summary.epoch == 1).unwrap();
    let next = first_epoch + 1;
    assert_eq!(results[next].1.summary.epoch, 1);
    let (epoch_msgs, next_msgs) = (&results[first_epoch].0, &results[next].0);
    assert_eq!(next_msgs[..epoch_msgs.len()], epoch_msgs[..]);
    assert!(next_msgs.iter().any(|m| m.contains("[elided]")), "the compacted form is reused");
}

#[test]
fn edited_history_starts_fresh() {
    let compactor = compactor_with(RESERVE_YAML, MaskEngine::new(2));
    let requests = coding_session(30, 150);
    let results = run(&compactor, "s", &requests[..20], WINDOW);
    assert!(results.last().unwrap().1.summary.epoch >= 1);
    // The agent rewrites its first user message (e.g. a retry with an edited prompt).
    let edited = String::from_utf8(requests[20].clone()).unwrap().replace("Fix the failing test", "Fix the flaky test");
    let body = ChatBody::parse(edited.as_bytes()).unwrap();
    let out = compactor.compact_body("s", &body, Some(WINDOW));
    assert!(out.summary.report.unwrap().history_changed);
    let forwarded = out.body.unwrap_or_else(|| edited.clone().into_bytes());
    let forwarded = String::from_utf8(forwarded).unwrap();
    assert!(forwarded.contains("Fix the flaky test"));
    assert!(out.summary.tokens_forwarded as f64 <= 0.75 * (WINDOW - 1024) as f64);
}

#[test]
fn eager_mode_advances_every_polling_turns() {
    let engine = MaskEngine::new(2);
    let yaml = "compaction:\n  mode: eager\nbudget:\n  polling: 3\n  output_reserve: 1024\n";
    let compactor = compactor_with(yaml, engine.clone());
    // A large window: never at high water, so only polling advances the frontier.
    let results = run(&compactor, "s", &coding_session(13, 40), 1_000_000);
    let actions: Vec<Action> =
        results.iter().map(|(_, o)| o.summary.report.as_ref().unwrap().action.unwrap()).collect();
    let advances: Vec<usize> =
        actions.iter().enumerate().filter(|(_, a)| **a == Action::Advance).map(|(i, _)| i).collect();
    assert_eq!(advances, vec![0, 3, 6, 9, 12], "{actions:?}");
    assert!(engine.targets.lock().unwrap().iter().all(Option::is_none), "no target below high water");
    for (k, pair) in results.windows(2).enumerate() {
        if actions[k + 1] == Action::Append {
            let (before, after) = (&pair[0].0, &pair[1].0);
            assert_eq!(after[..before.len()], before[..], "request {}: not a pure append", k + 1);
        }
    }
    let last = &results.last().unwrap().1.summary;
    assert!(last.tokens_forwarded < last.tokens_raw, "eager compacts below high water");
}

#[test]
fn eager_and_epoch_each_use_their_own_water_marks() {
    let yaml = "budget:\n  output_reserve: 1024\n  high_water: 0.9\n  low_water: 0.5\n  \
                eager_high_water: 0.3\n  eager_low_water: 0.2\n";
    let usable = (WINDOW - 1024) as f64;
    // Outputs of about 600 tokens: two of them (the engine's tail) cross eager's 0.3.
    let session = coding_session(20, 150);
    for (mode, high, low) in [("eager", 0.3, 0.2), ("epoch", 0.9, 0.5)] {
        let engine = MaskEngine::new(2);
        let compactor = compactor_with(&format!("compaction:\n  mode: {mode}\n{yaml}"), engine.clone());
        let results = run(&compactor, "s", &session, WINDOW);
        let targets = engine.targets.lock().unwrap().clone();
        let target = (low * usable) as u64;
        assert!(targets.contains(&Some(target)), "{mode}: the engine never got {target}: {targets:?}");
        assert!(targets.iter().all(|t| t.is_none() || *t == Some(target)), "{mode}: {targets:?}");
        // A request is compacted to the target exactly when what pare would otherwise forward (the
        // previous forwarded messages, then the new raw ones) is over the mode's high-water mark.
        let tokens = counter(Encoding::O200kBase);
        let mut crossed = false;
        for (k, (_, out)) in results.iter().enumerate() {
            let raw = ChatBody::parse(&session[k]).unwrap();
            let candidate: Vec<String> = match k.checked_sub(1) {
                None => raw.messages().iter().map(|m| (*m).to_owned()).collect(),
                Some(p) => {
                    let before = ChatBody::parse(&session[p]).unwrap().messages().len();
                    let since = raw.messages()[before..].iter().map(|m| (*m).to_owned());
                    results[p].0.iter().cloned().chain(since).collect()
                }
            };
            let over = tokens.count_request(&candidate, None) as f64 > high * usable;
            crossed |= over;
            assert_eq!(out.summary.report.as_ref().unwrap().action == Some(Action::Epoch), over, "{mode}, request {k}");
        }
        assert!(crossed, "{mode}: the session must cross {high}");
    }
}

#[test]
fn eager_gives_the_engine_its_history_budget_and_epoch_does_not() {
    let custom = "  eager_history:\n    high: 0.125\n    low: 0.05\n";
    // The shares of this window's usable tokens (8,192 − the 1,024 reserved for the answer).
    let tokens = |share: HistoryShare| {
        let (high, low) = share.tokens(WINDOW - 1024);
        Some(HistoryBudget { high, low })
    };
    let cases = [
        ("eager", "", tokens(HistoryShare::default())),
        ("eager", custom, Some(HistoryBudget { high: 896, low: 358 })),
        ("eager", "  eager_history: null\n", None),
        ("epoch", custom, None),
    ];
    for (mode, history, want) in cases {
        let yaml = format!("compaction:\n  mode: {mode}\n{RESERVE_YAML}{history}");
        let engine = MaskEngine::new(2);
        let compactor = compactor_with(&yaml, engine.clone());
        // Outputs of about 600 tokens: an epoch fires in this window.
        let _ = run(&compactor, "s", &coding_session(20, 150), WINDOW);
        let histories = engine.histories.lock().unwrap().clone();
        assert!(!histories.is_empty(), "{yaml}: the engine never ran");
        assert!(histories.iter().all(|h| *h == want), "{yaml}: {histories:?}");
    }
}

/// The history budget with the real engine: in eager mode old turns are elided once the history
/// passes its high mark, a share of the window, even where the window marks never fire.
#[test]
fn eager_bounds_the_history_as_a_share_of_the_window() {
    let engine = Arc::new(pare::compact::Engine::default_pack());
    let session = coding_session(40, 120);
    let last = |yaml: &str| {
        let compactor = compactor_with(yaml, engine.clone());
        run(&compactor, "s", &session, 1_000_000).pop().unwrap()
    };
    let elided = |messages: &[String]| messages.iter().any(|m| m.contains("earlier messages elided"));
    // 0.1 % and 0.04 % of the usable million: about 1,000 and 400 tokens of history.
    let budget = "compaction:\n  mode: eager\nbudget:\n  eager_history:\n    high: 0.001\n    low: 0.0004\n";
    let (bounded, bounded_out) = last(budget);
    let (unbounded, unbounded_out) = last("compaction:\n  mode: eager\nbudget:\n  eager_history: null\n");
    assert!(elided(&bounded), "no elision marker: {bounded:?}");
    assert!(!elided(&unbounded), "elided without a history budget: {unbounded:?}");
    let (b, u) = (bounded_out.summary.tokens_forwarded, unbounded_out.summary.tokens_forwarded);
    assert!(b + 500 < u, "bounded {b} vs unbounded {u} tokens");
}

/// The history floor with the real engine: where the task and the protected tail leave the history
/// little of the low-water target, an epoch lands higher (so the history keeps more of the old turns),
/// never above the ceiling `low + max_rise × (high − low)`; without the floor it lands under low water.
#[test]
fn an_epochs_history_floor_raises_where_it_lands_up_to_its_ceiling() {
    let engine = Arc::new(pare::compact::Engine::default_pack());
    let session = coding_session(60, 150);
    let window = 16_384;
    let usable = (window - 1024) as f64;
    let landings = |floor: &str| -> Vec<u64> {
        let yaml = format!("budget:\n  output_reserve: 1024\n  high_water: 0.9\n  low_water: 0.3\n  {floor}\n");
        let compactor = compactor_with(&yaml, engine.clone());
        let results = run(&compactor, "s", &session, window);
        results.iter().filter(|(_, o)| o.summary.epoch_started).map(|(_, o)| o.summary.tokens_forwarded).collect()
    };
    let without = landings("history_floor: null");
    let with = landings("history_floor:\n    tokens: 3000\n    max_rise: 0.5");
    assert!(!without.is_empty() && !with.is_empty(), "no epoch: {without:?} {with:?}");
    assert!(without.iter().all(|&t| t as f64 <= 0.3 * usable), "{without:?} {with:?}");
    assert!(with.iter().all(|&t| t as f64 <= 0.6 * usable), "{with:?}");
    assert!(with[0] as f64 > 0.3 * usable && with[0] > without[0], "{with:?} vs {without:?}");

    // The defaults: 3,000 tokens, up to 0.4 + 0.6 × (0.9 − 0.4) = 0.7 of the usable window; epoch mode only.
    let floor = EpochPolicy::from_config(&Config::default()).history_floor(12_288);
    assert_eq!(floor, Some(HistoryFloor { tokens: 3000, max_target: 8601 }));
    let eager = Config::from_yaml("compaction:\n  mode: eager\n").unwrap();
    assert_eq!(EpochPolicy::from_config(&eager).history_floor(12_288), None);
}

/// An epoch's depth follows the session's growth: the history floor raises the target no higher
/// than leaves `epoch_room` requests of it below the high-water mark, and never lowers it under
/// low water.
#[test]
fn an_epochs_depth_leaves_room_for_the_sessions_next_requests() {
    use pare::budget::compactor::turn_growth;
    let policy = EpochPolicy::from_config(&Config::default());
    assert_eq!(policy.epoch_room, 2);
    // 16k, 12,288 usable: high water 11,059, low water 4,915, the floor's own ceiling 8,601.
    let max_target = |growth: u64| policy.epoch_floor(12_288, growth).map(|f| f.max_target);
    assert_eq!(max_target(0), Some(8601), "a session that does not grow keeps the floor's ceiling");
    assert_eq!(max_target(1000), Some(8601), "room for 2 × 1,000 under 11,059 leaves the ceiling");
    assert_eq!(max_target(1500), Some(11_059 - 3000));
    assert_eq!(max_target(2500), Some(11_059 - 5000));
    assert_eq!(max_target(4300), Some(4915), "never under low water");
    let off = EpochPolicy { epoch_room: 0, ..policy.clone() };
    assert_eq!(off.epoch_floor(12_288, 4300), off.history_floor(12_288));
    let no_floor = EpochPolicy { history_floor: None, ..policy };
    assert_eq!(no_floor.epoch_floor(12_288, 1000), None);

    // Growth: the mean of the last (up to 8) turns, each an assistant message and what follows it.
    let roles = |rs: &[&str]| -> Vec<String> { rs.iter().map(|r| json!({"role": r}).to_string()).collect() };
    let messages = roles(&["system", "user", "assistant", "tool", "assistant", "tool", "tool"]);
    let messages: Vec<&str> = messages.iter().map(String::as_str).collect();
    assert_eq!(turn_growth(&messages, &[900, 100, 10, 290, 20, 200, 180]), (300 + 400) / 2);
    assert_eq!(turn_growth(&messages[..2], &[900, 100]), 0, "no turn yet");
    let long = roles(&["assistant", "tool"].repeat(12));
    let long: Vec<&str> = long.iter().map(String::as_str).collect();
    let counts: Vec<u64> = (0..24).map(|i| if i < 8 { 10_000 } else { 50 }).collect();
    assert_eq!(turn_growth(&long, &counts), 100, "the last eight turns only");
}

#[test]
fn a_models_entry_sets_the_encoding_window_and_reserve_the_compactor_uses() {
    let yaml = "models:\n  - match: \"^legacy\"\n    context_window: 3000\n    output_reserve: 500\n    \
                encoding: cl100k_base\nbudget:\n  default_context_window: 9000\n  detect_window: false\n";
    let compactor = compactor_with(yaml, MaskEngine::new(2));
    let body = |model: &str, extra: &str| {
        format!(r#"{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}]{extra}}}"#).into_bytes()
    };
    let legacy = body("legacy-7b", "");
    let parsed = ChatBody::parse(&legacy).unwrap();
    assert_eq!(compactor.counter(parsed.split.model().as_deref()).encoding(), Encoding::Cl100kBase);
    assert_eq!(compactor.window_and_reserve(&parsed, None), (3000, 500));
    // The request's own max_tokens is the reserve, whatever the model's.
    let asks = body("legacy-7b", r#","max_tokens":700"#);
    assert_eq!(compactor.window_and_reserve(&ChatBody::parse(&asks).unwrap(), None), (3000, 700));
    let other = body("qwen3", r#","max_completion_tokens":100"#);
    let parsed = ChatBody::parse(&other).unwrap();
    assert_eq!(compactor.counter(parsed.split.model().as_deref()).encoding(), Encoding::O200kBase);
    assert_eq!(compactor.window_and_reserve(&parsed, None), (9000, 100));
    // The counts in the summary are the model's encoding's.
    let text = "Ünïcödé façade naïve — 東京 ".repeat(40);
    let session =
        |model: &str| json!({"model": model, "messages": [{"role": "user", "content": text}]}).to_string().into_bytes();
    let (legacy_tokens, other_tokens) = (
        compactor.compact_body("a", &ChatBody::parse(&session("legacy-7b")).unwrap(), None).summary.tokens_raw,
        compactor.compact_body("b", &ChatBody::parse(&session("qwen3")).unwrap(), None).summary.tokens_raw,
    );
    let message = json!({"role": "user", "content": text}).to_string();
    assert_eq!(legacy_tokens, counter(Encoding::Cl100kBase).count_request(&[message.as_str()], None));
    assert_eq!(other_tokens, counter(Encoding::O200kBase).count_request(&[message.as_str()], None));
    assert_ne!(legacy_tokens, other_tokens);
}

/// With `salience.tau_seconds` and a clock, the engine is given each message's age: the time since
/// the request that first carried it, kept for the frozen prefix across epochs. Without
/// `tau_seconds` (or without a clock, as in replay) it is given none.
#[test]
fn the_compactor_gives_the_engine_message_ages_on_the_wall_clock() {
    use std::sync::atomic::AtomicU64;
    let session = coding_session(20, 150);
    let yaml = format!("{RESERVE_YAML}  salience:\n    tau_seconds: 600\n");
    let config = Config::from_yaml(&yaml).unwrap();
    let now = Arc::new(AtomicU64::new(1_000_000));
    let clock_now = now.clone();
    let clock: pare::budget::compactor::Clock = Arc::new(move || clock_now.load(Ordering::SeqCst));
    let engine = MaskEngine::new(2);
    let compactor = SessionCompactor::new(&config, engine.clone()).unwrap().with_wall_clock(&config, clock.clone());
    // Request k arrives at 1,000 s + 10 s·k; its two new messages arrive with it.
    let mut ages_seen = Vec::new();
    for (k, raw) in session.iter().enumerate() {
        now.store(1_000_000 + 10_000 * k as u64, Ordering::SeqCst);
        let calls = engine.calls();
        compactor.compact_body("s", &ChatBody::parse(raw).unwrap(), Some(WINDOW));
        if engine.calls() > calls {
            ages_seen.push((k, engine.ages.lock().unwrap().last().unwrap().clone().expect("ages given")));
        }
    }
    assert!(ages_seen.len() >= 2, "two epochs at least: {}", ages_seen.len());
    for (k, ages) in &ages_seen {
        // Message j > 1 came with request (j - 2) / 2 + 1; the system prompt and task with request 0.
        let want: Vec<f64> = (0..ages.len())
            .map(|j| if j < 2 { 10.0 * *k as f64 } else { 10.0 * (*k - ((j - 2) / 2 + 1)) as f64 })
            .collect();
        assert_eq!(ages, &want, "request {k}");
    }
    // No tau_seconds: no ages, clock or not.
    let engine = MaskEngine::new(2);
    let plain = Config::from_yaml(RESERVE_YAML).unwrap();
    let compactor = SessionCompactor::new(&plain, engine.clone()).unwrap().with_wall_clock(&plain, clock);
    let _ = run(&compactor, "s", &session, WINDOW);
    let ages = engine.ages.lock().unwrap().clone();
    assert!(!ages.is_empty() && ages.iter().all(Option::is_none), "{ages:?}");
}

#[test]
fn off_mode_forwards_unchanged_and_still_counts() {
    let engine = MaskEngine::new(2);
    let compactor = compactor_with("compaction:\n  mode: off\n", engine.clone());
    let requests = coding_session(30, 150);
    let results = run(&compactor, "s", &requests, 4096);
    for (_, out) in &results {
        assert!(out.body.is_none());
        assert_eq!(out.summary.tokens_raw, out.summary.tokens_forwarded);
        assert!(out.summary.tokens_raw > 0);
    }
    assert!(results.last().unwrap().1.summary.over_window);
    assert_eq!(engine.calls(), 0);
}

#[test]
fn over_window_is_flagged_when_the_tail_alone_does_not_fit() {
    let compactor = compactor_with(RESERVE_YAML, MaskEngine::new(2));
    // Two huge turns, both protected: nothing can be compacted.
    let requests = coding_session(3, 3000);
    let results = run(&compactor, "s", &requests, WINDOW);
    let last = &results.last().unwrap().1.summary;
    assert!(last.over_window);
    // What the archive stores of the exchange says so (the summary is archived as JSON).
    assert_eq!(serde_json::to_value(last).unwrap()["over_window"], true);
    assert_eq!(last.tokens_forwarded, last.tokens_raw, "forwarded anyway");
    let first = &results[0].1.summary;
    assert!(!first.over_window && serde_json::to_value(first).unwrap()["over_window"] == false);
}

#[test]
fn session_memory_is_bounded_in_bytes() {
    // Long enough to start an epoch: the frozen prefix is what a session's state weighs.
    let requests = coding_session(40, 150);
    // What one session of these requests weighs, over the caches' reservation.
    let measure = Arc::new(StateBudget::new(u64::MAX));
    let compactor = compactor_with(RESERVE_YAML, MaskEngine::new(2)).with_budget(measure.clone());
    run(&compactor, "a", &requests, WINDOW);
    let stats = measure.stats();
    let one = stats.held_bytes - stats.reserved_bytes;
    assert!(one > pare::memory::SESSION_OVERHEAD_BYTES, "{stats:?}");

    let budget = Arc::new(StateBudget::new(stats.reserved_bytes + 2 * one + one / 2));
    let compactor = compactor_with(RESERVE_YAML, MaskEngine::new(2)).with_budget(budget.clone());
    for session in ["a", "b", "c"] {
        run(&compactor, session, &requests, WINDOW);
    }
    assert_eq!(compactor.n_sessions(), 2);
    let stats = budget.stats();
    assert_eq!((stats.sessions, stats.evictions), (2, 1));
    assert!(stats.held_bytes <= stats.max_bytes, "{stats:?}");
    assert!(compactor.remembers("c") && !compactor.remembers("a"));
}

#[test]
fn sessions_do_not_share_state() {
    let compactor = compactor_with(RESERVE_YAML, MaskEngine::new(2));
    let requests = coding_session(40, 150);
    let a = run(&compactor, "a", &requests, WINDOW);
    let b = run(&compactor, "b", &requests, WINDOW);
    for ((fa, oa), (fb, ob)) in a.iter().zip(&b) {
        assert_eq!(fa, fb);
        assert_eq!(oa.summary, ob.summary);
    }
}

/// A stored prefix without what became of each message it covers (a plan from a pare that did not
/// keep it) cannot be written back: the resumed session compacts afresh, as a session pare never saw
/// does, while one resumed with its fates goes on forwarding what it would have.
#[test]
fn a_stored_prefix_without_its_fates_is_compacted_afresh() {
    let requests = coding_session(40, 150);
    let original = compactor_with(RESERVE_YAML, MaskEngine::new(2)).recording_plans();
    let results = run(&original, "s", &requests, WINDOW);
    let k = results.iter().position(|(_, o)| o.summary.epoch == 1).unwrap();
    let replayed = compactor_with(RESERVE_YAML, MaskEngine::new(2)).recording_plans();
    run(&replayed, "s", &requests[..=k], WINDOW);
    let plan = replayed.take_plan("s").expect("the epoch stored a plan");
    assert!(plan.frozen.as_ref().is_some_and(|f| f.plan.is_some()));
    let last_raw = pare::neutral::message_hashes(ChatBody::parse(&requests[k]).unwrap().messages());

    let with_fates = compactor_with(RESERVE_YAML, MaskEngine::new(2));
    with_fates.resume("s", plan.clone(), &last_raw);
    let next = run(&with_fates, "s", &requests[k + 1..k + 2], WINDOW);
    assert_eq!(next[0].0, results[k + 1].0, "resumed with its fates");

    let mut without = plan;
    without.frozen.as_mut().unwrap().plan = None;
    let resumed = compactor_with(RESERVE_YAML, MaskEngine::new(2));
    resumed.resume("s", without, &last_raw);
    let after = run(&resumed, "s", &requests[k + 1..k + 2], WINDOW);
    let fresh = run(&compactor_with(RESERVE_YAML, MaskEngine::new(2)), "s", &requests[k + 1..k + 2], WINDOW);
    assert_eq!(after[0].0, fresh[0].0, "compacted afresh");
    assert_ne!(after[0].0, results[k + 1].0, "not the prefix it cannot write");
}

// ---- replay ----

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/sessions");

#[test]
fn replay_is_deterministic_and_matches_the_compactor_path() {
    let path = format!("{FIXTURES}/swe-agent/function_calling_simple.jsonl");
    let run_cli = || {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_pare"))
            .args(["replay", "--window", "4096", &path])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        out.stdout
    };
    let first = run_cli();
    assert_eq!(first, run_cli(), "same input and config give the same bytes");

    let text = std::fs::read(&path).unwrap();
    let lines = session_lines(&text);
    let compactor = SessionCompactor::new(&Config::default(), Arc::new(pare::compact::Engine::default_pack())).unwrap();
    let library: Vec<u8> = replay_session(&compactor, Wire::Chat, &path, &lines, Some(4096))
        .into_iter()
        .flat_map(|r| r.forwarded.into_iter().chain(std::iter::once(b'\n')))
        .collect();
    assert_eq!(first, library);
    assert_eq!(session_lines(&first).len(), lines.len());
}

#[test]
fn replay_forwards_unparseable_lines_unchanged() {
    let compactor = compactor_with("", MaskEngine::new(2));
    let good = coding_session(2, 5);
    let lines: Vec<&[u8]> = vec![&good[0], b"{broken", &good[1]];
    let out = replay_session(&compactor, Wire::Chat, "s", &lines, Some(WINDOW));
    assert_eq!(out[1].forwarded, b"{broken");
    assert!(out[1].summary.is_none() && out[1].skipped.is_some());
    assert!(out[2].summary.is_some());
}

/// The issue's acceptance check: the proxy forwards exactly what `pare replay` predicts.
#[tokio::test]
async fn proxy_forwards_what_replay_predicts() {
    proxy_matches_replay(Mode::Epoch, &|| MaskEngine::new(2) as Arc<dyn CompactEngine>).await;
}

/// After a restart pare rebuilds each session's compacted prefix from the archive: the requests after
/// it are forwarded exactly as an uninterrupted pare would have forwarded them (an append to the
/// last epoch's prefix, not a fresh epoch), and no phantom epoch is counted.
#[tokio::test]
async fn a_restarted_pare_picks_up_the_sticky_prefix_from_the_archive() {
    use crate::support::stub::Stub;
    use crate::support::{client, pare as in_process, within};
    use pare::pipeline::Pipeline;

    let stub = Stub::start(Stub::openai).await;
    let dir = tempfile::tempdir().unwrap();
    let mut config = in_process::config_for(&stub);
    config.archive.enabled = true;
    config.archive.dir = Some(dir.path().to_owned());
    config.budget.default_context_window = WINDOW;
    config.budget.output_reserve = 1024;
    config.budget.detect_window = false;
    let config = Arc::new(config);
    let requests = coding_session(30, 150);
    let start = || async {
        let pipeline = Arc::new(Pipeline::from_config(config.clone()).unwrap());
        in_process::start_with_pipeline(config.clone(), pipeline).await
    };
    let send = |server: &in_process::Pare, body: &[u8]| {
        let request = client()
            .post(server.url("/v1/chat/completions"))
            .header("content-type", "application/json")
            .header("x-pare-session", "restarted")
            .body(body.to_vec())
            .send();
        async move {
            let response = within("pare to answer", request).await.unwrap();
            assert!(response.status().is_success(), "{}", response.status());
            response.bytes().await.unwrap();
        }
    };
    let restart_at = 20;
    let first = start().await;
    for body in &requests[..restart_at] {
        send(&first, body).await;
    }
    first.shutdown().await.unwrap();
    let second = start().await;
    for body in &requests[restart_at..] {
        send(&second, body).await;
    }
    let metrics = client().get(second.url("/_pare/metrics")).send().await.unwrap().text().await.unwrap();
    second.shutdown().await.unwrap();

    let compactor = SessionCompactor::new(&config, Arc::new(pare::compact::Engine::default_pack())).unwrap();
    let lines: Vec<&[u8]> = requests.iter().map(Vec::as_slice).collect();
    let predicted = replay_session(&compactor, Wire::Chat, "uninterrupted", &lines, None);
    let received: Vec<Vec<u8>> = stub.requests().into_iter().map(|r| r.body.to_vec()).collect();
    assert_eq!(received.len(), requests.len());
    let epochs_before: Vec<usize> = (0..restart_at).filter(|&k| epoch_started(&predicted[k])).collect();
    assert!(!epochs_before.is_empty() && received[restart_at - 1] != requests[restart_at - 1], "no epoch before");
    for (k, (got, want)) in received.iter().zip(&predicted).enumerate() {
        assert!(*got == want.forwarded, "request {k}: not what an uninterrupted pare forwards");
    }
    let epochs_after = (restart_at..requests.len()).filter(|&k| epoch_started(&predicted[k])).count();
    let counted = metrics
        .lines()
        .find_map(|l| l.strip_prefix(r#"pare_epochs_total{model="test-model",wire="chat"} "#))
        .map_or(0, |n| n.parse::<usize>().unwrap());
    assert_eq!(counted, epochs_after, "{metrics}");
}

fn epoch_started(result: &pare::budget::replay::Replayed) -> bool {
    result.summary.as_ref().is_some_and(|s| s.epoch_started)
}

/// A model no `models:` entry names and the upstream reports nothing for is warned about once,
/// by name; a configured one never; the start-up line lists the sources in order.
#[tokio::test]
async fn a_model_on_the_default_window_is_named_once() {
    pare::outbound::install_crypto_provider();
    let config = Config::from_yaml(
        "models:\n  - match: \"^qwen\"\n    context_window: 32768\n  - match: \"^llama\"\n    encoding: cl100k_base\nbudget:\n  detect_window: false\n",
    )
    .unwrap();
    let resolver = WindowResolver::new(
        reqwest::Client::new(),
        "http://127.0.0.1:9/v1",
        ModelTable::from_config(&config).unwrap(),
        DetectConfig::from_budget(&config.budget),
    );
    let sources = resolver.sources();
    assert!(sources.starts_with("models `^qwen` 32768, else the price table ("), "{sources}");
    assert!(sources.ends_with("), else default 65536 (Messages 200000, Gemini 1048576)"), "{sources}");
    let log = crate::engine::Log::default();
    let subscriber = tracing_subscriber::fmt().with_writer(log.clone()).with_ansi(false).finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    for model in ["qwen-7b", "llama-3", "llama-3", "mistral", "qwen-7b"] {
        resolver.window_for(Wire::Chat, Some(model)).await;
    }
    assert_eq!(resolver.window_for(Wire::Messages, Some("claude")).await, 200_000);
    // A model the price table names takes its window from it, unwarned.
    assert_eq!(resolver.resolve(Wire::Chat, Some("gpt-5")).await, (272_000, WindowSource::Prices));
    assert_eq!(resolver.resolve(Wire::Chat, Some("qwen-7b")).await, (32_768, WindowSource::Models));
    assert_eq!(resolver.resolve(Wire::Chat, Some("mistral")).await, (65_536, WindowSource::Default));
    let text = log.text();
    assert_eq!(text.matches("compacting to the default window").count(), 3, "{text}");
    assert!(text.contains("model=\"llama-3\"") && text.contains("model=\"mistral\""), "{text}");
    assert!(text.contains("budget.anthropic_context_window") && !text.contains("qwen"), "{text}");
}

/// A request whose floor (here one user message) does not fit the window is forwarded anyway, as
/// sent, and the answer, the report and the metrics say so.
#[tokio::test]
async fn the_proxy_says_when_it_forwards_over_the_window() {
    use crate::support::stub::Stub;
    use crate::support::{client, pare as in_process};

    let stub = Stub::start(Stub::openai).await;
    let mut config = in_process::config_for(&stub);
    config.budget.default_context_window = 2048;
    config.budget.output_reserve = 512;
    config.budget.detect_window = false;
    let compactor = Arc::new(SessionCompactor::new(&config, Arc::new(pare::compact::Engine::default_pack())).unwrap());
    let server = in_process::start_with_compactor(config, compactor).await;
    let send = |content: String| {
        let body = json!({"model": "test-model", "messages": [{"role": "user", "content": content}]}).to_string();
        client().post(server.url("/v1/chat/completions")).header("content-type", "application/json").body(body).send()
    };
    let small = send("hello".into()).await.unwrap();
    assert_eq!(small.status(), 200);
    assert!(!small.headers().contains_key("x-pare-over-window"));
    assert_eq!(small.headers()["x-pare-window"], "2048", "the window compacted to, on every answer");
    let huge: String = (0..3000).map(|i| format!("word{i} ")).collect();
    let over = send(huge.clone()).await.unwrap();
    assert_eq!(over.status(), 200);
    assert_eq!(over.headers()["x-pare-over-window"], "true");
    let raw_tokens: u64 = over.headers()["x-pare-tokens-raw"].to_str().unwrap().parse().unwrap();
    assert!(raw_tokens > 2048, "{raw_tokens}");
    assert_eq!(over.headers()["x-pare-tokens-forwarded"], over.headers()["x-pare-tokens-raw"]);
    let forwarded = stub.requests().last().unwrap().json();
    assert_eq!(forwarded["messages"][0]["content"], huge, "forwarded as sent");
    let metrics = client().get(server.url("/_pare/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains(r#"pare_over_window_requests_total{model="test-model",wire="chat"} 1"#), "{metrics}");
}

/// The counting thread is a batch thread (`SCHED_BATCH`): waking it to hand it a count never
/// preempts the request that handed it over.
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_counting_thread_is_a_batch_thread() {
    use crate::support::stub::Stub;
    use crate::support::{client, pare as in_process, within};

    let stub = Stub::start(Stub::openai).await;
    let mut config = in_process::config_for(&stub);
    config.budget.default_context_window = WINDOW;
    config.budget.detect_window = false;
    let config = Arc::new(config);
    let pipeline = Arc::new(Pipeline::from_config(config.clone()).unwrap());
    let server = in_process::start_with_pipeline(config, pipeline).await;
    for line in coding_session(6, 150) {
        let response = within(
            "pare to answer",
            client()
                .post(server.url("/v1/chat/completions"))
                .header("content-type", "application/json")
                .header("x-pare-session", "batch-check")
                .body(line)
                .send(),
        )
        .await
        .unwrap();
        assert!(response.status().is_success());
    }
    // /proc/…/stat: the 41st field is the scheduling policy (3: SCHED_BATCH); the 2nd, the name in
    // parentheses, may hold spaces.
    let policy = |stat: &str| -> u32 {
        let after_name = &stat[stat.rfind(')').unwrap() + 2..];
        after_name.split(' ').nth(38).unwrap().parse().unwrap()
    };
    let mut counting = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").unwrap() {
        let task = task.unwrap().path();
        if std::fs::read_to_string(task.join("comm")).is_ok_and(|name| name.trim() == "pare-count") {
            counting.push(policy(&std::fs::read_to_string(task.join("stat")).unwrap()));
        }
    }
    assert_eq!(policy(&std::fs::read_to_string("/proc/thread-self/stat").unwrap()), 0, "this thread is a normal one");
    assert_eq!(counting, vec![3], "one counting thread, a batch thread");
}

/// The same check with the real engine, in both compacting modes (eager with a small history
/// budget, so that tiers and elision run as well as the rules).
#[tokio::test]
async fn proxy_forwards_what_replay_predicts_with_the_real_engine() {
    let engine = || -> Arc<dyn CompactEngine> { Arc::new(pare::compact::Engine::default_pack()) };
    proxy_matches_replay(Mode::Epoch, &engine).await;
    proxy_matches_replay(Mode::Eager, &engine).await;
}

async fn proxy_matches_replay(mode: Mode, engine: &dyn Fn() -> Arc<dyn CompactEngine>) {
    use crate::support::stub::Stub;
    use crate::support::{client, pare as in_process, within};

    let requests = coding_session(40, 150);
    let lines: Vec<&[u8]> = requests.iter().map(Vec::as_slice).collect();

    let stub = Stub::start(Stub::openai).await;
    let mut config = in_process::config_for(&stub);
    config.compaction.mode = mode;
    config.budget.default_context_window = WINDOW;
    config.budget.output_reserve = 1024;
    config.budget.detect_window = false;
    config.budget.eager_history = Some(HistoryShare { high: 0.125, low: 0.05 });
    let compactor = Arc::new(SessionCompactor::new(&config, engine()).unwrap());
    let server = in_process::start_with_compactor(config.clone(), compactor).await;

    let http = client();
    let mut counted = Vec::new();
    for line in &lines {
        let response = within(
            "pare to answer",
            http.post(server.url("/v1/chat/completions"))
                .header("content-type", "application/json")
                .header("x-pare-session", "replay-check")
                .body(line.to_vec())
                .send(),
        )
        .await
        .unwrap();
        assert!(response.status().is_success(), "{}", response.status());
        let header = |name: &str| response.headers()[name].to_str().unwrap().parse::<u64>().unwrap();
        counted.push((header("x-pare-tokens-raw"), header("x-pare-tokens-forwarded")));
        response.bytes().await.unwrap();
    }
    let received: Vec<Vec<u8>> = stub.requests().into_iter().map(|r| r.body.to_vec()).collect();

    let replay_compactor = SessionCompactor::new(&config, engine()).unwrap();
    let replayed = replay_session(&replay_compactor, Wire::Chat, "replay", &lines, None);
    let predicted: Vec<Vec<u8>> = replayed.iter().map(|r| r.forwarded.clone()).collect();
    assert_eq!(received.len(), predicted.len());
    for (k, (got, want)) in received.iter().zip(&predicted).enumerate() {
        assert!(got == want, "{mode:?}, request {k}: the proxy forwarded something else than replay predicts");
    }
    // The proxy counts a request that appends after forwarding it; its headers carry the exact
    // counts all the same.
    for (k, (got, want)) in counted.iter().zip(&replayed).enumerate() {
        let want = want.summary.as_ref().map(|s| (s.tokens_raw, s.tokens_forwarded));
        assert_eq!(Some(*got), want, "{mode:?}, request {k}: token counts");
    }
    assert!(received.iter().zip(&lines).any(|(f, r)| f.as_slice() != *r), "{mode:?}: pare must compact");
    let elided = received.iter().any(|b| String::from_utf8_lossy(b).contains("earlier messages elided"));
    assert!(elided || mode != Mode::Eager, "eager: the history budget must elide");
}

/// Three sessions through the whole pipeline (tracker, compactor, archive), their requests
/// interleaved, each answered with the assistant message its next request carries. Returns every
/// forwarded body, the session of each request and the memory figures.
async fn interleaved_through_the_pipeline(max_state_bytes: Option<u64>) -> (Vec<Bytes>, Vec<String>, BudgetStats) {
    let sessions: Vec<Vec<Vec<u8>>> = (0..3)
        .map(|s| {
            coding_session(30, 150)
                .into_iter()
                .map(|r| {
                    let text = String::from_utf8(r).unwrap();
                    text.replace("src/lib.rs", &format!("src/lib{s}.rs")).replace("\"stream\":true", "\"stream\":false")
                })
                .map(String::into_bytes)
                .collect()
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let mut config = Config::from_yaml(RESERVE_YAML).unwrap();
    config.budget.default_context_window = WINDOW;
    config.budget.detect_window = false;
    config.archive.dir = Some(dir.path().to_owned());
    if let Some(max) = max_state_bytes {
        config.memory.max_state_bytes = max;
    }
    let pipeline = Pipeline::from_config(Arc::new(config)).unwrap();
    let (mut forwarded, mut assigned, mut sent) = (Vec::new(), Vec::new(), Vec::new());
    for k in 0..sessions[0].len() {
        for requests in &sessions {
            sent.push(requests[k].clone());
            let prepared = pipeline.prepare_chat(&HeaderMap::new(), Bytes::from(requests[k].clone())).await;
            let mut sink = prepared.sink.unwrap();
            let mut headers = HeaderMap::new();
            headers.insert("content-type", "application/json".parse().unwrap());
            sink.head(200, &headers);
            if let Some(next) = requests.get(k + 1) {
                let next: Value = serde_json::from_slice(next).unwrap();
                let messages = next["messages"].as_array().unwrap();
                let answer = &messages[messages.len() - 2];
                let body = json!({"choices": [{"index": 0, "message": answer, "finish_reason": "tool_calls"}]});
                sink.chunk(&Bytes::from(body.to_string()));
            }
            sink.finish(StreamEnd::Complete);
            forwarded.push(prepared.body);
            assigned.push(prepared.session.unwrap());
        }
    }
    let stats = pipeline.memory();
    pipeline.archive().unwrap().close();
    // The archive holds every body exactly, whatever the writer's cursors forgot in between.
    let reader = pare::archive::query::ArchiveReader::open(dir.path()).unwrap();
    let report = pare::archive::verify::verify(reader.conn(), None).unwrap();
    assert!(report.ok() && report.exchanges == sent.len() as u64, "{report:?}");
    let mut seq = std::collections::HashMap::new();
    for ((raw, fwd), session) in sent.iter().zip(&forwarded).zip(&assigned) {
        let seq = seq.entry(session.clone()).and_modify(|n| *n += 1).or_insert(1);
        assert_eq!(reader.body(session, *seq, BodyKind::Raw).unwrap(), *raw, "raw request {seq} of {session}");
        assert_eq!(reader.body(session, *seq, BodyKind::Forwarded).unwrap(), *fwd, "forwarded {seq} of {session}");
    }
    (forwarded, assigned, stats)
}

/// With a budget smaller than one session, every request evicts the other sessions (tracker keys,
/// frozen prefixes, archive cursors): each comes back through its head key and its last archived
/// pair, and pare forwards exactly what it forwards when nothing is evicted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evicted_sessions_come_back_forwarding_the_same_bytes() {
    let (kept, kept_sessions, kept_stats) = interleaved_through_the_pipeline(None).await;
    assert_eq!(kept_stats.evictions, 0);
    assert_eq!(kept_sessions.iter().collect::<std::collections::HashSet<_>>().len(), 3);
    let compacted = kept
        .iter()
        .filter(|b| serde_json::from_slice::<Value>(b).unwrap()["messages"].as_array().unwrap().len() < 3 + 2 * 29)
        .count();
    assert!(compacted > 0, "some requests are compacted (epochs happen before evictions)");

    let tiny = kept_stats.reserved_bytes + 1;
    let (evicted, evicted_sessions, evicted_stats) = interleaved_through_the_pipeline(Some(tiny)).await;
    assert!(evicted_stats.evictions >= 2 * 30, "{evicted_stats:?}");
    assert_eq!(evicted_stats.sessions, 1, "only the session in use stays");
    assert_eq!(evicted_sessions.iter().collect::<std::collections::HashSet<_>>().len(), 3);
    for (k, (a, b)) in kept.iter().zip(&evicted).enumerate() {
        assert!(a == b, "request {k} (session {}) forwarded differently after an eviction", k % 3);
    }
}

/// `x-pare-bypass: 1`: the request is archived, forwarded exactly as sent, and counted;
/// the session's other requests are forwarded as replay predicts for them.
#[tokio::test]
async fn a_bypassed_request_is_forwarded_as_sent_and_counted() {
    use crate::support::stub::Stub;
    use crate::support::{client, pare as in_process, within};
    use pare::pipeline::Pipeline;

    let requests = coding_session(30, 150);
    let stub = Stub::start(Stub::openai).await;
    let dir = tempfile::tempdir().unwrap();
    let mut config = in_process::config_for(&stub);
    config.archive.enabled = true;
    config.archive.dir = Some(dir.path().to_owned());
    config.budget.default_context_window = WINDOW;
    config.budget.output_reserve = 1024;
    config.budget.detect_window = false;
    let config = Arc::new(config);
    let pipeline = Arc::new(Pipeline::from_config(config.clone()).unwrap());
    let server = in_process::start_with_pipeline(config.clone(), pipeline.clone()).await;
    let bypassed = 25;
    for (k, body) in requests.iter().enumerate() {
        let mut request = client()
            .post(server.url("/v1/chat/completions"))
            .header("content-type", "application/json")
            .header("x-pare-session", "bypass")
            .body(body.clone());
        if k == bypassed {
            request = request.header("x-pare-bypass", "1");
        }
        let response = within("pare to answer", request.send()).await.unwrap();
        assert!(response.status().is_success());
        response.bytes().await.unwrap();
    }
    let received: Vec<Vec<u8>> = stub.requests().into_iter().map(|r| r.body.to_vec()).collect();
    assert_eq!(received[bypassed], requests[bypassed], "the bypassed request went out as sent");
    assert!(stub.requests()[bypassed].header("x-pare-bypass").is_none(), "pare's own header stays with pare");
    assert!(received[bypassed - 1] != requests[bypassed - 1], "its neighbours are compacted");
    assert!(received[bypassed + 1] != requests[bypassed + 1], "its neighbours are compacted");
    assert_eq!(pipeline.stats.bypassed.load(std::sync::atomic::Ordering::Relaxed), 1);
    let archive = pipeline.archive().unwrap();
    within("the archive to commit every request", async {
        while archive.health().committed_records < 2 * requests.len() as u64 {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await;
    let reader = pare::archive::query::ArchiveReader::open(dir.path()).unwrap();
    assert_eq!(reader.exchanges("bypass").unwrap().len(), requests.len(), "every request archived, in one session");
}
