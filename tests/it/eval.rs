//! `pare eval`'s metrics on tiny hand-made sessions with known answers.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use pare::budget::{CompactEngine, SessionCompactor};
use pare::compact::report::Report;
use pare::compact::{CompactOptions, Compacted, Fate};
use pare::config::Config;
use pare::eval::{Metrics, evaluate_session};
use pare::neutral::View;
use pare::tokens::{CountTokens, REPLY_PRIMING};
use pare::wire::{ChatBody, Wire};
use serde_json::{Value, json};

use crate::budget::MaskEngine;

fn compactor(yaml: &str, engine: Arc<dyn CompactEngine>) -> SessionCompactor {
    SessionCompactor::new(&Config::from_yaml(yaml).unwrap(), engine).unwrap()
}

fn call(id: &str, args: &str) -> Value {
    json!({"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function", "function": {"name": "terminal", "arguments": args}}]})
}

fn tool(id: &str, content: &str) -> Value {
    json!({"role": "tool", "tool_call_id": id, "content": content})
}

/// Requests ending before each assistant message of `conversation` (as the corpus records them).
fn requests_of(conversation: &[Value]) -> Vec<Vec<u8>> {
    (0..conversation.len())
        .filter(|i| conversation[*i]["role"] == "assistant")
        .map(|i| json!({"model": "m", "messages": conversation[..i]}).to_string().into_bytes())
        .collect()
}

/// A session whose 3rd assistant reply uses a path and a number seen only in the first tool output,
/// and a file name the user gave.
fn needle_session() -> Vec<Value> {
    vec![
        json!({"role": "system", "content": "You are a coding agent."}),
        json!({"role": "user", "content": "Please fix README.md"}),
        call("c1", "{\"command\":\"grep -rn render .\"}"),
        tool(
            "c1",
            &format!("src/widget/render.py:48213: def render(self): raise ValueError\n{}", "lorem ".repeat(300)),
        ),
        call("c2", "{\"command\":\"ls\"}"),
        tool("c2", "ok"),
        json!({"role": "assistant", "content": "The bug is at src/widget/render.py line 48213; README.md is fine."}),
        json!({"role": "user", "content": "Thanks."}),
        json!({"role": "assistant", "content": "Done."}),
    ]
}

fn eval(yaml: &str, engine: Arc<dyn CompactEngine>, requests: &[Vec<u8>], window: u64) -> Metrics {
    let compactor = compactor(yaml, engine.clone());
    let lines: Vec<&[u8]> = requests.iter().map(Vec::as_slice).collect();
    evaluate_session(&compactor, engine.as_ref(), Wire::Chat, "s", &lines, window)
}

#[test]
fn needles_are_identifiers_seen_only_in_tool_outputs() {
    let requests = requests_of(&needle_session());
    assert_eq!(requests.len(), 4);
    let off = eval("compaction:\n  mode: off\n", MaskEngine::new(1), &requests, 100_000);
    // `src/widget/render.py` and `48213`; README.md was in the user message, not a needle.
    assert_eq!((off.needles, off.needles_kept), (2, 2));
    assert_eq!(off.recall(), 1.0);

    // Eager, polling every turn, one protected turn: the first tool output is masked in the last
    // request, just before the reply that needs it.
    let eager = eval("compaction:\n  mode: eager\nbudget:\n  polling: 1\n", MaskEngine::new(1), &requests, 100_000);
    assert_eq!((eager.needles, eager.needles_kept), (2, 0));
    assert_eq!(eager.recall(), 0.0);
    assert!(eager.saved() > 0.0);
}

/// Each lost needle is blamed on the rule the plan names for the output that held it, with its way
/// back; a compactor that keeps no plans says so.
#[test]
fn lost_needles_are_blamed_on_the_rule_that_hid_them() {
    let mut conversation = vec![
        json!({"role": "system", "content": "You are a coding agent."}),
        json!({"role": "user", "content": "Fix the total."}),
        call("c1", "{\"command\":\"cat notes.txt\"}"),
    ];
    // More numbers than a marker lists by name: the one in the middle is lost with the output.
    let listing: Vec<String> = (1..=300).map(|i| format!("entry {i}: total {}", 10_000 + i * 7)).collect();
    conversation.push(tool("c1", &listing.join("\n")));
    for (i, command) in ["ls", "pwd", "date"].iter().enumerate() {
        conversation.push(call(&format!("d{i}"), &format!("{{\"command\":\"{command}\"}}")));
        conversation.push(tool(&format!("d{i}"), "ok"));
    }
    conversation.push(json!({"role": "assistant", "content": "The total 11050 needs a start value."}));
    conversation
        .extend([json!({"role": "user", "content": "Go on."}), json!({"role": "assistant", "content": "Done."})]);
    let requests = requests_of(&conversation);
    let yaml = "compaction:\n  mode: eager\n  rules:\n    protect_last_turns: 1\nbudget:\n  polling: 1\n";
    let config = Config::from_yaml(yaml).unwrap();
    let engine: Arc<dyn CompactEngine> = Arc::new(pare::compact::Engine::from_config(&config).unwrap());
    let lines: Vec<&[u8]> = requests.iter().map(Vec::as_slice).collect();

    let recording = compactor(yaml, engine.clone()).recording_plans();
    let m = evaluate_session(&recording, engine.as_ref(), Wire::Chat, "s", &lines, 100_000);
    assert_eq!((m.needles, m.needles_kept), (1, 0), "the needle is in the middle of the collapsed listing");
    let (cause, way) = m.lost_by.iter().next().expect("a cause");
    assert_eq!(m.lost_by.len(), 1);
    assert_eq!(cause, "collapse_succeeded");
    assert_eq!((way.lost, way.retrieve + way.reread + way.unrecoverable()), (1, 1));
    assert_eq!(way.retrieve, m.needles_recoverable);

    let unrecorded = eval(yaml, engine.clone(), &requests, 100_000);
    assert_eq!(unrecorded.lost_by.keys().collect::<Vec<_>>(), ["unplanned"]);
}

#[test]
fn needles_are_read_in_decoded_text_not_in_json_escapes() {
    // A Hermes-style result: a JSON object in a string, whose output holds a newline. In the wire
    // bytes that newline is `\\n`, so `nNow` appears in them; in the text it never does.
    let result = json!({"output": "done\nNow at lib/core_util.py", "exit_code": 0}).to_string();
    let conversation = vec![
        json!({"role": "user", "content": "Go."}),
        call("c1", "{\"command\":\"make\"}"),
        tool("c1", &result),
        json!({"role": "assistant", "content": "Fixed lib/core_util.py; the script printed \\nNow first."}),
        json!({"role": "user", "content": "Thanks."}),
        json!({"role": "assistant", "content": "Done."}),
    ];
    let m = eval("compaction:\n  mode: off\n", MaskEngine::new(1), &requests_of(&conversation), 100_000);
    assert_eq!((m.needles, m.needles_kept), (1, 1), "only lib/core_util.py is a needle");
}

#[test]
fn the_ceiling_is_what_the_invariants_leave_to_save() {
    let requests = requests_of(&needle_session());
    let off = eval("compaction:\n  mode: off\n", MaskEngine::new(1), &requests, 100_000);
    let eager = eval("compaction:\n  mode: eager\nbudget:\n  polling: 1\n", MaskEngine::new(1), &requests, 100_000);
    // The floor is read from the raw requests: the mode does not change it.
    assert_eq!(off.tokens_floor, eager.tokens_floor);
    assert!(off.tokens_floor < off.tokens_raw, "the masked tool output is outside the floor");
    assert!(0.0 < off.ceiling() && off.ceiling() < 1.0);
    assert!(eager.saved() > 0.0 && eager.saved() <= eager.ceiling());
}

#[test]
fn uncached_prefill_of_an_append_only_session_is_its_last_request() {
    let requests = requests_of(&needle_session());
    let m = eval("compaction:\n  mode: off\n", MaskEngine::new(1), &requests, 100_000);
    let compactor = compactor("", MaskEngine::new(1));
    let counter = compactor.counter(Some("m"));
    let last = ChatBody::parse(requests.last().unwrap()).unwrap();
    let last_tokens: u64 = last.messages().iter().map(|x| counter.message(x)).sum::<u64>() + REPLY_PRIMING;
    // Each request re-sends the previous one plus new messages; only the reply priming repeats.
    assert_eq!(m.uncached_raw, last_tokens + REPLY_PRIMING * (requests.len() as u64 - 1));
    assert_eq!(m.uncached_forwarded, m.uncached_raw);
    assert_eq!(m.prefill_ratio(), 1.0);
    assert_eq!(m.saved(), 0.0);
    assert_eq!(m.tokens_raw, m.tokens_forwarded);
    assert_eq!(m.peak_raw, last_tokens);
}

#[test]
fn over_window_counts_only_requests_that_could_fit() {
    let requests = requests_of(&needle_session());
    // Off mode, 200 usable tokens. Request 1 (system + user) fits. The 300-word tool output is in
    // the protected tail of request 2 (floor over the window), and outside it in requests 3 and 4.
    let m = eval("compaction:\n  mode: off\nbudget:\n  output_reserve: 200\n", MaskEngine::new(1), &requests, 400);
    assert_eq!(m.usable_window, 200);
    assert_eq!(m.over_window, 3);
    assert_eq!(m.over_window_fitting, 2);
    // Epoch mode masks the output once it leaves the tail: requests 3 and 4 then fit.
    let m = eval("budget:\n  output_reserve: 200\n", MaskEngine::new(1), &requests, 400);
    assert_eq!((m.over_window, m.over_window_fitting), (1, 0));
}

/// An engine that drops the tool results before the tail (breaking pairing) and edits user messages.
struct BadEngine {
    calls: AtomicUsize,
    drop_tool_results: bool,
    edit_users: bool,
    nondeterministic: bool,
}

impl CompactEngine for BadEngine {
    fn compact(&self, view: &View<'_>, _options: &CompactOptions, _counter: &dyn CountTokens) -> Compacted {
        let n = self.calls.fetch_add(1, Ordering::SeqCst);
        let boundary = view.messages.len().saturating_sub(1);
        let mut prefix = Vec::new();
        let mut plan = Vec::new();
        for m in &view.messages[..boundary] {
            let mut v: Value = serde_json::from_str(m).unwrap();
            if v["role"] == "tool" && self.drop_tool_results {
                plan.push(Fate::Dropped { rules: Default::default() });
                continue;
            }
            if v["role"] == "user" && self.edit_users {
                v["content"] = json!("edited");
            }
            if v["role"] == "system" && self.nondeterministic {
                v["content"] = json!(format!("call {n}"));
            }
            plan.push(Fate::Rewritten { at: prefix.len(), rules: Default::default() });
            prefix.push(v.to_string());
        }
        let typed = vec![None; prefix.len()];
        Compacted { boundary, prefix, report: Report::default(), fitted: false, lists: Vec::new(), plan, typed }
    }
}

fn bad(drop_tool_results: bool, edit_users: bool, nondeterministic: bool) -> Arc<BadEngine> {
    Arc::new(BadEngine { calls: AtomicUsize::new(0), drop_tool_results, edit_users, nondeterministic })
}

#[test]
fn invalid_pairing_lost_users_and_nondeterminism_are_reported() {
    let requests = requests_of(&needle_session());
    let eager = "compaction:\n  mode: eager\nbudget:\n  polling: 1\n";

    let m = eval(eager, bad(false, false, false), &requests, 100_000);
    assert_eq!((m.valid_forwarded, m.preserved, m.deterministic), (4, 4, 1));

    // Dropping results breaks pairing in requests 3 and 4 (in request 2 the only result is the
    // protected last message).
    let m = eval(eager, bad(true, false, false), &requests, 100_000);
    assert_eq!(m.valid_forwarded, 2);
    assert_eq!(m.valid_raw, 4);

    // The first user message is protected only in request 1 (it is the last message there).
    let m = eval(eager, bad(false, true, false), &requests, 100_000);
    assert_eq!(m.preserved, 1);
    assert_eq!(m.validity(), 1.0);

    let m = eval(eager, bad(false, false, true), &requests, 100_000);
    assert_eq!(m.deterministic, 0);
}

#[test]
fn pare_eval_reports_fixture_corpus_as_json() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/sessions");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pare"))
        .args(["eval", "--window", "8192", "--json", dir])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["window"], 8192);
    assert_eq!(report["sessions"].as_array().unwrap().len(), 2);
    let sources: Vec<&String> = report["sources"].as_object().unwrap().keys().collect();
    assert_eq!(sources, ["swe-agent", "tau-bench"]);
    let total = &report["total"];
    assert_eq!(total["requests"], 7);
    assert_eq!(total["deterministic"], 2);
    assert_eq!(total["valid_forwarded"], 7);
}

#[test]
fn a_corpus_evaluated_on_all_cores_matches_its_sessions_evaluated_one_by_one() {
    let dir = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/sessions"));
    let yaml = "compaction:\n  mode: eager\n  rules:\n    protect_last_turns: 1\n";
    let engine: Arc<dyn CompactEngine> =
        Arc::new(pare::compact::Engine::from_config(&Config::from_yaml(yaml).unwrap()).unwrap());
    let report =
        pare::eval::evaluate_corpus(dir, &compactor(yaml, engine.clone()), engine.as_ref(), 4096, Default::default())
            .unwrap();
    let files = pare::eval::corpus::session_files(dir).unwrap();
    assert_eq!(report.sessions.len(), files.len());
    for (session, path) in report.sessions.iter().zip(&files) {
        assert_eq!(Some(session.id.as_str()), path.file_stem().and_then(|s| s.to_str()), "sessions in path order");
        let text = std::fs::read(path).unwrap();
        let lines = pare::budget::replay::session_lines(&text);
        let alone = compactor(yaml, engine.clone());
        let expected = evaluate_session(&alone, engine.as_ref(), Wire::Chat, &path.display().to_string(), &lines, 4096);
        assert_eq!(session.metrics, expected, "{}", path.display());
    }
    assert!(report.total.tokens_forwarded < report.total.tokens_raw, "eager at 4k compacts something");
}

/// The peers' strategies run through the same metrics: SWE-agent's masking of all but the last
/// observation loses the needle of the first output; Anthropic's clearing only above its trigger.
#[test]
fn peer_strategies_are_measured_with_the_same_metrics() {
    use pare::eval::evaluate_session_with;
    use pare::eval::strategy::Strategy;
    let requests = requests_of(&needle_session());
    let lines: Vec<&[u8]> = requests.iter().map(Vec::as_slice).collect();
    let engine: Arc<dyn CompactEngine> = MaskEngine::new(1);
    let compactor = compactor("", engine.clone());
    let run = |strategy: Strategy| {
        evaluate_session_with(strategy, &compactor, engine.as_ref(), Wire::Chat, "s", &lines, Some(100_000))
    };

    let mask = run(Strategy::Mask { keep: 1 });
    assert_eq!((mask.needles, mask.needles_kept), (2, 0), "the first output is masked before the reply");
    assert!(mask.saved() > 0.0);
    assert_eq!(mask.validity(), 1.0);
    assert_eq!(mask.deterministic_share(), 1.0);
    assert_eq!(mask.epochs, 0);

    // 100,000 tokens of window: the trigger is never crossed, nothing is cleared.
    let clear = run(Strategy::Clear { keep: 0, trigger: 0.5 });
    assert_eq!((clear.saved(), clear.recall()), (0.0, 1.0));
    let tight = evaluate_session_with(
        Strategy::Clear { keep: 0, trigger: 0.1 },
        &compactor,
        engine.as_ref(),
        Wire::Chat,
        "s",
        &lines,
        Some(2_000),
    );
    assert!(tight.saved() > 0.0 && tight.recall() < 1.0, "{tight:?}");
    assert_eq!(tight.validity(), 1.0);

    // No output of this session is over Codex's 10 KiB.
    let truncate = run(Strategy::Truncate);
    assert_eq!((truncate.saved(), truncate.recall()), (0.0, 1.0));
}

/// `--split`: every run of a task falls on one side, and the two sides cover the corpus.
#[test]
fn the_split_keeps_a_tasks_runs_together_and_covers_the_corpus() {
    use pare::eval::corpus::{Requests, SessionInput, Split, select, split_of};
    let ids = [
        "pr1__model_a__django__django-11099",
        "pr1__model_b__django__django-11099",
        "v1-agent__astropy__astropy-7336",
        "airline-task03-trial0",
        "airline-task03-trial4",
        "retail-task11-trial2",
    ];
    let sessions: Vec<SessionInput> = ids
        .iter()
        .map(|id| SessionInput { source: "s".into(), id: (*id).into(), requests: Requests::Bodies(Vec::new()) })
        .collect();
    let tune = select(sessions.clone(), Some(Split::Tune));
    let holdout = select(sessions.clone(), Some(Split::Holdout));
    assert_eq!(tune.len() + holdout.len(), ids.len());
    assert_eq!(select(sessions, None).len(), ids.len());
    assert_eq!(split_of(ids[0]), split_of(ids[1]));
    assert_eq!(split_of(ids[3]), split_of(ids[4]));
}

/// Regression: `pare eval --archive` needed `--window` although the config's `models:` gives each
/// model's window; and the TOTAL line put the largest peak of one window over the usable tokens of
/// another. Without `--window` each request is replayed at its model's window, and a total over
/// different windows gives its peak as a share of each request's own usable window.
#[test]
fn eval_of_an_archive_takes_each_models_window_from_the_config() {
    use bytes::Bytes;
    use pare::archive::{Archive, ExchangeRecord};
    use pare::config::Durability;

    let dir = tempfile::tempdir().unwrap();
    let archive_dir = dir.path().join("archive");
    let archive = Archive::start(archive_dir.clone(), Durability::Buffered, std::time::Duration::from_millis(5));
    for (session, model) in [("small-session", "small"), ("big-session", "big")] {
        let conversation = needle_session();
        for (k, body) in requests_of(&conversation).into_iter().enumerate() {
            let mut body: Value = serde_json::from_slice(&body).unwrap();
            body["model"] = json!(model);
            archive.record_exchange(ExchangeRecord {
                model: Some(model.into()),
                ..ExchangeRecord::unchanged(session, 1_700_000_000_000 + k as i64, Bytes::from(body.to_string()))
            });
        }
    }
    archive.close();
    let config = dir.path().join("pare.yaml");
    std::fs::write(
        &config,
        "models:\n  - match: ^small$\n    context_window: 8192\n  - match: ^big$\n    context_window: 65536\n",
    )
    .unwrap();
    let eval = |json: bool| {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_pare"));
        command.args(["eval", "--config", config.to_str().unwrap(), "--archive", archive_dir.to_str().unwrap()]);
        if json {
            command.arg("--json");
        }
        let out = command.output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let report: Value = serde_json::from_str(&eval(true)).unwrap();
    assert_eq!(report["window"], Value::Null);
    let usable: Vec<(&str, u64)> = report["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s["id"].as_str().unwrap(), s["usable_window"].as_u64().unwrap()))
        .collect();
    // The default answer reserve (4,096 tokens) off each model's window.
    assert_eq!(usable, [("big-session", 61_440), ("small-session", 4_096)], "{report:#}");
    let total = &report["total"];
    assert_eq!((total["usable_window"].as_u64(), total["usable_window_max"].as_u64()), (Some(4_096), Some(61_440)));
    let share = total["peak_share"].as_f64().unwrap();
    let small = report["sessions"].as_array().unwrap().iter().find(|s| s["id"] == "small-session").unwrap();
    assert_eq!(share, small["peak_forwarded"].as_f64().unwrap() / 4_096.0, "the larger share is the small window's");

    let table = eval(false);
    assert!(table.starts_with("pare eval: window of each request's model"), "{table}");
    let total_row = table.lines().find(|l| l.starts_with("TOTAL")).unwrap();
    assert!(!total_row.contains("/4,096"), "the total compares no tokens across windows: {total_row}");
    assert!(total_row.contains(&format!("{:.1}% of own", share * 100.0)), "{total_row}");
    assert!(table.contains("usable windows 4,096–61,440, each request against its own"), "{table}");
}

/// The proxy's per-request prefill estimates (raw and forwarded, in each summary) sum to what
/// `pare eval` computes for the same session from the bytes: one rule, two callers. The session
/// crosses several epochs at 8k, so the forwarded figure includes the requests after a new prefix.
#[test]
fn the_proxys_prefill_estimates_sum_to_evals_uncached_prefill() {
    let agent = crate::support::CodingAgent { model: "m", tool: "terminal", id_prefix: "call_", reasoning: None };
    let requests: Vec<Vec<u8>> =
        crate::support::coding_session(&agent, 30, 150).iter().map(|body| body.to_string().into_bytes()).collect();
    let lines: Vec<&[u8]> = requests.iter().map(Vec::as_slice).collect();
    let engine = Arc::new(pare::compact::Engine::default_pack());
    let compactor = SessionCompactor::new(&Config::default(), engine.clone()).unwrap();
    let metrics = evaluate_session(&compactor, engine.as_ref(), Wire::Chat, "s", &lines, 8_192);
    assert!(metrics.epochs >= 2, "{} epochs", metrics.epochs);

    let compactor = SessionCompactor::new(&Config::default(), engine.clone()).unwrap();
    // The proxy decides a request that surely appends before counting its new messages, and
    // counts them late: the estimates come out the same.
    let deferred = SessionCompactor::new(&Config::default(), engine).unwrap();
    let (mut raw, mut forwarded, mut over, mut raw_over) = (0, 0, 0, 0);
    for line in &lines {
        let replayed = pare::budget::replay::replay_request(&compactor, Wire::Chat, "s", line, Some(8_192));
        let summary = replayed.summary.expect("compacted");
        let body = pare::wire::parse(Wire::Chat, line).unwrap();
        let messages = body.messages();
        let hashes = pare::neutral::message_hashes(&messages);
        let out = deferred.compact_messages("s", body.as_ref(), &messages, &hashes, Some(8_192), true);
        let late = out.late.map_or(out.summary.clone(), |late| late(out.summary));
        assert_eq!(late, summary);
        let prefill = summary.prefill.expect("every request is estimated");
        raw += prefill.raw;
        forwarded += prefill.forwarded;
        over += prefill.raw_over_window as usize;
        // No request asks for an answer length: the whole window is the limit.
        raw_over += (summary.tokens_raw > 8_192) as usize;
    }
    assert_eq!((raw, forwarded), (metrics.uncached_raw, metrics.uncached_forwarded));
    assert!(forwarded > raw, "epochs at 8k re-send their rewritten prefix: {forwarded} vs {raw}");
    assert!(over > 0);
    assert_eq!(over, raw_over);
}
