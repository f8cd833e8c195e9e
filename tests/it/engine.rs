//! The engine under odd inputs and hard budgets: lone surrogate escapes, sessions whose
//! protected tail alone overflows the window.

use std::sync::Arc;

use pare::budget::SessionCompactor;
use pare::compact::Engine;
use pare::config::Config;
use pare::pipeline::CompactOutput;
use pare::tokens::CountTokens;
use pare::wire::{ChatBody, Wire};

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

/// A session that views files whole, `cat -n` style: `n` requests, each turn a view of a new
/// file of `lines` numbered lines (262 lines: about 4.3k tokens), as OpenHands' file-heavy
/// sessions do.
fn file_reads_session(n: usize, lines: usize) -> Vec<String> {
    use serde_json::json;
    let mut messages = vec![
        json!({"role": "system", "content": "You are a coding agent. Read the code before you change it."}),
        json!({"role": "user", "content": "The request handlers time out under load: find out why and fix it."}),
    ];
    let mut requests = Vec::new();
    for k in 0..n {
        requests.push(json!({"model": "m", "messages": messages}).to_string());
        let id = format!("toolu_{k:02}");
        let path = format!("/workspace/service/handlers/module_{k}.py");
        let arguments = json!({"command": "view", "path": path}).to_string();
        messages.push(json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": id, "type": "function", "function": {"name": "str_replace_editor", "arguments": arguments}}]}));
        let mut text = format!("Here's the result of running `cat -n` on {path}:\n");
        for i in 1..=lines {
            let body = match i % 4 {
                0 => format!("def handle_{k}_{i}(request, timeout={}):", 30 + (i * 7) % 90),
                1 => format!("    response = client_{k}.send(request, retries={})", i % 5),
                2 => format!("    log.debug(\"module_{k} step {i}: %s\", response.status_{i})"),
                _ => format!("    return response.body[{}:{}]", i, i + k + 3),
            };
            text.push_str(&format!("{i:>6}\t{body}\n"));
        }
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": text}));
    }
    requests
}

/// The forwarded request's tokens counted from its bytes, and the neutral messages raw and forwarded.
fn sent(compactor: &SessionCompactor, wire: Wire, raw: &[u8], out: &CompactOutput) -> (u64, Vec<String>, Vec<String>) {
    let bytes = out.body.clone().unwrap_or_else(|| raw.to_vec());
    let fwd = pare::wire::parse(wire, &bytes).unwrap();
    let counter = compactor.counter(None);
    let messages: Vec<String> = fwd.messages().iter().map(|m| (*m).to_owned()).collect();
    let tokens = messages.iter().map(|m| counter.message(m)).sum::<u64>()
        + fwd.tools().map_or(0, |t| counter.tools(t))
        + pare::tokens::REPLY_PRIMING;
    let raw_messages = pare::wire::parse(wire, raw).unwrap().messages().iter().map(|m| (*m).to_owned()).collect();
    (tokens, raw_messages, messages)
}

/// Chat request bodies as one session file of `wire` requests.
fn convert(requests: &[String], wire: Wire) -> String {
    let chat = requests.join("\n");
    match wire {
        Wire::Chat => chat,
        _ => pare::wire::convert::chat_session_to(wire, &chat),
    }
}

/// What a session did: per request, whether it started an epoch, its forwarded tokens, the model's
/// window it had to fit ([`SessionCompactor::hard_limit`]) and what pare may not leave out of it
/// (first system message, user messages, last turn, tools); and the log of its warnings.
struct Run {
    started: Vec<bool>,
    tokens: Vec<u64>,
    limits: Vec<u64>,
    floors: Vec<u64>,
    raw_total: u64,
    forwarded_total: u64,
    log: String,
}

/// `requests` (chat bodies) converted to `wire` and sent through one session at `window` tokens,
/// checking on every request that the forwarded body is valid, that the last turn went out whole
/// and that a request between epochs extends the one before.
fn run_at(requests: &[String], wire: Wire, window: u64) -> Run {
    let compactor = SessionCompactor::new(&Config::default(), Arc::new(Engine::default_pack())).unwrap();
    let counter = compactor.counter(None);
    let log = Log::default();
    let subscriber = tracing_subscriber::fmt().with_writer(log.clone()).with_ansi(false).finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let converted = convert(requests, wire);
    let mut run = Run {
        started: Vec::new(),
        tokens: Vec::new(),
        limits: Vec::new(),
        floors: Vec::new(),
        raw_total: 0,
        forwarded_total: 0,
        log: String::new(),
    };
    let mut previous: Option<Vec<String>> = None;
    for raw in pare::budget::replay::session_lines(converted.as_bytes()) {
        let body = pare::wire::parse(wire, raw).unwrap();
        let out = compactor.compact_body("s", body.as_ref(), Some(window));
        let (tokens, raw_messages, forwarded) = sent(&compactor, wire, raw, &out);
        let k = run.tokens.len();
        let written = out.body.as_deref().unwrap_or(raw);
        assert!(pare::wire::parse(wire, written).unwrap().check().is_ok(), "{wire:?}: request {k} is invalid");
        // The last turn goes out whole: its results byte for byte, its calls as made (in a turn
        // format, a marker written just before the call items reads back as the call's text).
        let role = |m: &str| pare::neutral::role_of(m).into_owned();
        let last_turn = raw_messages.iter().rposition(|m| role(m) == "assistant").unwrap_or(0);
        let tail = &raw_messages[last_turn..];
        let sent_tail = &forwarded[forwarded.len() - tail.len()..];
        let calls = |m: &str| serde_json::from_str::<serde_json::Value>(m).unwrap()["tool_calls"].clone();
        assert!(sent_tail[1..] == tail[1..], "{wire:?}: request {k}: the last turn's results differ");
        assert_eq!(calls(&sent_tail[0]), calls(&tail[0]), "{wire:?}: request {k}: the last turn's calls differ");
        if !out.summary.epoch_started
            && let Some(before) = &previous
        {
            assert!(forwarded.starts_with(before), "{wire:?}: a request between epochs is a pure append");
        }
        let first_system = raw_messages.iter().position(|m| role(m) == "system");
        let floor: u64 = (0..raw_messages.len())
            .filter(|&i| i >= last_turn || Some(i) == first_system || role(&raw_messages[i]) == "user")
            .map(|i| counter.message(&raw_messages[i]))
            .sum::<u64>()
            + body.tools().map_or(0, |t| counter.tools(t))
            + pare::tokens::REPLY_PRIMING;
        run.raw_total += out.summary.tokens_raw;
        run.forwarded_total += tokens;
        run.started.push(out.summary.epoch_started);
        run.tokens.push(tokens);
        run.limits.push(SessionCompactor::hard_limit(body.as_ref(), window));
        run.floors.push(floor);
        previous = Some(forwarded);
    }
    run.log = log.text();
    run
}

/// [`run_at`] a 16k window.
fn run_at_16k(requests: &[String], wire: Wire) -> Run {
    run_at(requests, wire, 16_384)
}

/// The warning a session whose protected tail does not fit logs, once.
const TAIL_WARNING: &str = "do not fit the usable window";

/// Regression: when the system prompt, the user messages and the protected tail alone exceeded
/// the window, an epoch that could not reach its marks was skipped and the session appended past
/// the model's whole window (28 of 30 requests of this session over 16,384 tokens, peak 32,484).
/// Appending never crosses the window: the protected tail's older turns yield, oldest first, the
/// last turn going out whole, and the epochs stay rare (never two in a row), with one warning.
#[test]
fn a_protected_tail_over_the_window_yields_its_older_turns_and_stays_within_it() {
    let run = run_at_16k(&tail_over_window_session(), Wire::Chat);
    assert!(run.tokens.iter().all(|&t| t <= 16_384), "{:?}", run.tokens);
    let n_epochs = run.started.iter().filter(|&&s| s).count();
    assert!((2..=15).contains(&n_epochs), "{n_epochs} epochs in 30 requests: {:?}", run.started);
    assert!(!run.started.windows(2).any(|w| w[0] && w[1]), "two epochs in a row: {:?}", run.started);
    assert!(run.forwarded_total * 2 < run.raw_total, "compacted: {} of {}", run.forwarded_total, run.raw_total);
    // One warning for the session, naming the cause and the key to change.
    assert_eq!(run.log.matches(TAIL_WARNING).count(), 1, "{}", run.log);
    assert!(run.log.contains("compaction.rules.protect_last_turns") && run.log.contains("session=s"), "{}", run.log);
}

/// Thirty whole-file views of about 4.3k tokens at a 16k window, in every wire format: every
/// forwarded request within 16,384 tokens, at most 20 epochs, one warning.
#[test]
fn thirty_file_reads_at_16k_stay_within_the_window_in_every_wire_format() {
    let session = file_reads_session(30, 262);
    let counter = pare::tokens::TokenCounter::new(&pare::tokens::CounterConfig::default());
    let last: serde_json::Value = serde_json::from_str(session.last().unwrap()).unwrap();
    let view = last["messages"].as_array().unwrap().last().unwrap().to_string();
    assert!((4000..=4700).contains(&counter.message(&view)), "a view is about 4.3k tokens: {}", counter.message(&view));
    for wire in [Wire::Chat, Wire::Responses, Wire::Messages, Wire::Gemini] {
        let run = run_at_16k(&session, wire);
        let peak = run.tokens.iter().max().unwrap();
        assert!(*peak <= 16_384, "{wire:?}: peak {peak}: {:?}", run.tokens);
        let n_epochs = run.started.iter().filter(|&&s| s).count();
        assert!((1..=20).contains(&n_epochs), "{wire:?}: {n_epochs} epochs: {:?}", run.started);
        assert_eq!(run.log.matches(TAIL_WARNING).count(), 1, "{wire:?}: {}", run.log);
    }
}

/// A chat session of tool turns whose outputs have `turns[k]` words each, a system prompt of
/// `system` words, optionally asking for `max_tokens`.
fn sized_session(turns: &[usize], system: usize, max_tokens: Option<u64>) -> Vec<String> {
    use serde_json::json;
    let words = |n: usize, tag: &str| (0..n).map(|i| format!("{tag}{i} ")).collect::<String>();
    let mut messages = vec![
        json!({"role": "system", "content": words(system, "rule")}),
        json!({"role": "user", "content": "Make the failing test pass."}),
    ];
    let mut requests = Vec::new();
    for (k, &n) in turns.iter().enumerate() {
        let mut body = json!({"model": "m", "messages": messages});
        if let Some(max) = max_tokens {
            body["max_tokens"] = json!(max);
        }
        requests.push(body.to_string());
        let id = format!("call_{k}");
        let arguments = json!({"command": format!("run step_{k}")}).to_string();
        messages.push(json!({"role": "assistant", "content": format!("Step {k}."), "tool_calls": [
            {"id": id, "type": "function", "function": {"name": "terminal", "arguments": arguments}}]}));
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": words(n, &format!("out{k}_"))}));
    }
    requests
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]

    /// Any session, any window: every forwarded request whose first system message, user messages,
    /// last turn and tools fit the model's window (less the answer length it asks for), with room
    /// for the marker standing for the older turns, is within it; every request is valid, its last
    /// turn goes out whole, one warning at most — in chat and in a turn-based wire format, through
    /// the session compactor as the proxy runs it.
    #[test]
    fn every_request_fits_the_model_window_when_its_last_turn_does(
        turns in proptest::collection::vec(1usize..2400, 1..14),
        system in 5usize..600,
        window in 2048u64..20_000,
        max_tokens in proptest::option::of(16u64..3000),
    ) {
        let session = sized_session(&turns, system, max_tokens);
        for wire in [Wire::Chat, Wire::Messages] {
            let run = run_at(&session, wire, window);
            for k in 0..run.tokens.len() {
                let (tokens, limit, floor) = (run.tokens[k], run.limits[k], run.floors[k]);
                proptest::prop_assert!(
                    tokens <= limit || floor + MARKER_ALLOWANCE > limit,
                    "{:?}: request {}: {} tokens over the window's {} (the last turn and what pare keeps: {})",
                    wire, k, tokens, limit, floor
                );
            }
            proptest::prop_assert!(run.log.matches(TAIL_WARNING).count() <= 1, "{}", run.log);
        }
    }
}

/// What the older turns cost at the least once they all yielded: the elision marker that stands for
/// them (`[pare: 4 earlier messages elided — terminal ×2; ids listed in pare:…]`), which pare keeps
/// so that nothing is lost without a way back.
const MARKER_ALLOWANCE: u64 = 64;

/// What a test's tracing subscriber writes.
#[derive(Clone, Default)]
pub(crate) struct Log(Arc<std::sync::Mutex<Vec<u8>>>);

impl Log {
    pub(crate) fn text(&self) -> String {
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
