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
