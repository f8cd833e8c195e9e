//! Token counts of o200k_base and cl100k_base text, as `bpe-openai` computes them, without its two
//! per-piece costs.
//!
//! `bpe_openai::Tokenizer::count` splits a text with the encoding's pre-tokenization regex and counts
//! each piece with `bpe`'s backtracking encoder. Two things in that loop cost more than the counting
//! on the texts pare meets (a cold request tokenizes about 200k tokens of them, on every core):
//!
//! - **the regex's cache pool**: each piece is one `Regex::find`, which takes a search cache from the
//!   regex's pool and puts it back. Only the thread that built the regex has a lock-free slot; on any
//!   other thread of the rayon pool every piece locks a mutex. Here the split is a forward lazy DFA
//!   (`regex_automata::hybrid`, what the meta regex would run for these anchored searches, without its
//!   strategy layer or its reverse automata), and each thread keeps its own [`Cache`] for it;
//! - **two allocations per piece**: the backtracking encoder allocates its token vector and bit field
//!   even for a piece that is one token — most pieces: words, numbers, punctuation runs. Here a piece
//!   found whole in the vocabulary counts 1 without the encoder (tiktoken's own encoder takes the same
//!   shortcut, and a test checks every token of both vocabularies counts 1 with `bpe`).
//!
//! The split patterns are `bpe-openai` 0.3's (MIT), which rewrites tiktoken's negative look-ahead
//! `\s+(?!\S)` as a pattern that matches one character more and drops it. The tests hold the counts
//! equal to `bpe-openai`'s and to tiktoken's on arbitrary text, so a pattern drifting from the crate
//! it mirrors fails them.

use std::cell::RefCell;
use std::sync::LazyLock;

use bpe_openai::Tokenizer;
use regex_automata::hybrid::dfa::{Cache, DFA};
use regex_automata::nfa::thompson;
use regex_automata::{Anchored, Input, MatchKind};
use rustc_hash::FxHashSet;

/// One encoding: its pre-tokenizer, its byte-pair encoding and its vocabulary as a set of byte strings.
pub(super) struct Counter {
    split: DFA,
    tokenizer: &'static Tokenizer,
    vocabulary: FxHashSet<&'static [u8]>,
    /// Which slot of the per-thread caches is this counter's.
    slot: usize,
}

/// Index of the look-ahead pattern in both splits: its match ends with one character too many.
const LOOKAHEAD: usize = 1;

pub(super) static O200K: LazyLock<Counter> = LazyLock::new(|| {
    let words = [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+$",
    ]
    .join("|");
    Counter::new(&words, bpe_openai::o200k_base(), 0)
});

pub(super) static CL100K: LazyLock<Counter> = LazyLock::new(|| {
    let words =
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+$";
    Counter::new(words, bpe_openai::cl100k_base(), 1)
});

thread_local! {
    /// Each thread's search caches, one per encoding (slot), made on the thread's first count.
    static CACHES: RefCell<[Option<Cache>; 2]> = const { RefCell::new([None, None]) };
}

impl Counter {
    fn new(words: &str, tokenizer: &'static Tokenizer, slot: usize) -> Counter {
        // Pattern 0: words, numbers, punctuation, newlines; 1: whitespace not followed by a
        // non-space (one character too many, dropped); 2: the remaining whitespace.
        // Leftmost-first, as the meta regex: the end of an anchored forward search is the end of the
        // match it would find, and the pattern that matched. A lazy DFA may give up when its cache
        // thrashes; told never to, it clears the cache and goes on (see `count` for what is left).
        let split = DFA::builder()
            .configure(DFA::config().match_kind(MatchKind::LeftmostFirst).minimum_cache_clear_count(None))
            .thompson(thompson::Config::new().which_captures(thompson::WhichCaptures::None))
            .build_many(&[words, r"\s+\s", r"\s+"])
            .expect("the split patterns are valid");
        let bpe = &tokenizer.bpe;
        let vocabulary = (0..bpe.num_tokens() as u32).map(|id| bpe.token_bytes(id)).collect();
        Counter { split, tokenizer, vocabulary, slot }
    }

    /// Tokens of `text` (special tokens counted as text), equal to `bpe_openai`'s `count`.
    pub(super) fn count(&self, text: &str) -> usize {
        // The DFA stops only on a quit byte (these patterns have none: no Unicode word boundary) or
        // when it gives up (told not to): should it ever, bpe-openai counts the text instead.
        self.split_count(text).unwrap_or_else(|| self.tokenizer.count(text))
    }

    fn split_count(&self, text: &str) -> Option<usize> {
        CACHES.with_borrow_mut(|caches| {
            let cache = caches[self.slot].get_or_insert_with(|| self.split.create_cache());
            let mut tokens = 0;
            let mut at = 0;
            while at < text.len() {
                // A fresh haystack from `at`, as bpe-openai searches: `$` and anchoring see the same text.
                let input = Input::new(&text[at..]).anchored(Anchored::Yes);
                let Some(found) = self.split.try_search_fwd(cache, &input).ok()? else { break };
                let mut end = at + found.offset();
                if found.pattern().as_usize() == LOOKAHEAD {
                    end -= text[at..end].chars().next_back().map_or(0, char::len_utf8);
                }
                if end == at {
                    // No pattern matches empty text; stop rather than loop should one ever do.
                    break;
                }
                let piece = &text.as_bytes()[at..end];
                tokens += if self.vocabulary.contains(piece) { 1 } else { self.tokenizer.bpe.count(piece) };
                at = end;
            }
            Some(tokens)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shortcut's premise, on every token of both vocabularies: a piece that is one token is
    /// counted as one by the byte-pair encoder.
    #[test]
    fn every_vocabulary_token_counts_one() {
        for counter in [&*O200K, &*CL100K] {
            let bpe = &counter.tokenizer.bpe;
            let many: Vec<u32> =
                (0..bpe.num_tokens() as u32).filter(|&id| bpe.count(bpe.token_bytes(id)) != 1).collect();
            assert!(
                many.is_empty(),
                "{} tokens count more than one, e.g. {:?}",
                many.len(),
                &many[..many.len().min(5)]
            );
        }
    }

    /// Each thread searches with its own cache, both encodings interleaved on every thread: the
    /// counts are the same as one thread's.
    #[test]
    fn threads_count_alike() {
        let texts: Vec<String> = (0..64)
            .map(|i| format!("line {i}: let value_{i} = compute(&input[{i}..]);\n    \t ").repeat(i % 7 + 1))
            .collect();
        let expected: Vec<(usize, usize)> = texts.iter().map(|t| (O200K.count(t), CL100K.count(t))).collect();
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..4)
                .map(|k| {
                    let texts = &texts;
                    scope.spawn(move || {
                        texts
                            .iter()
                            .cycle()
                            .skip(k * 5)
                            .take(texts.len())
                            .map(|t| (O200K.count(t), CL100K.count(t)))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            for (k, handle) in handles.into_iter().enumerate() {
                let got = handle.join().expect("a counting thread panicked");
                let want: Vec<(usize, usize)> =
                    expected.iter().cycle().skip(k * 5).take(texts.len()).copied().collect();
                assert_eq!(got, want, "thread {k}");
            }
        });
    }

    #[test]
    fn counts_equal_bpe_openai_on_mixed_text() {
        let text =
            "fn main() {\n    println!(\"héllo, wörld\");  \n}\n\n\tIt's 12345 tokens — 日本語 😀 /usr/bin \r\n  ";
        for (counter, reference) in [(&*O200K, bpe_openai::o200k_base()), (&*CL100K, bpe_openai::cl100k_base())] {
            for end in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
                assert_eq!(counter.count(&text[..end]), reference.count(&text[..end]), "{:?}", &text[..end]);
            }
        }
    }
}
