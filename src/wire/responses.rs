//! The OpenAI Responses API (`POST …/responses`) as a wire adapter.
//!
//! A request is `instructions` (the system prompt) and `input`: a string (one user message) or a
//! list of items. The adapter reads the items into neutral messages:
//!
//! | items | neutral message |
//! |---|---|
//! | `instructions` | the first `system` message (never touched: written back as its bytes) |
//! | `message` (user, system, developer, assistant), or an item with a `role` and no `type` | that role, `content` as sent (a string or parts with `text`) |
//! | an assistant `message` followed by `function_call` / `custom_tool_call` / `local_shell_call` items | one assistant message with `tool_calls` (`id` = `call_id`) |
//! | `function_call_output` / `custom_tool_call_output` / `local_shell_call_output` | a `tool` message paired by `call_id` |
//! | `reasoning` | none of its own: it belongs to the item it precedes and goes wherever that goes |
//! | `compaction` (`compaction_summary`, `context_compaction`) | an opaque message, the request's hard epoch boundary (`WireBody::epoch_boundary`): it and everything before it are forwarded as they are (the server reads it in place of them) |
//! | `item_reference`, every other type | an opaque entry (the items as sent) the engine keeps in place |
//!
//! Writing back maps each forwarded neutral message to items by its source (the engine's plan:
//! which of the request's neutral messages it stands for): one the engine left alone is its items'
//! original bytes; a rewritten tool result is its
//! output item with `output` replaced; a rewritten call turn is its items with each call's
//! `arguments` (or custom `input`) replaced and every reasoning item kept byte for byte; a rewritten
//! message (a condensed developer message) is its item with `content` replaced, its reasoning kept;
//! a message that stands for none (an elision marker) is a new `message` item. A dropped or elided turn takes its reasoning items with it. The
//! result is checked ([`check_items`]): the neutral view of the written items passes the pairing
//! check every format shares ([`crate::compact::validate`]: every call answered by its outputs right
//! after it, no output without its call), and every reasoning item is followed by the item it
//! precedes ([`Structure`]); otherwise the original body is forwarded.
//!
//! A request with a `compaction_trigger` item asks the server to summarize the history it carries:
//! pare forwards it as sent ([`WireBody::server_compaction`]).
//!
//! `previous_response_id` needs nothing special: the server holds the earlier turns, the request
//! carries only the new items, and those are what pare compacts.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::Value;
use serde_json::value::RawValue;

use super::{Forward, Invalid, Origin, Spans, Split, Wire, WireBody, WireError, json_string, replace_member};
use crate::compact::validate::Skeleton;
use crate::neutral::scan::Resume;
use crate::neutral::{Arguments, Content, Draft, DraftCall, Message, Typing, push_json_string};

/// The `type` of the input item with which a client (Codex) asks the server to compact the
/// history it sends: such a request is forwarded as sent ([`WireBody::server_compaction`]).
pub const COMPACTION_TRIGGER: &str = "compaction_trigger";

/// The `type`s of the items in which the server hands back a compacted history (`compaction`, what
/// `/responses/compact` and server-side compaction return; `compaction_summary` and
/// `context_compaction`, the names Codex also sends): the server reads such an item in place of
/// everything before it, so each is a hard epoch boundary ([`WireBody::epoch_boundary`]).
pub const COMPACTION_ITEMS: [&str; 3] = ["compaction", "compaction_summary", "context_compaction"];

/// What one input item is to the adapter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Message,
    Call,
    Output,
    Reasoning,
    Opaque,
}

/// The keys of an item the adapter reads; everything else stays in the item's bytes.
#[derive(Debug, Deserialize, Default)]
struct Head<'a> {
    #[serde(rename = "type", borrow, default)]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    role: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    call_id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    arguments: Option<&'a RawValue>,
    #[serde(borrow, default)]
    input: Option<&'a RawValue>,
    #[serde(borrow, default)]
    action: Option<&'a RawValue>,
    #[serde(borrow, default)]
    output: Option<&'a RawValue>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
}

/// One input item, read.
#[derive(Debug, Clone)]
struct Item<'a> {
    kind: Kind,
    /// `type` as sent (`function_call`, `custom_tool_call`…).
    type_name: String,
    role: String,
    /// The id pairing a call with its output.
    call_id: String,
    /// The value a rewrite of the item replaces, as sent: an output's `output`, a function call's
    /// `arguments`, a custom tool call's `input`, a message's `content`.
    rewritable: Option<&'a str>,
}

impl<'a> Item<'a> {
    fn read(raw: &'a str) -> (Item<'a>, Option<Head<'a>>) {
        let Ok(head) = serde_json::from_str::<Head<'_>>(raw) else {
            let item = Item {
                kind: Kind::Opaque,
                type_name: String::new(),
                role: String::new(),
                call_id: String::new(),
                rewritable: None,
            };
            return (item, None);
        };
        let type_name = head.kind.as_deref().unwrap_or("").to_owned();
        let kind = match type_name.as_str() {
            "message" => Kind::Message,
            "" if head.role.is_some() => Kind::Message,
            "function_call" | "custom_tool_call" | "local_shell_call" => Kind::Call,
            "function_call_output" | "custom_tool_call_output" | "local_shell_call_output" => Kind::Output,
            "reasoning" => Kind::Reasoning,
            _ => Kind::Opaque,
        };
        let role = head.role.as_deref().unwrap_or("").to_owned();
        let kind = match kind {
            Kind::Message if !matches!(role.as_str(), "user" | "system" | "developer" | "assistant") => Kind::Opaque,
            Kind::Call | Kind::Output if call_id_of(&head).is_none() => Kind::Opaque,
            other => other,
        };
        let call_id = call_id_of(&head).unwrap_or_default().to_owned();
        let rewritable = match (kind, type_name.as_str()) {
            (Kind::Output, _) => head.output,
            (Kind::Call, "function_call") => head.arguments,
            (Kind::Call, "custom_tool_call") => head.input,
            (Kind::Message, _) => head.content,
            _ => None,
        };
        (Item { kind, type_name, role, call_id, rewritable: rewritable.map(RawValue::get) }, Some(head))
    }
}

/// The id pairing a call with its output: `call_id` (a local shell output may carry only `id`).
fn call_id_of<'h>(head: &'h Head<'_>) -> Option<&'h str> {
    head.call_id
        .as_deref()
        .or_else(|| (head.kind.as_deref() == Some("local_shell_call_output")).then_some(head.id.as_deref()).flatten())
}

/// A Responses request body read into the neutral view.
#[derive(Debug)]
pub struct ResponsesBody<'a> {
    /// The body split around `input` (its elements are the raw items).
    split: Split<'a>,
    /// `input` is a string: one user message, forwarded as sent.
    input_is_text: bool,
    items: Vec<Item<'a>>,
    /// Each item's keys the adapter reads (`None`: not an object).
    heads: Vec<Option<Head<'a>>>,
    /// The neutral messages: the instructions first when the request has them, then the items'.
    neutral: Vec<String>,
    /// Instructions are neutral message 0.
    has_instructions: bool,
    /// For each neutral message after the instructions, the items `start..end` it stands for.
    ranges: Vec<(usize, usize)>,
    /// The last neutral message holding a compaction item.
    epoch_boundary: Option<usize>,
}

impl<'a> ResponsesBody<'a> {
    /// Parse a Responses request. Fails when the body is not a JSON object with an `input` list or
    /// string.
    pub fn parse(bytes: &'a [u8]) -> Result<ResponsesBody<'a>, WireError> {
        Self::parse_resumed(bytes, None)
    }

    /// [`ResponsesBody::parse`] whose scan starts again after `resume` ([`Split::parse_resumed`]).
    pub(crate) fn parse_resumed(bytes: &'a [u8], resume: Option<&Resume<'_>>) -> Result<ResponsesBody<'a>, WireError> {
        let (split, input_is_text) = match Split::parse_resumed(bytes, "input", resume) {
            Ok(split) => (split, false),
            Err(WireError::NoArray(_)) => (text_input(bytes)?, true),
            Err(err) => return Err(err),
        };
        let mut out = ResponsesBody {
            split,
            input_is_text,
            items: Vec::new(),
            heads: Vec::new(),
            neutral: Vec::new(),
            has_instructions: false,
            ranges: Vec::new(),
            epoch_boundary: None,
        };
        out.has_instructions = out.instructions().is_some();
        if input_is_text {
            out.neutral = (0..2).filter_map(|i| out.draft(i)).map(|draft| draft.write()).collect();
            return Ok(out);
        }
        out.heads.reserve(out.split.elements.len());
        for raw in &out.split.elements {
            let (item, head) = Item::read(raw);
            out.items.push(item);
            out.heads.push(head);
        }
        let mut start = 0;
        while start < out.items.len() {
            let end = turn_end(&out.items, start);
            if out.items[start..end].iter().any(|item| COMPACTION_ITEMS.contains(&item.type_name.as_str())) {
                out.epoch_boundary = Some(out.ranges.len() + out.first_item_message());
            }
            out.ranges.push((start, end));
            start = end;
        }
        let n = out.first_item_message() + out.ranges.len();
        let items = |i: usize| {
            let (start, end) = out.ranges[i - out.first_item_message()];
            &out.split.elements[start..end]
        };
        out.neutral = super::neutral_texts(n, |i| out.draft(i), items);
        Ok(out)
    }

    /// The instructions, when they are a string.
    fn instructions(&self) -> Option<&'a str> {
        self.split.field("instructions").map(RawValue::get).filter(|v| v.starts_with('"'))
    }

    /// Neutral message `i` as read from its items (`None`: an opaque entry, or no such message).
    fn draft(&self, i: usize) -> Option<Draft<'_>> {
        let i = match (self.has_instructions, i) {
            (true, 0) => return self.instructions().map(|text| Draft::text("system", text)),
            (true, i) => i - 1,
            (false, i) => i,
        };
        if self.input_is_text {
            return (i == 0).then(|| Draft::text("user", self.split.array_raw));
        }
        let &(start, end) = self.ranges.get(i)?;
        draft_of(&self.items[start..end], &self.heads[start..end])
    }

    /// The raw items of the request, in order.
    pub fn items(&self) -> &[&'a str] {
        &self.split.elements
    }

    /// The neutral messages as JSON values (an opaque entry: its items as sent, in an array), built
    /// from what the adapter read; an entry serde_json cannot read as a value is left out.
    pub fn neutral_values(&self) -> Vec<Value> {
        (0..self.neutral.len())
            .filter_map(|i| match self.draft(i) {
                Some(draft) => draft.value(),
                None => serde_json::from_str(&self.neutral[i]).ok(),
            })
            .collect()
    }

    /// Index of the first neutral message made of items (after the instructions, when present).
    fn first_item_message(&self) -> usize {
        usize::from(self.has_instructions)
    }
}

/// A body whose `input` is a string: the top level with an empty item list.
fn text_input(bytes: &[u8]) -> Result<Split<'_>, WireError> {
    let top = super::TopLevel::parse(bytes, "input")?;
    let (idx, raw) = top.array.filter(|(_, raw)| raw.get().starts_with('"')).ok_or(WireError::NoArray("input"))?;
    Ok(Split {
        array_key: "input",
        fields: top.fields.into_iter().collect(),
        array_idx: idx,
        array_raw: raw.get(),
        elements: Vec::new(),
        body: bytes,
    })
}

/// One past the last item of the neutral message starting at `start`: reasoning items join the item
/// they precede; an assistant message joins the calls right after it (reasoning between them
/// included); consecutive calls form one turn.
fn turn_end<'a, I: std::borrow::Borrow<Item<'a>>>(items: &[I], start: usize) -> usize {
    let item = |j: usize| items[j].borrow();
    let next_non_reasoning =
        |from: usize| (from..items.len()).find(|&j| item(j).kind != Kind::Reasoning).unwrap_or(items.len());
    let j = next_non_reasoning(start);
    if j == items.len() {
        return items.len();
    }
    let mut end = j + 1;
    let is_assistant_text = item(j).kind == Kind::Message && item(j).role == "assistant";
    if is_assistant_text || item(j).kind == Kind::Call {
        loop {
            let k = next_non_reasoning(end);
            if k < items.len() && item(k).kind == Kind::Call {
                end = k + 1;
            } else {
                break;
            }
        }
    }
    end
}

/// The neutral message of items forming one unit (see [`turn_end`]); `None` for an opaque entry.
fn draft_of<'d>(items: &'d [Item<'_>], heads: &'d [Option<Head<'_>>]) -> Option<Draft<'d>> {
    let main = items.iter().position(|i| i.kind != Kind::Reasoning)?;
    let head = heads[main].as_ref();
    match items[main].kind {
        Kind::Message | Kind::Call => {
            let role = if items[main].kind == Kind::Call { "assistant" } else { items[main].role.as_str() };
            let content = heads[main..]
                .iter()
                .zip(&items[main..])
                .find(|(_, i)| i.kind == Kind::Message)
                .and_then(|(h, _)| h.as_ref()?.content);
            let tool_calls = (main..items.len())
                .filter(|&k| items[k].kind == Kind::Call)
                .map(|k| {
                    let h = heads[k].as_ref().expect("a call item has a head");
                    let (name, arguments) = match items[k].type_name.as_str() {
                        "function_call" => {
                            (h.name.as_deref(), Arguments::Literal(h.arguments.map_or(r#""""#, RawValue::get)))
                        }
                        "custom_tool_call" => {
                            (h.name.as_deref(), Arguments::Literal(h.input.map_or(r#""""#, RawValue::get)))
                        }
                        "local_shell_call" => {
                            (Some("local_shell"), Arguments::Text(h.action.map_or("", RawValue::get)))
                        }
                        _ => (h.name.as_deref(), Arguments::Text(h.action.map_or("", RawValue::get))),
                    };
                    DraftCall { id: &items[k].call_id, name: name.unwrap_or(""), arguments }
                })
                .collect();
            Some(Draft {
                role,
                content: Cow::Borrowed(content.map_or("null", RawValue::get)),
                tool_calls,
                tool_call_id: None,
            })
        }
        Kind::Output => {
            Some(Draft::result(&items[main].call_id, head.and_then(|h| h.output).map_or("null", RawValue::get)))
        }
        Kind::Reasoning | Kind::Opaque => None,
    }
}

impl WireBody for ResponsesBody<'_> {
    fn wire(&self) -> Wire {
        Wire::Responses
    }
    fn messages(&self) -> Vec<&str> {
        self.neutral.iter().map(String::as_str).collect()
    }
    fn typed(&self, i: usize) -> Option<Typing> {
        Some(self.draft(i).map_or((None, None), |draft| draft.typing(self.neutral[i].len())))
    }
    fn top(&self) -> &Split<'_> {
        &self.split
    }
    fn output_limit(&self) -> Option<u64> {
        self.split.field("max_output_tokens").and_then(|v| serde_json::from_str::<u64>(v.get()).ok())
    }
    fn epoch_boundary(&self) -> Option<usize> {
        self.epoch_boundary
    }
    fn server_compaction(&self) -> Option<&'static str> {
        self.items.iter().any(|item| item.type_name == COMPACTION_TRIGGER).then_some(
            "the request asks the server to compact its history (a compaction_trigger item): forwarded as sent",
        )
    }
    fn write(&self, forwarded: &[Forward<'_>]) -> Result<(Vec<u8>, Spans), WireError> {
        if self.input_is_text {
            return Err(WireError::Unwritable("a string `input` is forwarded as sent".into()));
        }
        let items = self.items_for(forwarded)?;
        let read = super::reuse_reads(&items, &self.split.elements, &self.items, |raw| Item::read(raw).0);
        check_read(&read.iter().map(|(_, r)| r.as_ref()).collect::<Vec<_>>(), self.has_instructions)?;
        let unchanged = items.len() == self.split.elements.len()
            && items.iter().zip(&self.split.elements).all(|(item, raw)| std::ptr::eq(item.as_ref(), *raw));
        Ok(if unchanged { self.split.to_vec_and_spans_keeping_array() } else { self.split.to_vec_and_spans(&items) })
    }
    fn spans_in(&self, body: &[u8]) -> Option<Spans> {
        if self.input_is_text {
            return None;
        }
        self.split.spans_in(body)
    }
    fn check(&self) -> Result<(), Invalid> {
        if self.input_is_text {
            return check_conversation(&self.split.elements, self.has_instructions);
        }
        check_read(&self.items.iter().collect::<Vec<_>>(), self.has_instructions)
    }
}

impl ResponsesBody<'_> {
    /// The input items standing for the `forwarded` entries, each written from what it stands
    /// for: a message kept is its items' original bytes; a rewritten one is those items with its
    /// changes; a new one (a marker) is a new `message` item.
    fn items_for(&self, forwarded: &[Forward<'_>]) -> Result<Vec<Cow<'_, str>>, WireError> {
        let first = self.first_item_message();
        if self.has_instructions && !matches!(forwarded.first(), Some(Forward::Kept(0))) {
            return Err(WireError::Unwritable("the instructions were changed".into()));
        }
        let range = |idx: usize| {
            idx.checked_sub(first).and_then(|n| self.ranges.get(n).copied()).ok_or_else(|| {
                WireError::Unwritable(format!("a forwarded message stands for message {idx}, not one of the request's"))
            })
        };
        let raw = &self.split.elements;
        let mut out: Vec<Cow<'_, str>> = Vec::with_capacity(raw.len());
        for entry in forwarded.iter().skip(first) {
            match *entry {
                Forward::Kept(idx) => {
                    let (start, end) = range(idx)?;
                    out.extend(raw[start..end].iter().map(|r| Cow::Borrowed(*r)));
                }
                Forward::Rewritten(idx, written) => {
                    let (start, end) = range(idx)?;
                    let message = written.message()?;
                    for k in start..end {
                        out.push(self.rewrite_item(k, message)?);
                    }
                }
                Forward::New(written) => out.push(Cow::Owned(message_item(written.message()?)?)),
            }
        }
        Ok(out)
    }

    /// Item `k` with what the forwarded neutral `message` changed: a tool output's `output`, a call's
    /// arguments, an assistant message's content. Reasoning and opaque items are kept.
    fn rewrite_item(&self, k: usize, message: &Message) -> Result<Cow<'_, str>, WireError> {
        let raw = self.split.elements[k];
        let item = &self.items[k];
        let replace = |key: &str, value: String| -> Result<Cow<'_, str>, WireError> {
            replace_member(raw, key, item.rewritable, &value)
                .map(Cow::Owned)
                .ok_or_else(|| WireError::Unwritable(format!("item {k} cannot be rewritten")))
        };
        match item.kind {
            Kind::Output => replace("output", content_json(&message.content)),
            Kind::Call => {
                let call = message.tool_calls.iter().flatten().find(|c| c.id == item.call_id);
                let arguments = call.and_then(|c| c.function.as_ref()).map(|f| &f.arguments);
                match (item.type_name.as_str(), arguments) {
                    ("function_call", Some(Value::String(a))) => replace("arguments", json_string(a)),
                    ("custom_tool_call", Some(Value::String(a))) => replace("input", json_string(a)),
                    _ => Ok(Cow::Borrowed(raw)),
                }
            }
            Kind::Message if item.role != "user" => {
                let new = content_json(&message.content);
                if item.rewritable == Some(new.as_str()) { Ok(Cow::Borrowed(raw)) } else { replace("content", new) }
            }
            _ => Ok(Cow::Borrowed(raw)),
        }
    }
}

/// A neutral message the engine wrote (a marker) as a `message` item.
fn message_item(message: &Message) -> Result<String, WireError> {
    let role = match message.role.as_str() {
        role @ ("user" | "system" | "developer" | "assistant") => role,
        other => return Err(WireError::Unwritable(format!("a forwarded `{other}` message has no item to stand for"))),
    };
    let mut out = String::from(r#"{"type":"message","role":"#);
    push_json_string(&mut out, role);
    out.push_str(r#","content":"#);
    out.push_str(&content_json(&message.content));
    out.push('}');
    Ok(out)
}

/// A neutral `content` as JSON text (a string stays a string, parts stay parts).
fn content_json(content: &Option<Content>) -> String {
    match content {
        Some(Content::Text(text)) => json_string(text),
        Some(c) => serde_json::to_string(c).unwrap_or_else(|_| "null".into()),
        None => "null".into(),
    }
}

/// A rule of the Responses API over input items that the neutral form cannot express (the
/// pairing of calls and outputs is the neutral view's, [`crate::compact::validate`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Structure {
    /// A `reasoning` item belongs to the item it precedes: another non-reasoning item must follow
    /// it, and not an output.
    #[error("reasoning item {idx} is not followed by its item")]
    ReasoningWithoutItem { idx: usize },
}

/// The Responses API's rules over input `items` (a request without instructions): the pairing of
/// their neutral view ([`crate::compact::validate`]: every call answered by its outputs right after
/// it, no output without its open call, no call id empty or repeated while open), then every
/// `reasoning` item followed by the item it belongs to ([`Structure`]). Items that are not objects
/// pare reads are opaque messages.
pub fn check_items<S: AsRef<str>>(items: &[S]) -> Result<(), Invalid> {
    check_conversation(items, false)
}

/// [`check_items`] over the items of a request, whose neutral view opens with its instructions
/// when `instructions`.
fn check_conversation<S: AsRef<str>>(items: &[S], instructions: bool) -> Result<(), Invalid> {
    let read: Vec<Item> = items.iter().map(|raw| Item::read(raw.as_ref()).0).collect();
    check_read(&read.iter().collect::<Vec<_>>(), instructions)
}

/// [`check_conversation`] over items already read.
fn check_read(read: &[&Item], instructions: bool) -> Result<(), Invalid> {
    let (skeletons, origins) = neutral_skeletons(read, instructions);
    super::check_pairing(&skeletons, &origins)?;
    for (idx, item) in read.iter().enumerate() {
        if item.kind == Kind::Reasoning {
            let next = read[idx + 1..].iter().find(|i| i.kind != Kind::Reasoning);
            if next.is_none_or(|i| i.kind == Kind::Output) {
                return Err(Structure::ReasoningWithoutItem { idx }.into());
            }
        }
    }
    Ok(())
}

/// The skeleton of each neutral message `items` read into (as [`ResponsesBody::parse`] groups and
/// writes them, the instructions first when `instructions`), and the item it comes from (its first
/// item that is not reasoning).
fn neutral_skeletons(items: &[&Item], instructions: bool) -> (Vec<Option<Skeleton>>, Vec<Origin>) {
    let mut skeletons = Vec::with_capacity(items.len() + 1);
    let mut origins = Vec::with_capacity(items.len() + 1);
    if instructions {
        skeletons.push(super::skeleton("system", Vec::new(), None));
        origins.push(Origin::System);
    }
    let mut start = 0;
    while start < items.len() {
        let end = turn_end(items, start);
        let main = (start..end).find(|&k| items[k].kind != Kind::Reasoning);
        let skeleton = match main.map(|k| (k, items[k])) {
            Some((k, item)) if matches!(item.kind, Kind::Message | Kind::Call) => {
                let role = if item.kind == Kind::Call { "assistant" } else { item.role.as_str() };
                let calls = items[k..end].iter().filter(|i| i.kind == Kind::Call).map(|i| i.call_id.clone()).collect();
                super::skeleton(role, calls, None)
            }
            Some((_, item)) if item.kind == Kind::Output => super::skeleton("tool", Vec::new(), Some(&item.call_id)),
            _ => Some(Skeleton::opaque()),
        };
        skeletons.push(skeleton);
        origins.push(Origin::Item(main.unwrap_or(start)));
        start = end;
    }
    (skeletons, origins)
}

#[cfg(test)]
mod tests;
