//! The Anthropic Messages API through pare: chat sessions converted to Claude Code-shaped requests
//! (`wire::messages::convert`), replayed and proxied against a stub speaking Messages SSE; the
//! adapter's invariants (pairing, the person's text, thinking bytes, cache marks) on every forwarded
//! request; the archive, the session tracker and export for Messages exchanges.

use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use pare::budget::replay::{Replayed, replay_session, session_lines};
use pare::budget::{CompactEngine, SessionCompactor};
use pare::config::{Config, Mode};
use pare::wire::messages::{MessagesBody, cache, check_turns, convert};
use pare::wire::{Wire, WireBody};
use serde_json::{Value, json};

use crate::support::stub::{Reply, Step, Stub};
use crate::support::{CodingAgent, client, pare as in_process, within};

const WINDOW: u64 = 16_000;

/// The shared coding session (`support::coding_session`, reasoning on every assistant turn)
/// converted to Messages requests: a marked system prompt, signed thinking blocks, the last user
/// turn marked.
fn coding_session(n_turns: usize, words: usize) -> Vec<Vec<u8>> {
    let agent = CodingAgent {
        model: "claude-test",
        tool: "Bash",
        id_prefix: "toolu_",
        reasoning: Some(|k| format!("thinking about step {k}")),
    };
    let chat = crate::support::coding_session(&agent, n_turns, words);
    chat.iter().map(|body| convert::chat_to_messages(body).unwrap().to_string().into_bytes()).collect()
}

fn config(mode: Mode) -> Config {
    let mut config = Config::default();
    config.compaction.mode = mode;
    config.budget.anthropic_context_window = WINDOW;
    config.budget.output_reserve = 1024;
    config.budget.detect_window = false;
    config
}

fn engine() -> Arc<dyn CompactEngine> {
    Arc::new(pare::compact::Engine::default_pack())
}

fn blocks(body: &Value, pick: impl Fn(&str, &Value) -> bool) -> Vec<String> {
    let turns = body["messages"].as_array().map(Vec::as_slice).unwrap_or_default();
    let mut out = Vec::new();
    for turn in turns {
        let role = turn["role"].as_str().unwrap_or("");
        for block in turn["content"].as_array().into_iter().flatten() {
            if pick(role, block) {
                out.push(block.to_string());
            }
        }
    }
    out
}

/// The invariants of one forwarded Messages request against its raw request: the API's pairing
/// rules, every top-level key but `messages` byte-identical (`system`, `tools`, `thinking`…), the
/// person's blocks kept in order, every thinking block kept byte for byte or gone with its turn, no
/// more cache marks than the agent's and at most 4, the last turn as sent.
fn check_forwarded(raw: &[u8], forwarded: &[u8], what: &str) {
    let fwd_body = MessagesBody::parse(forwarded).unwrap_or_else(|e| panic!("{what}: forwarded is not a request: {e}"));
    fwd_body.check().unwrap_or_else(|e| panic!("{what}: {e}"));
    let raw_v: Value = serde_json::from_slice(raw).unwrap();
    let fwd_v: Value = serde_json::from_slice(forwarded).unwrap();
    for (key, value) in raw_v.as_object().unwrap() {
        if key != "messages" {
            assert_eq!(&fwd_v[key], value, "{what}: top-level `{key}` changed");
        }
    }
    let persons = |role: &str, b: &Value| role == "user" && b["type"] != "tool_result";
    let fwd_persons = blocks(&fwd_v, persons);
    let mut from = 0;
    for block in blocks(&raw_v, persons) {
        let at = fwd_persons[from..].iter().position(|f| *f == block);
        assert!(at.is_some(), "{what}: the person's block {block} is missing or changed");
        from += at.unwrap() + 1;
    }
    let thinking = |_: &str, b: &Value| b["type"].as_str().is_some_and(|t| t.ends_with("thinking"));
    let raw_thinking = blocks(&raw_v, thinking);
    for block in blocks(&fwd_v, thinking) {
        assert!(raw_thinking.contains(&block), "{what}: a thinking block was changed");
    }
    let (raw_marks, fwd_marks) = (cache::marks(&raw_v), cache::marks(&fwd_v));
    assert!(
        fwd_marks.len() <= raw_marks.len().min(4),
        "{what}: {} marks for the agent's {}",
        fwd_marks.len(),
        raw_marks.len()
    );
    let turns = |v: &Value| v["messages"].as_array().unwrap().clone();
    assert_eq!(turns(&fwd_v).last(), turns(&raw_v).last(), "{what}: the last turn changed");
}

/// The turns of a forwarded body with the cache marks taken out (the agent moves its last mark).
fn unmarked_turns(body: &[u8]) -> Vec<Value> {
    let mut v: Value = serde_json::from_slice(body).unwrap();
    for turn in v["messages"].as_array_mut().unwrap() {
        for block in turn["content"].as_array_mut().into_iter().flatten() {
            block.as_object_mut().unwrap().shift_remove("cache_control");
        }
    }
    v["messages"].as_array().unwrap().clone()
}

#[test]
fn replaying_a_converted_session_keeps_the_invariants_the_cached_prefix_and_compacts() {
    let requests = coding_session(40, 150);
    let lines: Vec<&[u8]> = requests.iter().map(Vec::as_slice).collect();
    for mode in [Mode::Epoch, Mode::Eager] {
        let compactor = SessionCompactor::new(&config(mode), engine()).unwrap();
        let out = replay_session(&compactor, Wire::Messages, "s", &lines, None);
        for (k, (raw, replayed)) in lines.iter().zip(&out).enumerate() {
            assert!(replayed.skipped.is_none(), "{mode:?} {k}: {:?}", replayed.skipped);
            let report = replayed.summary.as_ref().unwrap().report.as_ref().unwrap();
            assert!(report.tokens_estimated, "{mode:?} {k}: the counts are an estimate");
            check_forwarded(raw, &replayed.forwarded, &format!("{mode:?} request {k}"));
        }
        // Between epochs nothing already sent is rewritten: each request's turns (marks aside)
        // start with the previous request's, so the upstream's cache keeps hitting.
        let mut n_epochs = 0;
        for (k, pair) in out.windows(2).enumerate() {
            let summary = pair[1].summary.as_ref().unwrap();
            if summary.epoch_started {
                n_epochs += 1;
                continue;
            }
            let (before, after) = (unmarked_turns(&pair[0].forwarded), unmarked_turns(&pair[1].forwarded));
            assert_eq!(after[..before.len()], before[..], "{mode:?}: request {} rewrote what request {k} sent", k + 1);
        }
        assert!(n_epochs >= 1, "{mode:?}: the session must compact");
        let raw_bytes: usize = lines.iter().map(|l| l.len()).sum();
        let fwd_bytes: usize = out.iter().map(|r| r.forwarded.len()).sum();
        assert!(fwd_bytes < raw_bytes * 3 / 4, "{mode:?}: {fwd_bytes} of {raw_bytes} bytes");
    }
}

/// The fixture sessions, converted to Messages, replayed at 16k: the invariants hold on every
/// request, and the savings are close to the chat path's on the same sessions.
#[test]
fn converted_fixture_sessions_replay_within_the_chat_savings() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sessions");
    let mut n_sessions = 0;
    for source in std::fs::read_dir(&dir).unwrap() {
        for file in std::fs::read_dir(source.unwrap().path()).unwrap() {
            let path = file.unwrap().path();
            let text = std::fs::read_to_string(&path).unwrap();
            let converted = pare::wire::convert::chat_session_to(pare::wire::Wire::Messages, &text);
            let chat_lines = session_lines(text.as_bytes());
            let lines = session_lines(converted.as_bytes());
            assert_eq!(lines.len(), chat_lines.len());
            let compactor = SessionCompactor::new(&config(Mode::Epoch), engine()).unwrap();
            let out = replay_session(&compactor, Wire::Messages, "m", &lines, Some(WINDOW));
            for (k, (raw, replayed)) in lines.iter().zip(&out).enumerate() {
                check_forwarded(raw, &replayed.forwarded, &format!("{} request {k}", path.display()));
            }
            let chat = replay_session(&compactor, Wire::Chat, "c", &chat_lines, Some(WINDOW));
            let tokens = |replayed: &[Replayed], raw: bool| -> u64 {
                replayed
                    .iter()
                    .filter_map(|r| r.summary.as_ref())
                    .map(|s| if raw { s.tokens_raw } else { s.tokens_forwarded })
                    .sum()
            };
            let saved = |r: &[Replayed]| 1.0 - tokens(r, false) as f64 / tokens(r, true) as f64;
            let (saved_messages, saved_chat) = (saved(&out), saved(&chat));
            assert!(
                (saved_messages - saved_chat).abs() < 0.05,
                "{}: saved {saved_messages:.3} (messages) against {saved_chat:.3} (chat)",
                path.display()
            );
            n_sessions += 1;
        }
    }
    assert!(n_sessions >= 2);
}

/// The frames a Messages server streams for one answer: a thinking block with its signature, text,
/// and a `tool_use` whose input arrives in pieces.
fn call_stream(tool_use_id: &str) -> Vec<Step> {
    let frames = [
        json!({"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-test", "content": [], "stop_reason": null, "stop_sequence": null, "usage": {"input_tokens": 20, "output_tokens": 1}}}),
        json!({"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
        json!({"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "List them."}}),
        json!({"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "EqQBsig"}}),
        json!({"type": "content_block_stop", "index": 0}),
        json!({"type": "ping"}),
        json!({"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}}),
        json!({"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Listing."}}),
        json!({"type": "content_block_stop", "index": 1}),
        json!({"type": "content_block_start", "index": 2, "content_block": {"type": "tool_use", "id": tool_use_id, "name": "Bash", "input": {}}}),
        json!({"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": "{\"command\": "}}),
        json!({"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": "\"ls\"}"}}),
        json!({"type": "content_block_stop", "index": 2}),
        json!({"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": null}, "usage": {"output_tokens": 30}}),
        json!({"type": "message_stop"}),
    ];
    frames
        .iter()
        .map(|f| Step::Send(Bytes::from(format!("event: {}\ndata: {f}\n\n", f["type"].as_str().unwrap()))))
        .collect()
}

fn final_message(text: &str) -> Value {
    json!({"id": "msg_2", "type": "message", "role": "assistant", "model": "claude-test",
        "content": [{"type": "text", "text": text}], "stop_reason": "end_turn", "stop_sequence": null,
        "usage": {"input_tokens": 40, "output_tokens": 3}})
}

/// The proxy forwards exactly what `pare replay --wire messages` predicts, keeps the query string
/// and passes Anthropic's headers through; `count_tokens` passes through untouched.
#[tokio::test]
async fn proxy_forwards_what_replay_predicts_for_messages() {
    for mode in [Mode::Epoch, Mode::Eager] {
        let requests = coding_session(30, 150);
        let lines: Vec<&[u8]> = requests.iter().map(Vec::as_slice).collect();
        let stub = Stub::start(|request| {
            if request.path_only().ends_with("/count_tokens") {
                Reply::json(200, json!({"input_tokens": 123}))
            } else {
                Reply::json(200, final_message("done"))
            }
        })
        .await;
        let mut config = in_process::config_for(&stub);
        let defaults = self::config(mode);
        config.compaction = defaults.compaction.clone();
        config.budget = defaults.budget.clone();
        let compactor = Arc::new(SessionCompactor::new(&config, engine()).unwrap());
        let server = in_process::start_with_compactor(config.clone(), compactor).await;
        for line in &lines {
            let response = within(
                "pare to answer",
                client()
                    .post(server.url("/v1/messages?beta=true"))
                    .header("content-type", "application/json")
                    .header("x-api-key", "sk-ant-test")
                    .header("anthropic-version", "2023-06-01")
                    .header("anthropic-beta", "interleaved-thinking-2025-05-14")
                    .header("x-pare-session", "messages-replay")
                    .body(line.to_vec())
                    .send(),
            )
            .await
            .unwrap();
            assert!(response.status().is_success());
            assert!(response.headers().contains_key("x-pare-tokens-forwarded"));
            response.bytes().await.unwrap();
        }
        let big = lines.last().unwrap().to_vec();
        let counted = client().post(server.url("/v1/messages/count_tokens")).body(big.clone()).send().await.unwrap();
        assert!(!counted.headers().contains_key("x-pare-session"), "count_tokens is not compacted");
        counted.bytes().await.unwrap();
        let seen = stub.requests();
        let (count, received): (Vec<_>, Vec<_>) =
            seen.into_iter().partition(|r| r.path_only().ends_with("/count_tokens"));
        assert_eq!(count[0].body, big, "count_tokens passes through byte for byte");
        for request in &received {
            assert_eq!(request.path, "/v1/messages?beta=true");
            assert_eq!(request.header("x-api-key"), Some("sk-ant-test"));
            assert_eq!(request.header("anthropic-version"), Some("2023-06-01"));
            assert_eq!(request.header("anthropic-beta"), Some("interleaved-thinking-2025-05-14"));
        }
        let received: Vec<Vec<u8>> = received.into_iter().map(|r| r.body.to_vec()).collect();
        let replay = SessionCompactor::new(&config, engine()).unwrap();
        let predicted = replay_session(&replay, Wire::Messages, "replay", &lines, None);
        assert_eq!(received.len(), predicted.len());
        for (k, (got, want)) in received.iter().zip(&predicted).enumerate() {
            assert!(*got == want.forwarded, "{mode:?}, request {k}: the proxy forwarded something else than replay");
        }
        assert!(received.iter().zip(&lines).any(|(f, r)| f.as_slice() != *r), "{mode:?}: pare must compact");
        let metrics = client().get(server.url("/_pare/metrics")).send().await.unwrap().text().await.unwrap();
        assert!(metrics.contains(r#"pare_tokens_raw_total{model="claude-test",wire="messages"}"#), "{metrics}");
    }
}

/// A streamed and a plain Messages exchange through `pare serve`: the stream reaches the client as
/// sent, both are archived byte for byte without the API key, the tracker joins them into one
/// session (the assembled answer is the next request's assistant turn), and export gives the chat
/// conversation.
#[tokio::test]
async fn messages_exchanges_are_archived_tracked_and_exported() {
    let stub = Stub::start(|request| {
        if request.json()["stream"] == true {
            Reply::sse(call_stream("toolu_ls"))
        } else {
            Reply::json(200, final_message("a.rs b.rs"))
        }
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let mut config = in_process::config_for(&stub);
    config.archive.enabled = true;
    config.archive.dir = Some(dir.path().to_owned());
    config.budget.detect_window = false;
    let config = Arc::new(config);
    let pipeline = Arc::new(pare::pipeline::Pipeline::from_config(config.clone()).unwrap());
    let server = in_process::start_with_pipeline(config.clone(), pipeline).await;

    let first = json!({"model": "claude-test", "max_tokens": 1024, "stream": true,
        "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "list the files", "cache_control": {"type": "ephemeral"}}]}],
        "tools": [{"name": "Bash", "description": "run", "input_schema": {"type": "object"}}]});
    let mut second = first.clone();
    second["stream"] = json!(false);
    second["messages"][0]["content"][0].as_object_mut().unwrap().shift_remove("cache_control");
    second["messages"].as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": [
            {"type": "thinking", "thinking": "List them.", "signature": "EqQBsig"},
            {"type": "text", "text": "Listing."},
            {"type": "tool_use", "id": "toolu_ls", "name": "Bash", "input": {"command": "ls"}}]}),
        json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_ls", "content": "a.rs\nb.rs", "cache_control": {"type": "ephemeral"}}]}),
    ]);
    let mut sessions = Vec::new();
    for body in [&first, &second] {
        let response = client()
            .post(server.url("/v1/messages"))
            .header("content-type", "application/json")
            .header("x-api-key", "sk-ant-SECRET")
            .header("anthropic-version", "2023-06-01")
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        assert!(response.status().is_success());
        sessions.push(response.headers()["x-pare-session"].to_str().unwrap().to_owned());
        let text = response.text().await.unwrap();
        if body["stream"] == true {
            let sent: Vec<u8> = call_stream("toolu_ls")
                .into_iter()
                .flat_map(|step| match step {
                    Step::Send(bytes) => bytes.to_vec(),
                    _ => Vec::new(),
                })
                .collect();
            assert_eq!(text.as_bytes(), sent.as_slice(), "the stream arrives as the upstream sent it");
        }
    }
    assert_eq!(sessions[0], sessions[1], "the second request extends the first and its answer");
    server.shutdown().await.unwrap();

    for entry in std::fs::read_dir(dir.path()).unwrap() {
        let bytes = std::fs::read(entry.unwrap().path()).unwrap();
        assert!(!bytes.windows(6).any(|w| w == b"SECRET"), "the API key reached the archive");
    }
    let reader = pare::archive::query::ArchiveReader::open(dir.path()).unwrap();
    let listed = reader.sessions(&Default::default()).unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].wire, Some("messages"));
    assert_eq!(listed[0].n_requests, 2);
    let raw = reader.body(&sessions[0], 2, pare::archive::read::BodyKind::Raw).unwrap();
    assert_eq!(raw, second.to_string().into_bytes(), "archived byte for byte");
    let answer = reader.response(&sessions[0], 1).unwrap().unwrap().assembled.unwrap();
    assert_eq!(answer["message"]["content"][0]["signature"], "EqQBsig");
    assert_eq!(answer["message"]["content"][2]["input"], json!({"command": "ls"}));
    assert_eq!(answer["finish_reason"], "tool_use");

    let data = pare::archive::export::load_sessions(&reader, &Default::default()).unwrap();
    let row = pare::archive::export::sft_row(&data[0], pare::archive::export::SftFormat::OpenAi).unwrap();
    let roles: Vec<&str> = row["messages"].as_array().unwrap().iter().map(|m| m["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "tool", "assistant"]);
    assert_eq!(row["messages"][0]["content"], "You are Claude Code.");
    assert_eq!(row["messages"][2]["tool_calls"][0]["function"]["arguments"], r#"{"command":"ls"}"#);
    assert_eq!(row["messages"][3]["tool_call_id"], "toolu_ls");
    assert_eq!(row["messages"][4]["content"], "a.rs b.rs");
    assert_eq!(row["tools"][0]["function"]["name"], "Bash");
}

/// The converter's output is what the adapter reads: every converted fixture request parses, passes
/// the API's checks, and its neutral view has the chat request's tool calls and results in order.
#[test]
fn converted_requests_read_back_as_the_chat_conversation() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sessions/swe-agent");
    for file in std::fs::read_dir(dir).unwrap() {
        let text = std::fs::read_to_string(file.unwrap().path()).unwrap();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let chat: Value = serde_json::from_str(line).unwrap();
            let converted = convert::chat_to_messages(&chat).unwrap().to_string();
            let body = MessagesBody::parse(converted.as_bytes()).unwrap();
            body.check().unwrap();
            let v: Value = serde_json::from_str(&converted).unwrap();
            check_turns(&v["messages"].as_array().unwrap().iter().map(Value::to_string).collect::<Vec<_>>()).unwrap();
            let ids = |messages: Vec<Value>| -> Vec<String> {
                messages
                    .iter()
                    .flat_map(|m| {
                        let calls = m["tool_calls"].as_array().into_iter().flatten().map(|c| c["id"].to_string());
                        calls.chain(m.get("tool_call_id").map(Value::to_string)).collect::<Vec<_>>()
                    })
                    .collect()
            };
            let neutral: Vec<Value> = body.messages().iter().map(|m| serde_json::from_str(m).unwrap()).collect();
            let chat_messages = chat["messages"].as_array().unwrap().clone();
            assert_eq!(ids(neutral), ids(chat_messages));
        }
    }
}
