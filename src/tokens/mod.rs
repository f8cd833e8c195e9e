//! Token counting, cached per message.
//!
//! o200k_base and cl100k_base are counted with `bpe-openai`'s byte-pair encoder, which produces the
//! same token counts as tiktoken (a test holds the two equal on arbitrary text) 2.5–3× faster on
//! code-like text, driven by `bpe`: it splits the text with a lazy DFA and a per-thread
//! cache (no regex pool lock per piece) and counts a piece that is one token without the encoder.
//! Cold requests tokenize everything, and tokenizing is most of their cost. tiktoken-rs is the
//! reference in tests (a dev-dependency); the GPT-3-era p50k/r50k encodings are not counted.
//!
//! Counts follow OpenAI's chat accounting (the cookbook's `num_tokens_from_messages`): 3 tokens of
//! framing per message, the role, the text, 1 more for a `name` (plus the name), and per tool call its
//! name, its arguments and 1; 3 tokens of reply priming per request ([`REPLY_PRIMING`]). Media parts
//! (images, audio, documents, in every wire's spelling: [`media`]) count a fixed estimate by kind and
//! are never tokenized as text. Counts are cached by a hash of the message's
//! raw bytes in a bounded LRU, so a warm request only tokenizes the messages it adds.

mod bpe;
pub mod media;

use std::num::NonZeroUsize;
use std::str::FromStr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use lru::LruCache;
use rayon::prelude::*;
use serde_json::Value;
use serde_json::value::RawValue;
use xxhash_rust::xxh3::xxh3_128;

use crate::neutral::{Content, Message, message_hashes};
pub use media::{MediaKind, MediaTokens};

/// Counts tokens of request parts as the upstream would see them.
pub trait CountTokens: Send + Sync {
    /// Tokens of one message (its raw JSON), per-message overhead included.
    fn message(&self, raw_json: &str) -> u64;
    /// Tokens of the `tools` array (raw JSON), counted once per distinct schema.
    fn tools(&self, raw_json: &str) -> u64;
}

/// A tokenizer-free estimate: one token per 4 bytes of JSON (rounded up), plus the per-message framing.
/// Deterministic and nearly free, for tests and benchmarks that measure the engine rather than the
/// tokenizer.
#[derive(Debug, Clone, Copy, Default)]
pub struct QuarterCounter;

impl CountTokens for QuarterCounter {
    fn message(&self, raw_json: &str) -> u64 {
        raw_json.len().div_ceil(4) as u64 + TOKENS_PER_MESSAGE
    }
    fn tools(&self, raw_json: &str) -> u64 {
        raw_json.len().div_ceil(4) as u64
    }
}

/// Tokens OpenAI adds once per request to prime the reply (`<|start|>assistant<|message|>`).
pub const REPLY_PRIMING: u64 = 3;
/// Framing tokens per message.
pub const TOKENS_PER_MESSAGE: u64 = 3;
/// Extra token when a message carries a `name`.
pub const TOKENS_PER_NAME: u64 = 1;
/// Extra token per tool call.
pub const TOKENS_PER_TOOL_CALL: u64 = 1;

/// Tokens of a whole request: its messages, its `tools` (when present) and the reply priming.
pub fn request_tokens<M: AsRef<str>>(counter: &dyn CountTokens, messages: &[M], tools: Option<&str>) -> u64 {
    let messages: u64 = messages.iter().map(|m| counter.message(m.as_ref())).sum();
    messages + tools.map_or(0, |t| counter.tools(t)) + REPLY_PRIMING
}

/// A tiktoken encoding pare can count with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Encoding {
    /// GPT-4o and later; also a good estimate for most recent open models.
    O200kBase,
    /// GPT-4 / GPT-3.5.
    Cl100kBase,
}

/// An encoding name pare does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown encoding `{0}` (expected `o200k_base` or `cl100k_base`)")]
pub struct UnknownEncoding(pub String);

impl FromStr for Encoding {
    type Err = UnknownEncoding;
    fn from_str(name: &str) -> Result<Encoding, UnknownEncoding> {
        match name {
            "o200k_base" | "o200k" => Ok(Encoding::O200kBase),
            "cl100k_base" | "cl100k" => Ok(Encoding::Cl100kBase),
            other => Err(UnknownEncoding(other.to_owned())),
        }
    }
}

impl Encoding {
    /// Tokens of a plain text (special tokens are counted as text), with the process-wide
    /// tokenizer of this encoding (built on first use, then shared).
    pub fn count(self, text: &str) -> usize {
        match self {
            Encoding::O200kBase => bpe::O200K.count(text),
            Encoding::Cl100kBase => bpe::CL100K.count(text),
        }
    }

    /// The encoding's tiktoken name.
    pub fn name(self) -> &'static str {
        match self {
            Encoding::O200kBase => "o200k_base",
            Encoding::Cl100kBase => "cl100k_base",
        }
    }
}

/// Tuning of a [`TokenCounter`].
#[derive(Debug, Clone)]
pub struct CounterConfig {
    pub encoding: Encoding,
    /// Tokens counted for one media part of each kind (never tokenized as text). OpenAI charges an
    /// image 85 + 170 per 512-px tile; 765 is a 1024×1024 image at high detail.
    pub media: MediaTokens,
    /// Messages whose counts are remembered (least recently used are forgotten).
    pub cache_entries: usize,
}

impl Default for CounterConfig {
    fn default() -> Self {
        CounterConfig { encoding: Encoding::O200kBase, media: MediaTokens::default(), cache_entries: 131_072 }
    }
}

/// The tiktoken counter with a bounded per-message cache.
pub struct TokenCounter {
    encoding: Encoding,
    media: MediaTokens,
    cache_entries: usize,
    /// xxh3-128 of the raw bytes → tokens. Separate entries for messages and tool schemas cannot
    /// collide in practice (128-bit hashes), and both are keyed by their exact bytes.
    cache: Mutex<LruCache<u128, u64>>,
    tokenizations: AtomicU64,
}

/// Bytes of one count-cache entry, as [`TokenCounter::cache_bytes`] reserves them.
const CACHE_ENTRY_BYTES: u64 = 80;

/// Uncached bytes from which [`TokenCounter::count_uncached`] counts a batch on the rayon pool
/// (≈ 32k tokens, about 3 ms of work on one core); a smaller batch is counted on demand.
pub const PARALLEL_COUNT_BYTES: usize = 128 * 1024;

impl std::fmt::Debug for TokenCounter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenCounter")
            .field("encoding", &self.encoding)
            .field("tokenizations", &self.tokenizations())
            .finish_non_exhaustive()
    }
}

impl TokenCounter {
    pub fn new(config: &CounterConfig) -> TokenCounter {
        let capacity = NonZeroUsize::new(config.cache_entries.max(1)).expect("max(1) is non-zero");
        TokenCounter {
            encoding: config.encoding,
            media: config.media,
            cache_entries: capacity.get(),
            cache: Mutex::new(LruCache::new(capacity)),
            tokenizations: AtomicU64::new(0),
        }
    }

    /// Count every message of `messages` that is not cached yet, on all cores (the rayon pool);
    /// later [`CountTokens::message`] calls then hit the cache. A cold request (a restart, a new
    /// session) tokenizes its whole history at once: that is the one place where counting is long
    /// enough (≈ 20 ms for 200k tokens) to be worth splitting. A batch under
    /// [`PARALLEL_COUNT_BYTES`] is left to be counted on demand. Returns, in order, each message's
    /// count where it is known now (cached, or counted here), so that a caller summing them does not
    /// hash every message a second time.
    pub fn count_uncached<M: AsRef<str> + Sync>(&self, messages: &[M]) -> Vec<Option<u64>> {
        self.count_uncached_hashed(messages, &message_hashes(messages))
    }

    /// [`TokenCounter::count_uncached`] with each message's hash given (`hashes[i]` is
    /// [`message_hashes`] of `messages[i]`).
    fn count_uncached_hashed<M: AsRef<str> + Sync>(&self, messages: &[M], keys: &[u128]) -> Vec<Option<u64>> {
        let mut counts: Vec<Option<u64>> = {
            let mut cache = self.lock();
            keys.iter().map(|key| cache.get(key).copied()).collect()
        };
        let mut seen = std::collections::HashSet::new();
        let todo: Vec<(u128, &str)> = (0..messages.len())
            .filter(|&i| counts[i].is_none() && seen.insert(keys[i]))
            .map(|i| (keys[i], messages[i].as_ref()))
            .collect();
        if todo.len() < 2 || todo.iter().map(|(_, m)| m.len()).sum::<usize>() < PARALLEL_COUNT_BYTES {
            return counts;
        }
        let counted: std::collections::HashMap<u128, u64> =
            todo.par_iter().map(|(key, m)| (*key, self.count_message(m))).collect();
        self.tokenizations.fetch_add(counted.len() as u64, Ordering::Relaxed);
        {
            let mut cache = self.lock();
            for (key, n) in &counted {
                cache.put(*key, *n);
            }
        }
        for (count, key) in counts.iter_mut().zip(keys) {
            if count.is_none() {
                *count = counted.get(key).copied();
            }
        }
        counts
    }

    /// Each message's tokens (`hashes[i]` is [`message_hashes`] of `messages[i]`). `known` holds
    /// (hash, tokens) of messages counted before, in order — a session's previous request: the
    /// leading messages with the same hashes take their counts from it without a cache lookup; the
    /// rest are read from the cache or counted (together, as [`TokenCounter::count_uncached`]).
    pub fn message_counts<M: AsRef<str> + Sync>(
        &self,
        messages: &[M],
        hashes: &[u128],
        known: &[(u128, u64)],
    ) -> Vec<u64> {
        let counts = self.known_counts(hashes, known);
        self.fill_counts(messages, hashes, counts)
    }

    /// The counts [`TokenCounter::message_counts`] finds without tokenizing: from `known` (the
    /// leading messages with the same hashes) or the cache; `None` for a message never counted.
    pub fn known_counts(&self, hashes: &[u128], known: &[(u128, u64)]) -> Vec<Option<u64>> {
        let n_known = known.iter().zip(hashes).take_while(|((a, _), b)| a == *b).count();
        let mut cache = self.lock();
        let rest = hashes[n_known..].iter().map(|key| cache.get(key).copied());
        known[..n_known].iter().map(|(_, n)| Some(*n)).chain(rest).collect()
    }

    /// `counts` ([`TokenCounter::known_counts`]) with each `None` counted: together on all cores
    /// when they weigh [`PARALLEL_COUNT_BYTES`] or more, else one by one.
    pub fn fill_counts<M: AsRef<str> + Sync>(
        &self,
        messages: &[M],
        hashes: &[u128],
        mut counts: Vec<Option<u64>>,
    ) -> Vec<u64> {
        let missing: Vec<usize> = (0..counts.len()).filter(|&i| counts[i].is_none()).collect();
        if missing.len() > 1 {
            let texts: Vec<&str> = missing.iter().map(|&i| messages[i].as_ref()).collect();
            let keys: Vec<u128> = missing.iter().map(|&i| hashes[i]).collect();
            for (i, n) in missing.into_iter().zip(self.count_uncached_hashed(&texts, &keys)) {
                counts[i] = n;
            }
        }
        counts
            .into_iter()
            .zip(messages.iter().zip(hashes))
            .map(|(n, (m, key))| n.unwrap_or_else(|| self.cached_by(*key, || self.count_message(m.as_ref()))))
            .collect()
    }

    /// A message's tokens through the cache (`key` is its [`message_hashes`] hash).
    pub fn message_hashed(&self, key: u128, raw: &str) -> u64 {
        self.cached_by(key, || self.count_message(raw))
    }

    /// At least as many tokens as [`CountTokens::message`] counts for `raw`, without tokenizing:
    /// the same framing, each text counted as its length in bytes (a token is at least one byte).
    pub fn message_bound(&self, raw: &str) -> u64 {
        self.count_message_with(raw, |text| text.len() as u64)
    }

    /// [`request_tokens`] of a whole request, each message hashed once: the uncached ones are
    /// counted together ([`TokenCounter::count_uncached`]), the rest read from the cache.
    pub fn count_request<M: AsRef<str> + Sync>(&self, messages: &[M], tools: Option<&str>) -> u64 {
        let messages: u64 = self.message_counts(messages, &message_hashes(messages), &[]).iter().sum();
        messages + tools.map_or(0, |t| self.tools(t)) + REPLY_PRIMING
    }

    pub fn encoding(&self) -> Encoding {
        self.encoding
    }

    /// Bytes the count cache takes when full (key, count, the LRU's node and map slot per entry).
    pub fn cache_bytes(&self) -> u64 {
        self.cache_entries as u64 * CACHE_ENTRY_BYTES
    }

    /// How many texts this counter has tokenized (cache misses); lets tests prove the cache works.
    pub fn tokenizations(&self) -> u64 {
        self.tokenizations.load(Ordering::Relaxed)
    }

    /// Tokens of a plain text, uncached.
    pub fn text(&self, text: &str) -> u64 {
        self.encoding.count(text) as u64
    }

    fn cached(&self, raw: &str, count: impl FnOnce() -> u64) -> u64 {
        self.cached_by(xxh3_128(raw.as_bytes()), count)
    }

    /// The count cached under `key` (the hash of the counted bytes), else `count()`, cached.
    fn cached_by(&self, key: u128, count: impl FnOnce() -> u64) -> u64 {
        if let Some(n) = self.lock().get(&key) {
            return *n;
        }
        self.tokenizations.fetch_add(1, Ordering::Relaxed);
        let n = count();
        self.lock().put(key, n);
        n
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LruCache<u128, u64>> {
        // A panic while holding the lock cannot leave the cache inconsistent: keep using it.
        self.cache.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Uncached count of one message.
    fn count_message(&self, raw: &str) -> u64 {
        self.count_message_with(raw, |text| self.text(text))
    }

    /// One message's tokens, each of its texts counted by `text`.
    fn count_message_with(&self, raw: &str, count: impl Fn(&str) -> u64) -> u64 {
        let Ok(message) = Message::from_raw(raw) else {
            // Not a message object (an opaque entry): the upstream will see its JSON, media aside.
            return TOKENS_PER_MESSAGE + self.count_json_text(raw, &count);
        };
        let mut n = TOKENS_PER_MESSAGE + count(&message.role);
        match &message.content {
            Some(Content::Text(text)) => n += count(text),
            Some(Content::Parts(parts)) => {
                for part in parts {
                    if let Some(text) = &part.text {
                        n += count(text);
                    } else if let Some(kind) = media::kind_of_part(part.kind.as_deref(), &part.extra) {
                        n += self.media.of(kind);
                    } else if !part.extra.is_empty() {
                        n += self.count_json(Value::Object(part.extra.clone()), &count);
                    }
                }
            }
            Some(Content::Other(Value::Null)) | None => {}
            Some(Content::Other(other)) => n += self.count_json(other.clone(), &count),
        }
        if let Some(name) = &message.name {
            n += TOKENS_PER_NAME + count(name);
        }
        for call in message.tool_calls.iter().flatten() {
            n += TOKENS_PER_TOOL_CALL;
            if let Some(function) = &call.function {
                n += count(&function.name);
                n += match &function.arguments {
                    Value::String(s) => count(s),
                    Value::Null => 0,
                    other => count(&other.to_string()),
                };
            }
        }
        for reasoning in [&message.reasoning_content, &message.reasoning].into_iter().flatten() {
            n += match reasoning {
                Value::String(s) => count(s),
                Value::Null => 0,
                other => count(&other.to_string()),
            };
        }
        n
    }

    /// Tokens of a JSON text as the upstream sees it: its media parts by their estimates, the rest
    /// as text.
    fn count_json_text(&self, json: &str, count: &impl Fn(&str) -> u64) -> u64 {
        if !media::may_hold_media(json) {
            return count(json);
        }
        match serde_json::from_str::<Value>(json) {
            Ok(value) => self.count_json(value, count),
            Err(_) => count(json),
        }
    }

    /// [`TokenCounter::count_json_text`] of a parsed value.
    fn count_json(&self, mut value: Value, count: &impl Fn(&str) -> u64) -> u64 {
        let media = media::take_media(&mut value, &self.media);
        media + count(&value.to_string())
    }

    /// Uncached count of a `tools` array: each distinct schema once (through the cache).
    fn count_tools(&self, raw: &str) -> u64 {
        match serde_json::from_str::<Vec<&RawValue>>(raw) {
            Ok(tools) => tools.iter().map(|tool| self.cached(tool.get(), || self.text(tool.get()))).sum(),
            Err(_) => self.text(raw),
        }
    }
}

impl CountTokens for TokenCounter {
    fn message(&self, raw_json: &str) -> u64 {
        self.cached(raw_json, || self.count_message(raw_json))
    }

    fn tools(&self, raw_json: &str) -> u64 {
        // The whole array is cached too, so the common case (same tools every request) is one lookup.
        self.cached(raw_json, || self.count_tools(raw_json))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counter() -> TokenCounter {
        TokenCounter::new(&CounterConfig::default())
    }

    #[test]
    fn encoding_names_parse_and_unknown_is_named() {
        assert_eq!("o200k_base".parse::<Encoding>(), Ok(Encoding::O200kBase));
        assert_eq!("cl100k_base".parse::<Encoding>(), Ok(Encoding::Cl100kBase));
        let err = "gpt2".parse::<Encoding>().unwrap_err();
        assert!(err.to_string().contains("`gpt2`"));
    }

    #[test]
    fn unparseable_message_counts_its_text() {
        let c = counter();
        assert_eq!(c.message("42"), TOKENS_PER_MESSAGE + c.text("42"));
    }

    #[test]
    fn a_large_batch_counted_on_threads_matches_counting_one_by_one() {
        // Distinct messages, over PARALLEL_COUNT_BYTES in all, plus a repeated one.
        let messages: Vec<String> = (0..400)
            .map(|i| {
                let text =
                    format!("line {i}: let value_{i} = compute(&input[{i}..]); // ünïcode {}\n", "x".repeat(i % 7))
                        .repeat(40);
                serde_json::json!({"role": if i % 2 == 0 { "tool" } else { "assistant" }, "content": text}).to_string()
            })
            .chain(std::iter::once(r#"{"role":"user","content":"again"}"#.to_owned()).cycle().take(3))
            .collect();
        assert!(messages.iter().map(String::len).sum::<usize>() > PARALLEL_COUNT_BYTES);
        let one_by_one = counter();
        let expected: Vec<u64> = messages.iter().map(|m| one_by_one.message(m)).collect();

        let batched = counter();
        let known = batched.count_uncached(&messages);
        assert_eq!(batched.tokenizations(), 401, "each distinct message tokenized once");
        assert_eq!(known, expected.iter().map(|n| Some(*n)).collect::<Vec<_>>(), "every count returned");
        let got: Vec<u64> = messages.iter().map(|m| batched.message(m)).collect();
        assert_eq!(got, expected);
        assert_eq!(batched.tokenizations(), 401, "every later count is a cache hit");

        batched.count_uncached(&messages);
        assert_eq!(batched.tokenizations(), 401, "nothing left to count");
    }

    #[test]
    fn a_small_batch_is_left_to_be_counted_on_demand() {
        let c = counter();
        let hi = r#"{"role":"user","content":"hi"}"#;
        assert_eq!(c.count_uncached(&[hi]), vec![None]);
        assert_eq!(c.tokenizations(), 0);
        // A whole request counts it on demand, once, and reads it back from the cache after.
        let tools = r#"[{"type":"function","function":{"name":"f","parameters":{}}}]"#;
        assert_eq!(c.count_request(&[hi, hi], Some(tools)), request_tokens(&counter(), &[hi, hi], Some(tools)));
        assert_eq!(c.count_uncached(&[hi]), vec![Some(c.message(hi))]);
    }

    /// A session's earlier counts answer the leading messages whose hashes they share, and only
    /// those (the count given for a hash is taken as it is: no lookup, no tokenizing).
    #[test]
    fn known_counts_answer_the_leading_messages_with_the_same_hashes() {
        let c = counter();
        let messages = [
            r#"{"role":"user","content":"a"}"#,
            r#"{"role":"user","content":"b c"}"#,
            r#"{"role":"tool","content":"d"}"#,
        ];
        let hashes = message_hashes(&messages);
        let fresh = c.message_counts(&messages, &hashes, &[]);
        assert_eq!(fresh, messages.iter().map(|m| c.message(m)).collect::<Vec<_>>());
        let known = [(hashes[0], 1000), (hashes[2], 2000)];
        assert_eq!(c.message_counts(&messages, &hashes, &known), vec![1000, fresh[1], fresh[2]]);
        assert_eq!(c.message_counts(&messages[..1], &hashes[..1], &known), vec![1000]);
    }

    /// Regression: a Gemini `inlineData` image of 400 KB counted 370,094 tokens (its base64 as
    /// text), and so did audio and documents on every wire; each counts its kind's estimate.
    #[test]
    fn media_parts_count_their_estimate_not_their_base64() {
        let c = counter();
        let data = "iVBORw0KGgo".repeat(40_000);
        let media = MediaTokens::default();
        for (part, estimate) in [
            (format!(r#"{{"inlineData":{{"mimeType":"image/png","data":"{data}"}}}}"#), media.image),
            (format!(r#"{{"type":"input_audio","input_audio":{{"data":"{data}","format":"wav"}}}}"#), media.audio),
            (format!(r#"{{"type":"document","source":{{"type":"base64","data":"{data}"}}}}"#), media.document),
        ] {
            let with = c.message(&format!(r#"{{"role":"user","content":[{{"text":"look"}},{part}]}}"#));
            let without = c.message(r#"{"role":"user","content":[{"text":"look"}]}"#);
            assert_eq!(with, without + estimate, "{}", &part[..40]);
            let opaque = c.message(&format!("[{part}]"));
            assert_eq!(opaque, TOKENS_PER_MESSAGE + c.text("[]") + estimate, "an opaque entry: {}", &part[..40]);
            assert!(c.message_bound(&format!("[{part}]")) >= opaque);
        }
    }

    #[test]
    fn null_content_and_missing_content_count_the_same() {
        let c = counter();
        assert_eq!(c.message(r#"{"role":"assistant","content":null}"#), c.message(r#"{"role":"assistant"}"#));
    }
}
