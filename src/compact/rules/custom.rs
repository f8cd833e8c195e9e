//! User-defined rules from the pack's `custom:` list, run first and in the order written: the first
//! rule that matches a message decides (keep, truncate, marker or clear). User messages are never
//! matched.

use regex::Regex;

use super::super::Policy;
use super::super::conversation::{Conversation, is_system};
use super::super::edits::Edits;
use super::super::markers::{CallFacts, NAMES_PER_MARKER, mentioned_files, names_suffix, render, salient_names};
use super::super::pack::{CustomAction, CustomRule};
use super::super::report::RuleId;
use super::truncate::truncate_lines;

/// A user rule with its regexes compiled.
#[derive(Debug)]
pub struct CompiledCustom {
    pub rule: CustomRule,
    tool: Option<Regex>,
    arguments: Option<Regex>,
    content: Option<Regex>,
}

impl CompiledCustom {
    /// Regexes were validated with the pack; a rule whose regex fails here is skipped (never matches).
    pub fn compile(rule: &CustomRule) -> Option<CompiledCustom> {
        let compile = |p: &Option<String>| -> Result<Option<Regex>, regex::Error> {
            p.as_deref().map(|p| Regex::new(&format!("^(?:{p})$"))).transpose()
        };
        let search =
            |p: &Option<String>| -> Result<Option<Regex>, regex::Error> { p.as_deref().map(Regex::new).transpose() };
        Some(CompiledCustom {
            rule: rule.clone(),
            tool: compile(&rule.matches.tool).ok()?,
            arguments: search(&rule.matches.arguments).ok()?,
            content: search(&rule.matches.content).ok()?,
        })
    }

    fn matches(&self, conv: &Conversation<'_>, edits: &Edits, idx: usize) -> bool {
        let Some(m) = &conv.msgs[idx] else {
            return false;
        };
        let role = m.role.as_str();
        let role_ok = match self.rule.matches.role.as_deref() {
            Some("system") => is_system(role),
            Some(want) => role == want,
            None => role == "tool" || role == "assistant" || is_system(role),
        };
        if !role_ok {
            return false;
        }
        // The calls this message is about: its own (assistant) or the one it answers (tool).
        let calls: Vec<&super::super::conversation::Call> = match role {
            "tool" => conv.call_of_result[idx].map(|c| &conv.calls[c]).into_iter().collect(),
            "assistant" => conv.calls_of_message(idx).iter().collect(),
            _ => Vec::new(),
        };
        if let Some(re) = &self.tool
            && !calls.iter().any(|c| re.is_match(&c.name))
        {
            return false;
        }
        if let Some(re) = &self.arguments
            && !calls.iter().any(|c| re.is_match(&c.arguments))
        {
            return false;
        }
        if let Some(status) = self.rule.matches.status.as_deref()
            && status != "any"
        {
            let Some(outcome) = &conv.outcomes[idx] else {
                return false;
            };
            if (status == "ok") != outcome.status.is_ok() {
                return false;
            }
        }
        let text = edits.current_text(conv, idx);
        let chars = text.chars().count();
        if self.rule.matches.min_chars.is_some_and(|min| chars < min)
            || self.rule.matches.max_chars.is_some_and(|max| chars > max)
        {
            return false;
        }
        if let Some(re) = &self.content
            && !re.is_match(&text)
        {
            return false;
        }
        true
    }
}

pub fn apply(policy: &Policy, conv: &Conversation<'_>, edits: &mut Edits) {
    if policy.custom.is_empty() {
        return;
    }
    for idx in 0..conv.boundary {
        if !edits.open(idx) || conv.msgs[idx].as_ref().is_none_or(|m| m.role == "user") {
            continue;
        }
        let Some(rule) = policy.custom.iter().find(|r| r.matches(conv, edits, idx)) else {
            continue;
        };
        match rule.rule.action {
            CustomAction::Keep => edits.kept[idx] = true,
            CustomAction::Truncate => {
                let text = edits.current_text(conv, idx);
                let template = conv.fill_retrieve(idx, &policy.spec.truncate.template);
                if let Some(short) = truncate_lines(&text, rule.rule.head, rule.rule.tail, &template) {
                    edits.set_text(conv, idx, RuleId::Custom, short, true);
                }
            }
            CustomAction::Marker => {
                let template = rule.rule.template.as_deref().unwrap_or("[pare: {call}]");
                let marker = if conv.outcomes[idx].is_some() {
                    conv.render_marker(idx, template)
                } else {
                    let text = edits.current_text(conv, idx);
                    let facts = CallFacts {
                        tool: conv.msgs[idx].as_ref().map(|m| m.role.clone()).unwrap_or_default(),
                        status: "ok".into(),
                        chars: text.chars().count(),
                        lines: text.lines().count(),
                        files: mentioned_files(&text, 5),
                        ..Default::default()
                    };
                    render(template, &|name| match name {
                        "names" => Some(names_suffix(&salient_names(&text, NAMES_PER_MARKER, &[], conv.shown()))),
                        "retrieve" => Some(conv.retrieve(idx)),
                        other => facts.value(other),
                    })
                };
                edits.set_marker(conv, idx, RuleId::Custom, marker);
            }
            CustomAction::Clear => edits.set_marker(conv, idx, RuleId::Custom, String::new()),
        }
    }
}
