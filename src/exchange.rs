//! The types the proxy, the pipeline, the compactor and the archive exchange about one request: the
//! compaction seam ([`ConversationCompactor`], its input and output, fail-open), what compaction reports, and
//! the sink that receives the upstream's answer. A leaf module (it imports none of them but the wire
//! types and the engine's report), so that neither the archive nor the budget and the pipeline import
//! each other.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use bytes::Bytes;
use http::HeaderMap;

use crate::compact::report::Report;
use crate::config::Mode;
use crate::wire::{Spans, WireBody};

/// What compaction reports for one request; carried into headers, the log line and the archive.
/// Archived as JSON: a field added later has a default, so older summaries still read.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CompactionSummary {
    pub tokens_raw: u64,
    pub tokens_forwarded: u64,
    /// Epoch number of the session after this request (0 = never compacted).
    pub epoch: u64,
    /// This request started an epoch (eager: an advance that changed the forwarded prefix). Said by
    /// the compactor, so a restart that seeds sessions at their archived epoch numbers counts none.
    #[serde(default)]
    pub epoch_started: bool,
    /// The forwarded request is over the usable window (window − answer reserve): in epoch and eager
    /// mode, compaction could not bring it under — what pare never shrinks (first system message,
    /// user messages, protected tail, tools, messages a rule keeps whole) does not fit, or at a very
    /// small window the markers left in place of what went — or a session in that state appends
    /// up to the model's whole window instead of compacting again on every request; in off mode,
    /// the raw request is over.
    /// Forwarded anyway, and said so in the `x-pare-over-window` header, the log line, the archived
    /// summary and `pare_over_window_requests_total`.
    #[serde(default)]
    pub over_window: bool,
    /// What the budget did with the request, and the engine's report when it ran. `None` (JSON
    /// `null`): no budget ran (the identity compactor).
    #[serde(default)]
    pub report: Option<BudgetReport>,
    /// pare's estimate of the prompt tokens an upstream with a prefix cache computes afresh for this
    /// request, as forwarded and as the agent sent it. `None`: not estimated (mode `off`, or an
    /// archive written before pare estimated it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill: Option<PrefillEstimate>,
    /// Mode `observe`: what epoch mode would have done with the request, which was forwarded
    /// unchanged (the figures above say so). `None` in every other mode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed: Option<Observed>,
}

/// The uncached prefill of one request, as pare estimates it ([`crate::budget::prefill`]): the
/// forwarded request after the session's previous forwarded request, and the raw request after the
/// agent's previous raw request (what the upstream would have computed without pare).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PrefillEstimate {
    pub forwarded: u64,
    pub raw: u64,
    /// The raw request is over the model's whole window less the answer length it asks for: without
    /// pare the upstream would have refused it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub raw_over_window: bool,
}

/// What epoch mode would have done with one request that mode `observe` forwarded unchanged: the
/// step of the same compactor over the same session (what `pare replay` gives for the request),
/// and the prompt tokens an upstream's prefix cache could not have reused with and without it.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Observed {
    /// Tokens epoch mode would have forwarded.
    pub tokens_forwarded: u64,
    /// The session's epoch number after the request, had epoch mode compacted it.
    pub epoch: u64,
    /// The request would have started an epoch.
    pub epoch_started: bool,
    /// What epoch mode would have forwarded is over the usable window.
    pub over_window: bool,
    /// Tokens of the raw request (what was forwarded) a prefix cache could not reuse from the
    /// session's previous request: all but its tools when unchanged and the longest run of
    /// leading messages the two share (the estimate `pare eval` makes).
    pub uncached_raw: u64,
    /// The same for what epoch mode would have forwarded, against what it would have forwarded
    /// for the previous request.
    pub uncached_forwarded: u64,
}

/// The [`Observed`] figures of a session's requests, summed (what `sessions show` and the UI say of
/// a session mode `observe` projected).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ObservedTotals {
    pub requests: u64,
    pub tokens_raw: u64,
    pub tokens_forwarded: u64,
    /// The highest epoch number projected.
    pub epochs: u64,
    pub uncached_raw: u64,
    pub uncached_forwarded: u64,
}

impl ObservedTotals {
    /// The sums over `summaries`; `None` when none of them was projected.
    pub fn of<'a>(summaries: impl IntoIterator<Item = &'a CompactionSummary>) -> Option<ObservedTotals> {
        let mut totals = ObservedTotals::default();
        for summary in summaries {
            let Some(observed) = &summary.observed else { continue };
            totals.requests += 1;
            totals.tokens_raw += summary.tokens_raw;
            totals.tokens_forwarded += observed.tokens_forwarded;
            totals.epochs = totals.epochs.max(observed.epoch);
            totals.uncached_raw += observed.uncached_raw;
            totals.uncached_forwarded += observed.uncached_forwarded;
        }
        (totals.requests > 0).then_some(totals)
    }

    /// One line: what epoch mode would have forwarded, and its uncached prefill against the raw
    /// requests', said plainly when it is more.
    pub fn line(&self) -> String {
        let saved = match self.tokens_raw {
            0 => 0.0,
            raw => 100.0 * (1.0 - self.tokens_forwarded as f64 / raw as f64),
        };
        let prefill = match self.uncached_forwarded.cmp(&self.uncached_raw) {
            std::cmp::Ordering::Greater => {
                "more than as forwarded: its epochs cost the prompt cache more than they save"
            }
            _ => "no more than as forwarded",
        };
        let n = |value: u64| crate::compact::markers::group_digits(value as usize);
        format!(
            "observe mode: epoch mode would have forwarded {} of {} tokens over {} request(s) (saved {saved:.1} %) in {} \
             epoch(s); uncached prefill {} with it against {} as forwarded ({prefill})",
            n(self.tokens_forwarded),
            n(self.tokens_raw),
            n(self.requests),
            self.epochs,
            n(self.uncached_forwarded),
            n(self.uncached_raw),
        )
    }
}

/// What the budget did with one request.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct BudgetReport {
    pub mode: Mode,
    /// The request's context window and the tokens reserved for the answer.
    pub window: u64,
    pub reserve: u64,
    /// Where the window came from, when the proxy resolved it: for the answer's header and the log
    /// line, not archived (a replay resolves no window source, and predicts the archived summary).
    #[serde(skip)]
    pub window_source: Option<WindowSource>,
    /// The token counts are estimates (a Messages request: Anthropic's tokenizer is not public, the
    /// configured encoding counted them).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tokens_estimated: bool,
    /// `None` in mode `off`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<Action>,
    /// The agent edited or dropped earlier messages: the session's compacted prefix started afresh.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub history_changed: bool,
    /// The engine's report, when the engine ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<Report>,
    /// The protected tail did not fit the model's window: the epoch protected only this many last
    /// turns (fewer than `compaction.rules.protect_last_turns`), the older ones yielding.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protected_turns: Option<u32>,
    /// The compacted conversation has no valid form in the request's wire format: forwarded raw.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub write_failed: Option<String>,
    /// The request's raw messages as the session's state keeps them for its next request: a
    /// replica that did not serve this request catches up from it and the stored plan.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub raw_head: Option<RawHead>,
}

/// A request's raw messages as a session's compaction state remembers them once it is forwarded:
/// how many, and a digest of their [`crate::neutral::message_hashes`]. While the next request starts
/// with them, the upstream holds all of them cached (an epoch keeps as much of them as it can).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RawHead {
    pub messages: u64,
    /// Written as 32 hex digits (a JSON number would not hold 128 bits for every reader).
    #[serde(with = "hex_u128")]
    pub digest: u128,
}

/// A `u128` as 32 lowercase hex digits in JSON.
mod hex_u128 {
    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    pub fn serialize<S: Serializer>(value: &u128, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&format!("{value:032x}"))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u128, D::Error> {
        let text = String::deserialize(deserializer)?;
        u128::from_str_radix(&text, 16).map_err(D::Error::custom)
    }
}

/// Where a request's context window came from (`budget::window::WindowResolver`), first source first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WindowSource {
    /// A `models:` entry's `context_window`.
    Models,
    /// The upstream's report (llama.cpp, vLLM, LM Studio, Ollama).
    Upstream,
    /// The built-in price table (`data/prices.json`).
    Prices,
    /// `budget.default_context_window` (or the Messages or Gemini default).
    Default,
}

impl WindowSource {
    /// The name in the `x-pare-window-source` header and the log line.
    pub fn name(self) -> &'static str {
        match self {
            WindowSource::Models => "models",
            WindowSource::Upstream => "upstream",
            WindowSource::Prices => "prices",
            WindowSource::Default => "default",
        }
    }
}

/// One step of a session's budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Under the high-water mark: the new messages are appended to the session's prefix.
    Append,
    /// Eager mode under the mark: the rules ran and the frozen frontier moved.
    Advance,
    /// An epoch: the engine compacted the conversation to the low-water mark.
    Epoch,
}

/// Receives the upstream's answer to a request as it streams (for the archive).
/// The proxy calls `finish` exactly once: on end of body, on error, or when the body is dropped.
pub trait ResponseSink: Send {
    fn head(&mut self, status: u16, headers: &HeaderMap);
    fn chunk(&mut self, bytes: &Bytes);
    /// The answer's final event has passed (a streamed answer read event by event): it is whole,
    /// and the exchange ends [`StreamEnd::Complete`] even when the client closes, or the upstream
    /// fails, before the body's last chunk (a client stops reading at the final event). A sink that
    /// reads no events says `false`.
    fn answer_complete(&self) -> bool {
        false
    }
    fn finish(self: Box<Self>, end: StreamEnd);
    /// [`ResponseSink::finish`], returning what the upstream reported it billed for the answer (its
    /// `usage`), for a sink that reads it.
    fn finish_reporting(self: Box<Self>, end: StreamEnd) -> Option<Usage> {
        self.finish(end);
        None
    }
}

/// How a response body ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamEnd {
    Complete,
    /// The client went away before the end.
    ClientGone,
    /// The upstream failed mid-body (reset, timeout).
    UpstreamError(String),
    /// pare answered itself (502/504…) and the upstream never did.
    NoResponse(String),
}

/// Input of one compaction.
pub struct CompactInput<'a> {
    pub session: &'a str,
    pub raw: &'a [u8],
    pub body: &'a dyn WireBody,
    /// The body's neutral messages, read once for the session tracker and the compactor.
    pub messages: &'a [&'a str],
    /// Each message's hash ([`crate::neutral::message_hashes`]), computed once for the session
    /// tracker, the compactor and the token cache.
    pub hashes: &'a [u128],
    /// Context window of the request's model when the pipeline resolved one (config or detection).
    pub window: Option<u64>,
    /// The caller runs [`CompactOutput::late`]: a compactor may leave counting the new messages
    /// of a request whose forwarding does not depend on them until after it is forwarded.
    pub defer_counts: bool,
}

/// Output of one compaction: `body` is `None` when the request is forwarded unchanged.
pub struct CompactOutput {
    pub body: Option<Vec<u8>>,
    /// Where `body`'s values lie, when the compactor wrote it with [`WireBody::write`]:
    /// the archive then stores it without parsing it. `None`: the archive parses `body` itself.
    pub spans: Option<Spans>,
    pub summary: CompactionSummary,
    /// Set when some token counts in `summary` are upper bounds (only with
    /// [`CompactInput::defer_counts`]): given `summary`, it counts what was left and returns the
    /// exact summary. `body` and `spans` are final either way.
    pub late: Option<LateCount>,
    /// The texts the forwarded markers name that compaction derived rather than read from the
    /// request (the id lists of elision markers, [`crate::compact::Compacted::lists`]): the
    /// archive stores them as it stores the hidden outputs, so that every id resolves.
    pub lists: Arc<[String]>,
}

/// Finishes a summary whose new messages were not counted yet (see [`CompactOutput::late`]).
pub type LateCount = Box<dyn FnOnce(CompactionSummary) -> CompactionSummary + Send>;

/// Anything that can compact a request. The engine is pure; implementations may keep
/// per-session state (epochs, stickiness) behind interior mutability.
pub trait ConversationCompactor: Send + Sync {
    fn compact(&self, input: &CompactInput<'_>) -> anyhow::Result<CompactOutput>;
}

/// Forwards every request unchanged (mode `off`, and the seam's default until wired).
pub struct IdentityCompactor;

impl ConversationCompactor for IdentityCompactor {
    fn compact(&self, _input: &CompactInput<'_>) -> anyhow::Result<CompactOutput> {
        Ok(CompactOutput {
            body: None,
            spans: None,
            summary: CompactionSummary::default(),
            late: None,
            lists: Arc::from([]),
        })
    }
}

/// One compaction under `catch_unwind`: the proxy and `pare replay` both go through here, so that they
/// forward the same bytes. `Err` says why compaction did not apply (an error or a panic); the caller
/// then forwards the original body.
pub fn compact_fail_open(
    compactor: &dyn ConversationCompactor,
    input: &CompactInput<'_>,
) -> Result<CompactOutput, String> {
    match catch_unwind(AssertUnwindSafe(|| compactor.compact(input))) {
        Ok(Ok(out)) => Ok(out),
        Ok(Err(err)) => Err(format!("compaction failed: {err:#}")),
        Err(panic) => Err(format!("compaction panicked: {}", panic_message(&panic))),
    }
}

fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An archived summary reads back as the value that wrote it, and writes the same bytes again.
    #[test]
    fn an_archived_summary_reads_back_byte_for_byte() {
        let summaries = [
            r#"{"tokens_raw":5000,"tokens_forwarded":3000,"epoch":2,"epoch_started":true,"over_window":false,"report":{"mode":"epoch","window":8192,"reserve":1024,"action":"epoch","history_changed":true,"engine":{"pack":"default","messages_in":12,"messages_out":11,"boundary":8,"messages_changed":3,"messages_dropped":1,"chars_saved":472,"tokens_saved":180,"rules":{"collapse_succeeded":{"messages":3,"chars_saved":472,"tokens_saved":180}},"tiers":{"target_tokens":3000,"tokens_after_rules":4000,"focus":1,"recent":2,"summary":0,"background":0,"elided_groups":1,"elided_messages":1,"over_target":false}},"write_failed":"no form","raw_head":{"messages":12,"digest":"0123456789abcdef0123456789abcdef"}}}"#,
            r#"{"tokens_raw":10,"tokens_forwarded":10,"epoch":0,"epoch_started":false,"over_window":true,"report":{"mode":"off","window":8192,"reserve":1024}}"#,
            r#"{"tokens_raw":10,"tokens_forwarded":10,"epoch":1,"epoch_started":false,"over_window":false,"report":{"mode":"eager","window":8192,"reserve":1024,"tokens_estimated":true,"action":"append"}}"#,
            r#"{"tokens_raw":0,"tokens_forwarded":0,"epoch":0,"epoch_started":false,"over_window":false,"report":null}"#,
        ];
        for json in summaries {
            let summary: CompactionSummary = serde_json::from_str(json).unwrap();
            assert_eq!(serde_json::to_string(&summary).unwrap(), json);
        }
        let epoch: CompactionSummary = serde_json::from_str(summaries[0]).unwrap();
        let report = epoch.report.unwrap();
        assert_eq!(report.action, Some(Action::Epoch));
        assert_eq!(report.raw_head, Some(RawHead { messages: 12, digest: 0x0123456789abcdef0123456789abcdef }));
        assert_eq!(report.engine.unwrap().rules[&crate::compact::report::RuleId::CollapseSucceeded].tokens_saved, 180);
    }

    /// A summary archived before a field existed still reads, the field at its default.
    #[test]
    fn a_summary_missing_later_fields_still_reads() {
        let old = r#"{"tokens_raw":7,"tokens_forwarded":5,"epoch":1,"report":{"mode":"epoch","window":100,"reserve":10,"engine":{"pack":"default","rules":{}}}}"#;
        let summary: CompactionSummary = serde_json::from_str(old).unwrap();
        assert_eq!((summary.epoch, summary.epoch_started, summary.over_window), (1, false, false));
        let report = summary.report.unwrap();
        assert_eq!((report.action, report.engine.unwrap().tiers), (None, None));
    }
}

/// What the upstream reported it billed for one answer, in its own tokenizer's tokens (read by
/// `archive::usage`, one arm per wire format).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Usage {
    /// Every prompt token the upstream processed, cached or not.
    pub prompt: Option<u64>,
    /// Prompt tokens read from the upstream's prompt cache (billed at its cache-read rate).
    pub cached: Option<u64>,
    /// Prompt tokens written to the upstream's prompt cache (Anthropic bills them above the input rate).
    pub cache_write: Option<u64>,
    /// Tokens of the answer.
    pub output: Option<u64>,
}
