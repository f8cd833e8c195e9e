//! Streamed answers through the proxy into the archive: where a stream ends (its final event, never
//! bytes that look like one), an answer the client stops reading at its final event, and the cap on
//! answers held for the archive across exchanges in flight.

use std::sync::Arc;
use std::time::Duration;

use pare::archive::query::ArchiveReader;
use pare::config::Config;
use pare::pipeline::Pipeline;
use serde_json::{Value, json};
use tokio::sync::Notify;

use crate::support::pare::{Pare, config_for, start_with_pipeline};
use crate::support::stub::{self, Recorded, Reply, Step, Stub};
use crate::support::{client, within};

/// pare with its archive in `dir`, from the configuration (as `pare serve` builds it).
async fn archived_pare(stub: &Stub, dir: &std::path::Path, configure: impl FnOnce(&mut Config)) -> Pare {
    let mut config = config_for(stub);
    config.archive.enabled = true;
    config.archive.dir = Some(dir.to_owned());
    config.archive.flush_interval_ms = 10;
    config.budget.detect_window = false;
    configure(&mut config);
    let config = Arc::new(config);
    let pipeline = Arc::new(Pipeline::from_config(Arc::clone(&config)).expect("pipeline"));
    start_with_pipeline(config, pipeline).await
}

/// `(end_reason, partial)` of every archived answer, once `n` are recorded (at most 10 s).
async fn archived_ends(pare: &Pare, n: usize) -> Vec<(String, bool)> {
    let archive = Arc::clone(pare.pipeline.archive().expect("archive on"));
    within("the answers to be archived", async {
        loop {
            archive.flush_async().await.expect("flush");
            let reader = ArchiveReader::open(archive.location()).expect("open archive");
            let mut statement =
                reader.conn().as_sqlite().unwrap().prepare("SELECT end_reason, partial FROM responses").unwrap();
            let ends: Vec<(String, bool)> =
                statement.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).unwrap().map(Result::unwrap).collect();
            if ends.len() >= n {
                return ends;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
}

/// The value of one sample of pare's metrics (`name{labels} value`); 0 when absent.
async fn metric(pare: &Pare, sample: &str) -> f64 {
    let text = client().get(pare.url("/_pare/metrics")).send().await.unwrap().text().await.unwrap();
    text.lines().find_map(|line| line.strip_prefix(sample)?.strip_prefix(' ')?.parse().ok()).unwrap_or(0.0)
}

fn chat(messages: &Value) -> String {
    json!({"model": "stub-model", "stream": true, "messages": messages}).to_string()
}

/// Regression: an answer whose content talks about `data: [DONE]` was archived
/// cut at that word (a byte search found `[DONE]` in a chunk), so the agent's next request, which
/// carries the whole answer, started a new session. The end is the event whose data is `[DONE]`.
#[tokio::test]
async fn an_answer_that_talks_about_done_is_archived_whole_and_the_session_goes_on() {
    const TALK: &str = "A stream ends with the line data: [DONE] and a blank line; [DONE] inside text is no end.";
    let stub = Stub::start(|request: &Recorded| {
        Reply::sse(stub::stream_steps(request.json()["model"].as_str().unwrap(), TALK, false))
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let pare = archived_pare(&stub, dir.path(), |_| {}).await;
    let client = client();
    let mut messages =
        json!([{"role": "system", "content": "Explain SSE."}, {"role": "user", "content": "How does it end?"}]);
    let first = client.post(pare.url("/v1/chat/completions")).body(chat(&messages)).send().await.unwrap();
    let session = first.headers()["x-pare-session"].to_str().unwrap().to_owned();
    assert!(first.text().await.unwrap().ends_with("data: [DONE]\n\n"));
    let ends = archived_ends(&pare, 1).await;
    assert_eq!(ends, [("complete".to_owned(), false)]);

    let messages_next = messages.as_array_mut().unwrap();
    messages_next.push(json!({"role": "assistant", "content": TALK}));
    messages_next.push(json!({"role": "user", "content": "Thanks."}));
    let second = client.post(pare.url("/v1/chat/completions")).body(chat(&messages)).send().await.unwrap();
    assert_eq!(second.headers()["x-pare-session"].to_str().unwrap(), session, "the next request continues the session");
    second.text().await.unwrap();

    archived_ends(&pare, 2).await;
    let reader = ArchiveReader::open(dir.path()).unwrap();
    let answer = reader.response(&session, 1).unwrap().expect("the first answer");
    assert_eq!(answer.assembled.unwrap()["message"]["content"], TALK, "archived whole");
    assert!(!answer.partial);
}

/// A streamed exchange of one dialect: its path, request body and the stub's frames (the final
/// event last).
struct Dialect {
    path: &'static str,
    body: Value,
    frames: Vec<bytes::Bytes>,
}

fn chat_dialect() -> Dialect {
    let frames = stub::stream_steps("stub-model", stub::ANSWER, true)
        .into_iter()
        .filter_map(|step| match step {
            Step::Send(bytes) => Some(bytes),
            _ => None,
        })
        .collect();
    Dialect {
        path: "/v1/chat/completions",
        body: json!({"model": "stub-model", "stream": true, "messages": [{"role": "user", "content": "hi"}]}),
        frames,
    }
}

/// Named frames, as the Responses and Messages APIs send them.
fn named(events: &[Value]) -> Vec<bytes::Bytes> {
    events
        .iter()
        .map(|e| bytes::Bytes::from(format!("event: {}\ndata: {e}\n\n", e["type"].as_str().unwrap())))
        .collect()
}

fn responses_dialect() -> Dialect {
    let item = json!({"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
        "content": [{"type": "output_text", "text": "hi there", "annotations": []}]});
    let frames = named(&[
        json!({"type": "response.created", "response": {"id": "resp_1", "status": "in_progress", "model": "m", "output": []}}),
        json!({"type": "response.output_item.added", "output_index": 0, "item": {"type": "message", "id": "msg_1", "role": "assistant", "content": []}}),
        json!({"type": "response.output_text.delta", "output_index": 0, "content_index": 0, "delta": "hi there"}),
        json!({"type": "response.output_item.done", "output_index": 0, "item": item}),
        json!({"type": "response.completed", "response": {"id": "resp_1", "status": "completed", "model": "m", "output": [item]}}),
    ]);
    Dialect {
        path: "/v1/responses",
        body: json!({"model": "m", "stream": true, "input": [{"role": "user", "content": "hi"}]}),
        frames,
    }
}

fn messages_dialect() -> Dialect {
    let frames = named(&[
        json!({"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude", "content": [], "stop_reason": null, "usage": {"input_tokens": 3, "output_tokens": 1}}}),
        json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "hi there"}}),
        json!({"type": "content_block_stop", "index": 0}),
        json!({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": null}, "usage": {"output_tokens": 2}}),
        json!({"type": "message_stop"}),
    ]);
    Dialect {
        path: "/v1/messages",
        body: json!({"model": "claude", "max_tokens": 64, "stream": true, "messages": [{"role": "user", "content": "hi"}]}),
        frames,
    }
}

/// How many of `n` streamed answers are archived `client_gone` (and counted so in the metrics) when
/// the client stops reading at the final event and closes, as the openai SDK does at `[DONE]`, while
/// the upstream sends its terminating chunk `delay` later.
async fn client_gone_after_the_final_event(dialect: Dialect, n: usize, delay: Duration) -> (usize, f64, f64) {
    let frames = dialect.frames.clone();
    let stub = Stub::start(move |_: &Recorded| {
        let mut steps: Vec<Step> = frames.iter().cloned().map(Step::Send).collect();
        steps.push(Step::Sleep(delay));
        Reply::sse(steps)
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let pare = archived_pare(&stub, dir.path(), |_| {}).await;
    let body = dialect.body.to_string();
    let last = dialect.frames.last().expect("a final event").clone();
    for _ in 0..n {
        let client = client();
        let mut response = client.post(pare.url(dialect.path)).body(body.clone()).send().await.unwrap();
        let mut received = Vec::new();
        while !received.ends_with(&last) {
            let chunk = within("the stream up to its final event", response.chunk()).await.unwrap().expect("more body");
            received.extend_from_slice(&chunk);
        }
        drop(response);
    }
    let ends = archived_ends(&pare, n).await;
    let n_client_gone = ends.iter().filter(|(end, _)| end.starts_with("client_gone")).count();
    assert_eq!(ends.iter().filter(|(_, partial)| *partial).count(), n_client_gone, "{ends:?}");
    let metric_gone = metric(&pare, r#"pare_responses_ended_total{end="client_gone"}"#).await;
    let metric_complete = metric(&pare, r#"pare_responses_ended_total{end="complete"}"#).await;
    (n_client_gone, metric_gone, metric_complete)
}

/// Regression: an upstream that sends its last chunk a moment after
/// `data: [DONE]` while the client stops reading at `[DONE]` and closes: pare recorded every such
/// answer `client_gone` and partial. The answer is whole once its final event passed: complete in
/// the archive, the access line and the metrics. 40 answers, the terminating chunk 300 ms late.
#[tokio::test]
async fn a_client_that_closes_at_done_before_the_last_chunk_leaves_a_complete_answer() {
    let n = 40;
    let (n_client_gone, metric_gone, metric_complete) =
        client_gone_after_the_final_event(chat_dialect(), n, Duration::from_millis(300)).await;
    assert_eq!(n_client_gone, 0, "archived client_gone: {n_client_gone} of {n}");
    assert_eq!(metric_gone, 0.0, "counted client_gone");
    assert!(metric_complete >= n as f64, "counted complete: {metric_complete}");
}

/// The same for the Responses (`response.completed`) and Messages (`message_stop`) dialects.
#[tokio::test]
async fn responses_and_messages_streams_closed_at_their_final_event_are_complete() {
    for (name, dialect) in [("responses", responses_dialect()), ("messages", messages_dialect())] {
        let n = 5;
        let (n_client_gone, metric_gone, _) =
            client_gone_after_the_final_event(dialect, n, Duration::from_millis(300)).await;
        assert_eq!((n_client_gone, metric_gone), (0, 0.0), "{name}: archived client_gone {n_client_gone} of {n}");
    }
}

/// Answers streaming together hold at most
/// `archive.max_held_answer_bytes` for the archive. The answer that does not fit streams to its client
/// byte for byte; its archived copy is cut, marked partial with the reason, and counted; the other
/// is archived whole, and the room is given back once both are done.
#[tokio::test]
async fn answers_over_the_held_cap_stream_whole_and_are_archived_truncated() {
    const CAP: u64 = 1024 * 1024;
    let gate = Arc::new(Notify::new());
    let script_gate = Arc::clone(&gate);
    let big = "x".repeat(600 * 1024);
    let script_big = big.clone();
    let stub = Stub::start(move |request: &Recorded| {
        let mut steps = vec![Step::Send(stub::chunk_event("stub-model", json!({"content": script_big}), None))];
        if request.header("x-pare-session") == Some("held") {
            steps.push(Step::Gate(Arc::clone(&script_gate)));
        }
        steps.push(Step::Send(stub::chunk_event("stub-model", json!({}), Some("stop"))));
        steps.push(Step::Send(stub::sse_done()));
        Reply::sse(steps)
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let pare = archived_pare(&stub, dir.path(), |config| config.archive.max_held_answer_bytes = CAP).await;
    let expected: Vec<u8> = [
        stub::chunk_event("stub-model", json!({"content": big}), None),
        stub::chunk_event("stub-model", json!({}), Some("stop")),
        stub::sse_done(),
    ]
    .concat();
    let client = client();
    let body = chat(&json!([{"role": "user", "content": "a long answer"}]));

    // The first answer holds 600 KiB while it waits at the gate.
    let mut held = client
        .post(pare.url("/v1/chat/completions"))
        .header("x-pare-session", "held")
        .body(body.clone())
        .send()
        .await
        .unwrap();
    let mut held_received = Vec::new();
    while held_received.len() < big.len() {
        held_received.extend_from_slice(&within("the first answer's content", held.chunk()).await.unwrap().unwrap());
    }
    // The second does not fit beside it: its client still gets every byte.
    let over = client.post(pare.url("/v1/chat/completions")).header("x-pare-session", "over").body(body).send();
    let over = within("the second answer", over).await.unwrap();
    assert_eq!(within("the second answer's body", over.bytes()).await.unwrap(), expected);
    gate.notify_one();
    while let Some(chunk) = within("the rest of the first answer", held.chunk()).await.unwrap() {
        held_received.extend_from_slice(&chunk);
    }
    assert_eq!(held_received, expected);

    archived_ends(&pare, 2).await;
    let reader = ArchiveReader::open(dir.path()).unwrap();
    let over = reader.response("over", 1).unwrap().expect("the second answer");
    assert!(over.partial);
    assert_eq!(
        over.end_reason,
        "complete; body truncated: the answers held for the archive reached archive.max_held_answer_bytes"
    );
    assert!(
        (CAP as usize - expected.len()..=CAP as usize - big.len()).contains(&over.body.len()),
        "{}",
        over.body.len()
    );
    assert_eq!(over.body, expected[..over.body.len()], "what is kept is the answer's start");
    let whole = reader.response("held", 1).unwrap().expect("the first answer");
    assert!(!whole.partial, "{}", whole.end_reason);
    assert_eq!(whole.body, expected);
    assert_eq!(whole.assembled.unwrap()["message"]["content"], big.as_str());
    assert_eq!(metric(&pare, r#"pare_answers_truncated_total{reason="held_cap"}"#).await, 1.0);
    assert_eq!(metric(&pare, "pare_answer_bytes_held").await, 0.0);
}
