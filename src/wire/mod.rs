//! The wire formats pare reads, one adapter each, onto pare's neutral conversation
//! ([`crate::neutral`]).
//!
//! An adapter parses a request body once into a [`WireBody`]: the conversation as neutral messages
//! (what the session tracker, the budget and the engine read), the tool definitions (counted, never
//! touched), and whatever else the request says that pare needs (model, stream, output limit). Given
//! the forwarded conversation, it writes the forwarded body back: top-level keys keep their order
//! and bytes, and every part the engine left alone is written as its original bytes.
//!
//! - [`ChatBody`] (this file): Chat Completions. Its `messages` are already the neutral form, so the
//!   adapter copies nothing; the body's split is the fast scan of `neutral::scan`.
//! - [`responses`]: the OpenAI Responses API (`input` items, `instructions`).
//! - [`messages`]: the Anthropic Messages API (`system`, `messages` turns of content blocks).
//! - [`gemini`]: the Gemini API (`systemInstruction`, `contents` turns of parts; the model in the path).
//!
//! [`recent::RecentBodies`] lets the proxy scan a chat body only after the messages it shares with
//! a recent body it extends.
//!
//! Every format checks what it writes the same way ([`WireBody::check`]): the pairing of its
//! neutral view through the one pairing validator, [`crate::compact::validate`], then the rules of
//! its own that the neutral form cannot express, each a variant of its `Structure` error. Both
//! are an [`Invalid`].
//!
//! A new format is one file with a type implementing [`WireBody`], a variant of [`Wire`] and its
//! arm in [`parse`] (and of [`Invalid`] when it has rules of its own).

pub mod convert;
pub mod gemini;
pub mod messages;
pub mod recent;
pub mod responses;

use serde_json::value::RawValue;

use crate::compact::validate::{Skeleton, Violation};
use crate::neutral::scan;

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
    /// The body's top level as read around its conversation array (every format keeps its other
    /// top-level keys this way).
    fn top(&self) -> &ChatBody<'_>;
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
    /// The body to forward with `messages` (neutral, the forwarded conversation) in place of the
    /// conversation, and where its values lie; `sources` says, one per message, what each stands for
    /// among the request's own neutral messages (the engine's plan, [`Source::of_plan`]), so that
    /// each is written from the parts it came from. `Err` when the conversation cannot be written
    /// validly in this format: the caller forwards the original body.
    fn write(&self, messages: &[&str], sources: &[Source]) -> Result<(Vec<u8>, Spans), WireError>;
    /// Where this body's values lie in `body`, the bytes it was parsed from (for the archive).
    fn spans_in(&self, body: &[u8]) -> Option<Spans>;
    /// The format's rules over the body, as its writer checks what it writes: the pairing of its
    /// neutral view ([`crate::compact::validate`]: a tool call answered by its result, no result
    /// without its call…), then the format's own rules the neutral form cannot express. Used by
    /// eval and the tests.
    fn check(&self) -> Result<(), Invalid>;
}

/// What one entry of a forwarded conversation stands for among the request's own neutral messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The request's neutral message `i`, forwarded as it is.
    Kept(usize),
    /// The request's neutral message `i`, rewritten into the entry.
    Rewritten(usize),
    /// An entry pare wrote (an elision marker): no part of the request.
    New,
}

impl Source {
    /// The sources of a conversation of `n_raw` neutral messages forwarded as a prefix of
    /// `n_prefix` entries written from `plan` (what became of its first `plan.len()` messages), then
    /// its messages after those as sent.
    pub fn of_plan(plan: &[crate::compact::Fate], n_prefix: usize, n_raw: usize) -> Vec<Source> {
        use crate::compact::Fate;
        let mut sources = vec![Source::New; n_prefix];
        for (idx, fate) in plan.iter().enumerate() {
            let source = match *fate {
                Fate::Kept { at } => (at, Source::Kept(idx)),
                Fate::Rewritten { at, .. } => (at, Source::Rewritten(idx)),
                Fate::Elided { .. } | Fate::Dropped { .. } => continue,
            };
            if let Some(slot) = sources.get_mut(source.0) {
                *slot = source.1;
            }
        }
        sources.extend((plan.len()..n_raw).map(Source::Kept));
        sources
    }

    /// The sources of the request's own neutral messages forwarded as they are.
    pub fn unchanged(n: usize) -> Vec<Source> {
        (0..n).map(Source::Kept).collect()
    }
}

/// The sources of a conversation put together by hand from a request's `neutral` messages, for
/// tests: in order, an entry equal to one of them is that one kept; a tool result or calling turn
/// with one's ids, or an entry of one's role that carries no pare marker, is that one rewritten;
/// anything else is new.
#[cfg(test)]
pub(crate) fn sources_by_hand<N: AsRef<str>>(neutral: &[N], forwarded: &[&str]) -> Vec<Source> {
    use crate::neutral::Message;
    let ids = |m: &Message| -> Vec<String> {
        match &m.tool_call_id {
            Some(id) => vec![id.clone()],
            None => m.tool_calls.iter().flatten().map(|c| c.id.clone()).collect(),
        }
    };
    let mut cursor = 0;
    let mut out = Vec::with_capacity(forwarded.len());
    for text in forwarded {
        if let Some(j) = (cursor..neutral.len()).find(|&j| neutral[j].as_ref() == *text) {
            out.push(Source::Kept(j));
            cursor = j + 1;
            continue;
        }
        let Ok(message) = Message::from_raw(text) else {
            out.push(Source::New);
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
                out.push(Source::Rewritten(j));
                cursor = j + 1;
            }
            None => out.push(Source::New),
        }
    }
    out
}

/// [`WireBody::write`] of a conversation put together by hand from `body`'s neutral messages, for
/// tests ([`sources_by_hand`]).
#[cfg(test)]
pub(crate) fn write_by_hand(body: &dyn WireBody, messages: &[&str]) -> Result<(Vec<u8>, Spans), WireError> {
    let neutral = body.messages();
    body.write(messages, &sources_by_hand(&neutral, messages))
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

/// What a forwarded neutral message stands for in a turn adapter (Messages, Gemini): one of the
/// body's units left alone, one the engine rewrote (a shorter result, shorter arguments), or one it
/// wrote (an elision marker).
pub(crate) enum Forwarded {
    Kept(Unit),
    Rewritten(Unit, crate::neutral::Message),
    New(crate::neutral::Message),
}

/// The forwarded neutral `messages` traced back to a turn adapter's `units` by their `sources`.
/// `neutral` are the body's own neutral messages, one per unit from index `first` on (before it,
/// the system prompt). An entry kept is its unit as sent; one rewritten is its unit with the
/// entry's changes; a new one is written as a turn of its own.
pub(crate) fn trace_units(
    units: &[Unit],
    neutral: &[String],
    first: usize,
    messages: &[&str],
    sources: &[Source],
) -> Result<Vec<Forwarded>, WireError> {
    if sources.len() != messages.len() {
        return Err(WireError::Unwritable(format!("{} sources for {} messages", sources.len(), messages.len())));
    }
    let unit = |idx: usize| {
        idx.checked_sub(first).and_then(|n| units.get(n).copied()).ok_or_else(|| {
            WireError::Unwritable(format!("a forwarded message stands for message {idx}, not one of the request's"))
        })
    };
    let read = |text: &str| {
        crate::neutral::Message::from_raw(text).map_err(|e| WireError::Unwritable(format!("forwarded message: {e}")))
    };
    let mut out = Vec::with_capacity(messages.len());
    for (text, source) in messages.iter().zip(sources).skip(first) {
        out.push(match *source {
            Source::Kept(idx) if neutral.get(idx).is_some_and(|n| n == text) => Forwarded::Kept(unit(idx)?),
            Source::Kept(idx) | Source::Rewritten(idx) => Forwarded::Rewritten(unit(idx)?, read(text)?),
            Source::New => Forwarded::New(read(text)?),
        });
    }
    Ok(out)
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

/// Read `bytes` as a request of format `wire`.
pub fn parse(wire: Wire, bytes: &[u8]) -> Result<Box<dyn WireBody + '_>, WireError> {
    Ok(match wire {
        Wire::Chat => Box::new(ChatBody::parse(bytes)?),
        Wire::Responses => Box::new(responses::ResponsesBody::parse(bytes)?),
        Wire::Messages => Box::new(messages::MessagesBody::parse(bytes)?),
        Wire::Gemini => Box::new(gemini::GeminiBody::parse(bytes)?),
    })
}

/// [`parse`] for a request sent to `path`: a Gemini request names its model and whether it streams
/// there ([`gemini::Call::of_path`]); the other formats say both in the body.
pub fn parse_at<'a>(wire: Wire, path: &str, bytes: &'a [u8]) -> Result<Box<dyn WireBody + 'a>, WireError> {
    match wire {
        Wire::Gemini => Ok(Box::new(gemini::GeminiBody::parse_at(bytes, gemini::Call::of_path(path))?)),
        _ => parse(wire, bytes),
    }
}

impl WireBody for ChatBody<'_> {
    fn wire(&self) -> Wire {
        Wire::Chat
    }
    fn messages(&self) -> Vec<&str> {
        self.messages.clone()
    }
    fn top(&self) -> &ChatBody<'_> {
        self
    }
    fn output_limit(&self) -> Option<u64> {
        ["max_completion_tokens", "max_tokens"]
            .iter()
            .find_map(|key| self.field(key).and_then(|v| serde_json::from_str::<u64>(v.get()).ok()))
    }
    fn write(&self, messages: &[&str], _sources: &[Source]) -> Result<(Vec<u8>, Spans), WireError> {
        Ok(self.to_vec_and_spans(messages))
    }
    fn spans_in(&self, body: &[u8]) -> Option<Spans> {
        ChatBody::spans_in(self, body)
    }
    fn check(&self) -> Result<(), Invalid> {
        crate::compact::validate::check_messages(&self.messages)
            .map_err(|violation| Invalid::Pairing { violation, origin: None })
    }
}

/// A request body parsed shallowly around its conversation array: `messages` for Chat Completions
/// (its elements are then the neutral messages themselves), `input` for the Responses API.
#[derive(Debug)]
pub struct ChatBody<'a> {
    /// The key of the conversation array (`messages`, `input`).
    pub key: &'static str,
    /// Top-level keys other than `messages`, in their original order, each with its original bytes.
    pub fields: Vec<(String, &'a RawValue)>,
    /// Position of the `messages` key among the top-level keys: it comes before `fields[messages_idx]`
    /// (after the last field when `messages_idx == fields.len()`).
    pub messages_idx: usize,
    /// The `messages` array as it is in the body, brackets and whitespace inside included (the
    /// archive stores the bytes between messages).
    pub messages_raw: &'a str,
    /// The `messages` array, one message per entry as its original JSON text (checked to be valid
    /// JSON, not necessarily an object), in order.
    pub messages: Vec<&'a str>,
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
    NoMessages(&'static str),
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

impl<'a> ChatBody<'a> {
    /// Parse the top level and split `messages` into raw messages, checking that the whole body is
    /// valid JSON but building no value inside a message. A repeated key keeps its first position and
    /// its last value (as a JSON object map does); a `messages` that is not an array is refused.
    ///
    /// A body is read by the fast scan of [`scan`] when it can; whatever the scan declines (invalid
    /// JSON included) is parsed by serde_json, which also words the error.
    pub fn parse(bytes: &'a [u8]) -> Result<ChatBody<'a>, WireError> {
        Self::parse_keyed(bytes, "messages")
    }

    /// [`ChatBody::parse`] around the array under `key` instead of `messages`.
    pub fn parse_keyed(bytes: &'a [u8], key: &'static str) -> Result<ChatBody<'a>, WireError> {
        Self::parse_resumed(bytes, key, None)
    }

    /// [`ChatBody::parse_keyed`] whose scan starts again after `resume` (see [`scan::split_resumed`]
    /// for what the caller vouches for).
    pub(crate) fn parse_resumed(
        bytes: &'a [u8],
        key: &'static str,
        resume: Option<&scan::Resume<'_>>,
    ) -> Result<ChatBody<'a>, WireError> {
        if let Some(body) = Self::from_scan(bytes, key, resume) {
            return Ok(body);
        }
        // The array's elements are read in a second pass over its bytes: this path is for bodies the
        // scan declines, which are rare and small.
        let top: TopLevel<'a> = TopLevel::parse(bytes, key)?;
        let (messages_idx, messages_raw, messages) = top.messages().ok_or(WireError::NoMessages(key))?;
        let messages = messages.into_iter().map(RawValue::get).collect();
        Ok(ChatBody {
            key,
            fields: top.fields.into_iter().collect(),
            messages_idx,
            messages_raw: messages_raw.get(),
            messages,
        })
    }

    /// The fast path: the scan's split, with the (few, small) top-level values handed to serde_json
    /// as raw values.
    fn from_scan(bytes: &'a [u8], key: &'static str, resume: Option<&scan::Resume<'_>>) -> Option<ChatBody<'a>> {
        let split = scan::split_resumed(bytes, key, resume)?;
        let fields = split
            .fields
            .into_iter()
            .map(|(key, value)| Some((key.into_owned(), serde_json::from_str::<&'a RawValue>(value).ok()?)))
            .collect::<Option<Vec<_>>>()?;
        Some(ChatBody {
            key,
            fields,
            messages_idx: split.messages_idx,
            messages_raw: split.messages_raw,
            messages: split.messages,
        })
    }

    /// The request as the engine reads it: its messages are already the neutral form.
    pub fn view(&self) -> crate::neutral::View<'_> {
        crate::neutral::View { messages: &self.messages, tools: WireBody::tools(self) }
    }

    /// The raw value of a top-level key.
    pub fn field(&self, key: &str) -> Option<&'a RawValue> {
        self.fields.iter().find(|(k, _)| k == key).map(|(_, v)| *v)
    }

    /// The request's `model`, when it is a string.
    pub fn model(&self) -> Option<String> {
        self.field("model").and_then(|v| serde_json::from_str::<String>(v.get()).ok())
    }

    /// Serialize the body with `messages` replaced; every other key keeps its position and bytes.
    pub fn to_vec_with_messages<M: AsRef<str>>(&self, messages: &[M]) -> Vec<u8> {
        self.to_vec_and_spans(messages).0
    }

    /// [`ChatBody::to_vec_with_messages`], and where in the bytes written each value lies (what a
    /// parse of them would find, without the parse).
    pub fn to_vec_and_spans<M: AsRef<str>>(&self, messages: &[M]) -> (Vec<u8>, Spans) {
        let fields_len: usize = self.fields.iter().map(|(k, v)| k.len() + v.get().len() + 4).sum();
        let messages_len: usize = messages.iter().map(|m| m.as_ref().len() + 1).sum();
        let mut out = Vec::with_capacity(fields_len + messages_len + 16);
        let mut spans = Spans {
            fields: Vec::with_capacity(self.fields.len()),
            messages_array: (0, 0),
            messages: Vec::with_capacity(messages.len()),
        };
        out.push(b'{');
        let write_messages = |out: &mut Vec<u8>, spans: &mut Spans| {
            out.push(b'"');
            out.extend_from_slice(self.key.as_bytes());
            out.extend_from_slice(b"\":");
            let array_start = out.len();
            out.push(b'[');
            for (j, m) in messages.iter().enumerate() {
                if j > 0 {
                    out.push(b',');
                }
                let start = out.len();
                out.extend_from_slice(m.as_ref().as_bytes());
                spans.messages.push((start, out.len()));
            }
            out.push(b']');
            spans.messages_array = (array_start, out.len());
        };
        for (i, (key, value)) in self.fields.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            if i == self.messages_idx {
                write_messages(&mut out, &mut spans);
                out.push(b',');
            }
            serde_json::to_writer(&mut out, key).expect("writing a string to a Vec cannot fail");
            out.push(b':');
            let start = out.len();
            out.extend_from_slice(value.get().as_bytes());
            spans.fields.push((start, out.len()));
        }
        if self.messages_idx >= self.fields.len() {
            if !self.fields.is_empty() {
                out.push(b',');
            }
            write_messages(&mut out, &mut spans);
        }
        out.push(b'}');
        (out, spans)
    }

    /// The body written with its own conversation array, as its original bytes (the whitespace
    /// between elements included), and where its values lie.
    pub fn to_vec_and_spans_keeping_array(&self) -> (Vec<u8>, Spans) {
        let (mut out, mut spans) = self.to_vec_and_spans(&[""]);
        let (start, end) = spans.messages_array;
        out.splice(start..end, self.messages_raw.bytes());
        let shift = |at: usize| if at >= end { at + self.messages_raw.len() - (end - start) } else { at };
        spans.fields = spans.fields.iter().map(|&(a, b)| (shift(a), shift(b))).collect();
        spans.messages_array = (start, start + self.messages_raw.len());
        let base = self.messages_raw.as_ptr() as usize;
        spans.messages = self
            .messages
            .iter()
            .map(|m| (start + (m.as_ptr() as usize - base), start + (m.as_ptr() as usize - base) + m.len()))
            .collect();
        (out, spans)
    }

    /// Where this body's values lie in `body`, the bytes it was parsed from (`None` for other bytes).
    pub fn spans_in(&self, body: &[u8]) -> Option<Spans> {
        let span = |inner: &str| {
            let start = (inner.as_ptr() as usize).checked_sub(body.as_ptr() as usize)?;
            (start + inner.len() <= body.len()).then_some((start, start + inner.len()))
        };
        Some(Spans {
            fields: self.fields.iter().map(|(_, v)| span(v.get())).collect::<Option<_>>()?,
            messages_array: span(self.messages_raw)?,
            messages: self.messages.iter().map(|m| span(m)).collect::<Option<_>>()?,
        })
    }
}

/// Where a body's values lie, as byte ranges (start, end) into it: each top-level value other than
/// `messages` (in [`ChatBody::fields`] order), the `messages` array, and each message. What the
/// archive splits a body along ([`crate::archive::body::split_along`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spans {
    pub fields: Vec<(usize, usize)>,
    pub messages_array: (usize, usize),
    pub messages: Vec<(usize, usize)>,
}

/// The top level as serde_json reads it for [`ChatBody::parse`]: every key kept raw, the conversation
/// array's key apart.
pub(crate) struct TopLevel<'a> {
    pub(crate) fields: indexmap::IndexMap<String, &'a RawValue>,
    /// Position of the first `messages` key among the keys, and its last value.
    messages: Option<(usize, &'a RawValue)>,
}

impl<'a> TopLevel<'a> {
    /// Read `bytes` with serde_json, the array under `key` apart.
    pub(crate) fn parse(bytes: &'a [u8], key: &'static str) -> serde_json::Result<TopLevel<'a>> {
        let mut de = serde_json::Deserializer::from_slice(bytes);
        let top = serde::de::DeserializeSeed::deserialize(TopSeed(key, std::marker::PhantomData), &mut de)?;
        de.end()?;
        Ok(top)
    }

    /// The elements of `messages`, when it is an array.
    pub(crate) fn messages(&self) -> Option<(usize, &'a RawValue, Vec<&'a RawValue>)> {
        let (idx, raw) = self.messages?;
        if !raw.get().starts_with('[') {
            return None;
        }
        Some((idx, raw, serde_json::from_str(raw.get()).ok()?))
    }
}

/// Reads a [`TopLevel`] with the array under `.0` apart.
struct TopSeed<'a>(&'static str, std::marker::PhantomData<&'a ()>);

impl<'de: 'a, 'a> serde::de::DeserializeSeed<'de> for TopSeed<'a> {
    type Value = TopLevel<'a>;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<TopLevel<'a>, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de: 'a, 'a> serde::de::Visitor<'de> for TopSeed<'a> {
    type Value = TopLevel<'a>;
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<TopLevel<'a>, A::Error> {
        let mut top = TopLevel { fields: indexmap::IndexMap::new(), messages: None };
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            let value = map.next_value::<&'a RawValue>()?;
            if key == self.0 {
                let position = top.messages.map_or(top.fields.len(), |(p, _)| p);
                top.messages = Some((position, value));
            } else {
                top.fields.insert(key.into_owned(), value);
            }
        }
        Ok(top)
    }
}

/// `text` as a JSON string literal.
pub(crate) fn json_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    crate::neutral::push_json_string(&mut out, text);
    out
}

/// `object` (a JSON object's text) with the value of `key` replaced by `value` (raw JSON); every other
/// member keeps its bytes. `None` when the text is not an object pare can split. The adapters write
/// rewritten items and blocks with it.
pub(crate) fn replace_member(object: &str, key: &str, value: &str) -> Option<String> {
    let members = crate::neutral::raw_members(object)?;
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
    use crate::neutral::role_of;
    use serde_json::Value;

    #[test]
    fn untouched_top_level_keeps_order_and_bytes() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":0.50,"x":{"b":1,"a":2}}"#;
        let parsed = ChatBody::parse(body).unwrap();
        let msgs = parsed.messages.clone();
        assert_eq!(parsed.to_vec_with_messages(&msgs), body.to_vec());
    }

    /// The one-pass parse must agree with a JSON object map: a repeated key keeps its first position
    /// and its last value, `messages` included.
    #[test]
    fn repeated_keys_keep_first_position_and_last_value() {
        let body = br#"{"a":1,"messages":[{"role":"user"}],"b":2,"a":3,"messages":[{"role":"tool"},7]}"#;
        let parsed = ChatBody::parse(body).unwrap();
        let msgs = parsed.messages.clone();
        assert_eq!(msgs, vec![r#"{"role":"tool"}"#, "7"]);
        assert_eq!(
            String::from_utf8(parsed.to_vec_with_messages(&msgs)).unwrap(),
            r#"{"a":3,"messages":[{"role":"tool"},7],"b":2}"#
        );
        // The same reading as a generic JSON map gives.
        let map: indexmap::IndexMap<String, Value> = serde_json::from_slice(body).unwrap();
        assert_eq!(serde_json::to_string(&map).unwrap(), r#"{"a":3,"messages":[{"role":"tool"},7],"b":2}"#);
        // A later non-array `messages` wins and is refused; a later array makes an earlier odd one valid.
        assert!(matches!(ChatBody::parse(br#"{"messages":[],"messages":{"x":[1]}}"#), Err(WireError::NoMessages(_))));
        let parsed = ChatBody::parse(br#"{"messages":"x","m":null,"messages":[]}"#).unwrap();
        assert_eq!(parsed.to_vec_with_messages::<&str>(&[]), br#"{"messages":[],"m":null}"#.to_vec());
    }

    #[test]
    fn messages_first_last_or_alone_serialize_in_place() {
        for body in [
            r#"{"messages":[{"role":"user","content":"hi"}],"model":"m"}"#,
            r#"{"model":"m","stream":true,"messages":[]}"#,
            r#"{"messages":[1,2,3]}"#,
            r#"{"model":"m","messages":[{"role":"user"}],"tools":[{"type":"function"}],"n":1}"#,
        ] {
            let parsed = ChatBody::parse(body.as_bytes()).unwrap();
            let msgs = parsed.messages.clone();
            assert_eq!(String::from_utf8(parsed.to_vec_with_messages(&msgs)).unwrap(), body);
            assert_eq!(parsed.field("messages").map(|v| v.get()), None);
            // Where the writing put each value is where a parse of what it wrote finds it, also with
            // other messages than the parsed ones.
            for msgs in [msgs.clone(), vec![r#"{"role":"user","content":"new"}"#, "7"], Vec::new()] {
                let (bytes, spans) = parsed.to_vec_and_spans(&msgs);
                assert_eq!(bytes, parsed.to_vec_with_messages(&msgs));
                assert_eq!(ChatBody::parse(&bytes).unwrap().spans_in(&bytes), Some(spans), "{body}");
            }
            assert_eq!(parsed.spans_in(b"other bytes"), None);
        }
    }

    #[test]
    fn role_is_read_alone_and_defaults_to_empty() {
        assert_eq!(role_of(r#"{"content":"x","role":"tool","tool_call_id":"c"}"#), "tool");
        assert_eq!(role_of(r#"{"role":"us\u0065r"}"#), "user");
        assert_eq!(role_of(r#"{"content":"no role"}"#), "");
        assert_eq!(role_of("[1,2]"), "");
    }

    #[test]
    fn a_chat_body_checks_its_messages_with_the_pairing_validator() {
        let valid = br#"{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":null,"tool_calls":[{"id":"a","type":"function","function":{"name":"f","arguments":"{}"}}]},{"role":"tool","tool_call_id":"a","content":"x"}]}"#;
        assert_eq!(ChatBody::parse(valid).unwrap().check(), Ok(()));
        let orphan =
            br#"{"messages":[{"role":"user","content":"hi"},{"role":"tool","tool_call_id":"a","content":"x"}]}"#;
        let violation = Violation::OrphanResult { idx: 1, id: "a".into() };
        let refused = ChatBody::parse(orphan).unwrap().check().unwrap_err();
        // The messages are the neutral ones: the violation says where, no origin is added.
        assert_eq!(refused.to_string(), violation.to_string());
        assert_eq!(refused, Invalid::Pairing { violation, origin: None });
    }

    #[test]
    fn body_without_messages_is_refused() {
        assert!(matches!(ChatBody::parse(br#"{"model":"m"}"#), Err(WireError::NoMessages(_))));
        assert!(matches!(ChatBody::parse(b"{nope"), Err(WireError::Json(_))));
        assert!(matches!(ChatBody::parse(br#"{"messages":[1,]}"#), Err(WireError::Json(_))));
        assert!(matches!(ChatBody::parse(b"[1]"), Err(WireError::Json(_))));
        for not_array in [r#"null"#, r#"3"#, r#"-1.5"#, r#""s""#, r#"true"#, r#"{"a":[{}]}"#] {
            let body = format!(r#"{{"messages":{not_array},"model":"m"}}"#);
            assert!(matches!(ChatBody::parse(body.as_bytes()), Err(WireError::NoMessages(_))), "{not_array}");
        }
    }
}
