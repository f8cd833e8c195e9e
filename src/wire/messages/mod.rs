//! The Anthropic Messages API (`POST …/v1/messages`: Claude Code, the `anthropic` SDKs) as a wire
//! adapter.
//!
//! A request is `system` (a string or text blocks: the system prompt) and `messages`: turns that
//! alternate `user` and `assistant`, each with `content` as a string or a list of blocks. The
//! adapter reads the turns into neutral messages:
//!
//! | turn or block | neutral message |
//! |---|---|
//! | `system` | the first `system` message (never touched: written back as its bytes) |
//! | a user turn's `tool_result` blocks | one `tool` message each (`tool_call_id` = `tool_use_id`, `content` the result's) |
//! | a user turn's other blocks (`text`, `image`, `document`, …) or its string content | one `user` message: what the person wrote, never touched |
//! | an assistant turn | one `assistant` message: `text` blocks as content parts, `tool_use` blocks as `tool_calls` (`arguments` = the JSON text of `input`) |
//! | `thinking`, `redacted_thinking`, `server_tool_use`, `web_search_tool_result`, unknown blocks in an assistant turn | none of their own: they stay in their turn byte for byte, and go only with the whole turn |
//! | a turn of another role, or one pare cannot read | an opaque entry (the turn as sent) the engine keeps in place |
//! | a turn holding a `compaction` block with a summary (the context-management beta) | its message as above, the request's hard epoch boundary (`WireBody::epoch_boundary`): the turn and everything before it are forwarded as they are (the API reads the block in place of them) |
//!
//! `cache_control` marks are left out of the neutral form (Claude Code moves its last mark to the
//! newest turn on every request: the conversation it marks is the same) and written back where the
//! agent's request has them ([`cache`] decides where a mark of an elided block goes).
//!
//! Writing back maps each forwarded neutral message to its blocks: one the engine left alone is its
//! turn's original bytes; a rewritten tool result is its `tool_result` block with `content`
//! replaced (`is_error`, `cache_control` and every other key kept); a rewritten call turn is its
//! blocks with each `tool_use`'s `input` replaced (still an object with the same keys) and every
//! thinking and unknown block kept byte for byte; an elision marker becomes an assistant turn of
//! one text block (a user turn when the next turn opens with a thinking block, which the API would
//! otherwise find behind the marker's text once it joins the two turns). A turn whose neutral
//! messages are all gone is left out; a user turn keeps what the person wrote even when its results
//! go. The result is checked ([`check_turns`]): the neutral view of the written turns passes the
//! pairing check every format shares ([`crate::compact::validate`]: every `tool_use` answered, no
//! result without its call), and the API's own rules hold ([`Structure`]: results only in the user
//! turn right after the calling turn, at most 4 marks…); otherwise the original body is forwarded.

pub mod cache;
pub mod convert;

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};

use serde::Deserialize;
use serde_json::Value;
use serde_json::value::RawValue;

use super::{
    Forward, Invalid, Origin, Spans, Split, Traced, Unit, Wire, WireBody, WireError, json_string, replace_member,
};
use crate::compact::validate::Skeleton;
use crate::neutral::scan::Resume;
use crate::neutral::{Arguments, Content, Draft, DraftCall, Message, Typing, push_json_string, raw_members};
use cache::{Fate, Place};

/// The `type` of the block in which the server hands back its summary of the conversation
/// (the context-management beta's compaction): the API reads it in place of everything before it, so
/// the neutral message holding it is a hard epoch boundary ([`WireBody::epoch_boundary`]), forwarded with
/// everything before it as they are. The block itself stays in its turn byte for byte.
pub const COMPACTION_BLOCK: &str = "compaction";

/// What a content block is to the adapter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Text,
    ToolUse,
    ToolResult,
    /// `thinking` / `redacted_thinking`: signed, never altered, never marked.
    Thinking,
    /// Images, documents, server tool blocks, unknown types.
    Other,
}

/// The keys of a block the adapter reads; everything else stays in the block's bytes.
#[derive(Deserialize, Default)]
struct BlockHead<'a> {
    #[serde(rename = "type", borrow, default)]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    input: Option<&'a RawValue>,
    #[serde(borrow, default)]
    tool_use_id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
    #[serde(borrow, default)]
    cache_control: Option<&'a RawValue>,
}

/// One content block, read.
#[derive(Debug, Clone)]
struct Block<'a> {
    raw: &'a str,
    kind: Kind,
    /// A `tool_use`'s `id`, a `tool_result`'s `tool_use_id`.
    id: String,
    name: String,
    input: Option<&'a str>,
    content: Option<&'a str>,
    /// The block's own `cache_control` value as sent (`None`: none, or `null`).
    cache_control: Option<&'a str>,
    /// A `compaction` block with a summary: the server reads it in place of everything before it
    /// (see [`COMPACTION_BLOCK`]). One with `content: null` is a failed compaction the server treats
    /// as a no-op: it reads what comes before, so it is no boundary.
    compaction: bool,
}

impl<'a> Block<'a> {
    fn read(raw: &'a str) -> Block<'a> {
        let head = serde_json::from_str::<BlockHead<'a>>(raw).unwrap_or_else(|_| {
            // A block whose other keys are not what the API's are still carries its marks.
            let marks = serde_json::from_str::<MarkHead<'a>>(raw).unwrap_or_default();
            BlockHead { content: marks.content, cache_control: marks.cache_control, ..BlockHead::default() }
        });
        let kind = match head.kind.as_deref().unwrap_or("") {
            "text" => Kind::Text,
            "tool_use" if head.id.is_some() && head.input.is_some_and(|i| i.get().starts_with('{')) => Kind::ToolUse,
            "tool_result" if head.tool_use_id.is_some() => Kind::ToolResult,
            "thinking" | "redacted_thinking" => Kind::Thinking,
            _ => Kind::Other,
        };
        let id = head.id.as_deref().or(head.tool_use_id.as_deref()).unwrap_or("").to_owned();
        Block {
            raw,
            kind,
            id,
            name: head.name.as_deref().unwrap_or("").to_owned(),
            input: head.input.map(RawValue::get),
            content: head.content.map(RawValue::get),
            cache_control: head.cache_control.map(RawValue::get).filter(|c| *c != "null"),
            compaction: head.kind.as_deref() == Some(COMPACTION_BLOCK)
                && head.content.is_some_and(|c| c.get() != "null"),
        }
    }

    /// The block carries its own `cache_control`.
    fn marked(&self) -> bool {
        self.cache_control.is_some()
    }
}

/// The keys of a block that hold marks: its own, and those of the blocks of its `content`.
#[derive(Deserialize, Default)]
struct MarkHead<'a> {
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
    #[serde(borrow, default)]
    cache_control: Option<&'a RawValue>,
}

/// The keys of a turn the adapter reads.
#[derive(Deserialize)]
struct TurnHead<'a> {
    #[serde(borrow)]
    role: Cow<'a, str>,
    #[serde(borrow)]
    content: &'a RawValue,
}

/// One turn of `messages`, read.
#[derive(Debug, Clone)]
struct Turn<'a> {
    raw: &'a str,
    /// `user` or `assistant`; any other turn is opaque.
    role: String,
    /// The content as sent (a string or an array).
    content: &'a str,
    /// The blocks, when the content is an array (empty for a string or an opaque turn).
    blocks: Vec<Block<'a>>,
    opaque: bool,
}

impl<'a> Turn<'a> {
    fn read(raw: &'a str) -> Turn<'a> {
        let opaque = || Turn { raw, role: String::new(), content: "", blocks: Vec::new(), opaque: true };
        let Ok(head) = serde_json::from_str::<TurnHead<'a>>(raw) else { return opaque() };
        if !matches!(head.role.as_ref(), "user" | "assistant") {
            return opaque();
        }
        let content = head.content.get();
        let blocks = if content.starts_with('[') {
            match serde_json::from_str::<Vec<&'a RawValue>>(content) {
                Ok(list) => list.into_iter().map(|b| Block::read(b.get())).collect(),
                Err(_) => return opaque(),
            }
        } else if content.starts_with('"') {
            Vec::new()
        } else {
            return opaque();
        };
        Turn { raw, role: head.role.into_owned(), content, blocks, opaque: false }
    }

    /// The turn is one unit that is kept or goes whole: opaque, a string content, or no blocks.
    fn is_whole(&self) -> bool {
        self.opaque || self.blocks.is_empty()
    }

    /// Blocks of the turn for the cache plan (a whole turn counts as one).
    fn n_blocks(&self) -> usize {
        if self.is_whole() { 1 } else { self.blocks.len() }
    }
}

/// A Messages request body read into the neutral view.
#[derive(Debug)]
pub struct MessagesBody<'a> {
    /// The body split around `messages` (its elements are the raw turns).
    split: Split<'a>,
    turns: Vec<Turn<'a>>,
    /// The neutral messages: the system prompt first when the request has one, then the turns'.
    neutral: Vec<String>,
    has_system: bool,
    /// What each neutral message after the system prompt stands for.
    units: Vec<Unit>,
    /// The last neutral message holding a compaction block with a summary.
    epoch_boundary: Option<usize>,
}

impl<'a> MessagesBody<'a> {
    /// Parse a Messages request. Fails when the body is not a JSON object with a `messages` list.
    pub fn parse(bytes: &'a [u8]) -> Result<MessagesBody<'a>, WireError> {
        Self::parse_resumed(bytes, None)
    }

    /// [`MessagesBody::parse`] whose scan starts again after `resume` ([`Split::parse_resumed`]).
    pub(crate) fn parse_resumed(bytes: &'a [u8], resume: Option<&Resume<'_>>) -> Result<MessagesBody<'a>, WireError> {
        let split = Split::parse_resumed(bytes, "messages", resume)?;
        let mut out = MessagesBody {
            turns: Vec::with_capacity(split.elements.len()),
            split,
            neutral: Vec::new(),
            has_system: false,
            units: Vec::new(),
            epoch_boundary: None,
        };
        out.has_system = out.system().is_some();
        out.turns = out.split.elements.iter().map(|raw| Turn::read(raw)).collect();
        for (t, turn) in out.turns.iter().enumerate() {
            if turn.is_whole() {
                out.units.push(Unit::Turn(t));
            } else if turn.role == "assistant" {
                if turn.blocks.iter().any(|b| b.compaction) {
                    out.epoch_boundary = Some(out.units.len() + usize::from(out.has_system));
                }
                out.units.push(Unit::Turn(t));
            } else {
                for (b, _) in turn.blocks.iter().enumerate().filter(|(_, b)| b.kind == Kind::ToolResult) {
                    out.units.push(Unit::Result { turn: t, part: b });
                }
                // The person's blocks beside the results (the turn has blocks: it is not whole).
                let mut written = turn.blocks.iter().filter(|b| b.kind != Kind::ToolResult).peekable();
                if written.peek().is_some() {
                    if written.any(|b| b.compaction) {
                        out.epoch_boundary = Some(out.units.len() + usize::from(out.has_system));
                    }
                    out.units.push(Unit::UserParts(t));
                }
            }
        }
        let first = out.first_turn_message();
        let turn_raw = |i: usize| std::slice::from_ref(&out.turns[out.units[i - first].turn()].raw);
        out.neutral = super::neutral_texts(first + out.units.len(), |i| out.draft(i), turn_raw);
        Ok(out)
    }

    /// The system prompt as sent, when the request has one.
    fn system(&self) -> Option<&'a str> {
        self.split.field("system").map(RawValue::get).filter(|s| *s != "null")
    }

    /// Neutral message `i` as read from its turn (`None`: an opaque turn, or no such message).
    fn draft(&self, i: usize) -> Option<Draft<'_>> {
        let i = match (self.has_system, i) {
            (true, 0) => return self.system().map(|system| Draft::text("system", unmarked(system))),
            (true, i) => i - 1,
            (false, i) => i,
        };
        match *self.units.get(i)? {
            Unit::Turn(t) => {
                let turn = &self.turns[t];
                if turn.opaque {
                    None
                } else if turn.is_whole() {
                    Some(Draft::text(&turn.role, turn.content))
                } else {
                    Some(assistant_draft(&turn.blocks))
                }
            }
            Unit::Result { turn, part } => Some(result_draft(&self.turns[turn].blocks[part])),
            Unit::UserParts(t) => {
                let written: Vec<&Block<'_>> =
                    self.turns[t].blocks.iter().filter(|b| b.kind != Kind::ToolResult).collect();
                Some(user_blocks_draft(&written))
            }
        }
    }

    fn first_turn_message(&self) -> usize {
        usize::from(self.has_system)
    }
}

/// A content value (a string, or an array of blocks) without `cache_control` marks, as JSON text.
fn unmarked<'c>(content: impl Into<Cow<'c, str>>) -> Cow<'c, str> {
    let content = content.into();
    if !content.contains("\"cache_control\"") {
        return content;
    }
    match serde_json::from_str::<Value>(&content) {
        Ok(mut value) => {
            strip_marks(&mut value);
            Cow::Owned(value.to_string())
        }
        Err(_) => content,
    }
}

fn strip_marks(value: &mut Value) {
    if let Value::Array(blocks) = value {
        for block in blocks {
            if let Value::Object(map) = block {
                map.shift_remove("cache_control");
                if let Some(inner) = map.get_mut("content") {
                    strip_marks(inner);
                }
            }
        }
    }
}

fn result_draft<'b>(block: &'b Block<'_>) -> Draft<'b> {
    Draft::result(&block.id, block.content.map_or(Cow::Borrowed("\"\""), unmarked))
}

fn user_blocks_draft<'b>(blocks: &[&'b Block<'_>]) -> Draft<'b> {
    let list: Vec<&str> = blocks.iter().map(|b| b.raw).collect();
    Draft::text("user", unmarked(format!("[{}]", list.join(","))))
}

fn assistant_draft<'b>(blocks: &'b [Block<'_>]) -> Draft<'b> {
    let texts: Vec<&str> = blocks.iter().filter(|b| b.kind == Kind::Text).map(|b| b.raw).collect();
    let content = if texts.is_empty() { Cow::Borrowed("null") } else { unmarked(format!("[{}]", texts.join(","))) };
    let tool_calls = blocks
        .iter()
        .filter(|b| b.kind == Kind::ToolUse)
        .map(|call| DraftCall {
            id: &call.id,
            name: &call.name,
            arguments: Arguments::Text(call.input.unwrap_or("{}")),
        })
        .collect();
    Draft { role: "assistant", content, tool_calls, tool_call_id: None }
}

impl WireBody for MessagesBody<'_> {
    fn wire(&self) -> Wire {
        Wire::Messages
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
    fn epoch_boundary(&self) -> Option<usize> {
        self.epoch_boundary
    }
    fn output_limit(&self) -> Option<u64> {
        self.split.field("max_tokens").and_then(|v| serde_json::from_str::<u64>(v.get()).ok())
    }
    fn write(&self, forwarded: &[Forward<'_>]) -> Result<(Vec<u8>, Spans), WireError> {
        let turns = self.turns_for(forwarded)?;
        // A request that was already invalid goes as the agent sent it, when nothing changed.
        let unchanged = turns.len() == self.split.elements.len()
            && turns.iter().zip(&self.split.elements).all(|(turn, raw)| std::ptr::eq(turn.as_ref(), *raw));
        if unchanged {
            return Ok(self.split.to_vec_and_spans_keeping_array());
        }
        let read = super::reuse_reads(&turns, &self.split.elements, &self.turns, Turn::read);
        check_read(&read.iter().map(|(_, r)| r.as_ref()).collect::<Vec<_>>(), self.has_system)?;
        Ok(self.split.to_vec_and_spans(&turns))
    }
    fn spans_in(&self, body: &[u8]) -> Option<Spans> {
        self.split.spans_in(body)
    }
    fn check(&self) -> Result<(), Invalid> {
        check_read(&self.turns.iter().collect::<Vec<_>>(), self.has_system)
    }
}

/// A forwarded turn being written: the original turn it stands for (`None`: a turn the engine
/// wrote), and its blocks, each with its original index (`None`: the whole turn as one text).
type WrittenTurn<'b> = (Option<usize>, Vec<(Option<usize>, Cow<'b, str>)>);

impl MessagesBody<'_> {
    /// The turns standing for the `forwarded` entries, with the agent's cache marks placed.
    fn turns_for(&self, forwarded: &[Forward<'_>]) -> Result<Vec<Cow<'_, str>>, WireError> {
        let traced = super::trace_units(&self.units, self.first_turn_message(), forwarded, "system prompt")?;
        // Per original turn: which of its units survive, and how.
        let mut kept_units: HashSet<Unit> = HashSet::new();
        let mut rewrites: HashMap<Unit, &Message> = HashMap::new();
        for f in &traced {
            match f {
                Traced::Kept(unit) => {
                    kept_units.insert(*unit);
                }
                Traced::Rewritten(unit, message) => {
                    rewrites.insert(*unit, message);
                }
                Traced::New(_) => {}
            }
        }
        let mut fates: Vec<Vec<Fate>> = self.turns.iter().map(|t| vec![Fate::Elided; t.n_blocks()]).collect();
        // The blocks of each surviving turn, as (original block index or None for new, text).
        let mut written: Vec<WrittenTurn<'_>> = Vec::new();
        // The text of each turn the engine wrote, by its place in `written`.
        let mut new_texts: HashMap<usize, String> = HashMap::new();
        let mut seen_turn: Option<usize> = None;
        for f in &traced {
            let unit = match f {
                Traced::Kept(unit) | Traced::Rewritten(unit, _) => *unit,
                Traced::New(message) => {
                    new_texts.insert(written.len(), message.text());
                    written.push((None, vec![(None, Cow::Owned(new_turn(message)?))]));
                    seen_turn = None;
                    continue;
                }
            };
            let t = unit.turn();
            if seen_turn == Some(t) {
                continue;
            }
            seen_turn = Some(t);
            let turn = &self.turns[t];
            if turn.is_whole() {
                fates[t][0] = Fate::Kept;
                written.push((Some(t), vec![(None, Cow::Borrowed(turn.raw))]));
                continue;
            }
            let mut blocks = Vec::with_capacity(turn.blocks.len());
            // A changed assistant text goes to the turn's first text block; its other text blocks go.
            let mut new_text = match rewrites.get(&Unit::Turn(t)) {
                Some(message) if turn.role == "assistant" => changed_text(turn, message),
                _ => None,
            };
            let text_changed = new_text.is_some();
            for (b, block) in turn.blocks.iter().enumerate() {
                let unit = match (turn.role.as_str(), block.kind) {
                    ("assistant", _) => Unit::Turn(t),
                    (_, Kind::ToolResult) => Unit::Result { turn: t, part: b },
                    _ => Unit::UserParts(t),
                };
                if kept_units.contains(&unit) {
                    fates[t][b] = Fate::Kept;
                    blocks.push((Some(b), Cow::Borrowed(block.raw)));
                } else if let Some(message) = rewrites.get(&unit) {
                    let rewritten = match block.kind {
                        Kind::Text if text_changed => match new_text.take() {
                            Some(text) if !text.is_empty() => Some(
                                replace_member(block.raw, "text", None, &json_string(&text))
                                    .ok_or_else(|| WireError::Unwritable("a text block cannot be rewritten".into()))?,
                            ),
                            _ => None,
                        },
                        _ => rewrite_block(block, message)?,
                    };
                    match rewritten {
                        Some(text) if text == block.raw => {
                            fates[t][b] = Fate::Kept;
                            blocks.push((Some(b), Cow::Borrowed(block.raw)));
                        }
                        Some(text) => {
                            fates[t][b] = Fate::Rewritten;
                            blocks.push((Some(b), Cow::Owned(text)));
                        }
                        None => {}
                    }
                }
            }
            if !blocks.is_empty() {
                written.push((Some(t), blocks));
            }
        }
        self.place_marks(&fates, &mut written)?;
        // The API joins consecutive turns of one role, and the final assistant turn must open with
        // its thinking block: a marker right before an assistant turn that opens with one is written
        // as a user turn, which joins the user turn before it instead.
        let opens_with_thinking: Vec<bool> = written
            .iter()
            .map(|(t, blocks)| {
                let first = blocks.first().and_then(|(b, _)| *b);
                t.zip(first).is_some_and(|(t, b)| {
                    self.turns[t].role == "assistant" && self.turns[t].blocks[b].kind == Kind::Thinking
                })
            })
            .collect();
        written
            .into_iter()
            .enumerate()
            .map(|(i, (t, blocks))| match t {
                None => {
                    let text = blocks.into_iter().next().expect("a new turn is one text").1;
                    if !opens_with_thinking.get(i + 1).copied().unwrap_or(false) {
                        return Ok(text);
                    }
                    let marker = new_texts.get(&i).map_or("", String::as_str);
                    Ok(Cow::Owned(turn_of("user", &text_blocks(marker))))
                }
                Some(t) => {
                    let turn = &self.turns[t];
                    let all_borrowed = blocks.iter().all(|(_, text)| matches!(text, Cow::Borrowed(_)));
                    if turn.is_whole() || (all_borrowed && blocks.len() == turn.blocks.len()) {
                        return Ok(Cow::Borrowed(turn.raw));
                    }
                    let list: Vec<&str> = blocks.iter().map(|(_, text)| text.as_ref()).collect();
                    replace_member(turn.raw, "content", Some(turn.content), &format!("[{}]", list.join(",")))
                        .map(Cow::Owned)
                        .ok_or_else(|| WireError::Unwritable(format!("turn {t} cannot be rewritten")))
                }
            })
            .collect()
    }

    /// Move the marks of elided blocks (see [`cache::placement`]); a rewritten result whose content
    /// carried a mark inside takes it on the block itself.
    fn place_marks(&self, fates: &[Vec<Fate>], written: &mut [WrittenTurn<'_>]) -> Result<(), WireError> {
        let marks = self.marks();
        let may_carry = |t: usize, b: usize| {
            let turn = &self.turns[t];
            turn.blocks.get(b).is_some_and(|block| match turn.role.as_str() {
                "assistant" => matches!(block.kind, Kind::Text | Kind::ToolUse),
                _ => block.kind == Kind::ToolResult,
            })
        };
        let placed = cache::placement(&marks, fates, may_carry);
        let mut add: Vec<(usize, usize, &Value)> = Vec::new();
        for (mark, place) in marks.iter().zip(&placed) {
            let Place::Block { message: t, block: b } = mark.place else { continue };
            match place {
                Some(Place::Block { message, block }) if (*message, *block) != (t, b) => {
                    add.push((*message, *block, &mark.value))
                }
                // A rewritten result loses the marks inside its old content: its block takes one.
                Some(_)
                    if fates.get(t).and_then(|blocks| blocks.get(b)) == Some(&Fate::Rewritten)
                        && !self.turns[t].blocks.get(b).is_some_and(Block::marked) =>
                {
                    add.push((t, b, &mark.value))
                }
                _ => {}
            }
        }
        for (t, b, value) in add {
            let Some((_, blocks)) = written.iter_mut().find(|(turn, _)| *turn == Some(t)) else { continue };
            let Some((_, text)) = blocks.iter_mut().find(|(block, _)| *block == Some(b)) else { continue };
            if text.contains("\"cache_control\"") && Block::read(text).marked() {
                continue;
            }
            let mark = value.to_string();
            *text = Cow::Owned(
                insert_member(text, "cache_control", &mark)
                    .ok_or_else(|| WireError::Unwritable(format!("block {b} of turn {t} cannot take a mark")))?,
            );
        }
        Ok(())
    }

    /// The agent's marks, in the API's order: the tools' and the system prompt's read from their
    /// values when they hold any, the turns' from the blocks the body was read into (a block's own
    /// mark, then those of its `content` blocks; an opaque turn's read from its value).
    fn marks(&self) -> Vec<cache::Mark> {
        let mut out = Vec::new();
        for key in ["tools", "system"] {
            let place = |i| if key == "tools" { Place::Tool(i) } else { Place::System(i) };
            let Some(raw) = self.split.field(key).map(RawValue::get).filter(|r| r.contains("\"cache_control\"")) else {
                continue;
            };
            for (i, value) in serde_json::from_str::<Vec<Value>>(raw).unwrap_or_default().iter().enumerate() {
                cache::push_marks(value, place(i), &mut out);
            }
        }
        let value = |raw: &str| serde_json::from_str::<Value>(raw).unwrap_or(Value::Null);
        for (message, turn) in self.turns.iter().enumerate() {
            if turn.opaque {
                let content = value(turn.raw).get("content").and_then(Value::as_array).cloned().unwrap_or_default();
                for (block, value) in content.iter().enumerate() {
                    cache::push_marks(value, Place::Block { message, block }, &mut out);
                }
                continue;
            }
            for (b, block) in turn.blocks.iter().enumerate() {
                let place = Place::Block { message, block: b };
                if let Some(mark) = block.cache_control {
                    out.push(cache::Mark { place, value: value(mark) });
                }
                let inner = block.content.filter(|c| c.starts_with('[') && c.contains("\"cache_control\""));
                let inner =
                    inner.map(|c| serde_json::from_str::<Vec<&RawValue>>(c).unwrap_or_default()).unwrap_or_default();
                for raw in inner {
                    let head = serde_json::from_str::<MarkHead<'_>>(raw.get()).unwrap_or_default();
                    if let Some(mark) = head.cache_control.map(RawValue::get).filter(|c| *c != "null") {
                        out.push(cache::Mark { place, value: value(mark) });
                    }
                }
            }
        }
        out
    }
}

/// The neutral message of an assistant answer (the `message` the API returns, or the one assembled
/// from its stream): what the same turn reads as when the agent's next request carries it, so
/// that the session tracker finds the conversation it extends.
pub fn neutral_answer(message: &Value) -> Option<Value> {
    let content = message.get("content")?;
    match content {
        Value::String(_) => Draft::text("assistant", content.to_string()).value(),
        Value::Array(blocks) => {
            let raws: Vec<String> = blocks.iter().map(Value::to_string).collect();
            let blocks: Vec<Block<'_>> = raws.iter().map(|raw| Block::read(raw)).collect();
            assistant_draft(&blocks).value()
        }
        _ => None,
    }
}

/// `block` with what the forwarded neutral `message` changed: a result's `content`, a call's `input`
/// (which must stay an object with the same keys), an assistant's text. `None`: the block goes.
fn rewrite_block(block: &Block<'_>, message: &Message) -> Result<Option<String>, WireError> {
    // `known`: the value replaced, as the block's read found it.
    let replace = |key: &str, known: Option<&str>, value: &str| {
        replace_member(block.raw, key, known, value)
            .ok_or_else(|| WireError::Unwritable("a block cannot be rewritten".into()))
    };
    match block.kind {
        Kind::ToolResult => Ok(Some(replace("content", block.content, &content_json(&message.content))?)),
        Kind::ToolUse => {
            let call = message.tool_calls.iter().flatten().find(|c| c.id == block.id);
            let Some(arguments) = call.and_then(|c| c.function.as_ref()).map(|f| &f.arguments) else {
                return Err(WireError::Unwritable(format!("call `{}` lost its tool_use", block.id)));
            };
            let Value::String(arguments) = arguments else {
                return Err(WireError::Unwritable(format!("call `{}` has arguments that are not a string", block.id)));
            };
            if Some(arguments.as_str()) == block.input {
                return Ok(Some(block.raw.to_owned()));
            }
            let same_keys =
                |raw: &str| raw_members(raw).map(|m| m.into_iter().map(|(k, _)| k.to_owned()).collect::<Vec<_>>());
            match (same_keys(arguments), block.input.and_then(same_keys)) {
                (Some(new), Some(old)) if new == old => Ok(Some(replace("input", block.input, arguments)?)),
                _ => Err(WireError::Unwritable(format!(
                    "call `{}`: its input must stay an object with the same keys",
                    block.id
                ))),
            }
        }
        Kind::Text | Kind::Thinking | Kind::Other => Ok(Some(block.raw.to_owned())),
    }
}

/// The forwarded text of an assistant `turn`, when the engine changed it ("" when it took it away).
fn changed_text(turn: &Turn<'_>, message: &Message) -> Option<String> {
    let original = crate::neutral::parts_text(turn.blocks.iter().filter(|b| b.kind == Kind::Text).map(|b| b.raw));
    let new_text = message.text();
    (original != new_text).then_some(new_text)
}

/// A turn for a neutral message the engine wrote (an elision marker).
fn new_turn(message: &Message) -> Result<String, WireError> {
    let role = match message.role.as_str() {
        role @ ("user" | "assistant") => role,
        other => return Err(WireError::Unwritable(format!("a forwarded `{other}` message has no turn to stand for"))),
    };
    Ok(turn_of(role, &text_blocks(&message.text())))
}

/// A turn of `role` whose content is `content`, JSON text.
fn turn_of(role: &str, content: &str) -> String {
    let mut out = String::from(r#"{"role":"#);
    push_json_string(&mut out, role);
    out.push_str(r#","content":"#);
    out.push_str(content);
    out.push('}');
    out
}

/// `[{"type":"text","text": text}]`: a turn pare writes has blocks, as the turns Claude Code sends.
fn text_blocks(text: &str) -> String {
    format!(r#"[{{"type":"text","text":{}}}]"#, json_string(text))
}

/// A neutral `content` as the content of a `tool_result` (a string stays a string, parts stay blocks).
fn content_json(content: &Option<Content>) -> String {
    match content {
        Some(Content::Text(text)) => json_string(text),
        Some(c) => serde_json::to_string(c).unwrap_or_else(|_| "\"\"".into()),
        None => "\"\"".into(),
    }
}

/// `object` with `key: value` appended (raw JSON).
fn insert_member(object: &str, key: &str, value: &str) -> Option<String> {
    let members = raw_members(object)?;
    let mut out = String::with_capacity(object.len() + key.len() + value.len() + 4);
    out.push('{');
    for (k, v) in &members {
        push_json_string(&mut out, k);
        out.push(':');
        out.push_str(v);
        out.push(',');
    }
    push_json_string(&mut out, key);
    out.push(':');
    out.push_str(value);
    out.push('}');
    Some(out)
}

/// A rule of the Messages API over turns that the neutral form cannot express (the pairing of
/// `tool_use` and `tool_result` blocks is the neutral view's, [`crate::compact::validate`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Structure {
    /// A `tool_use` block in a user turn: the neutral view reads it as what the person wrote.
    #[error("turn {turn}: tool_use `{id}` outside an assistant turn")]
    ToolUseOutsideAssistant { turn: usize, id: String },
    /// A `tool_result` block in an assistant turn: the neutral view does not read it.
    #[error("turn {turn}: tool_result for `{id}` outside a user turn")]
    ToolResultOutsideUser { turn: usize, id: String },
    /// The API takes the results of an assistant turn's calls in the very next turn; the neutral
    /// view cannot tell two user turns of results apart from one.
    #[error("turn {turn}: tool_result for `{id}` is not in the turn right after an assistant turn")]
    ResultNotAfterCalls { turn: usize, id: String },
    /// The API takes at most 4 `cache_control` marks; the neutral view carries none.
    #[error("{n_marks} cache_control marks in the turns (the API takes 4)")]
    TooManyMarks { n_marks: usize },
}

/// The Messages API's rules over `turns` (a request without a system prompt) that pare could
/// break: the pairing of their neutral view ([`crate::compact::validate`]: every `tool_use`
/// answered by a `tool_result` before anything else, no result without its open call, no id empty
/// or repeated while open), then the API's own ([`Structure`]): `tool_use` only in assistant
/// turns, `tool_result` only in the user turn right after an assistant turn, at most 4
/// `cache_control` marks. Turns pare cannot read are opaque messages.
pub fn check_turns<S: AsRef<str>>(turns: &[S]) -> Result<(), Invalid> {
    check_conversation(turns, false)
}

/// [`check_turns`] over the turns of a request, whose neutral view opens with its system prompt
/// when `system`.
fn check_conversation<S: AsRef<str>>(turns: &[S], system: bool) -> Result<(), Invalid> {
    let read: Vec<Turn<'_>> = turns.iter().map(|t| Turn::read(t.as_ref())).collect();
    check_read(&read.iter().collect::<Vec<_>>(), system)
}

/// [`check_conversation`] over turns already read.
fn check_read(read: &[&Turn<'_>], system: bool) -> Result<(), Invalid> {
    let (skeletons, origins) = neutral_skeletons(read, system);
    super::check_pairing(&skeletons, &origins)?;
    let mut n_marks = 0;
    for (t, turn) in read.iter().enumerate() {
        n_marks += turn.blocks.iter().filter(|b| b.marked()).count();
        let first_of = |kind: Kind| turn.blocks.iter().find(|b| b.kind == kind).map(|b| b.id.clone());
        if let Some(id) = first_of(Kind::ToolUse).filter(|_| turn.role != "assistant") {
            return Err(Structure::ToolUseOutsideAssistant { turn: t, id }.into());
        }
        if let Some(id) = first_of(Kind::ToolResult) {
            if turn.role != "user" {
                return Err(Structure::ToolResultOutsideUser { turn: t, id }.into());
            }
            if t.checked_sub(1).is_none_or(|before| read[before].role != "assistant") {
                return Err(Structure::ResultNotAfterCalls { turn: t, id }.into());
            }
        }
    }
    if n_marks > 4 {
        return Err(Structure::TooManyMarks { n_marks }.into());
    }
    Ok(())
}

/// The skeleton of each neutral message `turns` read into (as [`MessagesBody::parse`] writes them,
/// the system prompt first when `system`), and the turn it comes from.
fn neutral_skeletons(turns: &[&Turn<'_>], system: bool) -> (Vec<Option<Skeleton>>, Vec<Origin>) {
    let mut skeletons = Vec::with_capacity(turns.len() + 1);
    let mut origins = Vec::with_capacity(turns.len() + 1);
    if system {
        skeletons.push(super::skeleton("system", Vec::new(), None));
        origins.push(Origin::System);
    }
    for (t, turn) in turns.iter().enumerate() {
        let mut push = |skeleton| {
            skeletons.push(skeleton);
            origins.push(Origin::Turn(t));
        };
        if turn.opaque {
            push(Some(Skeleton::opaque()));
        } else if turn.is_whole() {
            push(super::skeleton(&turn.role, Vec::new(), None));
        } else if turn.role == "assistant" {
            let calls = turn.blocks.iter().filter(|b| b.kind == Kind::ToolUse).map(|b| b.id.clone()).collect();
            push(super::skeleton("assistant", calls, None));
        } else {
            for block in turn.blocks.iter().filter(|b| b.kind == Kind::ToolResult) {
                push(super::skeleton("tool", Vec::new(), Some(&block.id)));
            }
            if turn.blocks.iter().any(|b| b.kind != Kind::ToolResult) {
                push(super::skeleton("user", Vec::new(), None));
            }
        }
    }
    (skeletons, origins)
}

#[cfg(test)]
mod tests;
