//! The OpenAI Responses API through pare: chat sessions converted to Responses requests
//! (`wire::convert`), replayed and proxied; the adapter's invariants on real fixture sessions; the
//! archive, the session tracker and export for Responses exchanges.

use std::path::Path;
use std::sync::Arc;

use pare::budget::replay::{replay_session, session_lines};
use pare::budget::{CompactEngine, SessionCompactor};
use pare::config::{Config, Mode};
use pare::wire::responses::{ResponsesBody, check_items};
use pare::wire::{Wire, WireBody, convert};
use serde_json::{Value, json};

use crate::support::stub::{Reply, Step, Stub, sse_event};
use crate::support::{CodingAgent, client, pare as in_process, within};

const WINDOW: u64 = 16_000;

/// The shared coding session (`support::coding_session`, reasoning on every assistant turn),
/// converted to Responses requests.
fn coding_session(n_turns: usize, words: usize) -> Vec<Vec<u8>> {
    let agent = CodingAgent {
        model: "test-model",
        tool: "terminal",
        id_prefix: "call_",
        reasoning: Some(|k| format!("gAAAA{k}encrypted")),
    };
    let chat = crate::support::coding_session(&agent, n_turns, words);
    chat.iter().map(|body| convert::chat_to_responses(body).unwrap().to_string().into_bytes()).collect()
}

fn config(mode: Mode) -> Config {
    let mut config = Config::default();
    config.compaction.mode = mode;
    config.budget.default_context_window = WINDOW;
    config.budget.output_reserve = 1024;
    config.budget.detect_window = false;
    config
}

fn engine() -> Arc<dyn CompactEngine> {
    Arc::new(pare::compact::Engine::default_pack())
}

/// The invariants of one forwarded Responses request against its raw request: the format's pairing
/// rules, the instructions and every top-level key but `input` byte-identical, user items and the
/// protected tail kept, every reasoning item either kept byte for byte or gone with its turn.
fn check_forwarded(raw: &[u8], forwarded: &[u8], what: &str) {
    let raw_body = ResponsesBody::parse(raw).unwrap();
    let fwd_body =
        ResponsesBody::parse(forwarded).unwrap_or_else(|e| panic!("{what}: forwarded is not a request: {e}"));
    check_items(fwd_body.items()).unwrap_or_else(|e| panic!("{what}: {e}"));
    let raw_v: Value = serde_json::from_slice(raw).unwrap();
    let fwd_v: Value = serde_json::from_slice(forwarded).unwrap();
    for (key, value) in raw_v.as_object().unwrap() {
        if key != "input" {
            assert_eq!(&fwd_v[key], value, "{what}: top-level `{key}` changed");
        }
    }
    let raw_items = raw_body.items();
    let fwd_items = fwd_body.items();
    let mut from = 0;
    for user in raw_items.iter().filter(|i| i.contains(r#""role":"user""#)) {
        let at = fwd_items[from..].iter().position(|f| f == user);
        assert!(at.is_some(), "{what}: a user item is missing or changed");
        from += at.unwrap() + 1;
    }
    for item in fwd_items.iter().filter(|i| i.contains(r#""type":"reasoning""#)) {
        assert!(raw_items.contains(item), "{what}: a reasoning item was changed");
    }
    // The last turn (the latest call and its output) is forwarded as sent.
    let tail = &raw_items[raw_items.len().saturating_sub(3)..];
    assert_eq!(&fwd_items[fwd_items.len() - tail.len()..], tail, "{what}: the tail changed");
}

#[test]
fn replaying_a_converted_session_keeps_the_invariants_and_compacts() {
    let requests = coding_session(40, 150);
    let lines: Vec<&[u8]> = requests.iter().map(Vec::as_slice).collect();
    for mode in [Mode::Epoch, Mode::Eager] {
        let compactor = SessionCompactor::new(&config(mode), engine()).unwrap();
        let out = replay_session(&compactor, Wire::Responses, "s", &lines, None);
        for (k, (raw, replayed)) in lines.iter().zip(&out).enumerate() {
            assert!(replayed.skipped.is_none(), "{mode:?} {k}: {:?}", replayed.skipped);
            check_forwarded(raw, &replayed.forwarded, &format!("{mode:?} request {k}"));
        }
        let raw_bytes: usize = lines.iter().map(|l| l.len()).sum();
        let fwd_bytes: usize = out.iter().map(|r| r.forwarded.len()).sum();
        assert!(fwd_bytes < raw_bytes * 3 / 4, "{mode:?}: {fwd_bytes} of {raw_bytes} bytes");
        let last = &out.last().unwrap().forwarded;
        assert!(
            !String::from_utf8_lossy(last).contains("gAAAA0encrypted"),
            "{mode:?}: the oldest turn is compacted whole"
        );
    }
}

/// The fixture sessions, converted to Responses, replayed at 16k: the invariants hold on every
/// request, and the savings are close to the chat path's on the same sessions.
#[test]
fn converted_fixture_sessions_replay_within_the_chat_savings() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sessions");
    let mut n_sessions = 0;
    for source in std::fs::read_dir(&dir).unwrap() {
        for file in std::fs::read_dir(source.unwrap().path()).unwrap() {
            let path = file.unwrap().path();
            let text = std::fs::read_to_string(&path).unwrap();
            let converted = pare::wire::convert::chat_session_to(pare::wire::Wire::Responses, &text);
            let chat_lines = session_lines(text.as_bytes());
            let lines = session_lines(converted.as_bytes());
            assert_eq!(lines.len(), chat_lines.len());
            let compactor = SessionCompactor::new(&config(Mode::Epoch), engine()).unwrap();
            let out = replay_session(&compactor, Wire::Responses, "r", &lines, Some(WINDOW));
            for (k, (raw, replayed)) in lines.iter().zip(&out).enumerate() {
                check_forwarded(raw, &replayed.forwarded, &format!("{} request {k}", path.display()));
            }
            let chat = replay_session(&compactor, Wire::Chat, "c", &chat_lines, Some(WINDOW));
            let tokens = |replayed: &[pare::budget::replay::Replayed], raw: bool| -> u64 {
                replayed
                    .iter()
                    .filter_map(|r| r.summary.as_ref())
                    .map(|s| if raw { s.tokens_raw } else { s.tokens_forwarded })
                    .sum()
            };
            let saved = |r: &[pare::budget::replay::Replayed]| 1.0 - tokens(r, false) as f64 / tokens(r, true) as f64;
            let (saved_responses, saved_chat) = (saved(&out), saved(&chat));
            assert!(
                (saved_responses - saved_chat).abs() < 0.05,
                "{}: saved {saved_responses:.3} (responses) against {saved_chat:.3} (chat)",
                path.display()
            );
            n_sessions += 1;
        }
    }
    assert!(n_sessions >= 2);
}

/// The proxy forwards exactly what `pare replay --wire responses` predicts.
#[tokio::test]
async fn proxy_forwards_what_replay_predicts_for_responses() {
    for mode in [Mode::Epoch, Mode::Eager] {
        let requests = coding_session(30, 150);
        let lines: Vec<&[u8]> = requests.iter().map(Vec::as_slice).collect();
        let stub = Stub::start(|_| Reply::json(200, completed_response("done"))).await;
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
                    .post(server.url("/v1/responses"))
                    .header("content-type", "application/json")
                    .header("x-pare-session", "responses-replay")
                    .body(line.to_vec())
                    .send(),
            )
            .await
            .unwrap();
            assert!(response.status().is_success());
            assert!(response.headers().contains_key("x-pare-tokens-forwarded"));
            response.bytes().await.unwrap();
        }
        let received: Vec<Vec<u8>> = stub.requests().into_iter().map(|r| r.body.to_vec()).collect();
        let replay = SessionCompactor::new(&config, engine()).unwrap();
        let predicted = replay_session(&replay, Wire::Responses, "replay", &lines, None);
        assert_eq!(received.len(), predicted.len());
        for (k, (got, want)) in received.iter().zip(&predicted).enumerate() {
            assert!(*got == want.forwarded, "{mode:?}, request {k}: the proxy forwarded something else than replay");
        }
        assert!(received.iter().zip(&lines).any(|(f, r)| f.as_slice() != *r), "{mode:?}: pare must compact");
        let metrics = client().get(server.url("/_pare/metrics")).send().await.unwrap().text().await.unwrap();
        assert!(metrics.contains(r#"pare_tokens_raw_total{model="test-model",wire="responses"}"#), "{metrics}");
    }
}

fn completed_response(text: &str) -> Value {
    json!({"id": "resp_1", "object": "response", "status": "completed", "model": "test-model",
        "output": [{"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                    "content": [{"type": "output_text", "text": text, "annotations": []}]}],
        "usage": {"input_tokens": 10, "output_tokens": 2, "total_tokens": 12}})
}

/// The SSE frames a Responses server streams for one function call.
fn call_stream(call_id: &str) -> Vec<Step> {
    let item = json!({"type": "function_call", "id": "fc_1", "call_id": call_id, "name": "shell", "arguments": "{\"command\":[\"ls\"]}", "status": "completed"});
    let frames = [
        json!({"type": "response.created", "response": {"id": "resp_2", "status": "in_progress", "model": "test-model", "output": []}}),
        json!({"type": "response.output_item.added", "output_index": 0, "item": {"type": "function_call", "id": "fc_1", "call_id": call_id, "name": "shell", "arguments": ""}}),
        json!({"type": "response.function_call_arguments.delta", "output_index": 0, "item_id": "fc_1", "delta": "{\"command\":[\"ls\"]}"}),
        json!({"type": "response.output_item.done", "output_index": 0, "item": item}),
        json!({"type": "response.completed", "response": {"id": "resp_2", "status": "completed", "model": "test-model", "output": [item], "usage": {"input_tokens": 5, "output_tokens": 3}}}),
    ];
    frames.iter().map(|f| Step::Send(sse_event(f))).collect()
}

/// Stream and non-stream Responses requests through `pare serve` are archived byte for byte, joined
/// into one session by the tracker (the answer's output items are the next request's items), shown
/// and exported as chat conversations.
#[tokio::test]
async fn responses_exchanges_are_archived_tracked_and_exported() {
    let stub = Stub::start(|request| {
        let body = request.json();
        if body["stream"] == true {
            Reply::sse(call_stream("call_ls"))
        } else {
            Reply::json(200, completed_response("a.rs b.rs"))
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

    let call = json!({"type": "function_call", "id": "fc_1", "call_id": "call_ls", "name": "shell", "arguments": "{\"command\":[\"ls\"]}", "status": "completed"});
    let first = json!({"model": "test-model", "instructions": "You are Codex.", "stream": true,
        "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list the files"}]}],
        "tools": [{"type": "function", "name": "shell", "parameters": {"type": "object"}}]});
    let mut second = first.clone();
    second["stream"] = json!(false);
    second["input"]
        .as_array_mut()
        .unwrap()
        .extend([call, json!({"type": "function_call_output", "call_id": "call_ls", "output": "a.rs\nb.rs"})]);
    let mut sessions = Vec::new();
    for body in [&first, &second] {
        let response = client()
            .post(server.url("/v1/responses"))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        assert!(response.status().is_success());
        sessions.push(response.headers()["x-pare-session"].to_str().unwrap().to_owned());
        let text = response.text().await.unwrap();
        if body["stream"] == true {
            assert!(text.contains("event: response.completed") || text.contains("response.completed"), "{text}");
        }
    }
    assert_eq!(sessions[0], sessions[1], "the second request extends the first and its answer");
    // Another path under /responses passes through, uncompacted and unarchived.
    let other = client().get(server.url("/v1/responses/resp_1")).send().await.unwrap();
    assert!(!other.headers().contains_key("x-pare-session"));
    other.bytes().await.unwrap();
    server.shutdown().await.unwrap();

    let reader = pare::archive::query::ArchiveReader::open(dir.path()).unwrap();
    let listed = reader.sessions(&Default::default()).unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].wire, Some("responses"));
    assert_eq!(listed[0].n_requests, 2);
    let raw = reader.body(&sessions[0], 2, pare::archive::read::BodyKind::Raw).unwrap();
    assert_eq!(raw, second.to_string().into_bytes(), "archived byte for byte");
    let answer = reader.response(&sessions[0], 1).unwrap().unwrap();
    assert_eq!(answer.assembled.unwrap()["message"]["tool_calls"][0]["id"], "call_ls");

    let data = pare::archive::export::load_sessions(&reader, &Default::default()).unwrap();
    let row = pare::archive::export::sft_row(&data[0], pare::archive::export::SftFormat::OpenAi).unwrap();
    let roles: Vec<&str> = row["messages"].as_array().unwrap().iter().map(|m| m["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "tool", "assistant"]);
    assert_eq!(row["messages"][0]["content"], "You are Codex.");
    assert_eq!(row["messages"][2]["tool_calls"][0]["function"]["name"], "shell");
    assert_eq!(row["messages"][4]["content"], "a.rs b.rs");
    assert_eq!(row["tools"][0]["function"]["name"], "shell");
}

/// The converter's output is what the adapter reads: every converted fixture request parses, passes
/// the format's checks, and its neutral view equals the chat request's messages in substance
/// (roles and call ids).
#[test]
fn converted_requests_read_back_as_the_chat_conversation() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sessions/swe-agent");
    for file in std::fs::read_dir(dir).unwrap() {
        let text = std::fs::read_to_string(file.unwrap().path()).unwrap();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let chat: Value = serde_json::from_str(line).unwrap();
            let converted = convert::chat_to_responses(&chat).unwrap().to_string();
            let body = ResponsesBody::parse(converted.as_bytes()).unwrap();
            body.check().unwrap();
            let roles: Vec<String> = body
                .messages()
                .iter()
                .map(|m| serde_json::from_str::<Value>(m).unwrap()["role"].as_str().unwrap().to_owned())
                .collect();
            let chat_roles: Vec<String> =
                chat["messages"].as_array().unwrap().iter().map(|m| m["role"].as_str().unwrap().to_owned()).collect();
            assert_eq!(roles, chat_roles);
        }
    }
}

/// Regression: a request ending in a `compaction_trigger` item (Codex asking the server
/// to summarize the history) was compacted first, so the server summarized pare's shortened
/// history. It goes upstream as sent, through the proxy and in replay alike.
#[tokio::test]
async fn a_compaction_trigger_request_is_forwarded_as_sent() {
    let mut requests = coding_session(30, 150);
    let last = requests.pop().unwrap();
    let mut trigger: Value = serde_json::from_slice(&last).unwrap();
    trigger["input"].as_array_mut().unwrap().push(json!({"type": "compaction_trigger"}));
    let trigger = serde_json::to_vec(&trigger).unwrap();
    requests.push(trigger.clone());
    let lines: Vec<&[u8]> = requests.iter().map(Vec::as_slice).collect();

    let compactor = SessionCompactor::new(&config(Mode::Epoch), engine()).unwrap();
    let replayed = replay_session(&compactor, Wire::Responses, "s", &lines, None);
    assert!(replayed[lines.len() - 2].forwarded != lines[lines.len() - 2], "the request before it is compacted");
    let last = replayed.last().unwrap();
    assert_eq!(last.forwarded, trigger, "the trigger request is forwarded as sent");
    assert!(last.skipped.as_deref().is_some_and(|why| why.contains("compaction_trigger")), "{:?}", last.skipped);

    let stub = Stub::start(|_| Reply::json(200, completed_response("summary"))).await;
    let mut config = in_process::config_for(&stub);
    let defaults = self::config(Mode::Epoch);
    config.compaction = defaults.compaction.clone();
    config.budget = defaults.budget.clone();
    let compactor = Arc::new(SessionCompactor::new(&config, engine()).unwrap());
    let server = in_process::start_with_compactor(config.clone(), compactor).await;
    for line in &lines {
        let request = client()
            .post(server.url("/v1/responses"))
            .header("content-type", "application/json")
            .header("x-pare-session", "trigger")
            .body(line.to_vec());
        let response = within("pare to answer", request.send()).await.unwrap();
        assert!(response.status().is_success());
        response.bytes().await.unwrap();
    }
    let received = stub.requests();
    assert_eq!(received.last().unwrap().body.to_vec(), trigger);
}
