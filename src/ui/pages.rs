//! The markup of the audit UI (maud: checked at compile time, every interpolated value escaped).
//! Styles are inline in the page; there is no script. Text that came from an agent or a model is
//! shown through [`Shown`]: bidirectional controls and invisible characters become visible marks,
//! and the text is isolated (`<bdi>`) so that right-to-left runs cannot reorder what is around it.

use std::collections::HashMap;

use maud::{DOCTYPE, Markup, PreEscaped, Render, html};
use serde_json::Value;

use super::{PAGE_SIZE, PREFIX, Query, messages_of, percent_encode};
use crate::archive::plan::forwarding;
use crate::archive::prefill::SessionPrefill;
use crate::archive::query::{
    ExchangeInfo, ResponseInfo, Savings, SessionFigures, SessionInfo, SessionPage, UpstreamUsage,
};
use crate::archive::verify::{VerifyReport, summary_line};
use crate::budget::compactor::FrozenPlan;
use crate::budget::cost::{CostSource, RequestCost, SessionCost, usd};
use crate::compact::markers::{group_digits, one_line};
use crate::compact::provenance::Step;
use crate::exchange::Usage;
use crate::exchange::{CompactionSummary, ObservedTotals};
use crate::session::content_text;
use crate::wire::Wire;

const STYLE: &str = r#"
*{box-sizing:border-box}
body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"Noto Sans",sans-serif;color:#1f2328;background:#f6f8fa}
header{background:#1f2937;color:#f9fafb;padding:10px 24px;display:flex;gap:16px;align-items:baseline}
header a{color:#f9fafb;text-decoration:none;font-weight:600;font-size:16px}
header .where{color:#9ca3af;font-size:12px}
main{padding:16px 24px 40px}
h1{font-size:18px;margin:4px 0 12px}
h2{font-size:15px;margin:22px 0 8px}
a{color:#0b5cad}
code,.mono,pre{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12.5px}
table{border-collapse:collapse;width:100%;background:#fff;border:1px solid #d0d7de;border-radius:6px}
th,td{padding:5px 8px;border-bottom:1px solid #eaeef2;text-align:left;vertical-align:middle;white-space:nowrap}
th{background:#f0f3f6;font-weight:600;font-size:12px;color:#57606a}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums}
td.wide{white-space:normal;width:38%}
tr:hover td{background:#f8fafc}
.bar{position:relative;height:16px;min-width:240px;background:#f0f3f6;border-radius:3px}
.bar .raw{position:absolute;left:0;top:0;bottom:0;background:#bcd0ea;border-radius:3px}
.bar .fwd{position:absolute;left:0;top:4px;bottom:4px;background:#2f6fb8;border-radius:2px}
.bar .win{position:absolute;top:-3px;bottom:-3px;width:2px;background:#c2410c}
.badge{display:inline-block;padding:0 6px;border-radius:10px;font-size:11.5px;font-weight:600;line-height:18px;background:#eef2f6;color:#374151}
.ok{background:#dcfce7;color:#166534}.bad{background:#fee2e2;color:#991b1b}.warn{background:#fef3c7;color:#92400e}
.epoch{background:#ede9fe;color:#5b21b6}.rule{background:#e0f2fe;color:#075985}
.muted{color:#6e7781}
.filters{display:flex;gap:10px;align-items:end;flex-wrap:wrap;margin-bottom:12px}
.filters label{display:flex;flex-direction:column;font-size:12px;color:#57606a;gap:2px}
input{font:inherit;padding:4px 6px;border:1px solid #d0d7de;border-radius:4px}
button,.button{font:inherit;font-size:13px;padding:4px 10px;border:1px solid #d0d7de;border-radius:5px;background:#fff;color:#1f2328;text-decoration:none;cursor:pointer;display:inline-block}
.button:hover,button:hover{background:#f3f4f6}
.actions{display:flex;gap:8px;flex-wrap:wrap;align-items:center;margin:8px 0}
.pager{display:flex;gap:12px;align-items:center;margin:10px 0}
.facts{display:flex;gap:22px;flex-wrap:wrap;background:#fff;border:1px solid #d0d7de;border-radius:6px;padding:10px 14px}
.facts div{display:flex;flex-direction:column}.facts b{font-size:15px}.facts span{font-size:11.5px;color:#57606a}
.legend{font-size:12px;color:#57606a;margin:6px 0}
.legend i{display:inline-block;width:12px;height:10px;margin:0 4px 0 10px;vertical-align:middle}
details{background:#fff;border:1px solid #d0d7de;border-radius:6px;margin:6px 0}
details>summary{cursor:pointer;padding:5px 10px;color:#57606a}
details[open]>summary{border-bottom:1px solid #eaeef2}
.change{background:#fff;border:1px solid #d0d7de;border-left:4px solid #2f6fb8;border-radius:6px;margin:8px 0}
.change.dropped{border-left-color:#c2410c}.change.elided{border-left-color:#7c3aed}
.change>.head{padding:5px 10px;border-bottom:1px solid #eaeef2;display:flex;gap:8px;align-items:center}
.pair{display:grid;grid-template-columns:1fr 1fr}
.pair>div{min-width:0;padding:6px 10px}.pair>div+div{border-left:1px solid #eaeef2;background:#fbfdff}
.side{font-size:11px;text-transform:uppercase;letter-spacing:.04em;color:#6e7781;margin-bottom:2px}
.msg{margin:4px 0}
.role{font-weight:600;font-size:12.5px}
.role.user{color:#1a7f37}.role.assistant{color:#0b5cad}.role.tool{color:#8250df}.role.system{color:#9a6700}
pre{white-space:pre-wrap;word-break:break-word;margin:2px 0;max-height:26em;overflow:auto;background:#f6f8fa;border-radius:4px;padding:6px 8px}
.call{color:#8250df}
.error{background:#fff;border:1px solid #d0d7de;border-left:4px solid #c2410c;border-radius:6px;padding:12px 16px}
.cc{font:10.5px ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;color:#9a3412;background:#ffedd5;border:1px solid #fdba74;border-radius:3px;padding:0 2px;margin:0 1px}
"#;

/// Characters that change how the text around them is drawn without being seen: bidirectional
/// controls (which can make `exe.txt` read as `txt.exe`), zero-width characters and joiners, the
/// byte-order mark, the soft hyphen, and Unicode tag characters (invisible ASCII look-alikes used to
/// smuggle instructions past a reader).
fn is_hidden(c: char) -> bool {
    matches!(c,
        '\u{00AD}' | '\u{061C}' | '\u{180E}' | '\u{200B}'..='\u{200F}' | '\u{202A}'..='\u{202E}'
        | '\u{2060}'..='\u{2064}' | '\u{2066}'..='\u{2069}' | '\u{FEFF}' | '\u{E0000}'..='\u{E007F}')
}

/// The name a hidden character is shown with (its tooltip).
fn hidden_name(c: char) -> &'static str {
    match c {
        '\u{00AD}' => "soft hyphen",
        '\u{061C}' => "Arabic letter mark",
        '\u{180E}' => "Mongolian vowel separator",
        '\u{200B}' => "zero-width space",
        '\u{200C}' => "zero-width non-joiner",
        '\u{200D}' => "zero-width joiner",
        '\u{200E}' => "left-to-right mark",
        '\u{200F}' => "right-to-left mark",
        '\u{202A}' => "left-to-right embedding",
        '\u{202B}' => "right-to-left embedding",
        '\u{202C}' => "pop directional formatting",
        '\u{202D}' => "left-to-right override",
        '\u{202E}' => "right-to-left override",
        '\u{2060}' => "word joiner",
        '\u{2066}' => "left-to-right isolate",
        '\u{2067}' => "right-to-left isolate",
        '\u{2068}' => "first strong isolate",
        '\u{2069}' => "pop directional isolate",
        '\u{FEFF}' => "zero-width no-break space (byte-order mark)",
        '\u{E0000}'..='\u{E007F}' => "tag character",
        _ => "invisible character",
    }
}

/// Text from an agent, a model or a tool, as the page shows it: HTML-escaped, each hidden character
/// ([`is_hidden`]) replaced by a visible mark naming its code point, the whole in a `<bdi>` so that
/// its direction stays inside it.
pub struct Shown<'a>(pub &'a str);

impl Render for Shown<'_> {
    fn render_to(&self, out: &mut String) {
        out.push_str("<bdi>");
        let mut rest = self.0;
        while let Some((at, c)) = rest.char_indices().find(|(_, c)| is_hidden(*c)) {
            rest[..at].render_to(out);
            out.push_str(&format!("<span class=\"cc\" title=\"{}\">U+{:04X}</span>", hidden_name(c), c as u32));
            rest = &rest[at + c.len_utf8()..];
        }
        rest.render_to(out);
        out.push_str("</bdi>");
    }
}

/// Longest text shown of one message; the downloads have every byte.
const SHOWN_CHARS: usize = 20_000;

fn layout(title: &str, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · pare" }
                style { (PreEscaped(STYLE)) }
            }
            body {
                header {
                    a href={ (PREFIX) "/" } { "pare · archive" }
                    span.where { "audit of what agents sent and what models saw" }
                }
                main { (body) }
            }
        }
    }
}

pub fn error_page(title: &str, detail: &str) -> Markup {
    layout(
        title,
        html! {
            div.error { h1 { (title) } p { (detail) } p { a href={ (PREFIX) "/" } { "All sessions" } } }
        },
    )
}

/// A time for people: UTC, to the second.
fn show_time(ms: i64) -> String {
    crate::archive::time::show_time(ms).replacen('T', " ", 1).trim_end_matches('Z').to_owned()
}

fn int(n: i64) -> String {
    let digits = group_digits(n.unsigned_abs() as usize);
    if n < 0 { format!("-{digits}") } else { digits }
}

fn saved(raw: i64, forwarded: i64) -> String {
    if raw <= 0 { "—".into() } else { format!("{:.1} %", 100.0 * (raw - forwarded) as f64 / raw as f64) }
}

fn session_href(id: &str) -> String {
    format!("{PREFIX}/session/{}", percent_encode(id))
}

fn request_href(id: &str, seq: i64) -> String {
    format!("{PREFIX}/session/{}/request/{seq}", percent_encode(id))
}

fn index_href(query: &str) -> String {
    if query.is_empty() { format!("{PREFIX}/") } else { format!("{PREFIX}/?{query}") }
}

fn export_buttons(query: &str) -> Markup {
    let amp = if query.is_empty() { "" } else { "&" };
    html! {
        a.button href={ (PREFIX) "/export/sft?" (query) } { "SFT JSONL (OpenAI)" }
        a.button href={ (PREFIX) "/export/sft?" (query) (amp) "format=sharegpt" } { "SFT JSONL (ShareGPT)" }
        a.button href={ (PREFIX) "/export/dpo?" (query) } { "DPO JSONL" }
    }
}

pub fn index(
    archive: &str,
    query: &Query,
    page: &SessionPage,
    figures: &[SessionFigures],
    verified: &HashMap<String, (i64, bool)>,
    costs: &HashMap<String, SessionCost>,
) -> Markup {
    let pages = ((page.total + PAGE_SIZE - 1) / PAGE_SIZE).max(1);
    let first = (query.page - 1) * PAGE_SIZE;
    let filter_query = query.to_query(1);
    let pager = html! {
        div.pager {
            @if query.page > 1 {
                a.button rel="prev" href=(index_href(&query.to_query(query.page - 1))) { "← newer" }
            }
            span.muted {
                @if page.sessions.is_empty() { "no sessions" } @else {
                    (int(first + 1)) "–" (int(first + page.sessions.len() as i64)) " of " (int(page.total))
                    " sessions · page " (query.page) " of " (pages)
                }
            }
            @if query.page < pages {
                a.button rel="next" href=(index_href(&query.to_query(query.page + 1))) { "older →" }
            }
        }
    };
    layout(
        "Sessions",
        html! {
            h1 { "Sessions" span.muted { " · " code { (archive) } } }
            form.filters method="get" action={ (PREFIX) "/" } {
                label { "Model contains" input name="model" value=[query.model.as_deref()] placeholder="qwen"; }
                label { "Active since" input name="since" value=[query.since.as_deref()] placeholder="YYYY-MM-DD"; }
                button type="submit" { "Filter" }
                @if query.model.is_some() || query.since.is_some() { a.button href={ (PREFIX) "/" } { "Clear" } }
                span.actions { span.muted { "Export these sessions:" } (export_buttons(&filter_query)) }
            }
            (pager)
            table id="sessions" {
                thead { tr {
                    th { "Session" } th { "Model" } th { "Wire" } th.num { "Requests" } th { "First (UTC)" } th { "Last (UTC)" }
                    th.num { "Tokens raw → forwarded" } th.num title=(SAVED_FORWARDED) { "Saved (forwarded tokens)" }
                    (prefill_heads())
                    th.num title="prompt tokens the upstream reported read from its cache" { "Cache hits" }
                    th.num { "Epochs" } th.num { "Partial" }
                    th.num title="estimated without pare → with pare, USD at the model's price" { "Cost" }
                    th { "Verified" }
                } }
                tbody {
                    @for (s, f) in page.sessions.iter().zip(figures) {
                        tr {
                            td.mono { a href=(session_href(&s.info.id)) { (Shown(&s.info.id)) } }
                            td { (Shown(s.info.model.as_deref().unwrap_or("—"))) }
                            td { span.badge { (s.info.wire.unwrap_or("—")) } }
                            td.num { (int(s.info.n_requests)) }
                            td.muted { (show_time(s.info.started_ms)) }
                            td.muted { (show_time(s.info.last_ms)) }
                            td.num { (int(s.info.tokens_raw)) " → " (int(s.info.tokens_forwarded)) }
                            td.num { (saved(s.info.tokens_raw, s.info.tokens_forwarded)) }
                            (prefill_cells(f))
                            td.num.upstream { (hit_rate_cell(&s.info.upstream)) }
                            td.num { @if s.epochs > 0 { span.badge.epoch { (s.epochs) } } @else { span.muted { "0" } } }
                            td.num { @if s.partial > 0 { span.badge.warn { (s.partial) } } @else { span.muted { "0" } } }
                            td.num.cost { (session_cost_cell(costs.get(&s.info.id))) }
                            td { (verify_badge(verified.get(&s.info.id), s.info.n_requests)) }
                        }
                    }
                }
            }
            @if page.total > PAGE_SIZE { (pager) }
        },
    )
}

fn verify_badge(cached: Option<&(i64, bool)>, n_requests: i64) -> Markup {
    match cached {
        Some(&(n, true)) if n == n_requests => html! { span.badge.ok { "✓ verified" } },
        Some(&(n, false)) if n == n_requests => html! { span.badge.bad { "✗ failed" } },
        _ => html! { span.muted title="verified when the session is opened" { "not yet" } },
    }
}

/// One line saying what an answer was: its text's first line, or its calls.
fn answer_summary(wire: Option<Wire>, answer: Option<&ResponseInfo>) -> Markup {
    let Some(answer) = answer else { return html! { span.muted { "no answer recorded" } } };
    // The answer as the neutral messages it stands for, as the session tracker reads it; an answer
    // to a path pare does not compact as its `message`.
    let assembled = answer.assembled.as_ref();
    let messages: Vec<Value> = match (wire, assembled) {
        (Some(wire), Some(assembled)) => crate::archive::response::answer_messages(wire, assembled),
        _ => None,
    }
    .unwrap_or_else(|| assembled.and_then(|a| a.get("message")).cloned().into_iter().collect());
    let text = messages.iter().map(|m| content_text(m.get("content"))).collect::<Vec<_>>().join("\n");
    let first_line = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
    let calls: Vec<String> = messages
        .iter()
        .filter_map(|m| m.get("tool_calls"))
        .filter_map(Value::as_array)
        .flatten()
        .map(|call| {
            let f = call.get("function");
            let name = f.and_then(|f| f.get("name")).and_then(Value::as_str).unwrap_or("?");
            let args = match f.and_then(|f| f.get("arguments")) {
                Some(Value::String(s)) => s.clone(),
                Some(other) => other.to_string(),
                None => String::new(),
            };
            format!("→ {name}({})", one_line(&args, 60))
        })
        .collect();
    html! {
        @if answer.partial { span.badge.warn { "partial" } " " }
        @if let Some(status) = answer.status.filter(|s| *s >= 400) { span.badge.bad { (status) } " " }
        @if !first_line.is_empty() { (Shown(&one_line(first_line, 110))) " " }
        @for call in &calls { span.call { (Shown(call)) } " " }
        @if first_line.is_empty() && calls.is_empty() && messages.is_empty() { span.muted { (answer.end_reason) } }
    }
}

/// A request's window as the page shows it: the model's whole window and the part of it a prompt may
/// use (the rest is reserved for the answer). "Over window" means over the usable part.
#[derive(Debug, Clone, Copy)]
struct Window {
    whole: u64,
    reserve: u64,
}

impl Window {
    fn of(summary: Option<&CompactionSummary>) -> Option<Window> {
        summary.and_then(|s| s.report.as_ref()).map(|r| Window { whole: r.window, reserve: r.reserve })
    }

    fn usable(self) -> u64 {
        self.whole.saturating_sub(self.reserve)
    }

    /// "usable 12,288 of window 16,384 (4,096 reserved for the answer)".
    fn describe(self) -> String {
        format!(
            "usable {} of window {} ({} reserved for the answer)",
            int(self.usable() as i64),
            int(self.whole as i64),
            int(self.reserve as i64)
        )
    }
}

/// Raw and forwarded tokens against the usable window (the line the over-window badge compares
/// with); its tooltip gives the whole window and the reserve too.
fn bar(raw: u64, forwarded: u64, window: Option<Window>, scale: u64) -> Markup {
    let pct = |n: u64| format!("{:.2}%", 100.0 * n as f64 / scale.max(1) as f64);
    html! {
        div.bar title={ (int(raw as i64)) " raw → " (int(forwarded as i64)) " forwarded tokens" } {
            div.raw style={ "width:" (pct(raw)) } {}
            div.fwd style={ "width:" (pct(forwarded)) } {}
            @if let Some(window) = window { div.win style={ "left:" (pct(window.usable())) } title=(window.describe()) {} }
        }
    }
}

/// A session's upstream cache hit rate in the index ("72.7 %", its base in the tooltip), or
/// "not reported".
fn hit_rate_cell(upstream: &UpstreamUsage) -> Markup {
    let title = format!("upstream cache hits: {}", upstream.cache_hits());
    match upstream.hit_rate() {
        Some(rate) => html! { span title=(title) { (format!("{:.1} %", 100.0 * rate)) } },
        None => html! { span.muted title=(title) { "not reported" } },
    }
}

/// One answer's upstream cache figures in a table cell: "2,048 / 3,000 (68.3 %)", or what was not
/// reported; the tooltip has every figure.
fn upstream_cell(usage: Option<&Usage>) -> Markup {
    let title = Usage::line(usage);
    match usage {
        Some(Usage { prompt: Some(prompt), cached: Some(cached), .. }) => html! {
            span title=(title) { (int(*cached as i64)) " / " (int(*prompt as i64))
                @if let Some(rate) = usage.and_then(Usage::hit_rate) { " (" (format!("{:.1} %", 100.0 * rate)) ")" } }
        },
        Some(Usage { prompt: Some(prompt), .. }) => html! {
            span.muted title=(title) { "cache not reported (prompt " (int(*prompt as i64)) ")" }
        },
        _ => html! { span.muted title=(title) { "not reported" } },
    }
}

/// What "saved" means where it stands alone: forwarded tokens against raw ones.
const SAVED_FORWARDED: &str =
    "1 − forwarded/raw prompt tokens: what compaction removed, before prompt caches (see uncached prefill)";

/// What the uncached prefill columns mean.
const UNCACHED: &str = "prompt tokens the upstream computed afresh (not read from its prompt cache): with pare, \
    the upstream's own prompt − cached where it reported both, else pare's estimate; raw, pare's estimate for the \
    requests as the agent sent them (each less its longest prefix shared with the request before)";

/// The index's uncached prefill headings (see [`prefill_cells`]).
fn prefill_heads() -> Markup {
    html! {
        th.num title="tokens removed net of the cache misses pare's epochs caused" { "Attributable" }
        th.num title=(UNCACHED) { "Uncached prefill pare / raw" }
        th.num title="1 − uncached with pare / uncached raw (negative: compaction cost more prefill than it saved)" { "Saved (uncached prefill)" }
    }
}

/// A session's attributable savings and uncached prefill in the index.
fn prefill_cells(figures: &SessionFigures) -> Markup {
    let prefill = &figures.prefill;
    let over = prefill.n_raw_over_window();
    html! {
        td.num { (int(figures.savings.net())) }
        td.num.prefill title=(prefill.verdict()) {
            @if prefill.requests.is_empty() { span.muted { "not estimated" } } @else {
                (int(prefill.with_pare() as i64)) " / " (int(prefill.raw() as i64))
            }
        }
        td.num.prefill-saved title=(prefill.verdict()) {
            @if prefill.with_pare() > prefill.raw() { span.badge.bad { (prefill.saved_text()) } } @else { (prefill.saved_text()) }
            @if over > 0 { " " span.badge.ok title="requests that as sent would not have fit the model's window" { (over) " fit" } }
        }
    }
}

/// The session page's uncached prefill facts.
fn prefill_facts(prefill: &SessionPrefill) -> Markup {
    html! {
        div id="uncached-prefill" title=(UNCACHED) {
            b { (int(prefill.with_pare() as i64)) " / " (int(prefill.raw() as i64)) }
            span { "uncached prefill, with pare (" (prefill.source()) ") / without (estimate)" }
        }
        div { b { (prefill.saved_text()) } span { "saved (uncached prefill)" } }
        div { b { (prefill.n_raw_over_window()) } span { "requests that fit only with pare" } }
    }
}

/// The verdict in words and the chart of cumulative uncached prefill.
fn prefill_block(prefill: &SessionPrefill) -> Markup {
    let cost_more = prefill.with_pare() > prefill.raw();
    html! {
        div id="prefill" {
            h2 { "Uncached prefill, with and without pare" }
            p.verdict.(if cost_more { "bad" } else { "ok" }) style="padding:6px 10px;border-radius:6px" { (prefill.verdict()) }
            @if prefill.n_unknown > 0 {
                p.muted { (prefill.n_unknown) " request(s) carry no estimate and are left out of both sums." }
            }
            @if !prefill.requests.is_empty() { (prefill_chart(prefill)) }
        }
    }
}

/// Cumulative uncached prefill over the requests, with pare and without: two lines in an inline SVG,
/// epochs aside. Each point's tooltip gives its figures.
fn prefill_chart(prefill: &SessionPrefill) -> Markup {
    const W: f64 = 720.0;
    const H: f64 = 220.0;
    const PAD: f64 = 48.0;
    let points = prefill.cumulative();
    let top = points.iter().map(|&(_, p, r)| p.max(r)).max().unwrap_or(0).max(1) as f64;
    let last = points.len().max(2) - 1;
    let x = |i: usize| PAD + (W - 2.0 * PAD) * i as f64 / last as f64;
    // 0 on the axis, the top figure half a margin below the top edge.
    let y = |v: u64| (H - PAD) - (H - 1.5 * PAD) * v as f64 / top;
    let line = |side: fn(&(i64, u64, u64)) -> u64| {
        points.iter().enumerate().map(|(i, p)| format!("{:.1},{:.1}", x(i), y(side(p)))).collect::<Vec<_>>().join(" ")
    };
    let (first_seq, last_seq) = (points.first().map_or(0, |p| p.0), points.last().map_or(0, |p| p.0));
    html! {
        svg id="prefill-chart" viewBox={ "0 0 " (W) " " (H) } width=(W) height=(H) role="img"
            aria-label="cumulative uncached prefill tokens over the requests, with pare and without"
            style="background:#fff;border:1px solid #d0d7de;border-radius:6px;max-width:100%" {
            title { "Cumulative uncached prefill: " (prefill.verdict()) }
            line x1=(PAD) y1=(H - PAD) x2=(W - PAD) y2=(H - PAD) stroke="#d0d7de" {}
            line x1=(PAD) y1=(PAD / 2.0) x2=(PAD) y2=(H - PAD) stroke="#d0d7de" {}
            text x=(PAD - 4.0) y=(y(top as u64) + 4.0) text-anchor="end" font-size="11" fill="#57606a" { (int(top as i64)) }
            text x=(PAD - 4.0) y=(H - PAD + 4.0) text-anchor="end" font-size="11" fill="#57606a" { "0" }
            text x=(PAD) y=(H - PAD + 16.0) font-size="11" fill="#57606a" { "request " (first_seq) }
            text x=(W - PAD) y=(H - PAD + 16.0) text-anchor="end" font-size="11" fill="#57606a" { "request " (last_seq) }
            polyline.raw points=(line(|p| p.2)) fill="none" stroke="#9ca3af" stroke-width="2" stroke-dasharray="5 3" {}
            polyline.pare points=(line(|p| p.1)) fill="none" stroke="#2f6fb8" stroke-width="2" {}
            @for (i, &(seq, with_pare, raw)) in points.iter().enumerate() {
                circle cx=(format!("{:.1}", x(i))) cy=(format!("{:.1}", y(with_pare))) r="2.5" fill="#2f6fb8" {
                    title { "request " (seq) ": " (int(with_pare as i64)) " with pare, " (int(raw as i64)) " without (cumulative)" }
                }
            }
            text x=(PAD + 8.0) y=(PAD / 2.0 + 4.0) font-size="12" fill="#2f6fb8" { "— with pare" }
            text x=(PAD + 110.0) y=(PAD / 2.0 + 4.0) font-size="12" fill="#6e7781" { "- - without pare (estimate)" }
        }
    }
}

/// One request's uncached prefill in the session table: "1,200 / 300", the source in the tooltip.
fn request_prefill_cell(exchange: &ExchangeInfo) -> Markup {
    match exchange.prefill() {
        Some(r) => html! {
            span title={ "with pare: " (r.source.name()) "; without: estimate" } {
                (int(r.with_pare as i64)) " / " (int(r.raw as i64))
            }
            @if r.raw_over_window { " " span.badge.ok title="as sent, this request would not have fit the model's window" { "fits only with pare" } }
        },
        None => html! { span.muted { "—" } },
    }
}

/// A session's cost in a table cell: "$0.0450 → $0.0210" (without pare, estimated → with pare), or
/// "tokens only" for a model with no price.
fn session_cost_cell(cost: Option<&SessionCost>) -> Markup {
    match cost {
        Some(cost) if cost.n_priced > 0 => html! {
            span title=(cost.line()) { (usd(cost.without_pare)) " → " (usd(cost.with_pare)) }
        },
        Some(cost) if cost.n_unpriced > 0 => html! { span.muted title=(cost.line()) { "tokens only" } },
        _ => html! { span.muted { "—" } },
    }
}

/// One request's cost in a table cell (without pare → with pare), or why there is none.
fn request_cost_cell(cost: Option<&RequestCost>, compacted: bool) -> Markup {
    match cost {
        Some(cost) => {
            let source = match cost.source {
                CostSource::Provider => "the upstream's figures",
                CostSource::Mixed => "the upstream's prompt, pare's cache estimate",
                CostSource::Estimate => "pare's estimate",
            };
            html! { span title={ "with pare from " (source) "; without pare estimated" } {
                (usd(cost.without_pare)) " → " (usd(cost.with_pare))
            } }
        }
        None if compacted => html! { span.muted title="no price for this model" { "tokens only" } },
        None => html! { span.muted { "—" } },
    }
}

/// The session's cost with pare and without it, and how it was reckoned.
fn cost_block(cost: &SessionCost) -> Markup {
    html! {
        details id="cost" {
            summary { "Cost: " b { (cost.line()) } }
            p {
                "At the model's price (the built-in table from litellm's, or a models: entry's price), USD. "
                "With pare: the upstream's reported usage — uncached input, cache reads, cache writes, output — "
                "else pare's estimate (the forwarded prompt, the part shared with the previous forwarded prompt read "
                "from the cache; an epoch request wholly uncached). Without pare: an estimate of the same requests "
                "sent raw (the previous raw prompt read from the cache, in the upstream's tokens when it reported "
                "them). Where the provider bills cache writes, the uncached part of a prompt is a write (5-minute "
                "rate). A model with no price shows tokens only."
            }
        }
    }
}

/// The session's attributable savings and how they were reckoned.
fn savings_block(savings: &Savings) -> Markup {
    html! {
        details id="savings" {
            summary {
                "Attributable savings: " b { (int(savings.net())) " tokens" }
                " = removed " (int(savings.removed as i64)) " − epoch cache misses " (int(savings.misses() as i64))
                " (misses from " (savings.source()) ")"
            }
            p {
                "net = Σ (R − F) over every request − Σ max(0, U − N) over the requests where pare started an epoch. "
                "R and F: the prompt as the agent sent it and as pare forwarded it (pare's count); what pare removed is "
                "priced as uncached input. U: the prompt tokens the upstream computed afresh on that request — its own "
                "figure (prompt − cached) when its answer reported both (provider), else pare's estimate: F less the "
                "part of it in the prefix shared with the request before (estimate). N: the tokens the agent added since "
                "its previous request, which an append would have sent uncached anyway."
            }
            @if !savings.epochs.is_empty() {
                table id="epoch-misses" {
                    thead { tr { th.num { "Request" } th.num { "Cache misses" } th { "From" } } }
                    tbody { @for miss in &savings.epochs { tr {
                        td.num { (miss.seq) }
                        td.num { (int(miss.tokens as i64)) }
                        td { (miss.source.name()) }
                    } } }
                }
            }
        }
    }
}

/// What epoch mode would have done with a session mode `observe` forwarded unchanged.
fn observed_block(exchanges: &[ExchangeInfo]) -> Markup {
    let Some(observed) = ObservedTotals::of(exchanges.iter().filter_map(|e| e.summary.as_ref())) else {
        return html! {};
    };
    html! { p id="observed" { (observed.line()) } }
}

pub fn session(
    info: &SessionInfo,
    exchanges: &[ExchangeInfo],
    answers: &[Option<ResponseInfo>],
    report: &VerifyReport,
    figures: &SessionFigures,
    costs: &(Vec<Option<RequestCost>>, SessionCost),
) -> Markup {
    let savings = &figures.savings;
    let prefill = &figures.prefill;
    let (request_costs, session_cost) = costs;
    let tokens = |e: &ExchangeInfo, of: fn(&CompactionSummary) -> u64| e.summary.as_ref().map(of);
    let window = |e: &ExchangeInfo| Window::of(e.summary.as_ref());
    let scale = exchanges
        .iter()
        .flat_map(|e| [tokens(e, |s| s.tokens_raw), window(e).map(Window::usable)])
        .flatten()
        .max()
        .unwrap_or(1);
    let epochs = exchanges.iter().filter_map(|e| tokens(e, |s| s.epoch)).max().unwrap_or(0);
    let partial = answers.iter().flatten().filter(|a| a.partial).count();
    let wire = info.wire.unwrap_or("—");
    let session_query = format!("session={}", percent_encode(&info.id));
    layout(
        &format!("Session {}", info.id),
        html! {
            h1 { "Session " code { (Shown(&info.id)) } }
            div.facts {
                div { b { (Shown(info.model.as_deref().unwrap_or("—"))) } span { "model" } }
                div { b { (wire) } span { "wire format" } }
                div { b { (int(info.n_requests)) } span { "requests" } }
                div { b { (show_time(info.started_ms)) } span { "first (UTC)" } }
                div { b { (show_time(info.last_ms)) } span { "last (UTC)" } }
                div { b { (int(info.tokens_raw)) " → " (int(info.tokens_forwarded)) } span { "tokens raw → forwarded" } }
                div title=(SAVED_FORWARDED) { b { (saved(info.tokens_raw, info.tokens_forwarded)) } span { "saved (forwarded tokens)" } }
                (prefill_facts(prefill))
                div id="upstream-cache" { b { (info.upstream.cache_hits()) } span { "upstream cache hits (as the upstream reported)" } }
                div { b { (info.upstream.cache_write.map(int).unwrap_or_else(|| "not reported".into())) } span { "upstream cache writes" } }
                div { b { (int(savings.net())) } span { "attributable savings, tokens (" (savings.source()) ")" } }
                div id="session-cost" { b { (session_cost_cell(Some(session_cost))) } span { "cost without pare (est.) → with pare" } }
                div { b { (epochs) } span { "epochs" } }
                div { b { (partial) } span { "partial answers" } }
                div id="verify" {
                    b { @if report.ok() { span.badge.ok { "✓ verified" } } @else { span.badge.bad { "✗ " (report.problems.len()) " problem(s)" } } }
                    span { (summary_line(report)) }
                }
            }
            @if !report.ok() {
                ul.error { @for problem in &report.problems { li { (problem.to_string()) } } }
            }
            (savings_block(savings))
            (prefill_block(prefill))
            (cost_block(session_cost))
            (observed_block(exchanges))
            div.actions { span.muted { "Export this session:" } (export_buttons(&session_query)) }
            h2 { "Requests" }
            div.legend {
                i style="background:#bcd0ea" {} "raw (what the agent sent)"
                i style="background:#2f6fb8" {} "forwarded (what the model saw)"
                i style="background:#c2410c;width:2px" {} "the usable window (the model's window less the answer's reserve)"
            }
            table id="requests" {
                thead { tr {
                    th.num { "#" } th { "Time (UTC)" } th.num { "Raw" } th.num { "Forwarded" } th { "Tokens" } th { "Epoch" }
                    th.num { "Upstream cached / prompt" } th.num title=(UNCACHED) { "Uncached pare / raw" } th.num { "Cost" } th { "Answer" }
                } }
                tbody {
                    @for ((e, answer), cost) in exchanges.iter().zip(answers).zip(request_costs) {
                        @let raw = tokens(e, |s| s.tokens_raw);
                        @let fwd = tokens(e, |s| s.tokens_forwarded);
                        tr {
                            td.num { a href=(request_href(&info.id, e.seq)) { (e.seq) } }
                            td.muted { (show_time(e.at_ms)) }
                            td.num { (raw.map(|n| int(n as i64)).unwrap_or_else(|| "—".into())) }
                            td.num { (fwd.map(|n| int(n as i64)).unwrap_or_else(|| "—".into())) }
                            td { (bar(raw.unwrap_or(0), fwd.or(raw).unwrap_or(0), window(e), scale)) }
                            td {
                                @if e.summary.as_ref().is_some_and(|s| s.epoch_started) {
                                    span.badge.epoch { "epoch " (tokens(e, |s| s.epoch).unwrap_or(0)) }
                                } @else if let Some(epoch) = tokens(e, |s| s.epoch).filter(|n| *n > 0) {
                                    span.muted { "epoch " (epoch) }
                                } @else if e.fwd_len.is_none() {
                                    span.muted { "unchanged" }
                                }
                                @if e.summary.as_ref().is_some_and(|s| s.over_window) {
                                    " " span.badge.bad title=[window(e).map(|w| format!("forwarded tokens over the {}", w.describe()))] { "over window" }
                                }
                            }
                            td.num.upstream { (upstream_cell(e.usage.as_ref())) }
                            td.num.prefill { (request_prefill_cell(e)) }
                            td.num.cost { (request_cost_cell(cost.as_ref(), e.summary.is_some())) }
                            td.wide { (answer_summary(Wire::of_path(&e.path), answer.as_ref())) }
                        }
                    }
                }
            }
        },
    )
}

/// What the request page shows.
pub struct RequestView<'a> {
    pub info: &'a SessionInfo,
    pub exchange: &'a ExchangeInfo,
    pub raw: &'a [u8],
    /// The session's frozen prefix when the request was forwarded (its stored plan).
    pub frozen: Option<&'a FrozenPlan>,
    /// The request that started the epoch this one belongs to.
    pub epoch_started_at: Option<i64>,
}

/// One message as a readable block: role, ids, text, tool calls, reasoning size.
fn message(idx: usize, json: &str) -> Markup {
    // A lone surrogate escape (valid JSON serde_json refuses to decode) shows as U+FFFD.
    let m: Value = serde_json::from_str(&crate::neutral::lone_surrogates_replaced(json)).unwrap_or(Value::Null);
    // An opaque entry (the wire parts pare does not read) shows as those parts.
    let (role, text) = match &m {
        Value::Array(_) => ("opaque", m.to_string()),
        _ => (m.get("role").and_then(Value::as_str).unwrap_or("?"), content_text(m.get("content"))),
    };
    let n_chars = text.chars().count();
    let shown: String = text.chars().take(SHOWN_CHARS).collect();
    let reasoning = ["reasoning_content", "reasoning"]
        .iter()
        .filter_map(|k| m.get(*k))
        .map(|r| r.as_str().map_or_else(|| r.to_string().chars().count(), |s| s.chars().count()))
        .sum::<usize>();
    html! {
        div.msg {
            span.role.(role) { "#" (idx) " " (Shown(role)) }
            @if let Some(name) = m.get("name").and_then(Value::as_str) { " " code { (Shown(name)) } }
            @if let Some(id) = m.get("tool_call_id").and_then(Value::as_str) { span.muted { " answers " code { (Shown(id)) } } }
            span.muted { " · " (int(n_chars as i64)) " chars" }
            @if reasoning > 0 { span.muted { " · reasoning " (int(reasoning as i64)) " chars" } }
            @if !shown.trim().is_empty() {
                pre { (Shown(&shown)) @if n_chars > SHOWN_CHARS { "\n… " (int((n_chars - SHOWN_CHARS) as i64)) " more chars (download the body for all)" } }
            }
            @for call in m.get("tool_calls").and_then(Value::as_array).into_iter().flatten() {
                @let f = call.get("function");
                @let args = match f.and_then(|f| f.get("arguments")) { Some(Value::String(s)) => s.clone(), Some(v) => v.to_string(), None => String::new() };
                pre.call { "→ " (Shown(f.and_then(|f| f.get("name")).and_then(Value::as_str).unwrap_or("?"))) "(" (Shown(&args)) ")"
                    @if let Some(id) = call.get("id").and_then(Value::as_str) { "  [" (Shown(id)) "]" } }
            }
        }
    }
}

fn unchanged_run(run: &[(usize, &str)]) -> Markup {
    let (first, last) = (run[0].0, run[run.len() - 1].0);
    html! {
        details.kept {
            summary {
                @if run.len() == 1 {
                    "#" (first) " " (crate::neutral::role_of(run[0].1))
                    " · unchanged"
                } @else { "#" (first) "–#" (last) " · " (run.len()) " messages unchanged" }
            }
            div style="padding:4px 10px" { @for (idx, m) in run { (message(*idx, m)) } }
        }
    }
}

fn aligned(raw: &[&str], forwarded: &[String], steps: &[Step]) -> Markup {
    let mut blocks: Vec<Markup> = Vec::new();
    let mut run: Vec<(usize, &str)> = Vec::new();
    for &step in steps {
        if let Step::Kept { raw: idx, .. } = step {
            run.push((idx, raw[idx]));
            continue;
        }
        if !run.is_empty() {
            blocks.push(unchanged_run(&run));
            run.clear();
        }
        blocks.push(match step {
            Step::Edited { raw: idx, fwd, rules } => {
                html! {
                    div.change {
                        div.head {
                            b { "#" (idx) " rewritten" }
                            @for rule in rules.iter() { span.badge.rule { (rule.name()) } }
                            span.muted { (int(raw[idx].len() as i64)) " → " (int(forwarded[fwd].len() as i64)) " bytes · forwarded as #" (fwd) }
                        }
                        div.pair {
                            div { div.side { "sent by the agent" } (message(idx, raw[idx])) }
                            div { div.side { "forwarded" } (message(fwd, &forwarded[fwd])) }
                        }
                    }
                }
            }
            Step::Elided { start, end, fwd } => html! {
                div.change.elided {
                    div.head { b { "#" (start) "–#" (end - 1) " elided" } span.badge.rule { "elision" } span.muted { (end - start) " messages → one marker, forwarded as #" (fwd) } }
                    div.pair {
                        div { div.side { "sent by the agent" }
                            details { summary { (end - start) " messages" } div style="padding:4px 10px" { @for idx in start..end { (message(idx, raw[idx])) } } } }
                        div { div.side { "forwarded" } (message(fwd, &forwarded[fwd])) }
                    }
                }
            },
            Step::Dropped { raw: idx, rules } => html! {
                div.change.dropped {
                    div.head { b { "#" (idx) " dropped" } @for rule in rules.iter() { span.badge.rule { (rule.name()) } } span.muted { "not forwarded" } }
                    div.pair {
                        div { div.side { "sent by the agent" } (message(idx, raw[idx])) }
                        div { div.side { "forwarded" } p.muted { "— nothing —" } }
                    }
                }
            },
            Step::Kept { .. } => html! {},
        });
    }
    if !run.is_empty() {
        blocks.push(unchanged_run(&run));
    }
    html! { @for block in blocks { (block) } }
}

/// The message number, as this page numbers the request's messages, where the protected tail
/// starts; `None` when nothing is protected. The engine counts in its own input — the session's
/// compacted prefix followed by the messages that came after it — which is shorter than the request
/// by what that prefix compacted: `messages_in` against `n_raw` gives the shift.
fn protected_tail_start(engine: &crate::compact::report::Report, n_raw: usize) -> Option<usize> {
    let start = match engine.messages_in {
        // A summary written without the engine's input length: its index is all there is.
        0 => engine.boundary,
        n_in => (engine.boundary + n_raw).checked_sub(n_in)?,
    };
    (start < n_raw).then_some(start)
}

fn compaction_report(summary: Option<&CompactionSummary>, n_raw: usize, epoch_link: Markup) -> Markup {
    let Some(summary) = summary else { return html! { p.muted { "no compaction summary recorded" } } };
    let report = summary.report.as_ref();
    let engine = report.and_then(|r| r.engine.as_ref());
    let window = Window::of(Some(summary));
    // An enum as the word it is archived as.
    let word = |v: Option<Value>| v.and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_else(|| "—".into());
    html! {
        div.facts {
            div { b { (word(report.and_then(|r| serde_json::to_value(r.mode).ok()))) } span { "mode" } }
            div { b { (word(report.and_then(|r| r.action).and_then(|a| serde_json::to_value(a).ok()))) } span { "action" } }
            div { b { (window.map_or_else(|| "—".into(), |w| int(w.usable() as i64))) } span { "usable window (tokens)" } }
            div {
                b { (window.map_or_else(|| "—".into(), |w| int(w.whole as i64))) }
                span { "window, of which " (window.map_or_else(|| "—".into(), |w| int(w.reserve as i64))) " reserved for the answer" }
            }
            div { b { (summary.epoch) } span { "epoch" } }
            (epoch_link)
            @if let Some(engine) = engine {
                div { b { (engine.pack) } span { "pack" } }
                div {
                    b { @match protected_tail_start(engine, n_raw) { Some(start) => { "#" (start) }, None => "none" } }
                    span { "protected tail starts at (message numbers as above)" }
                }
            }
        }
        @if let Some(rules) = engine.map(|e| &e.rules).filter(|r| !r.is_empty()) {
            table id="rules" style="margin-top:8px;width:auto" {
                thead { tr { th { "Rule" } th.num { "Messages" } th.num { "Chars saved" } th.num { "Tokens saved" } } }
                tbody { @for (rule, v) in rules { tr {
                    td { span.badge.rule { (rule.name()) } }
                    td.num { (int(v.messages as i64)) }
                    td.num { (int(v.chars_saved)) }
                    td.num { (int(v.tokens_saved)) }
                } } }
            }
        }
        details { summary { "Full report (JSON)" } pre { (serde_json::to_string_pretty(summary).unwrap_or_default()) } }
    }
}

fn answer_block(answer: Option<&ResponseInfo>, n_messages: usize) -> Markup {
    let Some(answer) = answer else { return html! { p.muted { "no answer recorded" } } };
    let message_json = answer.assembled.as_ref().and_then(|a| a.get("message")).map(Value::to_string);
    let finish = answer.assembled.as_ref().and_then(|a| a.get("finish_reason")).and_then(Value::as_str);
    html! {
        div.actions {
            span.badge { "status " (answer.status.map(|s| s.to_string()).unwrap_or_else(|| "—".into())) }
            span.badge { (if answer.stream { "streamed" } else { "json" }) }
            span.badge { "end: " (answer.end_reason) }
            @if let Some(finish) = finish { span.badge { "finish: " (finish) } }
            @if answer.partial { span.badge.warn { "partial" } }
        }
        div.change id="answer" style="padding:4px 10px" {
            @match &message_json {
                Some(json) => (message(n_messages, json)),
                None => pre { (Shown(&String::from_utf8_lossy(&answer.body).chars().take(SHOWN_CHARS).collect::<String>())) },
            }
        }
    }
}

pub fn request(view: &RequestView<'_>, answer: Option<&ResponseInfo>) -> Markup {
    let (info, e) = (view.info, view.exchange);
    let raw_msgs = messages_of(&e.path, view.raw);
    let raw: Vec<&str> = raw_msgs.iter().map(String::as_str).collect();
    // A request forwarded as sent is its raw messages whatever the plan in force.
    let plan = forwarding(&raw, view.frozen.filter(|_| e.fwd_len.is_some()));
    let forwarded = &plan.messages;
    let summary = e.summary.as_ref();
    let base = request_href(&info.id, e.seq);
    layout(
        &format!("Request {} of {}", e.seq, info.id),
        html! {
            h1 {
                a href=(session_href(&info.id)) { code { (Shown(&info.id)) } } " · request " (e.seq) " of " (info.n_requests)
            }
            div.actions {
                @if e.seq > 1 { a.button rel="prev" href=(request_href(&info.id, e.seq - 1)) { "← request " (e.seq - 1) } }
                @if e.seq < info.n_requests { a.button rel="next" href=(request_href(&info.id, e.seq + 1)) { "request " (e.seq + 1) " →" } }
                a.button href={ (base) "/raw" } download { "Download raw body" }
                a.button href={ (base) "/forwarded" } download { "Download forwarded body" }
            }
            div.facts {
                div { b { (show_time(e.at_ms)) } span { "time (UTC)" } }
                div { b { (Shown(e.model.as_deref().unwrap_or("—"))) } span { "model" } }
                div { b { code { (e.method) " " (Shown(&e.path)) } } span { "request" } }
                div { b { (int(e.raw_len)) " → " (int(e.fwd_len.unwrap_or(e.raw_len))) } span { "bytes raw → forwarded" } }
                div { b { (summary.map(|s| int(s.tokens_raw as i64)).unwrap_or_else(|| "—".into())) " → "
                          (summary.map(|s| int(s.tokens_forwarded as i64)).unwrap_or_else(|| "—".into())) } span { "tokens raw → forwarded" } }
                div { b { (raw.len()) " → " (forwarded.len()) } span { "messages" } }
                div id="upstream-usage" { b { (Usage::line(e.usage.as_ref())) } span { "upstream usage (as the upstream reported)" } }
            }
            @if let Some(skipped) = &e.skipped { p { span.badge.warn { "forwarded unchanged" } " " (skipped) } }
            h2 { "Messages: sent by the agent ↔ forwarded to the model" }
            @if raw.is_empty() {
                p.muted { "Not a request body pare reads (" (int(e.raw_len)) " bytes): download it to read it." }
            } @else {
                @match &plan.steps {
                    Some(steps) => (aligned(&raw, forwarded, steps)),
                    None => p.muted { "What became of each message is not in this archive's plans: download the two bodies to compare them." },
                }
            }
            h2 { "Answer" }
            (answer_block(answer, forwarded.len()))
            h2 { "Compaction report" }
            (compaction_report(summary, raw.len(), html! {
            @if let Some(start) = view.epoch_started_at {
                div { b { a href=(request_href(&info.id, start)) { "request " (start) } } span { "compacted the prefix of this epoch" } }
            }
        }))
        },
    )
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn answer(assembled: Value) -> ResponseInfo {
        ResponseInfo {
            status: Some(200),
            stream: true,
            partial: false,
            end_reason: "complete".into(),
            body: Vec::new(),
            assembled: Some(assembled),
        }
    }

    /// An answer of any format shows its text and its calls, read as the neutral messages it
    /// stands for: a Gemini model turn of parts, Responses output messages, an Anthropic message of
    /// blocks, a chat message.
    #[test]
    fn an_answer_is_summarized_by_its_text_and_calls_in_every_format() {
        let gemini = answer(json!({"message": {"role": "model", "parts": [
            {"text": "Listing files.", "thoughtSignature": "c2ln"},
            {"functionCall": {"name": "run_shell_command", "args": {"command": "ls"}}}]},
            "finish_reason": "STOP"}));
        let responses = answer(json!({"messages": [
            {"role": "assistant", "content": "Listing files."},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "run_shell_command", "arguments": "{}"}}]}]}));
        let messages = answer(json!({"message": {"role": "assistant", "content": [
            {"type": "text", "text": "Listing files."},
            {"type": "tool_use", "id": "t1", "name": "run_shell_command", "input": {"command": "ls"}}]}}));
        let chat = answer(json!({"message": {"role": "assistant", "content": "Listing files.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "run_shell_command", "arguments": "{}"}}]}}));
        for (wire, answer) in
            [(Wire::Gemini, gemini), (Wire::Responses, responses), (Wire::Messages, messages), (Wire::Chat, chat)]
        {
            let shown = answer_summary(Some(wire), Some(&answer)).into_string();
            assert!(shown.contains("Listing files.") && shown.contains("run_shell_command"), "{wire:?}: {shown}");
        }
        let elsewhere = answer(json!({"message": {"role": "assistant", "content": "done"}}));
        assert!(answer_summary(None, Some(&elsewhere)).into_string().contains("done"));
    }

    /// An opaque entry shows as the wire parts it carries, a message as its role and text.
    #[test]
    fn an_opaque_entry_shows_its_parts() {
        let opaque = crate::neutral::opaque(&[r#"{"type":"web_search_call","id":"ws_1"}"#]);
        let shown = message(3, &opaque).into_string();
        assert!(shown.contains("#3 <bdi>opaque</bdi>") && shown.contains("web_search_call"), "{shown}");
        let shown = message(4, r#"{"role":"user","content":"hello"}"#).into_string();
        assert!(shown.contains("#4 <bdi>user</bdi>") && shown.contains("hello"), "{shown}");
    }
}
