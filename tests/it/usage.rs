//! The upstream's own usage figures through `pare serve`: read from every answer dialect (JSON and
//! streamed), archived per answer, summed per session by the query layer and the CLI, counted in the
//! Prometheus series by model and wire; "not reported" stays distinct from zero. And the
//! attributable savings of a session, from the provider's figures and from pare's estimate.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use pare::archive::prefill::MissSource;
use pare::archive::query::{ArchiveReader, EpochMiss, Savings};
use pare::archive::{Archive, ExchangeRecord, ResponseRecord};
use pare::config::Durability;
use pare::exchange::Usage;
use pare::pipeline::{CompactionSummary, StreamEnd};
use pare::wire::Wire;
use serde_json::{Value, json};

use crate::support::pare::{config_for, start_with_pipeline};
use crate::support::stub::{Recorded, Reply, Step, Stub, chunk_event, sse_done, sse_event};
use crate::support::{client, within};

/// The figures the stub reports for one (wire, streamed) pair, all distinct so that sums show.
fn reported(wire: Wire, stream: bool) -> Usage {
    let base = match wire {
        Wire::Chat => 1000,
        Wire::Responses => 2000,
        Wire::Messages => 3000,
        Wire::Gemini => 4000,
    } + if stream { 100 } else { 0 };
    match wire {
        Wire::Chat => Usage { prompt: Some(base), cached: Some(base / 2), cache_write: None, output: Some(7) },
        Wire::Responses => Usage { prompt: Some(base), cached: Some(base / 4), cache_write: None, output: Some(9) },
        // Anthropic's input_tokens excludes reads and writes: the prompt is the three together.
        Wire::Messages => {
            Usage { prompt: Some(base), cached: Some(base / 2), cache_write: Some(200), output: Some(11) }
        }
        // Gemini's output is its candidates plus its thoughts (8 + 5).
        Wire::Gemini => Usage { prompt: Some(base), cached: Some(base / 8), cache_write: None, output: Some(13) },
    }
}

fn model(wire: Wire) -> &'static str {
    match wire {
        Wire::Chat => "m-chat",
        Wire::Responses => "m-responses",
        Wire::Messages => "m-messages",
        Wire::Gemini => "m-gemini",
    }
}

fn chat_usage(u: Usage) -> Value {
    json!({"prompt_tokens": u.prompt, "completion_tokens": u.output, "total_tokens": u.prompt.unwrap() + u.output.unwrap(),
        "prompt_tokens_details": {"cached_tokens": u.cached, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0}})
}

fn responses_object(u: Usage, status: &str) -> Value {
    json!({"id": "resp_1", "object": "response", "created_at": 1_700_000_000, "status": status, "model": "m-responses",
        "output": [{"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": "done", "annotations": []}]}],
        "usage": {"input_tokens": u.prompt, "input_tokens_details": {"cached_tokens": u.cached},
            "output_tokens": u.output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt.unwrap() + u.output.unwrap()}})
}

fn messages_usage(u: Usage, output: u64) -> Value {
    let (cached, written) = (u.cached.unwrap(), u.cache_write.unwrap());
    json!({"input_tokens": u.prompt.unwrap() - cached - written, "cache_creation_input_tokens": written,
        "cache_read_input_tokens": cached, "output_tokens": output, "service_tier": "standard"})
}

fn messages_object(u: Usage, output: u64) -> Value {
    json!({"id": "msg_1", "type": "message", "role": "assistant", "model": "m-messages",
        "content": [{"type": "text", "text": "done"}], "stop_reason": "end_turn", "stop_sequence": null,
        "usage": messages_usage(u, output)})
}

fn gemini_chunk(u: Usage, text: &str, last: bool) -> Value {
    let mut chunk = json!({"candidates": [{"content": {"role": "model", "parts": [{"text": text}]}, "index": 0}],
        "usageMetadata": {"promptTokenCount": u.prompt}, "modelVersion": "m-gemini", "responseId": "r1"});
    if last {
        chunk["candidates"][0]["finishReason"] = json!("STOP");
        chunk["usageMetadata"] = json!({"promptTokenCount": u.prompt, "cachedContentTokenCount": u.cached,
            "candidatesTokenCount": 8, "thoughtsTokenCount": 5, "totalTokenCount": u.prompt.unwrap() + 13});
    }
    chunk
}

fn named(event: &str, data: &Value) -> Step {
    Step::Send(Bytes::from(format!("event: {event}\ndata: {data}\n\n")))
}

/// The stub: each dialect's answer, JSON or streamed as its real server sends it, with
/// [`reported`]'s figures; a chat request whose model is `silent` gets an answer without usage.
fn answer(request: &Recorded) -> Reply {
    let body = request.json();
    let stream = body["stream"] == true || request.path_only().ends_with(":streamGenerateContent");
    let wire = Wire::of_path(request.path_only()).expect("a compacted path");
    let u = reported(wire, stream);
    match (wire, stream) {
        (Wire::Chat, false) => {
            let mut completion = json!({"id": "chatcmpl-1", "object": "chat.completion", "created": 1_700_000_000,
                "model": body["model"], "choices": [{"index": 0, "message": {"role": "assistant", "content": "done"},
                "finish_reason": "stop"}], "usage": chat_usage(u)});
            if body["model"] == "silent" {
                completion.as_object_mut().unwrap().remove("usage");
            }
            Reply::json(200, completion)
        }
        (Wire::Chat, true) => {
            let last = json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1_700_000_000,
                "model": "m-chat", "choices": [], "usage": chat_usage(u)});
            Reply::sse(vec![
                Step::Send(chunk_event("m-chat", json!({"role": "assistant", "content": "done"}), None)),
                Step::Send(chunk_event("m-chat", json!({}), Some("stop"))),
                Step::Send(sse_event(&last)),
                Step::Send(sse_done()),
            ])
        }
        (Wire::Responses, false) => Reply::json(200, responses_object(u, "completed")),
        (Wire::Responses, true) => {
            let mut created = responses_object(u, "in_progress");
            created["output"] = json!([]);
            created["usage"] = Value::Null;
            let done = responses_object(u, "completed");
            Reply::sse(vec![
                named(
                    "response.created",
                    &json!({"type": "response.created", "sequence_number": 0, "response": created}),
                ),
                named(
                    "response.output_item.done",
                    &json!({"type": "response.output_item.done", "sequence_number": 1, "output_index": 0, "item": done["output"][0]}),
                ),
                named(
                    "response.completed",
                    &json!({"type": "response.completed", "sequence_number": 2, "response": done}),
                ),
            ])
        }
        (Wire::Messages, false) => Reply::json(200, messages_object(u, u.output.unwrap())),
        (Wire::Messages, true) => {
            let mut started = messages_object(u, 1);
            started["content"] = json!([]);
            started["stop_reason"] = Value::Null;
            Reply::sse(vec![
                named("message_start", &json!({"type": "message_start", "message": started})),
                named(
                    "content_block_start",
                    &json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
                ),
                named(
                    "content_block_delta",
                    &json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "done"}}),
                ),
                named("content_block_stop", &json!({"type": "content_block_stop", "index": 0})),
                named(
                    "message_delta",
                    &json!({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": null},
                        "usage": {"output_tokens": u.output}}),
                ),
                named("message_stop", &json!({"type": "message_stop"})),
            ])
        }
        (Wire::Gemini, false) => Reply::json(200, gemini_chunk(u, "done", true)),
        (Wire::Gemini, true) => Reply::sse(vec![
            Step::Send(Bytes::from(format!("data: {}\r\n\r\n", gemini_chunk(u, "do", false)))),
            Step::Send(Bytes::from(format!("data: {}\r\n\r\n", gemini_chunk(u, "ne", true)))),
        ]),
    }
}

fn request(wire: Wire, stream: bool, model: &str) -> (String, Value) {
    let user = json!([{"role": "user", "content": "what changed?"}]);
    match wire {
        Wire::Chat => (
            "/v1/chat/completions".into(),
            json!({"model": model, "messages": user, "stream": stream, "stream_options": if stream { json!({"include_usage": true}) } else { Value::Null }}),
        ),
        Wire::Responses => ("/v1/responses".into(), json!({"model": model, "input": user, "stream": stream})),
        Wire::Messages => {
            ("/v1/messages".into(), json!({"model": model, "max_tokens": 256, "messages": user, "stream": stream}))
        }
        Wire::Gemini => {
            let method = if stream { "streamGenerateContent?alt=sse" } else { "generateContent" };
            (
                format!("/v1beta/models/{model}:{method}"),
                json!({"contents": [{"role": "user", "parts": [{"text": "what changed?"}]}]}),
            )
        }
    }
}

fn pare_cli(args: &[&str]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pare")).args(args).output().expect("run pare");
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// Every dialect, JSON and streamed, through the proxy: the answer's usage is archived as the
/// upstream reported it (Anthropic's prompt summed from its three parts), the session sums and the
/// CLI show it, the Prometheus series count it by model and wire; an answer without usage reads
/// "not reported" everywhere, never 0.
#[tokio::test]
async fn the_upstreams_usage_is_archived_listed_and_counted_for_every_format() {
    let stub = Stub::start(answer).await;
    let dir = tempfile::tempdir().unwrap();
    let mut config = config_for(&stub);
    config.archive.enabled = true;
    config.archive.dir = Some(dir.path().to_owned());
    config.budget.detect_window = false;
    let config = Arc::new(config);
    let pipeline = Arc::new(pare::pipeline::Pipeline::from_config(config.clone()).unwrap());
    let server = start_with_pipeline(config.clone(), pipeline).await;

    let mut cases: Vec<(Wire, bool, &str)> = Vec::new();
    for wire in Wire::ALL {
        for stream in [false, true] {
            cases.push((wire, stream, model(wire)));
        }
    }
    cases.push((Wire::Chat, false, "silent"));
    for &(wire, stream, model) in &cases {
        let (path, body) = request(wire, stream, model);
        let session = format!("{}-{}-{model}", wire.name(), if stream { "stream" } else { "json" });
        let response = within(
            "pare to answer",
            client()
                .post(server.url(&path))
                .header("content-type", "application/json")
                .header("x-pare-session", &session)
                .body(body.to_string())
                .send(),
        )
        .await
        .unwrap();
        assert!(response.status().is_success(), "{session}");
        response.bytes().await.unwrap();
    }
    let metrics = client().get(server.url("/_pare/metrics")).send().await.unwrap().text().await.unwrap();
    server.shutdown().await.unwrap();

    for wire in Wire::ALL {
        let (json, streamed) = (reported(wire, false), reported(wire, true));
        let labels = format!(r#"{{model="{}",wire="{}"}}"#, model(wire), wire.name());
        let sum = |f: fn(&Usage) -> Option<u64>| f(&json).unwrap() + f(&streamed).unwrap();
        for (series, total) in [
            ("pare_upstream_prompt_tokens_total", Some(sum(|u| u.prompt))),
            ("pare_upstream_cached_tokens_total", Some(sum(|u| u.cached))),
            ("pare_upstream_output_tokens_total", Some(sum(|u| u.output))),
            ("pare_upstream_cache_write_tokens_total", (wire == Wire::Messages).then(|| sum(|u| u.cache_write))),
        ] {
            let line = format!("{series}{labels} ");
            match total {
                Some(total) => assert!(metrics.contains(&format!("{line}{total}\n")), "{line}{total} in\n{metrics}"),
                None => {
                    assert!(!metrics.contains(&line), "{series} was never reported for {wire:?}: no series\n{metrics}")
                }
            }
        }
    }
    assert!(metrics.contains(r#"pare_upstream_usage_unreported_total{model="silent",wire="chat"} 1"#), "{metrics}");
    // Uncached prefill with pare is the upstream's prompt − cached where it reported both; the
    // silent upstream's is pare's estimate, on a first request the whole forwarded prompt, as is
    // the raw side's.
    for wire in Wire::ALL {
        let with_pare = reported(wire, false).uncached().unwrap() + reported(wire, true).uncached().unwrap();
        let line = format!(
            r#"pare_uncached_prefill_tokens_total{{model="{}",wire="{}",with="pare"}} {with_pare}"#,
            model(wire),
            wire.name()
        );
        assert!(metrics.contains(&format!("{line}\n")), "{line} in\n{metrics}");
    }
    let series = |with: &str| -> u64 {
        let head = format!(r#"pare_uncached_prefill_tokens_total{{model="silent",wire="chat",with="{with}"}} "#);
        let line = metrics.lines().find(|l| l.starts_with(&head)).unwrap_or_else(|| panic!("{head} in\n{metrics}"));
        line[head.len()..].parse().unwrap()
    };
    assert!(series("pare") > 0);
    assert_eq!(series("pare"), series("raw"));
    assert!(!metrics.contains(r#"pare_upstream_prompt_tokens_total{model="silent""#), "{metrics}");

    let reader = ArchiveReader::open(dir.path()).unwrap();
    for &(wire, stream, model) in &cases {
        let session = format!("{}-{}-{model}", wire.name(), if stream { "stream" } else { "json" });
        let exchanges = reader.exchanges(&session).unwrap();
        let info = reader.session(&session).unwrap();
        if model == "silent" {
            assert_eq!(exchanges[0].usage, None, "{session}");
            assert_eq!((info.upstream.n_reported, info.upstream.prompt, info.upstream.hit_rate()), (0, None, None));
            continue;
        }
        let expected = reported(wire, stream);
        assert_eq!(exchanges[0].usage, Some(expected), "{session}");
        let to_i64 = |n: Option<u64>| n.map(|n| n as i64);
        assert_eq!(
            (info.upstream.n_reported, info.upstream.prompt, info.upstream.cached, info.upstream.cache_write),
            (1, to_i64(expected.prompt), to_i64(expected.cached), to_i64(expected.cache_write)),
            "{session}"
        );
        assert_eq!(info.upstream.hit_rate(), expected.hit_rate(), "{session}");
    }

    let archive = dir.path().to_str().unwrap();
    let listed: Vec<Value> = pare_cli(&["sessions", "list", "--json", "--archive", archive])
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    let by_id = |id: &str| listed.iter().find(|s| s["id"] == id).unwrap_or_else(|| panic!("{id} listed"));
    let claude = by_id("messages-stream-m-messages");
    assert_eq!(
        (&claude["upstream_prompt_tokens"], &claude["upstream_cached_tokens"], &claude["upstream_cache_write_tokens"]),
        (&json!(3100), &json!(1550), &json!(200))
    );
    let silent = by_id("chat-json-silent");
    for key in ["upstream_prompt_tokens", "upstream_cached_tokens", "upstream_cache_write_tokens"] {
        assert_eq!(silent[key], Value::Null, "{key}: not reported is null, not 0");
    }
    let codex = by_id("responses-json-m-responses");
    assert_eq!(codex["upstream_cache_write_tokens"], Value::Null, "Responses reports no cache writes");
    assert_eq!(codex["upstream_cached_tokens"], json!(500));
    let chat = by_id("chat-json-m-chat");
    assert_eq!(chat["uncached_prefill_pare_tokens"], json!(reported(Wire::Chat, false).uncached().unwrap()));
    assert_eq!((&chat["uncached_prefill_pare_from"], &chat["epochs"]), (&json!("provider"), &json!(0)));
    assert!(chat["uncached_prefill_raw_tokens"].as_u64().unwrap() > 0);
    assert_eq!(silent["uncached_prefill_pare_from"], json!("estimate"));
    assert_eq!(silent["uncached_prefill_pare_tokens"], silent["uncached_prefill_raw_tokens"]);
    assert_eq!(silent["saved_forwarded_tokens_share"], json!(0.0));

    let table = pare_cli(&["sessions", "list", "--archive", archive]);
    for column in ["EPOCHS", "SAVED (FWD)", "ATTRIBUTABLE", "UNCACHED PARE / RAW", "SAVED (UNC.)"] {
        assert!(table.lines().next().unwrap().contains(column), "{column} in\n{table}");
    }
    let row = |id: &str| table.lines().find(|l| l.starts_with(id)).unwrap_or_else(|| panic!("{id} in\n{table}"));
    assert!(row("chat-json-m-chat").contains("50.0 % of 1,000"), "{table}");
    assert!(row("chat-json-silent").contains("not reported"), "{table}");
    let shown = pare_cli(&["sessions", "show", "messages-json-m-messages", "--archive", archive]);
    assert!(
        shown.contains("upstream usage: prompt 3,000 · cached 1,500 (50.0 %) · cache write 200 · output 11"),
        "{shown}"
    );
    let shown = pare_cli(&["sessions", "show", "chat-json-silent", "--archive", archive]);
    assert!(shown.contains("upstream usage: not reported"), "{shown}");
    assert!(shown.contains("request uncached prefill: ") && shown.contains(" with pare (estimate)"), "{shown}");
    let shown = pare_cli(&["sessions", "show", "chat-json-m-chat", "--archive", archive]);
    assert!(shown.contains("request uncached prefill: 500 with pare (provider)"), "{shown}");
    assert!(shown.contains("session uncached prefill: compaction"), "{shown}");
}

fn chat_body(messages: &[Value]) -> Vec<u8> {
    serde_json::to_vec(&json!({"model": "m", "messages": messages})).unwrap()
}

fn summary(raw: u64, forwarded: u64, epoch_started: bool) -> CompactionSummary {
    CompactionSummary {
        tokens_raw: raw,
        tokens_forwarded: forwarded,
        epoch: u64::from(epoch_started),
        epoch_started,
        ..Default::default()
    }
}

fn answered(usage: Value) -> ResponseRecord {
    let body = json!({"id": "c", "object": "chat.completion", "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": usage});
    let bytes = serde_json::to_vec(&body).unwrap();
    ResponseRecord {
        at_ms: 1,
        status: Some(200),
        headers: Vec::new(),
        stream: false,
        end: StreamEnd::Complete,
        assembled: pare::archive::response::assemble(&bytes, false),
        body: bytes,
        truncated: None,
        key_ext: None,
    }
}

/// Attributable savings: what pare removed, less the cache misses of the request that started an
/// epoch: from the upstream's prompt − cached when its answer reported both, else pare's estimate
/// from the forwarded prefix the epoch request shares with the one before; what the agent added
/// since its previous request is not counted as a miss.
#[test]
fn savings_net_of_epoch_misses_come_from_the_provider_else_from_the_shared_prefix() {
    let dir = tempfile::tempdir().unwrap();
    let archive = Archive::start(dir.path().to_owned(), Durability::Buffered, Duration::from_millis(10));
    let system = json!({"role": "system", "content": "You are a coding agent. ".repeat(40)});
    let user = json!({"role": "user", "content": "fix the failing test"});
    let call = json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
        "function": {"name": "read_file", "arguments": "{\"path\":\"src/lib.rs\"}"}}]});
    let result = json!({"role": "tool", "tool_call_id": "c1", "content": "fn main() {}\n".repeat(200)});
    let marker =
        json!({"role": "tool", "tool_call_id": "c1", "content": "[tool: read_file(\"src/lib.rs\") → 2,600 chars]"});
    let next = json!({"role": "assistant", "content": "Now the test."});
    let first = chat_body(&[system.clone(), user.clone()]);
    let second = chat_body(&[system.clone(), user.clone(), call.clone(), result.clone()]);
    let third_raw = chat_body(&[system.clone(), user.clone(), call.clone(), result.clone(), next.clone()]);
    let third_fwd = chat_body(&[system.clone(), user.clone(), call.clone(), marker.clone(), next.clone()]);
    let cases = [
        (
            "provider",
            json!({"prompt_tokens": 400, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 20}}),
        ),
        ("estimate", json!({"prompt_tokens": 400, "completion_tokens": 5})),
    ];
    for (session, third_usage) in &cases {
        let requests = [
            (&first, None, summary(100, 100, false), json!({"prompt_tokens": 100, "completion_tokens": 5})),
            (&second, None, summary(800, 800, false), json!({"prompt_tokens": 800, "completion_tokens": 5})),
            (&third_raw, Some(&third_fwd), summary(830, 330, true), third_usage.clone()),
        ];
        for (raw, forwarded, summary, usage) in requests {
            let record = ExchangeRecord {
                forwarded: forwarded.map(|f| Bytes::from(f.clone())),
                summary: Some(summary),
                ..ExchangeRecord::unchanged(*session, 1, Bytes::from(raw.clone()))
            };
            let ticket = archive.record_exchange(record);
            archive.record_response(ticket, answered(usage));
        }
    }
    archive.flush().unwrap();
    let reader = ArchiveReader::open(dir.path()).unwrap();

    let ui = pare::ui::Ui::new(dir.path().to_owned());
    let page = |path: &str| match ui.route("GET", path, None).body {
        pare::ui::Payload::Bytes(bytes) => String::from_utf8(bytes).unwrap(),
        pare::ui::Payload::Export(_) => panic!("{path} is a page"),
    };
    let session = page("/_pare/ui/session/provider");
    for shown in [
        "Attributable savings: <b>150 tokens</b> = removed 500 − epoch cache misses 350 (misses from provider)",
        "20 / 400 (5.0 %)",
        "not reported",
    ] {
        assert!(session.contains(shown), "{shown} on the session page:\n{session}");
    }
    assert!(page("/_pare/ui/session/estimate").contains("(misses from estimate)"));
    let request = page("/_pare/ui/session/provider/request/3");
    assert!(request.contains("prompt 400 · cached 20 (5.0 %) · cache write not reported · output 5"), "{request}");
    let index = page("/_pare/ui/");
    assert!(
        index.contains(r#"<span title="upstream cache hits: 5.0 % of 400">5.0 %</span>"#),
        "the index shows the session's hit rate:\n{index}"
    );

    // Provider: 400 − 20 = 380 computed afresh, less the 30 tokens the agent added since request 2.
    let savings = reader.savings(&reader.exchanges("provider").unwrap()).unwrap();
    let expected =
        Savings { removed: 500, epochs: vec![EpochMiss { seq: 3, tokens: 350, source: MissSource::Provider }] };
    assert_eq!(savings, expected);
    assert_eq!((savings.net(), savings.source()), (150, "provider"));

    // Estimate: request 3's forwarded messages share system, user and the call with request 2's.
    let len = |m: &Value| m.to_string().len() as f64;
    let shared =
        (len(&system) + len(&user) + len(&call)) / [&system, &user, &call, &marker, &next].map(len).iter().sum::<f64>();
    let afresh = 330 - (330.0 * shared).round() as u64;
    let savings = reader.savings(&reader.exchanges("estimate").unwrap()).unwrap();
    let expected =
        Savings { removed: 500, epochs: vec![EpochMiss { seq: 3, tokens: afresh - 30, source: MissSource::Estimate }] };
    assert_eq!(savings, expected, "shared share {shared}");
    assert_eq!(savings.source(), "estimate");
    archive.close();

    // Deleting a session takes its usage rows with it (they reference its exchanges).
    drop(reader);
    pare::archive::retention::delete_session(dir.path(), "provider").unwrap();
    let conn = rusqlite::Connection::open(dir.path().join(pare::archive::store::DB_FILE)).unwrap();
    let left: Vec<String> = conn
        .prepare("SELECT DISTINCT session FROM response_usage")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(left, ["estimate"]);
}

/// An archive written before the usage table existed opens read-only and reads as "not reported".
#[test]
fn an_archive_without_the_usage_table_reads_as_not_reported() {
    let dir = tempfile::tempdir().unwrap();
    let archive = Archive::start(dir.path().to_owned(), Durability::Buffered, Duration::from_millis(10));
    let ticket = archive.record_exchange(ExchangeRecord::unchanged(
        "old",
        1,
        Bytes::from(chat_body(&[json!({"role": "user", "content": "hi"})])),
    ));
    archive.record_response(ticket, answered(json!({"prompt_tokens": 5, "completion_tokens": 1})));
    archive.close();
    let conn = rusqlite::Connection::open(dir.path().join(pare::archive::store::DB_FILE)).unwrap();
    conn.execute_batch("DROP TABLE response_usage").unwrap();
    drop(conn);
    let reader = ArchiveReader::open(dir.path()).unwrap();
    assert_eq!(reader.exchanges("old").unwrap()[0].usage, None);
    let info = reader.session("old").unwrap();
    assert_eq!((info.upstream.n_reported, info.upstream.prompt), (0, None));
}

/// Figures no real answer holds (past 2^40 tokens) are read as not reported: an upstream that
/// sends them leaves the session's totals, the list and the UI as they are.
#[test]
fn absurd_usage_figures_read_as_not_reported() {
    let dir = tempfile::tempdir().unwrap();
    let archive = Archive::start(dir.path().to_owned(), Durability::Buffered, Duration::from_millis(10));
    let mut messages = vec![json!({"role": "user", "content": "hi"})];
    for k in 0..3 {
        let ticket = archive.record_exchange(ExchangeRecord::unchanged("absurd", 1, Bytes::from(chat_body(&messages))));
        let usage = json!({"prompt_tokens": u64::MAX, "completion_tokens": 1u64 << 40,
            "prompt_tokens_details": {"cached_tokens": u64::MAX - k}});
        archive.record_response(ticket, answered(usage));
        messages.push(json!({"role": "assistant", "content": "ok"}));
        messages.push(json!({"role": "user", "content": format!("again {k}")}));
    }
    archive.close();
    let reader = ArchiveReader::open(dir.path()).unwrap();
    let info = reader.session("absurd").unwrap();
    assert_eq!((info.upstream.n_reported, info.upstream.prompt, info.upstream.cached), (0, None, None));
    assert_eq!(reader.sessions(&Default::default()).unwrap().len(), 1);
    assert!(reader.exchanges("absurd").unwrap().iter().all(|e| e.usage.is_none()));
    let listed = pare_cli(&["sessions", "list", "--archive", dir.path().to_str().unwrap()]);
    assert!(listed.lines().any(|l| l.starts_with("absurd") && l.contains("not reported")), "{listed}");
}
