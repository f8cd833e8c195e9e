//! The engine under odd inputs and hard budgets: lone surrogate escapes, sessions whose
//! protected tail alone overflows the window.

use std::sync::Arc;

use pare::budget::SessionCompactor;
use pare::compact::Engine;
use pare::config::Config;
use pare::wire::ChatBody;

use crate::support::CodingAgent;

/// The shared coding session (`support::coding_session`) as chat request bodies.
fn coding_session(n_turns: usize, words: usize) -> Vec<String> {
    let agent = CodingAgent { model: "test-model", tool: "terminal", id_prefix: "call_", reasoning: None };
    crate::support::coding_session(&agent, n_turns, words).iter().map(|body| body.to_string()).collect()
}

/// Regression: one lone surrogate escape (`\udc80`, what a tool prints for an
/// undecodable byte) in an old tool output made that message unreadable, the request invalid to the
/// engine, and the whole session uncompacted (221,794 → 221,794 tokens). It is valid JSON: the
/// session is compacted as it would be without it, the message carrying it is compacted like any
/// other, and the messages pare leaves alone go out as their original bytes, escape included.
#[test]
fn a_lone_surrogate_in_an_old_tool_output_does_not_switch_compaction_off() {
    let bodies: Vec<String> = coding_session(24, 120)
        .into_iter()
        .map(|body| body.replace("w0x7 ", "w0x7 \\udc80 ").replace("failing test", "failing \\udc80 test"))
        .collect();
    assert!(bodies[3].contains(r"w0x7 \udc80 w0x8") && bodies[3].contains(r"failing \udc80 test"));
    let compactor = SessionCompactor::new(&Config::default(), Arc::new(Engine::default_pack())).unwrap();
    let window = 8192;
    let mut compacted = 0;
    for raw in &bodies {
        let body = ChatBody::parse(raw.as_bytes()).unwrap();
        let out = compactor.compact_body("s", &body, Some(window));
        let summary = &out.summary;
        let engine = summary.report.as_ref().and_then(|r| r.engine.as_ref());
        assert!(engine.is_none_or(|e| e.input_invalid.is_none() && e.validation_failed.is_none()), "{engine:?}");
        let Some(forwarded) = out.body else { continue };
        assert!(summary.tokens_forwarded < summary.tokens_raw);
        compacted += 1;
        let forwarded = String::from_utf8(forwarded).unwrap();
        let sent = ChatBody::parse(forwarded.as_bytes()).unwrap();
        let (raw_messages, sent_messages) = (body.messages(), sent.messages());
        // The task, with its escape, and the tail are the agent's bytes.
        assert_eq!(sent_messages[1], raw_messages[1]);
        assert!(sent_messages[1].contains(r"\udc80"));
        let tail = sent_messages.len().min(raw_messages.len()) / 3;
        assert_eq!(sent_messages[sent_messages.len() - tail..], raw_messages[raw_messages.len() - tail..]);
        // The old output that carries the escape is compacted (its words are gone), every other
        // forwarded message is either the agent's bytes or pare's rewrite of one.
        assert!(!forwarded.contains("w0x7 \\udc80 w0x8"), "the first output is compacted");
        for message in sent_messages {
            assert!(
                serde_json::from_str::<serde_json::Value>(&pare::neutral::lone_surrogates_replaced(message)).is_ok()
            );
        }
        // The rest of the body (model, stream) is the agent's.
        assert_eq!(sent.split.fields.len(), body.split.fields.len());
        for ((k1, v1), (k2, v2)) in sent.split.fields.iter().zip(&body.split.fields) {
            assert_eq!((k1, v1.get()), (k2, v2.get()));
        }
    }
    assert!(compacted > 5, "only {compacted} requests compacted");
    let last = bodies.last().unwrap();
    let out = compactor.compact_body("s", &ChatBody::parse(last.as_bytes()).unwrap(), Some(window));
    assert!(out.summary.tokens_forwarded * 2 < out.summary.tokens_raw, "{:?}", out.summary);
}

/// A session whose protected tail alone overflows a 16k window: 30 requests, each turn a tool
/// output of 3–5k tokens, each call naming a ticket the previous output printed (the session
/// `benches/thrash_session.py` writes for BENCHMARKS.md).
fn tail_over_window_session() -> Vec<String> {
    use serde_json::json;
    let mut messages = vec![
        json!({"role": "system", "content": "You are a coding agent working in a large repository."}),
        json!({"role": "user", "content": "Find why the nightly build fails and fix it."}),
    ];
    let mut requests = Vec::new();
    for k in 0..30usize {
        requests.push(json!({"model": "m", "messages": messages}).to_string());
        let id = format!("call_{k}");
        let ticket = format!("T{}", 70_000 + k.saturating_sub(1));
        let arguments = json!({"command": format!("grep -n {ticket} build_{k}.log")}).to_string();
        messages.push(json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": id, "type": "function", "function": {"name": "terminal", "arguments": arguments}}]}));
        let lines = 130 + (k * 37) % 80;
        let mut text: String = (0..lines)
            .map(|i| format!("build_{k}.log:{i}: step {i} of stage_{k} compiled module_{k}_{i} in {} ms\n", i % 97))
            .collect();
        text.push_str(&format!("ticket T{} opened for stage_{k}\n", 70_000 + k));
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": text}));
    }
    requests
}

/// Regression: when the system prompt, the user messages and the protected
/// tail alone exceed the usable window, every request crossed it again and started an epoch (24 of
/// 30 requests), eliding the rest into a new marker each time and losing the upstream's cache
/// (uncached prefill 4.3× raw). An epoch that cannot reach the high-water mark is followed by
/// appends until compacting again can gain what an ordinary epoch frees.
#[test]
fn a_protected_tail_over_the_window_does_not_start_an_epoch_on_every_request() {
    let compactor = SessionCompactor::new(&Config::default(), Arc::new(Engine::default_pack())).unwrap();
    let window = 16_384;
    let log = Log::default();
    let subscriber = tracing_subscriber::fmt().with_writer(log.clone()).with_ansi(false).finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let mut started = Vec::new();
    let mut previous: Option<Vec<String>> = None;
    let (mut raw_total, mut forwarded_total) = (0, 0);
    for raw in tail_over_window_session() {
        let body = ChatBody::parse(raw.as_bytes()).unwrap();
        let out = compactor.compact_body("s", &body, Some(window));
        let summary = &out.summary;
        raw_total += summary.tokens_raw;
        forwarded_total += summary.tokens_forwarded;
        let bytes = out.body.clone().unwrap_or_else(|| raw.clone().into_bytes());
        let forwarded: Vec<String> =
            ChatBody::parse(&bytes).unwrap().messages().iter().map(|m| (*m).to_owned()).collect();
        if !summary.epoch_started
            && let Some(before) = &previous
        {
            assert!(forwarded.starts_with(before), "a request between epochs is a pure append");
        }
        started.push(summary.epoch_started);
        previous = Some(forwarded);
    }
    let n_epochs = started.iter().filter(|&&s| s).count();
    assert!((2..=12).contains(&n_epochs), "{n_epochs} epochs in 30 requests: {started:?}");
    assert!(!started.windows(2).any(|w| w[0] && w[1]), "two epochs in a row: {started:?}");
    assert!(forwarded_total * 2 < raw_total, "the session is still compacted: {forwarded_total} of {raw_total}");
    // One warning for the session, naming the cause and the key to change.
    let logged = log.text();
    assert_eq!(logged.matches("could not bring the request under the usable window").count(), 1, "{logged}");
    assert!(logged.contains("compaction.rules.protect_last_turns") && logged.contains("session=s"), "{logged}");
}

/// What a test's tracing subscriber writes.
#[derive(Clone, Default)]
struct Log(Arc<std::sync::Mutex<Vec<u8>>>);

impl Log {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl std::io::Write for Log {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Log {
    type Writer = Log;
    fn make_writer(&'a self) -> Log {
        self.clone()
    }
}

/// Returns the request unchanged with a report that says why: its compacted form broke tool-call
/// pairing (pare's failure), or the request itself did (the agent's).
struct ReportingCompactor {
    validation_failed: bool,
}

impl pare::pipeline::ConversationCompactor for ReportingCompactor {
    fn compact(&self, _input: &pare::pipeline::CompactInput<'_>) -> anyhow::Result<pare::pipeline::CompactOutput> {
        let why = Some("tool message 3 answers `c9`, which is not an open call".to_owned());
        let engine = pare::compact::report::Report {
            validation_failed: why.clone().filter(|_| self.validation_failed),
            input_invalid: why.filter(|_| !self.validation_failed),
            ..Default::default()
        };
        let report = pare::exchange::BudgetReport { engine: Some(engine), ..Default::default() };
        let summary = pare::pipeline::CompactionSummary { report: Some(report), ..Default::default() };
        Ok(pare::pipeline::CompactOutput { body: None, spans: None, summary, late: None, lists: Default::default() })
    }
}

/// A compaction that forwards the original request because pare's own output
/// failed validation is counted as fail-open (and says why); a request forwarded unchanged because
/// the agent's input breaks tool-call pairing is not pare's failure and is not counted.
#[tokio::test]
async fn a_compaction_that_fails_validation_is_counted_as_fail_open() {
    use std::sync::atomic::Ordering;

    use crate::support::pare::{self as pare_support, config_for};
    use crate::support::stub::Stub;
    let body = r#"{"model":"stub-model","messages":[{"role":"user","content":"hi"}]}"#;
    for (validation_failed, counted) in [(true, 1), (false, 0)] {
        let stub = Stub::start(Stub::openai).await;
        let compactor = Arc::new(ReportingCompactor { validation_failed });
        let pare = pare_support::start_with_compactor(config_for(&stub), compactor).await;
        let response = crate::support::client().post(pare.url("/v1/chat/completions")).body(body).send().await.unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(stub.single().body, body.as_bytes(), "the original bytes are forwarded");
        assert_eq!(
            pare.pipeline.stats.fail_open.load(Ordering::Relaxed),
            counted,
            "validation failed: {validation_failed}"
        );
    }
}
