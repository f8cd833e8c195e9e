//! Resuming a session from the archive, for every wire format: after a restart or an eviction the
//! next forwarded request of any session is byte-identical to what an uninterrupted pare forwards
//! (the plan stored with each exchange that changed the session's compaction state).

use std::sync::Arc;

use bytes::Bytes;
use pare::archive::read::BodyKind;
use pare::budget::compactor::FrozenPlan;
use pare::budget::replay::{Replayed, replay_session};
use pare::budget::{CompactEngine, SessionCompactor};
use pare::compact::Fate;
use pare::config::{Config, Mode};
use pare::neutral::message_hashes;
use pare::pipeline::Pipeline;
use pare::wire::{Forward, Wire, WireBody, WrittenReads, convert};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use serde_json::json;

use crate::support::stub::{Reply, Step, Stub, sse_event, stream_steps};
use crate::support::{CodingAgent, client, pare as in_process, within};

pub(crate) const WINDOW: u64 = 16_000;
pub(crate) const WIRES: [Wire; 3] = [Wire::Chat, Wire::Responses, Wire::Messages];

/// A coding session of `n_turns` tool steps of about `words` tokens each, as requests of `wire`.
pub(crate) fn session(wire: Wire, n_turns: usize, words: usize) -> Vec<Vec<u8>> {
    let agent = CodingAgent {
        model: "test-model",
        tool: "terminal",
        id_prefix: if wire == Wire::Messages { "toolu_" } else { "call_" },
        reasoning: Some(|k| format!("thinking about step {k}")),
    };
    let chat = crate::support::coding_session(&agent, n_turns, words);
    chat.iter()
        .map(|body| match wire {
            Wire::Responses => convert::chat_to_responses(body).unwrap().to_string().into_bytes(),
            Wire::Messages => pare::wire::messages::convert::chat_to_messages(body).unwrap().to_string().into_bytes(),
            Wire::Gemini => pare::wire::gemini::convert::chat_to_gemini(body).unwrap().to_string().into_bytes(),
            _ => body.to_string().into_bytes(),
        })
        .collect()
}

pub(crate) fn path(wire: Wire) -> &'static str {
    match wire {
        Wire::Responses => "/v1/responses",
        Wire::Messages => "/v1/messages",
        _ => "/v1/chat/completions",
    }
}

pub(crate) fn config(mode: Mode) -> Config {
    let mut config = Config::default();
    config.compaction.mode = mode;
    config.budget.default_context_window = WINDOW;
    config.budget.anthropic_context_window = WINDOW;
    config.budget.output_reserve = 1024;
    config.budget.detect_window = false;
    config
}

fn compactor(config: &Config) -> SessionCompactor {
    let engine: Arc<dyn CompactEngine> = Arc::new(pare::compact::Engine::default_pack());
    SessionCompactor::new(config, engine).unwrap()
}

/// What an uninterrupted pare forwards for `requests`, at the window [`config`] gives every other
/// format (a Gemini request names its model only in its path, which replay has not).
pub(crate) fn uninterrupted(config: &Config, wire: Wire, requests: &[Vec<u8>]) -> Vec<Replayed> {
    let lines: Vec<&[u8]> = requests.iter().map(Vec::as_slice).collect();
    replay_session(&compactor(config), wire, "s", &lines, Some(WINDOW))
}

/// The bodies `requests[..cut]` are forwarded as, then those of `requests[cut..]` by a second
/// compactor resumed from the last plan the first one handed out and the last raw request.
fn cut_and_resume(config: &Config, wire: Wire, requests: &[Vec<u8>], cut: usize) -> Vec<Vec<u8>> {
    let before = compactor(config).recording_plans();
    let mut forwarded = Vec::new();
    let mut plan = None;
    for raw in &requests[..cut] {
        forwarded.extend(
            replay_session(&before, wire, "s", &[raw.as_slice()], Some(WINDOW)).into_iter().map(|r| r.forwarded),
        );
        plan = before.take_plan("s").or(plan);
    }
    let after = compactor(config);
    let last = pare::wire::parse(wire, &requests[cut - 1]).unwrap();
    after.resume("s", plan.expect("the first request hands out a plan"), &message_hashes(&last.messages()));
    let rest: Vec<&[u8]> = requests[cut..].iter().map(Vec::as_slice).collect();
    forwarded.extend(replay_session(&after, wire, "s", &rest, Some(WINDOW)).into_iter().map(|r| r.forwarded));
    forwarded
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, failure_persistence: None, ..ProptestConfig::default() })]

    /// Any session of any wire format, cut anywhere and resumed from the plan: every request after
    /// the cut is forwarded byte for byte as without the cut, in both compacting modes, whether the
    /// session saturates (large outputs) or not.
    #[test]
    fn any_session_cut_anywhere_resumes_with_the_same_bytes(
        wire in prop::sample::select(Wire::ALL.to_vec()),
        eager in any::<bool>(),
        n_turns in 6usize..36,
        words in 40usize..900,
        at in 0.0f64..1.0,
    ) {
        let config = config(if eager { Mode::Eager } else { Mode::Epoch });
        let requests = session(wire, n_turns, words);
        let cut = 1 + ((requests.len() - 1) as f64 * at) as usize;
        let want = uninterrupted(&config, wire, &requests);
        let got = cut_and_resume(&config, wire, &requests, cut);
        for (k, (got, want)) in got.iter().zip(&want).enumerate() {
            prop_assert!(*got == want.forwarded, "{wire:?}, cut at {cut}: request {k} differs");
        }
    }
}

/// `parsed` written as forwarded under `frozen`: its prefix, then the raw messages after those it
/// covers.
fn write_under(parsed: &dyn WireBody, frozen: Option<&FrozenPlan>) -> Result<Vec<u8>, pare::wire::WireError> {
    let n_raw = parsed.messages().len();
    let written = match frozen {
        Some(f) => {
            let reads = WrittenReads::new(f.prefix.len());
            parsed.write(&Forward::of_plan(
                f.plan.as_ref().unwrap(),
                f.prefix.iter().map(String::as_str),
                &reads,
                n_raw,
            ))
        }
        None => parsed.write(&Forward::unchanged(n_raw)),
    };
    written.map(|(bytes, _)| bytes)
}

/// Every fate of a plan agrees with the prefix it describes: a kept message is its raw bytes, a
/// rewritten one differs and names its rules, an elided run stands behind a marker.
fn check_fates(frozen: &FrozenPlan, raw: &[&str]) -> Result<(), TestCaseError> {
    let plan = frozen.plan.as_ref().expect("a plan the engine made holds its fates");
    prop_assert_eq!(plan.len(), frozen.raw_hashes.len());
    for (idx, fate) in plan.iter().enumerate() {
        match *fate {
            Fate::Kept { at } => prop_assert_eq!(frozen.prefix[at].as_str(), raw[idx], "message {}", idx),
            Fate::Rewritten { at, rules } => {
                prop_assert_ne!(frozen.prefix[at].as_str(), raw[idx], "message {}", idx);
                prop_assert!(!rules.is_empty(), "message {} rewritten by no rule", idx);
            }
            Fate::Elided { at } => prop_assert!(frozen.prefix[at].contains("[pare: "), "message {}", idx),
            Fate::Dropped { rules } => prop_assert!(!rules.is_empty(), "message {} dropped by no rule", idx),
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, failure_persistence: None, ..ProptestConfig::default() })]

    /// What the diff and the UI show is what pare forwarded: for any session of any format, the
    /// body written from the plan in force (its prefix, then the raw messages after those it
    /// covers) is the body forwarded, and every fate agrees with the prefix, across epochs.
    #[test]
    fn the_plan_in_force_writes_the_body_pare_forwarded(
        wire in prop::sample::select(Wire::ALL.to_vec()),
        eager in any::<bool>(),
        n_turns in 6usize..36,
        words in 40usize..900,
    ) {
        let config = config(if eager { Mode::Eager } else { Mode::Epoch });
        let requests = session(wire, n_turns, words);
        let compactor = compactor(&config).recording_plans();
        let mut plan = None;
        let mut epochs = 0;
        for (k, raw) in requests.iter().enumerate() {
            let replayed = replay_session(&compactor, wire, "s", &[raw.as_slice()], Some(WINDOW)).remove(0);
            if let Some(stored) = compactor.take_plan("s") {
                epochs += 1;
                plan = Some(stored);
            }
            let parsed = pare::wire::parse(wire, raw).unwrap();
            let messages = parsed.messages();
            let frozen = plan.as_ref().and_then(|p| p.frozen.as_ref());
            if let Some(frozen) = frozen {
                check_fates(frozen, &messages)?;
            }
            if replayed.forwarded == *raw {
                continue;
            }
            let forwarding = pare::archive::plan::forwarding(&messages, frozen);
            prop_assert!(forwarding.steps.is_some());
            let written = write_under(parsed.as_ref(), frozen).ok();
            prop_assert!(written.as_ref() == Some(&replayed.forwarded), "{wire:?}: request {k}");
        }
        prop_assert!(epochs > 0);
    }
}

/// An answer of `wire`, streamed as the upstream does.
pub(crate) fn stream(wire: Wire) -> Reply {
    let frames = match wire {
        Wire::Responses => {
            let item = json!({"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": "done", "annotations": []}]});
            vec![
                json!({"type": "response.created", "response": {"id": "resp_1", "status": "in_progress", "model": "test-model", "output": []}}),
                json!({"type": "response.output_item.added", "output_index": 0, "item": {"type": "message", "id": "msg_1", "role": "assistant", "content": []}}),
                json!({"type": "response.output_text.delta", "output_index": 0, "item_id": "msg_1", "content_index": 0, "delta": "done"}),
                json!({"type": "response.output_item.done", "output_index": 0, "item": item}),
                json!({"type": "response.completed", "response": {"id": "resp_1", "status": "completed", "model": "test-model", "output": [item], "usage": {"input_tokens": 5, "output_tokens": 1}}}),
            ]
        }
        Wire::Messages => {
            let frames = [
                json!({"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant", "model": "test-model", "content": [], "stop_reason": null, "stop_sequence": null, "usage": {"input_tokens": 20, "output_tokens": 1}}}),
                json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
                json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "done"}}),
                json!({"type": "content_block_stop", "index": 0}),
                json!({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": null}, "usage": {"output_tokens": 1}}),
                json!({"type": "message_stop"}),
            ];
            let steps = frames
                .iter()
                .map(|f| Step::Send(Bytes::from(format!("event: {}\ndata: {f}\n\n", f["type"].as_str().unwrap()))))
                .collect();
            return Reply::sse(steps);
        }
        _ => return Reply::sse(stream_steps("test-model", "done", true)),
    };
    Reply::sse(frames.iter().map(|f| Step::Send(sse_event(f))).collect())
}

/// pare with an archive in `dir`, built from `config` as `pare serve` builds it.
pub(crate) async fn start(config: &Arc<Config>) -> in_process::Pare {
    // Built off the runtime, as `pare serve` builds it: it reads the archive (a PostgreSQL one
    // through a blocking client).
    let for_pipeline = config.clone();
    let pipeline = tokio::task::spawn_blocking(move || Pipeline::from_config(for_pipeline).unwrap()).await.unwrap();
    in_process::start_with_pipeline(config.clone(), Arc::new(pipeline)).await
}

pub(crate) async fn send(server: &in_process::Pare, wire: Wire, session: &str, body: &[u8]) {
    let request = client()
        .post(server.url(path(wire)))
        .header("content-type", "application/json")
        .header("x-pare-session", session)
        .body(body.to_vec())
        .send();
    let response = within("pare to answer", request).await.unwrap();
    assert!(response.status().is_success(), "{}", response.status());
    within("the answer's end", response.bytes()).await.unwrap();
}

pub(crate) fn archived_config(stub: &Stub, dir: &std::path::Path) -> Config {
    let mut config = in_process::config_for(stub);
    let defaults = self::config(Mode::Epoch);
    config.compaction = defaults.compaction;
    config.budget = defaults.budget;
    config.archive.enabled = true;
    config.archive.dir = Some(dir.to_owned());
    config
}

/// Two long sessions of `wire` with `x-pare-session`, pare restarted (same archive) halfway
/// through each: every request the upstream receives is what an uninterrupted pare forwards, and
/// at least one epoch happened before the restart (so the restarted pare had a prefix to resume).
async fn a_restart_mid_session_forwards_the_same_bytes(wire: Wire) {
    let stub = Stub::start(move |_| stream(wire)).await;
    let dir = tempfile::tempdir().unwrap();
    let config = Arc::new(archived_config(&stub, dir.path()));
    let sessions = [("first", session(wire, 30, 260)), ("second", session(wire, 26, 320))];
    let halves: Vec<usize> = sessions.iter().map(|(_, r)| r.len() / 2 + 1).collect();
    let first = start(&config).await;
    for ((name, requests), half) in sessions.iter().zip(&halves) {
        for body in &requests[..*half] {
            send(&first, wire, name, body).await;
        }
    }
    first.shutdown().await.unwrap();
    let second = start(&config).await;
    for ((name, requests), half) in sessions.iter().zip(&halves) {
        for body in &requests[*half..] {
            send(&second, wire, name, body).await;
        }
    }
    second.shutdown().await.unwrap();

    let mut received = stub.requests().into_iter().map(|r| r.body.to_vec());
    let mut by_session: Vec<Vec<Vec<u8>>> = vec![Vec::new(); sessions.len()];
    for (i, half) in halves.iter().enumerate() {
        by_session[i].extend(received.by_ref().take(*half));
    }
    for (i, ((_, requests), half)) in sessions.iter().zip(&halves).enumerate() {
        by_session[i].extend(received.by_ref().take(requests.len() - half));
    }
    for ((name, requests), (got, half)) in sessions.iter().zip(by_session.iter().zip(&halves)) {
        let want = uninterrupted(&config, wire, requests);
        assert_eq!(got.len(), want.len(), "{wire:?} {name}");
        let epochs_before = want[..*half].iter().filter(|r| r.summary.as_ref().is_some_and(|s| s.epoch_started));
        assert!(epochs_before.count() > 0, "{wire:?} {name}: no epoch before the restart");
        for (k, (got, want)) in got.iter().zip(&want).enumerate() {
            assert!(*got == want.forwarded, "{wire:?} {name}: request {k} is not what an uninterrupted pare forwards");
        }
    }
    // The plans stored across the restart say what each request forwarded: the body written from
    // the plan in force is the forwarded body archived.
    let reader = pare::archive::query::ArchiveReader::open(dir.path()).unwrap();
    for (name, _) in &sessions {
        let history = pare::archive::plan::history(reader.conn(), name).unwrap();
        assert!(history.len() > 1, "{wire:?} {name}: plans stored");
        for exchange in reader.exchanges(name).unwrap().iter().filter(|e| e.fwd_len.is_some()) {
            let raw = reader.body(name, exchange.seq, BodyKind::Raw).unwrap();
            let forwarded = reader.body(name, exchange.seq, BodyKind::Forwarded).unwrap();
            let parsed = pare::wire::parse(wire, &raw).unwrap();
            let frozen = pare::archive::plan::in_force(&history, exchange.id).and_then(|p| p.frozen.as_ref());
            let forwarding = pare::archive::plan::forwarding(&parsed.messages(), frozen);
            assert!(forwarding.steps.is_some(), "{wire:?} {name}: request {} has its fates", exchange.seq);
            let written = write_under(parsed.as_ref(), frozen).unwrap();
            assert!(written == forwarded, "{wire:?} {name}: request {} is not what its plan writes", exchange.seq);
        }
    }
}

/// Regression: a Responses session restarted mid-way was compacted afresh (an extra epoch, the
/// upstream's cache lost): only chat sessions were rebuilt from the archive.
#[tokio::test]
async fn a_restarted_pare_resumes_responses_sessions_byte_for_byte() {
    a_restart_mid_session_forwards_the_same_bytes(Wire::Responses).await;
}

/// Regression: a Messages session restarted mid-way was compacted afresh.
#[tokio::test]
async fn a_restarted_pare_resumes_messages_sessions_byte_for_byte() {
    a_restart_mid_session_forwards_the_same_bytes(Wire::Messages).await;
}

#[tokio::test]
async fn a_restarted_pare_resumes_chat_sessions_byte_for_byte() {
    a_restart_mid_session_forwards_the_same_bytes(Wire::Chat).await;
}

/// A memory budget that holds one session: two sessions taking turns evict each other on every
/// request, so each request is compacted from state resumed from the archive; both are forwarded
/// as with all the memory in the world.
#[tokio::test]
async fn sessions_evicted_on_every_request_forward_the_same_bytes() {
    for wire in [Wire::Responses, Wire::Messages] {
        let stub = Stub::start(move |_| stream(wire)).await;
        let dir = tempfile::tempdir().unwrap();
        let mut config = archived_config(&stub, dir.path());
        let reserved = Pipeline::from_config(Arc::new(config.clone())).unwrap().memory().reserved_bytes;
        config.memory.max_state_bytes = reserved + 1;
        let config = Arc::new(config);
        let a = session(wire, 24, 150);
        let b = session(wire, 24, 220);
        let server = start(&config).await;
        for (ra, rb) in a.iter().zip(&b) {
            send(&server, wire, "a", ra).await;
            send(&server, wire, "b", rb).await;
        }
        let memory = server.pipeline.memory();
        server.shutdown().await.unwrap();
        assert!(memory.evictions as usize >= a.len(), "{wire:?}: {memory:?}");
        let received: Vec<Vec<u8>> = stub.requests().into_iter().map(|r| r.body.to_vec()).collect();
        let (want_a, want_b) = (uninterrupted(&config, wire, &a), uninterrupted(&config, wire, &b));
        for (k, pair) in received.chunks(2).enumerate() {
            assert!(pair[0] == want_a[k].forwarded, "{wire:?}: request {k} of a differs");
            assert!(pair[1] == want_b[k].forwarded, "{wire:?}: request {k} of b differs");
        }
    }
}

/// Regression: with an upstream whose answers are not the agent's next assistant messages (no
/// session header), every request started a new session, so each was compacted afresh (a fresh
/// epoch per request, the worst case for the prompt cache). The whole session stays one session,
/// across a restart too (the request keys are rebuilt from the archive), and pare forwards what
/// `pare replay` predicts for it.
#[tokio::test]
async fn a_session_whose_echoes_differ_from_the_answers_stays_one_across_a_restart() {
    for wire in WIRES {
        let stub = Stub::start(move |_| stream(wire)).await;
        let dir = tempfile::tempdir().unwrap();
        let config = Arc::new(archived_config(&stub, dir.path()));
        let requests = session(wire, 30, 260);
        let half = requests.len() / 2 + 1;
        let mut sessions = Vec::new();
        let mut server = start(&config).await;
        for (k, body) in requests.iter().enumerate() {
            if k == half {
                server.shutdown().await.unwrap();
                server = start(&config).await;
            }
            let request = client().post(server.url(path(wire))).header("content-type", "application/json");
            let response = within("pare to answer", request.body(body.clone()).send()).await.unwrap();
            assert!(response.status().is_success(), "{}", response.status());
            sessions.push(response.headers()["x-pare-session"].to_str().unwrap().to_owned());
            within("the answer's end", response.bytes()).await.unwrap();
        }
        server.shutdown().await.unwrap();
        assert!(sessions.iter().all(|s| *s == sessions[0]), "{wire:?}: {sessions:?}");
        let received: Vec<Vec<u8>> = stub.requests().into_iter().map(|r| r.body.to_vec()).collect();
        let want = uninterrupted(&config, wire, &requests);
        assert!(want.iter().any(|r| r.summary.as_ref().is_some_and(|s| s.epoch_started)), "{wire:?}: no epoch");
        for (k, (got, want)) in received.iter().zip(&want).enumerate() {
            assert!(*got == want.forwarded, "{wire:?}: request {k} is not what `pare replay` predicts");
        }
    }
}
