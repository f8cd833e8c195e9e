//! The wire formats pare reads, one adapter each, onto pare's neutral conversation
//! ([`crate::neutral`]).
//!
//! An adapter parses a request body once into a [`WireBody`]: the conversation as neutral messages
//! (what the session tracker, the budget and the engine read; each typed on demand from the parts
//! it was read from, [`WireBody::typed`]), the tool definitions (counted, never
//! touched), and whatever else the request says that pare needs (model, stream, output limit). Given
//! the forwarded conversation, it writes the forwarded body back: top-level keys keep their order
//! and bytes, and every part the engine left alone is written as its original bytes.
//!
//! Every adapter holds the body's [`Split`] (`split.rs`): the top-level keys other than the
//! conversation array with their bytes, and the array's elements as raw text, read by the fast scan
//! of `neutral::scan` (serde_json when it declines). The split writes the forwarded body and
//! says where its values lie ([`Spans`], what the archive stores a body along).
//!
//! - [`ChatBody`] (`chat.rs`): Chat Completions, split around `messages`. Its messages are the
//!   split's elements, already the neutral form, so the adapter copies nothing.
//! - [`responses`]: the OpenAI Responses API (`input` items, `instructions`).
//! - [`messages`]: the Anthropic Messages API (`system`, `messages` turns of content blocks).
//! - [`gemini`]: the Gemini API (`systemInstruction`, `contents` turns of parts; the model in the path).
//!
//! [`recent::RecentBodies`] lets the proxy split a body, of any format, only after the entries it
//! shares with a recent body it extends.
//!
//! Every format checks what it writes the same way ([`WireBody::check`]): the pairing of its
//! neutral view through the one pairing validator, [`crate::compact::validate`], then the rules of
//! its own that the neutral form cannot express, each a variant of its `Structure` error. Both
//! are an [`Invalid`].
//!
//! A new format is one file with a type implementing [`WireBody`] over its body's [`Split`], a
//! variant of [`Wire`] and its arm in [`parse`] (and of [`Invalid`] when it has rules of its own).

mod chat;
pub mod convert;
pub mod gemini;
pub mod messages;
pub mod recent;
pub mod responses;
mod split;

pub use chat::ChatBody;
pub(crate) use split::TopLevel;
pub use split::{Spans, Split};

use std::borrow::Cow;
use std::sync::OnceLock;

use crate::compact::validate::{Skeleton, Violation};
use crate::neutral::Message;

/// The request formats pare compacts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Wire {
    /// OpenAI Chat Completions (`…/chat/completions`, `messages`).
    #[default]
    Chat,
    /// OpenAI Responses (`…/responses`, `instructions` + `input` items).
    Responses,
    /// Anthropic Messages (`…/v1/messages`, `system` + `messages` turns of content blocks).
    Messages,
    /// Gemini (`…/models/{model}:generateContent` and `:streamGenerateContent`, `systemInstruction`
    /// + `contents` turns of parts).
    Gemini,
}

impl Wire {
    /// Every format, in [`Wire::name`] order.
    pub const ALL: [Wire; 4] = [Wire::Chat, Wire::Responses, Wire::Messages, Wire::Gemini];

    /// The name used in headers, metrics labels and the command line.
    pub fn name(self) -> &'static str {
        match self {
            Wire::Chat => "chat",
            Wire::Responses => "responses",
            Wire::Messages => "messages",
            Wire::Gemini => "gemini",
        }
    }

    /// The format of a `POST` to `path`, when pare compacts that path (exactly these suffixes:
    /// `/responses/{id}`, `/responses/compact` and the rest pass through).
    pub fn of_path(path: &str) -> Option<Wire> {
        if path.ends_with("/chat/completions") {
            Some(Wire::Chat)
        } else if path.ends_with("/responses") {
            Some(Wire::Responses)
        } else if path.ends_with("/v1/messages") {
            Some(Wire::Messages)
        } else if gemini::Call::is_generation(path) {
            Some(Wire::Gemini)
        } else {
            None
        }
    }
}

/// A request body read by its wire adapter (see the module docs).
pub trait WireBody: Send + Sync {
    fn wire(&self) -> Wire;
    /// The conversation in pare's neutral form, one JSON message per entry.
    fn messages(&self) -> Vec<&str>;
    /// Neutral message `i` typed from the parts the adapter read it from, when the adapter wrote it
    /// (`None`: the entry is the wire's own bytes, read as such).
    fn typed(&self, _i: usize) -> Option<crate::neutral::Typing> {
        None
    }
    /// The body split around its conversation array (every format keeps its other top-level keys
    /// this way).
    fn top(&self) -> &Split<'_>;
    /// The tool definitions as raw JSON, when the request has any.
    fn tools(&self) -> Option<&str> {
        self.top().field("tools").map(|t| t.get()).filter(|t| *t != "null")
    }
    /// The request's `model`, when it is a string.
    fn model(&self) -> Option<String> {
        self.top().model()
    }
    /// The request asks for a streamed answer.
    fn stream(&self) -> bool {
        self.top().field("stream").is_some_and(|v| v.get().trim() == "true")
    }
    /// The most tokens the request lets the model answer with, when it says.
    fn output_limit(&self) -> Option<u64>;
    /// Why the request goes upstream as sent (the reason the proxy logs), when it asks the server to
    /// compact the history itself (a Responses `compaction_trigger` item): compacting it first would
    /// have the server summarize pare's shortened history.
    fn server_compaction(&self) -> Option<&'static str> {
        None
    }
    /// The neutral message the upstream reads in place of everything before it, when the request
    /// has one (the last Responses `compaction` item, the last Anthropic `compaction` block with a
    /// summary): a hard epoch boundary ([`crate::compact::CompactOptions::epoch_boundary`]).
    fn epoch_boundary(&self) -> Option<usize> {
        None
    }
    /// The body to forward with `forwarded` in place of the conversation, and where its values
    /// lie. Each entry says what it stands for among the request's own neutral messages (the
    /// engine's plan, [`Forward::of_plan`]): one kept is written as the parts it came from, one
    /// rewritten as those parts with the changes its [`Written`] form carries, one pare wrote (a
    /// marker) as a new part. `Err` when the conversation cannot be written validly in this
    /// format: the caller forwards the original body.
    fn write(&self, forwarded: &[Forward<'_>]) -> Result<(Vec<u8>, Spans), WireError>;
    /// Where this body's values lie in `body`, the bytes it was parsed from (for the archive).
    fn spans_in(&self, body: &[u8]) -> Option<Spans>;
    /// The format's rules over the body, as its writer checks what it writes: the pairing of its
    /// neutral view ([`crate::compact::validate`]: a tool call answered by its result, no result
    /// without its call…), then the format's own rules the neutral form cannot express. Used by
    /// eval and the tests.
    fn check(&self) -> Result<(), Invalid>;
}

/// The neutral texts of a body's `n` entries: entry `i`'s draft written, or, for an entry the
/// adapter does not read, the wire parts it stands for (`parts(i)`) as an opaque entry.
fn neutral_texts<'p, 'd>(
    n: usize,
    draft: impl Fn(usize) -> Option<crate::neutral::Draft<'d>>,
    parts: impl Fn(usize) -> &'p [&'p str],
) -> Vec<String> {
    (0..n).map(|i| draft(i).map_or_else(|| crate::neutral::opaque(parts(i)), |draft| draft.write())).collect()
}

/// One entry of a forwarded conversation, as the engine's plan says to write it.
#[derive(Debug, Clone, Copy)]
pub enum Forward<'a> {
    /// The request's neutral message `i`, forwarded as it is.
    Kept(usize),
    /// The request's neutral message `i`, rewritten into the entry.
    Rewritten(usize, Written<'a>),
    /// An entry pare wrote (an elision marker): no part of the request.
    New(Written<'a>),
}

/// A forwarded message pare wrote: its neutral text (what Chat Completions forwards, what is
/// hashed and counted) and its typed form, as the engine gave it with the prefix
/// ([`crate::compact::Compacted::typed`]) and kept as long as the prefix that holds it
/// ([`WrittenReads`]). A turn adapter writes a rewritten block from it. A prefix restored from the
/// archive has only its texts: an entry is read from its text the first time an adapter asks.
#[derive(Clone, Copy)]
pub struct Written<'a> {
    pub text: &'a str,
    read: &'a OnceLock<Option<Box<Message>>>,
}

impl std::fmt::Debug for Written<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Written").field(&self.text).finish()
    }
}

impl<'a> Written<'a> {
    /// The message: as the engine gave it, else read from the text the first time it is asked for.
    pub fn message(&self) -> Result<&'a Message, WireError> {
        self.read
            .get_or_init(|| Message::from_raw(self.text).ok().map(Box::new))
            .as_deref()
            .ok_or_else(|| WireError::Unwritable("a forwarded message pare wrote is not a neutral message".into()))
    }
}

/// The typed forms of a forwarded prefix's entries ([`Written`]), one slot per entry: filled with
/// what the engine gave, or the first time an adapter asks for an entry the engine did not type.
#[derive(Debug, Clone, Default)]
pub struct WrittenReads(Box<[OnceLock<Option<Box<Message>>>]>);

impl WrittenReads {
    /// Empty slots for a prefix of `n` entries.
    pub fn new(n: usize) -> WrittenReads {
        WrittenReads((0..n).map(|_| OnceLock::new()).collect())
    }

    /// The slots of a prefix whose entries the engine typed as `typed` (`None`: an entry kept as
    /// sent, read if an adapter ever asks).
    pub fn of(typed: Vec<Option<Box<Message>>>) -> WrittenReads {
        WrittenReads(typed.into_iter().map(|t| t.map_or_else(OnceLock::new, |m| OnceLock::from(Some(m)))).collect())
    }

    /// Entry `at`'s message, when it is typed already.
    pub fn typed(&self, at: usize) -> Option<&Message> {
        self.0.get(at)?.get()?.as_deref()
    }

    /// Entry `at` of the prefix, whose text is `text`, as written for an adapter.
    pub fn written<'a>(&'a self, at: usize, text: &'a str) -> Written<'a> {
        Written { text, read: &self.0[at] }
    }

    /// Bytes allocated for the slots and the messages they hold (given by the engine or read since),
    /// each counted as the length of its text (which its fields hold) plus the message itself;
    /// `text_len(at)` is entry `at`'s text length, asked only of the entries held.
    pub fn bytes(&self, text_len: impl Fn(usize) -> usize) -> usize {
        let read = (self.0.iter().enumerate())
            .filter(|(_, slot)| slot.get().is_some_and(Option::is_some))
            .map(|(at, _)| text_len(at) + size_of::<Message>())
            .sum::<usize>();
        size_of_val(&*self.0) + read
    }
}

impl<'a> Forward<'a> {
    /// The forwarded conversation of a request of `n_raw` neutral messages: a prefix whose entries
    /// are `prefix` (their typed forms in `reads`), written from `plan` (what became of the
    /// request's first `plan.len()` messages), then the request's messages after those as sent. An
    /// entry no fate names is one pare wrote.
    pub fn of_plan(
        plan: &[crate::compact::Fate],
        prefix: impl IntoIterator<Item = &'a str>,
        reads: &'a WrittenReads,
        n_raw: usize,
    ) -> Vec<Forward<'a>> {
        use crate::compact::Fate;
        let prefix = prefix.into_iter();
        let mut out: Vec<Forward<'a>> = Vec::with_capacity(prefix.size_hint().0 + n_raw.saturating_sub(plan.len()));
        out.extend(prefix.enumerate().map(|(at, text)| Forward::New(reads.written(at, text))));
        for (idx, fate) in plan.iter().enumerate() {
            match *fate {
                Fate::Kept { at } => {
                    if let Some(slot) = out.get_mut(at) {
                        *slot = Forward::Kept(idx);
                    }
                }
                Fate::Rewritten { at, .. } => {
                    if let Some(slot) = out.get_mut(at)
                        && let Forward::New(written) = *slot
                    {
                        *slot = Forward::Rewritten(idx, written);
                    }
                }
                Fate::Elided { .. } | Fate::Dropped { .. } => {}
            }
        }
        out.extend((plan.len()..n_raw).map(Forward::Kept));
        out
    }

    /// The request's own `n` neutral messages forwarded as they are.
    pub fn unchanged(n: usize) -> Vec<Forward<'static>> {
        (0..n).map(Forward::Kept).collect()
    }

    /// The entry's neutral text, given the request's own neutral messages; `None` when it names
    /// one the request does not have.
    pub fn text<'b>(&self, neutral: &[&'b str]) -> Option<&'b str>
    where
        'a: 'b,
    {
        match *self {
            Forward::Kept(idx) => neutral.get(idx).copied(),
            Forward::Rewritten(_, written) | Forward::New(written) => Some(written.text),
        }
    }
}

/// What each entry of a conversation put together by hand from a request's `neutral` messages
/// stands for, for tests: in order, an entry equal to one of them is that one kept; a tool result
/// or calling turn with one's ids, or an entry of one's role that carries no pare marker, is that
/// one rewritten; anything else is new. `reads` holds the typed forms (one slot per entry).
#[cfg(test)]
pub(crate) fn forward_by_hand<'a, N: AsRef<str>>(
    neutral: &[N],
    forwarded: &[&'a str],
    reads: &'a WrittenReads,
) -> Vec<Forward<'a>> {
    let ids = |m: &Message| -> Vec<String> {
        match &m.tool_call_id {
            Some(id) => vec![id.clone()],
            None => m.tool_calls.iter().flatten().map(|c| c.id.clone()).collect(),
        }
    };
    let mut cursor = 0;
    let mut out = Vec::with_capacity(forwarded.len());
    for (at, text) in forwarded.iter().enumerate() {
        let written = reads.written(at, text);
        if let Some(j) = (cursor..neutral.len()).find(|&j| neutral[j].as_ref() == *text) {
            out.push(Forward::Kept(j));
            cursor = j + 1;
            continue;
        }
        let Ok(message) = Message::from_raw(text) else {
            out.push(Forward::New(written));
            continue;
        };
        let same = (cursor..neutral.len()).find(|&j| {
            Message::from_raw(neutral[j].as_ref()).is_ok_and(|n| {
                n.role == message.role
                    && ids(&n) == ids(&message)
                    && (!ids(&n).is_empty() || !message.text().contains("[pare:"))
            })
        });
        match same {
            Some(j) => {
                out.push(Forward::Rewritten(j, written));
                cursor = j + 1;
            }
            None => out.push(Forward::New(written)),
        }
    }
    out
}

/// Every neutral entry `body` types ([`WireBody::typed`]) is typed as reading its text types it,
/// with its members where the text holds them: the adapter's two forms of an entry agree.
#[cfg(test)]
pub(crate) fn assert_typed_as_read(body: &dyn WireBody) {
    for (i, text) in body.messages().into_iter().enumerate() {
        let Some((message, members)) = body.typed(i) else { continue };
        let (read, read_members) = Message::read(text);
        assert_eq!(message, read.ok(), "entry {i} is typed otherwise than its text reads: {text}");
        let members: Option<Vec<(&str, &str)>> =
            members.map(|members| members.into_iter().map(|(key, at)| (key, &text[at])).collect());
        assert_eq!(members, read_members.or_else(|| crate::neutral::raw_members(text)), "entry {i}'s members: {text}");
    }
}

/// [`WireBody::write`] of a conversation put together by hand from `body`'s neutral messages, for
/// tests ([`forward_by_hand`]).
#[cfg(test)]
pub(crate) fn write_by_hand(body: &dyn WireBody, messages: &[&str]) -> Result<(Vec<u8>, Spans), WireError> {
    let reads = WrittenReads::new(messages.len());
    body.write(&forward_by_hand(&body.messages(), messages, &reads))
}

/// What one neutral message stands for in a turn adapter (Messages, Gemini).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Unit {
    /// The whole turn: an assistant (model) turn, a user turn with string content, an opaque turn.
    Turn(usize),
    /// One tool result part of a user turn (`tool_result`, `functionResponse`).
    Result { turn: usize, part: usize },
    /// A user turn's parts other than its results: what the person wrote.
    UserParts(usize),
}

impl Unit {
    pub(crate) fn turn(self) -> usize {
        match self {
            Unit::Turn(t) | Unit::UserParts(t) | Unit::Result { turn: t, .. } => t,
        }
    }
}

/// What a forwarded entry stands for in a turn adapter (Messages, Gemini): one of the body's units
/// left alone, one the engine rewrote (a shorter result, shorter arguments), or one it wrote (an
/// elision marker).
pub(crate) enum Traced<'a> {
    Kept(Unit),
    Rewritten(Unit, &'a Message),
    New(&'a Message),
}

/// The `forwarded` entries after the system prompt traced back to a turn adapter's `units`: one
/// unit per neutral message from index `first` on (before it, the system prompt, which must be
/// kept: `changed` says what the error names). An entry kept is its unit as sent; one rewritten is
/// its unit with the entry's changes; a new one is written as a turn of its own.
pub(crate) fn trace_units<'a>(
    units: &[Unit],
    first: usize,
    forwarded: &[Forward<'a>],
    changed: &str,
) -> Result<Vec<Traced<'a>>, WireError> {
    if first > 0 && !matches!(forwarded.first(), Some(Forward::Kept(0))) {
        return Err(WireError::Unwritable(format!("the {changed} was changed")));
    }
    let unit = |idx: usize| {
        idx.checked_sub(first).and_then(|n| units.get(n).copied()).ok_or_else(|| {
            WireError::Unwritable(format!("a forwarded message stands for message {idx}, not one of the request's"))
        })
    };
    forwarded
        .iter()
        .skip(first)
        .map(|entry| {
            Ok(match *entry {
                Forward::Kept(idx) => Traced::Kept(unit(idx)?),
                Forward::Rewritten(idx, written) => Traced::Rewritten(unit(idx)?, written.message()?),
                Forward::New(written) => Traced::New(written.message()?),
            })
        })
        .collect()
}

/// Each of `written`, a body's conversation elements as an adapter writes them (its own, borrowed
/// in place, or new text), read by `read`, taking `reads` (the body's own reads of its `elements`)
/// for each element written as it is, with that element's index: the writer's check reads only
/// what it wrote anew.
pub(crate) fn reuse_reads<'b, T: Clone>(
    written: &'b [Cow<'b, str>],
    elements: &[&'b str],
    reads: &'b [T],
    read: impl Fn(&'b str) -> T,
) -> Vec<(Option<usize>, Cow<'b, T>)> {
    written
        .iter()
        .map(|text| {
            // The elements lie in the body in order: one written as it is has its address.
            let at = elements.binary_search_by_key(&(text.as_ptr() as usize), |e| e.as_ptr() as usize);
            match (text, at) {
                (Cow::Borrowed(own), Ok(k)) if elements[k].len() == own.len() && k < reads.len() => {
                    (Some(k), Cow::Borrowed(&reads[k]))
                }
                _ => (None, Cow::Owned(read(text))),
            }
        })
        .collect()
}

/// A chat message's content as text, for the converters: the string, or the parts' `text` joined
/// by newlines (other parts left out).
pub(crate) fn chat_text(content: Option<&serde_json::Value>) -> String {
    match content {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(serde_json::Value::as_str))
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// Read `bytes` as a request of format `wire` (a Gemini request read without its path: no model,
/// not streamed).
pub fn parse(wire: Wire, bytes: &[u8]) -> Result<Box<dyn WireBody + '_>, WireError> {
    parse_resumed(wire, "", bytes, None)
}

/// [`parse`] for a request sent to `path`: a Gemini request names its model and whether it streams
/// there ([`gemini::Call::of_path`]); the other formats say both in the body.
pub fn parse_at<'a>(wire: Wire, path: &str, bytes: &'a [u8]) -> Result<Box<dyn WireBody + 'a>, WireError> {
    parse_resumed(wire, path, bytes, None)
}

/// [`parse_at`], its scan starting again after `resume` ([`Split::parse_resumed`]).
fn parse_resumed<'a>(
    wire: Wire,
    path: &str,
    bytes: &'a [u8],
    resume: Option<&crate::neutral::scan::Resume<'_>>,
) -> Result<Box<dyn WireBody + 'a>, WireError> {
    Ok(match wire {
        Wire::Chat => Box::new(ChatBody::parse_resumed(bytes, resume)?),
        Wire::Responses => Box::new(responses::ResponsesBody::parse_resumed(bytes, resume)?),
        Wire::Messages => Box::new(messages::MessagesBody::parse_resumed(bytes, resume)?),
        Wire::Gemini => Box::new(gemini::GeminiBody::parse_resumed(bytes, gemini::Call::of_path(path), resume)?),
    })
}

/// Why a body is not a request pare can compact (it is then forwarded unchanged), or why the
/// forwarded conversation has no valid form in the body's format (the original body is forwarded).
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The written conversation breaks its format's rules.
    #[error(transparent)]
    Invalid(#[from] Invalid),
    /// The forwarded conversation has no form in the format (a changed system prompt, a call whose
    /// input lost keys, a message with nothing to stand for).
    #[error("{0}")]
    Unwritable(String),
    #[error("body is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("body has no `{0}` array")]
    NoArray(&'static str),
}

/// Why a conversation breaks its format's rules ([`WireBody::check`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Invalid {
    /// Its neutral view breaks the pairing every format shares; `origin` is where the offending
    /// neutral message comes from in the body (none for Chat Completions, whose messages are the
    /// neutral ones).
    #[error("{}{violation}", origin.map(|o| format!("{o}: ")).unwrap_or_default())]
    Pairing { violation: Violation, origin: Option<Origin> },
    #[error(transparent)]
    Responses(#[from] responses::Structure),
    #[error(transparent)]
    Messages(#[from] messages::Structure),
    #[error(transparent)]
    Gemini(#[from] gemini::Structure),
}

/// Where a neutral message comes from in a wire body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// The system prompt (`instructions`, `system`, `systemInstruction`).
    System,
    /// An input item (Responses), by index.
    Item(usize),
    /// A turn (Messages, Gemini), by index.
    Turn(usize),
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Origin::System => f.write_str("the system prompt"),
            Origin::Item(idx) => write!(f, "item {idx}"),
            Origin::Turn(idx) => write!(f, "turn {idx}"),
        }
    }
}

/// The pairing check ([`crate::compact::validate::check`]) over a body's neutral view, given as
/// the skeleton of each neutral message and, at the same index, where it comes from.
pub(crate) fn check_pairing(skeletons: &[Option<Skeleton>], origins: &[Origin]) -> Result<(), Invalid> {
    crate::compact::validate::check(skeletons).map_err(|violation| {
        let origin = origins.get(violation.message_idx()).copied();
        Invalid::Pairing { violation, origin }
    })
}

/// The skeleton of a neutral message pare builds from a wire body (what [`Skeleton::of`] reads
/// from its JSON text).
pub(crate) fn skeleton(role: &str, tool_calls: Vec<String>, tool_call_id: Option<&str>) -> Option<Skeleton> {
    Some(Skeleton { role: role.to_owned(), tool_calls, tool_call_id: tool_call_id.map(str::to_owned) })
}

/// `text` as a JSON string literal.
pub(crate) fn json_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    crate::neutral::push_json_string(&mut out, text);
    out
}

/// `object` (a JSON object's text) with the value of `key` replaced by `value` (raw JSON); every other
/// member keeps its bytes. `None` when the text is not an object pare can split. The adapters write
/// rewritten items and blocks with it. `known` is the value being replaced as the adapter's parse of
/// `object` found it, when it has it: it is not scanned again
/// ([`crate::neutral::raw_members_around`]), so replacing a large tool output costs its object's
/// other members only — on every request that forwards the rewritten entry again.
pub(crate) fn replace_member(object: &str, key: &str, known: Option<&str>, value: &str) -> Option<String> {
    let members = crate::neutral::raw_members_around(object, known)?;
    let mut out = String::with_capacity(object.len());
    out.push('{');
    for (n, (k, v)) in members.iter().enumerate() {
        if n > 0 {
            out.push(',');
        }
        crate::neutral::push_json_string(&mut out, k);
        out.push(':');
        out.push_str(if *k == key { value } else { v });
    }
    out.push('}');
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compact::Fate;
    use crate::compact::report::RuleSet;
    use crate::neutral::role_of;

    #[test]
    fn a_plan_forwards_each_entry_as_what_it_stands_for() {
        // Raw 0 kept, 1 rewritten, 2–3 elided behind a marker, 4 dropped; raw 5–6 after the prefix.
        let rules = RuleSet::default();
        let plan = [
            Fate::Kept { at: 0 },
            Fate::Rewritten { at: 1, rules },
            Fate::Elided { at: 2 },
            Fate::Elided { at: 2 },
            Fate::Dropped { rules },
        ];
        let prefix = [r#"{"role":"user","content":"a"}"#, r#"{"role":"tool","tool_call_id":"c","content":"b"}"#, "{}"];
        let reads = WrittenReads::new(prefix.len());
        let forwarded = Forward::of_plan(&plan, prefix, &reads, 7);
        let shape: Vec<String> = forwarded
            .iter()
            .map(|f| match f {
                Forward::Kept(i) => format!("kept {i}"),
                Forward::Rewritten(i, w) => format!("rewritten {i} as {}", w.text),
                Forward::New(w) => format!("new {}", w.text),
            })
            .collect();
        assert_eq!(shape, ["kept 0", &format!("rewritten 1 as {}", prefix[1]), "new {}", "kept 5", "kept 6"]);
        assert_eq!(forwarded[2].text(&[]), Some("{}"));
        assert_eq!(forwarded[3].text(&["a", "b"]), None, "a kept entry names a message the request lacks");
    }

    #[test]
    fn a_check_reads_again_only_what_the_writer_wrote_anew() {
        let body = r#"[{"a":1},{"b":2},{"c":3}]"#;
        let elements = [&body[1..8], &body[9..16], &body[17..24]];
        let reads: Vec<String> = elements.iter().map(|e| format!("read {e}")).collect();
        let calls = std::cell::Cell::new(0);
        let read = |text: &str| {
            calls.set(calls.get() + 1);
            format!("read again {text}")
        };
        // Element 1 as it is, a new text equal to element 0, element 2, and a part of element 2.
        let written = [
            Cow::Borrowed(elements[1]),
            Cow::Owned(elements[0].to_owned()),
            Cow::Borrowed(elements[2]),
            Cow::Borrowed(&elements[2][..4]),
        ];
        let got = reuse_reads(&written, &elements, &reads, read);
        assert!(matches!(&got[0], (Some(1), Cow::Borrowed(r)) if std::ptr::eq(*r, &reads[1])));
        assert_eq!(got[1], (None, Cow::Owned(r#"read again {"a":1}"#.to_owned())));
        assert!(matches!(&got[2], (Some(2), Cow::Borrowed(r)) if std::ptr::eq(*r, &reads[2])));
        assert_eq!(got[3], (None, Cow::Owned(r#"read again {"c""#.to_owned())));
        assert_eq!(calls.get(), 2);
    }

    #[test]
    fn a_written_entry_is_read_once_and_an_unreadable_one_is_unwritable() {
        let prefix = [r#"{"role":"tool","tool_call_id":"c","content":"short"}"#, "[1]"];
        let reads = WrittenReads::new(prefix.len());
        let written = reads.written(0, prefix[0]);
        let first = written.message().unwrap();
        assert_eq!(first.tool_call_id.as_deref(), Some("c"));
        assert!(std::ptr::eq(first, reads.written(0, prefix[0]).message().unwrap()), "read once, kept");
        assert!(matches!(reads.written(1, prefix[1]).message(), Err(WireError::Unwritable(_))));
    }

    #[test]
    fn role_is_read_alone_and_defaults_to_empty() {
        assert_eq!(role_of(r#"{"content":"x","role":"tool","tool_call_id":"c"}"#), "tool");
        assert_eq!(role_of(r#"{"role":"us\u0065r"}"#), "user");
        assert_eq!(role_of(r#"{"content":"no role"}"#), "");
        assert_eq!(role_of("[1,2]"), "");
    }
}
