//! The Gemini API through pare: chat sessions converted to Gemini CLI-shaped requests
//! (`wire::gemini::convert`), replayed and proxied against a stub speaking Gemini's SSE and
//! JSON-array streams; the adapter's invariants (pairing, the person's parts, thoughts and
//! signatures, the system instruction) on every forwarded request; the archive (without the API
//! key), the session tracker and export for Gemini exchanges.

use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use pare::budget::replay::{Replayed, replay_session, session_lines};
use pare::budget::{CompactEngine, SessionCompactor};
use pare::config::{Config, Mode, ModelConfig};
use pare::wire::gemini::{GeminiBody, check_turns, convert};
use pare::wire::{Wire, WireBody};
use serde_json::{Value, json};

use crate::support::stub::{Reply, Step, Stub};
use crate::support::{CodingAgent, client, pare as in_process, within};

const WINDOW: u64 = 16_000;
const MODEL: &str = "gemini-test";

/// The shared coding session (`support::coding_session`, reasoning on every assistant turn)
/// converted to Gemini requests: a system instruction, thoughts, signed first calls.
fn coding_session(n_turns: usize, words: usize) -> Vec<Vec<u8>> {
    let agent = CodingAgent {
        model: MODEL,
        tool: "run_shell_command",
        id_prefix: "call_",
        reasoning: Some(|k| format!("thinking about step {k}")),
    };
    let chat = crate::support::coding_session(&agent, n_turns, words);
    chat.iter().map(|body| convert::chat_to_gemini(body).unwrap().to_string().into_bytes()).collect()
}

/// [`config`] with the default answer reserve, as a config file that sets only `models:` gives.
fn config_at_default_reserve(mode: Mode) -> Config {
    let mut config = config(mode);
    config.budget.output_reserve = Config::default().budget.output_reserve;
    config
}

/// A config whose `models:` entry gives Gemini models the test window (the path names the model).
fn config(mode: Mode) -> Config {
    let mut config = Config::default();
    config.compaction.mode = mode;
    config.budget.output_reserve = 1024;
    config.budget.detect_window = false;
    config.models = vec![ModelConfig {
        pattern: "^gemini-".into(),
        context_window: Some(WINDOW),
        output_reserve: None,
        encoding: None,
        price: None,
    }];
    config
}

fn engine() -> Arc<dyn CompactEngine> {
    Arc::new(pare::compact::Engine::default_pack())
}

fn parts(body: &Value, pick: impl Fn(&str, &Value) -> bool) -> Vec<String> {
    let turns = body["contents"].as_array().map(Vec::as_slice).unwrap_or_default();
    let mut out = Vec::new();
    for turn in turns {
        let role = turn["role"].as_str().unwrap_or("user");
        for part in turn["parts"].as_array().into_iter().flatten() {
            if pick(role, part) {
                out.push(part.to_string());
            }
        }
    }
    out
}

/// The invariants of one forwarded Gemini request against its raw request: the API's pairing rules,
/// every top-level key but `contents` byte-identical (`systemInstruction`, `tools`,
/// `generationConfig`…), the person's parts kept in order, every thought and signed part kept byte
/// for byte or gone with its turn, never two model turns in a row, the last turn as sent.
fn check_forwarded(raw: &[u8], forwarded: &[u8], what: &str) {
    let fwd_body = GeminiBody::parse(forwarded).unwrap_or_else(|e| panic!("{what}: forwarded is not a request: {e}"));
    fwd_body.check().unwrap_or_else(|e| panic!("{what}: {e}"));
    let raw_v: Value = serde_json::from_slice(raw).unwrap();
    let fwd_v: Value = serde_json::from_slice(forwarded).unwrap();
    for (key, value) in raw_v.as_object().unwrap() {
        if key != "contents" {
            assert_eq!(&fwd_v[key], value, "{what}: top-level `{key}` changed");
        }
    }
    let persons = |role: &str, p: &Value| role == "user" && p.get("functionResponse").is_none();
    let fwd_persons = parts(&fwd_v, persons);
    let mut from = 0;
    for part in parts(&raw_v, persons) {
        let at = fwd_persons[from..].iter().position(|f| *f == part);
        assert!(at.is_some(), "{what}: the person's part {part} is missing or changed");
        from += at.unwrap() + 1;
    }
    let opaque = |_: &str, p: &Value| p.get("thought").is_some() || p.get("thoughtSignature").is_some();
    let raw_opaque = parts(&raw_v, opaque);
    for part in parts(&fwd_v, opaque) {
        assert!(raw_opaque.contains(&part), "{what}: a thought or signed part was changed: {part}");
    }
    let turns = |v: &Value| v["contents"].as_array().unwrap().clone();
    let roles: Vec<Value> = turns(&fwd_v).iter().map(|t| t["role"].clone()).collect();
    assert!(
        roles.windows(2).all(|w| w != [json!("model"), json!("model")]),
        "{what}: two model turns in a row: {roles:?}"
    );
    assert_eq!(turns(&fwd_v).last(), turns(&raw_v).last(), "{what}: the last turn changed");
}

#[test]
fn replaying_a_converted_session_keeps_the_invariants_the_prefix_and_compacts() {
    let requests = coding_session(40, 150);
    let lines: Vec<&[u8]> = requests.iter().map(Vec::as_slice).collect();
    for mode in [Mode::Epoch, Mode::Eager] {
        let compactor = SessionCompactor::new(&config(mode), engine()).unwrap();
        let out = replay_session(&compactor, Wire::Gemini, "s", &lines, Some(WINDOW));
        for (k, (raw, replayed)) in lines.iter().zip(&out).enumerate() {
            assert!(replayed.skipped.is_none(), "{mode:?} {k}: {:?}", replayed.skipped);
            check_forwarded(raw, &replayed.forwarded, &format!("{mode:?} request {k}"));
        }
        // Between epochs nothing already sent is rewritten: each request's turns start with the
        // previous request's, so the upstream's implicit cache keeps hitting.
        let mut n_epochs = 0;
        for (k, pair) in out.windows(2).enumerate() {
            let summary = pair[1].summary.as_ref().unwrap();
            if summary.epoch_started {
                n_epochs += 1;
                continue;
            }
            let contents =
                |b: &[u8]| serde_json::from_slice::<Value>(b).unwrap()["contents"].as_array().unwrap().clone();
            let (before, after) = (contents(&pair[0].forwarded), contents(&pair[1].forwarded));
            assert_eq!(after[..before.len()], before[..], "{mode:?}: request {} rewrote what request {k} sent", k + 1);
        }
        assert!(n_epochs >= 1, "{mode:?}: the session must compact");
        let raw_bytes: usize = lines.iter().map(|l| l.len()).sum();
        let fwd_bytes: usize = out.iter().map(|r| r.forwarded.len()).sum();
        assert!(fwd_bytes < raw_bytes * 3 / 4, "{mode:?}: {fwd_bytes} of {raw_bytes} bytes");
    }
}

/// Tokens saved over a replayed session (1 - forwarded / raw).
fn saved(replayed: &[Replayed]) -> f64 {
    let tokens = |raw: bool| -> u64 {
        replayed
            .iter()
            .filter_map(|r| r.summary.as_ref())
            .map(|s| if raw { s.tokens_raw } else { s.tokens_forwarded })
            .sum()
    };
    1.0 - tokens(false) as f64 / tokens(true) as f64
}

/// A chat session and the same session converted to Gemini, both replayed at 16k: the invariants hold
/// on every Gemini request, and the savings are within a few points of the chat path's.
fn replay_beside_chat(chat_text: &str, what: &str) -> (f64, f64, Vec<Replayed>) {
    let converted = pare::wire::convert::chat_session_to(pare::wire::Wire::Gemini, chat_text);
    let chat_lines = session_lines(chat_text.as_bytes());
    let lines = session_lines(converted.as_bytes());
    assert_eq!(lines.len(), chat_lines.len());
    let compactor = SessionCompactor::new(&config(Mode::Epoch), engine()).unwrap();
    let out = replay_session(&compactor, Wire::Gemini, "g", &lines, Some(WINDOW));
    for (k, (raw, replayed)) in lines.iter().zip(&out).enumerate() {
        assert!(replayed.skipped.is_none(), "{what} request {k}: {:?}", replayed.skipped);
        check_forwarded(raw, &replayed.forwarded, &format!("{what} request {k}"));
    }
    let chat = replay_session(&compactor, Wire::Chat, "c", &chat_lines, Some(WINDOW));
    let (saved_gemini, saved_chat) = (saved(&out), saved(&chat));
    eprintln!("{what}: saved {saved_gemini:.3} (gemini) against {saved_chat:.3} (chat)");
    assert!(
        (saved_gemini - saved_chat).abs() < 0.05,
        "{what}: saved {saved_gemini:.3} (gemini) against {saved_chat:.3} (chat)"
    );
    (saved_gemini, saved_chat, out)
}

/// The fixture sessions and the shared coding session, converted to Gemini, replayed at 16k within
/// the chat path's savings; the long coding session is compacted (its last request goes out far
/// below its raw size).
#[test]
fn converted_sessions_replay_within_the_chat_savings() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sessions");
    let mut n_sessions = 0;
    for source in std::fs::read_dir(&dir).unwrap() {
        for file in std::fs::read_dir(source.unwrap().path()).unwrap() {
            let path = file.unwrap().path();
            replay_beside_chat(&std::fs::read_to_string(&path).unwrap(), &path.display().to_string());
            n_sessions += 1;
        }
    }
    assert!(n_sessions >= 2);
    let agent = CodingAgent { model: MODEL, tool: "run_shell_command", id_prefix: "call_", reasoning: None };
    let chat: Vec<String> = crate::support::coding_session(&agent, 40, 150).iter().map(Value::to_string).collect();
    let (saved_gemini, _, out) = replay_beside_chat(&chat.join("\n"), "coding session");
    let last_raw = convert::chat_to_gemini(&serde_json::from_str(chat.last().unwrap()).unwrap()).unwrap().to_string();
    let last_forwarded = &out.last().unwrap().forwarded;
    eprintln!("coding session: last request {} characters raw, {} forwarded", last_raw.len(), last_forwarded.len());
    assert!(saved_gemini > 0.3, "the coding session must compact: saved {saved_gemini:.3}");
    assert!(last_forwarded.len() < last_raw.len() / 2);
}

/// The converter's output is what the adapter reads: every converted fixture request parses, passes
/// the API's checks, and its neutral view has the chat request's tool calls and results, in order.
#[test]
fn converted_requests_read_back_as_the_chat_conversation() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sessions/swe-agent");
    for file in std::fs::read_dir(dir).unwrap() {
        let text = std::fs::read_to_string(file.unwrap().path()).unwrap();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let chat: Value = serde_json::from_str(line).unwrap();
            let converted = convert::chat_to_gemini(&chat).unwrap().to_string();
            let body = GeminiBody::parse(converted.as_bytes()).unwrap();
            body.check().unwrap();
            let v: Value = serde_json::from_str(&converted).unwrap();
            check_turns(&v["contents"].as_array().unwrap().iter().map(Value::to_string).collect::<Vec<_>>()).unwrap();
            let shape = |messages: Vec<Value>| -> Vec<(String, usize)> {
                messages
                    .iter()
                    .filter(|m| m["role"] != "user" && m["role"] != "system")
                    .map(|m| (m["role"].as_str().unwrap().to_owned(), m["tool_calls"].as_array().map_or(0, Vec::len)))
                    .collect()
            };
            let neutral: Vec<Value> = body.messages().iter().map(|m| serde_json::from_str(m).unwrap()).collect();
            let chat_messages = chat["messages"].as_array().unwrap().clone();
            assert_eq!(shape(neutral), shape(chat_messages));
        }
    }
}

/// The responses a Gemini server streams for one answer: a thought, text in pieces, a signed
/// function call, the usage (with cached tokens) in the last.
fn call_responses() -> Vec<Value> {
    let response = |parts: Value, last: bool| {
        let mut r = json!({"candidates": [{"content": {"role": "model", "parts": parts}, "index": 0}], "modelVersion": MODEL, "responseId": "r-1"});
        if last {
            r["candidates"][0]["finishReason"] = json!("STOP");
            r["usageMetadata"] = json!({"promptTokenCount": 40, "candidatesTokenCount": 9, "totalTokenCount": 60, "cachedContentTokenCount": 32, "thoughtsTokenCount": 11});
        }
        r
    };
    vec![
        response(json!([{"text": "List them.", "thought": true}]), false),
        response(json!([{"text": "Listing"}]), false),
        response(json!([{"text": " files."}]), false),
        response(
            json!([{"functionCall": {"name": "run_shell_command", "args": {"command": "ls"}}, "thoughtSignature": "Q2lRc2ln"}]),
            true,
        ),
    ]
}

fn sse_steps() -> Vec<Step> {
    call_responses().iter().map(|r| Step::Send(Bytes::from(format!("data: {r}\r\n\r\n")))).collect()
}

fn json_array_steps() -> Vec<Step> {
    let mut steps: Vec<Step> = call_responses()
        .iter()
        .enumerate()
        .map(|(n, r)| Step::Send(Bytes::from(format!("{}{r}", if n == 0 { "[" } else { "\r\n,\r\n" }))))
        .collect();
    steps.push(Step::Send(Bytes::from_static(b"\r\n]")));
    steps
}

fn final_response(text: &str) -> Value {
    json!({"candidates": [{"content": {"role": "model", "parts": [{"text": text}]}, "finishReason": "STOP", "index": 0}],
        "usageMetadata": {"promptTokenCount": 80, "candidatesTokenCount": 3, "totalTokenCount": 83, "cachedContentTokenCount": 64},
        "modelVersion": MODEL})
}

fn sent(steps: Vec<Step>) -> Vec<u8> {
    steps
        .into_iter()
        .flat_map(|step| match step {
            Step::Send(bytes) => bytes.to_vec(),
            _ => Vec::new(),
        })
        .collect()
}

/// The proxy forwards exactly what `pare replay --wire gemini` predicts (the model, named in the
/// path, selects the window), keeps the query string and Google's headers; `countTokens` passes
/// through untouched; metrics are labelled `wire="gemini"`.
#[tokio::test]
async fn proxy_forwards_what_replay_predicts_for_gemini() {
    for mode in [Mode::Epoch, Mode::Eager] {
        let requests = coding_session(30, 150);
        let lines: Vec<&[u8]> = requests.iter().map(Vec::as_slice).collect();
        let stub = Stub::start(|request| {
            if request.path_only().ends_with(":countTokens") {
                Reply::json(200, json!({"totalTokens": 123}))
            } else {
                Reply::json(200, final_response("done"))
            }
        })
        .await;
        let mut config = in_process::config_for(&stub);
        let defaults = self::config(mode);
        config.compaction = defaults.compaction.clone();
        config.budget = defaults.budget.clone();
        config.models = defaults.models.clone();
        let compactor = Arc::new(SessionCompactor::new(&config, engine()).unwrap());
        let server = in_process::start_with_compactor(config.clone(), compactor).await;
        let path = format!("/v1beta/models/{MODEL}:generateContent");
        for line in &lines {
            let response = within(
                "pare to answer",
                client()
                    .post(server.url(&format!("{path}?key=AIza-SECRET")))
                    .header("content-type", "application/json")
                    .header("x-goog-api-client", "google-genai-sdk/3.6.1 gl-python/3.11")
                    .header("x-pare-session", "gemini-replay")
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
        let count_path = format!("/v1beta/models/{MODEL}:countTokens");
        let counted = client().post(server.url(&count_path)).body(big.clone()).send().await.unwrap();
        assert!(!counted.headers().contains_key("x-pare-session"), "countTokens is not compacted");
        counted.bytes().await.unwrap();
        let seen = stub.requests();
        let (count, received): (Vec<_>, Vec<_>) =
            seen.into_iter().partition(|r| r.path_only().ends_with(":countTokens"));
        assert_eq!(count[0].body, big, "countTokens passes through byte for byte");
        for request in &received {
            assert_eq!(request.path, format!("{path}?key=AIza-SECRET"));
            assert_eq!(request.header("x-goog-api-client"), Some("google-genai-sdk/3.6.1 gl-python/3.11"));
        }
        let received: Vec<Vec<u8>> = received.into_iter().map(|r| r.body.to_vec()).collect();
        let replay = SessionCompactor::new(&config, engine()).unwrap();
        let predicted = replay_session(&replay, Wire::Gemini, "replay", &lines, Some(WINDOW));
        assert_eq!(received.len(), predicted.len());
        for (k, (got, want)) in received.iter().zip(&predicted).enumerate() {
            assert!(*got == want.forwarded, "{mode:?}, request {k}: the proxy forwarded something else than replay");
        }
        assert!(received.iter().zip(&lines).any(|(f, r)| f.as_slice() != *r), "{mode:?}: pare must compact");
        let metrics = client().get(server.url("/_pare/metrics")).send().await.unwrap().text().await.unwrap();
        assert!(metrics.contains(&format!(r#"pare_tokens_raw_total{{model="{MODEL}",wire="gemini"}}"#)), "{metrics}");
    }
}

/// A streamed (SSE), a JSON-array streamed and a plain Gemini exchange through `pare serve`: the
/// streams reach the client as sent, all three are archived byte for byte without the API key (sent
/// as `x-goog-api-key` and as `key=`), the tracker joins them into one session (the assembled answer
/// is the next request's model turn), the archived answers keep the usage with its cached tokens,
/// and export gives the chat conversation.
#[tokio::test]
async fn gemini_exchanges_are_archived_tracked_and_exported() {
    let stub = Stub::start(|request| {
        if request.path.ends_with(":streamGenerateContent?alt=sse") {
            Reply::sse(sse_steps())
        } else if request.path_only().ends_with(":streamGenerateContent") {
            Reply::Stream {
                status: 200,
                headers: vec![("content-type".into(), "application/json; charset=UTF-8".into())],
                steps: json_array_steps(),
            }
        } else {
            Reply::json(200, final_response("a.rs b.rs"))
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

    let first = json!({
        "contents": [{"role": "user", "parts": [{"text": "list the files"}]}],
        "systemInstruction": {"parts": [{"text": "You are Gemini CLI."}]},
        "tools": [{"functionDeclarations": [{"name": "run_shell_command", "description": "run", "parametersJsonSchema": {"type": "object"}}]}],
        "generationConfig": {"thinkingConfig": {"includeThoughts": true}},
    });
    let with_answer = |answer: Value, result: &str| {
        let mut next = first.clone();
        next["contents"].as_array_mut().unwrap().extend([
            answer,
            json!({"role": "user", "parts": [{"functionResponse": {"id": "run_shell_command-1", "name": "run_shell_command", "response": {"output": result}}}]}),
        ]);
        next
    };
    let streamed = pare::archive::gemini_sse::assemble(&sent(sse_steps()), true).unwrap();
    let second = with_answer(streamed["message"].clone(), "a.rs\nb.rs");
    let third = with_answer(streamed["message"].clone(), "a.rs\nb.rs\nc.rs");
    let model_path = format!("/v1beta/models/{MODEL}");
    let exchanges = [
        (&first, format!("{model_path}:streamGenerateContent?alt=sse"), Some(sse_steps())),
        (&second, format!("{model_path}:streamGenerateContent?key=AIza-SECRET"), Some(json_array_steps())),
        (&third, format!("{model_path}:generateContent"), None),
    ];
    let mut sessions = Vec::new();
    for (body, path, steps) in &exchanges {
        let response = client()
            .post(server.url(path))
            .header("content-type", "application/json")
            .header("x-goog-api-key", "AIza-SECRET")
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        assert!(response.status().is_success());
        sessions.push(response.headers()["x-pare-session"].to_str().unwrap().to_owned());
        let text = response.bytes().await.unwrap();
        if let Some(steps) = steps {
            assert_eq!(text.to_vec(), sent(steps.clone()), "the stream arrives as the upstream sent it");
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
    let session = listed.iter().find(|s| s.id == sessions[0]).unwrap();
    assert_eq!(session.wire, Some("gemini"));
    assert!(session.n_requests >= 2);
    let raw = reader.body(&sessions[0], 2, pare::archive::read::BodyKind::Raw).unwrap();
    assert_eq!(raw, second.to_string().into_bytes(), "archived byte for byte");
    for seq in [1, 2] {
        let answer = reader.response(&sessions[0], seq).unwrap().unwrap().assembled.unwrap();
        assert_eq!(answer["message"]["parts"][1], json!({"text": "Listing files."}), "request {seq}");
        assert_eq!(answer["message"]["parts"][2]["thoughtSignature"], "Q2lRc2ln");
        assert_eq!(answer["finish_reason"], "STOP");
        assert_eq!(answer["usage"]["cachedContentTokenCount"], 32);
        assert_eq!(answer["model"], MODEL);
    }

    let data = pare::archive::export::load_sessions(&reader, &Default::default()).unwrap();
    let exported = data.iter().find(|s| s.id == sessions[0]).unwrap();
    let row = pare::archive::export::sft_row(exported, pare::archive::export::SftFormat::OpenAi).unwrap();
    let roles: Vec<&str> = row["messages"].as_array().unwrap().iter().map(|m| m["role"].as_str().unwrap()).collect();
    assert_eq!(roles[..4], ["system", "user", "assistant", "tool"]);
    assert_eq!(row["messages"][0]["content"], "You are Gemini CLI.");
    assert_eq!(row["messages"][2]["content"], "Listing files.", "the thought is left out");
    assert_eq!(row["messages"][2]["tool_calls"][0]["function"]["arguments"], r#"{"command":"ls"}"#);
    assert_eq!(row["messages"][3]["tool_call_id"], row["messages"][2]["tool_calls"][0]["id"]);
    assert_eq!(row["tools"][0]["function"]["name"], "run_shell_command");
}

/// `pare replay --wire gemini --path P` reads the model from the path the requests were sent to, as
/// the proxy does: with a `models:` entry for it, the session is compacted at that entry's window;
/// without the path no entry matches and the session goes at the default Gemini window, unchanged.
#[test]
fn replay_reads_the_model_from_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let session = dir.path().join("session.jsonl");
    let requests = coding_session(30, 150);
    let mut text = requests.join(&b'\n');
    text.push(b'\n');
    std::fs::write(&session, &text).unwrap();
    let config = dir.path().join("pare.yaml");
    std::fs::write(&config, format!("models:\n  - match: \"^gemini-\"\n    context_window: {WINDOW}\n")).unwrap();
    let replay = |path: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_pare"))
            .args(["replay", "--wire", "gemini", "--mode", "epoch", "--config"])
            .arg(&config)
            .args(["--path", path])
            .arg(&session)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        out.stdout
    };
    let with_model = replay(&format!("/v1beta/models/{MODEL}:generateContent"));
    assert!(with_model.len() < text.len() * 3 / 4, "{} of {} bytes", with_model.len(), text.len());
    let lines: Vec<&[u8]> = requests.iter().map(Vec::as_slice).collect();
    let compactor = SessionCompactor::new(&config_at_default_reserve(Mode::Epoch), engine()).unwrap();
    let predicted: Vec<u8> = replay_session(&compactor, Wire::Gemini, "p", &lines, Some(WINDOW))
        .into_iter()
        .flat_map(|r| [r.forwarded, b"\n".to_vec()].concat())
        .collect();
    assert!(with_model == predicted, "the replay at the model's window is the proxy's");
    assert_eq!(replay(""), text, "no path names no model: the default window holds the whole session");
}

/// pare's own errors reach a Gemini client in Google's shape (`{"error": {"code", "message",
/// "status"}}`), which the google-genai SDKs parse.
#[tokio::test]
async fn pare_errors_reach_gemini_clients_in_googles_shape() {
    let stub = Stub::start(|_| Reply::json(200, final_response("unused"))).await;
    let mut config = in_process::config_for(&stub);
    config.server.max_body = 64;
    let server = in_process::start(config).await;
    let response = client()
        .post(server.url(&format!("/v1beta/models/{MODEL}:generateContent")))
        .header("content-type", "application/json")
        .body(vec![b' '; 200])
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 413);
    let body: Value = serde_json::from_slice(&response.bytes().await.unwrap()).unwrap();
    assert_eq!(body["error"]["code"], 413);
    assert_eq!(body["error"]["status"], "OUT_OF_RANGE");
    assert!(body["error"]["message"].as_str().unwrap().contains("server.max_body"), "{body}");
}
