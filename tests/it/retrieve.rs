//! Retrieval: every marker that stands for content names it by a `pare:` id, the id resolves to
//! exactly the hidden text (in the engine's own terms, through `/_pare/retrieve/{id}`, through the
//! MCP server and through the gateway), selective reads, unknown ids, and ids that stay the same
//! across replay and a restart.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use serde_json::{Value, json};

use pare::compact::markers::{content_id, content_ids_in, content_texts};
use pare::compact::provenance::{Step, steps};
use pare::compact::report::RuleId;
use pare::compact::{CompactOptions, Engine};
use pare::config::Config;
use pare::pipeline::Pipeline;
use pare::wire::ChatBody;

use crate::support::pare::{Pare, config_for, start_with_pipeline};
use crate::support::stub::Stub;
use crate::support::{client, json as body_json};

/// Every text of `messages` an id may name, by its id (`pare:` + hex).
fn texts_by_id(messages: &[Value]) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for m in messages {
        let message: pare::neutral::Message = serde_json::from_value(m.clone()).unwrap();
        for text in content_texts(&message) {
            out.insert(content_id(&text), text);
        }
    }
    out
}

fn file_view(lines: usize) -> String {
    let mut out = String::new();
    for i in 0..lines {
        match i % 6 {
            0 => out.push_str(&format!("{:6}\tclass Model{i}(Base):\n", i + 1)),
            1 => out.push_str(&format!("{:6}\t    def method_{i}(self, value_{i}):\n", i + 1)),
            _ => out.push_str(&format!("{:6}\t        return compute_{i}(value) + {i}\n", i + 1)),
        }
    }
    out
}

/// One conversation on which each rule that writes a marker has something to do.
fn every_rule_conversation() -> Vec<Value> {
    let mut m = vec![
        json!({"role": "system", "content": "You are a coding agent."}),
        json!({"role": "user", "content": "Fix the failing test."}),
    ];
    let mut k = 0;
    let mut call = |m: &mut Vec<Value>, name: &str, args: Value, output: String| {
        k += 1;
        let id = format!("call_{k}");
        m.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function",
            "function": {"name": name, "arguments": args.to_string()}}]}));
        m.push(json!({"role": "tool", "tool_call_id": id, "content": output}));
    };
    // collapse_succeeded: a plain successful output.
    let listing: String = (0..40).map(|i| format!("src/module_{i}.py\n")).collect();
    call(&mut m, "bash", json!({"command": "ls src"}), listing);
    // retry_pruning: a failure retried with success.
    let traceback: String = (0..12).map(|i| format!("  File \"src/mod_{i}.py\", line {i}, in run\n")).collect();
    let failure = format!("Traceback (most recent call last):\n{traceback}ValueError: boom_4411\nexit code 1");
    call(&mut m, "bash", json!({"command": "pytest -x"}), failure);
    call(&mut m, "bash", json!({"command": "pytest -x"}), "3 passed\nexit code 0".into());
    // loops: the same call three times.
    for n in 0..3 {
        let status: String = (0..10).map(|i| format!("\tmodified: src/changed_{i}.py\n")).collect();
        call(&mut m, "bash", json!({"command": "git status"}), format!("On branch main {n}\n{status}"));
    }
    // duplicates: the same long output twice.
    let long = "duplicate output line with data_7781\n".repeat(12);
    call(&mut m, "bash", json!({"command": "cat notes.txt"}), long.clone());
    call(&mut m, "bash", json!({"command": "cat notes.txt again"}), long);
    // structure: a large source view.
    call(&mut m, "str_replace_editor", json!({"command": "view", "path": "/w/app/models.py"}), file_view(180));
    // truncate: a long failed output.
    let failing: String = (0..60).map(|i| format!("FAILED test_case_{i} - AssertionError: value_{i}\n")).collect();
    call(&mut m, "bash", json!({"command": "pytest"}), failing);
    // hard_cap: a failed output of few very long lines.
    call(&mut m, "bash", json!({"command": "pytest -q"}), format!("Error: {}\n{}", "x".repeat(5000), "y".repeat(3000)));
    // arguments: a large argument of an old successful call.
    let script: String = (0..40).map(|i| format!("print('line {i} of the script')\n")).collect();
    call(&mut m, "bash", json!({"command": script}), "done\nexit code 0".into());
    // system_messages: a later system message.
    m.push(json!({"role": "system", "content": "# Skills loaded\n## skill one\nUse tools carefully.\n".repeat(4)}));
    for n in 0..6 {
        call(&mut m, "bash", json!({"command": format!("echo {n}")}), format!("step {n}\nexit code 0"));
    }
    m.push(json!({"role": "user", "content": "go on"}));
    m
}

/// The compaction of `messages` and what happened to each of those before its boundary.
fn compact(messages: &[Value], target: Option<u64>) -> (pare::compact::Compacted, Vec<Step>) {
    let body = serde_json::to_vec(&json!({"model": "m", "messages": messages})).unwrap();
    let parsed = ChatBody::parse(&body).unwrap();
    let view = parsed.view();
    let opts = CompactOptions { target_tokens: target, ..Default::default() };
    let out = Engine::default_pack().compact(&view, &opts, &pare::tokens::QuarterCounter);
    let steps = steps(&out.plan, out.boundary, out.prefix.len());
    (out, steps)
}

/// The ids a forwarded message shows, each checked to name a text of `raw` (the messages it stands
/// for): what the marker hid is exactly what its id resolves to.
fn check_ids_name(forwarded: &str, raw: &[Value], case: &str) -> usize {
    let texts = texts_by_id(raw);
    let ids: Vec<&str> = content_ids_in(forwarded).collect();
    for id in &ids {
        let id = format!("pare:{id}");
        assert!(texts.contains_key(&id), "{case}: {id} names no text of the messages it stands for: {forwarded}");
    }
    ids.len()
}

/// The ids `text` names, read through the id lists among `lists` (an elision marker of more than one
/// output names the id of a list of their ids): `pare:` + hex each.
fn named_through_lists(text: &str, lists: &[String]) -> BTreeSet<String> {
    let by_id: BTreeMap<String, &String> = lists.iter().map(|l| (content_id(l), l)).collect();
    let mut out = BTreeSet::new();
    let mut todo: Vec<String> = content_ids_in(text).map(|h| format!("pare:{h}")).collect();
    while let Some(id) = todo.pop() {
        match by_id.get(&id) {
            Some(list) => todo.extend(content_ids_in(list).map(|h| format!("pare:{h}"))),
            None => {
                out.insert(id);
            }
        }
    }
    out
}

/// Every rule that writes a marker, and every tier form, names what it hid: the id in each edited
/// message resolves to that message's own text (or one of its call's arguments), the ids of an
/// elision marker to the outputs of the run it stands for.
#[test]
fn every_marker_names_exactly_the_content_it_hides() {
    let raw = every_rule_conversation();
    let (rules_only, steps) = compact(&raw, None);
    let fired: BTreeSet<RuleId> = rules_only.report.rules.keys().copied().collect();
    for rule in [
        RuleId::CollapseSucceeded,
        RuleId::RetryPruning,
        RuleId::Loops,
        RuleId::Duplicates,
        RuleId::Structure,
        RuleId::Truncate,
        RuleId::HardCap,
        RuleId::Arguments,
        RuleId::SystemMessages,
    ] {
        assert!(fired.contains(&rule), "{rule:?} did not fire: {fired:?}");
    }
    let mut n_named = 0;
    for step in &steps {
        if let Step::Edited { raw: idx, fwd, .. } = *step {
            let forwarded = &rules_only.prefix[fwd];
            let n = check_ids_name(forwarded, &raw[idx..=idx], &format!("message {idx}"));
            assert!(n > 0, "edited message {idx} names nothing: {forwarded}");
            n_named += n;
        }
    }
    assert!(n_named >= 10, "{n_named} ids");

    // Tiers and elision, at a tight target.
    let (fitted, steps) = compact(&raw, Some(900));
    let tiers = fitted.report.tiers.as_ref().expect("tiers ran");
    assert!(tiers.elided_groups > 0, "{tiers:?}");
    let mut elision_ids = 0;
    for step in &steps {
        match *step {
            Step::Edited { raw: idx, fwd, .. } => {
                check_ids_name(&fitted.prefix[fwd], &raw[idx..=idx], &format!("message {idx}"));
            }
            Step::Elided { start, end, fwd } => {
                let forwarded = &fitted.prefix[fwd];
                // One id: an output's, or that of the list of the run's outputs' ids.
                assert_eq!(content_ids_in(forwarded).count(), 1, "one id: {forwarded}");
                let named = named_through_lists(forwarded, &fitted.lists);
                let texts = texts_by_id(&raw[start..end]);
                assert!(named.iter().all(|id| texts.contains_key(id)), "{named:?} not all of the run: {forwarded}");
                // One id per distinct output (two identical outputs are one content).
                let outputs: BTreeSet<String> = raw[start..end]
                    .iter()
                    .filter(|m| m["role"] == "tool")
                    .map(|m| content_id(m["content"].as_str().unwrap()))
                    .collect();
                assert_eq!(named, outputs, "one id per output: {forwarded}");
                elision_ids += named.len();
            }
            Step::Kept { .. } | Step::Dropped { .. } => {}
        }
    }
    assert!(elision_ids > 0);
}

/// With pare's retrieve tool among the request's tools, markers say to call it; without, they show
/// the id alone.
#[test]
fn markers_mention_the_retrieve_tool_only_when_offered() {
    let raw = every_rule_conversation();
    let with_tool = |tools: Value| {
        let body = serde_json::to_vec(&json!({"model": "m", "messages": raw, "tools": tools})).unwrap();
        let parsed = ChatBody::parse(&body).unwrap();
        let out =
            Engine::default_pack().compact(&parsed.view(), &CompactOptions::default(), &pare::tokens::QuarterCounter);
        out.prefix.join("\n")
    };
    let bash = json!({"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}});
    let retrieve = json!({"type": "function", "function": {"name": "mcp__pare__retrieve",
        "description": "Get back content pare replaced", "parameters": {"type": "object"}}});
    let plain = with_tool(json!([bash]));
    assert!(!plain.contains("get it back with"), "no retrieve tool, no mention");
    assert!(content_ids_in(&plain).count() > 5);
    let offered = with_tool(json!([bash, retrieve]));
    assert!(offered.contains("get it back with mcp__pare__retrieve(\\\"pare:"), "{offered}");
    // A tool merely named `retrieve` that is not pare's is not taken for it.
    let other = json!({"type": "function", "function": {"name": "retrieve", "description": "search the docs"}});
    assert!(!with_tool(json!([bash, other])).contains("get it back with"));
}

/// A session whose old outputs get compacted: each request the previous one plus a tool step.
fn session(n: usize) -> Vec<Value> {
    let mut messages = vec![
        json!({"role": "system", "content": "You are a coding agent."}),
        json!({"role": "user", "content": "Fix the failing test in src/lib.rs"}),
    ];
    let mut out = Vec::new();
    for k in 0..n {
        out.push(json!({"model": "m", "messages": messages, "stream": false}));
        let id = format!("call_{k}");
        messages.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function",
            "function": {"name": "bash", "arguments": format!("{{\"command\": \"cat src/file_{k}.rs\"}}")}}]}));
        let output: String = (0..40).map(|i| format!("fn item_{k}_{i}() -> u32 {{ {} }}\n", k * 1000 + i)).collect();
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": output}));
    }
    out
}

fn archived_config(stub: &Stub, dir: &std::path::Path) -> Config {
    let mut config = config_for(stub);
    config.archive.enabled = true;
    config.archive.dir = Some(dir.to_owned());
    config.archive.flush_interval_ms = 10;
    config.budget.default_context_window = 6000;
    config.budget.output_reserve = 1000;
    config.budget.detect_window = false;
    config
}

async fn start_archived(stub: &Stub, dir: &std::path::Path) -> Pare {
    let config = Arc::new(archived_config(stub, dir));
    let pipeline = Arc::new(Pipeline::from_config(Arc::clone(&config)).unwrap());
    start_with_pipeline(config, pipeline).await
}

/// Send `bodies` through pare; the forwarded bodies the stub saw.
async fn send_all(pare: &Pare, stub: &Stub, bodies: &[Value]) -> Vec<Value> {
    let http = client();
    for body in bodies {
        let response =
            http.post(pare.url("/v1/chat/completions")).body(body.to_string()).send().await.expect("chat request");
        assert_eq!(response.status(), 200);
    }
    stub.requests().iter().map(|r| r.json()).collect()
}

async fn get(pare: &Pare, path: &str) -> (u16, String) {
    let response = client().get(pare.url(path)).send().await.expect("get");
    (response.status().as_u16(), response.text().await.unwrap())
}

/// Through the proxy: every id in every forwarded body resolves through `GET /_pare/retrieve/{id}`
/// to exactly the text it names, after a restart too; selective reads and unknown ids answer as
/// documented; the ids are the ones `pare replay` forwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ids_resolve_through_the_proxy_across_a_restart_and_match_replay() {
    let dir = tempfile::tempdir().unwrap();
    let stub = Stub::start(Stub::openai).await;
    let bodies = session(24);
    let pare = start_archived(&stub, dir.path()).await;
    let forwarded = send_all(&pare, &stub, &bodies).await;
    let raw_texts = texts_by_id(bodies.last().unwrap()["messages"].as_array().unwrap());
    let mut ids: BTreeSet<String> = BTreeSet::new();
    for body in &forwarded {
        ids.extend(content_ids_in(&body.to_string()).map(|hex| format!("pare:{hex}")));
    }
    let forwarded_ids = ids.clone();
    // An elision marker of more than one output names one id, that of the list of their ids: the
    // list resolves, and each id it lists resolves to exactly one hidden output.
    let mut lists = 0;
    let mut todo: Vec<String> = ids.iter().cloned().collect();
    while let Some(id) = todo.pop() {
        let (status, text) = get(&pare, &format!("/_pare/retrieve/{id}")).await;
        assert_eq!(status, 200, "{id}: {text}");
        if let Some(raw) = raw_texts.get(&id) {
            assert_eq!(&text, raw, "{id}");
            continue;
        }
        lists += 1;
        let hiding: Vec<&Value> = forwarded.iter().filter(|body| body.to_string().contains(id.as_str())).collect();
        let listed: Vec<String> = content_ids_in(&text).map(|hex| format!("pare:{hex}")).collect();
        assert!(listed.len() > 1, "a list of several outputs: {text}");
        assert_eq!(text.lines().count(), listed.len() + 1, "a heading, then one id a line: {text}");
        for member in listed {
            let (status, output) = get(&pare, &format!("/_pare/retrieve/{member}")).await;
            assert_eq!(status, 200, "{member}");
            if !raw_texts.contains_key(&member) {
                // The list of an earlier epoch's marker, which this one swallowed.
                assert!(output.starts_with("content ids of the "), "{member} names a list or an output: {output}");
                todo.push(member);
                continue;
            }
            assert_eq!(&output, &raw_texts[&member], "{member}");
            for body in &hiding {
                let json = body.to_string();
                assert!(
                    !json.contains(&serde_json::to_string(&output).unwrap()),
                    "{member} is hidden where the list is named"
                );
            }
            ids.insert(member);
        }
    }
    assert!(lists > 0, "an elision marker named a list");
    let ids: BTreeSet<String> = ids.into_iter().filter(|id| raw_texts.contains_key(id)).collect();
    assert!(ids.len() > 10, "the session compacted: {} ids", ids.len());

    // Regression: the answers lacked `nosniff` and `no-store`: a browser could sniff stored text
    // into HTML, a cache could keep it.
    let id = ids.iter().next().unwrap();
    for path in [format!("/_pare/retrieve/{id}"), format!("/v1/retrieve/{}", id.trim_start_matches("pare:"))] {
        let response = client().get(pare.url(&path)).send().await.unwrap();
        assert_eq!(response.status(), 200, "{path}");
        assert_eq!(response.headers()["x-content-type-options"], "nosniff", "{path}");
        assert_eq!(response.headers()["cache-control"], "no-store", "{path}");
    }

    // Selective reads.
    let id = ids.iter().find(|id| raw_texts[*id].lines().count() >= 40).expect("a long output");
    let lines: Vec<&str> = raw_texts[id].split_inclusive('\n').collect();
    let (status, text) = get(&pare, &format!("/_pare/retrieve/{id}?lines=2-4")).await;
    assert_eq!((status, text), (200, lines[1..4].concat()));
    let (status, text) = get(&pare, &format!("/_pare/retrieve/{id}?lines=39-")).await;
    assert_eq!((status, text), (200, lines[38..].concat()));
    let (status, text) = get(&pare, &format!("/_pare/retrieve/{id}?lines=900-901")).await;
    assert_eq!((status, text.as_str()), (200, ""), "past the end: nothing");
    let needle = lines[6].split_whitespace().nth(1).unwrap().trim_end_matches("()");
    let (status, text) = get(&pare, &format!("/_pare/retrieve/{id}?grep={needle}%5C(")).await;
    assert_eq!((status, text), (200, format!("7: {}", lines[6])));
    for bad in ["lines=0-3", "lines=5-2", "lines=a", "grep=(unclosed"] {
        let (status, text) = get(&pare, &format!("/_pare/retrieve/{id}?{bad}")).await;
        assert_eq!(status, 400, "{bad}: {text}");
    }
    // Regression: a prefix of 8 hex digits (32 bits, found by random probes within seconds on a
    // large archive) read the content; an id needs 12. Unknown and malformed ids do not resolve.
    let (status, text) = get(&pare, &format!("/_pare/retrieve/{}", &id[..13])).await;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("at least 12 hex digits"), "{text}");
    let (status, text) = get(&pare, &format!("/_pare/retrieve/{}", id.trim_start_matches("pare:"))).await;
    assert_eq!((status, &text), (200, &raw_texts[id]), "the digits alone");
    let (status, text) = get(&pare, "/_pare/retrieve/pare:000000000000").await;
    assert_eq!(status, 404, "{text}");
    assert!(text.contains("no content with id pare:000000000000"), "{text}");
    let (status, _) = get(&pare, "/_pare/retrieve/pare:xyz").await;
    assert_eq!(status, 400);
    pare.shutdown().await.unwrap();

    // After a restart on the same archive, the same ids resolve to the same texts.
    let stub2 = Stub::start(Stub::openai).await;
    let pare = start_archived(&stub2, dir.path()).await;
    for id in ids.iter().take(5) {
        let (status, text) = get(&pare, &format!("/_pare/retrieve/{id}")).await;
        assert_eq!((status, &text), (200, &raw_texts[id]), "{id} after a restart");
    }
    pare.shutdown().await.unwrap();

    // `pare replay` forwards the same ids the proxy did.
    let config = archived_config(&stub, dir.path());
    let compactor =
        pare::budget::SessionCompactor::new(&config, Arc::new(Engine::from_config(&config).unwrap())).unwrap();
    let lines: Vec<Vec<u8>> = bodies.iter().map(|b| serde_json::to_vec(b).unwrap()).collect();
    let lines: Vec<&[u8]> = lines.iter().map(Vec::as_slice).collect();
    let replayed = pare::budget::replay::replay_session(&compactor, pare::wire::Wire::Chat, "replay", &lines, None);
    let mut replay_ids = BTreeSet::new();
    for step in &replayed {
        replay_ids.extend(content_ids_in(&String::from_utf8_lossy(&step.forwarded)).map(|hex| format!("pare:{hex}")));
    }
    assert_eq!(replay_ids, forwarded_ids, "replay names the same contents");
}

async fn mcp(pare: &Pare, message: Value) -> (u16, Value) {
    let response = client()
        .post(pare.url("/_pare/mcp"))
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .body(message.to_string())
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let bytes = response.bytes().await.unwrap();
    (status, if bytes.is_empty() { Value::Null } else { serde_json::from_slice(&bytes).unwrap() })
}

/// The MCP server: initialize, the initialized notification, tools/list, tools/call (content, a
/// selection, an unknown id as a tool error), ping, an unknown method.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_server_lists_and_calls_retrieve() {
    let dir = tempfile::tempdir().unwrap();
    let stub = Stub::start(Stub::openai).await;
    let bodies = session(20);
    let pare = start_archived(&stub, dir.path()).await;
    let forwarded = send_all(&pare, &stub, &bodies).await;
    let raw_texts = texts_by_id(bodies.last().unwrap()["messages"].as_array().unwrap());
    let named: Vec<String> =
        content_ids_in(&forwarded.last().unwrap().to_string()).map(|hex| format!("pare:{hex}")).collect();
    let list_id = named.iter().find(|id| !raw_texts.contains_key(*id)).expect("an elision marker's list id").clone();
    // An output's id: named in the body, or else in the list.
    let (_, list) = get(&pare, &format!("/_pare/retrieve/{list_id}")).await;
    let id = named
        .iter()
        .cloned()
        .chain(content_ids_in(&list).map(|hex| format!("pare:{hex}")))
        .find(|id| raw_texts.contains_key(id))
        .expect("an id of an output");

    let (status, init) = mcp(
        &pare,
        json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": "2025-06-18",
            "capabilities": {}, "clientInfo": {"name": "test", "version": "1"}}}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(init["result"]["protocolVersion"], "2025-06-18");
    assert_eq!(init["result"]["serverInfo"]["name"], "pare");
    let (status, body) = mcp(&pare, json!({"jsonrpc": "2.0", "method": "notifications/initialized"})).await;
    assert_eq!((status, body), (202, Value::Null));
    let (_, list) = mcp(&pare, json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"})).await;
    assert_eq!(list["result"]["tools"][0]["name"], "retrieve");
    let call = |id_value: &str, extra: Value| {
        let mut arguments = json!({"id": id_value});
        arguments.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        json!({"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {"name": "retrieve", "arguments": arguments}})
    };
    let (_, whole) = mcp(&pare, call(&id, json!({}))).await;
    assert_eq!(whole["result"]["isError"], false);
    assert_eq!(whole["result"]["content"][0]["text"], raw_texts[&id].as_str());
    let (_, some) = mcp(&pare, call(&id, json!({"lines": "1-2"}))).await;
    let first_two: String = raw_texts[&id].split_inclusive('\n').take(2).collect();
    assert_eq!(some["result"]["content"][0]["text"], first_two.as_str());
    // A list id gives its list, whose ids give the outputs.
    let (_, list) = mcp(&pare, call(&list_id, json!({}))).await;
    let list = list["result"]["content"][0]["text"].as_str().expect("the list").to_owned();
    let members: Vec<String> = content_ids_in(&list).map(|hex| format!("pare:{hex}")).collect();
    assert!(members.len() > 1 && members.iter().any(|m| raw_texts.contains_key(m)), "{list}");
    let (_, member) = mcp(&pare, call(&id, json!({}))).await;
    assert_eq!(member["result"]["content"][0]["text"], raw_texts[&id].as_str());
    let (_, unknown) = mcp(&pare, call("pare:000000000000", json!({}))).await;
    assert_eq!(unknown["result"]["isError"], true);
    assert!(unknown["result"]["content"][0]["text"].as_str().unwrap().contains("no content with id"));
    let (_, pong) = mcp(&pare, json!({"jsonrpc": "2.0", "id": 4, "method": "ping"})).await;
    assert_eq!(pong["result"], json!({}));
    let (_, missing) = mcp(&pare, json!({"jsonrpc": "2.0", "id": 5, "method": "resources/list"})).await;
    assert_eq!(missing["error"]["code"], -32601);
    let get = client().get(pare.url("/_pare/mcp")).send().await.unwrap();
    assert_eq!(get.status(), 405);
    pare.shutdown().await.unwrap();
}

/// The gateway contract LiteLLM's Headroom guardrail calls: `POST /v1/compress` answers as many
/// messages as it was given, compacted, with `ccr_hashes` listing the content ids they name, and
/// `GET /v1/retrieve/{hash}` gives each one's original content back as `original_content`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_compress_and_retrieve() {
    let dir = tempfile::tempdir().unwrap();
    let stub = Stub::start(Stub::openai).await;
    let pare = start_archived(&stub, dir.path()).await;
    let last = session(24).pop().unwrap();
    let messages = last["messages"].clone();
    let response = client()
        .post(pare.url("/v1/compress"))
        .header("content-type", "application/json")
        .body(json!({"messages": messages, "model": "m", "config": {"mode": "ccr"}}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let answer = body_json(response).await;
    assert!(stub.requests().is_empty(), "the gateway call goes to no upstream");
    let before = answer["tokens_before"].as_u64().unwrap();
    let after = answer["tokens_after"].as_u64().unwrap();
    assert!(after < before, "{before} → {after}");
    assert_eq!(answer["tokens_saved"].as_u64(), Some(before - after));
    let out = answer["messages"].as_array().unwrap();
    assert_eq!(out.len(), messages.as_array().unwrap().len(), "one message per message, by position");
    let hashes: Vec<&str> = answer["ccr_hashes"].as_array().unwrap().iter().map(|h| h.as_str().unwrap()).collect();
    let out_text = answer["messages"].to_string();
    let named: BTreeSet<&str> = content_ids_in(&out_text).collect();
    assert_eq!(hashes.iter().copied().collect::<BTreeSet<_>>(), named);
    assert!(hashes.len() > 10, "{hashes:?}");
    let raw_texts = texts_by_id(messages.as_array().unwrap());
    for hash in hashes.iter().take(5) {
        let response = client().get(pare.url(&format!("/v1/retrieve/{hash}"))).send().await.unwrap();
        assert_eq!(response.status(), 200);
        let got = body_json(response).await;
        assert_eq!(got["original_content"], raw_texts[&format!("pare:{hash}")].as_str());
    }
    let missing = client().get(pare.url("/v1/retrieve/000000000000")).send().await.unwrap();
    assert_eq!(missing.status(), 404);
    let bad = client().post(pare.url("/v1/compress")).body("{\"nope\": 1}").send().await.unwrap();
    assert_eq!(bad.status(), 400);

    // The guardrail holds back what a compressor may not touch (system, the last user and assistant
    // turns): tool results arrive without the calls they answer, and are compacted all the same.
    let results: Vec<Value> = messages.as_array().unwrap().iter().filter(|m| m["role"] == "tool").cloned().collect();
    let response = client()
        .post(pare.url("/v1/compress"))
        .body(json!({"messages": results, "model": "m"}).to_string())
        .send()
        .await
        .unwrap();
    let answer = body_json(response).await;
    let out = answer["messages"].as_array().unwrap();
    assert_eq!(out.len(), results.len());
    assert!(out.iter().all(|m| m["role"] == "tool"), "no inserted call comes back");
    assert!(answer["ccr_hashes"].as_array().unwrap().len() > 10, "{answer}");
    assert_eq!(out.last(), results.last(), "the latest results are the protected tail");
    pare.shutdown().await.unwrap();
}

/// The same round trip on the Anthropic Messages wire: the ids name the texts of the neutral
/// conversation the engine reads (a `tool_result` block's text), and the archive, reading the raw
/// Anthropic body, resolves each of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ids_resolve_on_the_messages_wire() {
    let dir = tempfile::tempdir().unwrap();
    let reply = json!({"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
        "content": [{"type": "text", "text": "done"}], "stop_reason": "end_turn",
        "usage": {"input_tokens": 1, "output_tokens": 1}});
    let stub = Stub::start(move |_| crate::support::stub::Reply::json(200, reply.clone())).await;
    let mut config = archived_config(&stub, dir.path());
    config.budget.anthropic_context_window = 6000;
    let config = Arc::new(config);
    let pipeline = Arc::new(Pipeline::from_config(Arc::clone(&config)).unwrap());
    let pare = start_with_pipeline(config, pipeline).await;
    let chat: String = session(24).iter().map(|b| format!("{b}\n")).collect();
    let bodies: Vec<String> =
        pare::wire::convert::chat_session_to(pare::wire::Wire::Messages, &chat).lines().map(str::to_owned).collect();
    let http = client();
    for body in &bodies {
        let response = http.post(pare.url("/v1/messages")).body(body.clone()).send().await.unwrap();
        assert_eq!(response.status(), 200);
    }
    let last = bodies.last().unwrap().as_bytes();
    let parsed = pare::wire::parse(pare::wire::Wire::Messages, last).unwrap();
    let mut texts = BTreeMap::new();
    for raw in parsed.messages() {
        let message = pare::neutral::Message::from_raw(raw).unwrap();
        for text in content_texts(&message) {
            texts.insert(content_id(&text), text);
        }
    }
    let mut ids = BTreeSet::new();
    for request in stub.requests() {
        ids.extend(content_ids_in(&request.json().to_string()).map(|hex| format!("pare:{hex}")));
    }
    let last_forwarded = stub.requests().last().unwrap().json().to_string();
    let mut todo: Vec<String> = ids.into_iter().collect();
    let mut resolved = 0;
    while let Some(id) = todo.pop() {
        let (status, text) = get(&pare, &format!("/_pare/retrieve/{id}")).await;
        assert_eq!(status, 200, "{id}: {text}");
        match texts.get(&id) {
            Some(expected) => {
                assert_eq!(&text, expected, "{id}");
                resolved += 1;
            }
            // An elision marker's list: its ids are resolved in turn.
            None => todo.extend(content_ids_in(&text).map(|hex| format!("pare:{hex}"))),
        }
    }
    assert!(resolved > 10, "the session compacted: {resolved} ids in {last_forwarded}");
    pare.shutdown().await.unwrap();
}

/// Regression: an elision over tool results that were already markers (eager mode compacts a history
/// that holds its earlier markers) listed no id for them, so what they stood for could no longer be
/// retrieved; it lists the ids those markers carried.
#[test]
fn elision_over_earlier_markers_keeps_their_ids() {
    let raw = every_rule_conversation();
    let (once, _) = compact(&raw, None);
    let mut input: Vec<Value> = once.prefix.iter().map(|m| serde_json::from_str(m).unwrap()).collect();
    input.extend(raw[once.boundary..].iter().cloned());
    let (twice, steps) = compact(&input, Some(900));
    let mut checked = 0;
    for step in &steps {
        let Step::Elided { start, end, fwd } = *step else { continue };
        let forwarded = &twice.prefix[fwd];
        let carried: BTreeSet<String> = input[start..end]
            .iter()
            .filter(|m| m["role"] == "tool")
            .flat_map(|m| {
                content_ids_in(m["content"].as_str().unwrap_or_default())
                    .map(|h| format!("pare:{h}"))
                    .collect::<Vec<_>>()
            })
            .collect();
        let named = named_through_lists(forwarded, &twice.lists);
        assert!(carried.is_subset(&named), "{carried:?} not all in {forwarded}");
        checked += carried.len();
    }
    assert!(checked > 3, "the second pass elided earlier markers: {checked}");
}

/// pare on an archive that holds `text` as a content hidden behind its marker (an exchange recorded
/// straight into the archive), with `tweak` applied to the configuration; the content's id.
async fn serving_content(
    stub: &Stub,
    dir: &std::path::Path,
    text: &str,
    tweak: impl FnOnce(&mut Config),
) -> (Pare, String) {
    let mut config = archived_config(stub, dir);
    tweak(&mut config);
    let config = Arc::new(config);
    let pipeline = Arc::new(Pipeline::from_config(Arc::clone(&config)).unwrap());
    let archive = Arc::clone(pipeline.archive().expect("archiving is on"));
    let id = content_id(text);
    let body = |output: &str| {
        bytes::Bytes::from(
            json!({"model": "m", "messages": [{"role": "user", "content": "go"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function",
                    "function": {"name": "bash", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c", "content": output}]})
            .to_string(),
        )
    };
    archive.record_exchange(pare::archive::ExchangeRecord {
        forwarded: Some(body(&format!("[tool: bash; {id}]"))),
        ..pare::archive::ExchangeRecord::unchanged("s", 0, body(text))
    });
    archive.flush().unwrap();
    (start_with_pipeline(config, pipeline).await, id)
}

/// A retrieve call of the MCP tool, as JSON-RPC request `n`.
fn retrieve_call(n: usize, id: &str, grep: Option<&str>) -> Value {
    let mut arguments = json!({"id": id});
    if let Some(grep) = grep {
        arguments["grep"] = json!(grep);
    }
    json!({"jsonrpc": "2.0", "id": n, "method": "tools/call", "params": {"name": "retrieve", "arguments": arguments}})
}

/// Regression (an MCP batch of 100 retrieves of a 4 MB content held 1 GB): what a batch retrieves
/// is held in the request budget (`server.max_buffered_bytes`) until the batch is answered; calls
/// past it get a tool error saying pare is busy, the budget is whole again afterwards, and a batch
/// of more than `MAX_BATCH` messages is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcp_batch_of_retrieves_is_held_to_the_request_budget() {
    let dir = tempfile::tempdir().unwrap();
    let stub = Stub::start(Stub::openai).await;
    let text: String = (0..2000).map(|k| format!("line {k:04} of a large output, {}\n", "x".repeat(40))).collect();
    let budget = 1u64 << 20;
    let (pare, id) = serving_content(&stub, dir.path(), &text, |config| {
        config.server.max_body = budget;
        config.server.max_buffered_bytes = budget;
    })
    .await;
    let batch: Vec<Value> = (0..32).map(|n| retrieve_call(n, &id, None)).collect();
    let (status, answers) = mcp(&pare, Value::Array(batch)).await;
    assert_eq!(status, 200);
    let answers = answers.as_array().expect("a batch answer");
    assert_eq!(answers.len(), 32, "one response per call");
    let whole = answers.iter().filter(|a| a["result"]["content"][0]["text"] == text.as_str()).count();
    let busy = answers
        .iter()
        .filter(|a| a["result"]["isError"] == true)
        .filter(|a| a["result"]["content"][0]["text"].as_str().is_some_and(|t| t.contains("server.max_buffered_bytes")))
        .count();
    assert!(whole >= 1, "the first calls are answered");
    assert!(whole as u64 * text.len() as u64 <= budget, "{whole} contents of {} bytes held at once", text.len());
    assert_eq!(whole + busy, 32, "the others are told pare is busy");
    let (_, one) = mcp(&pare, retrieve_call(99, &id, None)).await;
    assert_eq!(one["result"]["content"][0]["text"], text.as_str(), "the batch gave its bytes back");
    let pings: Vec<Value> = (0..33).map(|n| json!({"jsonrpc": "2.0", "id": n, "method": "ping"})).collect();
    let (status, refused) = mcp(&pare, Value::Array(pings)).await;
    assert_eq!((status, refused["error"]["code"].as_i64()), (200, Some(-32600)), "{refused}");
    pare.shutdown().await.unwrap();
}

/// A pattern the regex crate's lazy DFA cannot cache over random `a`s and `b`s (it tracks 30
/// positions of a class at once): 3 s over 4 MB in a release build.
const SLOW_GREP: &str = r"a[ab]{30}b{29}";

/// Regression (`?grep=` ran on the threads that serve connections: four slow greps held a `GET
/// /v1/models` 4.4 s): greps run on the blocking pool, one at a time, each within its time budget,
/// and a request sent meanwhile is answered at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_greps_leave_other_requests_alone() {
    let dir = tempfile::tempdir().unwrap();
    let stub = Stub::start(Stub::openai).await;
    let mut seed = 7u64;
    let mut ab = || {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        if seed >> 63 == 0 { 'a' } else { 'b' }
    };
    let text: String = (0..1000).map(|_| (0..4000).map(|_| ab()).chain(['\n']).collect::<String>()).collect();
    let (pare, id) = serving_content(&stub, dir.path(), &text, |_| {}).await;
    let grep: String = SLOW_GREP
        .bytes()
        .map(|b| if b.is_ascii_alphanumeric() { char::from(b).to_string() } else { format!("%{b:02X}") })
        .collect();
    let greps: Vec<_> = (0..4)
        .map(|_| {
            let url = pare.url(&format!("/_pare/retrieve/{id}?grep={grep}"));
            tokio::spawn(async move { client().get(url).send().await.unwrap().text().await.unwrap() })
        })
        .collect();
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let started = std::time::Instant::now();
    let models = client().get(pare.url("/v1/models")).send().await.unwrap();
    let took = started.elapsed();
    assert_eq!(models.status(), 200);
    assert!(greps.iter().any(|g| !g.is_finished()), "the greps still run");
    assert!(took < std::time::Duration::from_millis(500), "GET /v1/models took {took:?} beside the greps");
    for grep in greps {
        let answer = grep.await.unwrap();
        assert!(
            answer.ends_with("narrow it with `lines` or a simpler pattern]\n") || !answer.contains("[pare: grep"),
            "{answer}"
        );
    }
    pare.shutdown().await.unwrap();
}

async fn mcp_text(pare: &Pare, body: &str) -> (u16, String) {
    let response = client()
        .post(pare.url("/_pare/mcp"))
        .header("content-type", "application/json")
        .body(body.to_owned())
        .send()
        .await
        .unwrap();
    (response.status().as_u16(), response.text().await.unwrap())
}

/// Regression (MCP mangled ids past 64 bits, answered nothing to a batch of one invalid message,
/// accepted `jsonrpc: "1.0"`): ids come back as the client wrote them, every request of a batch
/// gets its response (only notifications and the client's responses get none), and a message
/// that is not JSON-RPC 2.0 is an invalid request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_keeps_ids_and_answers_every_request_of_a_batch() {
    let dir = tempfile::tempdir().unwrap();
    let stub = Stub::start(Stub::openai).await;
    let pare = start_archived(&stub, dir.path()).await;
    let big = r#"{"jsonrpc": "2.0", "id": 123456789012345678901234567890, "method": "ping"}"#;
    assert_eq!(
        mcp_text(&pare, big).await,
        (200, r#"{"jsonrpc":"2.0","id":123456789012345678901234567890,"result":{}}"#.into())
    );
    let exact = r#"{"jsonrpc": "2.0", "id": 1.50, "method": "ping"}"#;
    assert_eq!(mcp_text(&pare, exact).await.1, r#"{"jsonrpc":"2.0","id":1.50,"result":{}}"#);
    let (status, one_error) = mcp_text(&pare, r#"[{"foo": 1}]"#).await;
    assert_eq!(status, 200);
    let one_error: Value = serde_json::from_str(&one_error).unwrap();
    assert_eq!(one_error.as_array().map(Vec::len), Some(1), "{one_error}");
    assert_eq!((one_error[0]["id"].clone(), one_error[0]["error"]["code"].as_i64()), (Value::Null, Some(-32600)));
    for silent in [
        r#"[{"jsonrpc": "2.0", "method": "notifications/initialized"}]"#,
        r#"[{"jsonrpc": "2.0", "id": 7, "result": {}}]"#,
    ] {
        assert_eq!(mcp_text(&pare, silent).await, (202, String::new()), "{silent}");
    }
    for old in [r#"{"jsonrpc": "1.0", "id": 3, "method": "ping"}"#, r#"{"id": 3, "method": "ping"}"#] {
        let (_, answer) = mcp_text(&pare, old).await;
        let answer: Value = serde_json::from_str(&answer).unwrap();
        assert_eq!((answer["id"].as_i64(), answer["error"]["code"].as_i64()), (Some(3), Some(-32600)), "{old}");
    }
    let (_, bad_id) = mcp_text(&pare, r#"{"jsonrpc": "2.0", "id": {"a": 1}, "method": "ping"}"#).await;
    let bad_id: Value = serde_json::from_str(&bad_id).unwrap();
    assert_eq!((bad_id["id"].clone(), bad_id["error"]["code"].as_i64()), (Value::Null, Some(-32600)));
    pare.shutdown().await.unwrap();
}
