//! `pare sessions list|show|verify|delete`: audit the raw archive.
//!
//! `show` prints a readable transcript by default; `--raw`/`--forwarded` print exact body bytes (one
//! request with `--request N`, else every request, each followed by a newline: a session file `pare
//! replay` reads); `--diff` shows, per request, what changed since the request before: new
//! messages, and each message whose forwarded form changed (at an epoch, an eager advance), as the
//! original next to its replacement with the rules that made it, as the session's stored plans
//! say. Messages are numbered from 0.

use std::io::Write;
use std::process::ExitCode;

use serde_json::Value;

use crate::exchange::ObservedTotals;

use super::{SessionsArgs, SessionsCommand};
use crate::archive;
use crate::archive::query::{ArchiveReader, ExchangeInfo, SessionFigures, SessionFilter, SessionInfo};
use crate::archive::read::BodyKind;
use crate::archive::retention::delete_session;
use crate::archive::time::show_time;
use crate::archive::verify::{summary_line, verify};
use crate::budget::cost::{SessionCost, usd};
use crate::budget::price::Prices;
use crate::compact::markers::group_signed as n;
use crate::compact::provenance::Step;
use crate::exchange::Usage;

use super::compact::{change, mention};
use crate::config::Config;
use crate::session::content_text;
use crate::wire::Wire;

/// The archive in force: `--archive` (a directory or a `postgres://` URL), else `archive.url` or
/// `archive.dir` from `--config`, else the default directory.
pub(crate) fn archive_location(
    archive: Option<String>,
    config: Option<&std::path::Path>,
) -> anyhow::Result<archive::Location> {
    let config = Config::load(config)?;
    Ok(match archive {
        Some(text) => archive::Location::parse(&text, config.archive.password_file.as_deref())?,
        None => config.archive.location()?,
    })
}

/// Parse `--since` (see [`archive::time::parse_since`]).
pub(crate) fn parse_since(text: &str) -> anyhow::Result<i64> {
    archive::time::parse_since(text).map_err(|e| anyhow::anyhow!("--since {e}"))
}

pub fn run(args: SessionsArgs) -> anyhow::Result<ExitCode> {
    let dir = archive_location(args.archive, args.config.as_deref())?;
    match args.command {
        SessionsCommand::List { since, model, json } => {
            let since_ms = since.as_deref().map(parse_since).transpose()?;
            let reader = ArchiveReader::open(&dir)?;
            let filter = SessionFilter { since_ms, model, session: None };
            let sessions = reader.sessions(&filter)?;
            let prices = prices(args.config.as_deref())?;
            // Each session's exchanges, read once for its figures and its cost.
            let (mut figures, mut costs) = (Vec::new(), Vec::new());
            for s in &sessions {
                let exchanges = reader.exchanges(&s.id)?;
                figures.push(reader.figures(&exchanges)?);
                costs.push(archive::query::costs(&exchanges, &prices).1);
            }
            list(&sessions, &figures, &costs, json)?;
            Ok(ExitCode::SUCCESS)
        }
        SessionsCommand::Show { id, raw, forwarded, diff, request } => {
            let reader = ArchiveReader::open(&dir)?;
            let info = reader.session(&id)?;
            let request = request.map(|n| n as i64);
            if raw || forwarded {
                let kind = if raw { BodyKind::Raw } else { BodyKind::Forwarded };
                print_bodies(&reader, &info, kind, request)?;
            } else if diff {
                print_diff(&reader, &info, request)?;
            } else {
                print_transcript(&reader, &info, request, &prices(args.config.as_deref())?)?;
            }
            Ok(ExitCode::SUCCESS)
        }
        SessionsCommand::Verify { id } => {
            let reader = ArchiveReader::open(&dir)?;
            let report = verify(reader.conn(), id.as_deref())?;
            for problem in &report.problems {
                println!("FAIL {problem}");
            }
            println!("{}", summary_line(&report));
            Ok(if report.ok() { ExitCode::SUCCESS } else { ExitCode::from(1) })
        }
        SessionsCommand::Delete { id } => {
            let report = delete_session(&dir, &id)?;
            println!(
                "deleted session {id}: {} request(s), {} response(s), {} blob(s) freed",
                n(report.exchanges as i64),
                n(report.responses as i64),
                n(report.blobs_freed as i64)
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// Each model's price: `models:` prices from `--config` over the built-in table.
fn prices(config: Option<&std::path::Path>) -> anyhow::Result<Prices> {
    Ok(Prices::from_config(&Config::load(config)?))
}

/// The sessions as a table (the UI index's columns), or with `--json` as JSON Lines: one object per
/// session, one line each.
fn list(sessions: &[SessionInfo], figures: &[SessionFigures], costs: &[SessionCost], json: bool) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    if json {
        for ((s, f), cost) in sessions.iter().zip(figures).zip(costs) {
            let priced = cost.n_priced > 0;
            let mut line = serde_json::json!({
                "id": s.id,
                "started": show_time(s.started_ms),
                "last_activity": show_time(s.last_ms),
                "requests": s.n_requests,
                "model": s.model,
                "tokens_raw": s.tokens_raw,
                "tokens_forwarded": s.tokens_forwarded,
                "wire": s.wire,
                "upstream_answers_reported": s.upstream.n_reported,
                "upstream_prompt_tokens": s.upstream.prompt,
                "upstream_cached_tokens": s.upstream.cached,
                "upstream_cache_write_tokens": s.upstream.cache_write,
                "upstream_output_tokens": s.upstream.output,
                "upstream_cache_hit_rate": s.upstream.hit_rate(),
                "cost_usd_with_pare": priced.then_some(cost.with_pare),
                "cost_usd_without_pare": priced.then_some(cost.without_pare),
                "cost_unpriced_requests": cost.n_unpriced,
            });
            line.as_object_mut().expect("an object").extend(figures_json(s, f));
            writeln!(out, "{line}")?;
        }
        return Ok(());
    }
    writeln!(
        out,
        "{:<26}  {:<20}  {:<20}  {:>5}  {:<9}  {:<24}  {:>6}  {:>11}  {:>13}  {:<24}  {:>13}  {:<28}  {:<21}  tokens raw → forwarded",
        "ID",
        "STARTED",
        "LAST",
        "REQS",
        "WIRE",
        "MODEL",
        "EPOCHS",
        "SAVED (FWD)",
        "ATTRIBUTABLE",
        "UNCACHED PARE / RAW",
        "SAVED (UNC.)",
        "UPSTREAM CACHE HITS",
        "COST RAW (EST.) → PARE"
    )?;
    for ((s, f), cost) in sessions.iter().zip(figures).zip(costs) {
        let uncached = match f.prefill.requests.is_empty() {
            true => "not estimated".to_owned(),
            false => format!("{} / {}", n(f.prefill.with_pare() as i64), n(f.prefill.raw() as i64)),
        };
        writeln!(
            out,
            "{:<26}  {:<20}  {:<20}  {:>5}  {:<9}  {:<24}  {:>6}  {:>11}  {:>13}  {:<24}  {:>13}  {:<28}  {:<21}  {} → {}",
            s.id,
            show_time(s.started_ms),
            show_time(s.last_ms),
            n(s.n_requests),
            s.wire.unwrap_or("-"),
            s.model.as_deref().unwrap_or("-"),
            f.epochs,
            saved_share(s.tokens_raw, s.tokens_forwarded).map_or("-".into(), |x| format!("{:.1} %", 100.0 * x)),
            n(f.savings.net()),
            uncached,
            f.prefill.saved_text(),
            s.upstream.cache_hits(),
            cost_cell(cost),
            n(s.tokens_raw),
            n(s.tokens_forwarded)
        )?;
    }
    writeln!(
        out,
        "SAVED (FWD): forwarded tokens against raw · ATTRIBUTABLE: tokens, net of the epochs' cache misses · \
         UNCACHED: prompt tokens the upstream computed afresh with pare (its own figure where reported) and \
         without (estimated) · SAVED (UNC.): the same as a share (negative: compaction cost more prefill)"
    )?;
    Ok(())
}

/// `1 − forwarded / raw` in forwarded tokens; `None` without raw tokens.
fn saved_share(raw: i64, forwarded: i64) -> Option<f64> {
    (raw > 0).then(|| 1.0 - forwarded as f64 / raw as f64)
}

/// A session's figures beyond [`SessionInfo`] as `--json` keys (null: not known).
fn figures_json(s: &SessionInfo, f: &SessionFigures) -> serde_json::Map<String, Value> {
    let estimated = !f.prefill.requests.is_empty();
    let json = serde_json::json!({
        "epochs": f.epochs,
        "saved_forwarded_tokens_share": saved_share(s.tokens_raw, s.tokens_forwarded),
        "attributable_savings_tokens": f.savings.net(),
        "attributable_savings_misses_from": f.savings.source(),
        "uncached_prefill_pare_tokens": estimated.then(|| f.prefill.with_pare()),
        "uncached_prefill_raw_tokens": estimated.then(|| f.prefill.raw()),
        "uncached_prefill_pare_from": f.prefill.source(),
        "uncached_prefill_saved_share": f.prefill.saved(),
        "uncached_prefill_unestimated_requests": f.prefill.n_unknown,
        "raw_over_window_requests": f.prefill.n_raw_over_window(),
        "uncached_prefill_verdict": f.prefill.verdict(),
    });
    match json {
        Value::Object(map) => map,
        _ => unreachable!("a JSON object literal"),
    }
}

/// A session's cost in `sessions list`: "$0.0450 → $0.0210" (without pare, estimated → with pare),
/// "tokens only" for a model with no price, "-" when nothing was compacted.
fn cost_cell(cost: &SessionCost) -> String {
    match (cost.n_priced, cost.n_unpriced) {
        (0, 0) => "-".into(),
        (0, _) => "tokens only".into(),
        _ => format!("{} → {}", usd(cost.without_pare), usd(cost.with_pare)),
    }
}

fn print_bodies(
    reader: &ArchiveReader,
    info: &SessionInfo,
    kind: BodyKind,
    request: Option<i64>,
) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    match request {
        Some(seq) => out.write_all(&reader.body(&info.id, seq, kind)?)?,
        None => {
            for seq in 1..=info.n_requests {
                out.write_all(&reader.body(&info.id, seq, kind)?)?;
                out.write_all(b"\n")?;
            }
        }
    }
    out.flush()?;
    Ok(())
}

/// A body's conversation as neutral messages, read by the adapter of the exchange's path.
fn messages_of(path: &str, body: &[u8]) -> Vec<Value> {
    let wire = Wire::of_path(path).unwrap_or_default();
    match crate::wire::parse(wire, body) {
        Ok(parsed) => parsed.messages().iter().filter_map(|m| serde_json::from_str(m).ok()).collect(),
        Err(_) => Vec::new(),
    }
}

fn indent(text: &str) -> String {
    text.lines().map(|l| format!("    {l}")).collect::<Vec<_>>().join("\n")
}

/// One message as a readable block: role, tool calls, content. An opaque entry (the wire parts pare
/// does not read, [`crate::neutral::opaque`]) shows as those parts.
pub(crate) fn render_message(idx: usize, m: &Value) -> String {
    if m.is_array() {
        return format!("[{idx}] opaque\n{}", indent(&m.to_string()));
    }
    let role = m.get("role").and_then(Value::as_str).unwrap_or("?");
    let mut head = format!("[{idx}] {role}");
    if let Some(id) = m.get("tool_call_id").and_then(Value::as_str) {
        head.push_str(&format!(" (answers {id})"));
    }
    if let Some(name) = m.get("name").and_then(Value::as_str) {
        head.push_str(&format!(" {name}"));
    }
    let mut out = head;
    let text = content_text(m.get("content"));
    if !text.trim().is_empty() {
        out.push('\n');
        out.push_str(&indent(&text));
    }
    for call in m.get("tool_calls").and_then(Value::as_array).into_iter().flatten() {
        let f = call.get("function").cloned().unwrap_or(Value::Null);
        let name = f.get("name").and_then(Value::as_str).unwrap_or("?");
        let args = match f.get("arguments") {
            Some(Value::String(s)) => s.clone(),
            Some(other) => other.to_string(),
            None => String::new(),
        };
        let id = call.get("id").and_then(Value::as_str).unwrap_or("");
        out.push_str(&format!("\n    → {name}({args})  [{id}]"));
    }
    out
}

fn print_transcript(
    reader: &ArchiveReader,
    info: &SessionInfo,
    request: Option<i64>,
    prices: &Prices,
) -> anyhow::Result<()> {
    let seq = request.unwrap_or(info.n_requests);
    let exchanges = reader.exchanges(&info.id)?;
    let ex = exchanges
        .iter()
        .find(|e| e.seq == seq)
        .ok_or_else(|| anyhow::anyhow!("session {} has no request {seq}", info.id))?;
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "session {} · request {seq} of {} · {} · {} · model {} · {} bytes raw{}",
        info.id,
        info.n_requests,
        Wire::of_path(&ex.path).map_or("-", Wire::name),
        show_time(ex.at_ms),
        ex.model.as_deref().unwrap_or("-"),
        n(ex.raw_len),
        match ex.fwd_len {
            Some(len) => format!(" → {} bytes forwarded", n(len)),
            None => ", forwarded unchanged".into(),
        }
    )?;
    let figures = reader.figures(&exchanges)?;
    let savings = &figures.savings;
    writeln!(
        out,
        "session upstream cache hits {} · attributable savings {} tokens (removed {} − epoch cache misses {}, misses from {})",
        info.upstream.cache_hits(),
        n(savings.net()),
        n(savings.removed as i64),
        n(savings.misses() as i64),
        savings.source()
    )?;
    writeln!(out, "{}", prefill_lines(&figures, ex))?;
    let (request_costs, session_cost) = archive::query::costs(&exchanges, prices);
    let request_cost = exchanges.iter().zip(&request_costs).find(|(e, _)| e.seq == seq).and_then(|(_, c)| c.as_ref());
    writeln!(
        out,
        "cost: session {} · this request {}",
        session_cost.line(),
        request_cost.map_or_else(
            || "—".to_owned(),
            |c| format!("{} with pare, {} without (est.)", usd(c.with_pare), usd(c.without_pare))
        )
    )?;
    if let Some(observed) = ObservedTotals::of(exchanges.iter().filter_map(|e| e.summary.as_ref())) {
        writeln!(out, "{}", observed.line())?;
    }
    let raw = reader.body(&info.id, seq, BodyKind::Raw)?;
    let messages = messages_of(&ex.path, &raw);
    if messages.is_empty() {
        writeln!(out, "(no conversation pare reads: {} bytes; see --raw)", raw.len())?;
    }
    for (idx, m) in messages.iter().enumerate() {
        writeln!(out, "{}", render_message(idx, m))?;
    }
    match reader.response(&info.id, seq)? {
        None => writeln!(out, "── no answer recorded")?,
        Some(resp) => {
            let finish = resp.assembled.as_ref().and_then(|a| a.get("finish_reason")).cloned().unwrap_or(Value::Null);
            writeln!(
                out,
                "── answer (status {}, {}{}, finish_reason {finish})",
                resp.status.map(|s| s.to_string()).unwrap_or_else(|| "-".into()),
                resp.end_reason,
                if resp.partial { ", PARTIAL" } else { "" },
            )?;
            writeln!(out, "── upstream usage: {}", Usage::line(ex.usage.as_ref()))?;
            match resp.assembled.as_ref().and_then(|a| a.get("message")) {
                Some(m) => writeln!(out, "{}", render_message(messages.len(), m))?,
                None => writeln!(out, "{}", indent(&String::from_utf8_lossy(&resp.body)))?,
            }
        }
    }
    Ok(())
}

/// The session's uncached prefill in words, then the request's figures.
fn prefill_lines(figures: &SessionFigures, ex: &ExchangeInfo) -> String {
    let prefill = &figures.prefill;
    let mut text = format!("session uncached prefill: {}", prefill.verdict());
    if !prefill.requests.is_empty() {
        text.push_str(&format!(" (with pare from {})", prefill.source()));
    }
    match ex.prefill() {
        Some(r) => text.push_str(&format!(
            "\nrequest uncached prefill: {} with pare ({}) · {} without{}",
            n(r.with_pare as i64),
            r.source.name(),
            n(r.raw as i64),
            if r.raw_over_window { " · as sent it would not have fit the model's window" } else { "" }
        )),
        None => text.push_str("\nrequest uncached prefill: not estimated"),
    }
    text
}

/// How one request forwarded one raw message: what `--diff` compares with the request before.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Treatment {
    Kept,
    Edited(String),
    /// Elided with raw messages `start..end` behind this marker.
    Elided {
        start: usize,
        end: usize,
        marker: String,
    },
    Dropped,
}

/// Per raw message of one request: its bytes and how it was forwarded.
type Forwarding = Vec<(String, Treatment)>;

fn treatments(raw: &[&str], forwarded: &[String], steps: &[Step]) -> Forwarding {
    let mut out: Forwarding = raw.iter().map(|m| ((*m).to_owned(), Treatment::Kept)).collect();
    for step in steps {
        match *step {
            Step::Kept { .. } => {}
            Step::Edited { raw, fwd, .. } => out[raw].1 = Treatment::Edited(forwarded[fwd].clone()),
            Step::Elided { start, end, fwd } => {
                let marker = forwarded[fwd].clone();
                for entry in &mut out[start..end] {
                    entry.1 = Treatment::Elided { start, end, marker: marker.clone() };
                }
            }
            Step::Dropped { raw, .. } => out[raw].1 = Treatment::Dropped,
        }
    }
    out
}

fn print_diff(reader: &ArchiveReader, info: &SessionInfo, request: Option<i64>) -> anyhow::Result<()> {
    let exchanges = reader.exchanges(&info.id)?;
    let plans = archive::plan::history(reader.conn(), &info.id)?;
    let mut out = std::io::stdout().lock();
    let mut previous: Forwarding = Vec::new();
    for ex in &exchanges {
        if request.is_some_and(|n| ex.seq > n) {
            break;
        }
        let frozen = archive::plan::in_force(&plans, ex.id).and_then(|plan| plan.frozen.as_ref());
        let (block, now) = diff_block(reader, &info.id, ex, frozen, &previous)?;
        if request.is_none_or(|n| n == ex.seq) {
            out.write_all(block.as_bytes())?;
        }
        previous = now;
    }
    Ok(())
}

/// One request of `--diff`: a header, then in message order each message new since the request
/// before (one line) and each change to how a message is forwarded (original next to replacement,
/// with its rule); what the request before already forwarded the same way is not repeated.
fn diff_block(
    reader: &ArchiveReader,
    session: &str,
    ex: &ExchangeInfo,
    frozen: Option<&crate::budget::compactor::FrozenPlan>,
    previous: &Forwarding,
) -> anyhow::Result<(String, Forwarding)> {
    let raw_body = reader.body(session, ex.seq, BodyKind::Raw)?;
    let mut head = format!("request {} · {}", ex.seq, show_time(ex.at_ms));
    let wire = Wire::of_path(&ex.path).unwrap_or_default();
    let Ok(raw_parsed) = crate::wire::parse(wire, &raw_body) else {
        head.push_str(&format!(" · no conversation pare reads ({} bytes)\n", n(ex.raw_len)));
        return Ok((head, Vec::new()));
    };
    let raw = raw_parsed.messages();
    let plan = archive::plan::forwarding(&raw, frozen.filter(|_| ex.fwd_len.is_some()));
    let fwd: Vec<&str> = plan.messages.iter().map(String::as_str).collect();
    head.push_str(&format!(" · messages {} → {}", n(raw.len() as i64), n(fwd.len() as i64)));
    if let Some(summary) = &ex.summary {
        head.push_str(&format!(" · tokens {} → {}", n(summary.tokens_raw as i64), n(summary.tokens_forwarded as i64)));
        if summary.epoch_started {
            head.push_str(&format!(" · epoch {} starts", summary.epoch));
        }
    }
    if ex.fwd_len.is_none() {
        head.push_str(" · forwarded as sent");
        if let Some(why) = &ex.skipped {
            head.push_str(&format!(" ({why})"));
        }
    }
    head.push('\n');
    let Some(steps) = plan.steps else {
        head.push_str("  (what became of each message is not in this archive's plans)\n");
        return Ok((head, Vec::new()));
    };
    let now = treatments(&raw, &plan.messages, &steps);
    let mut lines = String::new();
    for step in &steps {
        let range = step.raw_range();
        let seen_alike = range.clone().all(|i| previous.get(i).is_some_and(|p| *p == now[i]));
        if seen_alike {
            continue;
        }
        let is_new = range.clone().all(|i| previous.get(i).is_none_or(|p| p.0 != now[i].0));
        let text = match (step, is_new) {
            (Step::Kept { raw: idx, .. }, true) => format!("+ {}\n", mention(*idx, raw[*idx])),
            (Step::Kept { raw: idx, .. }, false) => format!("#{idx} forwarded as sent again\n"),
            _ => match change(*step, &raw, &fwd) {
                Some(block) if is_new => format!("+ new {block}"),
                Some(block) => block,
                None => continue,
            },
        };
        for line in text.lines() {
            lines.push_str("  ");
            lines.push_str(line);
            lines.push('\n');
        }
    }
    if lines.is_empty() {
        lines.push_str("  (nothing new)\n");
    }
    Ok((head + &lines, now))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An opaque entry prints as the wire parts it carries, a message as its role and text.
    #[test]
    fn an_opaque_entry_prints_its_parts() {
        let opaque = crate::neutral::opaque(&[r#"{"type":"web_search_call","id":"ws_1"}"#]);
        let value: Value = serde_json::from_str(&opaque).unwrap();
        assert_eq!(render_message(2, &value), "[2] opaque\n    [{\"type\":\"web_search_call\",\"id\":\"ws_1\"}]");
        let user = serde_json::json!({"role": "user", "content": "hello"});
        assert_eq!(render_message(3, &user), "[3] user\n    hello");
    }
}
