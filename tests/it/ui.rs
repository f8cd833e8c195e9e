//! The audit UI: every route through `pare serve` (status, content, downloads, exports), hostile
//! text shown as text, 404s, the token rule, `pare ui` over an archive alone, and the index's
//! paging over 10,000 sessions.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use pare::archive::{Archive, ExchangeRecord, ResponseRecord};
use pare::config::{Config, Durability, Mode};
use pare::pipeline::{CompactionSummary, Pipeline, StreamEnd};
use pare::ui::{PAGE_SIZE, Payload, Ui};
use serde_json::{Value, json};

use crate::support::pare::{Pare, config_for, start_with_pipeline};
use crate::support::stub::Stub;
use crate::support::{bare_client, client, within};

const HOSTILE: &str = "<script>alert('pwned')</script> & \"quotes\" <img src=x onerror=alert(2)>";
const SESSION: &str = "ui-test";

/// An agent session with large tool results, sent through pare (eager mode, a small window, so
/// that older results are rewritten) with an explicit session id; the user's task is hostile HTML.
fn conversation(n_steps: usize) -> Vec<Vec<u8>> {
    let mut messages = vec![
        json!({"role": "system", "content": "You are a coding agent. ".repeat(40)}),
        json!({"role": "user", "content": HOSTILE}),
    ];
    let mut out = Vec::new();
    for k in 0..n_steps {
        out.push(serde_json::to_vec(&json!({"model": "stub-model", "messages": messages})).unwrap());
        let id = format!("call_{k}");
        let args = json!({"path": format!("src/file_{k}.rs")}).to_string();
        messages.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function", "function": {"name": "read_file", "arguments": args}}]}));
        let output = (0..80).map(|line| format!("fn f{k}_{line}() {{ /* line {line} */ }}\n")).collect::<String>();
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": output}));
    }
    out
}

struct Served {
    pare: Pare,
    _stub: Stub,
    dir: tempfile::TempDir,
    sent: Vec<Vec<u8>>,
    forwarded: Vec<Bytes>,
}

/// pare in eager mode with a small window against `stub`, archiving into `dir`.
fn archived_eager_config(stub: &Stub, dir: &Path) -> Config {
    let mut config = config_for(stub);
    config.archive.enabled = true;
    config.archive.dir = Some(dir.to_owned());
    config.archive.flush_interval_ms = 5;
    config.compaction.mode = Mode::Eager;
    config.budget.default_context_window = 6000;
    config.budget.output_reserve = 1000;
    config.budget.detect_window = false;
    config
}

async fn serve_with_traffic(token: Option<&str>) -> Served {
    let dir = tempfile::tempdir().unwrap();
    let stub = Stub::start(Stub::openai).await;
    let mut config = archived_eager_config(&stub, dir.path());
    config.server.auth_token = token.map(str::to_owned);
    let config = Arc::new(config);
    let pipeline = Arc::new(Pipeline::from_config(Arc::clone(&config)).unwrap());
    let pare = start_with_pipeline(config, Arc::clone(&pipeline)).await;
    let sent = conversation(10);
    for body in &sent {
        let mut request = client()
            .post(pare.url("/v1/chat/completions"))
            .header("content-type", "application/json")
            .header("x-pare-session", SESSION)
            .body(body.clone());
        if let Some(token) = token {
            request = request.header("x-pare-token", token);
        }
        let response = within("a proxied request", request.send()).await.unwrap();
        assert_eq!(response.status(), 200);
        response.bytes().await.unwrap();
    }
    within("the archive flush", async { pipeline.archive().unwrap().flush().unwrap() }).await;
    let forwarded = stub.requests().into_iter().map(|r| r.body).collect();
    Served { pare, _stub: stub, dir, sent, forwarded }
}

async fn get(pare: &Pare, path: &str) -> (u16, reqwest::header::HeaderMap, String) {
    let response = within(path, client().get(pare.url(path)).send()).await.unwrap();
    let (status, headers) = (response.status().as_u16(), response.headers().clone());
    (status, headers, response.text().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_answers_with_its_content() {
    let served = serve_with_traffic(None).await;
    let pare = &served.pare;

    let (status, headers, index) = get(pare, "/_pare/ui/").await;
    assert_eq!(status, 200);
    assert!(headers["content-type"].to_str().unwrap().starts_with("text/html"));
    assert!(index.contains(&format!("href=\"/_pare/ui/session/{SESSION}\"")), "{index}");
    assert!(index.contains("stub-model") && index.contains(">chat<"), "model and wire format listed");
    assert!(index.contains("1–1 of 1 sessions"), "{index}");
    for column in
        ["Saved (forwarded tokens)", "Attributable", "Uncached prefill pare / raw", "Saved (uncached prefill)"]
    {
        assert!(index.contains(column), "{column} in {index}");
    }

    let (status, _, session) = get(pare, &format!("/_pare/ui/session/{SESSION}")).await;
    assert_eq!(status, 200);
    for seq in 1..=10 {
        assert!(session.contains(&format!("href=\"/_pare/ui/session/{SESSION}/request/{seq}\"")), "row {seq}");
    }
    assert!(!session.contains("request/11\""));
    assert!(session.contains("✓ verified"), "the session verifies");
    assert!(session.contains("class=\"win\""), "the window line is drawn");
    assert!(session.contains("Hello from the stub."), "the answer's first line is summarised: {session}");
    assert!(session.contains(&format!("/_pare/ui/export/sft?session={SESSION}")));
    // Uncached prefill side by side: the verdict in words, and a chart of the cumulative figures
    // with a point per request on each line.
    assert!(session.contains("id=\"prefill-chart\""), "{session}");
    for side in ["pare", "raw"] {
        let start = session.find(&format!("<polyline class=\"{side}\" points=\"")).expect(side);
        let points = session[start..].split('"').nth(3).unwrap();
        assert_eq!(points.split(' ').count(), 10, "{side}: {points}");
    }
    assert!(session.contains("uncached prefill tokens") || session.contains("cost more uncached prefill"), "{session}");
    assert!(session.contains("saved (forwarded tokens)") && session.contains("saved (uncached prefill)"));
    assert_eq!(session.matches("<td class=\"num prefill\">").count(), 10, "a prefill cell per request");
    // Opening the session verified it: the index says so without hashing anything.
    let (_, _, index) = get(pare, "/_pare/ui/").await;
    assert!(index.contains("✓ verified"));

    // The last request had older results rewritten: each shows original, replacement and rule.
    let (status, _, request) = get(pare, &format!("/_pare/ui/session/{SESSION}/request/10")).await;
    assert_eq!(status, 200);
    assert!(served.forwarded[9] != served.sent[9], "the last request was compacted");
    assert!(request.contains("sent by the agent") && request.contains("forwarded"));
    assert!(request.contains(" elided"), "the elided messages are shown: {request}");
    assert!(request.contains("class=\"badge rule\""), "the rule is named: {request}");
    assert!(request.contains("unchanged"), "unchanged messages are collapsed");
    assert!(request.contains("<details class=\"kept\">"));
    assert!(request.contains("Compaction report") && request.contains("Answer"));
    assert!(request.contains("/request/10/raw\"") && request.contains("/request/10/forwarded\""));

    // Downloads: the exact bytes, as attachments.
    for (kind, expected) in [("raw", Bytes::from(served.sent[9].clone())), ("forwarded", served.forwarded[9].clone())] {
        let url = pare.url(&format!("/_pare/ui/session/{SESSION}/request/10/{kind}"));
        let response = client().get(url).send().await.unwrap();
        assert_eq!(response.status(), 200);
        let disposition = response.headers()["content-disposition"].to_str().unwrap().to_owned();
        assert_eq!(disposition, format!("attachment; filename=\"{SESSION}-10-{kind}.json\""));
        assert!(response.bytes().await.unwrap() == expected, "{kind} body differs");
    }

    // Exports: JSON Lines from the raw session.
    let (status, headers, sft) = get(pare, &format!("/_pare/ui/export/sft?session={SESSION}")).await;
    assert_eq!(status, 200);
    assert!(headers["content-disposition"].to_str().unwrap().contains("pare-sft-ui-test.jsonl"));
    let rows: Vec<Value> = sft.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["messages"][1]["content"], HOSTILE, "the export is of the raw session");
    let (_, _, sharegpt) = get(pare, "/_pare/ui/export/sft?format=sharegpt").await;
    assert!(serde_json::from_str::<Value>(sharegpt.lines().next().unwrap()).unwrap()["conversations"].is_array());
    let (status, _, dpo) = get(pare, "/_pare/ui/export/dpo?model=stub").await;
    assert_eq!(status, 200);
    assert!(dpo.lines().all(|l| serde_json::from_str::<Value>(l).is_ok()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_text_is_shown_escaped_and_no_script_can_run() {
    let served = serve_with_traffic(None).await;
    let (status, headers, page) = get(&served.pare, &format!("/_pare/ui/session/{SESSION}/request/3")).await;
    assert_eq!(status, 200);
    assert!(page.contains("&lt;script&gt;alert("), "the script tag is shown as text");
    assert!(page.contains("&lt;img src=x onerror=alert(2)&gt;") && page.contains("&amp; &quot;quotes&quot;"));
    assert!(!page.contains("<script"), "no script element on the page");
    assert!(!page.contains("<img"), "no element from the message");
    let csp = headers["content-security-policy"].to_str().unwrap();
    assert!(csp.contains("default-src 'none'") && !csp.contains("script-src"), "{csp}");
    // A hostile filter value is escaped in the form that echoes it.
    let (status, _, index) = get(&served.pare, "/_pare/ui/?model=%22%3E%3Cscript%3Ealert(1)%3C%2Fscript%3E").await;
    assert_eq!(status, 200);
    assert!(!index.contains("<script") && index.contains("&quot;&gt;&lt;script&gt;"), "{index}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_sessions_requests_and_pages_are_404() {
    let served = serve_with_traffic(None).await;
    let pare = &served.pare;
    for path in [
        "/_pare/ui/session/no-such-session".to_owned(),
        format!("/_pare/ui/session/{SESSION}/request/11"),
        format!("/_pare/ui/session/{SESSION}/request/0"),
        format!("/_pare/ui/session/{SESSION}/request/abc"),
        format!("/_pare/ui/session/{SESSION}/request/99/raw"),
        "/_pare/ui/session/no-such-session/request/1/forwarded".to_owned(),
        "/_pare/ui/export/sft?session=no-such-session".to_owned(),
        "/_pare/ui/nothing/here".to_owned(),
    ] {
        let (status, _, page) = get(pare, &path).await;
        assert_eq!(status, 404, "{path}");
        assert!(page.contains("Not found"), "{path}: {page}");
    }
    let (status, _, page) = get(pare, "/_pare/ui/?since=yesterday").await;
    assert_eq!(status, 400);
    assert!(page.contains("yesterday"));
    let response = client().post(pare.url("/_pare/ui/")).send().await.unwrap();
    assert_eq!(response.status(), 405);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ui_needs_the_token_when_one_is_set() {
    let served = serve_with_traffic(Some("s3cret-s3cret-s3cret")).await;
    let url = served.pare.url("/_pare/ui/");
    assert_eq!(bare_client().get(&url).send().await.unwrap().status(), 401);
    let wrong = bare_client().get(&url).header("x-pare-token", "guess").send().await.unwrap();
    assert_eq!(wrong.status(), 401);
    let page = client().get(&url).header("x-pare-token", "s3cret-s3cret-s3cret").send().await.unwrap();
    assert_eq!(page.status(), 200);
    assert!(!page.text().await.unwrap().contains("s3cret"), "the token is never shown");
}

/// `pare ui` serves an archive alone (read-only) on the address it prints, and refuses to listen
/// beyond loopback without a token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pare_ui_serves_an_archive_alone() {
    let served = serve_with_traffic(None).await;
    let dir = served.dir.path();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_pare"))
        .args(["ui", "--archive", dir.to_str().unwrap(), "--listen", "127.0.0.1:0"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stderr.take().unwrap()).read_line(&mut line).unwrap();
    let url = line.trim().strip_prefix("pare ui: ").unwrap_or_else(|| panic!("no address in {line:?}")).to_owned();
    // The printed URL carries the token kept beside the archive; opening it sets the cookie.
    let token = std::fs::read_to_string(dir.join("token")).unwrap();
    assert!(url.ends_with(&format!("/_pare/ui/?token={}", token.trim())), "{url}");
    let login = within("pare ui", bare_client().get(&url).send()).await.unwrap();
    assert_eq!(login.status(), 303);
    let cookie = login.headers()["set-cookie"].to_str().unwrap().split(';').next().unwrap().to_owned();
    let base = url.split('?').next().unwrap();
    let anonymous = within("pare ui", bare_client().get(format!("{base}session/{SESSION}")).send()).await.unwrap();
    assert_eq!(anonymous.status(), 401);
    let request = bare_client().get(format!("{base}session/{SESSION}")).header("cookie", cookie);
    let page = within("pare ui", request.send()).await.unwrap();
    assert_eq!(page.status(), 200);
    assert!(page.text().await.unwrap().contains("✓ verified"));
    child.kill().unwrap();
    child.wait().unwrap();

    let refused = std::process::Command::new(env!("CARGO_BIN_EXE_pare"))
        .args(["ui", "--archive", dir.to_str().unwrap(), "--listen", "0.0.0.0:0"])
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("not loopback"));
}

/// 10,000 one-request sessions written by the real archive writer, `s00001` the oldest.
fn large_archive(dir: &Path, n: usize) {
    let archive = Archive::start(dir.to_owned(), Durability::Buffered, Duration::from_millis(50));
    for k in 1..=n {
        let body = json!({"model": if k % 2 == 0 { "qwen-14b" } else { "llama-8b" }, "messages": [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": format!("task {k}")},
        ]});
        let raw = Bytes::from(serde_json::to_vec(&body).unwrap());
        let ticket = archive.record_exchange(ExchangeRecord {
            session: format!("s{k:05}"),
            at_ms: 1_760_000_000_000 + k as i64 * 60_000,
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            model: body["model"].as_str().map(str::to_owned),
            headers: Vec::new(),
            raw,
            raw_spans: None,
            forwarded: None,
            forwarded_spans: None,
            summary: Some(CompactionSummary { tokens_raw: 30, tokens_forwarded: 30, ..Default::default() }),
            late_summary: None,
            skipped: None,
            key_req: None,
            expect_requests: None,
            lists: Default::default(),
        });
        let answer = json!({"choices": [{"message": {"role": "assistant", "content": format!("done {k}")}, "finish_reason": "stop"}]});
        archive.record_response(
            ticket,
            ResponseRecord {
                at_ms: 1_760_000_000_000 + k as i64 * 60_000 + 500,
                status: Some(200),
                headers: Vec::new(),
                stream: false,
                end: if k % 100 == 0 { StreamEnd::ClientGone } else { StreamEnd::Complete },
                body: serde_json::to_vec(&answer).unwrap(),
                truncated: None,
                assembled: None,
                key_ext: None,
            },
        );
    }
    archive.close();
}

fn html_of(ui: &Ui, query: Option<&str>) -> String {
    let reply = ui.route("GET", "/_pare/ui/", query);
    assert_eq!(reply.status, 200);
    match reply.body {
        Payload::Bytes(bytes) => String::from_utf8(bytes).unwrap(),
        Payload::Export(_) => panic!("the index is a page"),
    }
}

/// The session ids listed on an index page, in order.
fn listed(page: &str) -> Vec<String> {
    page.split("href=\"/_pare/ui/session/").skip(1).map(|rest| rest[..rest.find('"').unwrap()].to_owned()).collect()
}

#[test]
fn the_index_pages_through_ten_thousand_sessions() {
    let dir = tempfile::tempdir().unwrap();
    large_archive(dir.path(), 10_000);
    let ui = Ui::new(dir.path().to_owned());

    let first = html_of(&ui, None);
    let ids = listed(&first);
    assert_eq!(ids.len(), PAGE_SIZE as usize);
    let expected: Vec<String> = (0..PAGE_SIZE).map(|k| format!("s{:05}", 10_000 - k)).collect();
    assert_eq!(ids, expected, "most recently active first");
    assert!(first.contains("1–50 of 10,000 sessions · page 1 of 200"));
    assert!(first.contains("rel=\"next\" href=\"/_pare/ui/?page=2\"") && !first.contains("rel=\"prev\""));
    assert!(first.contains("<span class=\"badge warn\">1</span>"), "s10000's answer was cut short");

    // Every page holds the next 50, no session twice, down to the oldest.
    let mut seen = std::collections::HashSet::new();
    for page in [2, 3, 100, 200] {
        let html = html_of(&ui, Some(&format!("page={page}")));
        let ids = listed(&html);
        assert_eq!(ids.len(), 50, "page {page}");
        assert_eq!(ids[0], format!("s{:05}", 10_000 - (page - 1) * 50), "page {page}");
        assert!(ids.iter().all(|id| seen.insert(id.clone())), "page {page} repeats a session");
        let prev = if page == 2 { "/_pare/ui/".to_owned() } else { format!("/_pare/ui/?page={}", page - 1) };
        assert!(html.contains(&format!("rel=\"prev\" href=\"{prev}\"")), "page {page}");
    }
    let last = html_of(&ui, Some("page=200"));
    assert_eq!(listed(&last).last().map(String::as_str), Some("s00001"));
    assert!(!last.contains("rel=\"next\""));
    assert!(listed(&html_of(&ui, Some("page=201"))).is_empty());

    // Filters: by model (5,000 each) and by date, kept by the paging links.
    let qwen = html_of(&ui, Some("model=qwen"));
    assert!(qwen.contains("of 5,000 sessions · page 1 of 100"), "model filter");
    assert!(listed(&qwen).iter().all(|id| id[1..].parse::<u32>().unwrap() % 2 == 0));
    assert!(qwen.contains("href=\"/_pare/ui/?model=qwen&amp;page=2\""));
    // s09001 onwards were active at or after this time (1_760_000_000_000 + 9_001 * 60_000 ms).
    let since = "2025-10-15T14:54:20Z";
    let recent = html_of(&ui, Some(&format!("since={since}")));
    assert!(recent.contains("of 1,000 sessions"), "date filter");
}

/// A rewritten message shows the original, its replacement and the rules the stored plan names; a
/// dropped one says so, with its rule.
/// The session id holds a `:`, which links percent-encode.
#[test]
fn a_rewritten_message_shows_original_replacement_and_rule() {
    use pare::budget::compactor::{FrozenPlan, SessionPlan};
    use pare::compact::Fate;
    use pare::compact::report::RuleId;
    let dir = tempfile::tempdir().unwrap();
    let archive = Archive::start(dir.path().to_owned(), Durability::Buffered, Duration::from_millis(5));
    let call = |id: &str| json!({"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function", "function": {"name": "read_file", "arguments": "{\"path\": \"a.py\"}"}}]});
    let long_output = "def main():\n    print('the whole file')\n".repeat(40);
    let raw = json!({"model": "m", "messages": [
        {"role": "user", "content": "fix a.py"},
        call("c1"), {"role": "tool", "tool_call_id": "c1", "content": long_output},
        {"role": "assistant", "content": "thinking out loud"},
        call("c2"), {"role": "tool", "tool_call_id": "c2", "content": "ok"},
    ]});
    let marker = "[tool: read_file(\"a.py\") → ok, 1,640 chars, 80 lines]";
    let forwarded = json!({"model": "m", "messages": [
        raw["messages"][0], raw["messages"][1], {"role": "tool", "tool_call_id": "c1", "content": marker},
        raw["messages"][4], raw["messages"][5],
    ]});
    let ticket = archive.record_exchange(ExchangeRecord {
        session: "crafted:1".into(),
        at_ms: 1_760_000_000_000,
        method: "POST".into(),
        path: "/v1/chat/completions".into(),
        model: Some("m".into()),
        headers: vec![("user-agent".into(), "agent/1".into())],
        raw: Bytes::from(serde_json::to_vec(&raw).unwrap()),
        raw_spans: None,
        forwarded: Some(Bytes::from(serde_json::to_vec(&forwarded).unwrap())),
        forwarded_spans: None,
        summary: None,
        late_summary: None,
        skipped: None,
        key_req: None,
        expect_requests: None,
        lists: Default::default(),
    });
    // What the session's plan says became of messages 0–3: a collapse and a drop.
    let covered: Vec<String> = (0..4).map(|i| raw["messages"][i].to_string()).collect();
    let rules = |rule| [rule].into_iter().collect();
    let frozen = FrozenPlan {
        raw_hashes: pare::neutral::message_hashes(&covered),
        prefix: vec![covered[0].clone(), covered[1].clone(), forwarded["messages"][2].to_string()],
        prefix_seen: Vec::new(),
        plan: Some(vec![
            Fate::Kept { at: 0 },
            Fate::Kept { at: 1 },
            Fate::Rewritten { at: 2, rules: rules(RuleId::CollapseSucceeded) },
            Fate::Dropped { rules: rules(RuleId::ConsecutiveAssistant) },
        ]),
    };
    archive.record_plan(ticket, SessionPlan { epoch: 1, frozen: Some(frozen), ..SessionPlan::default() });
    archive.close();
    let ui = Ui::new(dir.path().to_owned());
    // Links percent-encode the id (`:` may appear in a header-given one); the route decodes it.
    let reply = ui.route("GET", "/_pare/ui/session/crafted%3A1/request/1", None);
    assert_eq!(reply.status, 200);
    let Payload::Bytes(page) = reply.body else { panic!("a page") };
    let page = String::from_utf8(page).unwrap();
    let rewritten = &page[page.find("#2 rewritten").expect("message 2 is shown rewritten")..];
    assert!(rewritten.contains("<span class=\"badge rule\">collapse_succeeded</span>"), "{rewritten}");
    assert!(rewritten.contains("print(&#39;the whole file&#39;)") || rewritten.contains("print('the whole file')"));
    assert!(rewritten.contains("[tool: read_file(&quot;a.py&quot;) → ok, 1,640 chars, 80 lines]"), "{rewritten}");
    let dropped = &page[page.find("#3 dropped").expect("message 3 is shown dropped")..];
    assert!(dropped.contains("<span class=\"badge rule\">consecutive_assistant</span>"), "{dropped}");
    assert!(dropped.contains("thinking out loud"));
    assert!(!page.contains("agent/1"), "request headers are not shown");
}

/// A request between epochs links the request that compacted its prefix; the session marks where
/// the epoch started.
#[test]
fn requests_between_epochs_link_the_epoch_start() {
    let dir = tempfile::tempdir().unwrap();
    let archive = Archive::start(dir.path().to_owned(), Durability::Buffered, Duration::from_millis(5));
    for (seq, epoch, started) in [(1, 0, false), (2, 1, true), (3, 1, false)] {
        let body = json!({"model": "m", "messages": [{"role": "user", "content": format!("turn {seq}")}]});
        let summary = CompactionSummary {
            tokens_raw: 100 * seq,
            tokens_forwarded: 60 * seq,
            epoch,
            epoch_started: started,
            ..Default::default()
        };
        archive.record_exchange(ExchangeRecord {
            session: "epochs".into(),
            at_ms: 1_760_000_000_000 + seq as i64,
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            model: Some("m".into()),
            headers: Vec::new(),
            raw: Bytes::from(serde_json::to_vec(&body).unwrap()),
            raw_spans: None,
            forwarded: None,
            forwarded_spans: None,
            summary: Some(summary),
            late_summary: None,
            skipped: None,
            key_req: None,
            expect_requests: None,
            lists: Default::default(),
        });
    }
    archive.close();
    let ui = Ui::new(dir.path().to_owned());
    let page = |path: &str| match ui.route("GET", path, None).body {
        Payload::Bytes(bytes) => String::from_utf8(bytes).unwrap(),
        Payload::Export(_) => panic!("a page"),
    };
    let link =
        "<a href=\"/_pare/ui/session/epochs/request/2\">request 2</a></b><span>compacted the prefix of this epoch";
    assert!(page("/_pare/ui/session/epochs/request/3").contains(link));
    assert!(
        !page("/_pare/ui/session/epochs/request/2").contains("compacted the prefix"),
        "the start itself links nothing"
    );
    assert!(!page("/_pare/ui/session/epochs/request/1").contains("compacted the prefix"));
    let session = page("/_pare/ui/session/epochs");
    assert!(session.contains("<span class=\"badge epoch\">epoch 1</span>"), "{session}");
    assert!(session.contains("<span class=\"muted\">epoch 1</span>"), "{session}");
}

/// A Responses API session (Codex's format) is listed with its wire format, and its requests are
/// aligned on the neutral messages the adapter reads, as chat requests are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_sessions_are_listed_and_aligned() {
    let answer = json!({"id": "resp_1", "object": "response", "status": "completed", "model": "stub-model",
        "output": [{"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                    "content": [{"type": "output_text", "text": "On it.", "annotations": []}]}]});
    let stub = Stub::start(move |_| crate::support::stub::Reply::json(200, answer.clone())).await;
    let dir = tempfile::tempdir().unwrap();
    let config = Arc::new(archived_eager_config(&stub, dir.path()));
    let pipeline = Arc::new(Pipeline::from_config(Arc::clone(&config)).unwrap());
    let pare = start_with_pipeline(config, Arc::clone(&pipeline)).await;
    for chat in conversation(10) {
        let body = pare::wire::convert::chat_to_responses(&serde_json::from_slice(&chat).unwrap()).unwrap();
        let request = client()
            .post(pare.url("/v1/responses"))
            .header("content-type", "application/json")
            .header("x-pare-session", "codex")
            .body(body.to_string());
        let response = within("a proxied Responses request", request.send()).await.unwrap();
        assert_eq!(response.status(), 200);
        response.bytes().await.unwrap();
    }
    within("the archive flush", async { pipeline.archive().unwrap().flush().unwrap() }).await;
    assert!(stub.requests().last().unwrap().body.len() < 20_000, "the last request was compacted");

    let (_, _, index) = get(&pare, "/_pare/ui/").await;
    assert!(index.contains("href=\"/_pare/ui/session/codex\"") && index.contains(">responses<"), "{index}");
    let (status, _, page) = get(&pare, "/_pare/ui/session/codex/request/10").await;
    assert_eq!(status, 200);
    assert!(page.contains("sent by the agent") && page.contains("class=\"badge rule\""), "{page}");
    assert!(page.contains("&lt;script&gt;"), "the user's text, read from the Responses items, is shown escaped");
    assert!(!page.contains("Not a request body"));
}

/// One archived request of 8 messages, compacted by an epoch whose engine ran on a 4-message input
/// (the session's compacted prefix of 2, then the 2 messages after it: raw #6 and #7 are the engine's
/// #2 and #3), at an 8,192-token window with 1,024 reserved for the answer. Its text and model carry
/// a right-to-left override, a zero-width space and a tag character.
fn crafted_epoch_request(dir: &Path) {
    let archive = Archive::start(dir.to_owned(), Durability::Buffered, Duration::from_millis(5));
    let call = |id: &str| json!({"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function", "function": {"name": "read_file", "arguments": "{\"path\": \"a.py\"}"}}]});
    let raw = json!({"model": "m\u{202E}txt.exe", "messages": [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "open invoice\u{202E}fdp.exe and say\u{200B}nothing\u{E0041}"},
        call("c1"), {"role": "tool", "tool_call_id": "c1", "content": "print(1)"},
        call("c2"), {"role": "tool", "tool_call_id": "c2", "content": "print(2)"},
        {"role": "assistant", "content": "both read"},
        {"role": "user", "content": "thanks"},
    ]});
    let summary: CompactionSummary = serde_json::from_value(json!({
        "tokens_raw": 9000, "tokens_forwarded": 7500, "epoch": 1, "epoch_started": true, "over_window": true,
        "report": {"mode": "epoch", "window": 8192, "reserve": 1024, "action": "epoch",
            "engine": {"pack": "default", "messages_in": 4, "messages_out": 4, "boundary": 2, "rules": {}}},
    }))
    .unwrap();
    archive.record_exchange(ExchangeRecord {
        session: "crafted".into(),
        at_ms: 1_760_000_000_000,
        method: "POST".into(),
        path: "/v1/chat/completions".into(),
        model: Some("m\u{202E}txt.exe".into()),
        headers: Vec::new(),
        raw: Bytes::from(serde_json::to_vec(&raw).unwrap()),
        raw_spans: None,
        forwarded: None,
        forwarded_spans: None,
        summary: Some(summary),
        late_summary: None,
        skipped: None,
        key_req: None,
        expect_requests: None,
        lists: Default::default(),
    });
    archive.close();
}

fn page_of(ui: &Ui, path: &str) -> String {
    let reply = ui.route("GET", path, None);
    assert_eq!(reply.status, 200, "{path}");
    match reply.body {
        Payload::Bytes(bytes) => String::from_utf8(bytes).unwrap(),
        Payload::Export(_) => panic!("a page"),
    }
}

/// Regression: "protected tail from #2" was the engine's index into its own input (the compacted
/// prefix plus the new messages), not the number the page gives the request's messages.
#[test]
fn the_protected_tail_is_given_in_the_requests_message_numbers() {
    let dir = tempfile::tempdir().unwrap();
    crafted_epoch_request(dir.path());
    let ui = Ui::new(dir.path().to_owned());
    let page = page_of(&ui, "/_pare/ui/session/crafted/request/1");
    assert!(page.contains("<b>#6</b><span>protected tail starts at (message numbers as above)</span>"), "{page}");
    assert!(page.contains("#6 <bdi>assistant</bdi>") && page.contains("#7 <bdi>user</bdi>"), "numbered from #0");
}

/// Regression: the session's window line was drawn at the whole window while its "over window"
/// badge compared with the usable window (the window less the answer's reserve), so a request could
/// be badged over a line it stayed under. Both use the usable window and name the whole one too.
#[test]
fn the_window_line_and_the_over_window_badge_use_the_same_window() {
    let dir = tempfile::tempdir().unwrap();
    crafted_epoch_request(dir.path());
    let ui = Ui::new(dir.path().to_owned());
    let session = page_of(&ui, "/_pare/ui/session/crafted");
    let described = "usable 7,168 of window 8,192 (1,024 reserved for the answer)";
    // The scale is the largest of raw tokens and usable windows: 9,000; the line sits at 7,168.
    assert!(session.contains(&format!("class=\"win\" style=\"left:79.64%\" title=\"{described}\"")), "{session}");
    assert!(
        session.contains(&format!("title=\"forwarded tokens over the {described}\">over window</span>")),
        "{session}"
    );
    let request = page_of(&ui, "/_pare/ui/session/crafted/request/1");
    assert!(request.contains("<b>7,168</b><span>usable window (tokens)</span>"), "{request}");
    assert!(request.contains("<b>8,192</b><span>window, of which 1,024 reserved for the answer</span>"), "{request}");
}

/// Regression: a right-to-left override, zero-width characters and tag characters in a message or
/// a model name were drawn as they are: invisible, or reordering the text around them
/// (`invoice` U+202E `fdp.exe` reads as `invoiceexe.pdf`). Each is shown as a visible mark, in isolated text.
#[test]
fn bidi_controls_and_invisible_characters_are_shown_as_marks() {
    let dir = tempfile::tempdir().unwrap();
    crafted_epoch_request(dir.path());
    let ui = Ui::new(dir.path().to_owned());
    for path in ["/_pare/ui/", "/_pare/ui/session/crafted", "/_pare/ui/session/crafted/request/1"] {
        let page = page_of(&ui, path);
        for hidden in ['\u{202E}', '\u{200B}', '\u{E0041}'] {
            assert!(!page.contains(hidden), "{path} holds U+{:04X} as it is", hidden as u32);
        }
        assert!(
            page.contains("<bdi>m<span class=\"cc\" title=\"right-to-left override\">U+202E</span>txt.exe</bdi>"),
            "{path}: {page}"
        );
    }
    let request = page_of(&ui, "/_pare/ui/session/crafted/request/1");
    assert!(
        request.contains(
            "<bdi>open invoice<span class=\"cc\" title=\"right-to-left override\">U+202E</span>fdp.exe and say\
             <span class=\"cc\" title=\"zero-width space\">U+200B</span>nothing\
             <span class=\"cc\" title=\"tag character\">U+E0041</span></bdi>"
        ),
        "{request}"
    );
}
