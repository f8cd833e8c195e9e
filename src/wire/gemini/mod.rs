//! The Gemini API (`POST …/models/{model}:generateContent` and `:streamGenerateContent`: Gemini
//! CLI, the `google-genai` SDKs) as a wire adapter.
//!
//! A request is `systemInstruction` (the system prompt) and `contents`: turns of role `user` or
//! `model`, each a list of `parts`. The model is named in the path, not the body, and so is
//! streaming ([`Call::of_path`]). The adapter reads the turns into neutral messages:
//!
//! | turn or part | neutral message |
//! |---|---|
//! | `systemInstruction` | the first `system` message, its `parts` as content (never touched: written back as its bytes) |
//! | a user turn's `functionResponse` parts | one `tool` message each (`content` the response's one string member, else its JSON text) |
//! | a user turn's other parts (`text`, `inlineData`, `fileData`, …) | one `user` message: what the person wrote, never touched |
//! | a model turn | one `assistant` message: its `text` parts as content parts, its `functionCall` parts as `tool_calls` (`arguments` = the JSON text of `args`) |
//! | `thought: true` parts, `inlineData`, `executableCode`, unknown parts in a model turn | none of their own: they stay in their turn byte for byte, and go only with the whole turn |
//! | a turn of another role, or one pare cannot read | an opaque entry (the turn as sent) the engine keeps in place |
//!
//! A call is paired with its response by `id` when both have one, else as the API pairs them: by
//! name, in order, within the user turn that follows the call's model turn. In the neutral form a
//! call is named `call_{k}` (its place among the turn's calls) whatever its `id`: the API's answer
//! carries none and Gemini CLI gives the call one of its own when it sends it back, and the session
//! tracker must find the answer's turn in the next request.
//!
//! A part that carries a `thoughtSignature` is never altered: a signed `functionCall` keeps its
//! `args` (Gemini 3 refuses a call whose signature does not match it) and a signed `text` keeps its
//! text; such parts go only with their whole turn.
//!
//! Writing back maps each forwarded neutral message to its parts: one the engine left alone is its
//! turn's original bytes; a rewritten result is its part with `response` replaced (`{key: text}`
//! for the response's one string member, `{"output": text}` otherwise; `id`, `name` and every other
//! key kept); a rewritten call turn has each unsigned call's `args` replaced (still an object with
//! the same keys); an elision marker becomes a user turn of one `text` part, never text in a model
//! turn (where signatures live) nor in the person's turn (what the person wrote stays as sent). A
//! turn whose parts are all gone is left out. The result is checked ([`check_turns`]): the neutral
//! view of the written turns passes the pairing check every format shares
//! ([`crate::compact::validate`]: every call answered in the next turn, no response without its
//! call), and the API's own rules hold ([`Structure`]: a calling model turn right after a user
//! turn…); otherwise the original body is forwarded.

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
use crate::neutral::{
    Arguments, Draft, DraftCall, Message, Typing, push_json_string, raw_members, raw_members_around,
    written_as_pare_writes,
};

/// What the path of a Gemini request says: the model, and whether the answer streams.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Call {
    /// The `{model}` of `…/models/{model}:method`.
    pub model: Option<String>,
    /// The method is `streamGenerateContent` (as SSE with `alt=sse`, else as a JSON array).
    pub stream: bool,
}

impl Call {
    /// Read `path` (without its query): `…/models/gemini-2.5-pro:streamGenerateContent` names model
    /// `gemini-2.5-pro` and a stream.
    pub fn of_path(path: &str) -> Call {
        let last = path.rsplit('/').next().unwrap_or("");
        let (model, method) = last.split_once(':').unwrap_or((last, ""));
        Call {
            model: (!model.is_empty() && matches!(method, "generateContent" | "streamGenerateContent"))
                .then(|| model.to_owned()),
            stream: method == "streamGenerateContent",
        }
    }

    /// Whether `path` is a Gemini content generation (`…/models/{m}:generateContent` or
    /// `:streamGenerateContent`, under `/v1beta/`, `/v1/` or a Vertex publisher path).
    pub fn is_generation(path: &str) -> bool {
        let Some((before, method)) = path.rsplit_once(':') else { return false };
        matches!(method, "generateContent" | "streamGenerateContent")
            && before.rsplit_once('/').is_some_and(|(dir, model)| !model.is_empty() && dir.ends_with("models"))
    }
}

/// What a part is to the adapter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Text,
    Call,
    Response,
    /// Thoughts, inline and file data, code execution, unknown parts.
    Other,
}

/// The keys of a part the adapter reads; everything else stays in the part's bytes.
#[derive(Deserialize, Default)]
struct PartHead<'a> {
    #[serde(borrow, default)]
    text: Option<&'a RawValue>,
    #[serde(borrow, default)]
    thought: Option<&'a RawValue>,
    #[serde(rename = "thoughtSignature", alias = "thought_signature", borrow, default)]
    thought_signature: Option<&'a RawValue>,
    #[serde(rename = "functionCall", alias = "function_call", borrow, default)]
    function_call: Option<&'a RawValue>,
    #[serde(rename = "functionResponse", alias = "function_response", borrow, default)]
    function_response: Option<&'a RawValue>,
}

/// The keys of a `functionCall` or `functionResponse` the adapter reads.
#[derive(Deserialize, Default)]
struct FunctionHead<'a> {
    #[serde(borrow, default)]
    id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    args: Option<&'a RawValue>,
    #[serde(borrow, default)]
    response: Option<&'a RawValue>,
}

/// One part, read.
#[derive(Debug, Clone)]
struct Part<'a> {
    raw: &'a str,
    kind: Kind,
    /// The part carries a `thoughtSignature`: it is never altered.
    signed: bool,
    /// A call's or response's own `id`.
    id: Option<String>,
    name: String,
    /// A call's `args` (`{}` when it has none).
    args: &'a str,
    /// A response's `response`.
    response: Option<&'a str>,
    /// The response's one member, as (key, value) sent, when it has exactly one and that is a
    /// string: the text the response stands for ([`response_text`]).
    response_member: Option<(&'a str, &'a str)>,
    /// The member (`functionCall`, `function_response`, …) that holds the call or response.
    function_raw: &'a str,
    /// A text part's `text`, as sent.
    text: Option<&'a str>,
}

impl<'a> Part<'a> {
    fn read(raw: &'a str) -> Part<'a> {
        let mut part = Part {
            raw,
            kind: Kind::Other,
            signed: false,
            id: None,
            name: String::new(),
            args: "{}",
            response: None,
            response_member: None,
            function_raw: "",
            text: None,
        };
        let Ok(head) = serde_json::from_str::<PartHead<'a>>(raw) else { return part };
        part.signed = head.thought_signature.is_some_and(|s| s.get() != "null");
        if head.thought.is_some_and(|t| t.get() == "true") {
            return part;
        }
        let function =
            head.function_call.map(|f| (Kind::Call, f)).or(head.function_response.map(|f| (Kind::Response, f)));
        if let Some((kind, function)) = function {
            let Ok(f) = serde_json::from_str::<FunctionHead<'a>>(function.get()) else { return part };
            let Some(name) = f.name else { return part };
            if kind == Kind::Call && f.args.is_some_and(|a| !a.get().starts_with('{')) {
                return part;
            }
            part.kind = kind;
            part.id = f.id.map(Cow::into_owned).filter(|id| !id.is_empty());
            part.name = name.into_owned();
            part.args = f.args.map_or("{}", RawValue::get);
            part.response = f.response.map(RawValue::get);
            part.response_member =
                part.response.and_then(raw_members).filter(|m| m.len() == 1 && m[0].1.starts_with('"')).map(|m| m[0]);
            part.function_raw = function.get();
        } else if let Some(text) = head.text.map(RawValue::get).filter(|t| t.starts_with('"')) {
            part.kind = Kind::Text;
            part.text = Some(text);
        }
        part
    }
}

/// The keys of a turn the adapter reads.
#[derive(Deserialize)]
struct TurnHead<'a> {
    #[serde(borrow, default)]
    role: Option<Cow<'a, str>>,
    #[serde(borrow)]
    parts: &'a RawValue,
}

/// Which side a turn speaks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    User,
    Model,
    /// Another role, or a turn pare cannot read.
    Opaque,
}

/// One turn of `contents`, read.
#[derive(Debug, Clone)]
struct Turn<'a> {
    raw: &'a str,
    /// The turn's `parts`, as sent.
    parts_raw: Option<&'a str>,
    side: Side,
    parts: Vec<Part<'a>>,
    /// The neutral id of each call part (by part index), and of each response part (its call's).
    ids: HashMap<usize, String>,
}

impl<'a> Turn<'a> {
    fn read(raw: &'a str) -> Turn<'a> {
        let opaque = || Turn { raw, parts_raw: None, side: Side::Opaque, parts: Vec::new(), ids: HashMap::new() };
        let Ok(head) = serde_json::from_str::<TurnHead<'a>>(raw) else { return opaque() };
        // An unset role is the user's (the API reads a lone turn so); `function` is the older name
        // of the turn that carries responses.
        let side = match head.role.as_deref().unwrap_or("user") {
            "user" | "function" | "" => Side::User,
            "model" => Side::Model,
            _ => return opaque(),
        };
        let Ok(list) = serde_json::from_str::<Vec<&'a RawValue>>(head.parts.get()) else { return opaque() };
        let parts: Vec<Part<'a>> = list.into_iter().map(|p| Part::read(p.get())).collect();
        let mut ids = HashMap::new();
        if side == Side::Model {
            let calls = parts.iter().enumerate().filter(|(_, p)| p.kind == Kind::Call);
            for (k, (p, _)) in calls.enumerate() {
                ids.insert(p, format!("call_{k}"));
            }
        }
        Turn { raw, parts_raw: Some(head.parts.get()), side, parts, ids }
    }

    /// Indices of the call parts.
    fn calls(&self) -> impl Iterator<Item = usize> + '_ {
        self.parts.iter().enumerate().filter(|(_, p)| p.kind == Kind::Call).map(|(p, _)| p)
    }

    /// Indices of the response parts.
    fn responses(&self) -> impl Iterator<Item = usize> + '_ {
        self.parts.iter().enumerate().filter(|(_, p)| p.kind == Kind::Response).map(|(p, _)| p)
    }
}

/// Pair the responses of `user` with the calls of `model` (the turn before it): by `id` when the
/// response's id names a call, else the first call not yet answered with the response's name.
/// Each response part index maps to its call's part index; responses without a call are absent.
fn pair(model: Option<&Turn<'_>>, user: &Turn<'_>) -> HashMap<usize, usize> {
    let mut out = HashMap::new();
    let Some(model) = model.filter(|m| m.side == Side::Model) else { return out };
    let mut answered: HashSet<usize> = HashSet::new();
    for r in user.responses() {
        let response = &user.parts[r];
        let by_id = response
            .id
            .as_ref()
            .and_then(|id| model.calls().find(|&c| !answered.contains(&c) && model.parts[c].id.as_ref() == Some(id)));
        let by_name = || model.calls().find(|&c| !answered.contains(&c) && model.parts[c].name == response.name);
        if let Some(c) = by_id.or_else(by_name) {
            answered.insert(c);
            out.insert(r, c);
        }
    }
    out
}

/// Read every turn and give each response the neutral id of its call. An orphan is named
/// `orphan_{its own id}`, else `orphan_{p}`: a name no call has (calls are `call_{k}`), so the
/// neutral view shows a result without its call, the pairing check refuses it, and the engine
/// leaves such a conversation as it is.
fn read_turns<'a, S: AsRef<str> + ?Sized>(raws: &[&'a S]) -> Vec<Turn<'a>> {
    paired(raws.iter().map(|raw| Turn::read((*raw).as_ref())).collect())
}

/// `turns`, each as [`Turn::read`] reads it alone, with each response given its call's id (see
/// [`read_turns`]).
fn paired(mut turns: Vec<Turn<'_>>) -> Vec<Turn<'_>> {
    for t in 0..turns.len() {
        let ids = response_ids(t.checked_sub(1).map(|before| &turns[before]), &turns[t]);
        turns[t].ids.extend(ids);
    }
    turns
}

/// The neutral id of each response of `turn`, a turn read alone, when `before` is the turn before
/// it: its call's, else an orphan's (see [`read_turns`]).
fn response_ids(before: Option<&Turn<'_>>, turn: &Turn<'_>) -> Vec<(usize, String)> {
    if turn.side != Side::User {
        return Vec::new();
    }
    let pairs = pair(before, turn);
    turn.responses()
        .map(|r| {
            let id = match (pairs.get(&r), before) {
                (Some(c), Some(before)) => before.ids[c].clone(),
                _ => match &turn.parts[r].id {
                    Some(own) => format!("orphan_{own}"),
                    None => format!("orphan_{r}"),
                },
            };
            (r, id)
        })
        .collect()
}

/// A Gemini request body read into the neutral view.
#[derive(Debug)]
pub struct GeminiBody<'a> {
    /// The body split around `contents` (its elements are the raw turns).
    split: Split<'a>,
    turns: Vec<Turn<'a>>,
    /// The neutral messages: the system prompt first when the request has one, then the turns'.
    neutral: Vec<String>,
    has_system: bool,
    /// What each neutral message after the system prompt stands for.
    units: Vec<Unit>,
    /// What the request's path said.
    call: Call,
}

impl<'a> GeminiBody<'a> {
    /// Parse a Gemini request sent to a path that said `call`. Fails when the body is not a JSON
    /// object with a `contents` list.
    pub fn parse_at(bytes: &'a [u8], call: Call) -> Result<GeminiBody<'a>, WireError> {
        Self::parse_resumed(bytes, call, None)
    }

    /// [`GeminiBody::parse_at`] whose scan starts again after `resume` ([`Split::parse_resumed`]).
    pub(crate) fn parse_resumed(
        bytes: &'a [u8],
        call: Call,
        resume: Option<&Resume<'_>>,
    ) -> Result<GeminiBody<'a>, WireError> {
        let split = Split::parse_resumed(bytes, "contents", resume)?;
        let turns = read_turns(&split.elements);
        let mut out = GeminiBody { split, turns, neutral: Vec::new(), has_system: false, units: Vec::new(), call };
        out.has_system = out.system().is_some();
        for (t, turn) in out.turns.iter().enumerate() {
            match turn.side {
                Side::Opaque | Side::Model => out.units.push(Unit::Turn(t)),
                Side::User => {
                    out.units.extend(turn.responses().map(|r| Unit::Result { turn: t, part: r }));
                    if turn.parts.is_empty() || turn.parts.iter().any(|p| p.kind != Kind::Response) {
                        out.units.push(Unit::UserParts(t));
                    }
                }
            }
        }
        let first = out.first_turn_message();
        let turn_raw = |i: usize| std::slice::from_ref(&out.turns[out.units[i - first].turn()].raw);
        out.neutral = super::neutral_texts(first + out.units.len(), |i| out.draft(i), turn_raw);
        Ok(out)
    }

    /// Neutral message `i` as read from its turn (`None`: an opaque turn, or no such message).
    fn draft(&self, i: usize) -> Option<Draft<'_>> {
        let i = match (self.has_system, i) {
            (true, 0) => return self.system().map(system_draft),
            (true, i) => i - 1,
            (false, i) => i,
        };
        match *self.units.get(i)? {
            Unit::Turn(t) => {
                let turn = &self.turns[t];
                (turn.side == Side::Model).then(|| model_draft(turn))
            }
            Unit::Result { turn, part } => {
                let turn = &self.turns[turn];
                Some(result_draft(&turn.ids[&part], &turn.parts[part]))
            }
            Unit::UserParts(t) => {
                let written: Vec<&str> =
                    self.turns[t].parts.iter().filter(|p| p.kind != Kind::Response).map(|p| p.raw).collect();
                Some(Draft::text("user", format!("[{}]", written.join(","))))
            }
        }
    }

    /// Parse a Gemini request read without its path (no model, not streamed).
    pub fn parse(bytes: &'a [u8]) -> Result<GeminiBody<'a>, WireError> {
        Self::parse_at(bytes, Call::default())
    }

    fn system(&self) -> Option<&'a str> {
        ["systemInstruction", "system_instruction"]
            .iter()
            .find_map(|key| self.split.field(key))
            .map(RawValue::get)
            .filter(|s| *s != "null")
    }

    fn first_turn_message(&self) -> usize {
        usize::from(self.has_system)
    }
}

/// The system prompt as a neutral message: its `parts` as content, or the whole value as text when
/// it has none.
fn system_draft(system: &str) -> Draft<'_> {
    #[derive(Deserialize)]
    struct Parts<'a> {
        #[serde(borrow)]
        parts: &'a RawValue,
    }
    match serde_json::from_str::<Parts<'_>>(system) {
        Ok(p) if p.parts.get().starts_with('[') => Draft::text("system", p.parts.get()),
        _ if system.starts_with('"') => Draft::text("system", system),
        _ => Draft::text("system", json_string(system)),
    }
}

/// The text a response part stands for: its one string member, else its JSON text.
fn response_text<'p>(part: &Part<'p>) -> Cow<'p, str> {
    match part.response_member.and_then(|(_, value)| serde_json::from_str::<String>(value).ok()) {
        Some(text) => Cow::Owned(text),
        None => Cow::Borrowed(part.response.unwrap_or("")),
    }
}

/// Whether `text` is the text response part `part` stands for ([`response_text`]). A string value
/// sent as n bytes decodes to at least (n − 2) / 6 bytes (`"\u0001"` is the longest escape of the
/// shortest character), so a text that much shorter (a marker in place of an output) differs
/// without the value being decoded.
fn is_response_text(part: &Part<'_>, text: &str) -> bool {
    let surely_shorter = part.response_member.is_some_and(|(_, value)| text.len() < (value.len() - 2) / 6);
    !surely_shorter && text == response_text(part)
}

/// The neutral message of a response part: the text it stands for as its content, the member as
/// sent when that is how pare writes the text (no decoding and writing it again).
fn result_draft<'p>(id: &'p str, part: &'p Part<'_>) -> Draft<'p> {
    let content = match part.response_member {
        Some((_, value)) if written_as_pare_writes(value) => Cow::Borrowed(value),
        _ => Cow::Owned(json_string(&response_text(part))),
    };
    Draft::result(id, content)
}

fn model_draft<'t>(turn: &'t Turn<'_>) -> Draft<'t> {
    let texts: Vec<&str> = turn.parts.iter().filter(|p| p.kind == Kind::Text).map(|p| p.raw).collect();
    let content = if texts.is_empty() { Cow::Borrowed("null") } else { Cow::Owned(format!("[{}]", texts.join(","))) };
    let tool_calls = turn
        .calls()
        .map(|c| {
            let call = &turn.parts[c];
            DraftCall { id: &turn.ids[&c], name: &call.name, arguments: Arguments::Text(call.args) }
        })
        .collect();
    Draft { role: "assistant", content, tool_calls, tool_call_id: None }
}

/// The neutral message of a model answer (a candidate's `content`, as the API returns it or as
/// assembled from its stream): what the same turn reads as when the agent's next request carries
/// it, so that the session tracker finds the conversation it extends.
pub fn neutral_answer(content: &Value) -> Option<Value> {
    let raw = content.to_string();
    let turn = Turn::read(&raw);
    if turn.side != Side::Model {
        return None;
    }
    model_draft(&turn).value()
}

impl WireBody for GeminiBody<'_> {
    fn wire(&self) -> Wire {
        Wire::Gemini
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
    fn model(&self) -> Option<String> {
        self.call.model.clone()
    }
    fn stream(&self) -> bool {
        self.call.stream
    }
    fn output_limit(&self) -> Option<u64> {
        let config = ["generationConfig", "generation_config"].iter().find_map(|key| self.split.field(key))?;
        let members = raw_members(config.get())?;
        members
            .iter()
            .find(|(k, _)| matches!(*k, "maxOutputTokens" | "max_output_tokens"))
            .and_then(|(_, v)| serde_json::from_str::<u64>(v).ok())
    }
    fn write(&self, forwarded: &[Forward<'_>]) -> Result<(Vec<u8>, Spans), WireError> {
        let turns = self.turns_for(forwarded)?;
        // A request that was already invalid goes as the agent sent it, when nothing changed.
        let unchanged = turns.len() == self.split.elements.len()
            && turns.iter().zip(&self.split.elements).all(|(turn, raw)| std::ptr::eq(turn.as_ref(), *raw));
        if unchanged {
            return Ok(self.split.to_vec_and_spans_keeping_array());
        }
        // A turn written as sent is taken as the body's parse read it, the ids of its responses
        // included while the turn before it is the one before it in the body; any other turn of
        // responses is paired again where it stands.
        let mut read = super::reuse_reads(&turns, &self.split.elements, &self.turns, Turn::read);
        for t in 0..read.len() {
            let in_place = match (read[t].0, t.checked_sub(1).map(|before| read[before].0)) {
                (Some(k), None) => k == 0,
                (Some(k), Some(Some(before))) => k == before + 1,
                _ => false,
            };
            if in_place || read[t].1.side != Side::User {
                continue;
            }
            let alone = Turn { ids: HashMap::new(), ..read[t].1.as_ref().clone() };
            let ids = response_ids(t.checked_sub(1).map(|before| read[before].1.as_ref()), &alone);
            read[t].1 = Cow::Owned(Turn { ids: ids.into_iter().collect(), ..alone });
        }
        check_read(&read.iter().map(|(_, turn)| turn.as_ref()).collect::<Vec<_>>(), self.has_system)?;
        Ok(self.split.to_vec_and_spans(&turns))
    }
    fn spans_in(&self, body: &[u8]) -> Option<Spans> {
        self.split.spans_in(body)
    }
    fn check(&self) -> Result<(), Invalid> {
        check_read(&self.turns.iter().collect::<Vec<_>>(), self.has_system)
    }
}

/// A forwarded turn being written: the original turn it stands for (`None`: a turn pare wrote, a
/// user turn), and its parts as JSON text.
struct WrittenTurn<'b> {
    turn: Option<usize>,
    parts: Vec<Cow<'b, str>>,
    /// The turn is its original bytes.
    whole: bool,
}

impl GeminiBody<'_> {
    /// The turns standing for the `forwarded` entries.
    fn turns_for(&self, forwarded: &[Forward<'_>]) -> Result<Vec<Cow<'_, str>>, WireError> {
        let traced = super::trace_units(&self.units, self.first_turn_message(), forwarded, "system instruction")?;
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
        let mut written: Vec<WrittenTurn<'_>> = Vec::new();
        let mut seen_turn: Option<usize> = None;
        for f in &traced {
            let unit = match f {
                Traced::Kept(unit) | Traced::Rewritten(unit, _) => *unit,
                Traced::New(message) => {
                    written.push(WrittenTurn { turn: None, parts: vec![Cow::Owned(new_part(message)?)], whole: false });
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
            if turn.side == Side::Opaque || turn.parts.is_empty() {
                written.push(WrittenTurn { turn: Some(t), parts: Vec::new(), whole: true });
                continue;
            }
            let mut parts = Vec::with_capacity(turn.parts.len());
            let mut new_text = match rewrites.get(&Unit::Turn(t)) {
                Some(message) if turn.side == Side::Model => changed_text(turn, message),
                _ => None,
            };
            let text_changed = new_text.is_some();
            let mut all_kept = true;
            for (p, part) in turn.parts.iter().enumerate() {
                let unit = match (turn.side, part.kind) {
                    (Side::Model, _) => Unit::Turn(t),
                    (_, Kind::Response) => Unit::Result { turn: t, part: p },
                    _ => Unit::UserParts(t),
                };
                if kept_units.contains(&unit) {
                    parts.push(Cow::Borrowed(part.raw));
                    continue;
                }
                let rewritten = if let Some(message) = rewrites.get(&unit) {
                    match part.kind {
                        Kind::Text if text_changed && !part.signed => match new_text.take() {
                            Some(text) if !text.is_empty() => Some(Cow::Owned(
                                replace_member(part.raw, "text", part.text, &json_string(&text))
                                    .ok_or_else(|| WireError::Unwritable("a text part cannot be rewritten".into()))?,
                            )),
                            _ => None,
                        },
                        _ => Some(rewrite_part(turn, p, message)?),
                    }
                } else {
                    None
                };
                match rewritten {
                    Some(text) if text == part.raw => parts.push(Cow::Borrowed(part.raw)),
                    Some(text) => {
                        all_kept = false;
                        parts.push(text);
                    }
                    None => all_kept = false,
                }
            }
            if !parts.is_empty() {
                written.push(WrittenTurn { turn: Some(t), parts, whole: all_kept });
            }
        }
        self.rendered(written)
    }

    /// The written turns as JSON text.
    fn rendered(&self, written: Vec<WrittenTurn<'_>>) -> Result<Vec<Cow<'_, str>>, WireError> {
        written
            .into_iter()
            .map(|w| match w.turn {
                Some(t) if w.whole => Ok(Cow::Borrowed(self.turns[t].raw)),
                Some(t) => {
                    let turn = &self.turns[t];
                    replace_member(turn.raw, "parts", turn.parts_raw, &format!("[{}]", w.parts.join(",")))
                        .map(Cow::Owned)
                        .ok_or_else(|| WireError::Unwritable(format!("turn {t} cannot be rewritten")))
                }
                None => Ok(Cow::Owned(format!(r#"{{"role":"user","parts":[{}]}}"#, w.parts.join(",")))),
            })
            .collect()
    }
}

/// Part `p` of `turn` with what the forwarded neutral `message` changed: a response's `response`, an
/// unsigned call's `args` (which must stay an object with the same keys).
fn rewrite_part<'b>(turn: &Turn<'b>, p: usize, message: &Message) -> Result<Cow<'b, str>, WireError> {
    let part = &turn.parts[p];
    let function_key = || {
        raw_members_around(part.raw, Some(part.function_raw))
            .and_then(|m| m.into_iter().find(|(_, v)| std::ptr::eq(v.as_ptr(), part.function_raw.as_ptr())))
            .map(|(k, _)| k.to_owned())
            .ok_or_else(|| WireError::Unwritable(format!("part `{}` cannot be rewritten", part.name)))
    };
    // `known`: the value replaced, as the part's read found it.
    let replace = |key: &str, known: Option<&str>, value: &str| -> Result<Cow<'b, str>, WireError> {
        let function = replace_member(part.function_raw, key, known, value)
            .ok_or_else(|| WireError::Unwritable(format!("part `{}` cannot be rewritten", part.name)))?;
        replace_member(part.raw, &function_key()?, Some(part.function_raw), &function)
            .map(Cow::Owned)
            .ok_or_else(|| WireError::Unwritable(format!("part `{}` cannot be rewritten", part.name)))
    };
    match part.kind {
        Kind::Response => {
            let text = message.text();
            if is_response_text(part, &text) {
                return Ok(Cow::Borrowed(part.raw));
            }
            let key = part.response_member.map_or("output", |(key, _)| key);
            let mut response = String::from("{");
            push_json_string(&mut response, key);
            response.push(':');
            push_json_string(&mut response, &text);
            response.push('}');
            replace("response", part.response, &response)
        }
        Kind::Call if !part.signed => {
            let id = &turn.ids[&p];
            let call = message.tool_calls.iter().flatten().find(|c| &c.id == id);
            let Some(arguments) = call.and_then(|c| c.function.as_ref()).map(|f| &f.arguments) else {
                return Err(WireError::Unwritable(format!("call `{id}` lost its functionCall")));
            };
            let Value::String(arguments) = arguments else {
                return Err(WireError::Unwritable(format!("call `{id}` has arguments that are not a string")));
            };
            if arguments == part.args {
                return Ok(Cow::Borrowed(part.raw));
            }
            let keys =
                |raw: &str| raw_members(raw).map(|m| m.into_iter().map(|(k, _)| k.to_owned()).collect::<Vec<_>>());
            match (keys(arguments), keys(part.args)) {
                (Some(new), Some(old)) if new == old => replace("args", Some(part.args), arguments),
                _ => {
                    Err(WireError::Unwritable(format!("call `{id}`: its args must stay an object with the same keys")))
                }
            }
        }
        _ => Ok(Cow::Borrowed(part.raw)),
    }
}

/// The forwarded text of a model `turn`, when the engine changed it ("" when it took it away).
fn changed_text(turn: &Turn<'_>, message: &Message) -> Option<String> {
    let original = crate::neutral::parts_text(turn.parts.iter().filter(|p| p.kind == Kind::Text).map(|p| p.raw));
    let new_text = message.text();
    (original != new_text).then_some(new_text)
}

/// The part for a neutral message the engine wrote (an elision marker): its text.
fn new_part(message: &Message) -> Result<String, WireError> {
    if !matches!(message.role.as_str(), "user" | "assistant") {
        return Err(WireError::Unwritable(format!("a forwarded `{}` message has no turn to stand for", message.role)));
    }
    Ok(format!(r#"{{"text":{}}}"#, json_string(&message.text())))
}

/// A rule of the Gemini API over turns that the neutral form cannot express (the pairing of
/// calls and responses is the neutral view's, [`crate::compact::validate`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Structure {
    /// A `functionCall` part in a user turn: the neutral view reads it as what the person wrote.
    #[error("turn {turn}: functionCall `{name}` outside a model turn")]
    CallOutsideModel { turn: usize, name: String },
    /// A `functionResponse` part in a model turn: the neutral view does not read it.
    #[error("turn {turn}: functionResponse `{name}` outside a user turn")]
    ResponseOutsideUser { turn: usize, name: String },
    /// A model turn that calls must follow a user turn (two model turns read as two assistant
    /// messages, which the neutral form allows).
    #[error("turn {turn}: a model turn that calls comes right after another model turn")]
    CallAfterModel { turn: usize },
}

/// The Gemini API's rules over `turns` (a request without a system instruction) that pare could
/// break: the pairing of their neutral view ([`crate::compact::validate`]: every `functionCall` of
/// a model turn answered by a `functionResponse` in the next turn, paired by id else by name in
/// order; no response without its call), then the API's own ([`Structure`]): calls only in model
/// turns, responses only in user turns, a model turn that calls right after a user turn. Turns pare
/// cannot read are opaque messages.
pub fn check_turns<S: AsRef<str>>(turns: &[S]) -> Result<(), Invalid> {
    check_conversation(turns, false)
}

/// [`check_turns`] over the turns of a request, whose neutral view opens with its system
/// instruction when `system`.
fn check_conversation<S: AsRef<str>>(turns: &[S], system: bool) -> Result<(), Invalid> {
    let raws: Vec<&str> = turns.iter().map(AsRef::as_ref).collect();
    check_read(&read_turns(&raws).iter().collect::<Vec<_>>(), system)
}

/// [`check_conversation`] over turns already read and paired.
fn check_read(read: &[&Turn<'_>], system: bool) -> Result<(), Invalid> {
    let (skeletons, origins) = neutral_skeletons(read, system);
    super::check_pairing(&skeletons, &origins)?;
    for (t, turn) in read.iter().enumerate() {
        let name_of = |p: usize| turn.parts[p].name.clone();
        if let Some(c) = turn.calls().next() {
            if turn.side != Side::Model {
                return Err(Structure::CallOutsideModel { turn: t, name: name_of(c) }.into());
            }
            if t.checked_sub(1).is_some_and(|before| read[before].side == Side::Model) {
                return Err(Structure::CallAfterModel { turn: t }.into());
            }
        }
        if let Some(r) = turn.responses().next().filter(|_| turn.side != Side::User) {
            return Err(Structure::ResponseOutsideUser { turn: t, name: name_of(r) }.into());
        }
    }
    Ok(())
}

/// The skeleton of each neutral message `turns` read into (as [`GeminiBody::parse_at`] writes
/// them, the system instruction first when `system`), and the turn it comes from.
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
        match turn.side {
            Side::Opaque => push(Some(Skeleton::opaque())),
            Side::Model => {
                push(super::skeleton("assistant", turn.calls().map(|c| turn.ids[&c].clone()).collect(), None))
            }
            Side::User => {
                for r in turn.responses() {
                    push(super::skeleton("tool", Vec::new(), Some(&turn.ids[&r])));
                }
                if turn.parts.is_empty() || turn.parts.iter().any(|p| p.kind != Kind::Response) {
                    push(super::skeleton("user", Vec::new(), None));
                }
            }
        }
    }
    (skeletons, origins)
}

#[cfg(test)]
mod tests;
