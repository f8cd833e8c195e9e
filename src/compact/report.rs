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
}

impl RuleId {
    pub const ALL: [RuleId; 16] = [
        RuleId::Custom,
        RuleId::RetryPruning,
        RuleId::Loops,
        RuleId::Duplicates,
        RuleId::Structure,
        RuleId::CollapseSucceeded,
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
        }
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
