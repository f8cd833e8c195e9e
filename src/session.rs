//! Which conversation a request belongs to: an explicit header wins (bound to the credential that
//! opened it, see *Binding*); otherwise the session whose last
//! raw request plus its answer, or whose last request, this request extends (prefix match over message
//! keys); otherwise a new session with a time-sortable id (ULID).
//!
//! # Keys
//!
//! Each message gets a 64-bit key over a *normalized* form — role, content text (a string and a list of
//! text parts give the same key; surrounding whitespace ignored), tool calls (id, name, arguments with
//! JSON re-serialized compactly) and `tool_call_id`. Cosmetic keys are ignored: `name` on tool messages
//! (Hermes drops it when it resumes a session), reasoning fields (agents strip them), `refusal`,
//! `cache_control`… An opaque entry (wire parts pare does not read) keys as its parts re-serialized
//! compactly. The key of a message *list* is a rolling hash of its message keys, so every prefix
//! of a request has a key, computed in one pass.
//!
//! # Matching
//!
//! When an answer completes, the session registers the key of "its request + that answer" (an *ext*
//! key); the newest one is the session's *head*. A new request with message-prefix keys `c1..cm` looks
//! for the longest prefix `ci` that is a registered ext key:
//! - among sessions whose **head** is `ci`, the one that registered it first is chosen and the head is
//!   consumed (so two concurrent conversations with identical openings and identical answers each take
//!   one session, in the order their answers arrived);
//! - otherwise `ci` is an older ext key of some session: the request is a **branch** (a regenerate, or
//!   a retry after an error) and joins the session that registered `ci` most recently.
//!
//! Each request also registers its own key (a *request* key; the newest is the session's *request
//! head*), so that a conversation stays one session when the assistant message the agent sends back
//! is not the answer pare recorded (the agent trimmed or re-rendered it, an upstream's answer is not
//! what the agent goes on with) or no answer was recorded (a cut stream, a restart in between). A
//! *proper* prefix `ci` of the new request that is a request key, tried at each length after the ext
//! keys of that length:
//! - among sessions whose **request head** is `ci`, the one that registered it first is chosen and
//!   that head is consumed (two conversations with identical openings each take one session);
//! - otherwise, when `ci` goes beyond the request's *opening* (its messages up to the first user
//!   message), the request is a branch of the session that registered `ci` most recently. An opening
//!   alone joins only a request head: unrelated conversations share openings.
//! - If nothing matches, a request that extends exactly one session's request still waiting for its
//!   answer joins it (the agent was faster than the end of the stream).
//! - Otherwise it starts a new session. A request equal to an earlier *request* (not a proper
//!   extension of it) never joins it: identical openings start separate sessions. The price:
//!   re-sending the very first request of a conversation (a retry before any answer) starts a new
//!   session too.
//!
//! # Binding
//!
//! A session named by a header belongs to the credential of the request that opened it: a
//! SHA-256 of its `authorization`, `x-api-key`, `api-key` and `x-goog-api-key` headers (a Gemini
//! `?key=` counts as the last), kept in memory as 8 bytes, never stored. A request under the same
//! name with another credential (or none where there was one) is another client's: it gets a
//! session of its own, `{name}-{12 hex digits of its credential's hash}` ([`bound_session_id`]),
//! and never resets the first one's compaction nor lands in its records. The binding lives with the
//! session's keys: after a restart or an eviction, the next credential to name the session binds it.
//!
//! A session's keys are its tracker part in the memory budget (`memory.max_state_bytes`, see
//! [`crate::memory`]), which evicts least recently used sessions; the tracker's indexes by key
//! forget an evicted session's keys and keep its heads, through which it joins again when it comes
//! back; at start the tracker is rebuilt from the archive's stored request and ext keys
//! ([`StoredKey`]).

use std::collections::{HashMap, VecDeque};
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};

use http::HeaderMap;
use lru::LruCache;
use serde_json::Value;
use xxhash_rust::xxh3::xxh3_64;

use crate::config::ArchiveConfig;
use crate::memory::{Holder, StateBudget};
use crate::neutral::message_hashes;

/// Ext keys, and request keys, remembered per session (older branches beyond this can no longer be
/// joined).
const EXT_KEYS_PER_SESSION: usize = 4096;
/// Raw message bytes → normalized key, so unchanged messages are not re-parsed on every request.
const KEY_MEMO: usize = 200_000;
/// Bytes of one memo entry (key, value, the LRU's node and map slot), reserved in the budget.
const KEY_MEMO_ENTRY_BYTES: u64 = 80;
/// Evicted sessions whose head key is remembered (see `Inner::evicted_heads`).
const EVICTED_HEADS: usize = 16_384;
/// Bytes one ext or pending key of a session costs (its place in the session's list and in the
/// key → sessions map), on top of the session id's length.
const KEY_BYTES: u64 = 72;

/// The request headers whose values are a client's credential (with the query's `key`, which a
/// Gemini client may send instead of `x-goog-api-key`).
pub const CREDENTIAL_HEADERS: [&str; 4] = ["authorization", "x-api-key", "api-key", "x-goog-api-key"];

/// The first 8 bytes of a SHA-256 over the request's credentials ([`CREDENTIAL_HEADERS`], in that
/// order, each value with its name): what binds a session to its client without keeping the key.
/// A request without a credential has the hash of nothing.
pub fn credential_tag(headers: &HeaderMap) -> u64 {
    use sha2::Digest;
    let mut hasher = sha2::Sha256::new();
    for name in CREDENTIAL_HEADERS {
        for value in headers.get_all(name) {
            hasher.update(name.as_bytes());
            hasher.update([0]);
            hasher.update(value.as_bytes());
            hasher.update([0]);
        }
    }
    let digest = hasher.finalize();
    u64::from_be_bytes(digest[..8].try_into().expect("a SHA-256 has 32 bytes"))
}

/// The session a request naming `id` gets when `id` is bound to another credential: `id` (cut to
/// fit 128 characters) and 12 hex digits of the request's credential tag.
pub fn bound_session_id(id: &str, tag: u64) -> String {
    let suffix = format!("-{:012x}", tag >> 16);
    let keep = id.len().min(128 - suffix.len());
    format!("{}{suffix}", &id[..keep])
}

/// A valid explicit session id: 1 to 128 characters among `A-Z a-z 0-9 . _ : -`, not starting with a
/// dot. Session ids are printed and used as database keys, never as paths; the check keeps them tame.
pub fn valid_session_id(id: &str) -> bool {
    (1..=128).contains(&id.len())
        && !id.starts_with('.')
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
}

/// A new time-sortable session id (a ULID; monotonic within the process, so ids sort in creation order).
pub fn new_session_id() -> String {
    static GENERATOR: Mutex<ulid::Generator> = Mutex::new(ulid::Generator::new());
    let mut generator = GENERATOR.lock().unwrap_or_else(|p| p.into_inner());
    generator.generate().unwrap_or_else(|_| ulid::Ulid::generate()).to_string()
}

/// The normalized key of a message given as JSON text.
pub fn message_key(raw: &str) -> u64 {
    if let Some(key) = plain_message_key(raw) {
        return key;
    }
    match serde_json::from_str::<Value>(raw) {
        Ok(v @ (Value::Object(_) | Value::Array(_))) => message_key_value(&v),
        _ => xxh3_64(raw.as_bytes()),
    }
}

/// [`message_key`] of the usual message — an object whose `role`, `content` and `tool_call_id` are
/// strings, null or absent, and whose `tool_calls`, if any, are objects with a string `id` and a
/// `function` of string `name` and `arguments` — read in place as its [`crate::neutral::Shape`]
/// instead of into a [`Value`]: the same key [`message_key_value`] gives it. `None` for any other
/// message (and for a repeated key, where the `Value` keeps the last one).
fn plain_message_key(raw: &str) -> Option<u64> {
    // A content of another type than a string is keyed from its value: the read stops at it.
    let shape = crate::neutral::Shape::<crate::neutral::shape::Str<'_>>::parse_as(raw)?;
    let content = shape.content.as_ref().map_or("", |text| &text.0);
    let calls = shape
        .tool_calls
        .iter()
        .flatten()
        .map(|call| Some((call.id.as_deref().unwrap_or(""), call.name_and_arguments()?)))
        .collect::<Option<Vec<_>>>()?;
    let calls = |buf: &mut Vec<u8>| {
        for (id, (name, arguments)) in &calls {
            push_call(buf, id, name, &canonical_argument_text(arguments));
        }
    };
    Some(key_of_parts(&shape.role, content, calls, shape.tool_call_id.as_deref().unwrap_or("")))
}

/// The normalized key of a parsed message (see the module docs for what is ignored). An opaque
/// entry ([`crate::neutral::opaque`]: wire parts as sent) keys as its parts, however spaced.
pub fn message_key_value(message: &Value) -> u64 {
    if message.is_array() {
        return xxh3_64(message.to_string().as_bytes());
    }
    let calls = |buf: &mut Vec<u8>| {
        if let Some(Value::Array(calls)) = message.get("tool_calls") {
            for call in calls {
                let function = call.get("function").unwrap_or(&Value::Null);
                let arguments = canonical_arguments(function.get("arguments"));
                push_call(buf, str_field(call, "id"), str_field(function, "name"), &arguments);
            }
        }
    };
    key_of_parts(
        str_field(message, "role"),
        &content_text(message.get("content")),
        calls,
        str_field(message, "tool_call_id"),
    )
}

/// `value[key]` when it is a string, else "".
fn str_field<'v>(value: &'v Value, key: &str) -> &'v str {
    value.get(key).and_then(Value::as_str).unwrap_or("")
}

/// One tool call's part of a message key: its id, its function's name, its canonical arguments.
fn push_call(buf: &mut Vec<u8>, id: &str, name: &str, arguments: &str) {
    buf.extend_from_slice(id.as_bytes());
    buf.push(0xfe);
    buf.extend_from_slice(name.as_bytes());
    buf.push(0xfe);
    buf.extend_from_slice(arguments.as_bytes());
    buf.push(0xfd);
}

/// The key of a message's normalized parts; `calls` writes its tool calls.
fn key_of_parts(role: &str, content: &str, calls: impl FnOnce(&mut Vec<u8>), tool_call_id: &str) -> u64 {
    let mut buf = Vec::with_capacity(role.len() + content.len() + tool_call_id.len() + 8);
    buf.extend_from_slice(role.as_bytes());
    buf.push(0xff);
    buf.extend_from_slice(content.trim().as_bytes());
    buf.push(0xff);
    calls(&mut buf);
    buf.push(0xff);
    buf.extend_from_slice(tool_call_id.as_bytes());
    xxh3_64(&buf)
}

/// A message's content as text: the string, or its text parts joined by newlines (other parts as
/// their JSON), or empty for null/absent.
pub fn content_text(content: Option<&Value>) -> String {
    match content {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .map(|p| match p.get("text").and_then(Value::as_str) {
                Some(t) => t.to_string(),
                None => p.to_string(),
            })
            .collect::<Vec<_>>()
            .join("\n"),
        Some(other) => other.to_string(),
    }
}

fn canonical_arguments(arguments: Option<&Value>) -> String {
    match arguments {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => canonical_argument_text(s).into_owned(),
        Some(other) => other.to_string(),
    }
}

/// A call's `arguments` string as its JSON re-serialized compactly, or as it is when it is not JSON.
fn canonical_argument_text(arguments: &str) -> std::borrow::Cow<'_, str> {
    match serde_json::from_str::<Value>(arguments) {
        Ok(v) => v.to_string().into(),
        Err(_) => arguments.into(),
    }
}

/// The key of a message list extended by one message.
pub fn chain_key(prefix: u64, message: u64) -> u64 {
    let mut buf = [0u8; 16];
    buf[..8].copy_from_slice(&prefix.to_le_bytes());
    buf[8..].copy_from_slice(&message.to_le_bytes());
    xxh3_64(&buf)
}

/// Keys of every prefix of a message list: `out[i]` is the key of the first `i + 1` messages.
pub fn prefix_keys(message_keys: &[u64]) -> Vec<u64> {
    let mut acc = 0u64;
    message_keys
        .iter()
        .map(|k| {
            acc = chain_key(acc, *k);
            acc
        })
        .collect()
}

/// How a request was assigned to its session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Assigned {
    /// Named by a session header.
    Header,
    /// Extends the session's latest request + answer.
    Extends,
    /// Extends an older request + answer of the session (a regenerate or retry).
    Branch,
    /// Extends a request whose answer had not finished yet.
    Pending,
    /// Starts a new session.
    New,
}

/// A session key as the archive stores it, in the order of the session's records: each request's
/// key (`exchanges.key_req`), then its answer's ext key (`responses.key_ext`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoredKey {
    Request(u64),
    Answer(u64),
}

/// The outcome of [`SessionTracker::assign`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    pub session: String,
    /// Key of the request's whole message list (`None` for a body that did not parse).
    pub key_req: Option<u64>,
    pub how: Assigned,
}

/// The tracker's part of a session in the memory budget ([`crate::memory`]): its keys.
#[derive(Default)]
struct Tracked {
    ext_keys: VecDeque<u64>,
    head: Option<u64>,
    /// Keys of the session's requests, oldest first, and the newest one unless a request extending
    /// it consumed it.
    req_keys: VecDeque<u64>,
    req_head: Option<u64>,
    pending: Vec<u64>,
    /// The credential ([`credential_tag`]) of the request that opened a session named by a header.
    owner: Option<u64>,
}

/// A session's [`Tracked`] keys, as the budget holds them.
type TrackedPart = Mutex<Tracked>;

fn lock(part: &TrackedPart) -> std::sync::MutexGuard<'_, Tracked> {
    part.lock().unwrap_or_else(|p| p.into_inner())
}

/// The tracker's indexes over the sessions' keys; the sessions' own keys are their parts in the
/// budget.
struct Inner {
    budget: Arc<StateBudget>,
    /// Ext key → sessions that registered it, in registration order.
    ext: HashMap<u64, Vec<String>>,
    /// Request key → sessions that registered it, in registration order.
    req: HashMap<u64, Vec<String>>,
    /// Request key → sessions whose request with that key is waiting for its answer.
    pending: HashMap<u64, Vec<String>>,
    /// Head key → session, for sessions the memory budget evicted: the next request extending one
    /// joins it again (older branches of it are forgotten). A request head joins only a request that
    /// properly extends it ([`Head::Request`]).
    evicted_heads: LruCache<u64, (String, Head)>,
}

/// Which head of an evicted session a key was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Head {
    Answer,
    Request,
}

fn remove_from(map: &mut HashMap<u64, Vec<String>>, key: u64, session: &str) {
    if let Some(list) = map.get_mut(&key) {
        if let Some(pos) = list.iter().position(|s| s == session) {
            list.remove(pos);
        }
        if list.is_empty() {
            map.remove(&key);
        }
    }
}

impl Inner {
    /// `session`'s keys, made the most recently used session, tracking it if new.
    fn touch(&self, session: &str) -> Arc<TrackedPart> {
        self.budget.part(Holder::Tracker, session, TrackedPart::default)
    }

    /// The session a request naming `id` with credential `tag` belongs to: `id` when `tag` opened
    /// it (or it is new, or forgotten), else the session of `id` bound to `tag`.
    fn bind(&self, id: String, tag: u64) -> String {
        let part = self.touch(&id);
        let mut tracked = lock(&part);
        match tracked.owner {
            Some(owner) if owner != tag => {
                drop(tracked);
                let own = bound_session_id(&id, tag);
                lock(&self.touch(&own)).owner = Some(tag);
                own
            }
            Some(_) => id,
            None => {
                tracked.owner = Some(tag);
                id
            }
        }
    }

    /// `session`'s keys, when it is tracked.
    fn tracked(&self, session: &str) -> Option<Arc<TrackedPart>> {
        self.budget.peek_part(Holder::Tracker, session)
    }

    /// Drop the keys of the sessions the budget evicted from the indexes.
    fn forget_evicted(&mut self) {
        for (evicted, part) in self.budget.take_evicted::<TrackedPart>(Holder::Tracker) {
            let state = std::mem::take(&mut *lock(&part));
            if let Some(head) = state.req_head {
                self.evicted_heads.put(head, (evicted.clone(), Head::Request));
            }
            if let Some(head) = state.head {
                self.evicted_heads.put(head, (evicted.clone(), Head::Answer));
            }
            for key in state.ext_keys {
                remove_from(&mut self.ext, key, &evicted);
            }
            for key in state.req_keys {
                remove_from(&mut self.req, key, &evicted);
            }
            for key in state.pending {
                remove_from(&mut self.pending, key, &evicted);
            }
        }
    }

    /// Tell the budget what `session`'s keys weigh now.
    fn charge(&self, session: &str) {
        if let Some(part) = self.tracked(session) {
            let t = lock(&part);
            let n_keys = (t.ext_keys.len() + t.req_keys.len() + t.pending.len()) as u64;
            drop(t);
            self.budget.charge(Holder::Tracker, session, n_keys * (KEY_BYTES + session.len() as u64));
        }
    }

    fn register_ext(&mut self, session: &str, key: u64) {
        let part = self.touch(session);
        let mut tracked = lock(&part);
        tracked.head = Some(key);
        if tracked.ext_keys.contains(&key) {
            return;
        }
        tracked.ext_keys.push_back(key);
        let dropped = (tracked.ext_keys.len() > EXT_KEYS_PER_SESSION).then(|| tracked.ext_keys.pop_front()).flatten();
        if let Some(old) = dropped {
            remove_from(&mut self.ext, old, session);
        }
        self.ext.entry(key).or_default().push(session.to_owned());
    }

    /// A request of `session` with key `key`: its request head.
    fn register_req(&mut self, session: &str, key: u64) {
        let part = self.touch(session);
        let mut tracked = lock(&part);
        tracked.req_head = Some(key);
        if tracked.req_keys.contains(&key) {
            return;
        }
        tracked.req_keys.push_back(key);
        let dropped = (tracked.req_keys.len() > EXT_KEYS_PER_SESSION).then(|| tracked.req_keys.pop_front()).flatten();
        if let Some(old) = dropped {
            remove_from(&mut self.req, old, session);
        }
        self.req.entry(key).or_default().push(session.to_owned());
    }
}

/// Assigns requests to sessions (see the module docs). Cheap to share; all methods take `&self`.
pub struct SessionTracker {
    headers: Vec<String>,
    inner: Mutex<Inner>,
    memo: Mutex<LruCache<u128, u64>>,
}

impl SessionTracker {
    /// A tracker with its own default budget ([`SessionTracker::with_budget`] shares one).
    pub fn new(config: &ArchiveConfig) -> SessionTracker {
        SessionTracker::with_budget(config, Arc::new(StateBudget::default()))
    }

    /// A tracker whose sessions are charged to `budget` (the key memo reserves its capacity there).
    pub fn with_budget(config: &ArchiveConfig, budget: Arc<StateBudget>) -> SessionTracker {
        budget.reserve(KEY_MEMO as u64 * KEY_MEMO_ENTRY_BYTES + EVICTED_HEADS as u64 * (KEY_BYTES + 32));
        budget.notify(Holder::Tracker);
        SessionTracker {
            headers: config.session_headers.iter().map(|h| h.to_ascii_lowercase()).collect(),
            inner: Mutex::new(Inner {
                budget,
                ext: HashMap::new(),
                req: HashMap::new(),
                pending: HashMap::new(),
                evicted_heads: LruCache::new(NonZeroUsize::new(EVICTED_HEADS).expect("non-zero")),
            }),
            memo: Mutex::new(LruCache::new(NonZeroUsize::new(KEY_MEMO).expect("non-zero"))),
        }
    }

    /// The explicit session named by the request's headers, if a valid one is present.
    pub fn header_session(&self, headers: &HeaderMap) -> Option<String> {
        for name in &self.headers {
            let Some(value) = headers.get(name.as_str()) else {
                continue;
            };
            match value.to_str() {
                Ok(id) if valid_session_id(id.trim()) => return Some(id.trim().to_owned()),
                _ => {
                    tracing::warn!(header = %name, "ignoring an invalid session id (1-128 of A-Z a-z 0-9 . _ : -)");
                }
            }
        }
        None
    }

    /// Normalized keys of a request's messages, reusing the keys of messages seen before.
    pub fn message_keys(&self, messages: &[&str]) -> Vec<u64> {
        self.message_keys_hashed(messages, &message_hashes(messages))
    }

    /// [`SessionTracker::message_keys`] with each message's hash given ([`message_hashes`]).
    fn message_keys_hashed(&self, messages: &[&str], raw_hashes: &[u128]) -> Vec<u64> {
        let mut keys: Vec<Option<u64>> = {
            let mut memo = self.memo.lock().unwrap_or_else(|p| p.into_inner());
            raw_hashes.iter().map(|h| memo.get(h).copied()).collect()
        };
        let mut fresh = Vec::new();
        for (idx, key) in keys.iter_mut().enumerate() {
            if key.is_none() {
                let k = message_key(messages[idx]);
                *key = Some(k);
                fresh.push((raw_hashes[idx], k));
            }
        }
        if !fresh.is_empty() {
            let mut memo = self.memo.lock().unwrap_or_else(|p| p.into_inner());
            for (h, k) in fresh {
                memo.put(h, k);
            }
        }
        keys.into_iter().map(|k| k.unwrap_or_default()).collect()
    }

    /// Assign a request to a session and remember it as waiting for its answer.
    /// `messages` are the request's neutral messages (`None` for a body that did not parse).
    pub fn assign(&self, headers: &HeaderMap, messages: Option<&[&str]>) -> Assignment {
        let hashes = messages.map(message_hashes).unwrap_or_default();
        self.assign_hashed(headers, messages.map(|m| (m, hashes.as_slice())))
    }

    /// [`SessionTracker::assign`] with each message's hash given: `(messages, message_hashes(messages))`.
    pub fn assign_hashed(&self, headers: &HeaderMap, messages: Option<(&[&str], &[u128])>) -> Assignment {
        match self.assign_or_keys(headers, messages, true) {
            Ok(assignment) => assignment,
            Err(_) => unreachable!("a new session is registered when asked to"),
        }
    }

    /// [`SessionTracker::assign_hashed`] for a request of a session in memory; a request that would
    /// start a new session is not registered and gets the keys of its message prefixes instead, to be
    /// looked up where other processes record their sessions (a shared archive). Seed the sessions
    /// found there ([`SessionTracker::seed`]), then assign with [`SessionTracker::assign_hashed`].
    pub fn assign_known(
        &self,
        headers: &HeaderMap,
        messages: Option<(&[&str], &[u128])>,
    ) -> Result<Assignment, Vec<u64>> {
        self.assign_or_keys(headers, messages, false)
    }

    fn assign_or_keys(
        &self,
        headers: &HeaderMap,
        messages: Option<(&[&str], &[u128])>,
        register_new: bool,
    ) -> Result<Assignment, Vec<u64>> {
        let explicit = self.header_session(headers);
        let Some((messages, hashes)) = messages else {
            let (session, how) = match explicit {
                Some(s) => {
                    let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
                    inner.forget_evicted();
                    (inner.bind(s, credential_tag(headers)), Assigned::Header)
                }
                None => (new_session_id(), Assigned::New),
            };
            return Ok(Assignment { session, key_req: None, how });
        };
        let prefixes = prefix_keys(&self.message_keys_hashed(messages, hashes));
        let key_req = prefixes.last().copied();
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.forget_evicted();
        let explicit = explicit.map(|s| inner.bind(s, credential_tag(headers)));
        let (session, how) = match explicit {
            Some(s) => (s, Assigned::Header),
            None => choose(&mut inner, &prefixes, opening(messages)),
        };
        if how == Assigned::New && !register_new {
            return Err(prefixes);
        }
        let tracked = inner.touch(&session);
        if let Some(key) = key_req {
            lock(&tracked).pending.push(key);
            inner.pending.entry(key).or_default().push(session.clone());
            inner.register_req(&session, key);
        }
        inner.charge(&session);
        Ok(Assignment { session, key_req, how })
    }

    /// The answer to a request completed: register "request + answer" as the session's head.
    /// Returns the ext key (stored with the response, so the tracker can be rebuilt).
    pub fn answered(&self, session: &str, key_req: Option<u64>, answer: &Value) -> Option<u64> {
        self.answered_with(session, key_req, std::slice::from_ref(answer))
    }

    /// [`SessionTracker::answered`] with an answer of several neutral messages (a Responses
    /// answer's output items).
    pub fn answered_with(&self, session: &str, key_req: Option<u64>, answer: &[Value]) -> Option<u64> {
        let key_req = key_req?;
        let ext = answer.iter().fold(key_req, |acc, m| chain_key(acc, message_key_value(m)));
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.forget_evicted();
        forget_pending(&mut inner, session, key_req);
        inner.register_ext(session, ext);
        inner.charge(session);
        Some(ext)
    }

    /// The request got no usable answer (error, cut short): it no longer waits.
    pub fn unanswered(&self, session: &str, key_req: Option<u64>) {
        if let Some(key) = key_req {
            let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            forget_pending(&mut inner, session, key);
        }
    }

    /// Rebuild a session's state from its stored keys, in the order of its records.
    pub fn seed(&self, session: &str, keys: impl IntoIterator<Item = StoredKey>) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.forget_evicted();
        for key in keys {
            match key {
                StoredKey::Request(key) => inner.register_req(session, key),
                StoredKey::Answer(key) => inner.register_ext(session, key),
            }
        }
        inner.charge(session);
    }

    /// Number of sessions currently tracked in memory.
    pub fn n_tracked(&self) -> usize {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).budget.count(Holder::Tracker)
    }
}

fn forget_pending(inner: &mut Inner, session: &str, key: u64) {
    if let Some(part) = inner.tracked(session) {
        let mut tracked = lock(&part);
        if let Some(pos) = tracked.pending.iter().position(|k| *k == key) {
            tracked.pending.remove(pos);
        }
    }
    remove_from(&mut inner.pending, key, session);
}

/// How many leading messages are a request's opening: those up to its first user message (all of
/// them without one).
fn opening(messages: &[&str]) -> usize {
    messages.iter().position(|m| crate::neutral::role_of(m) == "user").map_or(messages.len(), |idx| idx + 1)
}

/// The session of a request whose message-prefix keys are `prefixes` and whose first `opening`
/// messages are its opening (see the module docs).
fn choose(inner: &mut Inner, prefixes: &[u64], opening: usize) -> (String, Assigned) {
    let whole = prefixes.len();
    for (idx, key) in prefixes.iter().enumerate().rev() {
        let len = idx + 1;
        if let Some(candidates) = inner.ext.get(key) {
            let head = candidates.iter().find(|s| inner.tracked(s).is_some_and(|t| lock(&t).head == Some(*key)));
            if let Some(session) = head.cloned() {
                lock(&inner.touch(&session)).head = None;
                return (session, Assigned::Extends);
            }
            if let Some(session) = candidates.last().cloned() {
                return (session, Assigned::Branch);
            }
        }
        let proper = len < whole;
        let evicted = inner.evicted_heads.peek(key).is_some_and(|(_, head)| *head == Head::Answer || proper);
        if evicted && let Some((session, _)) = inner.evicted_heads.pop(key) {
            return (session, Assigned::Extends);
        }
        if !proper {
            continue;
        }
        if let Some(candidates) = inner.req.get(key) {
            let head = candidates.iter().find(|s| inner.tracked(s).is_some_and(|t| lock(&t).req_head == Some(*key)));
            if let Some(session) = head.cloned() {
                let part = inner.touch(&session);
                let mut t = lock(&part);
                t.req_head = None;
                let how = if t.pending.contains(key) { Assigned::Pending } else { Assigned::Extends };
                return (session, how);
            }
            if len > opening
                && let Some(session) = candidates.last().cloned()
            {
                return (session, Assigned::Branch);
            }
        }
    }
    let proper = prefixes.len().saturating_sub(1);
    for key in prefixes[..proper].iter().rev() {
        if let Some(candidates) = inner.pending.get(key)
            && let [only] = candidates.as_slice()
        {
            return (only.clone(), Assigned::Pending);
        }
    }
    (new_session_id(), Assigned::New)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A message read in place keys as the same message read into a `Value` does, and the usual
    /// message is read in place.
    #[test]
    fn messages_read_in_place_key_as_their_values_do() {
        let in_place = [
            r#"{"role":"user","content":"  hi\n"}"#,
            r#"{"role":"tool","tool_call_id":"call_1","content":"line \"one\"\n\ttwo \u00e9\ud83d\ude00","name":"x"}"#,
            r#"{"content":null,"role":"assistant","reasoning_content":"think","refusal":null}"#,
            r#" {"role":"assistant","tool_calls":null,"content":"done","cache_control":{"type":"ephemeral"}}"#,
            r#"{}"#,
            r#"{"role":"assistant","content":null,"tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{\"b\": 1, \"a\": 2}"}}]}"#,
            r#"{"role":"assistant","content":"two","tool_calls":[{"id":"a","function":{"name":"f","arguments":"not json"},"index":0},{"function":null},{"id":"b","function":{"arguments":null}},{}]}"#,
            r#"{"role":"assistant","tool_calls":[],"content":"none"}"#,
        ];
        let by_value = [
            r#"{"role":"assistant","tool_calls":[{"id":"c","function":{"name":"f","arguments":{"a":1}}}]}"#,
            r#"{"role":"assistant","tool_calls":[{"id":1,"function":{"name":"f","arguments":"{}"}}]}"#,
            r#"{"role":"assistant","tool_calls":[{"id":"c","id":"d","function":{"name":"f","arguments":"{}"}}]}"#,
            r#"{"role":"assistant","tool_calls":["c"]}"#,
            r#"{"role":"assistant","tool_calls":{"id":"c"}}"#,
            r#"{"role":"assistant","tool_calls":[{"id":"c","function":"f"}]}"#,
            r#"{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"u"}}]}"#,
            r#"{"role":"user","content":"first","content":"second"}"#,
            r#"{"role":7,"content":"x"}"#,
            r#"{"role":"user","content":"x","tool_call_id":3}"#,
            r#"{"role":"user","content":12}"#,
            r#"["user","hi",null,null]"#,
            r#""just text""#,
            r#"{"role":"user","content":"cut"#,
        ];
        for raw in in_place {
            assert!(plain_message_key(raw).is_some(), "read in place: {raw}");
        }
        for raw in by_value {
            assert!(plain_message_key(raw).is_none(), "read into a Value: {raw}");
        }
        for raw in in_place.iter().chain(&by_value) {
            let want = match serde_json::from_str::<Value>(raw) {
                Ok(v @ Value::Object(_)) => message_key_value(&v),
                _ => xxh3_64(raw.as_bytes()),
            };
            assert_eq!(message_key(raw), want, "{raw}");
        }
    }

    /// A key is the hash of the message's normalized parts and their separators, one byte string:
    /// the archive stores keys, and a pare that reads them must compute the same ones.
    #[test]
    fn a_key_hashes_the_normalized_parts_and_their_separators() {
        let raw = r#"{"role":"assistant","content":" hi\n","tool_call_id":"x","tool_calls":[{"id":"c","function":{"name":"f","arguments":"{\"a\": 1}"}}]}"#;
        let want = xxh3_64(b"assistant\xffhi\xffc\xfef\xfe{\"a\":1}\xfd\xffx");
        assert_eq!(message_key(raw), want);
        assert_eq!(message_key_value(&serde_json::from_str(raw).unwrap()), want);
    }

    proptest::proptest! {
        /// Whatever the texts, a message read in place keys as its `Value` does.
        #[test]
        fn any_plain_message_keys_as_its_value(role in ".{0,8}", content in proptest::option::of(".{0,64}"),
                                               id in proptest::option::of("[a-z0-9_]{0,8}")) {
            let mut message = json!({"role": role, "content": content});
            if let Some(id) = id {
                message["tool_call_id"] = json!(id);
            }
            let raw = message.to_string();
            proptest::prop_assert_eq!(plain_message_key(&raw), Some(message_key_value(&message)));
        }

        /// Whatever the calls' ids, names and arguments (JSON or not), an assistant message with
        /// tool calls read in place keys as its `Value` does.
        #[test]
        fn any_plain_tool_calls_key_as_their_value(content in proptest::option::of(".{0,32}"),
                                                   calls in proptest::collection::vec(
                                                       (".{0,8}", ".{0,8}", "[ {}\\[\\]\":,a-c0-9]{0,24}"), 0..4)) {
            let calls: Vec<Value> = calls
                .into_iter()
                .map(|(id, name, arguments)| json!({"id": id, "type": "function",
                                                    "function": {"name": name, "arguments": arguments}}))
                .collect();
            let message = json!({"role": "assistant", "content": content, "tool_calls": calls});
            let raw = message.to_string();
            proptest::prop_assert_eq!(plain_message_key(&raw), Some(message_key_value(&message)));
        }
    }

    fn tracker() -> SessionTracker {
        SessionTracker::new(&ArchiveConfig::default())
    }

    fn body(messages: &[Value]) -> Vec<u8> {
        serde_json::to_vec(&json!({"model": "m", "messages": messages})).unwrap()
    }

    fn assign(t: &SessionTracker, messages: &[Value]) -> Assignment {
        let bytes = body(messages);
        let parsed = crate::wire::ChatBody::parse(&bytes).unwrap();
        t.assign(&HeaderMap::new(), Some(parsed.messages()))
    }

    fn sys() -> Value {
        json!({"role": "system", "content": "you are an agent"})
    }
    fn user(s: &str) -> Value {
        json!({"role": "user", "content": s})
    }
    fn call(id: &str) -> Value {
        json!({"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function", "function": {"name": "read_file", "arguments": "{\"path\": \"a.py\"}"}}]})
    }
    fn result(id: &str, out: &str) -> Value {
        json!({"role": "tool", "tool_call_id": id, "name": "read_file", "content": out})
    }

    #[test]
    fn normalization_ignores_cosmetic_differences() {
        let a = json!({"role": "tool", "tool_call_id": "c1", "name": "read_file", "content": "out"});
        let b = json!({"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "out\n"}]});
        assert_eq!(message_key_value(&a), message_key_value(&b));
        let c1 = json!({"role": "assistant", "content": "", "tool_calls": [{"id": "x", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}], "reasoning_content": "hmm"});
        let c2 = json!({"role": "assistant", "content": null, "tool_calls": [{"id": "x", "function": {"name": "f", "arguments": "{\"a\":1}"}}]});
        assert_eq!(message_key_value(&c1), message_key_value(&c2));
        assert_ne!(
            message_key_value(&a),
            message_key_value(&json!({"role": "tool", "tool_call_id": "c2", "content": "out"}))
        );
        assert_ne!(message_key_value(&user("a")), message_key_value(&json!({"role": "system", "content": "a"})));
    }

    #[test]
    fn a_request_extending_request_plus_answer_joins_the_session() {
        let t = tracker();
        let first = assign(&t, &[sys(), user("fix it")]);
        assert_eq!(first.how, Assigned::New);
        t.answered(&first.session, first.key_req, &call("c1"));
        let second = assign(&t, &[sys(), user("fix it"), call("c1"), result("c1", "code")]);
        assert_eq!((second.session.as_str(), second.how), (first.session.as_str(), Assigned::Extends));
        // Hermes resumes without the tool `name`: still the same session.
        t.answered(&second.session, second.key_req, &call("c2"));
        let third = assign(
            &t,
            &[
                sys(),
                user("fix it"),
                call("c1"),
                json!({"role": "tool", "tool_call_id": "c1", "content": "code"}),
                call("c2"),
                result("c2", "more"),
            ],
        );
        assert_eq!((third.session.as_str(), third.how), (first.session.as_str(), Assigned::Extends));
    }

    /// A Responses answer with an item pare does not read (an opaque entry) and a message, echoed
    /// by the next request as the client re-serializes it: the request extends request + answer.
    #[test]
    fn an_answer_with_an_opaque_item_is_extended_by_its_echo() {
        let t = tracker();
        let input = json!([{"role": "user", "content": [{"type": "input_text", "text": "fix it"}]}]);
        let request = |input: &Value| serde_json::to_vec(&json!({"model": "m", "input": input})).unwrap();
        let assign = |bytes: &[u8]| {
            let parsed = crate::wire::responses::ResponsesBody::parse(bytes).unwrap();
            t.assign(&HeaderMap::new(), Some(&crate::wire::WireBody::messages(&parsed)))
        };
        let first = assign(&request(&input));
        let output = json!([
            {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search", "query": "pare"}},
            {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
             "content": [{"type": "output_text", "text": "Done.", "annotations": []}]}
        ]);
        // The answer's neutral messages, as the archive reads them from its output items.
        let answer = serde_json::to_vec(&json!({"input": output})).unwrap();
        let parsed = crate::wire::responses::ResponsesBody::parse(&answer).unwrap();
        let messages: Vec<Value> =
            crate::wire::WireBody::messages(&parsed).iter().map(|m| serde_json::from_str(m).unwrap()).collect();
        assert_eq!(messages.len(), 2, "{messages:?}");
        let ext = t.answered_with(&first.session, first.key_req, &messages).unwrap();
        // The client sends the items back spaced its own way, and asks again.
        let mut echoed: Vec<Value> = input.as_array().unwrap().clone();
        echoed.extend(output.as_array().unwrap().iter().cloned());
        echoed.push(json!({"role": "user", "content": [{"type": "input_text", "text": "thanks"}]}));
        let spaced = serde_json::to_vec_pretty(&json!({"model": "m", "input": echoed})).unwrap();
        let second = assign(&spaced);
        assert_eq!((second.session.as_str(), second.how), (first.session.as_str(), Assigned::Extends));
        // By the key of request + answer, not only by the request's.
        let parsed = crate::wire::responses::ResponsesBody::parse(&spaced).unwrap();
        let keys = t.message_keys(&crate::wire::WireBody::messages(&parsed));
        assert_eq!(prefix_keys(&keys)[2], ext, "the echo keys as the answer did");
    }

    #[test]
    fn identical_openings_start_separate_sessions_and_stay_apart() {
        let t = tracker();
        let a1 = assign(&t, &[sys(), user("same")]);
        let b1 = assign(&t, &[sys(), user("same")]);
        assert_ne!(a1.session, b1.session);
        assert_eq!(b1.how, Assigned::New);
        // Identical answers: both sessions now have the same head.
        t.answered(&a1.session, a1.key_req, &call("c1"));
        t.answered(&b1.session, b1.key_req, &call("c1"));
        let a2 = assign(&t, &[sys(), user("same"), call("c1"), result("c1", "A")]);
        let b2 = assign(&t, &[sys(), user("same"), call("c1"), result("c1", "B")]);
        assert_eq!(a2.session, a1.session, "the first to answer is continued first");
        assert_eq!(b2.session, b1.session);
        assert_eq!((a2.how, b2.how), (Assigned::Extends, Assigned::Extends));
    }

    #[test]
    fn a_regenerate_is_a_branch_of_the_same_session() {
        let t = tracker();
        let s = assign(&t, &[sys(), user("go")]);
        t.answered(&s.session, s.key_req, &call("c1"));
        let r2 = assign(&t, &[sys(), user("go"), call("c1"), result("c1", "x")]);
        t.answered(&r2.session, r2.key_req, &call("c2"));
        let again = assign(&t, &[sys(), user("go"), call("c1"), result("c1", "x")]);
        assert_eq!((again.session.as_str(), again.how), (s.session.as_str(), Assigned::Branch));
    }

    #[test]
    fn a_request_overtaking_its_answer_joins_the_only_pending_session() {
        let t = tracker();
        let s = assign(&t, &[sys(), user("go")]);
        let next = assign(&t, &[sys(), user("go"), call("c1"), result("c1", "x")]);
        assert_eq!((next.session.as_str(), next.how), (s.session.as_str(), Assigned::Pending));
    }

    #[test]
    fn explicit_header_wins_and_is_validated() {
        let t = tracker();
        let mut headers = HeaderMap::new();
        headers.insert("x-pare-session", "agent-7".parse().unwrap());
        let bytes = body(&[sys(), user("x")]);
        let parsed = crate::wire::ChatBody::parse(&bytes).unwrap();
        let a = t.assign(&headers, Some(parsed.messages()));
        assert_eq!((a.session.as_str(), a.how), ("agent-7", Assigned::Header));
        headers.insert("x-pare-session", "../../etc/passwd".parse().unwrap());
        let b = t.assign(&headers, Some(parsed.messages()));
        assert_ne!(b.session, "../../etc/passwd");
        assert!(valid_session_id(&b.session));
        assert!(!valid_session_id(""));
        assert!(!valid_session_id(".hidden"));
        assert!(!valid_session_id(&"a".repeat(129)));
    }

    /// Regression: a client that sent its own body under another's `x-pare-session` reset that
    /// session's compaction and landed in its records. A session named by a header belongs to the
    /// credential that opened it; another credential gets a session of its own.
    #[test]
    fn a_session_named_by_a_header_is_bound_to_the_credential_that_opened_it() {
        let t = tracker();
        let bytes = body(&[sys(), user("x")]);
        let parsed = crate::wire::ChatBody::parse(&bytes).unwrap();
        let with = |key: Option<&str>| {
            let mut headers = HeaderMap::new();
            headers.insert("x-pare-session", "agent-7".parse().unwrap());
            if let Some(key) = key {
                headers.insert("authorization", format!("Bearer {key}").parse().unwrap());
            }
            headers
        };
        let owner = t.assign(&with(Some("sk-owner")), Some(parsed.messages()));
        assert_eq!(owner.session, "agent-7");
        let other = t.assign(&with(Some("sk-other")), Some(parsed.messages()));
        let tag = credential_tag(&with(Some("sk-other")));
        assert_eq!((other.session.clone(), other.how), (bound_session_id("agent-7", tag), Assigned::Header));
        assert!(valid_session_id(&other.session) && !other.session.contains("sk-other"));
        assert_eq!(t.assign(&with(Some("sk-other")), Some(parsed.messages())).session, other.session);
        assert_eq!(t.assign(&with(Some("sk-owner")), Some(parsed.messages())).session, "agent-7");
        let anonymous = t.assign(&with(None), None);
        assert_ne!(anonymous.session, "agent-7", "no credential is not the owner's either");
        assert_eq!(bound_session_id(&"a".repeat(128), tag).len(), 128);
    }

    #[test]
    fn the_tracker_is_bounded_and_forgets_evicted_sessions() {
        // Room for two sessions of two keys each (the request's, its answer's), after the memo's
        // reservation.
        let reserved = KEY_MEMO as u64 * KEY_MEMO_ENTRY_BYTES + EVICTED_HEADS as u64 * (KEY_BYTES + 32);
        let per_session = crate::memory::SESSION_OVERHEAD_BYTES + 2 * (KEY_BYTES + 26);
        let budget = Arc::new(StateBudget::new(reserved + 2 * per_session));
        let t = SessionTracker::with_budget(&ArchiveConfig::default(), budget.clone());
        let first = assign(&t, &[sys(), user("one")]);
        t.answered(&first.session, first.key_req, &call("c1"));
        for n in 0..3 {
            let s = assign(&t, &[sys(), user(&format!("other {n}"))]);
            t.answered(&s.session, s.key_req, &call("c1"));
        }
        assert_eq!(t.n_tracked(), 2);
        assert_eq!(budget.stats().evictions, 2);
        // The evicted session's keys are gone, its head is not: its next request joins it again.
        let late = assign(&t, &[sys(), user("one"), call("c1"), result("c1", "x")]);
        assert_eq!((late.session.as_str(), late.how), (first.session.as_str(), Assigned::Extends));
    }

    fn text(s: &str) -> Value {
        json!({"role": "assistant", "content": s})
    }

    /// Regression: an agent that sends back another assistant message than the answer pare
    /// recorded (re-rendered, trimmed, or an upstream's answer the agent does not go on with)
    /// started a new session with every request.
    #[test]
    fn a_request_whose_echo_differs_from_the_answer_continues_its_session() {
        let t = tracker();
        let first = assign(&t, &[sys(), user("go")]);
        t.answered(&first.session, first.key_req, &text("recorded answer"));
        let mut messages = vec![sys(), user("go"), call("c1"), result("c1", "x")];
        let second = assign(&t, &messages);
        assert_eq!((second.session.as_str(), second.how), (first.session.as_str(), Assigned::Extends));
        t.answered(&second.session, second.key_req, &text("another recorded answer"));
        messages.extend([call("c2"), result("c2", "y")]);
        let third = assign(&t, &messages);
        assert_eq!((third.session.as_str(), third.how), (first.session.as_str(), Assigned::Extends));
    }

    /// Regression: a request whose predecessor's answer was never recorded (a cut stream) started a
    /// new session once that request no longer waited.
    #[test]
    fn a_request_after_a_lost_answer_continues_its_session() {
        let t = tracker();
        let first = assign(&t, &[sys(), user("go")]);
        t.unanswered(&first.session, first.key_req);
        let second = assign(&t, &[sys(), user("go"), call("c1"), result("c1", "x")]);
        assert_eq!((second.session.as_str(), second.how), (first.session.as_str(), Assigned::Extends));
        t.unanswered(&second.session, second.key_req);
        let third = assign(&t, &[sys(), user("go"), call("c1"), result("c1", "x"), call("c2"), result("c2", "y")]);
        assert_eq!((third.session.as_str(), third.how), (first.session.as_str(), Assigned::Extends));
    }

    /// Two conversations with the same opening and no recorded answers each keep their own
    /// session, and a third one that shares the opening but whose first request pare never saw
    /// does not join either (an opening alone continues only a session whose last request it is).
    #[test]
    fn identical_openings_stay_apart_without_recorded_answers() {
        let t = tracker();
        let a1 = assign(&t, &[sys(), user("same")]);
        let b1 = assign(&t, &[sys(), user("same")]);
        assert_ne!(a1.session, b1.session);
        for s in [&a1, &b1] {
            t.answered(&s.session, s.key_req, &text("not what the agents send back"));
        }
        let a2 = assign(&t, &[sys(), user("same"), call("c1"), result("c1", "A")]);
        let b2 = assign(&t, &[sys(), user("same"), call("c1"), result("c1", "B")]);
        assert_eq!((a2.session.as_str(), b2.session.as_str()), (a1.session.as_str(), b1.session.as_str()));
        let b3 = assign(&t, &[sys(), user("same"), call("c1"), result("c1", "B"), call("c2"), result("c2", "b")]);
        let a3 = assign(&t, &[sys(), user("same"), call("c1"), result("c1", "A"), call("c2"), result("c2", "a")]);
        assert_eq!((a3.session.as_str(), b3.session.as_str()), (a1.session.as_str(), b1.session.as_str()));
        let c2 = assign(&t, &[sys(), user("same"), call("c1"), result("c1", "C")]);
        assert_eq!(c2.how, Assigned::New);
        assert!(c2.session != a1.session && c2.session != b1.session);
    }

    /// A request sent again (a regenerate) joins its session as a branch when the agent's echo
    /// differs from the recorded answers too.
    #[test]
    fn a_regenerate_is_a_branch_when_the_echo_differs() {
        let t = tracker();
        let s = assign(&t, &[sys(), user("go")]);
        t.answered(&s.session, s.key_req, &text("recorded"));
        let second = [sys(), user("go"), call("c1"), result("c1", "x")];
        let r2 = assign(&t, &second);
        t.answered(&r2.session, r2.key_req, &text("recorded too"));
        let third = [&second[..], &[call("c2"), result("c2", "y")]].concat();
        let r3 = assign(&t, &third);
        t.answered(&r3.session, r3.key_req, &text("recorded again"));
        let again = assign(&t, &third);
        assert_eq!((again.session.as_str(), again.how), (s.session.as_str(), Assigned::Branch));
    }

    /// The request keys the archive stores bring the new linking back after a restart.
    #[test]
    fn request_keys_link_a_differing_echo_after_a_restart() {
        let before = tracker();
        let first = assign(&before, &[sys(), user("go")]);
        let ext = before.answered(&first.session, first.key_req, &text("recorded")).unwrap();
        let messages = [sys(), user("go"), call("c1"), result("c1", "x")];
        let second = assign(&before, &messages);
        let after = tracker();
        let keys = [StoredKey::Request(first.key_req.unwrap()), StoredKey::Answer(ext)];
        after.seed(&first.session, keys.into_iter().chain([StoredKey::Request(second.key_req.unwrap())]));
        let next = assign(&after, &[&messages[..], &[call("c2"), result("c2", "y")]].concat());
        assert_eq!((next.session.as_str(), next.how), (first.session.as_str(), Assigned::Extends));
    }

    #[test]
    fn seeding_restores_matching_after_a_restart() {
        let before = tracker();
        let s = assign(&before, &[sys(), user("go")]);
        let ext = before.answered(&s.session, s.key_req, &call("c1")).unwrap();
        let after = tracker();
        after.seed(&s.session, [StoredKey::Request(s.key_req.unwrap()), StoredKey::Answer(ext)]);
        let next = assign(&after, &[sys(), user("go"), call("c1"), result("c1", "x")]);
        assert_eq!((next.session.as_str(), next.how), (s.session.as_str(), Assigned::Extends));
    }

    /// A replica that does not know a session (another one served it) gets the keys to look it up
    /// and registers nothing; seeded with what the archive stores, the request joins that session.
    #[test]
    fn a_replica_finds_a_session_it_never_saw_through_its_stored_keys() {
        let a = tracker();
        let first = assign(&a, &[sys(), user("go")]);
        let ext = a.answered(&first.session, first.key_req, &call("c1")).unwrap();
        let b = tracker();
        let next = [sys(), user("go"), call("c1"), result("c1", "x")];
        let bytes = body(&next);
        let parsed = crate::wire::ChatBody::parse(&bytes).unwrap();
        let (refs, hashes) = (parsed.messages(), message_hashes(parsed.messages()));
        let keys = b.assign_known(&HeaderMap::new(), Some((refs, &hashes))).unwrap_err();
        assert_eq!(keys.len(), next.len());
        assert!(keys.contains(&ext), "the prefix keys hold the session's ext key");
        assert_eq!(b.n_tracked(), 0, "nothing registered for a request that would start a session");
        b.seed(&first.session, [StoredKey::Request(first.key_req.unwrap()), StoredKey::Answer(ext)]);
        let joined = b.assign_known(&HeaderMap::new(), Some((refs, &hashes))).unwrap();
        assert_eq!((joined.session.as_str(), joined.how), (first.session.as_str(), Assigned::Extends));
    }
}
