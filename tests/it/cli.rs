//! The command line as a new user meets it: `pare check` lists every problem of a file in one run,
//! `pare serve`'s log lines carry no colour codes when stderr is not a terminal.

use std::path::Path;
use std::process::{Command, Output};

fn pare(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pare")).args(args).output().expect("run pare")
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
    assert!(got[2].2.contains("invalid type"), "{report}");
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
    use std::io::{BufRead, BufReader, Read, Write};

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
    let stderr = child.stderr.take().unwrap();
    let (lines_tx, lines_rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if lines_tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut seen: Vec<String> = Vec::new();
    let wait_for = |needle: &str, seen: &mut Vec<String>| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while std::time::Instant::now() < deadline {
            if let Ok(line) = lines_rx.recv_timeout(std::time::Duration::from_millis(200)) {
                let found = line.contains(needle);
                seen.push(line);
                if found {
                    return true;
                }
            }
        }
        false
    };
    let listening = wait_for("pare listening", &mut seen);
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
        answered = wait_for("total_ms=", &mut seen);
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(listening && answered, "{seen:#?}");
    for line in &seen {
        assert!(!line.contains('\u{1b}'), "an ANSI escape in {line:?}");
    }
    let access = seen.iter().find(|l| l.contains("total_ms=")).unwrap();
    let total = access.split("total_ms=").nth(1).unwrap().split(' ').next().unwrap();
    let decimals = total.split_once('.').map_or(0, |(_, d)| d.len());
    assert!(decimals <= 2, "{access}");
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
        archive.record_exchange(ExchangeRecord {
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
        });
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
