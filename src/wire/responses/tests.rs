//! Tests of the Responses adapter: round trips, the neutral view, write-back and its checks.

use super::*;
use crate::compact::validate::Violation;
use crate::wire::{Forward, WrittenReads, write_by_hand};

/// A Codex-shaped request: instructions, a developer and a user message, reasoning before calls,
/// a custom tool call, a local shell call, a compaction item and an unknown item.
const CODEX: &str = r#"{"model":"gpt-5-codex","instructions":"You are Codex.","input":[{"type":"message","role":"developer","content":[{"type":"input_text","text":"sandbox: workspace-write"}]},{"type":"message","role":"user","content":[{"type":"input_text","text":"fix the test"}]},{"type":"reasoning","id":"rs_1","summary":[],"encrypted_content":"gAAAA1"},{"type":"function_call","id":"fc_1","call_id":"call_1","name":"shell","arguments":"{\"command\":[\"cat\",\"src/lib.rs\"]}"},{"type":"function_call_output","call_id":"call_1","output":"fn main() {}\n"},{"type":"reasoning","id":"rs_2","summary":[{"type":"summary_text","text":"patch"}],"encrypted_content":"gAAAA2"},{"type":"message","role":"assistant","content":[{"type":"output_text","text":"Patching."}]},{"type":"custom_tool_call","call_id":"call_2","name":"apply_patch","input":"*** Begin Patch\n*** End Patch"},{"type":"custom_tool_call_output","call_id":"call_2","output":"Done!"},{"type":"local_shell_call","id":"ls_1","call_id":"call_3","status":"completed","action":{"type":"exec","command":["ls"]}},{"type":"local_shell_call_output","call_id":"call_3","output":"a\nb"},{"type":"compaction","encrypted_content":"opaque"},{"type":"web_search_call","id":"ws_1","status":"completed"},{"role":"user","content":"thanks"}],"tools":[{"type":"function","name":"shell","parameters":{}}],"stream":true,"store":false,"max_output_tokens":1234}"#;

fn parse(body: &str) -> ResponsesBody<'_> {
    ResponsesBody::parse(body.as_bytes()).unwrap()
}

#[test]
fn writing_the_neutral_messages_back_unchanged_gives_the_input_bytes() {
    for body in [
        CODEX,
        r#"{"input":[],"model":"m"}"#,
        r#"{"model":"m","input":[{"role":"user","content":"hi"}],"previous_response_id":"resp_1"}"#,
        r#"{"instructions":"x","input":[ {"type":"message","role":"user","content":"a"} , {"type":"x"} ],"z":{"k":1}}"#,
    ] {
        let parsed = parse(body);
        crate::wire::assert_typed_as_read(&parsed);
        let messages: Vec<String> = parsed.messages().into_iter().map(str::to_owned).collect();
        let (bytes, spans) = write_by_hand(&parsed, &refs(&messages)).unwrap();
        assert_eq!(String::from_utf8(bytes.clone()).unwrap(), body);
        assert_eq!(ResponsesBody::parse(&bytes).unwrap().spans_in(&bytes), Some(spans));
    }
}

#[test]
fn items_read_into_turns_paired_by_call_id() {
    let parsed = parse(CODEX);
    let messages = parsed.messages();
    let roles: Vec<String> = messages.iter().map(|m| crate::neutral::role_of(m).into_owned()).collect();
    // The neutral messages name no items: what each forwarded message stands for is the plan's.
    assert!(messages.iter().all(|m| !m.contains("pare_items")), "{messages:?}");
    assert_eq!(
        roles,
        ["system", "developer", "user", "assistant", "tool", "assistant", "tool", "assistant", "tool", "", "", "user"]
    );
    // What pare does not read is carried as the items themselves, in an array: no role of pare's.
    let item = |n: usize| serde_json::to_string(&serde_json::from_str::<Value>(CODEX).unwrap()["input"][n]).unwrap();
    assert_eq!(messages[9], format!("[{}]", item(11)));
    assert_eq!(messages[10], format!("[{}]", item(12)));
    let turn: Value = serde_json::from_str(messages[5]).unwrap();
    assert_eq!(turn["content"][0]["text"], "Patching.");
    assert_eq!(turn["tool_calls"][0]["id"], "call_2");
    assert_eq!(turn["tool_calls"][0]["function"]["arguments"], "*** Begin Patch\n*** End Patch");
    let shell: Value = serde_json::from_str(messages[7]).unwrap();
    assert_eq!(shell["tool_calls"][0]["function"]["name"], "local_shell");
    assert_eq!(parsed.output_limit(), Some(1234));
    assert!(parsed.stream());
    assert_eq!(parsed.tools(), Some(r#"[{"type":"function","name":"shell","parameters":{}}]"#));
    // The neutral form passes the engine's pairing check.
    let skeletons: Vec<_> = messages.iter().map(|m| crate::compact::validate::Skeleton::of(m)).collect();
    assert!(crate::compact::validate::check(&skeletons).is_ok());
}

/// A compaction item (under each name the server and Codex use) is an opaque message that is the
/// request's hard epoch boundary; the neutral form carries no key of pare's for it.
#[test]
fn compaction_items_are_marked_as_epoch_boundaries() {
    let parsed = parse(CODEX);
    assert_eq!(parsed.epoch_boundary(), Some(9));
    assert!(parsed.messages().iter().all(|m| !m.contains("pare_")));
    assert!(crate::neutral::is_opaque(parsed.messages()[9]));
    assert!(parsed.messages()[9].contains(r#""type":"compaction""#));
    for kind in COMPACTION_ITEMS {
        let body = format!(
            r#"{{"input":[{{"role":"user","content":"a"}},{{"type":"reasoning","id":"rs","summary":[],"encrypted_content":"e"}},{{"type":"{kind}","id":"cmp_1","encrypted_content":"x"}},{{"role":"user","content":"b"}}]}}"#
        );
        let parsed = parse(&body);
        let messages = parsed.messages();
        assert!(Message::from_raw(messages[1]).is_err(), "{kind}: an opaque entry is no message");
        assert!(crate::neutral::is_opaque(messages[1]), "{kind}");
        assert_eq!(parsed.epoch_boundary(), Some(1), "{kind}");
        let owned: Vec<String> = messages.iter().map(|m| (*m).to_owned()).collect();
        assert_eq!(write_by_hand(&parsed, &refs(&owned)).unwrap().0, body.as_bytes(), "written back as sent");
    }
}

#[test]
fn a_rewritten_output_and_arguments_keep_every_other_byte() {
    let parsed = parse(CODEX);
    let mut messages: Vec<String> = parsed.messages().into_iter().map(str::to_owned).collect();
    messages[4] = messages[4].replace(r#""fn main() {}\n""#, r#""[tool: cat → ok]""#);
    messages[3] = messages[3].replace(r#"[\"cat\",\"src/lib.rs\"]"#, r#"[\"cat\"]"#);
    let (bytes, _) = write_by_hand(&parsed, &refs(&messages)).unwrap();
    let out: Value = serde_json::from_slice(&bytes).unwrap();
    let input: Value = serde_json::from_str(CODEX).unwrap();
    assert_eq!(out["input"][4]["output"], "[tool: cat → ok]");
    assert_eq!(out["input"][3]["arguments"], r#"{"command":["cat"]}"#);
    assert_eq!(out["input"][2], input["input"][2], "the reasoning item before the call is kept");
    for k in [0, 1, 5, 6, 7, 8, 9, 10, 11, 12, 13] {
        assert_eq!(out["input"][k], input["input"][k], "item {k}");
    }
    let text = String::from_utf8(bytes).unwrap();
    assert!(text.contains(r#"{"type":"reasoning","id":"rs_1","summary":[],"encrypted_content":"gAAAA1"}"#));
    assert!(text.starts_with(r#"{"model":"gpt-5-codex","instructions":"You are Codex.","input":["#));
}

#[test]
fn an_elided_turn_takes_its_reasoning_and_a_marker_becomes_a_message_item() {
    let parsed = parse(CODEX);
    let messages: Vec<String> = parsed.messages().into_iter().map(str::to_owned).collect();
    let marker = r#"{"role":"assistant","content":"[pare: 2 earlier messages elided]"}"#.to_owned();
    let mut forwarded = messages[..3].to_vec();
    forwarded.push(marker);
    forwarded.extend(messages[5..].iter().cloned());
    let (bytes, _) = write_by_hand(&parsed, &refs(&forwarded)).unwrap();
    let out: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(
        out["input"][2],
        serde_json::json!({"type":"message","role":"assistant","content":"[pare: 2 earlier messages elided]"})
    );
    assert_eq!(out["input"][3]["id"], "rs_2");
    assert!(!String::from_utf8(bytes).unwrap().contains("rs_1"));
}

/// A rewritten developer message keeps its item (and the reasoning before it); a tool message that
/// names no item cannot be written.
#[test]
fn a_rewritten_message_keeps_its_item_and_a_new_tool_message_is_refused() {
    let parsed = parse(CODEX);
    let mut messages: Vec<String> = parsed.messages().into_iter().map(str::to_owned).collect();
    messages[1] = messages[1]
        .replace(r#"[{"type":"input_text","text":"sandbox: workspace-write"}]"#, r#""[system prompt: sandbox]""#);
    let (bytes, _) = write_by_hand(&parsed, &refs(&messages)).unwrap();
    let out: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(
        out["input"][0],
        serde_json::json!({"type":"message","role":"developer","content":"[system prompt: sandbox]"})
    );
    // A tool message that stands for none of the request's messages has no item to be written as.
    messages[4] = r#"{"role":"tool","tool_call_id":"call_1","content":"x"}"#.to_owned();
    let reads = WrittenReads::new(messages.len());
    let mut entries = crate::wire::forward_by_hand(&parsed.messages(), &refs(&messages), &reads);
    let Forward::Rewritten(4, written) = entries[4] else { panic!("{:?}", entries[4]) };
    assert!(parsed.write(&entries).is_ok());
    entries[4] = Forward::New(written);
    assert!(matches!(parsed.write(&entries), Err(WireError::Unwritable(_))));
}

#[test]
fn a_write_that_breaks_pairing_or_instructions_is_refused() {
    let parsed = parse(CODEX);
    let messages: Vec<String> = parsed.messages().into_iter().map(str::to_owned).collect();
    // The call turn without its output.
    let mut orphan = messages.clone();
    orphan.remove(4);
    let unanswered = Violation::Unanswered { call_idx: 3, id: "call_1".into(), idx: 4 };
    assert_eq!(write_by_hand(&parsed, &refs(&orphan)).unwrap_err().to_string(), format!("item 3: {unanswered}"));
    assert!(matches!(
        write_by_hand(&parsed, &refs(&orphan)),
        Err(WireError::Invalid(Invalid::Pairing { violation, origin: Some(Origin::Item(3)) })) if violation == unanswered
    ));
    // The output without its call turn.
    let mut no_call = messages.clone();
    no_call.remove(3);
    assert!(matches!(
        write_by_hand(&parsed, &refs(&no_call)),
        Err(WireError::Invalid(Invalid::Pairing {
            violation: Violation::OrphanResult { idx: 3, .. },
            origin: Some(Origin::Item(2))
        }))
    ));
    let mut instructions = messages.clone();
    instructions[0] = r#"{"role":"system","content":"other"}"#.to_owned();
    assert!(matches!(write_by_hand(&parsed, &refs(&instructions)), Err(WireError::Unwritable(_))));
    // An opaque message the engine made up has no item.
    let mut made_up = messages.clone();
    made_up.insert(2, r#"[{"type":"reasoning","id":"rs_9"}]"#.to_owned());
    assert!(matches!(write_by_hand(&parsed, &refs(&made_up)), Err(WireError::Unwritable(_))));
}

/// The pairing of `items`' neutral view, or the structural rule, that `check_items` refuses.
fn refusal(items: &[&str]) -> Option<Invalid> {
    check_items(items).err()
}

fn pairing(violation: Violation, item: usize) -> Option<Invalid> {
    Some(Invalid::Pairing { violation, origin: Some(Origin::Item(item)) })
}

#[test]
fn check_items_pairs_calls_through_the_neutral_view() {
    let call = r#"{"type":"function_call","call_id":"a","name":"f","arguments":"{}"}"#;
    let out = r#"{"type":"function_call_output","call_id":"a","output":"x"}"#;
    let reasoning = r#"{"type":"reasoning","encrypted_content":"e"}"#;
    let user = r#"{"type":"message","role":"user","content":"u"}"#;
    let a = || "a".to_owned();
    assert_eq!(refusal(&[user, reasoning, call, out]), None);
    assert_eq!(refusal(&[user, call]), pairing(Violation::Unanswered { call_idx: 1, id: a(), idx: 2 }, 1));
    assert_eq!(refusal(&[out, call]), pairing(Violation::OrphanResult { idx: 0, id: a() }, 0));
    assert_eq!(refusal(&[call, out, out]), pairing(Violation::OrphanResult { idx: 2, id: a() }, 2));
    // Parallel calls are one assistant message: a repeated id is a duplicate in it.
    assert_eq!(refusal(&[call, call, out]), pairing(Violation::DuplicateCallId { idx: 0, id: a() }, 0));
    // An id answered may be used again (agents reuse ids across turns).
    assert_eq!(refusal(&[call, out, user, call, out]), None);
    let nameless = r#"{"type":"function_call","call_id":"","name":"f","arguments":"{}"}"#;
    assert_eq!(refusal(&[user, nameless]), pairing(Violation::EmptyCallId { idx: 1 }, 1));
    // The outputs answer their calls right after them, as the neutral form (and Chat Completions)
    // reads a call turn: an item between them leaves the call unanswered.
    assert_eq!(refusal(&[call, user, out]), pairing(Violation::Unanswered { call_idx: 0, id: a(), idx: 1 }, 0));
    // The message names the item and the id.
    assert_eq!(
        refusal(&[user, out]).unwrap().to_string(),
        "item 1: tool message 1 answers `a`, which is not an open call"
    );
}

#[test]
fn a_reasoning_item_must_be_followed_by_its_item() {
    let call = r#"{"type":"function_call","call_id":"a","name":"f","arguments":"{}"}"#;
    let out = r#"{"type":"function_call_output","call_id":"a","output":"x"}"#;
    let reasoning = r#"{"type":"reasoning","encrypted_content":"e"}"#;
    let user = r#"{"type":"message","role":"user","content":"u"}"#;
    let reasoning_at = |idx| Some(Invalid::Responses(Structure::ReasoningWithoutItem { idx }));
    assert_eq!(refusal(&[user, reasoning]), reasoning_at(1));
    // The pairing holds (the output answers the call right before it), the reasoning has no item.
    assert_eq!(refusal(&[call, reasoning, out]), reasoning_at(1));
    assert_eq!(refusal(&[user, reasoning, reasoning, call, out]), None);
    assert_eq!(refusal(&[user, reasoning]).unwrap().to_string(), "reasoning item 1 is not followed by its item");
}

/// The pairing check reads the neutral messages the adapter hands the engine: the skeletons built
/// from the items are those of [`WireBody::messages`].
#[test]
fn the_checked_skeletons_are_those_of_the_neutral_messages() {
    for body in [
        CODEX,
        r#"{"input":[{"type":"reasoning"},{"type":"x"},{"role":"tool"},{"type":"function_call_output","call_id":"z"}]}"#,
    ] {
        let parsed = parse(body);
        let from_text: Vec<_> = parsed.messages().iter().map(|m| Skeleton::of(m)).collect();
        assert_eq!(
            neutral_skeletons(&parsed.items.iter().collect::<Vec<_>>(), parsed.has_instructions).0,
            from_text,
            "{body}"
        );
    }
}

#[test]
fn a_string_input_is_one_user_message_forwarded_as_sent() {
    let body = r#"{"model":"m","instructions":"be brief","input":"hello"}"#;
    let parsed = parse(body);
    assert_eq!(
        parsed.messages(),
        [r#"{"role":"system","content":"be brief"}"#, r#"{"role":"user","content":"hello"}"#]
    );
    assert!(write_by_hand(&parsed, &[]).is_err());
    assert!(ResponsesBody::parse(br#"{"model":"m"}"#).is_err());
    assert!(ResponsesBody::parse(br#"{"input":3}"#).is_err());
    assert!(ResponsesBody::parse(b"{nope").is_err());
}

mod properties {
    use proptest::prelude::*;
    use serde_json::json;

    use super::*;
    use crate::compact::{CompactOptions, Engine};
    use crate::neutral::View;
    use crate::tokens::QuarterCounter;

    /// One turn of an agent: a user message, an assistant text, a call turn (with or without
    /// reasoning, one to three parallel calls of the three call kinds, answered), or an opaque item.
    fn turn(k: usize) -> impl Strategy<Value = Vec<Value>> {
        let text = "[a-z ]{0,40}( line\n[a-z/._ ]{0,30}){0,30}";
        prop_oneof![
            text.prop_map(|t| vec![json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": t}]})]),
            (text, any::<bool>()).prop_map(move |(t, reasoning)| {
                let mut items = Vec::new();
                if reasoning {
                    items.push(json!({"type": "reasoning", "id": format!("rs_{k}"), "summary": [], "encrypted_content": format!("enc{k}")}));
                }
                items.push(json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": t}]}));
                items
            }),
            (prop::collection::vec((0u8..3, text), 1..4), any::<bool>(), any::<bool>()).prop_map(move |(calls, reasoning, fail)| {
                let mut items = Vec::new();
                if reasoning {
                    items.push(json!({"type": "reasoning", "id": format!("rs_{k}"), "summary": [], "encrypted_content": format!("enc{k}")}));
                }
                let mut outputs = Vec::new();
                for (n, (kind, output)) in calls.into_iter().enumerate() {
                    let id = format!("call_{k}_{n}");
                    let (call, out_type) = match kind {
                        0 => (json!({"type": "function_call", "call_id": id, "name": "read_file", "arguments": json!({"path": format!("src/f{k}.rs"), "long": output.clone()}).to_string()}), "function_call_output"),
                        1 => (json!({"type": "custom_tool_call", "call_id": id, "name": "apply_patch", "input": output.clone()}), "custom_tool_call_output"),
                        _ => (json!({"type": "local_shell_call", "call_id": id, "id": format!("ls_{k}"), "status": "completed", "action": {"type": "exec", "command": ["ls"]}}), "local_shell_call_output"),
                    };
                    items.push(call);
                    let output = if fail { format!("Error: {output}") } else { output };
                    outputs.push(json!({"type": out_type, "call_id": id, "output": output}));
                }
                items.extend(outputs);
                items
            }),
            Just(vec![json!({"type": "compaction", "encrypted_content": format!("cmp{k}")})]),
        ]
    }

    fn request() -> impl Strategy<Value = String> {
        (prop::collection::vec(any::<prop::sample::Index>(), 1..14), any::<bool>()).prop_flat_map(
            |(turns, instructions)| {
                let turns: Vec<_> = (0..turns.len()).map(turn).collect();
                turns.prop_map(move |turns| {
                    let mut body = json!({"model": "m"});
                    if instructions {
                        body["instructions"] = json!("You are an agent.");
                    }
                    body["input"] = Value::Array(turns.into_iter().flatten().collect());
                    body["store"] = json!(false);
                    body.to_string()
                })
            },
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn writing_back_untouched_messages_gives_the_input_bytes(body in request()) {
            let parsed = ResponsesBody::parse(body.as_bytes()).unwrap();
            crate::wire::assert_typed_as_read(&parsed);
            let read: Vec<serde_json::Value> =
                parsed.messages().iter().filter_map(|m| serde_json::from_str(m).ok()).collect();
            prop_assert_eq!(parsed.neutral_values(), read);
            let messages: Vec<String> = parsed.messages().into_iter().map(str::to_owned).collect();
            let from_text: Vec<_> = messages.iter().map(|m| Skeleton::of(m)).collect();
            prop_assert_eq!(neutral_skeletons(&parsed.items.iter().collect::<Vec<_>>(), parsed.has_instructions).0, from_text);
            prop_assert_eq!(write_by_hand(&parsed, &refs(&messages)).unwrap().0, body.into_bytes());
        }

        #[test]
        fn compaction_keeps_pairing_users_instructions_tail_and_reasoning_bytes(body in request(), target in 50u64..2000) {
            let parsed = ResponsesBody::parse(body.as_bytes()).unwrap();
            let raw = parsed.messages();
            let engine = Engine::default_pack();
            let options =
                CompactOptions { target_tokens: Some(target), epoch_boundary: parsed.epoch_boundary(), ..Default::default() };
            let typed = |i: usize| parsed.typed(i);
            let out = engine.compact(&View { messages: &raw, tools: None, typed: Some(&typed) }, &options, &QuarterCounter);
            let mut messages = out.prefix.clone();
            messages.extend(raw[out.boundary..].iter().map(|m| (*m).to_owned()));
            let Ok((bytes, _)) = write_by_hand(&parsed, &refs(&messages)) else {
                // Only a conversation the engine left invalid (never) or an input the API would refuse.
                prop_assert!(parsed.check().is_err(), "a valid request could not be written back");
                return Ok(());
            };
            let forwarded = ResponsesBody::parse(&bytes).unwrap();
            prop_assert!(forwarded.check().is_ok(), "{:?}", forwarded.check());
            let (raw_v, fwd_v): (Value, Value) = (serde_json::from_str(&body).unwrap(), serde_json::from_slice(&bytes).unwrap());
            prop_assert_eq!(&raw_v["instructions"], &fwd_v["instructions"]);
            let raw_items = parsed.items();
            let fwd_items = forwarded.items();
            for item in raw_items.iter().filter(|i| i.contains(r#""role":"user""#)) {
                prop_assert!(fwd_items.contains(item), "user item lost: {}", item);
            }
            for item in fwd_items.iter().filter(|i| i.contains(r#""type":"reasoning""#)) {
                prop_assert!(raw_items.contains(item), "reasoning item changed: {}", item);
            }
            // Everything up to the last compaction item goes as sent: the server reads the item in
            // place of all of it.
            if let Some(last) = raw_items.iter().rposition(|i| i.contains(r#""type":"compaction""#)) {
                prop_assert_eq!(&fwd_items[..=last], &raw_items[..=last]);
            }
            let first_tail_item = parsed.ranges.get(out.boundary.saturating_sub(parsed.first_item_message())).map(|r| r.0);
            if let Some(start) = first_tail_item {
                let tail = &raw_items[start..];
                prop_assert_eq!(&fwd_items[fwd_items.len() - tail.len()..], tail);
            }
            // Compacting the forwarded request again changes nothing.
            let again_raw = forwarded.messages();
            let again_options = CompactOptions { epoch_boundary: forwarded.epoch_boundary(), ..Default::default() };
            let again_typed = |i: usize| forwarded.typed(i);
            let again = engine.compact(&View { messages: &again_raw, tools: None, typed: Some(&again_typed) }, &again_options, &QuarterCounter);
            let mut again_messages = again.prefix.clone();
            again_messages.extend(again_raw[again.boundary..].iter().map(|m| (*m).to_owned()));
            prop_assert_eq!(again_messages, again_raw.iter().map(|m| (*m).to_owned()).collect::<Vec<_>>());
        }
    }
}

/// The forwarded messages as [`WireBody::write`] takes them.
fn refs(messages: &[String]) -> Vec<&str> {
    messages.iter().map(String::as_str).collect()
}
