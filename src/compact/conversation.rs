//! Conversation analysis: messages parsed once, the protected tail's boundary, tool-call groups
//! (an assistant message with `tool_calls` and all the tool messages answering it, kept, rewritten or
//! elided together), and one [`Call`] per tool call with its result's outcome.

use std::collections::HashMap;
use std::sync::{LazyLock, OnceLock};

use rayon::prelude::*;
use regex::Regex;
use rustc_hash::FxHashSet;
use serde_json::Value;

use super::in_play::InPlay;
use super::markers::{
    CallFacts, NAMES_PER_MARKER, content_id, mentioned_files, names_suffix, one_line, render, retrieve_suffix,
    salient_names, shorten, shown_names,
};
use super::outcome::{Outcome, Shape, Status, SuccessPolicy};
use super::outline::numbered_lines;
use crate::neutral::{Members, Message, View};

/// What kind of unit a group is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupKind {
    System,
    User,
    /// An assistant message without tool calls.
    Assistant,
    /// An assistant message with tool calls and its answers.
    ToolCalls,
    /// Anything pare does not understand; never touched.
    Other,
}

/// A run of messages `start..end` that rules and elision treat as one unit.
#[derive(Debug, Clone)]
pub struct Group {
    pub start: usize,
    pub end: usize,
    pub kind: GroupKind,
}

/// One tool call and its answer.
#[derive(Debug, Clone)]
pub struct Call {
    /// Index of the assistant message.
    pub msg: usize,
    pub id: String,
    pub name: String,
    /// The arguments as sent (a JSON-encoded string, usually).
    pub arguments: String,
    /// The key argument's value (path, command, pattern…), when there is one.
    pub key_arg: Option<String>,
    /// Index of the tool message answering it.
    pub result: Option<usize>,
}

/// A request's messages, analysed once.
pub struct Conversation<'a> {
    pub raw: &'a [&'a str],
    /// Parsed messages; `None` when a message is not an object pare understands (never touched).
    pub msgs: Vec<Option<Message>>,
    /// Each message's members as (key, raw value), when the fast read gave them: what a rewrite of
    /// the message keeps.
    pub members: Vec<Option<Members<'a>>>,
    /// First index of the protected tail.
    pub boundary: usize,
    /// One past the hard epoch boundary ([`super::CompactOptions::epoch_boundary`]) and the tool results answering
    /// it, 0 without one: messages before it are forwarded as they are.
    pub epoch_head: usize,
    /// Groups covering `0..boundary`, in order.
    pub groups: Vec<Group>,
    pub calls: Vec<Call>,
    /// For each message, the call it answers (tool messages).
    pub call_of_result: Vec<Option<usize>>,
    /// For each tool message, its outcome.
    pub outcomes: Vec<Option<Outcome>>,
    pub first_system: Option<usize>,
    /// Each tool result's [`CallFacts`], computed the first time a rule asks (several rules and the
    /// tiers may ask for the same message), from whichever thread asks first.
    facts: Vec<OnceLock<CallFacts>>,
    names: Vec<OnceLock<Vec<String>>>,
    /// The identifiers the forwarded request shows whole: user messages and the protected tail
    /// (see [`Conversation::shown`]).
    shown: OnceLock<FxHashSet<String>>,
    /// The identifiers the conversation works on now (see [`Conversation::in_play`]).
    in_play: OnceLock<InPlay>,
    /// Each tool result's text length in chars: facts, structural maps, savings and truncation all
    /// ask, and counting reads the whole text.
    text_chars: Vec<OnceLock<usize>>,
    /// Each message's content id ([`content_id`] of its text), computed the first time a marker asks.
    content_ids: Vec<OnceLock<String>>,
    /// Each tool result's `{restore}` fact ([`Conversation::restore`]), computed the first time a
    /// marker asks: the fit renders a run's marker again each time the run grows.
    restores: Vec<OnceLock<String>>,
    /// The name of pare's retrieve tool when the request offers it ([`super::markers::retrieve_tool`]):
    /// markers then say to call it.
    pub retrieve_tool: Option<String>,
    /// Large enough that per-message work is worth spreading over the rayon pool.
    parallel: bool,
}

/// From this many bytes of messages on, per-message work (parsing, reading results, structural maps,
/// markers) runs on all cores: a 128 KiB conversation takes about a millisecond on one, well above
/// the pool's cost of waking its threads (measured ≈ 25–35 µs per batch on the 2-vCPU test VM, and
/// a compaction makes about six batches). Smaller ones stay on the calling thread.
pub const PARALLEL_BYTES: usize = 128 * 1024;

/// What reading one message gives; computed per message, possibly on the rayon pool.
struct ReadMessage<'a> {
    msg: Option<Message>,
    members: Option<Members<'a>>,
    outcome: Option<Outcome>,
    /// One per tool call of an assistant message, in order.
    calls: Vec<ReadCall>,
}

struct ReadCall {
    name: String,
    arguments: String,
    key_arg: Option<String>,
}

/// Freeing a large conversation's parsed messages and outcomes (about a megabyte of small
/// allocations for an 800 KB request) is spread over the pool too, so the calling thread does not
/// spend the time.
impl Drop for Conversation<'_> {
    fn drop(&mut self) {
        if self.parallel {
            let msgs = std::mem::take(&mut self.msgs);
            let outcomes = std::mem::take(&mut self.outcomes);
            rayon::join(|| msgs.into_par_iter().for_each(drop), || outcomes.into_par_iter().for_each(drop));
        }
    }
}

impl<'a> Conversation<'a> {
    /// Parse and group the messages. With `may_parallelize`, a conversation of [`PARALLEL_BYTES`] or
    /// more does its per-message work on the rayon pool (here and in [`Conversation::map_each`]).
    pub fn analyse(
        view: &View<'a>,
        protect_last_turns: u32,
        key_arguments: &[String],
        success: &SuccessPolicy,
        may_parallelize: bool,
    ) -> Conversation<'a> {
        let raw = view.messages;
        let parallel = may_parallelize && raw.iter().map(|m| m.len()).sum::<usize>() >= PARALLEL_BYTES;
        // Type each message, read each tool result's outcome and each call's key argument:
        // independent per message.
        let read = |i: usize| {
            let (msg, members) = view.read(i);
            let outcome = msg.as_ref().filter(|m| m.role == "tool").map(|m| success.read_owned(m.text()));
            let calls = msg
                .iter()
                .filter(|m| m.role == "assistant")
                .flat_map(|m| m.tool_calls.iter().flatten())
                .map(|tc| {
                    let (name, arguments) = match &tc.function {
                        Some(f) => (f.name.clone(), arguments_text(&f.arguments)),
                        None => (String::new(), String::new()),
                    };
                    let key_arg = key_argument(&arguments, key_arguments);
                    ReadCall { name, arguments, key_arg }
                })
                .collect();
            ReadMessage { msg, members, outcome, calls }
        };
        let read: Vec<ReadMessage> = if parallel {
            (0..raw.len()).into_par_iter().map(read).collect()
        } else {
            (0..raw.len()).map(read).collect()
        };
        let mut msgs = Vec::with_capacity(read.len());
        let mut members = Vec::with_capacity(read.len());
        let mut outcomes = Vec::with_capacity(read.len());
        let mut calls_of = Vec::with_capacity(read.len());
        for r in read {
            msgs.push(r.msg);
            members.push(r.members);
            outcomes.push(r.outcome);
            calls_of.push(r.calls);
        }
        let boundary = boundary(&msgs, protect_last_turns);
        let first_system = msgs.iter().position(|m| m.as_ref().is_some_and(|m| is_system(&m.role)));

        let mut calls = Vec::new();
        let mut by_id: HashMap<&str, usize> = HashMap::new();
        let mut call_of_result = vec![None; msgs.len()];
        for (idx, m) in msgs.iter().enumerate() {
            let Some(m) = m else { continue };
            if m.role == "assistant" {
                by_id.clear();
                let read_calls = std::mem::take(&mut calls_of[idx]);
                for (tc, ReadCall { name, arguments, key_arg }) in m.tool_calls.iter().flatten().zip(read_calls) {
                    by_id.insert(tc.id.as_str(), calls.len());
                    calls.push(Call { msg: idx, id: tc.id.clone(), name, arguments, key_arg, result: None });
                }
            } else if m.role == "tool" {
                if let Some(&c) = m.tool_call_id.as_deref().and_then(|id| by_id.get(id)) {
                    calls[c].result = Some(idx);
                    call_of_result[idx] = Some(c);
                }
            }
        }

        for (idx, call) in call_of_result.iter().enumerate() {
            if let (Some(c), Some(outcome)) = (call, outcomes[idx].as_mut()) {
                read_is_not_a_failure(&calls[*c].arguments, outcome);
            }
        }

        let mut groups = Vec::new();
        let mut idx = 0;
        while idx < boundary {
            let kind = match &msgs[idx] {
                None => GroupKind::Other,
                Some(m) if is_system(&m.role) => GroupKind::System,
                Some(m) if m.role == "user" => GroupKind::User,
                Some(m) if m.role == "assistant" && m.tool_calls.as_ref().is_some_and(|t| !t.is_empty()) => {
                    GroupKind::ToolCalls
                }
                Some(m) if m.role == "assistant" => GroupKind::Assistant,
                Some(_) => GroupKind::Other,
            };
            let mut end = idx + 1;
            if kind == GroupKind::ToolCalls {
                while end < boundary && msgs[end].as_ref().is_some_and(|m| m.role == "tool") {
                    end += 1;
                }
            }
            groups.push(Group { start: idx, end, kind });
            idx = end;
        }
        let facts = (0..msgs.len()).map(|_| OnceLock::new()).collect();
        let names = (0..msgs.len()).map(|_| OnceLock::new()).collect();
        let text_chars = (0..msgs.len()).map(|_| OnceLock::new()).collect();
        let content_ids = (0..msgs.len()).map(|_| OnceLock::new()).collect();
        let restores = (0..msgs.len()).map(|_| OnceLock::new()).collect();
        Conversation {
            raw,
            msgs,
            members,
            boundary,
            epoch_head: 0,
            groups,
            calls,
            call_of_result,
            outcomes,
            first_system,
            facts,
            names,
            shown: OnceLock::new(),
            in_play: OnceLock::new(),
            text_chars,
            content_ids,
            restores,
            retrieve_tool: None,
            parallel,
        }
    }

    /// `f` over `items` (message indices, or per-message work items), results in order: on the rayon
    /// pool for a large conversation, else on this thread. `f` must be a pure function of its item
    /// and the conversation (the facts it computes are memoized).
    pub fn map_each<I: Sync, T: Send>(&self, items: &[I], f: impl Fn(&I) -> T + Sync + Send) -> Vec<T> {
        if self.parallel { items.par_iter().map(f).collect() } else { items.iter().map(f).collect() }
    }

    /// The facts about a tool result at message `idx` (a tool message), computed once.
    pub fn facts(&self, idx: usize) -> &CallFacts {
        self.facts[idx].get_or_init(|| self.compute_facts(idx))
    }

    /// The identifiers of tool result `idx` a marker lists (`{names}`), computed once, and only for
    /// results whose marker asks for them: the scan reads the result's text.
    pub fn names(&self, idx: usize) -> &[String] {
        self.names[idx].get_or_init(|| {
            let facts = self.facts(idx);
            let text = self.outcomes[idx].as_ref().map(|o| o.text.as_str()).unwrap_or("");
            let mut known: Vec<&str> = facts.files.iter().map(String::as_str).collect();
            known.push(&facts.arg);
            salient_names(text, NAMES_PER_MARKER, &known, self.shown())
        })
    }

    /// The identifiers of the messages no rule or tier ever changes, which the forwarded request
    /// therefore shows whole: user messages and the protected tail (its texts, its results' texts
    /// and the strings of its calls' arguments). A marker's `{names}` skips them: listing a name
    /// the model sees anyway costs tokens and keeps nothing. Computed once, on first use.
    pub fn shown(&self) -> &FxHashSet<String> {
        self.shown.get_or_init(|| {
            // Results are read in place; other texts and the calls' argument strings are decoded.
            let mut results: Vec<&str> = Vec::new();
            let mut texts: Vec<String> = Vec::new();
            for (idx, m) in self.msgs.iter().enumerate() {
                let Some(m) = m else { continue };
                if idx < self.boundary && m.role != "user" {
                    continue;
                }
                match &self.outcomes[idx] {
                    Some(o) => results.push(&o.text),
                    None => texts.push(m.text()),
                }
            }
            for call in self.calls.iter().filter(|c| c.msg >= self.boundary) {
                match serde_json::from_str::<Value>(&call.arguments) {
                    Ok(v) => push_strings(&v, &mut texts),
                    Err(_) => texts.push(call.arguments.clone()),
                }
            }
            shown_names(results.into_iter().chain(texts.iter().map(String::as_str)))
        })
    }

    /// What is in play: the task, the last `recent_turns` assistant turns before the boundary and
    /// the protected tail (texts, calls' arguments, the tail's results), computed once, on first
    /// use: every caller passes the policy's count.
    pub fn in_play(&self, recent_turns: usize) -> &InPlay {
        self.in_play.get_or_init(|| {
            let mut texts: Vec<String> = Vec::new();
            if let Some(task) = self.msgs.iter().flatten().find(|m| m.role == "user") {
                texts.push(task.text());
            }
            let assistants: Vec<usize> =
                (0..self.boundary).filter(|&i| self.msgs[i].as_ref().is_some_and(|m| m.role == "assistant")).collect();
            let from = assistants.len().saturating_sub(recent_turns);
            let first = assistants.get(from).copied().unwrap_or(self.boundary);
            for (idx, m) in self.msgs.iter().enumerate().skip(first) {
                let Some(m) = m else { continue };
                // Results before the tail are what relevance chooses from, not what chooses.
                if idx < self.boundary && m.role != "assistant" {
                    continue;
                }
                match &self.outcomes[idx] {
                    Some(o) => texts.push(o.text.clone()),
                    None => texts.push(m.text()),
                }
            }
            for call in self.calls.iter().filter(|c| c.msg >= first) {
                match serde_json::from_str::<Value>(&call.arguments) {
                    Ok(v) => push_strings(&v, &mut texts),
                    Err(_) => texts.push(call.arguments.clone()),
                }
            }
            InPlay::of_texts(texts.iter().map(String::as_str))
        })
    }

    /// The length in chars of tool result `idx`'s text (0 for a message that is not one), counted once.
    pub fn text_chars(&self, idx: usize) -> usize {
        *self.text_chars[idx].get_or_init(|| self.outcomes[idx].as_ref().map_or(0, |o| o.text.chars().count()))
    }

    /// The value of a call-marker placeholder for tool result `idx`.
    pub fn fact(&self, idx: usize, name: &str) -> Option<String> {
        match name {
            "names" => Some(names_suffix(self.names(idx))),
            "restore" => Some(
                self.restores[idx]
                    .get_or_init(|| self.restore(idx).map(|r| format!("; restore: {r}")).unwrap_or_default())
                    .clone(),
            ),
            "retrieve" => Some(self.retrieve(idx)),
            other => self.facts(idx).value(other),
        }
    }

    /// The content id of message `idx`'s text (a tool's output as the agent sent it, a system
    /// prompt, an assistant note), computed once.
    pub fn content_id(&self, idx: usize) -> &str {
        self.content_ids[idx].get_or_init(|| content_id(&self.msgs[idx].as_ref().map(|m| m.text()).unwrap_or_default()))
    }

    /// What a marker standing for message `idx`'s text says to get it back (`{retrieve}`).
    pub fn retrieve(&self, idx: usize) -> String {
        retrieve_suffix(self.content_id(idx), self.retrieve_tool.as_deref())
    }

    /// `template` with its `{retrieve}` filled for message `idx` and every other placeholder left as
    /// written (for the truncation markers, whose `{n}` their cut fills).
    pub fn fill_retrieve(&self, idx: usize, template: &str) -> String {
        render(template, &|name| (name == "retrieve").then(|| self.retrieve(idx)))
    }

    /// The one call that shows tool result `idx` again, when it is a view of a file: the file's
    /// lines it showed, by [`restore_call`].
    pub fn restore(&self, idx: usize) -> Option<String> {
        let call = self.call_of_result[idx].map(|c| &self.calls[c])?;
        let (path, first_line) = read_path(&call.arguments)?;
        if path_argument(&call.arguments).is_some()
            && !VIEW_TOOL.is_match(&call.name)
            && !is_view_command(&call.arguments)
        {
            return None;
        }
        let lines = numbered_lines(&self.outcomes[idx].as_ref()?.text, first_line);
        let (from, to) = (lines.first()?.0, lines.last()?.0);
        Some(restore_call(&call.name, &call.arguments, &path, from, to))
    }

    /// A call-marker template filled for tool result `idx`.
    pub fn render_marker(&self, idx: usize, template: &str) -> String {
        render(template, &|name| self.fact(idx, name))
    }

    fn compute_facts(&self, idx: usize) -> CallFacts {
        let call = self.call_of_result[idx].map(|c| &self.calls[c]);
        let outcome = self.outcomes[idx].as_ref();
        let text = outcome.map(|o| o.text.as_str()).unwrap_or("");
        let mut files: Vec<String> = Vec::new();
        if let Some(path) = call.and_then(|c| path_argument(&c.arguments)) {
            files.push(path);
        }
        for f in mentioned_files(text, 8) {
            if files.len() >= 5 {
                break;
            }
            if !files.iter().any(|g| g.ends_with(&f) || f.ends_with(g.as_str())) {
                files.push(f);
            }
        }
        let tool = call
            .map(|c| c.name.clone())
            .or_else(|| self.msgs[idx].as_ref().and_then(|m| m.name.clone()))
            .unwrap_or_else(|| "tool".into());
        let arg = call.and_then(|c| c.key_arg.as_deref()).map(quote_arg).unwrap_or_default();
        CallFacts {
            tool,
            arg,
            id: call.map(|c| c.id.clone()).unwrap_or_default(),
            status: outcome.map(|o| o.status.label()).unwrap_or_else(|| "ok".into()),
            chars: self.text_chars(idx),
            lines: line_count(text),
            first_error: outcome.and_then(|o| o.first_error.clone()),
            files,
            siblings: call.map_or(0, |c| self.calls_of_message(c.msg).len()),
        }
    }

    /// The calls assistant message `msg` made. `calls` is in message order: two binary searches,
    /// not a scan of every call for every marker (a long session has thousands).
    pub fn calls_of_message(&self, msg: usize) -> &[Call] {
        let start = self.calls.partition_point(|c| c.msg < msg);
        let end = self.calls.partition_point(|c| c.msg <= msg);
        &self.calls[start..end]
    }

    /// Number of assistant messages at or after `idx` (a turn count used as age).
    pub fn turns_from(&self, idx: usize) -> usize {
        self.msgs[idx..].iter().filter(|m| m.as_ref().is_some_and(|m| m.role == "assistant")).count()
    }
}

/// `text.lines().count()`, by counting newlines (`memchr`'s vectorised count, not a line iterator:
/// a filtered byte count does not vectorise as well).
pub fn line_count(text: &str) -> usize {
    let newlines = memchr::memchr_iter(b'\n', text.as_bytes()).count();
    newlines + usize::from(!text.is_empty() && !text.ends_with('\n'))
}

/// `system`, or `developer` (OpenAI's newer name for it).
pub fn is_system(role: &str) -> bool {
    role == "system" || role == "developer"
}

/// The tail starts at the N-th last assistant message; with fewer than N, everything is protected.
fn boundary(msgs: &[Option<Message>], protect_last_turns: u32) -> usize {
    if protect_last_turns == 0 {
        return msgs.len();
    }
    let mut seen = 0;
    for (idx, m) in msgs.iter().enumerate().rev() {
        if m.as_ref().is_some_and(|m| m.role == "assistant") {
            seen += 1;
            if seen == protect_last_turns {
                return idx;
            }
        }
    }
    0
}

impl Conversation<'_> {
    /// One past the epoch boundary at `boundary` (a message index); a boundary that is a call turn
    /// takes the tool messages answering it along, so that no tool-call group is split. 0 without one.
    pub fn epoch_head_after(&self, boundary: Option<usize>) -> usize {
        let Some(last) = boundary.filter(|&b| b < self.msgs.len()) else {
            return 0;
        };
        let msgs = &self.msgs;
        let mut end = last + 1;
        if msgs[last].as_ref().is_some_and(|m| m.tool_calls.as_ref().is_some_and(|calls| !calls.is_empty())) {
            while end < msgs.len() && msgs[end].as_ref().is_some_and(|m| m.role == "tool") {
                end += 1;
            }
        }
        end
    }
}

/// Every string inside a JSON value (a call's arguments), in order.
fn push_strings(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::String(s) => out.push(s.clone()),
        Value::Array(items) => items.iter().for_each(|v| push_strings(v, out)),
        Value::Object(map) => map.values().for_each(|v| push_strings(v, out)),
        _ => {}
    }
}

/// The arguments as text: the JSON-encoded string, or the JSON of an object some clients send.
fn arguments_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// The first configured key argument present as a non-empty string (or the first string argument).
fn key_argument(arguments: &str, keys: &[String]) -> Option<String> {
    let Ok(Value::Object(map)) = serde_json::from_str::<Value>(arguments) else {
        return (!arguments.trim().is_empty()).then(|| one_line(arguments, 80));
    };
    let pick = keys
        .iter()
        .find_map(|k| map.get(k).and_then(Value::as_str).filter(|s| !s.trim().is_empty()))
        .or_else(|| map.values().find_map(|v| v.as_str().filter(|s| !s.trim().is_empty())))?;
    let first = pick.trim().lines().next().unwrap_or("");
    let more = pick.trim().lines().nth(1).is_some();
    let mut out = shorten(first.trim(), 80);
    if more && !out.ends_with('…') {
        out.push('…');
    }
    Some(out)
}

/// A `path`-like argument, used as a file the call touched.
pub fn path_argument(arguments: &str) -> Option<String> {
    let Ok(Value::Object(map)) = serde_json::from_str::<Value>(arguments) else {
        return None;
    };
    ["path", "file_path", "filepath", "file", "filename", "file_name"]
        .iter()
        .find_map(|k| map.get(*k).and_then(Value::as_str))
        .filter(|s| !s.is_empty() && !s.contains('\n') && s.len() < 300)
        .map(str::to_owned)
}

static READ_COMMAND: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r#"^\s*(?:cd\s+\S+\s*&&\s*)?(?:cat(?:\s+-n)?|nl(?:\s+-\w+)*|head(?:\s+-n?\s*\d+)?|sed\s+-n\s+['"]?\d+,\d+p['"]?)\s+['"]?([^\s'"|;&>]+)['"]?\s*$"#)
        .expect("static regex")
});

static SED_RANGE: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r#"sed\s+-n\s+['"]?(\d+),\d+p"#).expect("static regex"));

/// Fewest numbered lines that make a read's output a listing of the file (see
/// [`read_is_not_a_failure`]).
const LISTING_MIN_LINES: usize = 20;

/// A read of a file whose output is the file's numbered listing (`cat -n`, an editor's `view`)
/// succeeded, whatever error text the file itself holds (`raise ValueError("Error: …")`, a test's
/// `FAILED` string): the error patterns read such a listing as a failure when no exit status says
/// otherwise, and a failure is kept as it is (truncated to its first and last lines) instead of
/// getting its structural map. An error shape (a JSON `error`) or an exit status still decides.
fn read_is_not_a_failure(arguments: &str, outcome: &mut Outcome) {
    if outcome.status != (Status::Failed { exit: None })
        || matches!(outcome.shape, Shape::JsonField { error: Some(_), .. })
    {
        return;
    }
    // An editor call with a path and another command writes (`create`, `str_replace`): not a read.
    let writes = path_argument(arguments).is_some()
        && serde_json::from_str::<Value>(arguments)
            .ok()
            .and_then(|v| v.get("command").and_then(Value::as_str).map(|c| c != "view"))
            .unwrap_or(false);
    if writes || read_path(arguments).is_none() {
        return;
    }
    let mut lines = 0;
    let mut numbered = 0;
    for line in outcome.text.lines() {
        lines += 1;
        numbered += usize::from(super::outline::split_numbered(line).is_some());
    }
    if numbered >= LISTING_MIN_LINES && numbered * 10 >= lines * 9 {
        outcome.status = Status::Ok;
        outcome.first_error = None;
    }
}

/// The source file a call read, when it is one, and the line of the file its output starts at: a
/// `sed -n 'A,Bp'` view without line numbers starts at A, so that the map's line ranges are the
/// file's and one `sed -n` of a range brings that definition back.
pub fn read_path(arguments: &str) -> Option<(String, usize)> {
    if let Some(path) = path_argument(arguments) {
        return Some((path, 1));
    }
    let v: Value = serde_json::from_str(arguments).ok()?;
    let command = v.get("command").or_else(|| v.get("cmd"))?.as_str()?;
    let path = READ_COMMAND.captures(command).map(|c| c[1].to_owned())?;
    let first_line = SED_RANGE.captures(command).and_then(|c| c[1].parse().ok()).unwrap_or(1usize).max(1);
    Some((path, first_line))
}

/// A tool that reads a file given its path (`read_file`, `view`, `open`, `cat`): a search or a write
/// given a path does not show the file.
static VIEW_TOOL: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(?i)^(?:read|view|open|cat|show)(?:_?file)?$").expect("static regex"));

/// An editor tool's view subcommand (OpenHands' `str_replace_editor` with `"command": "view"`).
fn is_view_command(arguments: &str) -> bool {
    serde_json::from_str::<Value>(arguments).is_ok_and(|v| v.get("command").and_then(Value::as_str) == Some("view"))
}

/// The one call that shows lines `from`–`to` of `path` again with the agent's own tool: `sed -n` for
/// a shell command's view, the view tool with the path and range otherwise.
pub fn restore_call(tool: &str, arguments: &str, path: &str, from: usize, to: usize) -> String {
    if path_argument(arguments).is_some() {
        format!("{tool} {path} lines {from}-{to}")
    } else {
        format!("sed -n '{from},{to}p' {path}")
    }
}

/// The key argument as markers show it: a JSON string literal.
fn quote_arg(arg: &str) -> String {
    serde_json::to_string(arg).expect("a string always serializes")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::pack::SuccessSpec;

    /// `refs` analysed with the default key arguments and success policy, read from their texts.
    fn analysed<'a>(refs: &'a [&'a str], protect_last_turns: u32, parallel: bool) -> Conversation<'a> {
        let policy = SuccessPolicy::new(&SuccessSpec::default());
        let keys = crate::config::pack::RulesSpec::default().key_arguments;
        Conversation::analyse(&View::of_texts(refs, None), protect_last_turns, &keys, &policy, parallel)
    }

    /// The head kept for an epoch boundary ends after the boundary, and after the tool results
    /// answering it when it is a call turn.
    #[test]
    fn the_epoch_head_ends_after_the_boundary_and_its_results() {
        let head = |refs: &[&str], boundary| analysed(refs, 1, false).epoch_head_after(boundary);
        let call = r#"{"role":"assistant","content":null,"tool_calls":[{"id":"a","type":"function","function":{"name":"ls","arguments":"{}"}}]}"#;
        let opaque = r#"[{"type":"compaction","encrypted_content":"x"}]"#;
        let user = r#"{"role":"user","content":"u"}"#;
        let result = r#"{"role":"tool","tool_call_id":"a","content":"x"}"#;
        let done = r#"{"role":"assistant","content":"done"}"#;
        assert_eq!(head(&[user, result, done], None), 0);
        assert_eq!(head(&[user, opaque, done, user], Some(1)), 2);
        assert_eq!(head(&[user, opaque, call, result, done, user], Some(2)), 4);
        assert_eq!(head(&[user, done], Some(7)), 0, "a boundary past the messages is none");
    }

    /// Regression: an editor's view of a source file that holds error text (`raise ValueError("Error:
    /// …")`) read as a failed call, so the rules kept its first and last lines instead of its
    /// structural map, and it never counted as a read of the file. A numbered listing from a read
    /// succeeds; the editor's own error and an edit's snippet keep the status their text gives.
    #[test]
    fn a_listing_of_a_file_with_error_text_is_a_successful_read() {
        let listing: String = (1..=40)
            .map(|i| match i {
                7 => format!("{i:6}\t        raise ValueError(\"Error: bad input\")"),
                _ => format!("{i:6}\t    value_{i} = compute_{i}()"),
            })
            .collect::<Vec<_>>()
            .join("\n");
        let status = |arguments: serde_json::Value, output: &str| {
            let call = serde_json::json!({"role": "assistant", "content": null, "tool_calls": [{"id": "a", "type": "function",
                "function": {"name": "str_replace_editor", "arguments": arguments.to_string()}}]});
            let result = serde_json::json!({"role": "tool", "tool_call_id": "a", "content": output});
            let raw = [call.to_string(), result.to_string()];
            let refs: Vec<&str> = raw.iter().map(String::as_str).collect();
            let conv = analysed(&refs, 1, false);
            conv.outcomes[1].as_ref().unwrap().status.clone()
        };
        let view = serde_json::json!({"command": "view", "path": "/w/a.py"});
        let shown = format!("Here's the result of running `cat -n` on /w/a.py:\n{listing}");
        assert_eq!(status(view.clone(), &shown), Status::Ok);
        let missing = "ERROR: Invalid `path` parameter: /w/b.py. The path /w/b.py does not exist.";
        assert_eq!(status(view.clone(), missing), Status::Failed { exit: None });
        let edit = serde_json::json!({"command": "str_replace", "path": "/w/a.py", "old_str": "x", "new_str": "y"});
        assert_eq!(status(edit, &shown), Status::Failed { exit: None });
        // A few numbered lines under an error message are a traceback's excerpt, not a listing.
        let excerpt: String = listing.lines().take(5).collect::<Vec<_>>().join("\n");
        assert_eq!(status(view, &format!("Error: cannot parse\n{excerpt}")), Status::Failed { exit: None });
    }

    #[test]
    fn groups_and_boundary() {
        let refs = [
            r#"{"role":"system","content":"s"}"#,
            r#"{"role":"user","content":"u"}"#,
            r#"{"role":"assistant","content":"","tool_calls":[{"id":"a","type":"function","function":{"name":"read_file","arguments":"{\"path\":\"x.py\"}"}},{"id":"b","type":"function","function":{"name":"terminal","arguments":"{\"command\":\"ls\"}"}}]}"#,
            r#"{"role":"tool","tool_call_id":"a","content":"data"}"#,
            r#"{"role":"tool","tool_call_id":"b","content":"Traceback (most recent call last):\nKeyError: 'k'"}"#,
            r#"{"role":"assistant","content":"done"}"#,
            r#"{"role":"user","content":"more"}"#,
            r#"{"role":"assistant","content":"ok"}"#,
        ];
        let conv = analysed(&refs, 1, true);
        assert_eq!(conv.boundary, 7);
        let kinds: Vec<(usize, usize, GroupKind)> = conv.groups.iter().map(|g| (g.start, g.end, g.kind)).collect();
        assert_eq!(
            kinds,
            vec![
                (0, 1, GroupKind::System),
                (1, 2, GroupKind::User),
                (2, 5, GroupKind::ToolCalls),
                (5, 6, GroupKind::Assistant),
                (6, 7, GroupKind::User)
            ]
        );
        let f = conv.facts(4);
        assert_eq!(f.call(), "terminal(\"ls\")");
        assert_eq!(f.status, "error");
        assert_eq!(f.first_error.as_deref(), Some("KeyError: 'k'"));
        assert_eq!(conv.facts(3).files, vec!["x.py".to_string()]);
        assert_eq!(analysed(&refs, 3, true).boundary, 2);
        assert_eq!(analysed(&refs, 4, true).boundary, 0);
        assert_eq!(analysed(&refs, 0, true).boundary, 8);
    }

    #[test]
    fn names_skip_what_user_messages_and_the_tail_show() {
        let refs = [
            r#"{"role":"user","content":"fix parse_header in HAT170"}"#,
            r#"{"role":"assistant","content":"","tool_calls":[{"id":"a","type":"function","function":{"name":"terminal","arguments":"{\"command\":\"cat x.py\"}"}}]}"#,
            r#"{"role":"tool","tool_call_id":"a","content":"def parse_header(raw_bytes): return ZFA04Y + load_user(user_id)"}"#,
            r#"{"role":"assistant","content":"Now load_user.","tool_calls":[{"id":"b","type":"function","function":{"name":"terminal","arguments":"{\"command\":\"grep -n user_id app.py\"}"}}]}"#,
            r#"{"role":"tool","tool_call_id":"b","content":"12: ZFA04Y"}"#,
        ];
        let conv = analysed(&refs, 1, true);
        assert_eq!(conv.boundary, 3);
        // `parse_header` is in the user message, `load_user` in the tail's text, `user_id` in its
        // call's arguments and `ZFA04Y` in its result: only `raw_bytes` is left to list.
        assert_eq!(conv.names(2), ["raw_bytes".to_string()]);
        assert!(conv.render_marker(2, "[tool: {call}{names}]").ends_with("; names: raw_bytes]"));
        // With no protected tail only the user message is shown: the result lists the rest.
        let none = analysed(&refs, 0, true);
        assert_eq!(none.names(2), ["raw_bytes", "ZFA04Y", "load_user", "user_id"].map(String::from));
    }

    #[test]
    fn ref_names_the_call_only_when_its_message_made_several() {
        let refs = [
            r#"{"role":"user","content":"go"}"#,
            r#"{"role":"assistant","content":"","tool_calls":[{"id":"a","type":"function","function":{"name":"read_file","arguments":"{\"path\":\"a.py\"}"}},{"id":"b","type":"function","function":{"name":"read_file","arguments":"{\"path\":\"b.py\"}"}}]}"#,
            r#"{"role":"tool","tool_call_id":"a","content":"x = 1"}"#,
            r#"{"role":"tool","tool_call_id":"b","content":"y = 2"}"#,
            r#"{"role":"assistant","content":"","tool_calls":[{"id":"c","type":"function","function":{"name":"terminal","arguments":"{\"command\":\"ls\"}"}}]}"#,
            r#"{"role":"tool","tool_call_id":"c","content":"a.py b.py"}"#,
        ];
        let conv = analysed(&refs, 0, false);
        assert_eq!(conv.calls_of_message(1).iter().map(|c| c.id.as_str()).collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!(conv.calls_of_message(4).len(), 1);
        assert!(conv.calls_of_message(2).is_empty());
        assert_eq!(conv.render_marker(2, "{ref}"), r#"read_file("a.py")"#);
        assert_eq!(conv.render_marker(3, "{ref}"), r#"read_file("b.py")"#);
        assert_eq!(conv.render_marker(5, "{ref}"), "terminal");
    }

    #[test]
    fn line_count_counts_like_lines() {
        for text in ["", "a", "a\n", "\n", "a\nb", "a\r\nb\r\n", "\n\n", "a\n\nb\n\n", "é\n\r"] {
            assert_eq!(line_count(text), text.lines().count(), "{text:?}");
        }
    }

    #[test]
    fn key_argument_prefers_configured_names() {
        let keys = crate::config::pack::RulesSpec::default().key_arguments;
        assert_eq!(key_argument(r#"{"timeout":5,"command":"ls -la\nrm x"}"#, &keys).as_deref(), Some("ls -la…"));
        assert_eq!(key_argument(r#"{"user_id":"mia_li"}"#, &keys).as_deref(), Some("mia_li"));
        assert_eq!(key_argument("{}", &keys), None);
    }
}
