//! Where each forwarded message came from and which rules made it, read from a plan (the engine's
//! [`Fate`] per raw message, as [`super::Compacted::plan`] returns it and the archive stores it): what
//! `pare compact --diff`, `pare sessions show --diff` and the audit UI show.

use super::Fate;
use super::report::RuleSet;

/// What happened to the raw messages, in raw order; `fwd` indexes the forwarded conversation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Raw message `raw` forwarded unchanged as forwarded entry `fwd`.
    Kept { raw: usize, fwd: usize },
    /// Raw message `raw` rewritten by `rules` into forwarded entry `fwd`.
    Edited { raw: usize, fwd: usize, rules: RuleSet },
    /// Raw messages `start..end` replaced by the one marker entry `fwd`.
    Elided { start: usize, end: usize, fwd: usize },
    /// Raw message `raw` left out by `rules`.
    Dropped { raw: usize, rules: RuleSet },
}

impl Step {
    /// The raw messages this step is about.
    pub fn raw_range(&self) -> std::ops::Range<usize> {
        match *self {
            Step::Kept { raw, .. } | Step::Edited { raw, .. } | Step::Dropped { raw, .. } => raw..raw + 1,
            Step::Elided { start, end, .. } => start..end,
        }
    }
}

/// The steps of a request of `n_raw` messages forwarded as a prefix of `n_prefix` entries written
/// from `plan` (what became of raw messages `0..plan.len()`), then the raw messages after those as
/// sent. An elided run is one step, with the messages left out between its messages.
pub fn steps(plan: &[Fate], n_raw: usize, n_prefix: usize) -> Vec<Step> {
    let mut out: Vec<Step> = Vec::with_capacity(n_raw);
    for (raw, fate) in plan.iter().enumerate() {
        let step = match *fate {
            Fate::Kept { at } => Step::Kept { raw, fwd: at },
            Fate::Rewritten { at, rules } => Step::Edited { raw, fwd: at, rules },
            Fate::Dropped { rules } => Step::Dropped { raw, rules },
            Fate::Elided { at } => {
                // A message left out earlier between two of one run's messages belongs to the run.
                let dropped = out.iter().rev().take_while(|s| matches!(s, Step::Dropped { .. })).count();
                let run = out.len() - dropped;
                if let Some(Step::Elided { end, fwd, .. }) = run.checked_sub(1).and_then(|i| out.get_mut(i))
                    && *fwd == at
                {
                    *end = raw + 1;
                    out.truncate(run);
                    continue;
                }
                Step::Elided { start: raw, end: raw + 1, fwd: at }
            }
        };
        out.push(step);
    }
    out.extend((plan.len()..n_raw).map(|raw| Step::Kept { raw, fwd: n_prefix + raw - plan.len() }));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compact::report::RuleId;

    #[test]
    fn an_elided_run_is_one_step_and_the_tail_follows_the_prefix() {
        let rules: RuleSet = [RuleId::Truncate].into_iter().collect();
        let plan = [
            Fate::Kept { at: 0 },
            Fate::Rewritten { at: 1, rules },
            Fate::Elided { at: 2 },
            Fate::Dropped { rules },
            Fate::Elided { at: 2 },
            Fate::Elided { at: 3 },
        ];
        let steps = steps(&plan, 8, 4);
        // Every raw message is in exactly one step, in raw order.
        let covered: Vec<usize> = steps.iter().flat_map(Step::raw_range).collect();
        assert_eq!(covered, (0..8).collect::<Vec<_>>());
        assert_eq!(
            steps,
            [
                Step::Kept { raw: 0, fwd: 0 },
                Step::Edited { raw: 1, fwd: 1, rules },
                Step::Elided { start: 2, end: 5, fwd: 2 },
                Step::Elided { start: 5, end: 6, fwd: 3 },
                Step::Kept { raw: 6, fwd: 4 },
                Step::Kept { raw: 7, fwd: 5 },
            ]
        );
    }
}
