//! Rule packs: the strict YAML schema of `rules/*.yaml`, the built-in packs, deep-merging the
//! config's `compaction.rules` overrides onto a pack, and validation that reports every problem.
//!
//! The schema is strict (`deny_unknown_fields` everywhere) and every field has a default, so an
//! override only names what it changes. Structural errors come from serde (the first one, with its
//! path); [`RulesSpec::validate`] then lists every semantic problem (bad regex, out-of-range number,
//! unknown placeholder, a rule that would touch user messages) with its dotted path.

use regex::Regex;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::config::yaml::{self, Problem, regex_error};

/// The built-in packs, embedded in the binary.
pub const BUILTIN_PACKS: &[(&str, &str)] = &[
    ("default", include_str!("../../rules/default.yaml")),
    ("hermes", include_str!("../../rules/hermes.yaml")),
    ("openai", include_str!("../../rules/openai.yaml")),
];

/// A rule pack file.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Pack {
    /// Short name shown in reports.
    pub name: String,
    /// What the pack is for.
    pub description: String,
    pub rules: RulesSpec,
}

/// Every rule's switch and parameters. The order in which rules run is fixed (see `docs/engine.md`).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RulesSpec {
    /// Turns at the end that are never touched: the tail starts at the N-th last assistant message.
    pub protect_last_turns: u32,
    /// How a tool result's success is read.
    pub success: SuccessSpec,
    /// Argument names tried, in order, for a call's key argument shown in markers.
    pub key_arguments: Vec<String>,
    pub custom: Vec<CustomRule>,
    pub retry_pruning: MarkerRule,
    pub loops: LoopRule,
    pub duplicates: DuplicateRule,
    pub structure: StructureRule,
    pub collapse_succeeded: CollapseRule,
    pub relevance: RelevanceRule,
    pub truncate: TruncateRule,
    pub hard_cap: HardCapRule,
    pub arguments: ArgumentsRule,
    pub reasoning: ReasoningRule,
    pub system_messages: SystemRule,
    pub consecutive_assistant: Toggle,
    pub tiers: TierSpec,
}

impl Default for RulesSpec {
    fn default() -> Self {
        RulesSpec {
            protect_last_turns: 5,
            success: SuccessSpec::default(),
            key_arguments: [
                "path",
                "file_path",
                "filepath",
                "file",
                "filename",
                "file_name",
                "command",
                "cmd",
                "pattern",
                "query",
                "url",
                "code",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect(),
            custom: Vec::new(),
            retry_pruning: MarkerRule {
                enabled: true,
                template: "[retried: {call} failed{error}; a later retry succeeded{retrieve}]".into(),
            },
            loops: LoopRule::default(),
            duplicates: DuplicateRule::default(),
            structure: StructureRule::default(),
            collapse_succeeded: CollapseRule::default(),
            relevance: RelevanceRule::default(),
            truncate: TruncateRule::default(),
            hard_cap: HardCapRule::default(),
            arguments: ArgumentsRule::default(),
            reasoning: ReasoningRule::default(),
            system_messages: SystemRule::default(),
            consecutive_assistant: Toggle { enabled: true },
            tiers: TierSpec::default(),
        }
    }
}

/// How success and failure are read from a tool result.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct SuccessSpec {
    /// Regexes that mark a text result as failed when no exit status is present.
    pub error_patterns: Vec<String>,
    /// An explicit exit status (`exit_code`, `<returncode>`, `[Command finished with exit code N]`)
    /// decides success even when the text matches an error pattern (e.g. `grep error` exiting 0).
    pub trust_exit_code: bool,
}

impl Default for SuccessSpec {
    fn default() -> Self {
        SuccessSpec {
            error_patterns: [
                r"Traceback \(most recent call last\)",
                r"(?-u:\b)(?:error|ERROR|Error)(?:\[[A-Za-z0-9_]+\])?:",
                r"(?:Error|Exception): ",
                r"(?-u:\b)FAILED(?-u:\b)",
                r"panicked at",
                r"command not found",
                r"(?m)^fatal: ",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect(),
            trust_exit_code: true,
        }
    }
}

/// A rule with only a switch.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Toggle {
    pub enabled: bool,
}

impl Default for Toggle {
    fn default() -> Self {
        Toggle { enabled: true }
    }
}

/// A rule whose output is one marker line.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct MarkerRule {
    pub enabled: bool,
    pub template: String,
}

impl Default for MarkerRule {
    fn default() -> Self {
        MarkerRule { enabled: true, template: String::new() }
    }
}

/// The same call (tool and arguments) made `min_repeats` times or more.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoopRule {
    pub enabled: bool,
    pub min_repeats: u32,
    pub template: String,
}

impl Default for LoopRule {
    fn default() -> Self {
        LoopRule {
            enabled: true,
            min_repeats: 3,
            template:
                "[pare: repeated call {k} of {total}: {call} → {status}, {chars} chars{error}; see the latest result{retrieve}]"
                    .into(),
        }
    }
}

/// The same output seen again later: the older copy points to the newer one.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct DuplicateRule {
    pub enabled: bool,
    /// Outputs shorter than this are left alone (the pointer would not be much shorter).
    pub min_chars: usize,
    pub template: String,
}

impl Default for DuplicateRule {
    fn default() -> Self {
        DuplicateRule {
            enabled: true,
            min_chars: 200,
            template:
                "[pare: output of {call} ({chars} chars) identical to the later result of call {later_id}{retrieve}]"
                    .into(),
        }
    }
}

/// Large successful reads of source files become a map of their definitions.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct StructureRule {
    pub enabled: bool,
    /// Reads shorter than this are left to the other rules.
    pub min_chars: usize,
    /// Largest number of definitions listed.
    pub max_entries: usize,
    /// Deepest nesting listed (1 = top level only).
    pub max_depth: usize,
    pub template: String,
}

impl Default for StructureRule {
    fn default() -> Self {
        StructureRule {
            enabled: true,
            min_chars: 2000,
            max_entries: 150,
            max_depth: 2,
            template:
                "[pare: structure of {path} ({lines} lines, {chars} chars; body omitted; {restore} restores it{retrieve}){names}]"
                    .into(),
        }
    }
}

/// Rule 1 of the spec.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct CollapseRule {
    pub enabled: bool,
    /// Results shorter than this are left alone.
    pub min_chars: usize,
    /// Tool names (regexes, whole name) never collapsed.
    pub except_tools: Vec<String>,
    pub template: String,
}

impl Default for CollapseRule {
    fn default() -> Self {
        CollapseRule {
            enabled: true,
            min_chars: 0,
            except_tools: Vec::new(),
            template: "[tool: {ref} → {status}, {chars} chars, {lines} lines{files}{restore}{retrieve}{names}]".into(),
        }
    }
}

/// The lines of a large old output that name what the conversation works on now, kept verbatim
/// under the marker that replaces it (`compact::relevance`).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RelevanceRule {
    pub enabled: bool,
    /// Outputs shorter than this keep only their marker.
    pub min_chars: usize,
    /// At most this many lines kept of one output.
    pub max_lines: usize,
    /// A definition of a numbered source view at most this long is kept whole around a line that
    /// names an identifier in play.
    pub chunk_lines: usize,
    /// Lines kept on each side of such a line outside a definition kept whole.
    pub context_lines: usize,
    /// Assistant turns before the protected tail whose identifiers are in play (with the task and
    /// the tail).
    pub recent_turns: usize,
}

impl Default for RelevanceRule {
    fn default() -> Self {
        RelevanceRule {
            enabled: true,
            min_chars: 2000,
            max_lines: 48,
            chunk_lines: 48,
            context_lines: 6,
            recent_turns: 5,
        }
    }
}

/// Rule 2 of the spec.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct TruncateRule {
    pub enabled: bool,
    pub max_chars: usize,
    pub head_lines: usize,
    pub tail_lines: usize,
    /// The line put between head and tail.
    pub template: String,
}

impl Default for TruncateRule {
    fn default() -> Self {
        TruncateRule {
            enabled: true,
            max_chars: 500,
            head_lines: 10,
            tail_lines: 5,
            template: "[...truncated {n} lines...{retrieve}]".into(),
        }
    }
}

/// A hard cap on one tool result, in characters (for outputs with few, very long lines).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct HardCapRule {
    pub enabled: bool,
    pub max_chars: usize,
    pub template: String,
}

impl Default for HardCapRule {
    fn default() -> Self {
        HardCapRule { enabled: true, max_chars: 4000, template: "[pare: …truncated {n} chars…{retrieve}]".into() }
    }
}

/// Large string values in the arguments of old, succeeded tool calls keep their first and last
/// lines (or, with few long lines, their first third and last sixth of `max_chars`) around a marker
/// line; the call itself, its keys and their order stay.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ArgumentsRule {
    pub enabled: bool,
    /// String values up to this many chars are left alone.
    pub max_chars: usize,
    pub head_lines: usize,
    pub tail_lines: usize,
    /// The line put in place of what was cut.
    pub template: String,
}

impl Default for ArgumentsRule {
    fn default() -> Self {
        ArgumentsRule {
            enabled: true,
            max_chars: 500,
            head_lines: 4,
            tail_lines: 2,
            template:
                "[pare: {lines} lines, {chars} chars of this old {key} elided; the call was sent in full{retrieve}]"
                    .into(),
        }
    }
}

/// Old reasoning: `reasoning_content`, `reasoning`, thinking parts and `<think>` blocks.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReasoningRule {
    pub enabled: bool,
    /// Also remove `<think>…</think>` blocks at the start of assistant text.
    pub think_tags: bool,
}

impl Default for ReasoningRule {
    fn default() -> Self {
        ReasoningRule { enabled: true, think_tags: true }
    }
}

/// Rule 3 of the spec.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct SystemRule {
    pub enabled: bool,
    /// Also condense the first system message. Off by default: it is the agent's instructions and
    /// the start of every prompt cache; replacing it changes the model's behaviour and the cache.
    pub replace_first: bool,
    pub template: String,
}

impl Default for SystemRule {
    fn default() -> Self {
        SystemRule { enabled: true, replace_first: false, template: "[system prompt: {summary}{retrieve}]".into() }
    }
}

/// What a user-defined rule does to a matched message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CustomAction {
    /// Leave it alone: no later rule and no tier compression touches it (elision still may).
    Keep,
    /// Keep `head` first and `tail` last lines.
    Truncate,
    /// Replace by `template`.
    Marker,
    /// Replace by an empty string.
    Clear,
}

/// Which messages a user-defined rule applies to. Every given condition must hold.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct CustomMatch {
    /// `tool`, `assistant` or `system` (user messages are never touched).
    pub role: Option<String>,
    /// Regex over the whole tool name (tool results and assistant calls).
    pub tool: Option<String>,
    /// Regex searched in the call's raw arguments.
    pub arguments: Option<String>,
    /// Regex searched in the content text.
    pub content: Option<String>,
    pub min_chars: Option<usize>,
    pub max_chars: Option<usize>,
    /// `ok`, `failed` or `any` (tool results).
    pub status: Option<String>,
}

/// A user-defined rule.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CustomRule {
    pub name: String,
    #[serde(default = "yes")]
    pub enabled: bool,
    #[serde(rename = "match", default)]
    pub matches: CustomMatch,
    pub action: CustomAction,
    #[serde(default = "ten")]
    pub head: usize,
    #[serde(default = "five")]
    pub tail: usize,
    #[serde(default)]
    pub template: Option<String>,
}

fn yes() -> bool {
    true
}
fn ten() -> usize {
    10
}
fn five() -> usize {
    5
}

/// How each salience tier is compressed (used only when a token target is given).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct TierSpec {
    /// Recent tier: results over `light_max_chars` keep `light_head` + `light_tail` lines.
    pub light_max_chars: usize,
    pub light_head: usize,
    pub light_tail: usize,
    /// Summary tier: results become this marker; assistant text is cut to `heavy_text_chars`.
    pub heavy_template: String,
    pub heavy_text_chars: usize,
    /// Background tier: results become this marker; assistant text becomes `facts_text_template`.
    pub facts_template: String,
    pub facts_text_template: String,
    /// One message replacing each run of elided groups.
    pub elision_template: String,
}

impl Default for TierSpec {
    fn default() -> Self {
        TierSpec {
            light_max_chars: 300,
            light_head: 5,
            light_tail: 3,
            heavy_template:
                "[tool: {ref} → {status}, {chars} chars, {lines} lines{error}{files}{restore}{retrieve}{names}]".into(),
            heavy_text_chars: 200,
            facts_template: "[tool: {ref} → {status}{retrieve}]".into(),
            facts_text_template: "[pare: assistant note, {chars} chars omitted{retrieve}]".into(),
            elision_template: "[pare: {n} earlier messages elided — {tools}{files}{retrieve}{names}]".into(),
        }
    }
}

/// The roles a custom rule may match (user messages are never touched).
const CUSTOM_ROLES: [&str; 3] = ["tool", "assistant", "system"];

/// Prefixes every marker must start with, so that pare recognises its own output (idempotence).
pub const MARKER_PREFIXES: &[&str] = &["[pare", "[tool:", "[retried:", "[system prompt:", "[...truncated"];

/// A placeholder-bearing template and the placeholders it may use.
struct TemplateCheck<'a> {
    path: String,
    text: &'a str,
    allowed: &'static [&'static str],
}

const CALL_FACTS: &[&str] =
    &["tool", "arg", "call", "ref", "id", "status", "chars", "lines", "error", "files", "names", "retrieve"];
/// [`CALL_FACTS`] and `{restore}` (the call that shows a file view again): the templates a
/// [`Conversation`](super::conversation::Conversation) renders.
const VIEW_FACTS: &[&str] =
    &["tool", "arg", "call", "ref", "id", "status", "chars", "lines", "error", "files", "names", "restore", "retrieve"];

impl RulesSpec {
    /// Every semantic problem, each with its dotted path under `rules`.
    pub fn validate(&self) -> Vec<Problem> {
        let mut problems = Vec::new();
        let mut push = |path: String, message: String| problems.push(Problem { line: None, path, message });
        for (i, pattern) in self.success.error_patterns.iter().enumerate() {
            if let Err(e) = Regex::new(pattern) {
                push(
                    format!("rules.success.error_patterns.{i}"),
                    format!("bad regex `{pattern}`: {}", regex_error(&e)),
                );
            }
        }
        for (i, pattern) in self.collapse_succeeded.except_tools.iter().enumerate() {
            if let Err(e) = Regex::new(pattern) {
                push(
                    format!("rules.collapse_succeeded.except_tools.{i}"),
                    format!("bad regex `{pattern}`: {}", regex_error(&e)),
                );
            }
        }
        if self.loops.min_repeats < 2 {
            push("rules.loops.min_repeats".into(), format!("must be at least 2, got {}", self.loops.min_repeats));
        }
        if self.truncate.head_lines + self.truncate.tail_lines == 0 {
            push("rules.truncate.head_lines".into(), "head_lines + tail_lines must be at least 1".into());
        }
        if self.hard_cap.max_chars < 100 {
            push("rules.hard_cap.max_chars".into(), format!("must be at least 100, got {}", self.hard_cap.max_chars));
        }
        if self.arguments.head_lines == 0 {
            push(
                "rules.arguments.head_lines".into(),
                "must be at least 1 (the first line names what the call did)".into(),
            );
        }
        if self.arguments.max_chars < 300 {
            push("rules.arguments.max_chars".into(), format!("must be at least 300, got {}", self.arguments.max_chars));
        }
        if self.structure.max_depth == 0 {
            push("rules.structure.max_depth".into(), "must be at least 1".into());
        }
        if self.tiers.light_head + self.tiers.light_tail == 0 {
            push("rules.tiers.light_head".into(), "light_head + light_tail must be at least 1".into());
        }
        let mut seen_names = std::collections::BTreeSet::new();
        for (i, rule) in self.custom.iter().enumerate() {
            let at = format!("rules.custom.{i}");
            if rule.name.trim().is_empty() {
                push(format!("{at}.name"), "must not be empty".into());
            } else if !seen_names.insert(rule.name.clone()) {
                push(format!("{at}.name"), format!("duplicate rule name `{}`", rule.name));
            }
            if let Some(role) = &rule.matches.role {
                match role.as_str() {
                    "tool" | "assistant" | "system" => {}
                    "user" => push(format!("{at}.match.role"), "user messages are never touched".into()),
                    other => push(
                        format!("{at}.match.role"),
                        match yaml::did_you_mean(other, CUSTOM_ROLES) {
                            Some(role) => format!(
                                "unknown role `{other}`; did you mean `{role}`? (expected tool, assistant or system)"
                            ),
                            None => format!("unknown role `{other}` (expected tool, assistant or system)"),
                        },
                    ),
                }
            }
            for (key, pattern) in [
                ("tool", &rule.matches.tool),
                ("arguments", &rule.matches.arguments),
                ("content", &rule.matches.content),
            ] {
                if let Some(pattern) = pattern
                    && let Err(e) = Regex::new(pattern)
                {
                    push(format!("{at}.match.{key}"), format!("bad regex `{pattern}`: {}", regex_error(&e)));
                }
            }
            if let Some(status) = &rule.matches.status
                && !matches!(status.as_str(), "ok" | "failed" | "any")
            {
                let hint = yaml::did_you_mean(status, ["ok", "failed", "any"])
                    .map(|s| format!("; did you mean `{s}`?"))
                    .unwrap_or_default();
                push(
                    format!("{at}.match.status"),
                    format!("unknown status `{status}`{hint} (expected ok, failed or any)"),
                );
            }
            if let (Some(lo), Some(hi)) = (rule.matches.min_chars, rule.matches.max_chars)
                && lo > hi
            {
                push(format!("{at}.match.min_chars"), format!("min_chars {lo} is larger than max_chars {hi}"));
            }
            match rule.action {
                CustomAction::Marker if rule.template.is_none() => {
                    push(format!("{at}.template"), "action `marker` needs a template".into())
                }
                CustomAction::Truncate if rule.head + rule.tail == 0 => {
                    push(format!("{at}.head"), "head + tail must be at least 1".into())
                }
                _ => {}
            }
        }
        let mut templates = vec![
            TemplateCheck {
                path: "rules.retry_pruning.template".into(),
                text: &self.retry_pruning.template,
                allowed: CALL_FACTS,
            },
            TemplateCheck {
                path: "rules.loops.template".into(),
                text: &self.loops.template,
                allowed: &[
                    "tool", "arg", "call", "ref", "id", "status", "chars", "lines", "error", "files", "names", "k",
                    "total", "retrieve",
                ],
            },
            TemplateCheck {
                path: "rules.duplicates.template".into(),
                text: &self.duplicates.template,
                allowed: &[
                    "tool", "arg", "call", "ref", "id", "status", "chars", "lines", "error", "files", "names",
                    "later_id", "retrieve",
                ],
            },
            TemplateCheck {
                path: "rules.structure.template".into(),
                text: &self.structure.template,
                allowed: &[
                    "tool", "arg", "call", "ref", "id", "path", "lines", "chars", "language", "names", "restore",
                    "retrieve",
                ],
            },
            TemplateCheck {
                path: "rules.collapse_succeeded.template".into(),
                text: &self.collapse_succeeded.template,
                allowed: VIEW_FACTS,
            },
            TemplateCheck {
                path: "rules.truncate.template".into(),
                text: &self.truncate.template,
                allowed: &["n", "retrieve"],
            },
            TemplateCheck {
                path: "rules.hard_cap.template".into(),
                text: &self.hard_cap.template,
                allowed: &["n", "retrieve"],
            },
            TemplateCheck {
                path: "rules.arguments.template".into(),
                text: &self.arguments.template,
                allowed: &["lines", "chars", "key", "tool", "retrieve"],
            },
            TemplateCheck {
                path: "rules.system_messages.template".into(),
                text: &self.system_messages.template,
                allowed: &["summary", "chars", "lines", "retrieve"],
            },
            TemplateCheck {
                path: "rules.tiers.heavy_template".into(),
                text: &self.tiers.heavy_template,
                allowed: VIEW_FACTS,
            },
            TemplateCheck {
                path: "rules.tiers.facts_template".into(),
                text: &self.tiers.facts_template,
                allowed: CALL_FACTS,
            },
            TemplateCheck {
                path: "rules.tiers.facts_text_template".into(),
                text: &self.tiers.facts_text_template,
                allowed: &["chars", "lines", "retrieve"],
            },
            TemplateCheck {
                path: "rules.tiers.elision_template".into(),
                text: &self.tiers.elision_template,
                allowed: &["n", "tools", "files", "retrieve", "names"],
            },
        ];
        for (i, rule) in self.custom.iter().enumerate() {
            if let Some(t) = &rule.template {
                templates.push(TemplateCheck {
                    path: format!("rules.custom.{i}.template"),
                    text: t,
                    allowed: CALL_FACTS,
                });
            }
        }
        for t in templates {
            if !MARKER_PREFIXES.iter().any(|p| t.text.starts_with(p)) {
                push(
                    t.path.clone(),
                    format!(
                        "template `{}` must start with one of {} so that pare recognises its own markers",
                        t.text,
                        MARKER_PREFIXES.join(", ")
                    ),
                );
            }
            for name in placeholders(t.text) {
                if !t.allowed.contains(&name) {
                    push(
                        t.path.clone(),
                        format!("unknown placeholder `{{{name}}}` (allowed: {})", t.allowed.join(", ")),
                    );
                }
            }
        }
        problems
    }
}

/// Why a pack could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum PackError {
    #[error("cannot read rule pack {path}: {source} (built-in packs: {})", builtin_names())]
    Read { path: String, source: std::io::Error },
    #[error("rule pack {name} is not valid YAML: {message}")]
    Yaml { name: String, message: String },
    #[error("{}", render(.name, .problems))]
    Invalid { name: String, problems: Vec<Problem> },
}

/// The built-in pack names, comma-separated.
fn builtin_names() -> String {
    BUILTIN_PACKS.iter().map(|(name, _)| *name).collect::<Vec<_>>().join(", ")
}

fn render(name: &str, problems: &[Problem]) -> String {
    let mut out = format!("{} problem(s) in rule pack {name}", problems.len());
    for p in problems {
        out.push_str(&format!("\n  {}: {}", p.path, p.message));
    }
    out
}

/// Largest rule pack file read, in bytes (the built-in packs are a few KiB).
pub const MAX_PACK_BYTES: u64 = 1024 * 1024;

/// Placeholder names used in a template, in order (`{name}`; `{{` is not special).
pub fn placeholders(template: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        let after = &rest[open + 1..];
        match after.find('}') {
            Some(close) if after[..close].chars().all(|c| c.is_ascii_alphanumeric() || c == '_') && close > 0 => {
                out.push(&after[..close]);
                rest = &after[close + 1..];
            }
            _ => rest = after,
        }
    }
    out
}

/// The text of a pack named `default|hermes|openai`, or read from a path: a regular file of at most
/// [`MAX_PACK_BYTES`] (a device or a pipe named by mistake is refused, never read without end).
pub fn pack_text(name_or_path: &str) -> Result<String, PackError> {
    use std::io::Read;
    if let Some((_, text)) = BUILTIN_PACKS.iter().find(|(n, _)| *n == name_or_path) {
        return Ok((*text).to_owned());
    }
    let read_error = |source| PackError::Read { path: name_or_path.to_owned(), source };
    let file = std::fs::File::open(name_or_path).map_err(read_error)?;
    let meta = file.metadata().map_err(read_error)?;
    if !meta.is_file() || meta.len() > MAX_PACK_BYTES {
        let why = format!("not a regular file of at most {MAX_PACK_BYTES} bytes");
        return Err(read_error(std::io::Error::new(std::io::ErrorKind::InvalidInput, why)));
    }
    let mut text = String::new();
    file.take(MAX_PACK_BYTES).read_to_string(&mut text).map_err(read_error)?;
    Ok(text)
}

/// Parse a pack's text, deep-merge `overrides` onto its `rules:`, and validate the result.
pub fn load_pack(name: &str, text: &str, overrides: Option<&Value>) -> Result<Pack, PackError> {
    let problems = check_pack(text);
    if !problems.is_empty() {
        return Err(PackError::Invalid { name: name.to_owned(), problems });
    }
    let root = yaml::parse(text).map_err(|p| PackError::Yaml { name: name.to_owned(), message: p.message })?;
    let mut tree = root.to_json();
    if let Some(overrides) = overrides {
        let Value::Object(top) = &mut tree else {
            return Err(PackError::Invalid {
                name: name.to_owned(),
                problems: vec![Problem { line: None, path: String::new(), message: "a rule pack is a mapping".into() }],
            });
        };
        let rules = top.entry("rules").or_insert_with(|| Value::Object(Default::default()));
        deep_merge(rules, overrides);
    }
    // The pack alone is valid (checked above): what fails now comes from the overrides, so it is
    // reported at the config's `compaction.rules` paths.
    let name = if overrides.is_some() { format!("{name} with compaction.rules") } else { name.to_owned() };
    let at = |path: &str| if overrides.is_some() { config_path(path) } else { path.to_owned() };
    let mut problems = Vec::new();
    let pack: Option<Pack> = yaml::deserialize_value_all(tree, &|_| None, &mut problems);
    if let Some(pack) = &pack {
        problems.extend(pack.rules.validate());
    }
    for p in &mut problems {
        p.path = at(&p.path);
    }
    match pack {
        Some(pack) if problems.is_empty() => Ok(pack),
        _ => Err(PackError::Invalid { name, problems }),
    }
}

impl Pack {
    /// The pack a configuration selects: `compaction.pack` (a built-in name, or a path read here)
    /// with `compaction.rules` deep-merged onto its `rules:`.
    pub fn of_config(config: &crate::config::Config) -> Result<Pack, PackError> {
        let name = &config.compaction.pack;
        load_pack(name, &pack_text(name)?, config.compaction.rules.as_ref())
    }
}

/// `rules.x.y` of a pack → `compaction.rules.x.y` of the config that overrides it.
fn config_path(path: &str) -> String {
    match path.strip_prefix("rules") {
        Some(rest) => format!("compaction.rules{rest}"),
        None => format!("compaction.rules.{path}"),
    }
}

/// Validate a config's `compaction.rules` overrides against the pack they apply to. Paths start with
/// `compaction.rules.` so that the config's line map can place them. Problems of the pack itself are
/// reported by [`check_pack`].
pub fn check_overrides(pack_text: &str, overrides: &Value) -> Vec<Problem> {
    if !overrides.is_object() {
        return vec![Problem { line: None, path: "compaction.rules".into(), message: "must be a mapping".into() }];
    }
    let Ok(root) = yaml::parse(pack_text) else { return Vec::new() };
    let mut tree = root.to_json();
    let Value::Object(top) = &mut tree else { return Vec::new() };
    let rules = top.entry("rules").or_insert_with(|| Value::Object(Default::default()));
    deep_merge(rules, overrides);
    let mut problems = Vec::new();
    if let Some(pack) = yaml::deserialize_value_all::<Pack>(tree, &|_| None, &mut problems) {
        problems.extend(pack.rules.validate());
    }
    for p in &mut problems {
        p.path = config_path(&p.path);
    }
    problems
}

/// Every problem of the pack a configuration selects (`compaction.pack`) and of the configuration's
/// `compaction.rules` overrides, in one list: the pack's own problems are placed at the config's
/// `compaction.pack` line and name the pack's line; the overrides' problems are placed by `line_of`
/// (the config's line of a dotted path). A pack that cannot be read is one problem, and the
/// overrides are then checked against the built-in `default` pack, so that a bad pack name does not
/// hide the overrides' mistakes.
pub fn check_selected(pack: &str, overrides: Option<&Value>, line_of: &dyn Fn(&str) -> Option<u64>) -> Vec<Problem> {
    let pack_line = line_of("compaction.pack");
    let mut problems = Vec::new();
    let pack_source = match pack_text(pack) {
        // A blank name is the configuration's own problem (`Config::validate`).
        Err(_) if pack.trim().is_empty() => BUILTIN_PACKS[0].1.to_owned(),
        Ok(source) => {
            problems.extend(check_pack(&source).into_iter().map(|p| Problem {
                line: pack_line,
                path: "compaction.pack".into(),
                message: match p.line {
                    Some(line) => format!("rule pack `{pack}` line {line}: {}: {}", p.path, p.message),
                    None => format!("rule pack `{pack}`: {}: {}", p.path, p.message),
                },
            }));
            source
        }
        Err(err) => {
            problems.push(Problem { line: pack_line, path: "compaction.pack".into(), message: err.to_string() });
            BUILTIN_PACKS[0].1.to_owned()
        }
    };
    if let Some(overrides) = overrides {
        for mut p in check_overrides(&pack_source, overrides) {
            p.line = p.line.or_else(|| line_of(&p.path));
            problems.push(p);
        }
    }
    problems
}

/// Maps merge key by key; anything else (scalars, lists) replaces.
pub fn deep_merge(base: &mut Value, over: &Value) {
    match (base, over) {
        (Value::Object(b), Value::Object(o)) => {
            for (k, v) in o {
                match b.get_mut(k) {
                    Some(slot) => deep_merge(slot, v),
                    None => {
                        b.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (slot, v) => *slot = v.clone(),
    }
}

/// Validate a rule pack's text for `pare check`: every problem (structural and semantic), each with
/// its line and dotted path, in line order.
pub fn check_pack(text: &str) -> Vec<Problem> {
    let root = match yaml::parse(text) {
        Ok(root) => root,
        Err(problem) => return vec![problem],
    };
    let mut problems = Vec::new();
    let pack: Option<Pack> = yaml::deserialize_all(&root, &mut problems);
    if let Some(pack) = pack {
        for mut p in pack.rules.validate() {
            p.line = p.line.or_else(|| root.line_of(&p.path));
            problems.push(p);
        }
    }
    problems.sort_by_key(|p| p.line.unwrap_or(u64::MAX));
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_packs_load_and_validate() {
        for (name, text) in BUILTIN_PACKS {
            let pack = load_pack(name, text, None).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(&pack.name, name);
            assert!(check_pack(text).is_empty(), "{name}: {:?}", check_pack(text));
        }
    }

    #[test]
    fn overrides_merge_deeply() {
        let overrides = serde_json::json!({"truncate": {"max_chars": 900}, "protect_last_turns": 2});
        let pack = load_pack("default", BUILTIN_PACKS[0].1, Some(&overrides)).unwrap();
        assert_eq!(pack.rules.truncate.max_chars, 900);
        assert_eq!(pack.rules.truncate.head_lines, 10, "siblings of an override keep the pack's value");
        assert_eq!(pack.rules.protect_last_turns, 2);
    }

    #[test]
    fn unknown_key_is_refused_with_its_path() {
        let overrides = serde_json::json!({"truncate": {"max_char": 900}});
        let err = load_pack("default", BUILTIN_PACKS[0].1, Some(&overrides)).unwrap_err();
        let PackError::Invalid { problems, .. } = err else { panic!("expected Invalid, got {err}") };
        assert_eq!(problems[0].path, "compaction.rules.truncate.max_char");
        assert!(problems[0].message.contains("max_char"), "{}", problems[0].message);
    }

    #[test]
    fn every_semantic_problem_is_listed() {
        let text = r#"
name: bad
rules:
  success:
    error_patterns: ["(unclosed"]
  loops:
    min_repeats: 1
  collapse_succeeded:
    template: "done: {call} {nope}"
  custom:
    - name: x
      match: { role: user }
      action: marker
"#;
        let problems = check_pack(text);
        let paths: Vec<&str> = problems.iter().map(|p| p.path.as_str()).collect();
        for want in [
            "rules.success.error_patterns.0",
            "rules.loops.min_repeats",
            "rules.collapse_succeeded.template",
            "rules.custom.0.match.role",
            "rules.custom.0.template",
        ] {
            assert!(paths.contains(&want), "missing {want} in {paths:?}");
        }
        // Both the prefix and the unknown placeholder of the collapse template are reported.
        assert_eq!(paths.iter().filter(|p| **p == "rules.collapse_succeeded.template").count(), 2);
        let lines: Vec<Option<u64>> = problems.iter().map(|p| p.line).collect();
        assert_eq!(lines, vec![Some(5), Some(7), Some(9), Some(9), Some(11), Some(12)], "{problems:?}");
    }

    #[test]
    fn arguments_settings_are_checked() {
        let text =
            "name: x\nrules:\n  arguments:\n    max_chars: 100\n    head_lines: 0\n    template: '[pare: {n} cut]'\n";
        let found: Vec<(Option<u64>, String)> = check_pack(text).into_iter().map(|p| (p.line, p.path)).collect();
        let want = ["rules.arguments.max_chars", "rules.arguments.head_lines", "rules.arguments.template"];
        assert_eq!(found, [4, 5, 6].iter().zip(want).map(|(l, p)| (Some(*l), p.to_owned())).collect::<Vec<_>>());
        let problems = check_overrides(BUILTIN_PACKS[0].1, &serde_json::json!({"arguments": {"tail_line": 1}}));
        assert_eq!(problems[0].path, "compaction.rules.arguments.tail_line");
        let pack = load_pack("default", BUILTIN_PACKS[0].1, None).unwrap();
        assert_eq!(pack.rules.arguments, ArgumentsRule::default(), "the default pack spells out the defaults");
    }

    #[test]
    fn structural_problems_are_all_listed_with_lines() {
        let text = "name: x\nrules:\n  truncate:\n    max_char: 3\n  loops:\n    min_repeats: many\n  nope: 1\n";
        let problems = check_pack(text);
        let found: Vec<(Option<u64>, &str)> = problems.iter().map(|p| (p.line, p.path.as_str())).collect();
        assert_eq!(
            found,
            vec![(Some(4), "rules.truncate.max_char"), (Some(6), "rules.loops.min_repeats"), (Some(7), "rules.nope")]
        );
    }

    #[test]
    fn overrides_are_checked_with_config_paths() {
        let text = BUILTIN_PACKS[0].1;
        assert!(check_overrides(text, &serde_json::json!({"truncate": {"max_chars": 10}})).is_empty());
        let problems = check_overrides(text, &serde_json::json!({"truncate": {"max_char": 10}}));
        assert_eq!(problems[0].path, "compaction.rules.truncate.max_char");
        let problems = check_overrides(text, &serde_json::json!({"loops": {"min_repeats": 1}}));
        assert_eq!(problems[0].path, "compaction.rules.loops.min_repeats");
    }

    #[test]
    fn every_problem_of_the_overrides_is_listed() {
        let overrides = serde_json::json!({
            "truncate": {"max_char": 10},
            "loops": {"min_repeats": "many"},
            "duplicates": {"enabled": "yes"},
            "arguments": {"head_lines": 0},
        });
        let mut paths: Vec<String> =
            check_overrides(BUILTIN_PACKS[0].1, &overrides).into_iter().map(|p| p.path).collect();
        paths.sort();
        let expected = [
            "compaction.rules.arguments.head_lines",
            "compaction.rules.duplicates.enabled",
            "compaction.rules.loops.min_repeats",
            "compaction.rules.truncate.max_char",
        ];
        assert_eq!(paths, expected);
        let Err(PackError::Invalid { problems, .. }) = load_pack("default", BUILTIN_PACKS[0].1, Some(&overrides))
        else {
            panic!("a pack with bad overrides must not load")
        };
        let mut paths: Vec<String> = problems.into_iter().map(|p| p.path).collect();
        paths.sort();
        assert_eq!(paths, expected, "the engine refuses with the same list `pare check` gives");
    }

    /// A device named as a pack is refused at once: `/dev/zero` would otherwise be read without end.
    #[cfg(unix)]
    #[test]
    fn a_pack_that_is_not_a_regular_file_is_refused() {
        for path in ["/dev/zero", "/tmp"] {
            let err = pack_text(path).unwrap_err().to_string();
            assert!(err.contains(path) && err.contains("not a regular file"), "{err}");
        }
    }

    #[test]
    fn yaml_syntax_error_has_a_line() {
        let problems = check_pack("name: x\nrules:\n  truncate: [\n");
        assert_eq!(problems.len(), 1);
        assert!(problems[0].line.is_some(), "{problems:?}");
    }
}
