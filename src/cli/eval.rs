//! `pare eval`: the metrics of MISSION.md over a corpus directory, as a table or JSON.

use std::fmt::Write as _;
use std::process::ExitCode;
use std::sync::Arc;

use super::SplitArg;
use crate::compact::Engine;
use crate::compact::markers::group_digits as n;
use crate::config::Config;
use crate::eval::corpus::{self, Split};
use crate::eval::strategy::Strategy;
use crate::eval::{CorpusReport, Metrics, evaluate_sessions};
use crate::wire::Wire;

pub fn run(args: super::EvalArgs) -> anyhow::Result<ExitCode> {
    let config = Config::load(args.config.as_deref())?;
    let engine = Arc::new(Engine::from_config(&config)?);
    // Plans say what became of each message: why a needle was lost.
    let compactor = super::replay::compactor_with_engine(&config, args.mode, engine.clone())?.recording_plans();
    // `--convert` alone converts to Responses, the first format it served.
    let wire = match (args.convert, args.wire) {
        (true, Wire::Chat) => Wire::Responses,
        (_, wire) => wire,
    };
    if args.strategy != Strategy::Pare && wire != Wire::Chat {
        anyhow::bail!("--strategy {} reads Chat Completions sessions only (--wire chat)", args.strategy);
    }
    let input = crate::eval::EvalInput { wire, convert_chat: args.convert };
    let sessions = match (&args.archive, &args.corpus) {
        (Some(_), _) if args.convert => anyhow::bail!("--convert reads session files, not an archive"),
        (Some(archive), _) => corpus::from_archive(super::sessions::archive_location(Some(archive.clone()), None)?)?,
        (None, Some(dir)) => corpus::from_dir(dir)?,
        (None, None) => anyhow::bail!("give a corpus directory or --archive DIR|URL"),
    };
    let split = args.split.map(|s| match s {
        SplitArg::Tune => Split::Tune,
        SplitArg::Holdout => Split::Holdout,
    });
    let sessions = corpus::select(sessions, split);
    let mut report = evaluate_sessions(&sessions, args.strategy, &compactor, engine.as_ref(), args.window, input)?;
    report.split = split.map(|s| s.name().to_owned());
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render_table(&report));
    }
    Ok(ExitCode::SUCCESS)
}

/// The table's header, in the widths of [`row`].
fn header() -> String {
    format!(
        "{:<41} {:>6} {:>11} {:>11} {:>6} {:>7} {:>15} {:>5} {:>8} {:>12} {:>7} {:>7} {:>5} {:>7} {:>7}",
        "session",
        "reqs",
        "raw tok",
        "fwd tok",
        "saved",
        "at most",
        "peak/usable",
        "over",
        "fit-over",
        "prefill F/R",
        "recall",
        "valid",
        "kept",
        "determ",
        "epochs"
    )
}

fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

/// The peak against the usable window: in tokens when every request had the same usable window,
/// else as the largest share of a request's own usable window (tokens of different windows do not
/// compare).
fn peak(m: &Metrics) -> String {
    match m.one_usable_window() {
        true => format!("{:>7}/{:<7}", n(m.peak_forwarded as usize), n(m.usable_window as usize)),
        false => format!("{:>7} of own", pct(m.peak_share)),
    }
}

fn row(out: &mut String, name: &str, m: &Metrics) {
    let name = if name.len() > 40 { format!("…{}", &name[name.len() - 39..]) } else { name.to_owned() };
    let _ = writeln!(
        out,
        "{name:<41} {:>6} {:>11} {:>11} {:>6} {:>7} {:>15} {:>5} {:>8} {:>12} {:>7} {:>7} {:>5} {:>7} {:>7}",
        n(m.requests),
        n(m.tokens_raw as usize),
        n(m.tokens_forwarded as usize),
        pct(m.saved()),
        pct(m.ceiling()),
        peak(m),
        n(m.over_window),
        n(m.over_window_fitting),
        format!("{:.2}x", m.prefill_ratio()),
        format!("{:.3}", m.recall()),
        pct(m.validity()),
        pct(m.preserved_share()),
        pct(m.deterministic_share()),
        n(m.epochs as usize),
    );
}

/// The human-readable report: sessions grouped by source, a line per source, then the total.
pub fn render_table(report: &CorpusReport) -> String {
    let mut out = String::new();
    let window = match report.window {
        Some(window) => format!("window {} tokens", n(window as usize)),
        None => "window of each request's model (config `models:`, else budget.default_context_window)".into(),
    };
    let _ = write!(out, "pare eval: {window}, mode {}, strategy {}", report.mode, report.strategy);
    let _ = writeln!(out, "{}", report.split.as_ref().map(|s| format!(", {s} sessions")).unwrap_or_default());
    let _ = writeln!(out, "{}", header());
    for (source, metrics) in &report.sources {
        for s in report.sessions.iter().filter(|s| &s.source == source) {
            row(&mut out, &format!("  {}", s.id), &s.metrics);
        }
        row(&mut out, &format!("{source} ({} sessions)", metrics.sessions), metrics);
    }
    row(&mut out, &format!("TOTAL ({} sessions)", report.total.sessions), &report.total);
    let t = &report.total;
    let peak = match t.one_usable_window() {
        true => format!("peak {} of usable {}", n(t.peak_forwarded as usize), n(t.usable_window as usize)),
        false => format!(
            "peak {} of its request's usable window (usable windows {}–{}, each request against its own)",
            pct(t.peak_share),
            n(t.usable_window as usize),
            n(t.usable_window_max as usize)
        ),
    };
    let _ = writeln!(
        out,
        "\nsaved {} (at most {}: the rest is system, user messages, protected tail and tools) · {peak} · over window {} (of which fitting {}) · over the model's window {} (of which the last turn fitting {}) · uncached prefill {} vs raw {} ({:.2}x) · needle recall {:.3} ({}/{}) · recoverable recall {:.3} ({}/{} lost needles a marker id names) · validity {} (raw {}) · user+tail kept {} · deterministic {}",
        pct(t.saved()),
        pct(t.ceiling()),
        n(t.over_window),
        n(t.over_window_fitting),
        n(t.over_model_window),
        n(t.over_model_window_fitting),
        n(t.uncached_forwarded as usize),
        n(t.uncached_raw as usize),
        t.prefill_ratio(),
        t.recall(),
        n(t.needles_kept as usize),
        n(t.needles as usize),
        t.recoverable_recall(),
        n(t.needles_recoverable as usize),
        n((t.needles - t.needles_kept) as usize),
        pct(t.validity()),
        pct(if t.requests == 0 { 1.0 } else { t.valid_raw as f64 / t.requests as f64 }),
        pct(t.preserved_share()),
        pct(t.deterministic_share()),
    );
    let _ = write!(out, "{}", render_lost(report));
    out
}

/// Per source, the lost needles by cause (what became of the latest output that held each) and their
/// ways back, most lost first; nothing when no needle was lost.
pub fn render_lost(report: &CorpusReport) -> String {
    let mut out = String::new();
    let total = "TOTAL".to_owned();
    let sources = report.sources.iter().chain(std::iter::once((&total, &report.total)));
    for (source, metrics) in sources.filter(|(_, m)| !m.lost_by.is_empty()) {
        if out.is_empty() {
            let _ = writeln!(
                out,
                "\nlost needles by cause (what became of the latest output that held each) and way back:\n{:<28} {:<40} {:>6} {:>9} {:>8} {:>6}",
                "source", "cause", "lost", "retrieve", "re-read", "none"
            );
        }
        let mut causes: Vec<_> = metrics.lost_by.iter().collect();
        causes.sort_by(|a, b| b.1.lost.cmp(&a.1.lost).then_with(|| a.0.cmp(b.0)));
        for (cause, lost) in causes {
            let _ = writeln!(
                out,
                "{:<28} {:<40} {:>6} {:>9} {:>8} {:>6}",
                source,
                cause,
                n(lost.lost as usize),
                n(lost.retrieve as usize),
                n(lost.reread as usize),
                n(lost.unrecoverable() as usize)
            );
        }
    }
    out
}
