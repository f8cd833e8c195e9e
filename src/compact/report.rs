//! The report of one compaction: per rule, the messages it changed and the characters and tokens it
//! saved; the tiers and elision when a target was given; and why the request was forwarded
//! unchanged when it was (invalid input, failed final validation).

use serde::{Deserialize, Serialize};

/// Every rule and stage, in the order they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RuleId {
    Custom,
    RetryPruning,
    Loops,
    Duplicates,
    Structure,
    CollapseSucceeded,
    Truncate,
    HardCap,
    Arguments,
    Reasoning,
    SystemMessages,
    ConsecutiveAssistant,
    TierLight,
    TierHeavy,
    TierFacts,
    Elision,
    /// Last of the variants: a plan stores a rule set as one bit per variant (`RuleSet::bits`).
    Relevance,
}

impl RuleId {
    pub const ALL: [RuleId; 17] = [
        RuleId::Custom,
        RuleId::RetryPruning,
        RuleId::Loops,
        RuleId::Duplicates,
        RuleId::Structure,
        RuleId::CollapseSucceeded,
        RuleId::Relevance,
        RuleId::Truncate,
        RuleId::HardCap,
        RuleId::Arguments,
        RuleId::Reasoning,
        RuleId::SystemMessages,
        RuleId::ConsecutiveAssistant,
        RuleId::TierLight,
        RuleId::TierHeavy,
        RuleId::TierFacts,
        RuleId::Elision,
    ];

    /// The name used in packs and reports.
    pub fn name(self) -> &'static str {
        match self {
            RuleId::Custom => "custom",
            RuleId::RetryPruning => "retry_pruning",
            RuleId::Loops => "loops",
            RuleId::Duplicates => "duplicates",
            RuleId::Structure => "structure",
            RuleId::CollapseSucceeded => "collapse_succeeded",
            RuleId::Truncate => "truncate",
            RuleId::HardCap => "hard_cap",
            RuleId::Arguments => "arguments",
            RuleId::Reasoning => "reasoning",
            RuleId::SystemMessages => "system_messages",
            RuleId::ConsecutiveAssistant => "consecutive_assistant",
            RuleId::TierLight => "tier_light",
            RuleId::TierHeavy => "tier_heavy",
            RuleId::TierFacts => "tier_facts",
            RuleId::Elision => "elision",
            RuleId::Relevance => "relevance",
        }
    }
}

/// A set of rules: those that rewrote one message. One bit per [`RuleId`], in [`RuleId::ALL`] order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct RuleSet(u32);

impl RuleSet {
    pub fn insert(&mut self, rule: RuleId) {
        self.0 |= 1 << rule as u32;
    }

    pub fn contains(self, rule: RuleId) -> bool {
        self.0 & (1 << rule as u32) != 0
    }

    pub fn union(self, other: RuleSet) -> RuleSet {
        RuleSet(self.0 | other.0)
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The rules, in the order they run.
    pub fn iter(self) -> impl Iterator<Item = RuleId> {
        RuleId::ALL.into_iter().filter(move |rule| self.contains(*rule))
    }

    /// The rules' names joined by ", " ("" for none).
    pub fn names(self) -> String {
        self.iter().map(RuleId::name).collect::<Vec<_>>().join(", ")
    }

    /// The set as stored (`archive::plan`).
    pub fn bits(self) -> u32 {
        self.0
    }

    /// A stored set; `None` when it names a rule this pare does not know.
    pub fn from_bits(bits: u32) -> Option<RuleSet> {
        (bits >> RuleId::ALL.len() == 0).then_some(RuleSet(bits))
    }
}

impl FromIterator<RuleId> for RuleSet {
    fn from_iter<I: IntoIterator<Item = RuleId>>(rules: I) -> RuleSet {
        let mut set = RuleSet::default();
        rules.into_iter().for_each(|rule| set.insert(rule));
        set
    }
}

/// What one rule did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RuleStats {
    pub messages: u64,
    pub chars_saved: i64,
    /// The message's token saving, shared among the rules that changed it in proportion to the
    /// characters each removed.
    pub tokens_saved: i64,
}

/// Salience tiers and elision (present when a token target or a history budget was given).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TierReport {
    /// What tiers and elision aimed at: the window's target, or the one the history budget sets when
    /// the history is over its high mark, whichever is lower. `None`: neither asked for anything.
    pub target_tokens: Option<u64>,
    pub tokens_after_rules: u64,
    /// The history's tokens after the rules, when a history budget was given (eager mode).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub history_tokens_after_rules: Option<u64>,
    pub focus: u64,
    pub recent: u64,
    pub summary: u64,
    pub background: u64,
    pub elided_groups: u64,
    pub elided_messages: u64,
    /// The target could not be reached (system + users + tail alone are over it).
    pub over_target: bool,
}

/// The report of one compaction. Archived inside each request's summary: every field has a default,
/// so a summary written before a field existed still reads.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Report {
    pub pack: String,
    pub messages_in: usize,
    pub messages_out: usize,
    /// First index of the protected tail (raw messages from here on are forwarded unchanged).
    pub boundary: usize,
    pub messages_changed: u64,
    pub messages_dropped: u64,
    pub chars_saved: i64,
    pub tokens_saved: i64,
    /// Per rule, in the order they run; rules that did nothing are left out.
    pub rules: indexmap::IndexMap<RuleId, RuleStats>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tiers: Option<TierReport>,
    /// The input itself breaks invariant 1 (an agent bug): forwarded unchanged.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub input_invalid: Option<String>,
    /// The output failed the final validation: the original request was returned.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub validation_failed: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rule_reads_and_writes_by_its_pack_name() {
        for rule in RuleId::ALL {
            let json = serde_json::to_string(&rule).unwrap();
            assert_eq!(json, format!("\"{}\"", rule.name()));
            assert_eq!(serde_json::from_str::<RuleId>(&json).unwrap(), rule);
        }
    }
}
