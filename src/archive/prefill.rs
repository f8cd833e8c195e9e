//! Uncached prefill side by side, per request and per session: the prompt tokens the upstream
//! computed afresh for the requests as pare forwarded them — its own figure (prompt − cached) where
//! the answer reported both, else pare's estimate — against pare's estimate of the same for the
//! requests as the agent sent them ([`crate::budget::prefill`]); and the requests that, as sent,
//! would not have fit the model's window. [`uncached_with_pare`] is the one definition of "what the
//! upstream computed with pare": the session pages, `pare sessions`, the epoch misses of
//! [`super::query::Savings`] and `/_pare/metrics` all read it.

use serde::Serialize;

use crate::compact::markers::group_signed as n;
use crate::exchange::{CompactionSummary, Usage};

/// Where a figure of what the upstream computed afresh was read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MissSource {
    /// The upstream's figures for that request (prompt − cached).
    Provider,
    /// pare's estimate: the forwarded prompt less its prefix shared with the previous request.
    Estimate,
}

impl MissSource {
    /// `provider` or `estimate`.
    pub fn name(self) -> &'static str {
        match self {
            MissSource::Provider => "provider",
            MissSource::Estimate => "estimate",
        }
    }
}

/// The prompt tokens the upstream computed afresh for a request as pare forwarded it: the
/// upstream's `prompt − cached` when its answer reported both ([`Usage::uncached`]), else pare's
/// estimate from the request's summary; `None` when neither is known.
pub fn uncached_with_pare(usage: Option<&Usage>, summary: Option<&CompactionSummary>) -> Option<(u64, MissSource)> {
    match usage.and_then(Usage::uncached) {
        Some(uncached) => Some((uncached, MissSource::Provider)),
        None => summary.and_then(|s| s.prefill).map(|p| (p.forwarded, MissSource::Estimate)),
    }
}

/// One request's uncached prefill with and without pare.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct RequestPrefill {
    pub seq: i64,
    /// What the upstream computed afresh for the forwarded request ([`uncached_with_pare`]).
    pub with_pare: u64,
    pub source: MissSource,
    /// pare's estimate for the request as the agent sent it.
    pub raw: u64,
    /// As sent, the request was over the model's window: without pare the upstream refuses it.
    pub raw_over_window: bool,
}

impl RequestPrefill {
    /// `None` when the request carries no estimate (mode `off`, not compacted, an older archive).
    /// Request `seq` of its session, with the upstream's usage and pare's summary of it.
    pub fn of(seq: i64, usage: Option<&Usage>, summary: Option<&CompactionSummary>) -> Option<RequestPrefill> {
        let estimate = summary?.prefill?;
        let (with_pare, source) = uncached_with_pare(usage, summary)?;
        Some(RequestPrefill { seq, with_pare, source, raw: estimate.raw, raw_over_window: estimate.raw_over_window })
    }
}

/// A session's uncached prefill with and without pare, over the requests that carry an estimate.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct SessionPrefill {
    /// Request by request, in order.
    pub requests: Vec<RequestPrefill>,
    /// Requests without an estimate, left out of both sums.
    pub n_unknown: usize,
}

impl SessionPrefill {
    /// From each request's number, usage and summary, in order (see [`RequestPrefill::of`]).
    pub fn of<'a>(
        requests: impl IntoIterator<Item = (i64, Option<&'a Usage>, Option<&'a CompactionSummary>)>,
    ) -> SessionPrefill {
        let mut out = SessionPrefill::default();
        for (seq, usage, summary) in requests {
            match RequestPrefill::of(seq, usage, summary) {
                Some(request) => out.requests.push(request),
                None => out.n_unknown += 1,
            }
        }
        out
    }

    /// Σ uncached prefill with pare.
    pub fn with_pare(&self) -> u64 {
        self.requests.iter().map(|r| r.with_pare).sum()
    }

    /// Σ uncached prefill without pare (estimated).
    pub fn raw(&self) -> u64 {
        self.requests.iter().map(|r| r.raw).sum()
    }

    /// Requests that, as the agent sent them, would not have fit the model's window.
    pub fn n_raw_over_window(&self) -> usize {
        self.requests.iter().filter(|r| r.raw_over_window).count()
    }

    /// Which figures "with pare" came from: `provider`, `estimate`, `provider + estimate`, `none`.
    pub fn source(&self) -> &'static str {
        let provider = self.requests.iter().any(|r| r.source == MissSource::Provider);
        let estimate = self.requests.iter().any(|r| r.source == MissSource::Estimate);
        match (provider, estimate) {
            (true, true) => "provider + estimate",
            (true, false) => "provider",
            (false, true) => "estimate",
            (false, false) => "none",
        }
    }

    /// The uncached prefill pare saved, as a share of the raw figure (negative: it cost more);
    /// `None` without a raw figure.
    pub fn saved(&self) -> Option<f64> {
        let raw = self.raw();
        (raw > 0).then(|| 1.0 - self.with_pare() as f64 / raw as f64)
    }

    /// [`SessionPrefill::saved`] for a table cell: "−118.0 %", "—".
    pub fn saved_text(&self) -> String {
        self.saved().map_or_else(|| "—".to_owned(), |s| format!("{:.1} %", 100.0 * s).replace('-', "−"))
    }

    /// The cumulative figures after each request: (seq, Σ with pare, Σ raw).
    pub fn cumulative(&self) -> Vec<(i64, u64, u64)> {
        let (mut with_pare, mut raw) = (0, 0);
        self.requests
            .iter()
            .map(|r| {
                with_pare += r.with_pare;
                raw += r.raw;
                (r.seq, with_pare, raw)
            })
            .collect()
    }

    /// What the figures say, in words: whether compaction saved uncached prefill or cost more than
    /// it saved, and whether the gain is that requests fit the window at all.
    pub fn verdict(&self) -> String {
        if self.requests.is_empty() {
            return "uncached prefill not estimated (compaction off, or requests archived without an estimate)".into();
        }
        let (with_pare, raw) = (self.with_pare() as i64, self.raw() as i64);
        let over = self.n_raw_over_window();
        let fit = match over {
            0 => String::new(),
            1 => "; 1 request would not have fit the model's window without pare: the gain is that it fit".into(),
            n => {
                format!("; {n} requests would not have fit the model's window without pare: the gain is that they fit")
            }
        };
        let figures = format!("{} with pare against {} without", n(with_pare), n(raw));
        if with_pare > raw {
            format!(
                "compaction cost more uncached prefill than it saved: {figures} (+{}, ×{:.2}){fit}",
                n(with_pare - raw),
                with_pare as f64 / raw.max(1) as f64
            )
        } else {
            format!(
                "compaction saved {} uncached prefill tokens ({}): {figures}{fit}",
                n(raw - with_pare),
                self.saved_text()
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exchange::PrefillEstimate;

    type Archived = (i64, Option<Usage>, Option<CompactionSummary>);

    fn of(requests: &[Archived]) -> SessionPrefill {
        SessionPrefill::of(requests.iter().map(|(seq, usage, summary)| (*seq, usage.as_ref(), summary.as_ref())))
    }

    fn exchange(seq: i64, estimate: Option<(u64, u64, bool)>, usage: Option<Usage>) -> Archived {
        let summary = CompactionSummary {
            prefill: estimate.map(|(forwarded, raw, raw_over_window)| PrefillEstimate {
                forwarded,
                raw,
                raw_over_window,
            }),
            ..CompactionSummary::default()
        };
        (seq, usage, Some(summary))
    }

    fn reported(prompt: u64, cached: Option<u64>) -> Option<Usage> {
        Some(Usage { prompt: Some(prompt), cached, cache_write: None, output: Some(1) })
    }

    #[test]
    fn provider_figures_win_over_the_estimate_request_by_request() {
        let exchanges = [
            // The upstream reported its cache: its figure.
            exchange(1, Some((1000, 1000, false)), reported(1100, Some(100))),
            // It reported a prompt but no cache figure: pare's estimate.
            exchange(2, Some((300, 200, false)), reported(1500, None)),
            // No answer: pare's estimate.
            exchange(3, Some((50, 40, false)), None),
            // Not estimated (an older archive): left out of both sums, even with a provider figure.
            exchange(4, None, reported(2000, Some(0))),
        ];
        let prefill = of(&exchanges);
        assert_eq!(prefill.n_unknown, 1);
        let sources: Vec<MissSource> = prefill.requests.iter().map(|r| r.source).collect();
        assert_eq!(sources, [MissSource::Provider, MissSource::Estimate, MissSource::Estimate]);
        assert_eq!((prefill.with_pare(), prefill.raw()), (1000 + 300 + 50, 1000 + 200 + 40));
        assert_eq!(prefill.source(), "provider + estimate");
        assert_eq!(prefill.cumulative(), [(1, 1000, 1000), (2, 1300, 1200), (3, 1350, 1240)]);
        assert_eq!(uncached_with_pare(reported(10, Some(4)).as_ref(), None), Some((6, MissSource::Provider)));
        assert_eq!(uncached_with_pare(None, None), None);
    }

    #[test]
    fn the_verdict_says_when_compaction_cost_more_and_when_the_gain_is_fitting() {
        let cost = of(&[exchange(1, Some((500, 500, false)), None), exchange(2, Some((900, 100, false)), None)]);
        assert_eq!(
            cost.verdict(),
            "compaction cost more uncached prefill than it saved: 1,400 with pare against 600 without (+800, ×2.33)"
        );
        assert_eq!(cost.saved_text(), "−133.3 %");
        let fit = of(&[exchange(1, Some((500, 500, false)), None), exchange(2, Some((900, 100, true)), None)]);
        assert!(
            fit.verdict()
                .ends_with("1 request would not have fit the model's window without pare: the gain is that it fit"),
            "{}",
            fit.verdict()
        );
        let saved = of(&[exchange(1, Some((100, 400, true)), None), exchange(2, Some((100, 400, true)), None)]);
        assert_eq!(
            saved.verdict(),
            "compaction saved 600 uncached prefill tokens (75.0 %): 200 with pare against 800 without; 2 requests would not have fit the model's window without pare: the gain is that they fit"
        );
        assert!(of(&[exchange(1, None, None)]).verdict().starts_with("uncached prefill not estimated"));
        assert_eq!(SessionPrefill::default().saved_text(), "—");
    }
}
