//! Server-side compactions as hard epoch boundaries: a session whose history carries a Responses
//! `compaction` item or an Anthropic `compaction` block, replayed through the epoch state machine.
//! The upstream reads the compaction in place of everything before it, so pare's later epochs leave
//! the compaction and everything before it byte-identical to what it forwarded the first time.

use std::sync::Arc;

use pare::budget::SessionCompactor;
use pare::budget::replay::{Replayed, replay_session};
use pare::config::{Config, Mode};
use pare::wire::messages::convert::chat_to_messages;
use pare::wire::{Wire, convert};
use serde_json::{Value, json};

use crate::support::CodingAgent;

const WINDOW: u64 = 16_000;
/// The request whose answer brings the compaction: later requests carry it.
const COMPACTED_AT: usize = 12;
const N_TURNS: usize = 40;

fn config() -> Config {
    let mut config = Config::default();
    config.compaction.mode = Mode::Epoch;
    config.budget.default_context_window = WINDOW;
    config.budget.output_reserve = 1024;
    config.budget.detect_window = false;
    config
}

fn chat_session() -> Vec<Value> {
    let agent = CodingAgent {
        model: "test-model",
        tool: "terminal",
        id_prefix: "call_",
        reasoning: Some(|k| format!("gAAAA{k}encrypted")),
    };
    crate::support::coding_session(&agent, N_TURNS, 150)
}

/// The session's requests with `item` inserted into the conversation array under `key` of every
/// request after [`COMPACTED_AT`], right after the entries that request held (where the answer to it
/// put the item).
fn with_item_after(requests: Vec<Value>, key: &str, item: &Value) -> Vec<Vec<u8>> {
    let at = requests[COMPACTED_AT][key].as_array().unwrap().len();
    requests
        .into_iter()
        .enumerate()
        .map(|(k, mut body)| {
            if k > COMPACTED_AT {
                body[key].as_array_mut().unwrap().insert(at, item.clone());
            }
            body.to_string().into_bytes()
        })
        .collect()
}

fn replay(wire: Wire, lines: &[Vec<u8>]) -> Vec<Replayed> {
    let lines: Vec<&[u8]> = lines.iter().map(Vec::as_slice).collect();
    let compactor = SessionCompactor::new(&config(), Arc::new(pare::compact::Engine::default_pack())).unwrap();
    replay_session(&compactor, wire, "s", &lines, Some(WINDOW))
}

/// Each forwarded request's conversation array up to and including `item` (`None`: the request
/// does not carry it).
fn heads(out: &[Replayed], key: &str, item: &Value) -> Vec<Option<Vec<Value>>> {
    out.iter()
        .map(|replayed| {
            let body: Value = serde_json::from_slice(&replayed.forwarded).unwrap();
            let entries = body[key].as_array().unwrap();
            let at = entries.iter().position(|e| e == item)?;
            Some(entries[..=at].to_vec())
        })
        .collect()
}

/// The epochs started by the requests after the first one carrying the compaction.
fn later_epochs(out: &[Replayed]) -> usize {
    out[COMPACTED_AT + 2..].iter().filter(|r| r.summary.as_ref().is_some_and(|s| s.epoch_started)).count()
}

/// Asserts that every request from the first one carrying `item` on forwards the same head up to
/// it, and that epochs ran meanwhile.
fn assert_head_kept(out: &[Replayed], key: &str, item: &Value, what: &str) {
    let heads = heads(out, key, item);
    assert!(
        heads[..=COMPACTED_AT].iter().all(Option::is_none),
        "{what}: the item arrives after request {COMPACTED_AT}"
    );
    let first = heads[COMPACTED_AT + 1].as_ref().expect("the first request carrying the item keeps it");
    for (k, head) in heads.iter().enumerate().skip(COMPACTED_AT + 2) {
        assert_eq!(head.as_ref(), Some(first), "{what}: request {k} rewrote what comes up to the compaction");
    }
    assert!(later_epochs(out) >= 2, "{what}: {} epochs after the compaction", later_epochs(out));
}

/// Whether a later request forwards something else up to `item` than the first one carrying it.
fn head_rewritten(out: &[Replayed], key: &str, item: &Value) -> bool {
    let heads = heads(out, key, item);
    heads[COMPACTED_AT + 2..].iter().any(|head| head != &heads[COMPACTED_AT + 1])
}

/// A Codex session past a compaction: the `compaction` item and every item before it go upstream as
/// the first request carrying it sent them, through every later epoch.
#[test]
fn responses_epochs_keep_everything_up_to_a_compaction_item() {
    let requests: Vec<Value> = chat_session().iter().map(|body| convert::chat_to_responses(body).unwrap()).collect();
    for kind in ["compaction", "compaction_summary", "context_compaction"] {
        let item = json!({"type": kind, "id": "cmp_1", "encrypted_content": "gAAAAcompacted-history"});
        let out = replay(Wire::Responses, &with_item_after(requests.clone(), "input", &item));
        assert!(out.iter().all(|r| r.skipped.is_none()));
        assert_head_kept(&out, "input", &item, kind);
    }
    // An opaque item of another type is no boundary: later epochs rewrite what comes before it.
    let other = json!({"type": "web_search_call", "id": "ws_1", "status": "completed"});
    let out = replay(Wire::Responses, &with_item_after(requests, "input", &other));
    assert!(head_rewritten(&out, "input", &other), "the session compacts its older history");
}

/// A Claude Code session past a context-management compaction: the assistant turn opening with the
/// `compaction` block and every turn before it go upstream as first sent, through every later epoch.
#[test]
fn messages_epochs_keep_everything_up_to_a_compaction_block() {
    let requests: Vec<Value> = chat_session().iter().map(|body| chat_to_messages(body).unwrap()).collect();
    let turn = |first: Value| json!({"role": "assistant", "content": [first, {"type": "text", "text": "Picking up from the summary."}]});
    let compacted = turn(json!({"type": "compaction", "content": "Summary: the tests fail in src/app.py."}));
    // The assistant turn goes before the user turn that asks for the next step.
    let with_turn = |turn: &Value| {
        let mut lines = with_item_after(requests.clone(), "messages", turn);
        let user = json!({"role": "user", "content": "Go on."});
        let at = requests[COMPACTED_AT]["messages"].as_array().unwrap().len() + 1;
        for line in lines.iter_mut().skip(COMPACTED_AT + 1) {
            let mut body: Value = serde_json::from_slice(line).unwrap();
            body["messages"].as_array_mut().unwrap().insert(at, user.clone());
            *line = body.to_string().into_bytes();
        }
        lines
    };
    let out = replay(Wire::Messages, &with_turn(&compacted));
    assert!(out.iter().all(|r| r.skipped.is_none()));
    assert_head_kept(&out, "messages", &compacted, "compaction block");
    let plain = turn(json!({"type": "text", "text": "Summary: the tests fail in src/app.py."}));
    let out = replay(Wire::Messages, &with_turn(&plain));
    assert!(head_rewritten(&out, "messages", &plain), "the session compacts its older history");
}
