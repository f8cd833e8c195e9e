//! Tests of the Gemini adapter: round trips, the neutral view, pairing, signatures, write-back and checks.

use crate::wire::{Forward, WrittenReads, write_by_hand};
use serde_json::json;

use super::*;
use crate::compact::validate::Violation;

/// A Gemini CLI-shaped request: a system instruction, the person's text with an image, a model
/// turn with a thought, signed text and two calls (the first signed, no ids: the Gemini API sends
/// none), their responses (in the other order, the CLI's ids that name no call) beside the
/// person's text, a call with an id answered by id, and a code execution part.
const GEMINI_CLI: &str = r#"{"contents":[{"role":"user","parts":[{"text":"This is the Gemini CLI. Fix the build."},{"inlineData":{"mimeType":"image/png","data":"iVBORw0KGgo="}}]},{"role":"model","parts":[{"text":"**Planning**","thought":true},{"text":"Reading both.","thoughtSignature":"c2lnLXRleHQ="},{"functionCall":{"name":"read_file","args":{"absolute_path":"/src/main.rs"}},"thoughtSignature":"Q2lRQlZLaE"},{"functionCall":{"name":"run_shell_command","args":{"command":"cargo build 2>&1","description":"Build"}}}]},{"role":"user","parts":[{"functionResponse":{"id":"run_shell_command-17-a","name":"run_shell_command","response":{"output":"error[E0425]: cannot find function `run`"}}},{"functionResponse":{"id":"read_file-17-b","name":"read_file","response":{"output":"fn main() {\n    run();\n}\n"}}},{"text":"also check lib.rs"}]},{"role":"model","parts":[{"functionCall":{"id":"fc_9","name":"search_file_content","args":{"pattern":"fn run"}}}]},{"role":"user","parts":[{"functionResponse":{"id":"fc_9","name":"search_file_content","response":{"matches":[{"file":"src/lib.rs","line":12}],"count":1}}}]},{"role":"model","parts":[{"executableCode":{"language":"PYTHON","code":"print(1)"}},{"text":"Found it."}]},{"role":"user","parts":[{"text":"go on"}]}],"systemInstruction":{"role":"user","parts":[{"text":"You are an interactive CLI agent."}]},"tools":[{"functionDeclarations":[{"name":"read_file","parametersJsonSchema":{"type":"object"}}]}],"generationConfig":{"temperature":0,"maxOutputTokens":8192,"thinkingConfig":{"includeThoughts":true}}}"#;

fn parse(body: &str) -> GeminiBody<'_> {
    GeminiBody::parse_at(body.as_bytes(), Call::of_path("/v1beta/models/gemini-2.5-pro:streamGenerateContent")).unwrap()
}

fn neutral(parsed: &GeminiBody<'_>) -> Vec<String> {
    parsed.messages().into_iter().map(str::to_owned).collect()
}

fn refs(messages: &[String]) -> Vec<&str> {
    messages.iter().map(String::as_str).collect()
}

fn written(parsed: &GeminiBody<'_>, messages: &[String]) -> Value {
    serde_json::from_slice(&write_by_hand(parsed, &refs(messages)).unwrap().0).unwrap()
}

#[test]
fn the_path_names_the_model_and_the_stream() {
    assert_eq!(
        Call::of_path("/v1beta/models/gemini-2.5-pro:streamGenerateContent"),
        Call { model: Some("gemini-2.5-pro".into()), stream: true }
    );
    assert_eq!(
        Call::of_path("/v1/models/gemini-3-pro-preview:generateContent"),
        Call { model: Some("gemini-3-pro-preview".into()), stream: false }
    );
    // A body read without its path (`wire::parse`) says neither.
    assert_eq!(Call::of_path(""), Call::default());
    for (path, generation) in [
        ("/v1beta/models/gemini-2.5-flash:generateContent", true),
        ("/v1/models/gemini-2.5-flash:streamGenerateContent", true),
        ("/v1/projects/p/locations/us/publishers/google/models/gemini-2.5-pro:generateContent", true),
        ("/v1beta/models/gemini-2.5-flash:countTokens", false),
        ("/v1beta/models/gemini-2.5-flash", false),
        ("/v1beta/models/:generateContent", false),
        ("/v1/chat/completions", false),
    ] {
        assert_eq!(Call::is_generation(path), generation, "{path}");
        assert_eq!(Wire::of_path(path) == Some(Wire::Gemini), generation, "{path}");
    }
    let parsed = parse(GEMINI_CLI);
    assert_eq!(parsed.model().as_deref(), Some("gemini-2.5-pro"));
    assert!(parsed.stream());
    assert_eq!(parsed.output_limit(), Some(8192));
    assert!(parsed.tools().unwrap().contains("functionDeclarations"));
    assert_eq!(GeminiBody::parse(GEMINI_CLI.as_bytes()).unwrap().model(), None);
}

#[test]
fn writing_the_neutral_messages_back_unchanged_gives_the_input_bytes() {
    for body in [
        GEMINI_CLI,
        r#"{"contents":[]}"#,
        r#"{"contents":[{"parts":[{"text":"hi"}]}],"system_instruction":{"parts":[{"text":"Be brief."}]}}"#,
        r#"{"contents":[ {"role":"user","parts":[]} , {"role":"narrator","parts":"x"}, 7 ],"z":{"k":1}}"#,
        // An invalid history (a response without its call) goes as it came when nothing changed.
        r#"{"contents":[{"role":"user","parts":[{"functionResponse":{"name":"f","response":{}}}]}]}"#,
    ] {
        let parsed = parse(body);
        let (bytes, spans) = write_by_hand(&parsed, &refs(&neutral(&parsed))).unwrap();
        assert_eq!(String::from_utf8(bytes.clone()).unwrap(), body);
        assert_eq!(GeminiBody::parse(&bytes).unwrap().spans_in(&bytes), Some(spans));
    }
}

#[test]
fn turns_read_into_neutral_messages_paired_by_id_else_by_name_in_order() {
    let parsed = parse(GEMINI_CLI);
    let messages: Vec<Value> = parsed.messages().iter().map(|m| serde_json::from_str(m).unwrap()).collect();
    let roles: Vec<&str> = messages.iter().map(|m| m["role"].as_str().unwrap()).collect();
    assert_eq!(
        roles,
        ["system", "user", "assistant", "tool", "tool", "user", "assistant", "tool", "assistant", "user"]
    );
    assert_eq!(messages[0]["content"], json!([{"text": "You are an interactive CLI agent."}]));
    // The thought is not in the neutral form; the signed text is; calls without ids are named by place.
    assert_eq!(messages[2]["content"], json!([{"text": "Reading both.", "thoughtSignature": "c2lnLXRleHQ="}]));
    assert_eq!(messages[2]["tool_calls"][0]["id"], "call_0");
    assert_eq!(messages[2]["tool_calls"][1]["id"], "call_1");
    assert_eq!(
        messages[2]["tool_calls"][1]["function"]["arguments"],
        r#"{"command":"cargo build 2>&1","description":"Build"}"#
    );
    // The CLI's response ids name no call: the responses pair by name, whatever their order.
    assert_eq!(messages[3]["tool_call_id"], "call_1");
    assert_eq!(messages[3]["content"], "error[E0425]: cannot find function `run`");
    assert_eq!(messages[4]["tool_call_id"], "call_0");
    assert_eq!(messages[5]["content"], json!([{"text": "also check lib.rs"}]));
    // A call with an id is answered by id (and named by its place, as the answer that carried it
    // without an id); a response of several members reads as its JSON.
    assert_eq!(messages[6]["tool_calls"][0]["id"], "call_0");
    assert_eq!(messages[7]["tool_call_id"], "call_0");
    assert_eq!(messages[7]["content"], r#"{"matches":[{"file":"src/lib.rs","line":12}],"count":1}"#);
    assert_eq!(messages[8], json!({"role": "assistant", "content": [{"text": "Found it."}]}));
    let skeletons: Vec<_> = parsed.messages().iter().map(|m| crate::compact::validate::Skeleton::of(m)).collect();
    assert!(crate::compact::validate::check(&skeletons).is_ok());
    parsed.check().unwrap();
}

#[test]
fn a_rewritten_response_and_unsigned_args_keep_every_other_byte() {
    let parsed = parse(GEMINI_CLI);
    let mut messages = neutral(&parsed);
    messages[3] = r#"{"role":"tool","tool_call_id":"call_1","content":"error[E0425]"}"#.to_owned();
    messages[7] = r#"{"role":"tool","tool_call_id":"call_0","content":"[1 match]"}"#.to_owned();
    messages[2] = messages[2].replace("cargo build 2>&1", "cargo").replace("/src/main.rs", "/x");
    let out = written(&parsed, &messages);
    let input: Value = serde_json::from_str(GEMINI_CLI).unwrap();
    let results = &out["contents"][2]["parts"];
    assert_eq!(
        results[0],
        json!({"functionResponse": {"id": "run_shell_command-17-a", "name": "run_shell_command", "response": {"output": "error[E0425]"}}})
    );
    assert_eq!(results[1], input["contents"][2]["parts"][1]);
    assert_eq!(results[2], input["contents"][2]["parts"][2], "the person's text");
    assert_eq!(out["contents"][4]["parts"][0]["functionResponse"]["response"], json!({"output": "[1 match]"}));
    let turn = &out["contents"][1]["parts"];
    assert_eq!(turn[0], input["contents"][1]["parts"][0], "the thought, byte for byte");
    assert_eq!(turn[2], input["contents"][1]["parts"][2], "a signed call keeps its args");
    assert_eq!(turn[3]["functionCall"]["args"], json!({"command": "cargo", "description": "Build"}));
    for key in ["systemInstruction", "tools", "generationConfig"] {
        assert_eq!(out[key], input[key]);
    }
    check_turns(&out["contents"].as_array().unwrap().iter().map(Value::to_string).collect::<Vec<_>>()).unwrap();
}

#[test]
fn a_response_text_is_compared_without_decoding_only_when_it_is_surely_shorter() {
    // Eight bytes of control characters, sent as escapes six bytes each: the most a value can be
    // longer than its text.
    let escaped = "\\u0001".repeat(8);
    let raw = format!(r#"{{"functionResponse":{{"name":"f","response":{{"output":"{escaped}"}}}}}}"#);
    let part = Part::read(&raw);
    let text = "\u{1}".repeat(8);
    assert_eq!(response_text(&part), text);
    assert!(is_response_text(&part, &text));
    assert!(!is_response_text(&part, &text[1..]));
    assert!(!is_response_text(&part, "\u{1}\u{1}x\u{1}\u{1}\u{1}\u{1}\u{1}"));
    // A response of other members stands for its JSON text.
    let raw = r#"{"functionResponse":{"name":"f","response":{"matches":[],"count":0}}}"#;
    let part = Part::read(raw);
    assert!(is_response_text(&part, r#"{"matches":[],"count":0}"#));
    assert!(!is_response_text(&part, "{}"));
}

#[test]
fn args_that_lose_keys_and_a_changed_system_instruction_are_refused() {
    let parsed = parse(GEMINI_CLI);
    let mut messages = neutral(&parsed);
    messages[2] = messages[2].replace(r#",\"description\":\"Build\""#, "");
    assert!(matches!(write_by_hand(&parsed, &refs(&messages)), Err(WireError::Unwritable(_))));
    let mut messages = neutral(&parsed);
    messages[0] = r#"{"role":"system","content":"shorter"}"#.to_owned();
    assert!(write_by_hand(&parsed, &refs(&messages)).is_err(), "the system instruction is never changed");
}

#[test]
fn an_elided_call_turn_goes_with_its_signatures_and_the_marker_is_a_user_turn_of_its_own() {
    let parsed = parse(GEMINI_CLI);
    let messages = neutral(&parsed);
    let marker =
        r#"{"role":"assistant","content":"[pare: 3 earlier messages elided — read_file ×1, run_shell_command ×1]"}"#;
    let forwarded: Vec<String> = [&messages[..2], &[marker.to_owned()], &messages[5..]].concat();
    let out = written(&parsed, &forwarded);
    let input: Value = serde_json::from_str(GEMINI_CLI).unwrap();
    let turns = out["contents"].as_array().unwrap();
    // The person's turn as sent, the marker's turn, the person's text of the results turn.
    assert_eq!(turns[0], input["contents"][0]);
    assert_eq!(
        turns[1],
        json!({"role": "user", "parts": [{"text": "[pare: 3 earlier messages elided — read_file ×1, run_shell_command ×1]"}]})
    );
    assert_eq!(turns[2], json!({"role": "user", "parts": [{"text": "also check lib.rs"}]}));
    assert_eq!(turns[3], input["contents"][3]);
    let roles: Vec<&str> = turns.iter().map(|t| t["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["user", "user", "user", "model", "user", "model", "user"]);
    let text = out.to_string();
    assert!(
        !text.contains("Q2lRQlZLaE") && !text.contains("Planning"),
        "signed and thought parts went with their turn"
    );
    check_turns(&turns.iter().map(Value::to_string).collect::<Vec<_>>()).unwrap();
    // Read again, every user message of the request is there as it was.
    let again = GeminiBody::parse(&write_by_hand(&parsed, &refs(&forwarded)).unwrap().0)
        .unwrap()
        .messages()
        .iter()
        .map(|m| (*m).to_owned())
        .collect::<Vec<_>>();
    for user in messages.iter().filter(|m| crate::neutral::role_of(m) == "user") {
        assert!(again.contains(user), "{user}");
    }
}

/// Regression: Gemini call ids are their place in the turn (`call_0` in every turn), so a rewritten
/// call turn after an elided run was traced by its id to the first elided call turn: the forwarded
/// turn had the rewritten turn's text with the elided turn's call and signature. Each forwarded
/// message is written from the turn its source names.
#[test]
fn a_rewritten_call_turn_after_an_elided_run_is_written_from_its_own_turn() {
    let body = json!({"contents": [
        {"role": "user", "parts": [{"text": "fix it"}]},
        {"role": "model", "parts": [{"text": "Looking."}, {"functionCall": {"name": "bash", "args": {"command": "find ."}}, "thoughtSignature": "c2lnLWE="}]},
        {"role": "user", "parts": [{"functionResponse": {"name": "bash", "response": {"output": "a\nb"}}}]},
        {"role": "model", "parts": [{"text": "Writing the test."}, {"functionCall": {"name": "bash", "args": {"command": "cat > t.py << EOF\nlong\nEOF"}}, "thoughtSignature": "c2lnLWI="}]},
        {"role": "user", "parts": [{"functionResponse": {"name": "bash", "response": {"output": ""}}}]},
        {"role": "user", "parts": [{"text": "go on"}]}
    ]})
    .to_string();
    let parsed = parse(&body);
    let messages = neutral(&parsed);
    assert_eq!(messages.len(), 6);
    // Messages 1–2 elided behind one marker; message 3's arguments shortened.
    let marker = r#"{"role":"assistant","content":"[pare: 2 earlier messages elided — bash ×1]"}"#.to_owned();
    let shortened = messages[3].replace(r#"long\\n"#, "");
    assert_ne!(shortened, messages[3]);
    let forwarded = [messages[0].clone(), marker, shortened, messages[4].clone(), messages[5].clone()];
    let reads = WrittenReads::new(forwarded.len());
    let entries = [
        Forward::Kept(0),
        Forward::New(reads.written(1, &forwarded[1])),
        Forward::Rewritten(3, reads.written(2, &forwarded[2])),
        Forward::Kept(4),
        Forward::Kept(5),
    ];
    let (bytes, _) = parsed.write(&entries).unwrap();
    let out: Value = serde_json::from_slice(&bytes).unwrap();
    let turn = out["contents"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t.to_string().contains("Writing the test."))
        .expect("the rewritten turn is forwarded")
        .to_string();
    assert!(turn.contains("c2lnLWI=") && turn.contains("cat > t.py"), "{turn}");
    assert!(!turn.contains("c2lnLWE=") && !turn.contains("find ."), "{turn}");
    assert!(!String::from_utf8_lossy(&bytes).contains("find ."), "the elided call is gone");
}

#[test]
fn a_response_that_loses_its_call_is_refused_by_the_pairing_check() {
    let parsed = parse(GEMINI_CLI);
    let messages = neutral(&parsed);
    // The call turn goes, one of its responses stays.
    let forwarded: Vec<String> = [&messages[..2], &messages[3..4], &messages[5..]].concat();
    assert!(matches!(
        write_by_hand(&parsed, &refs(&forwarded)),
        Err(WireError::Invalid(Invalid::Pairing {
            violation: Violation::OrphanResult { idx: 2, .. },
            origin: Some(Origin::Turn(1))
        }))
    ));
}

const Q: &str = r#"{"role":"user","parts":[{"text":"q"}]}"#;
const CALL: &str = r#"{"role":"model","parts":[{"functionCall":{"name":"f","args":{}}}]}"#;
const ANSWER: &str = r#"{"role":"user","parts":[{"functionResponse":{"name":"f","response":{}}}]}"#;
const TWO_CALLS: &str =
    r#"{"role":"model","parts":[{"functionCall":{"name":"f","args":{}}},{"functionCall":{"name":"g","args":{}}}]}"#;

fn pairing(violation: Violation, turn: usize) -> Result<(), Invalid> {
    Err(Invalid::Pairing { violation, origin: Some(Origin::Turn(turn)) })
}

fn structure(rule: Structure) -> Result<(), Invalid> {
    Err(Invalid::Gemini(rule))
}

#[test]
fn the_turn_check_pairs_calls_through_the_neutral_view() {
    assert_eq!(check_turns(&[Q, CALL, ANSWER]), Ok(()));
    let no_answer = r#"{"role":"user","parts":[{"text":"no answer"}]}"#;
    assert_eq!(
        check_turns(&[CALL, no_answer]),
        pairing(Violation::Unanswered { call_idx: 0, id: "call_0".into(), idx: 1 }, 0)
    );
    assert_eq!(check_turns(&[Q, ANSWER]), pairing(Violation::OrphanResult { idx: 1, id: "orphan_0".into() }, 1));
    // The responses go in the very next turn: the neutral mapping pairs a user turn with the model
    // turn right before it only, so a response a turn later is an orphan.
    let answer_g = r#"{"role":"user","parts":[{"functionResponse":{"name":"g","response":{}}}]}"#;
    assert_eq!(
        check_turns(&[Q, TWO_CALLS, ANSWER, answer_g]),
        pairing(Violation::OrphanResult { idx: 3, id: "orphan_0".into() }, 3)
    );
    assert_eq!(
        check_turns(&[CALL, no_answer]).unwrap_err().to_string(),
        "turn 0: tool call `call_0` of assistant message 0 has no answer before message 1"
    );
}

/// Regression: an orphan response kept its own id in the neutral view, so one whose id was a call's
/// neutral name (`call_1`) answered that call there while the API pairs it with none.
#[test]
fn an_orphan_response_whose_own_id_names_a_call_stays_an_orphan() {
    let answer_and_orphan = r#"{"role":"user","parts":[{"functionResponse":{"name":"f","response":{}}},{"functionResponse":{"id":"call_1","name":"h","response":{}}}]}"#;
    assert_eq!(
        check_turns(&[Q, TWO_CALLS, answer_and_orphan]),
        pairing(Violation::OrphanResult { idx: 3, id: "orphan_call_1".into() }, 2)
    );
}

#[test]
fn the_turn_check_keeps_the_apis_own_rules() {
    let user_call = r#"{"role":"user","parts":[{"functionCall":{"name":"f","args":{}}}]}"#;
    assert_eq!(check_turns(&[user_call]), structure(Structure::CallOutsideModel { turn: 0, name: "f".into() }));
    let model_response = r#"{"role":"model","parts":[{"text":"t"},{"functionResponse":{"name":"g","response":{}}}]}"#;
    assert_eq!(
        check_turns(&[Q, model_response]),
        structure(Structure::ResponseOutsideUser { turn: 1, name: "g".into() })
    );
    let model_text = r#"{"role":"model","parts":[{"text":"a"}]}"#;
    assert_eq!(check_turns(&[model_text, CALL, ANSWER]), structure(Structure::CallAfterModel { turn: 1 }));
    assert_eq!(
        check_turns(&[model_text, CALL, ANSWER]).unwrap_err().to_string(),
        "turn 1: a model turn that calls comes right after another model turn"
    );
}

/// The pairing check reads the neutral messages the adapter hands the engine: the skeletons built
/// from the turns are those of [`WireBody::messages`].
#[test]
fn the_checked_skeletons_are_those_of_the_neutral_messages() {
    let odd = r#"{"contents":[{"parts":[]},{"role":"tool","parts":[]},{"role":"function","parts":[{"functionResponse":{"id":"x","name":"f","response":{}}}]},7]}"#;
    for body in [GEMINI_CLI, odd] {
        let parsed = parse(body);
        let from_text: Vec<_> = parsed.messages().iter().map(|m| Skeleton::of(m)).collect();
        assert_eq!(
            neutral_skeletons(&parsed.turns.iter().collect::<Vec<_>>(), parsed.has_system).0,
            from_text,
            "{body}"
        );
    }
}

#[test]
fn a_changed_model_text_goes_to_the_first_unsigned_text_part() {
    let body = r#"{"contents":[{"role":"user","parts":[{"text":"q"}]},{"role":"model","parts":[{"text":"long answer"},{"text":" more"},{"text":"signed","thoughtSignature":"s"},{"functionCall":{"name":"ls","args":{}}}]},{"role":"user","parts":[{"functionResponse":{"name":"ls","response":{"output":"a"}}}]}]}"#;
    let parsed = parse(body);
    let mut messages = neutral(&parsed);
    let mut call: Value = serde_json::from_str(&messages[1]).unwrap();
    call["content"] = json!("short");
    messages[1] = call.to_string();
    let out = written(&parsed, &messages);
    assert_eq!(
        out["contents"][1]["parts"],
        json!([{"text": "short"}, {"text": "signed", "thoughtSignature": "s"}, {"functionCall": {"name": "ls", "args": {}}}])
    );
}

/// Regression: Gemini CLI sends the answer's call back with an `id` of its own (the API's answer has
/// none) and without its thought; the session tracker must still find the answer in the next request.
#[test]
fn an_answer_reads_as_the_turn_that_carries_it_next() {
    let answer = json!({"role": "model", "parts": [{"text": "x", "thought": true}, {"functionCall": {"name": "ls", "args": {}}, "thoughtSignature": "s"}]});
    let sent_back = json!({"role": "model", "parts": [{"functionCall": {"id": "ls_1795764961472_0", "args": {}, "name": "ls"}, "thoughtSignature": "s"}]});
    let next = format!(r#"{{"contents":[{{"role":"user","parts":[{{"text":"q"}}]}},{sent_back}]}}"#);
    let parsed = parse(&next);
    assert_eq!(neutral_answer(&answer), Some(serde_json::from_str(parsed.messages()[1]).unwrap()));
}

mod properties {
    use proptest::prelude::*;
    use serde_json::{Value, json};

    use super::super::*;
    use crate::wire::write_by_hand;

    /// A conversation of `n` rounds: the person asks, the model calls (signed first call, a thought,
    /// ids on some calls), the responses come back (some out of order), text between.
    fn conversation(rounds: Vec<(u8, bool, bool, bool)>, system: bool) -> Value {
        let mut contents = vec![json!({"role": "user", "parts": [{"text": "start"}]})];
        for (r, (n_calls, with_ids, reversed, thought)) in rounds.into_iter().enumerate() {
            let n = usize::from(n_calls % 3) + 1;
            let mut parts = Vec::new();
            if thought {
                parts.push(json!({"text": format!("thinking {r}"), "thought": true}));
            }
            let mut responses = Vec::new();
            for k in 0..n {
                let name = format!("tool{}", k % 2);
                let mut call = json!({"functionCall": {"name": name, "args": {"path": format!("/f/{r}/{k}"), "n": k}}});
                let mut response =
                    json!({"functionResponse": {"name": name, "response": {"output": "x".repeat(50 + k)}}});
                if with_ids {
                    call["functionCall"]["id"] = json!(format!("id{r}_{k}"));
                    response["functionResponse"]["id"] = json!(format!("id{r}_{k}"));
                }
                if k == 0 {
                    call["thoughtSignature"] = json!(format!("sig{r}"));
                }
                parts.push(call);
                responses.push(response);
            }
            if reversed && with_ids {
                responses.reverse();
            }
            contents.push(json!({"role": "model", "parts": parts}));
            responses.push(json!({"text": format!("note {r}")}));
            contents.push(json!({"role": "user", "parts": responses}));
        }
        let mut body = json!({"contents": contents, "generationConfig": {"maxOutputTokens": 100}});
        if system {
            body["systemInstruction"] = json!({"parts": [{"text": "be brief"}]});
        }
        body
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Unchanged neutral messages write the input bytes; the neutral view pairs every call;
        /// eliding any round (its model turn and its results, with a marker) keeps every signature
        /// of the rounds kept, leaves none of the elided one, keeps the system instruction and the
        /// tail, passes the API's checks, and writing what was written again changes nothing.
        #[test]
        fn elision_keeps_pairing_signatures_system_and_tail(
            rounds in proptest::collection::vec((0u8..6, any::<bool>(), any::<bool>(), any::<bool>()), 1..6),
            system in any::<bool>(),
            pick in 0usize..6,
        ) {
            let body = conversation(rounds.clone(), system).to_string();
            let parsed = GeminiBody::parse(body.as_bytes()).unwrap();
            crate::wire::assert_typed_as_read(&parsed);
            let messages = parsed.messages();
            prop_assert_eq!(write_by_hand(&parsed, &messages).unwrap().0, body.as_bytes().to_vec());
            let skeletons: Vec<_> = messages.iter().map(|m| crate::compact::validate::Skeleton::of(m)).collect();
            prop_assert!(crate::compact::validate::check(&skeletons).is_ok());
            prop_assert_eq!(neutral_skeletons(&parsed.turns.iter().collect::<Vec<_>>(), parsed.has_system).0, skeletons);
            parsed.check().unwrap();

            let r = pick % rounds.len();
            // The round's messages: its assistant message, its tool messages, then the person's note.
            let first = usize::from(system) + 1;
            let mut start = first;
            for (k, (n_calls, ..)) in rounds.iter().enumerate() {
                let n = usize::from(n_calls % 3) + 1;
                if k == r {
                    break;
                }
                start += n + 2;
            }
            let n = usize::from(rounds[r].0 % 3) + 1;
            let marker = format!(r#"{{"role":"assistant","content":"[pare: {} earlier messages elided]"}}"#, n + 1);
            let mut forwarded: Vec<&str> = messages[..start].to_vec();
            forwarded.push(&marker);
            forwarded.extend_from_slice(&messages[start + n + 1..]);
            let out = write_by_hand(&parsed, &forwarded).unwrap().0;
            let text = String::from_utf8(out.clone()).unwrap();
            for k in 0..rounds.len() {
                prop_assert_eq!(text.contains(&format!("\"sig{k}\"")), k != r, "signature of round {}", k);
            }
            let value: Value = serde_json::from_slice(&out).unwrap();
            if system {
                prop_assert_eq!(&value["systemInstruction"], &json!({"parts": [{"text": "be brief"}]}));
            }
            let turns = value["contents"].as_array().unwrap();
            let last_input = conversation(rounds.clone(), system)["contents"].as_array().unwrap().last().cloned().unwrap();
            if r + 1 < rounds.len() {
                prop_assert_eq!(turns.last().unwrap(), &last_input, "the tail is kept");
            }
            let roles: Vec<&str> = turns.iter().map(|t| t["role"].as_str().unwrap()).collect();
            prop_assert!(roles.windows(2).all(|w| w != ["model", "model"]), "two model turns in a row: {:?}", roles);
            check_turns(&turns.iter().map(Value::to_string).collect::<Vec<_>>()).unwrap();
            // Idempotence: the written body read again and written unchanged is itself.
            let again = GeminiBody::parse(&out).unwrap();
            prop_assert_eq!(write_by_hand(&again, &again.messages()).unwrap().0, out.clone());
        }
    }
}

/// A response turn written as sent is paired again where it lands: behind a marker that stands for
/// its calling turn it answers no call, and the write is refused, as when every turn is read anew.
#[test]
fn a_response_kept_behind_the_marker_of_its_call_is_refused() {
    let body = json!({"contents": [
        {"role": "user", "parts": [{"text": "fix it"}]},
        {"role": "model", "parts": [{"functionCall": {"name": "bash", "args": {"command": "ls"}}}]},
        {"role": "user", "parts": [{"functionResponse": {"name": "bash", "response": {"output": "a"}}}]},
        {"role": "model", "parts": [{"text": "Done."}]}
    ]})
    .to_string();
    let parsed = parse(&body);
    assert_eq!(parsed.check(), Ok(()));
    let marker = r#"{"role":"assistant","content":"[pare: 1 earlier message elided — bash ×1]"}"#;
    let reads = WrittenReads::new(1);
    let entries = [Forward::Kept(0), Forward::New(reads.written(0, marker)), Forward::Kept(2), Forward::Kept(3)];
    let refused = parsed.write(&entries).unwrap_err();
    assert!(matches!(refused, WireError::Invalid(Invalid::Pairing { .. })), "{refused}");
    // Written as sent, the same turns pass.
    assert!(parsed.write(&Forward::unchanged(4)).is_ok());
}

/// A response written as sent behind another calling turn than its own is paired there: a `g`
/// response after a turn that called `f` answers nothing, though both calls are `call_0` of
/// their turns.
#[test]
fn a_response_moved_behind_another_call_is_paired_where_it_lands() {
    let call = |name: &str| json!({"role": "model", "parts": [{"functionCall": {"name": name, "args": {}}}]});
    let response =
        |name: &str| json!({"role": "user", "parts": [{"functionResponse": {"name": name, "response": {}}}]});
    let body = json!({"contents": [
        {"role": "user", "parts": [{"text": "fix it"}]},
        call("f"), response("f"), call("g"), response("g"),
        {"role": "user", "parts": [{"text": "go on"}]}
    ]})
    .to_string();
    let parsed = parse(&body);
    assert_eq!(parsed.check(), Ok(()));
    let refused = parsed.write(&[Forward::Kept(0), Forward::Kept(1), Forward::Kept(4), Forward::Kept(5)]).unwrap_err();
    assert!(matches!(refused, WireError::Invalid(Invalid::Pairing { .. })), "{refused}");
    let kept = parsed.write(&[Forward::Kept(0), Forward::Kept(3), Forward::Kept(4), Forward::Kept(5)]);
    assert!(kept.is_ok(), "{kept:?}");
}
