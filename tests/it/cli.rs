//! The command line as a new user meets it: `pare check` lists every problem of a file in one run,
//! `pare serve`'s log lines carry no colour codes when stderr is not a terminal.

use std::path::Path;
use std::process::{Command, Output};

fn pare(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pare")).args(args).output().expect("run pare")
}

/// `pare ARGS` for a command that must end by itself: killed after 20 s (then it failed).
fn pare_within(args: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_pare"))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run pare");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while child.try_wait().expect("wait for pare").is_none() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let _ = child.kill();
    child.wait_with_output().expect("pare's output")
}

fn check(dir: &Path, name: &str, yaml: &str) -> (Option<i32>, String) {
    let path = dir.join(name);
    std::fs::write(&path, yaml).unwrap();
    let out = pare(&["check", path.to_str().unwrap()]);
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// Problem lines of `pare check`'s report (`FILE:LINE: PATH: MESSAGE`), as (line, path, message).
fn problems(report: &str) -> Vec<(u64, String, String)> {
    report
        .lines()
        .filter_map(|l| {
            let (_, rest) = l.trim().split_once(".yaml:")?;
            let (line, rest) = rest.split_once(": ")?;
            let (path, message) = rest.split_once(": ")?;
            Some((line.parse().ok()?, path.to_owned(), message.to_owned()))
        })
        .collect()
}

/// A config with an unknown (misspelt) key, a value of the wrong type and a custom rule whose regex
/// does not compile: one run reports all three, in line order, with a suggestion for the misspelling.
#[test]
fn check_reports_every_problem_of_a_config_in_line_order() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = "\
compaction:
  rules:
    custom:
      - name: mine
        match:
          content: \"(unclosed\"
        action: clear
budget:
  high_watr: 0.9
  low_water: lots
";
    let (code, report) = check(dir.path(), "three.yaml", yaml);
    assert_eq!(code, Some(1), "{report}");
    let got = problems(&report);
    let lines: Vec<(u64, &str)> = got.iter().map(|(l, p, _)| (*l, p.as_str())).collect();
    assert_eq!(
        lines,
        vec![(6, "compaction.rules.custom.0.match.content"), (9, "budget.high_watr"), (10, "budget.low_water")],
        "{report}"
    );
    assert_eq!(got[0].2, "bad regex `(unclosed`: unclosed group");
    assert_eq!(got[1].2, "unknown key `high_watr`; did you mean `high_water`?");
    assert_eq!(got[2].2, "expected a number, got the text \"lots\"");
}

/// A config whose problems lie in itself, in the name of the pack it selects and in its rule
/// overrides (a misspelt role in a custom rule, a misspelt key, a value of the wrong type).
const MANY_MISTAKES: &str = "\
compaction:
  pack: defualt
  rules:
    custom:
      - name: mine
        match:
          role: toool
        action: clear
    truncate:
      max_char: 3
budget:
  default_context_window: lots
";

/// Regression: `pare check` stopped at a bad pack name and reported the rule mistakes only once it
/// was fixed; a misspelt custom-rule role had no suggestion; type errors spoke serde ("expected u64").
#[test]
fn check_reports_the_pack_name_and_the_rule_mistakes_in_one_run() {
    let dir = tempfile::tempdir().unwrap();
    let (code, report) = check(dir.path(), "many.yaml", MANY_MISTAKES);
    assert_eq!(code, Some(1), "{report}");
    let got = problems(&report);
    let lines: Vec<(u64, &str)> = got.iter().map(|(l, p, _)| (*l, p.as_str())).collect();
    assert_eq!(
        lines,
        vec![
            (2, "compaction.pack"),
            (7, "compaction.rules.custom.0.match.role"),
            (10, "compaction.rules.truncate.max_char"),
            (12, "budget.default_context_window"),
        ],
        "{report}"
    );
    assert!(got[0].2.contains("built-in packs: default, hermes, openai"), "{report}");
    assert!(got[1].2.starts_with("unknown role `toool`; did you mean `tool`?"), "{report}");
    assert_eq!(got[3].2, "expected a whole number (0 or more), got the text \"lots\"");
    for jargon in ["u64", "u32", "usize", "f64", "invalid type", "invalid value"] {
        assert!(!report.contains(jargon), "{jargon} in {report}");
    }
}

/// Regression: `pare serve` reported a config's own problems, then — once they were fixed — the
/// pack's and the overrides' in a second stage without lines. It refuses now with the very listing
/// `pare check` prints, before it binds its port.
#[test]
fn serve_refuses_a_bad_config_with_the_listing_of_check() {
    let dir = tempfile::tempdir().unwrap();
    let (_, report) = check(dir.path(), "many.yaml", MANY_MISTAKES);
    let config = dir.path().join("many.yaml");
    let archive = dir.path().join("archive");
    let (config, archive_arg) = (config.to_str().unwrap(), archive.to_str().unwrap());
    let out = pare_within(&["serve", "--config", config, "--listen", "127.0.0.1:0", "--archive", archive_arg]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert_eq!(problems(&stderr), problems(&report), "{stderr}");
    assert_eq!(problems(&stderr).len(), 4, "{stderr}");
    assert!(!archive.exists(), "refused before the archive was opened");
}

/// Regression: an upstream URL naming an endpoint (`…/v1/chat/completions`) was accepted, and every
/// request then went to `…/v1/chat/completions/v1/chat/completions`. `check` and `serve` refuse it
/// with the base URL to use; a value given by a flag is named by its flag.
#[test]
fn an_endpoint_as_upstream_url_is_refused_with_the_base_url() {
    let dir = tempfile::tempdir().unwrap();
    for (endpoint, base) in [
        ("http://127.0.0.1:8080/v1/chat/completions", "http://127.0.0.1:8080/v1"),
        ("https://api.example.com/v1/responses/", "https://api.example.com/v1"),
        ("http://h:9/v1/messages", "http://h:9/v1"),
    ] {
        let (code, report) = check(dir.path(), "up.yaml", &format!("upstream:\n  url: {endpoint}\n"));
        assert_eq!(code, Some(1), "{report}");
        let got = problems(&report);
        assert_eq!((got[0].0, got[0].1.as_str()), (2, "upstream.url"), "{report}");
        assert!(got[0].2.contains(&format!("use `{base}`")), "{report}");
    }
    let (code, report) = check(dir.path(), "ok.yaml", "upstream:\n  url: http://127.0.0.1:8080/v1\n");
    assert_eq!(code, Some(0), "{report}");
    let out =
        pare_within(&["serve", "--listen", "127.0.0.1:0", "--upstream", "http://127.0.0.1:8080/v1/chat/completions"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("--upstream (upstream.url)") && stderr.contains("use `http://127.0.0.1:8080/v1`"),
        "{stderr}"
    );
}

/// Regression: an upstream given without its scheme got two different errors for the same mistake
/// (`127.0.0.1:9100`: "relative URL without a base"; `localhost:9100`: "must be http:// or
/// https://", read as a URL of scheme `localhost`). Both say what to write.
#[test]
fn an_upstream_without_a_scheme_gets_one_answer_whatever_its_host() {
    let mut answers = Vec::new();
    for host in ["127.0.0.1:9100", "localhost:9100", "[::1]:9100", "gpu-box"] {
        let out = pare_within(&["serve", "--listen", "127.0.0.1:0", "--upstream", host]);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!out.status.success(), "{stderr}");
        let line = stderr.lines().find(|l| l.contains("--upstream")).unwrap_or_else(|| panic!("{stderr}"));
        answers.push(line.replace(host, "HOST"));
    }
    assert_eq!(
        answers[0],
        "  config: --upstream (upstream.url): `HOST` has no scheme; write `http://HOST` (or https://)"
    );
    assert!(answers.iter().all(|a| *a == answers[0]), "{answers:#?}");
}

/// Regression: `server.auth_token: " "` was accepted (a token anyone can send by accident).
#[test]
fn a_blank_auth_token_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    for blank in ["\" \"", "\"\"", "\"\\t\""] {
        let (code, report) = check(dir.path(), "token.yaml", &format!("server:\n  auth_token: {blank}\n"));
        assert_eq!(code, Some(1), "{blank}: {report}");
        let got = problems(&report);
        assert_eq!((got[0].0, got[0].1.as_str()), (2, "server.auth_token"), "{report}");
        assert!(got[0].2.contains("blank"), "{report}");
    }
    assert_eq!(check(dir.path(), "token.yaml", "server:\n  auth_token: s3cret-s3cret-s3cret\n").0, Some(0));
    let (code, report) = check(dir.path(), "token.yaml", "server:\n  auth_token: s3cret\n");
    assert_eq!(code, Some(1), "a token of 6 characters is refused: {report}");
    assert!(report.contains("at least 16"), "{report}");
}

/// Regression: an explicit `--archive` that cannot be written started anyway (every record lost,
/// the UI saying "nothing recorded yet"). pare refuses to start and says why.
#[test]
fn an_unwritable_explicit_archive_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let not_a_dir = dir.path().join("archive");
    std::fs::write(&not_a_dir, b"a file where the archive directory should be").unwrap();
    let out = pare_within(&["serve", "--listen", "127.0.0.1:0", "--archive", not_a_dir.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains(&format!("cannot write the archive directory {}", not_a_dir.display())), "{stderr}");
    assert!(!stderr.contains("pare listening"), "{stderr}");
}

/// Regression: a port in use was reported only after the archive was opened and the sessions'
/// state rebuilt from it (seconds on a large archive). The port is bound first.
#[test]
fn a_port_in_use_is_reported_before_the_archive_is_opened() {
    let dir = tempfile::tempdir().unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let archive = dir.path().join("archive");
    let out = pare_within(&["serve", "--listen", &addr, "--archive", archive.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains(&addr), "{stderr}");
    assert!(!archive.exists(), "the archive was opened before the bind failed: {stderr}");
}

/// A required key that is there but wrong is reported once, as wrong, not a second time as missing.
#[test]
fn a_bad_required_key_is_not_also_reported_missing() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = "compaction:\n  rules:\n    custom:\n      - name: x\n        action: drop\n";
    let (code, report) = check(dir.path(), "action.yaml", yaml);
    assert_eq!(code, Some(1), "{report}");
    let got = problems(&report);
    assert_eq!(got.len(), 1, "{report}");
    assert_eq!((got[0].0, got[0].1.as_str()), (5, "compaction.rules.custom.0.action"));
    assert!(!report.contains("missing field"), "{report}");
}

#[test]
fn an_unknown_pack_lists_the_built_in_ones() {
    let dir = tempfile::tempdir().unwrap();
    let (code, report) = check(dir.path(), "pack.yaml", "compaction:\n  pack: defualt\n");
    assert_eq!(code, Some(1), "{report}");
    let got = problems(&report);
    assert_eq!((got[0].0, got[0].1.as_str()), (2, "compaction.pack"), "{report}");
    assert!(got[0].2.contains("built-in packs: default, hermes, openai"), "{report}");
}

#[test]
fn a_yaml_syntax_error_gives_its_line_column_and_key() {
    let dir = tempfile::tempdir().unwrap();
    let (code, report) = check(dir.path(), "syntax.yaml", "budget:\n  high_water: [0.9\n");
    assert_eq!(code, Some(1), "{report}");
    let got = problems(&report);
    assert_eq!(got.len(), 1, "{report}");
    assert_eq!((got[0].0, got[0].1.as_str()), (2, "budget.high_water"), "{report}");
    assert!(got[0].2.starts_with("YAML syntax error at line 2, column "), "{report}");
}

/// `pare serve` with stderr on a pipe (a journal, a file): the log lines are plain text, and the
/// access line's timings are rounded to two decimals.
#[test]
fn logs_to_a_pipe_carry_no_colour_codes_and_rounded_timings() {
    use std::io::{Read, Write};

    let dir = tempfile::tempdir().unwrap();
    // A port that was free a moment ago, and an upstream that refuses connections (the discard port
    // of a listener that is closed again).
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let refused = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_pare"))
        .args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--upstream"])
        .arg(format!("http://127.0.0.1:{refused}"))
        .arg("--archive")
        .arg(dir.path())
        .env_remove("NO_COLOR")
        .env("RUST_LOG", "info")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start pare serve");
    let mut stderr = crate::support::StderrLines::follow(&mut child);
    let listening = stderr.wait_for("pare listening");
    let mut answered = false;
    if listening {
        let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        write!(
            stream,
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut response = String::new();
        let _ = stream.read_to_string(&mut response);
        answered = stderr.wait_for("total_ms=");
        // A call to pare's own endpoints is logged too, in the same units.
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        write!(stream, "GET /_pare/health HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\nconnection: close\r\n\r\n").unwrap();
        let _ = stream.read_to_string(&mut response);
        answered &= stderr.wait_for("pare endpoint");
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let seen = stderr.seen;
    assert!(listening && answered, "{seen:#?}");
    for line in &seen {
        assert!(!line.contains('\u{1b}'), "an ANSI escape in {line:?}");
    }
    let access = seen.iter().find(|l| l.contains("total_ms=")).unwrap();
    for key in ["total_ms=", "pare_ms="] {
        let figure = access.split(key).nth(1).unwrap_or_else(|| panic!("{key} in {access}")).split(' ').next().unwrap();
        let decimals = figure.split_once('.').map_or(0, |(_, d)| d.len());
        assert!(decimals <= 2, "{access}");
    }
    assert!(!access.contains("_us="), "every duration in milliseconds: {access}");
    let endpoint = seen.iter().find(|l| l.contains("pare endpoint")).unwrap();
    for field in ["method=GET", "path=/_pare/health", "status=", "total_ms="] {
        assert!(endpoint.contains(field), "{field} in {endpoint}");
    }
}

/// `--since` says its format in its help and in its error.
#[test]
fn since_says_its_format() {
    let help = String::from_utf8_lossy(&pare(&["sessions", "list", "--help"]).stdout).into_owned();
    assert!(help.contains("YYYY-MM-DD") && help.contains("RFC 3339"), "{help}");
    let dir = tempfile::tempdir().unwrap();
    let out = pare(&["sessions", "list", "--archive", dir.path().to_str().unwrap(), "--since", "last week"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("YYYY-MM-DD") && err.contains("2026-11-24T18:00:00Z"), "{err}");
}

/// A 52-request session with two epochs (ten results collapsed at request 21; four steps elided and
/// ten more results collapsed at request 40): `sessions show --diff` lists each request's new
/// messages and only the changes of that request, each original next to its replacement and rule,
/// so its size grows with the changes, not with the requests times the session's length.
#[test]
fn sessions_diff_shows_each_change_once() {
    use bytes::Bytes;
    use pare::archive::{Archive, ExchangeRecord};
    use pare::config::Durability;
    use pare::pipeline::CompactionSummary;
    use serde_json::{Value, json};

    let output =
        |k: usize| (1..=6).map(|l| format!("line {l} of step {k}: some output")).collect::<Vec<_>>().join("\n");
    let call = |k: usize| {
        json!({"role": "assistant", "content": null, "tool_calls": [{"id": format!("call_{k}"), "type": "function",
            "function": {"name": "terminal", "arguments": format!("{{\"command\":\"run {k}\"}}")}}]})
    };
    let result = |k: usize, text: String| json!({"role": "tool", "tool_call_id": format!("call_{k}"), "content": text});
    let collapsed =
        |k: usize| result(k, format!("[tool: terminal → ok, {} chars, 6 lines]", output(k).chars().count()));
    let head = || {
        vec![
            json!({"role": "system", "content": "You are a coding agent."}),
            json!({"role": "user", "content": "Fix the bug."}),
        ]
    };
    let body = |messages: Vec<Value>| Bytes::from(json!({"model": "m", "messages": messages}).to_string());

    let dir = tempfile::tempdir().unwrap();
    let archive = Archive::start(dir.path().to_owned(), Durability::Buffered, std::time::Duration::from_millis(20));
    for k in 1..=52usize {
        let mut raw = head();
        for step in 1..=k {
            raw.push(call(step));
            raw.push(result(step, output(step)));
        }
        // Epoch 1 from request 21: steps 1–10 collapsed. Epoch 2 from request 40: steps 1–4 elided
        // into one marker, steps 11–20 collapsed as well.
        let (epoch, forwarded) = match k {
            1..=20 => (0, None),
            _ => {
                let mut fwd = head();
                let first = if k >= 40 {
                    fwd.push(
                        json!({"role": "assistant", "content": "[pare: 8 earlier messages elided — terminal ×4]"}),
                    );
                    5
                } else {
                    1
                };
                let collapsed_to = if k >= 40 { 20 } else { 10 };
                for step in first..=k {
                    fwd.push(call(step));
                    fwd.push(if step <= collapsed_to { collapsed(step) } else { result(step, output(step)) });
                }
                (if k >= 40 { 2 } else { 1 }, Some(body(fwd)))
            }
        };
        let raw_messages = raw.clone();
        let ticket = archive.record_exchange(ExchangeRecord {
            session: "s52".into(),
            at_ms: 1_700_000_000_000 + k as i64 * 1000,
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            model: Some("m".into()),
            headers: Vec::new(),
            raw: body(raw),
            raw_spans: None,
            forwarded,
            forwarded_spans: None,
            summary: Some(CompactionSummary {
                tokens_raw: 1000 * k as u64,
                tokens_forwarded: 900 * k as u64,
                epoch,
                epoch_started: k == 21 || k == 40,
                ..Default::default()
            }),
            late_summary: None,
            skipped: None,
            key_req: None,
            expect_requests: None,
            lists: Default::default(),
        });
        // The plans the session's epochs stored: what became of each message the prefix covers.
        if k == 21 || k == 40 {
            archive.record_plan(ticket, s52_plan(k, &raw_messages));
        }
    }
    archive.close();

    let archive_dir = dir.path().to_str().unwrap();
    let out = pare(&["sessions", "show", "s52", "--diff", "--archive", archive_dir]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let blocks: Vec<&str> = text.split("request ").filter(|b| !b.is_empty()).collect();
    assert_eq!(blocks.len(), 52, "{text}");
    for (k, block) in (1..).zip(&blocks) {
        let lines: Vec<&str> = block.lines().collect();
        let new: Vec<&str> = lines.iter().copied().filter(|l| l.starts_with("  + #")).collect();
        // Numbered from 0: request k brings messages 2k and 2k+1 (request 1 also the first two).
        let expected_new: Vec<usize> = if k == 1 { (0..4).collect() } else { vec![2 * k, 2 * k + 1] };
        let got_new: Vec<usize> = new.iter().map(|l| l[5..].split(' ').next().unwrap().parse().unwrap()).collect();
        assert_eq!(got_new, expected_new, "request {k}:\n{block}");
        let collapses =
            lines.iter().filter(|l| l.starts_with("  #") && l.contains(" tool · collapse_succeeded (")).count();
        let elisions = lines.iter().filter(|l| l.starts_with("  #2..#9 elided (8 messages) · elision")).count();
        match k {
            21 | 40 => {
                assert_eq!((collapses, elisions), (10, usize::from(k == 40)), "request {k}:\n{block}");
                assert!(lines[0].ends_with(&format!("epoch {} starts", if k == 21 { 1 } else { 2 })), "{block}");
            }
            _ => assert_eq!(lines.len(), 1 + new.len(), "request {k} repeats earlier changes:\n{block}"),
        }
    }
    // Each change shows the original next to its replacement.
    let epoch1 = blocks[20];
    let at = epoch1.find("  #3 tool · collapse_succeeded").unwrap_or_else(|| panic!("{epoch1}"));
    let change: Vec<&str> = epoch1[at..].lines().take(3).collect();
    assert!(change[1].starts_with("    - line 1 of step 1: some output⏎line 2"), "{change:?}");
    assert!(change[2].starts_with("    + [tool: terminal → ok,"), "{change:?}");
    // The elision lists what it hid, each message by its number.
    let epoch2 = blocks[39];
    for idx in 2..=9 {
        assert!(epoch2.contains(&format!("\n    - #{idx} ")), "#{idx} missing:\n{epoch2}");
    }
    // Output grows with the changes: 52 headers, 106 new messages, 20 collapses of 3 lines and one
    // elision of 10.
    assert_eq!(text.lines().count(), 52 + 106 + 20 * 3 + 10, "{text}");

    // The transcript numbers messages from 0 too.
    let transcript = pare(&["sessions", "show", "s52", "--request", "1", "--archive", archive_dir]);
    let transcript = String::from_utf8(transcript.stdout).unwrap();
    assert!(transcript.contains("\n[0] system\n") && transcript.contains("\n[3] tool"), "{transcript}");
}

/// The plan `sessions_diff_shows_each_change_once` stores at request `k` (21: steps 1–10 collapsed;
/// 40: steps 1–4 elided into one marker, 5–20 collapsed), over that request's `raw` messages.
fn s52_plan(k: usize, raw: &[serde_json::Value]) -> pare::budget::compactor::SessionPlan {
    use pare::compact::Fate;
    use pare::compact::report::RuleId;
    let collapse = [RuleId::CollapseSucceeded].into_iter().collect();
    let (elided_steps, collapsed_to) = if k == 40 { (4, 20) } else { (0, 10) };
    let covered = 2 + 2 * collapsed_to;
    let mut prefix: Vec<String> = raw[..2].iter().map(|m| m.to_string()).collect();
    let mut plan = vec![Fate::Kept { at: 0 }, Fate::Kept { at: 1 }];
    if elided_steps > 0 {
        prefix.push(
            serde_json::json!({"role": "assistant", "content": "[pare: 8 earlier messages elided — terminal ×4]"})
                .to_string(),
        );
        plan.extend((0..2 * elided_steps).map(|_| Fate::Elided { at: 2 }));
    }
    for message in &raw[2 + 2 * elided_steps..covered] {
        let at = prefix.len();
        let mut message = message.clone();
        if message["role"] == "tool" {
            let chars = message["content"].as_str().unwrap().chars().count();
            message["content"] = format!("[tool: terminal → ok, {chars} chars, 6 lines]").into();
            plan.push(Fate::Rewritten { at, rules: collapse });
        } else {
            plan.push(Fate::Kept { at });
        }
        prefix.push(message.to_string());
    }
    let raw_text: Vec<String> = raw[..covered].iter().map(|m| m.to_string()).collect();
    let frozen = pare::budget::compactor::FrozenPlan {
        raw_hashes: pare::neutral::message_hashes(&raw_text),
        prefix,
        prefix_seen: Vec::new(),
        plan: Some(plan),
    };
    pare::budget::compactor::SessionPlan {
        epoch: if k == 40 { 2 } else { 1 },
        advanced_at_len: 0,
        saturated: false,
        frozen: Some(frozen),
        observed: false,
    }
}

/// Regression: `pare export --out FILE` wrote FILE 0644, readable by every user of the host, though
/// it holds the prompts and tool outputs of every session; a file that was there kept its mode.
#[cfg(unix)]
#[test]
fn an_export_file_is_readable_by_its_owner_only() {
    use std::os::unix::fs::PermissionsExt;

    use bytes::Bytes;
    use pare::archive::{Archive, ExchangeRecord};
    use pare::config::Durability;

    let dir = tempfile::tempdir().unwrap();
    let archive = Archive::start(dir.path().join("archive"), Durability::Buffered, std::time::Duration::from_millis(5));
    archive.record_exchange(ExchangeRecord {
        model: Some("m".into()),
        ..ExchangeRecord::unchanged(
            "s",
            1_700_000_000_000,
            Bytes::from_static(br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#),
        )
    });
    archive.close();
    let archive_dir = dir.path().join("archive");
    let existing = dir.path().join("existing.jsonl");
    std::fs::write(&existing, b"old rows").unwrap();
    std::fs::set_permissions(&existing, std::fs::Permissions::from_mode(0o644)).unwrap();
    for out_file in [dir.path().join("sft.jsonl"), existing] {
        let out =
            pare(&["export", "--archive", archive_dir.to_str().unwrap(), "--out", out_file.to_str().unwrap(), "sft"]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let mode = std::fs::metadata(&out_file).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{}", out_file.display());
    }
}
