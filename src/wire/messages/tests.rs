//! Tests of the Messages adapter: round trips, the neutral view, write-back, cache marks and checks.

use crate::wire::{Forward, WrittenReads, write_by_hand};
use serde_json::json;

use super::*;
use crate::compact::validate::Violation;

/// A Claude Code-shaped request: system blocks (the last marked, 1h), a marked tool, a turn with a
/// signed thinking block and two calls, their results (one an error, one with blocks and an
/// inner mark), the person's text beside results, a redacted thinking turn, a server tool turn and
/// an image; the last user turn is marked.
const CLAUDE_CODE: &str = r#"{"model":"claude-sonnet-4-5","max_tokens":32000,"system":[{"type":"text","text":"x-anthropic-billing-header: cc_version=2.0.14"},{"type":"text","text":"You are Claude Code.","cache_control":{"type":"ephemeral","ttl":"1h"}}],"messages":[{"role":"user","content":[{"type":"text","text":"<system-reminder>CLAUDE.md</system-reminder>"},{"type":"text","text":"Fix the build."},{"type":"image","source":{"type":"base64","media_type":"image/png","data":"iVBORw0KGgo="}}]},{"role":"assistant","content":[{"type":"thinking","thinking":"Look at the error first.","signature":"EqQBCkgIBxABGAIiQL2w"},{"type":"text","text":"Reading both."},{"type":"tool_use","id":"toolu_01","name":"Read","input":{"file_path":"/src/main.rs","limit":2000}},{"type":"tool_use","id":"toolu_02","name":"Bash","input":{"command":"cargo build 2>&1","description":"Build"}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_01","content":"     1\tfn main() {\n     2\t    run();\n     3\t}\n"},{"type":"tool_result","tool_use_id":"toolu_02","is_error":true,"content":[{"type":"text","text":"error[E0425]: cannot find function `run`","cache_control":{"type":"ephemeral"}}]},{"type":"text","text":"also check lib.rs"}]},{"role":"assistant","content":[{"type":"redacted_thinking","data":"EmwKAhgBEgy3va3pzix"},{"type":"tool_use","id":"toolu_03","name":"Grep","input":{"pattern":"fn run","path":"src"}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_03","content":"src/lib.rs:12:pub fn run() {}"}]},{"role":"assistant","content":[{"type":"server_tool_use","id":"srvtoolu_1","name":"web_search","input":{"query":"E0425"}},{"type":"web_search_tool_result","tool_use_id":"srvtoolu_1","content":[]},{"type":"text","text":"Found it."}]},{"role":"user","content":[{"type":"text","text":"go on","cache_control":{"type":"ephemeral"}}]}],"tools":[{"name":"Read","input_schema":{"type":"object"}},{"name":"Bash","input_schema":{"type":"object"},"cache_control":{"type":"ephemeral"}}],"stream":true,"thinking":{"type":"enabled","budget_tokens":10000}}"#;

fn parse(body: &str) -> MessagesBody<'_> {
    MessagesBody::parse(body.as_bytes()).unwrap()
}

fn neutral(parsed: &MessagesBody<'_>) -> Vec<String> {
    parsed.messages().into_iter().map(str::to_owned).collect()
}

fn written(parsed: &MessagesBody<'_>, messages: &[String]) -> Value {
    serde_json::from_slice(&write_by_hand(parsed, &refs(messages)).unwrap().0).unwrap()
}

#[test]
fn writing_the_neutral_messages_back_unchanged_gives_the_input_bytes() {
    for body in [
        CLAUDE_CODE,
        r#"{"model":"m","messages":[]}"#,
        r#"{"messages":[{"role":"user","content":"hi"}],"system":"Be brief.","max_tokens":10}"#,
        r#"{"messages":[ {"role":"user","content":[]} , {"role":"narrator","content":"x"}, 7 ],"z":{"k":1}}"#,
    ] {
        let parsed = parse(body);
        crate::wire::assert_typed_as_read(&parsed);
        let (bytes, spans) = write_by_hand(&parsed, &refs(&neutral(&parsed))).unwrap();
        assert_eq!(String::from_utf8(bytes.clone()).unwrap(), body);
        assert_eq!(MessagesBody::parse(&bytes).unwrap().spans_in(&bytes), Some(spans));
    }
}

#[test]
fn turns_read_into_neutral_messages_paired_by_tool_use_id() {
    let parsed = parse(CLAUDE_CODE);
    let messages = parsed.messages();
    let roles: Vec<String> = messages.iter().map(|m| crate::neutral::role_of(m).into_owned()).collect();
    assert_eq!(
        roles,
        ["system", "user", "assistant", "tool", "tool", "user", "assistant", "tool", "assistant", "user"]
    );
    let system: Value = serde_json::from_str(messages[0]).unwrap();
    assert_eq!(
        system["content"][1],
        json!({"type": "text", "text": "You are Claude Code."}),
        "marks are not in the neutral form"
    );
    let calls: Value = serde_json::from_str(messages[2]).unwrap();
    assert_eq!(calls["content"], json!([{"type": "text", "text": "Reading both."}]));
    assert_eq!(calls["tool_calls"][1]["id"], "toolu_02");
    assert_eq!(
        calls["tool_calls"][1]["function"]["arguments"],
        r#"{"command":"cargo build 2>&1","description":"Build"}"#
    );
    let error: Value = serde_json::from_str(messages[4]).unwrap();
    assert_eq!(error["content"][0], json!({"type": "text", "text": "error[E0425]: cannot find function `run`"}));
    let person: Value = serde_json::from_str(messages[5]).unwrap();
    assert_eq!(person["content"], json!([{"type": "text", "text": "also check lib.rs"}]));
    let server: Value = serde_json::from_str(messages[8]).unwrap();
    assert_eq!(server, json!({"role": "assistant", "content": [{"type": "text", "text": "Found it."}]}));
    assert_eq!(parsed.output_limit(), Some(32000));
    assert!(parsed.stream());
    assert!(parsed.tools().unwrap().starts_with(r#"[{"name":"Read""#));
    let skeletons: Vec<_> = messages.iter().map(|m| crate::compact::validate::Skeleton::of(m)).collect();
    assert!(crate::compact::validate::check(&skeletons).is_ok());
}

/// The marks a body's turns were read with are those of its whole value, wherever they sit: the
/// tools, the system prompt, a block, a result's content, an opaque turn, a block whose other
/// keys are odd, beside content that is no object.
#[test]
fn marks_are_read_from_the_turns_as_from_the_whole_value() {
    let odd = r#"{"model":"m","system":"plain","messages":[{"role":"system","content":[{"type":"text","text":"s","cache_control":{"type":"ephemeral"}}]},{"role":"assistant","content":[{"type":"tool_use","id":7,"name":"f","input":{},"cache_control":{"type":"ephemeral","ttl":"1h"}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"a","content":["x",{"type":"text","text":"y","cache_control":{"type":"ephemeral"}},{"type":"text","text":"z","cache_control":null}]}]},{"role":"user","content":"no blocks"}]}"#;
    for body in [CLAUDE_CODE, odd] {
        let parsed = parse(body);
        let want = cache::marks(&serde_json::from_str(body).unwrap());
        assert!(!want.is_empty());
        assert_eq!(parsed.marks(), want, "{body}");
    }
    assert_eq!(parse(odd).marks().len(), 3);
}

/// A turn pare cannot read is one unit, whatever marks its blocks carry: writing around it keeps
/// its marks where they are and never looks for a block of its own.
#[test]
fn an_opaque_turn_with_marks_on_its_blocks_is_written_whole() {
    let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"},{"rode":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b","cache_control":{"type":"ephemeral"}}]},{"role":"assistant","content":"ok"},{"role":"user","content":"go on"}]}"#;
    let parsed = parse(body);
    assert_eq!(parsed.marks().len(), 1);
    let marker = r#"{"role":"assistant","content":"[pare: marker]"}"#;
    let reads = WrittenReads::new(1);
    let entries = [
        Forward::Kept(0),
        Forward::New(reads.written(0, marker)),
        Forward::Kept(1),
        Forward::Kept(2),
        Forward::Kept(3),
    ];
    let (bytes, _) = parsed.write(&entries).unwrap();
    let out: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(out["messages"][2], serde_json::from_str::<Value>(parsed.split.elements[1]).unwrap());
    assert_eq!(cache::marks(&out).len(), 1);
}

#[test]
fn moving_the_last_mark_leaves_the_neutral_form_alone() {
    // Claude Code marks the newest user turn on each request: the turn marked before is the same turn.
    let earlier = CLAUDE_CODE.replace(r#""text":"go on","cache_control":{"type":"ephemeral"}"#, r#""text":"go on""#);
    let earlier = earlier.replace(
        r#""content":"src/lib.rs:12:pub fn run() {}""#,
        r#""content":"src/lib.rs:12:pub fn run() {}","cache_control":{"type":"ephemeral"}"#,
    );
    assert_ne!(earlier, CLAUDE_CODE);
    assert_eq!(neutral(&parse(&earlier)), neutral(&parse(CLAUDE_CODE)));
}

/// A session past a server-side compaction: an older read, the assistant turn opening with the
/// `compaction` block (then its text and a call), and later reads.
fn compacted_session(block: &str) -> String {
    let big = (0..400).map(|n| format!("line {n} of the file")).collect::<Vec<_>>().join("\n");
    let read = |id: &str| json!({"role": "assistant", "content": [{"type": "tool_use", "id": id, "name": "Read", "input": {"file_path": format!("/src/{id}.rs")}}]});
    let result =
        |id: &str| json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": id, "content": big}]});
    let boundary = json!({"role": "assistant", "content": [
        serde_json::from_str::<Value>(block).unwrap(),
        {"type": "text", "text": "Continuing."},
        {"type": "tool_use", "id": "toolu_b", "name": "Read", "input": {"file_path": "/src/b.rs"}},
    ]});
    json!({"model": "m", "max_tokens": 100, "messages": [
        {"role": "user", "content": "Fix the build."},
        read("toolu_a"), result("toolu_a"),
        boundary, result("toolu_b"),
        read("toolu_c"), result("toolu_c"),
        {"role": "assistant", "content": [{"type": "text", "text": "Done."}]},
        {"role": "user", "content": "thanks"},
    ]})
    .to_string()
}

/// A turn holding a `compaction` block is a hard epoch boundary: it, the results answering it and
/// every turn before it are forwarded byte for byte; later results are compacted as usual.
#[test]
fn a_compaction_turn_and_everything_before_it_are_forwarded_as_sent() {
    let mut engine = crate::compact::Engine::default_pack();
    engine.policy.spec.protect_last_turns = 1;
    let compact = |body: &str| -> Value {
        let parsed = parse(body);
        let raw = parsed.messages();
        let typed = |i: usize| parsed.typed(i);
        let view = crate::neutral::View { messages: &raw, tools: None, typed: Some(&typed) };
        let options = crate::compact::CompactOptions { epoch_boundary: parsed.epoch_boundary(), ..Default::default() };
        let out = engine.compact(&view, &options, &crate::tokens::QuarterCounter);
        let mut messages = out.prefix.clone();
        messages.extend(raw[out.boundary..].iter().map(|m| (*m).to_owned()));
        written(&parsed, &messages)
    };
    for block in [
        r#"{"type":"compaction","content":"The build failed in main.rs; a.rs was read."}"#,
        r#"{"type":"compaction","content":"Summary.","cache_control":{"type":"ephemeral"}}"#,
    ] {
        let body = compacted_session(block);
        let raw: Value = serde_json::from_str(&body).unwrap();
        let parsed = parse(&body);
        assert_eq!(parsed.epoch_boundary(), Some(3), "the assistant turn holding the block");
        assert!(!parsed.messages().iter().any(|m| m.contains("pare_")), "the neutral form carries no key of pare's");
        let forwarded = compact(&body);
        assert_eq!(forwarded["messages"].as_array().unwrap()[..5], raw["messages"].as_array().unwrap()[..5]);
        assert_ne!(forwarded["messages"][6], raw["messages"][6], "a later result is compacted");
    }
    // The same session without a summary in the block (a failed compaction, which the API treats as
    // a no-op) or without the block: the older read is compacted too.
    for block in [r#"{"type":"compaction","content":null}"#, r#"{"type":"text","text":"Summary."}"#] {
        let body = compacted_session(block);
        let raw: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(parse(&body).epoch_boundary(), None, "{block}");
        assert_ne!(compact(&body)["messages"][2], raw["messages"][2], "{block}");
    }
}

#[test]
fn a_rewritten_result_and_input_keep_every_other_byte() {
    let parsed = parse(CLAUDE_CODE);
    let mut messages = neutral(&parsed);
    messages[3] =
        r#"{"role":"tool","tool_call_id":"toolu_01","content":"[tool: Read(/src/main.rs) → 3 lines]"}"#.to_owned();
    messages[4] = r#"{"role":"tool","tool_call_id":"toolu_02","content":"error[E0425]"}"#.to_owned();
    messages[2] = messages[2].replace(r#"cargo build 2>&1"#, "cargo");
    let out = written(&parsed, &messages);
    let input: Value = serde_json::from_str(CLAUDE_CODE).unwrap();
    assert_eq!(out["messages"][2]["content"][0]["content"], "[tool: Read(/src/main.rs) → 3 lines]");
    // The error keeps is_error; its inner mark moves onto its block.
    assert_eq!(out["messages"][2]["content"][1]["is_error"], true);
    assert_eq!(out["messages"][2]["content"][1]["content"], "error[E0425]");
    assert_eq!(out["messages"][2]["content"][1]["cache_control"], json!({"type": "ephemeral"}));
    assert_eq!(out["messages"][2]["content"][2], input["messages"][2]["content"][2], "the person's text");
    let turn = &out["messages"][1]["content"];
    assert_eq!(turn[0], input["messages"][1]["content"][0], "thinking and its signature, byte for byte");
    assert_eq!(turn[3]["input"], json!({"command": "cargo", "description": "Build"}));
    for key in ["system", "tools", "thinking", "model"] {
        assert_eq!(out[key], input[key]);
    }
    assert_eq!(out["messages"][6], input["messages"][6]);
    assert_eq!(crate::wire::messages::cache::marks(&out).len(), 4);
}

#[test]
fn an_input_that_loses_or_gains_keys_is_refused() {
    let parsed = parse(CLAUDE_CODE);
    let mut messages = neutral(&parsed);
    messages[2] = messages[2].replace(r#",\"limit\":2000"#, "");
    assert!(matches!(write_by_hand(&parsed, &refs(&messages)), Err(WireError::Unwritable(_))));
    let mut messages = neutral(&parsed);
    messages[0] = r#"{"role":"system","content":"shorter"}"#.to_owned();
    assert!(write_by_hand(&parsed, &refs(&messages)).is_err(), "the system prompt is never changed");
}

#[test]
fn an_elided_call_turn_goes_with_its_thinking_and_results_but_not_the_persons_text() {
    let parsed = parse(CLAUDE_CODE);
    let messages = neutral(&parsed);
    // The engine elides the first call turn and its two results, leaving a marker.
    let marker = r#"{"role":"assistant","content":"[pare: 3 earlier messages elided — Read ×1, Bash ×1]"}"#.to_owned();
    let forwarded: Vec<String> = [&messages[..2], std::slice::from_ref(&marker), &messages[5..]].concat();
    let out = written(&parsed, &forwarded);
    let turns = out["messages"].as_array().unwrap();
    let input: Value = serde_json::from_str(CLAUDE_CODE).unwrap();
    assert_eq!(turns[0], input["messages"][0]);
    assert_eq!(
        turns[1],
        json!({"role": "assistant", "content": [{"type": "text", "text": "[pare: 3 earlier messages elided — Read ×1, Bash ×1]"}]})
    );
    assert_eq!(turns[2], json!({"role": "user", "content": [{"type": "text", "text": "also check lib.rs"}]}));
    assert_eq!(turns[3], input["messages"][3]);
    assert!(!out.to_string().contains("EqQBCkgIBxABGAIiQL2w"), "the thinking block went with its turn");
    // The error result's inner mark went with it; no block before it may carry one (the person's
    // text and the marker are not pare's to mark): 3 marks remain, in the agent's order.
    let marks = crate::wire::messages::cache::marks(&out);
    assert_eq!(marks.len(), 3);
    check_turns(&turns.iter().map(Value::to_string).collect::<Vec<_>>()).unwrap();
}

#[test]
fn a_marker_before_a_turn_that_opens_with_thinking_is_a_user_turn() {
    // The API would join an assistant marker with the next assistant turn, which must open with
    // its thinking block when it is the final one.
    let body = r#"{"messages":[{"role":"user","content":"go"},{"role":"assistant","content":[{"type":"tool_use","id":"a","name":"f","input":{}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"a","content":"1"}]},{"role":"assistant","content":[{"type":"thinking","thinking":"t","signature":"s"},{"type":"tool_use","id":"b","name":"f","input":{}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"b","content":"2"}]}]}"#;
    let parsed = parse(body);
    let messages = neutral(&parsed);
    let marker = r#"{"role":"assistant","content":"[pare: elided]"}"#.to_owned();
    let forwarded: Vec<String> = [&messages[..1], std::slice::from_ref(&marker), &messages[3..]].concat();
    let out = written(&parsed, &forwarded);
    assert_eq!(out["messages"][1], json!({"role": "user", "content": [{"type": "text", "text": "[pare: elided]"}]}));
    assert_eq!(out["messages"][2]["content"][0]["type"], "thinking");
    // Before a turn without thinking, the marker stays the assistant's.
    let body = body.replace(r#"{"type":"thinking","thinking":"t","signature":"s"},"#, "");
    let parsed = parse(&body);
    let messages = neutral(&parsed);
    let forwarded: Vec<String> = [&messages[..1], std::slice::from_ref(&marker), &messages[3..]].concat();
    assert_eq!(written(&parsed, &forwarded)["messages"][1]["role"], "assistant");
}

#[test]
fn a_mark_of_an_elided_result_moves_to_the_nearest_block_before_it() {
    let body = r#"{"messages":[{"role":"user","content":"task"},{"role":"assistant","content":[{"type":"tool_use","id":"a","name":"f","input":{}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"a","content":"1"}]},{"role":"assistant","content":[{"type":"tool_use","id":"b","name":"f","input":{}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"b","content":"2","cache_control":{"type":"ephemeral","ttl":"1h"}}]},{"role":"assistant","content":"done"},{"role":"user","content":[{"type":"text","text":"next","cache_control":{"type":"ephemeral"}}]}]}"#;
    let parsed = parse(body);
    let messages = neutral(&parsed);
    let marker = r#"{"role":"assistant","content":"[pare: elided]"}"#.to_owned();
    // Elide the second call and its result: the 1h mark moves back to the first result.
    let forwarded: Vec<String> = [&messages[..3], std::slice::from_ref(&marker), &messages[5..]].concat();
    let out = written(&parsed, &forwarded);
    assert_eq!(out["messages"][2]["content"][0]["cache_control"], json!({"type": "ephemeral", "ttl": "1h"}));
    let marks = crate::wire::messages::cache::marks(&out);
    assert_eq!(marks.len(), 2);
    assert!(marks[0].place < marks[1].place);
}

#[test]
fn a_reused_tool_use_id_rewrites_the_result_of_its_own_turn() {
    // Agents reuse an id once its call is answered: the rewritten result is the later one.
    let body = r#"{"messages":[{"role":"user","content":"go"},{"role":"assistant","content":[{"type":"tool_use","id":"a","name":"f","input":{"n":1}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"a","content":"first"}]},{"role":"assistant","content":[{"type":"tool_use","id":"a","name":"f","input":{"n":2}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"a","content":"second"}]},{"role":"assistant","content":"done"}]}"#;
    let parsed = parse(body);
    let mut messages = neutral(&parsed);
    messages[4] = r#"{"role":"tool","tool_call_id":"a","content":"[2nd]"}"#.to_owned();
    let out = written(&parsed, &messages);
    assert_eq!(out["messages"][2]["content"][0]["content"], "first");
    assert_eq!(out["messages"][4]["content"][0]["content"], "[2nd]");
}

fn pairing(violation: Violation, turn: usize) -> Result<(), Invalid> {
    Err(Invalid::Pairing { violation, origin: Some(Origin::Turn(turn)) })
}

fn structure(rule: Structure) -> Result<(), Invalid> {
    Err(Invalid::Messages(rule))
}

const CALL: &str = r#"{"role":"assistant","content":[{"type":"tool_use","id":"a","name":"f","input":{}}]}"#;
const RESULT: &str = r#"{"role":"user","content":[{"type":"tool_result","tool_use_id":"a","content":"x"}]}"#;
const TEXT: &str = r#"{"role":"user","content":"hi"}"#;

#[test]
fn the_turn_check_pairs_tool_uses_through_the_neutral_view() {
    let a = || "a".to_owned();
    assert_eq!(check_turns(&[TEXT, CALL, RESULT]), Ok(()));
    assert_eq!(check_turns(&[TEXT, CALL, TEXT]), pairing(Violation::Unanswered { call_idx: 1, id: a(), idx: 2 }, 1));
    assert_eq!(check_turns(&[TEXT, RESULT]), pairing(Violation::OrphanResult { idx: 1, id: a() }, 1));
    // The last turn's calls are answered too (the API refuses a tool_use without its result).
    assert_eq!(check_turns(&[TEXT, CALL]), pairing(Violation::Unanswered { call_idx: 1, id: a(), idx: 2 }, 1));
    let twice = r#"{"role":"assistant","content":[{"type":"tool_use","id":"a","name":"f","input":{}},{"type":"tool_use","id":"a","name":"f","input":{}}]}"#;
    assert_eq!(check_turns(&[TEXT, twice, RESULT]), pairing(Violation::DuplicateCallId { idx: 1, id: a() }, 1));
    let nameless = r#"{"role":"assistant","content":[{"type":"tool_use","id":"","name":"f","input":{}}]}"#;
    assert_eq!(check_turns(&[TEXT, nameless]), pairing(Violation::EmptyCallId { idx: 1 }, 1));
    assert_eq!(
        check_turns(&[TEXT, CALL, TEXT]).unwrap_err().to_string(),
        "turn 1: tool call `a` of assistant message 1 has no answer before message 2"
    );
}

#[test]
fn the_turn_check_keeps_the_apis_own_rules() {
    // A tool_use in a user turn (the neutral view reads it as the person's text).
    let user_use = r#"{"role":"user","content":[{"type":"tool_use","id":"a","name":"f","input":{}}]}"#;
    assert_eq!(
        check_turns(&[TEXT, user_use]),
        structure(Structure::ToolUseOutsideAssistant { turn: 1, id: "a".into() })
    );
    // A tool_result in an assistant turn (the neutral view does not read it).
    let assistant_result = r#"{"role":"assistant","content":[{"type":"text","text":"t"},{"type":"tool_result","tool_use_id":"x","content":"r"}]}"#;
    assert_eq!(
        check_turns(&[TEXT, assistant_result]),
        structure(Structure::ToolResultOutsideUser { turn: 1, id: "x".into() })
    );
    // The results of a turn's calls go in the very next turn: split over two user turns, they read
    // as one run of tool messages in the neutral form, which the API refuses.
    let two = r#"{"role":"assistant","content":[{"type":"tool_use","id":"a","name":"f","input":{}},{"type":"tool_use","id":"b","name":"f","input":{}}]}"#;
    let result_b = r#"{"role":"user","content":[{"type":"tool_result","tool_use_id":"b","content":"y"}]}"#;
    assert_eq!(
        check_turns(&[TEXT, two, RESULT, result_b]),
        structure(Structure::ResultNotAfterCalls { turn: 3, id: "b".into() })
    );
    let both = r#"{"role":"user","content":[{"type":"tool_result","tool_use_id":"a","content":"x"},{"type":"tool_result","tool_use_id":"b","content":"y"}]}"#;
    assert_eq!(check_turns(&[TEXT, two, both]), Ok(()));
    let marked = r#"{"role":"user","content":[{"type":"text","text":"a","cache_control":{"type":"ephemeral"}},{"type":"text","text":"b","cache_control":{"type":"ephemeral"}},{"type":"text","text":"c","cache_control":{"type":"ephemeral"}}]}"#;
    assert_eq!(check_turns(&[marked, CALL, RESULT, marked]), structure(Structure::TooManyMarks { n_marks: 6 }));
    assert_eq!(
        check_turns(&[marked, CALL, RESULT, marked]).unwrap_err().to_string(),
        "6 cache_control marks in the turns (the API takes 4)"
    );
    assert_eq!(check_turns(&[marked, CALL, RESULT, TEXT]), Ok(()));
}

#[test]
fn a_write_that_drops_a_call_turn_but_keeps_its_results_is_refused_by_the_pairing_check() {
    let parsed = parse(CLAUDE_CODE);
    let messages = neutral(&parsed);
    // Messages 3 and 4 answer the calls of message 2, which goes.
    let forwarded: Vec<String> = [&messages[..2], &messages[3..]].concat();
    assert!(matches!(
        write_by_hand(&parsed, &refs(&forwarded)),
        Err(WireError::Invalid(Invalid::Pairing {
            violation: Violation::OrphanResult { idx: 2, .. },
            origin: Some(Origin::Turn(1))
        }))
    ));
}

/// The pairing check reads the neutral messages the adapter hands the engine: the skeletons built
/// from the turns are those of [`WireBody::messages`].
#[test]
fn the_checked_skeletons_are_those_of_the_neutral_messages() {
    let odd = r#"{"messages":[{"role":"user","content":[]},{"role":"system","content":"x"},{"role":"assistant","content":[{"type":"thinking","thinking":"t"}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"q"}]},7]}"#;
    for body in [CLAUDE_CODE, odd] {
        let parsed = parse(body);
        let from_text: Vec<_> = parsed.messages().iter().map(|m| Skeleton::of(m)).collect();
        assert_eq!(
            neutral_skeletons(&parsed.turns.iter().collect::<Vec<_>>(), parsed.has_system).0,
            from_text,
            "{body}"
        );
    }
}

mod properties {
    use proptest::prelude::*;
    use serde_json::json;

    use super::*;
    use crate::compact::{CompactOptions, Engine};
    use crate::neutral::View;
    use crate::tokens::QuarterCounter;

    /// One step of a Claude Code session as turns: the person's text, an assistant text (with or
    /// without thinking), or a call turn (thinking or redacted thinking, one to three `tool_use`
    /// blocks, a server tool) answered in the next user turn (errors, the person's text beside the
    /// results, a mark on a result).
    fn step(k: usize) -> impl Strategy<Value = Vec<Value>> {
        let text = "[a-z ]{0,40}( line\n[a-z/._ ]{0,30}){0,30}";
        let thinking = move |kind: u8| match kind {
            0 => None,
            1 => Some(json!({"type": "thinking", "thinking": format!("plan {k}"), "signature": format!("sig{k}==")})),
            _ => Some(json!({"type": "redacted_thinking", "data": format!("red{k}")})),
        };
        prop_oneof![
            text.prop_map(|t| vec![json!({"role": "user", "content": [{"type": "text", "text": t}]})]),
            (text, 0u8..3).prop_map(move |(t, kind)| {
                let mut blocks: Vec<Value> = thinking(kind).into_iter().collect();
                blocks.push(json!({"type": "text", "text": t}));
                vec![json!({"role": "assistant", "content": blocks})]
            }),
            (prop::collection::vec(text, 1..4), 0u8..3, any::<bool>(), any::<bool>(), any::<bool>(), any::<bool>()).prop_map(
                move |(outputs, kind, fail, person, mark, server)| {
                    let mut calls: Vec<Value> = thinking(kind).into_iter().collect();
                    if server {
                        calls.push(json!({"type": "server_tool_use", "id": format!("srv_{k}"), "name": "web_search", "input": {"query": "q"}}));
                        calls.push(json!({"type": "web_search_tool_result", "tool_use_id": format!("srv_{k}"), "content": []}));
                    }
                    let mut results = Vec::new();
                    for (n, output) in outputs.into_iter().enumerate() {
                        let id = format!("toolu_{k}_{n}");
                        calls.push(json!({"type": "tool_use", "id": id, "name": "Read", "input": {"file_path": format!("src/f{k}.rs"), "long": output.clone()}}));
                        let mut result = json!({"type": "tool_result", "tool_use_id": id, "content": if fail { format!("Error: {output}") } else { output }});
                        if fail {
                            result["is_error"] = json!(true);
                        }
                        results.push(result);
                    }
                    if mark {
                        results[0]["cache_control"] = json!({"type": "ephemeral", "ttl": "1h"});
                    }
                    if person {
                        results.push(json!({"type": "text", "text": format!("note {k}")}));
                    }
                    vec![json!({"role": "assistant", "content": calls}), json!({"role": "user", "content": results})]
                }
            ),
        ]
    }

    /// A request as Claude Code sends it: a marked system prompt, a first user turn, steps, and a
    /// mark on the last block of the last user turn; at most 4 marks in all.
    fn request() -> impl Strategy<Value = String> {
        prop::collection::vec(any::<prop::sample::Index>(), 1..14).prop_flat_map(|steps| {
            let steps: Vec<_> = (0..steps.len()).map(step).collect();
            steps.prop_map(|steps| {
                let mut turns = vec![json!({"role": "user", "content": "Fix the build."})];
                turns.extend(steps.into_iter().flatten());
                let mut n_marks = 2;
                for turn in turns.iter_mut() {
                    for block in turn["content"].as_array_mut().into_iter().flatten() {
                        if block.get("cache_control").is_some() {
                            n_marks += 1;
                            if n_marks > 4 {
                                block.as_object_mut().unwrap().shift_remove("cache_control");
                            }
                        }
                    }
                }
                if let Some(Value::Array(blocks)) = turns.iter_mut().rev().find(|t| t["role"] == "user").map(|t| &mut t["content"])
                    && let Some(last) = blocks.last_mut()
                    && last.get("cache_control").is_none()
                {
                    last["cache_control"] = json!({"type": "ephemeral"});
                }
                json!({
                    "model": "claude-sonnet-4-5",
                    "max_tokens": 32000,
                    "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
                    "messages": turns,
                    "tools": [{"name": "Read", "input_schema": {"type": "object"}}],
                })
                .to_string()
            })
        })
    }

    fn blocks_of(turns: &[&str], pick: impl Fn(&str, &Value) -> bool) -> Vec<String> {
        let mut out = Vec::new();
        for turn in turns {
            let turn: Value = serde_json::from_str(turn).unwrap();
            let role = turn["role"].as_str().unwrap_or("");
            for block in turn["content"].as_array().into_iter().flatten() {
                if pick(role, block) {
                    out.push(block.to_string());
                }
            }
        }
        out
    }

    fn forwarded(engine: &Engine, parsed: &MessagesBody<'_>, target: Option<u64>) -> (Vec<String>, usize) {
        let raw = parsed.messages();
        let options =
            CompactOptions { target_tokens: target, epoch_boundary: parsed.epoch_boundary(), ..Default::default() };
        let typed = |i: usize| parsed.typed(i);
        let out = engine.compact(&View { messages: &raw, tools: None, typed: Some(&typed) }, &options, &QuarterCounter);
        let mut messages = out.prefix.clone();
        messages.extend(raw[out.boundary..].iter().map(|m| (*m).to_owned()));
        (messages, out.boundary)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn writing_back_untouched_messages_gives_the_input_bytes(body in request()) {
            let parsed = MessagesBody::parse(body.as_bytes()).unwrap();
            crate::wire::assert_typed_as_read(&parsed);
            let messages: Vec<String> = parsed.messages().into_iter().map(str::to_owned).collect();
            let from_text: Vec<_> = messages.iter().map(|m| Skeleton::of(m)).collect();
            prop_assert_eq!(neutral_skeletons(&parsed.turns.iter().collect::<Vec<_>>(), parsed.has_system).0, from_text);
            prop_assert_eq!(parsed.marks(), cache::marks(&serde_json::from_str(&body).unwrap()));
            for turn in parsed.turns.iter().filter(|t| t.role == "assistant") {
                let texts = turn.blocks.iter().filter(|b| b.kind == Kind::Text).map(|b| b.raw);
                let read_back = Message::from_raw(&assistant_draft(&turn.blocks).write()).unwrap().text();
                prop_assert_eq!(crate::neutral::parts_text(texts), read_back);
            }
            prop_assert_eq!(write_by_hand(&parsed, &refs(&messages)).unwrap().0, body.into_bytes());
        }

        #[test]
        fn compaction_keeps_pairing_user_text_system_tail_thinking_and_marks(body in request(), target in 50u64..2000) {
            let parsed = MessagesBody::parse(body.as_bytes()).unwrap();
            prop_assert!(parsed.check().is_ok());
            let engine = Engine::default_pack();
            let (messages, boundary) = forwarded(&engine, &parsed, Some(target));
            let (bytes, _) = write_by_hand(&parsed, &refs(&messages)).map_err(|e| TestCaseError::fail(format!("{e}")))?;
            let fwd = MessagesBody::parse(&bytes).unwrap();
            prop_assert!(fwd.check().is_ok(), "{:?}", fwd.check());
            let (raw_v, fwd_v): (Value, Value) = (serde_json::from_str(&body).unwrap(), serde_json::from_slice(&bytes).unwrap());
            for key in ["system", "tools", "model", "max_tokens"] {
                prop_assert_eq!(&raw_v[key], &fwd_v[key]);
            }
            let raw_turns = &parsed.split.elements;
            let fwd_turns = &fwd.split.elements;
            let persons = |role: &str, b: &Value| role == "user" && b["type"] != "tool_result";
            let fwd_persons = blocks_of(fwd_turns, persons);
            for block in blocks_of(raw_turns, persons) {
                prop_assert!(fwd_persons.contains(&block), "the person's block lost: {}", block);
            }
            let thinking = |_: &str, b: &Value| matches!(b["type"].as_str(), Some("thinking" | "redacted_thinking"));
            let raw_thinking = blocks_of(raw_turns, thinking);
            for block in blocks_of(fwd_turns, thinking) {
                prop_assert!(raw_thinking.contains(&block), "a thinking block changed: {}", block);
            }
            // An assistant turn still there (by its first tool_use) has all its thinking blocks.
            for raw_turn in raw_turns.iter().filter(|t| t.contains("\"tool_use\"")) {
                let raw_turn: Value = serde_json::from_str(raw_turn).unwrap();
                let blocks = raw_turn["content"].as_array().unwrap();
                let id = blocks.iter().find(|b| b["type"] == "tool_use").unwrap()["id"].clone();
                let kept = fwd_v["messages"].as_array().unwrap().iter().find(|t| {
                    t["content"].as_array().is_some_and(|c| c.iter().any(|b| b["type"] == "tool_use" && b["id"] == id))
                });
                if let Some(kept) = kept {
                    let n_thinking = |blocks: &[Value]| blocks.iter().filter(|b| b["type"].as_str().is_some_and(|t| t.contains("thinking"))).count();
                    prop_assert_eq!(n_thinking(blocks), n_thinking(kept["content"].as_array().unwrap()));
                }
            }
            // Marks: never more, never more than 4, in the agent's order of ttls (1h before 5m).
            let (raw_marks, fwd_marks) = (cache::marks(&raw_v), cache::marks(&fwd_v));
            prop_assert!(fwd_marks.len() <= raw_marks.len() && fwd_marks.len() <= 4);
            prop_assert!(fwd_marks.windows(2).all(|w| w[0].place < w[1].place));
            let long = |m: &cache::Mark| m.value.get("ttl").is_some();
            prop_assert!(fwd_marks.windows(2).all(|w| long(&w[0]) || !long(&w[1])), "a 1h mark after a 5m one");
            // The protected tail: the raw turns from the tail's first turn on, byte for byte.
            let first = parsed.first_turn_message();
            if let Some(unit) = parsed.units.get(boundary.saturating_sub(first)).filter(|_| boundary >= first) {
                let t = unit.turn();
                let starts_turn = parsed.units.iter().position(|u| u.turn() == t) == Some(boundary - first);
                if starts_turn {
                    let tail = &raw_turns[t..];
                    prop_assert_eq!(&fwd_turns[fwd_turns.len() - tail.len()..], tail);
                }
            }
            // Compacting the forwarded request again changes nothing.
            let (again, _) = forwarded(&engine, &fwd, None);
            let (again_bytes, _) = write_by_hand(&fwd, &refs(&again)).unwrap();
            prop_assert_eq!(again_bytes, bytes);
        }
    }
}

/// The forwarded messages as [`WireBody::write`] takes them.
fn refs(messages: &[String]) -> Vec<&str> {
    messages.iter().map(String::as_str).collect()
}
