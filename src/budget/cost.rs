//! What a request cost in money with pare, and what the same request would have cost without it:
//! the prompt split into uncached input, cache reads and cache writes, each at the model's price
//! ([`super::price`]), plus the answer.
//!
//! **With pare**, the split is the upstream's own figures ([`Usage`]) where it reported them, else
//! pare's estimate: the forwarded prompt, of which the part a prompt cache holding the previous
//! forwarded prompt would serve is read from the cache ([`Prompt::shared`]).
//!
//! **Without pare** is always an estimate: the raw prompt, of which the previous raw prompt is read
//! from the cache. When the upstream reported figures, the raw counts are put in its tokens (× its
//! prompt ÷ pare's count of the forwarded prompt); a cache miss the upstream reported on a request
//! pare appended to (an expired or evicted cache) is assumed to have hit the raw prompt alike, and
//! so is a cache hit the previous prompt does not explain (a prefix another session cached).
//!
//! The uncached part of a prompt is a cache write at a provider that bills writes (a price with
//! `write`: Anthropic, whose agents mark their prompts for caching), else plain input. Writes are
//! billed at the 5-minute rate. The answer costs the same either way: its reported tokens, or none.

use serde::Serialize;

use crate::config::PriceConfig;
use crate::exchange::{CompactionSummary, Usage};

/// USD per million tokens → USD per token.
const PER_TOKEN: f64 = 1e-6;

/// One prompt as pare counted it, and the part of it a cache holding the previous prompt of the
/// same kind (raw or forwarded) would serve.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Prompt {
    pub tokens: u64,
    pub shared: u64,
}

/// Tokens of one request by how they are billed.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Billed {
    pub uncached: f64,
    pub cached: f64,
    pub written: f64,
    pub output: f64,
}

impl Billed {
    /// The cost in USD at `price`; a cache price the provider does not have bills at `input`.
    pub fn cost(&self, price: &PriceConfig) -> f64 {
        PER_TOKEN
            * (self.uncached * price.input
                + self.cached * price.cached.unwrap_or(price.input)
                + self.written * price.write.unwrap_or(price.input)
                + self.output * price.output)
    }
}

/// Which figures a cost was reckoned from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CostSource {
    /// The upstream reported the prompt and its cached part.
    Provider,
    /// The upstream reported the prompt but not its cached part: pare's estimate gave that.
    Mixed,
    /// The upstream reported no prompt: pare's counts.
    Estimate,
}

/// One request's cost, with pare and (estimated) without it, in USD.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RequestCost {
    pub with_pare: f64,
    pub without_pare: f64,
    pub source: CostSource,
}

/// The split of a prompt `total` tokens long of which `cached` are read from the cache: the rest
/// is written where the provider bills writes, else plain input.
fn split(total: f64, cached: f64, output: f64, price: &PriceConfig) -> Billed {
    let rest = (total - cached).max(0.0);
    let (uncached, written) = if price.write.is_some() { (0.0, rest) } else { (rest, 0.0) };
    Billed { uncached, cached: cached.min(total), written, output }
}

/// What request cost at `price`, given the upstream's figures (`usage`, if any) and pare's counts
/// of the forwarded and the raw prompt.
pub fn request_cost(price: &PriceConfig, usage: Option<&Usage>, forwarded: Prompt, raw: Prompt) -> RequestCost {
    let output = usage.and_then(|u| u.output).unwrap_or(0) as f64;
    let reported_prompt = usage.and_then(|u| u.prompt);
    let Some(prompt) = reported_prompt else {
        let paid = split(forwarded.tokens as f64, forwarded.shared as f64, output, price);
        let raw = split(raw.tokens as f64, raw.shared as f64, output, price);
        return RequestCost {
            with_pare: paid.cost(price),
            without_pare: raw.cost(price),
            source: CostSource::Estimate,
        };
    };
    let prompt = prompt as f64;
    // The upstream's tokens per token of pare's count (its tokenizer is not pare's).
    let scale = if forwarded.tokens > 0 { prompt / forwarded.tokens as f64 } else { 1.0 };
    let estimated_hit = forwarded.shared as f64 * scale;
    let (paid, source) = match usage.and_then(|u| u.cached) {
        Some(cached) => {
            let cached = (cached as f64).min(prompt);
            let written = match usage.and_then(|u| u.cache_write) {
                Some(written) => (written as f64).min(prompt - cached),
                None if price.write.is_some() => prompt - cached,
                None => 0.0,
            };
            (Billed { uncached: prompt - cached - written, cached, written, output }, CostSource::Provider)
        }
        None => (split(prompt, estimated_hit.min(prompt), output, price), CostSource::Mixed),
    };
    // A miss on what pare forwarded unchanged since the previous request is the cache's, not pare's:
    // the raw prompt would have missed alike. A hit the previous prompt does not explain (a system
    // prompt another session cached) would have hit the raw prompt too.
    let kept = if estimated_hit > 0.0 { (paid.cached / estimated_hit).min(1.0) } else { 1.0 };
    let raw_tokens = raw.tokens as f64 * scale;
    let raw_cached = (raw.shared as f64 * scale * kept).max(paid.cached.min(raw_tokens));
    let raw = split(raw_tokens, raw_cached, output, price);
    RequestCost { with_pare: paid.cost(price), without_pare: raw.cost(price), source }
}

/// pare's counts of request `current`'s forwarded and raw prompts and their parts shared with the
/// session's `previous` request: an agent appends, so the previous raw prompt is a prefix of this
/// one unless the agent edited its history; the previous forwarded prompt is one too unless this
/// request started an epoch (then nothing is counted as shared: pare's kept head is not known here).
pub fn prompts(previous: Option<&CompactionSummary>, current: &CompactionSummary) -> (Prompt, Prompt) {
    let edited = current.report.as_ref().is_some_and(|r| r.history_changed);
    let previous = previous.filter(|_| !edited);
    let forwarded = Prompt {
        tokens: current.tokens_forwarded,
        shared: previous
            .filter(|_| !current.epoch_started)
            .map_or(0, |p| p.tokens_forwarded.min(current.tokens_forwarded)),
    };
    let raw =
        Prompt { tokens: current.tokens_raw, shared: previous.map_or(0, |p| p.tokens_raw.min(current.tokens_raw)) };
    (forwarded, raw)
}

/// A session's cost: the sums over its priced requests, and how many it could not price.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct SessionCost {
    pub with_pare: f64,
    pub without_pare: f64,
    /// Requests whose cost is summed.
    pub n_priced: u64,
    /// Requests of a model with no price: their tokens are counted, never a made-up cost.
    pub n_unpriced: u64,
    /// Priced requests reckoned (partly) from pare's estimates.
    pub n_estimated: u64,
}

impl SessionCost {
    pub fn add(&mut self, cost: Option<&RequestCost>) {
        let Some(cost) = cost else {
            self.n_unpriced += 1;
            return;
        };
        self.with_pare += cost.with_pare;
        self.without_pare += cost.without_pare;
        self.n_priced += 1;
        if cost.source != CostSource::Provider {
            self.n_estimated += 1;
        }
    }

    /// What pare saved (negative: it cost more), when any request was priced.
    pub fn saved(&self) -> Option<f64> {
        (self.n_priced > 0).then_some(self.without_pare - self.with_pare)
    }

    /// For people: "$1.2345 with pare · $2.3456 without (est.) · saved $1.1111", or what is not known.
    pub fn line(&self) -> String {
        if self.n_priced == 0 {
            return if self.n_unpriced > 0 { "no price for this model: tokens only".into() } else { "—".into() };
        }
        let saved = self.without_pare - self.with_pare;
        let mut out = format!(
            "{} with pare · {} without (est.) · {} {}",
            usd(self.with_pare),
            usd(self.without_pare),
            if saved >= 0.0 { "saved" } else { "cost" },
            usd(saved.abs())
        );
        if self.n_estimated > 0 {
            out.push_str(&format!(
                " · {} of {} priced requests from pare's estimates",
                self.n_estimated, self.n_priced
            ));
        }
        if self.n_unpriced > 0 {
            out.push_str(&format!(" · {} unpriced", self.n_unpriced));
        }
        out
    }
}

/// A USD amount for people: four decimals under a dollar, two above.
pub fn usd(amount: f64) -> String {
    if amount.abs() < 1.0 { format!("${amount:.4}") } else { format!("${amount:.2}") }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Anthropic-like: cache reads a tenth of input, writes 1.25×.
    const CLAUDE: PriceConfig =
        PriceConfig { input: 3.0, cached: Some(0.3), write: Some(3.75), write_1h: Some(6.0), output: 15.0 };
    /// OpenAI-like: reads discounted, writes not billed apart.
    const GPT: PriceConfig = PriceConfig { input: 2.0, cached: Some(0.5), write: None, write_1h: None, output: 8.0 };

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-12
    }

    /// The upstream reported everything: pare's side is its figures exactly; the raw side is pare's
    /// counts in the upstream's tokens.
    #[test]
    fn provider_reported_cost_is_the_upstreams_figures() {
        let usage = Usage { prompt: Some(10_000), cached: Some(8_000), cache_write: Some(1_500), output: Some(200) };
        let forwarded = Prompt { tokens: 5_000, shared: 4_000 };
        let raw = Prompt { tokens: 9_000, shared: 8_500 };
        let cost = request_cost(&CLAUDE, Some(&usage), forwarded, raw);
        assert_eq!(cost.source, CostSource::Provider);
        // 500 uncached at 3, 8,000 read at 0.3, 1,500 written at 3.75, 200 out at 15.
        let paid = (500.0 * 3.0 + 8_000.0 * 0.3 + 1_500.0 * 3.75 + 200.0 * 15.0) * 1e-6;
        assert!(close(cost.with_pare, paid), "{cost:?}");
        // Scale 2: raw 18,000 of which 17,000 read (8,000 reported ≥ 4,000 × 2 estimated: no miss);
        // 1,000 written.
        let without = (17_000.0 * 0.3 + 1_000.0 * 3.75 + 200.0 * 15.0) * 1e-6;
        assert!(close(cost.without_pare, without), "{cost:?}");
    }

    /// Nothing reported: both sides from pare's counts; at a provider that does not bill writes the
    /// uncached part is input.
    #[test]
    fn estimated_cost_uses_pares_counts() {
        let forwarded = Prompt { tokens: 3_000, shared: 2_000 };
        let raw = Prompt { tokens: 6_000, shared: 5_500 };
        let cost = request_cost(&GPT, None, forwarded, raw);
        assert_eq!(cost.source, CostSource::Estimate);
        assert!(close(cost.with_pare, (1_000.0 * 2.0 + 2_000.0 * 0.5) * 1e-6), "{cost:?}");
        assert!(close(cost.without_pare, (500.0 * 2.0 + 5_500.0 * 0.5) * 1e-6), "{cost:?}");
        // The same prompts at a provider that bills writes: the uncached parts are writes.
        let cost = request_cost(&CLAUDE, None, forwarded, raw);
        assert!(close(cost.with_pare, (1_000.0 * 3.75 + 2_000.0 * 0.3) * 1e-6), "{cost:?}");
    }

    /// The prompt reported, its cached part not (a local server): pare's estimate splits it.
    #[test]
    fn mixed_cost_splits_the_reported_prompt_by_pares_estimate() {
        let usage = Usage { prompt: Some(4_000), cached: None, cache_write: None, output: Some(100) };
        let cost = request_cost(
            &GPT,
            Some(&usage),
            Prompt { tokens: 4_000, shared: 3_000 },
            Prompt { tokens: 4_000, shared: 3_000 },
        );
        assert_eq!(cost.source, CostSource::Mixed);
        let expected = (1_000.0 * 2.0 + 3_000.0 * 0.5 + 100.0 * 8.0) * 1e-6;
        assert!(close(cost.with_pare, expected) && close(cost.without_pare, expected), "{cost:?}");
    }

    /// A cache the upstream reports cold on a request pare only appended to (the cache expired):
    /// the raw prompt is assumed to have missed alike, so pare is not charged with that miss.
    #[test]
    fn a_cache_miss_pare_did_not_cause_hits_the_raw_estimate_too() {
        let usage = Usage { prompt: Some(1_000), cached: Some(0), cache_write: None, output: Some(0) };
        let same = Prompt { tokens: 1_000, shared: 900 };
        let cost = request_cost(&GPT, Some(&usage), same, same);
        assert!(close(cost.with_pare, cost.without_pare), "{cost:?}");
        assert!(close(cost.with_pare, 1_000.0 * 2.0 * 1e-6), "{cost:?}");
    }

    /// A first request the upstream reports partly cached (a system prompt another session cached):
    /// the raw prompt would have hit that cache too.
    #[test]
    fn a_cache_hit_the_previous_prompt_does_not_explain_hits_the_raw_estimate_too() {
        let usage = Usage { prompt: Some(1_000), cached: Some(600), cache_write: None, output: Some(50) };
        let first = Prompt { tokens: 1_000, shared: 0 };
        let cost = request_cost(&GPT, Some(&usage), first, first);
        assert!(close(cost.with_pare, cost.without_pare), "{cost:?}");
        // An epoch: the upstream read pare's kept head (300) from its cache; the raw prompt would have
        // read its whole previous prompt (the larger share), not both.
        let usage = Usage { prompt: Some(1_000), cached: Some(300), cache_write: None, output: Some(0) };
        let cost = request_cost(
            &GPT,
            Some(&usage),
            Prompt { tokens: 1_000, shared: 0 },
            Prompt { tokens: 4_000, shared: 3_500 },
        );
        assert!(close(cost.without_pare, (500.0 * 2.0 + 3_500.0 * 0.5) * 1e-6), "{cost:?}");
    }

    #[test]
    fn shared_prefixes_follow_appends_epochs_and_edits() {
        let first = CompactionSummary { tokens_raw: 1_000, tokens_forwarded: 1_000, ..Default::default() };
        assert_eq!(prompts(None, &first), (Prompt { tokens: 1_000, shared: 0 }, Prompt { tokens: 1_000, shared: 0 }));
        let append = CompactionSummary { tokens_raw: 1_500, tokens_forwarded: 1_500, ..Default::default() };
        assert_eq!(prompts(Some(&first), &append).0.shared, 1_000);
        let epoch = CompactionSummary {
            tokens_raw: 2_000,
            tokens_forwarded: 800,
            epoch: 1,
            epoch_started: true,
            ..Default::default()
        };
        let (forwarded, raw) = prompts(Some(&append), &epoch);
        assert_eq!((forwarded.shared, raw.shared), (0, 1_500));
        let report = crate::exchange::BudgetReport { history_changed: true, ..Default::default() };
        let edited = CompactionSummary { report: Some(report), ..append.clone() };
        assert_eq!(
            prompts(Some(&first), &edited),
            (Prompt { tokens: 1_500, shared: 0 }, Prompt { tokens: 1_500, shared: 0 })
        );
    }

    /// A model without a price is counted, never priced; a session of such requests says so.
    #[test]
    fn an_unknown_model_shows_tokens_only() {
        let mut session = SessionCost::default();
        session.add(None);
        assert_eq!((session.saved(), session.line()), (None, "no price for this model: tokens only".to_owned()));
        let cost = request_cost(&GPT, None, Prompt { tokens: 1_000, shared: 0 }, Prompt { tokens: 2_000, shared: 0 });
        session.add(Some(&cost));
        assert_eq!((session.n_priced, session.n_unpriced, session.n_estimated), (1, 1, 1));
        assert!(close(session.saved().unwrap(), 1_000.0 * 2.0 * 1e-6));
        assert_eq!(
            session.line(),
            "$0.0020 with pare · $0.0040 without (est.) · saved $0.0020 · 1 of 1 priced requests from pare's estimates · 1 unpriced"
        );
    }
}
