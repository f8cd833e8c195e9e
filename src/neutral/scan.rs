//! The fast path of [`Split::parse`](crate::wire::Split::parse): one pass over the body that checks
//! it is valid JSON and finds the top-level keys and the bytes of each message, without building any
//! value.
//!
//! A long agent request is mostly strings (tool outputs) full of escapes: the engine bench's request
//! has a quote or backslash every 12 bytes. serde_json's raw-value parse of it costs about 6.6
//! instructions per byte; this scan about 4.6, because between two escapes it only looks for the
//! next quote, backslash or control character, eight bytes at a time, and validates an escape in
//! place.
//!
//! The scan accepts a subset of what serde_json accepts and gives the same slices (a raw value starts
//! at its first byte and ends after its last, without surrounding whitespace). Whenever it meets
//! something it does not handle — invalid JSON, an escaped or repeated top-level key, a `messages`
//! that is not an array, nesting deeper than [`MAX_DEPTH`], more than [`MAX_TOP_LEVEL_KEYS`] keys — it
//! declines, and the caller parses with serde_json, which then also words the error.

use std::borrow::Cow;

/// The top level of a body as the scan finds it around its conversation array (the list key).
#[derive(Debug)]
pub(crate) struct Scanned<'a> {
    /// The other keys (without their quotes; they contain no escapes) and their raw values.
    pub fields: Vec<(Cow<'a, str>, &'a str)>,
    /// Position of the array among the keys, as in [`Split`](crate::wire::Split).
    pub array_idx: usize,
    /// The array as it is in the body, brackets included.
    pub array_raw: &'a str,
    /// Each element of the array.
    pub elements: Vec<&'a str>,
}

/// Where a scan starts again in a body whose leading bytes are those of a body the scan accepted:
/// inside the conversation array, right after one of its elements. Byte offsets into both bodies.
#[derive(Debug, Clone)]
pub(crate) struct Resume<'r> {
    /// The top-level keys before the array and their values' (start, end).
    pub fields: &'r [(String, (usize, usize))],
    /// Where the array starts (its `[`).
    pub array_start: usize,
    /// The elements kept, (start, end) each, in order; the scan goes on after the last one. Not empty.
    pub elements: &'r [(usize, usize)],
}

/// Deeper nesting is left to serde_json (whose raw-value parse has no depth limit); the scan recurses
/// once per level, so this also bounds its stack.
const MAX_DEPTH: usize = 128;

/// A chat request has a dozen top-level keys; many more are left to serde_json, so the duplicate
/// check here can stay a linear search.
const MAX_TOP_LEVEL_KEYS: usize = 64;

/// Split `body`, or `None` when the scan declines (see the module's doc).
#[cfg(test)]
pub(crate) fn split<'a>(body: &'a [u8], list_key: &str) -> Option<Scanned<'a>> {
    split_resumed(body, list_key, None)
}

/// Split `body`, or `None` when the scan declines, scanning only what follows `resume` when given:
/// the caller vouches that `body` starts with the bytes of a body this scan accepted up to the end
/// of `resume`'s last element (and one byte more when that element ends in a digit, which a number
/// could go on with), so that the scan would reach the same state there. The whole body is still
/// checked to be UTF-8.
pub(crate) fn split_resumed<'a>(body: &'a [u8], list_key: &str, resume: Option<&Resume<'_>>) -> Option<Scanned<'a>> {
    let text = std::str::from_utf8(body).ok()?;
    let mut s = Scanner { bytes: body, at: 0 };
    let mut fields: Vec<(Cow<'a, str>, &'a str)> = Vec::new();
    let mut array = None;
    let mut end = false;
    if let Some(resume) = resume {
        let slice = |(start, end): (usize, usize)| text.get(start..end);
        for (key, value) in resume.fields {
            fields.push((Cow::Owned(key.clone()), slice(*value)?));
        }
        let kept = resume.elements.iter().map(|span| slice(*span)).collect::<Option<Vec<_>>>()?;
        s.at = resume.elements.last()?.1;
        s.whitespace();
        let elements = match s.next()? {
            b',' => {
                s.whitespace();
                s.more_elements(text, kept)?
            }
            b']' => kept,
            _ => return None,
        };
        array = Some((fields.len(), text.get(resume.array_start..s.at)?, elements));
        end = s.after_member()?;
    } else {
        s.whitespace();
        s.expect(b'{')?;
        s.whitespace();
    }
    while !end {
        let key_start = s.at;
        s.string()?;
        let key = &text[key_start + 1..s.at - 1];
        let repeated = key == list_key && array.is_some() || fields.iter().any(|(k, _)| k == key);
        if key.as_bytes().contains(&b'\\') || repeated || fields.len() == MAX_TOP_LEVEL_KEYS {
            return None;
        }
        s.whitespace();
        s.expect(b':')?;
        s.whitespace();
        if key == list_key {
            let start = s.at;
            let elements = s.elements(text)?;
            array = Some((fields.len(), &text[start..s.at], elements));
        } else {
            let start = s.at;
            s.value(1)?;
            fields.push((Cow::Borrowed(key), &text[start..s.at]));
        }
        end = s.after_member()?;
    }
    s.whitespace();
    if s.at != body.len() {
        return None;
    }
    let (array_idx, array_raw, elements) = array?;
    Some(Scanned { fields, array_idx, array_raw, elements })
}

/// A validating reader over JSON bytes (valid UTF-8), also used by the typed message read of
/// [`super::read`]. Every method returns `None` at anything it does not accept, leaving `at` anywhere.
pub(crate) struct Scanner<'a> {
    pub(super) bytes: &'a [u8],
    pub(super) at: usize,
}

impl<'a> Scanner<'a> {
    pub(super) fn new(bytes: &'a [u8]) -> Scanner<'a> {
        Scanner { bytes, at: 0 }
    }

    pub(super) fn peek(&self) -> Option<u8> {
        self.bytes.get(self.at).copied()
    }

    pub(super) fn next(&mut self) -> Option<u8> {
        let b = self.peek()?;
        self.at += 1;
        Some(b)
    }

    pub(super) fn expect(&mut self, byte: u8) -> Option<()> {
        (self.next()? == byte).then_some(())
    }

    /// JSON's four whitespace bytes.
    pub(super) fn whitespace(&mut self) {
        while let Some(b' ' | b'\n' | b'\t' | b'\r') = self.peek() {
            self.at += 1;
        }
    }

    /// After a top-level member: `true` at the object's closing brace, `false` after a comma.
    fn after_member(&mut self) -> Option<bool> {
        self.whitespace();
        match self.next()? {
            b',' => {
                self.whitespace();
                Some(false)
            }
            b'}' => Some(true),
            _ => None,
        }
    }

    /// The elements of the array starting here, each as its raw text.
    fn elements<'t>(&mut self, text: &'t str) -> Option<Vec<&'t str>> {
        self.expect(b'[')?;
        self.whitespace();
        if self.peek()? == b']' {
            self.at += 1;
            return Some(Vec::new());
        }
        self.more_elements(text, Vec::new())
    }

    /// `out` followed by the elements from here (the start of one) to the end of the array.
    fn more_elements<'t>(&mut self, text: &'t str, mut out: Vec<&'t str>) -> Option<Vec<&'t str>> {
        loop {
            let start = self.at;
            self.value(2)?;
            out.push(&text[start..self.at]);
            self.whitespace();
            match self.next()? {
                b',' => self.whitespace(),
                b']' => return Some(out),
                _ => return None,
            }
        }
    }

    /// One value at nesting `depth` (the top-level object is 1).
    pub(super) fn value(&mut self, depth: usize) -> Option<()> {
        match self.peek()? {
            b'"' => self.string(),
            b'-' | b'0'..=b'9' => self.number(),
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            open @ (b'{' | b'[') if depth < MAX_DEPTH => {
                let close = if open == b'{' { b'}' } else { b']' };
                self.at += 1;
                self.whitespace();
                if self.peek()? == close {
                    self.at += 1;
                    return Some(());
                }
                loop {
                    if open == b'{' {
                        self.string()?;
                        self.whitespace();
                        self.expect(b':')?;
                        self.whitespace();
                    }
                    self.value(depth + 1)?;
                    self.whitespace();
                    match self.next()? {
                        b',' => self.whitespace(),
                        b if b == close => return Some(()),
                        _ => return None,
                    }
                }
            }
            _ => None,
        }
    }

    pub(super) fn literal(&mut self, word: &[u8]) -> Option<()> {
        self.bytes[self.at..].starts_with(word).then(|| self.at += word.len())
    }

    /// `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?`; what follows is the caller's to check.
    fn number(&mut self) -> Option<()> {
        if self.peek() == Some(b'-') {
            self.at += 1;
        }
        match self.next()? {
            b'0' => {}
            b'1'..=b'9' => self.digits(),
            _ => return None,
        }
        if self.peek() == Some(b'.') {
            self.at += 1;
            self.some_digits()?;
        }
        if let Some(b'e' | b'E') = self.peek() {
            self.at += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.at += 1;
            }
            self.some_digits()?;
        }
        Some(())
    }

    fn digits(&mut self) {
        while self.peek().is_some_and(|b| b.is_ascii_digit()) {
            self.at += 1;
        }
    }

    fn some_digits(&mut self) -> Option<()> {
        let start = self.at;
        self.digits();
        (self.at > start).then_some(())
    }

    /// The string starting here: an opening quote, no control character, only JSON's escapes. The
    /// bytes are valid UTF-8 already (the whole body was checked).
    pub(super) fn string(&mut self) -> Option<()> {
        let bytes = self.bytes;
        if bytes.get(self.at) != Some(&b'"') {
            return None;
        }
        let mut at = self.at + 1;
        loop {
            // The next quote, backslash or control character: eight bytes at a time, the last few one
            // by one. (The loop of `next_stop`, written in place: this one runs over every string of
            // every body, and the compiler keeps `at` in a register here.)
            let stop = loop {
                if at + 8 <= bytes.len() {
                    let word = u64::from_le_bytes(bytes[at..at + 8].try_into().expect("eight bytes"));
                    match stops(word) {
                        0 => at += 8,
                        mask => {
                            at += mask.trailing_zeros() as usize / 8;
                            break bytes[at];
                        }
                    }
                } else {
                    match *bytes.get(at)? {
                        b @ (b'"' | b'\\' | 0..0x20) => break b,
                        _ => at += 1,
                    }
                }
            };
            match stop {
                b'"' => {
                    self.at = at + 1;
                    return Some(());
                }
                b'\\' => match *bytes.get(at + 1)? {
                    escaped if SHORT_ESCAPES[usize::from(escaped)] != 0 => at += 2,
                    b'u' => {
                        // Any four hex digits, as serde_json's raw-value parse: whether a surrogate is
                        // paired matters only to whoever decodes the string.
                        let hex = bytes.get(at + 2..at + 6)?;
                        if !hex.iter().all(u8::is_ascii_hexdigit) {
                            return None;
                        }
                        at += 6;
                    }
                    _ => return None,
                },
                _ => return None,
            }
        }
    }

    /// The string starting here, decoded into the start of `out` as serde_json decodes it into a
    /// `String`, and its decoded length: the checks of [`Scanner::string`], and `None` as well when
    /// `out` is not at least eight bytes longer than the string's raw text (a caller sizes it from the
    /// text it reads). A `\u` escape of an unpaired surrogate, which serde_json refuses, decodes as
    /// U+FFFD: what serde_json reads from [`lone_surrogates_replaced`] of the text.
    /// The bytes written are UTF-8 when the scanner's bytes are.
    ///
    /// The string's plain bytes are copied eight at a time as they are searched for the next escape,
    /// and an escape is decoded in place; serde_json's reader copies the run before each escape with
    /// a call and the whole string once more at the end. On the engine bench's messages (an escape
    /// every dozen bytes) the typed read built on this takes 6.7 M instructions where serde_json's
    /// derive took 9.8 M.
    pub(super) fn decode_string(&mut self, out: &mut [u8]) -> Option<usize> {
        let bytes = self.bytes;
        if bytes.get(self.at) != Some(&b'"') {
            return None;
        }
        // Writes go by index into a buffer sized by the caller, the length kept in a register: a
        // `Vec`'s capacity check and length store on every eight bytes cost more than the copy.
        let mut len = 0;
        let mut at = self.at + 1;
        loop {
            let stop = if let Some(chunk) = bytes.get(at..at + 8) {
                let chunk: [u8; 8] = chunk.try_into().expect("eight bytes");
                // Copied whole, then cut back to the stop: one fixed-size store, no copy call.
                out.get_mut(len..len + 8)?.copy_from_slice(&chunk);
                match stops(u64::from_le_bytes(chunk)) {
                    0 => {
                        at += 8;
                        len += 8;
                        continue;
                    }
                    mask => {
                        let plain = mask.trailing_zeros() as usize / 8;
                        len += plain;
                        at += plain;
                        bytes[at]
                    }
                }
            } else {
                match *bytes.get(at)? {
                    b @ (b'"' | b'\\' | 0..0x20) => b,
                    b => {
                        *out.get_mut(len)? = b;
                        len += 1;
                        at += 1;
                        continue;
                    }
                }
            };
            match stop {
                b'"' => {
                    self.at = at + 1;
                    return Some(len);
                }
                b'\\' => {
                    let escaped = *bytes.get(at + 1)?;
                    // The one-letter escapes by a table: a data load, where a `match` on the letter
                    // is an indirect jump that mispredicts on mixed escapes (`\n`, `\"`, `\\`).
                    let short = SHORT_ESCAPES[usize::from(escaped)];
                    if short != 0 {
                        *out.get_mut(len)? = short;
                        len += 1;
                        at += 2;
                        continue;
                    }
                    if escaped != b'u' {
                        return None;
                    }
                    let (c, n) = match hex4(bytes, at + 2)? {
                        // A pair when the low half follows as the next escape; otherwise a lone
                        // surrogate, read as U+FFFD (see `lone_surrogates_replaced`).
                        high @ 0xD800..0xDC00 => match low_half(bytes, at + 6) {
                            Some(low) => (char::from_u32(0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00))?, 12),
                            None => (char::REPLACEMENT_CHARACTER, 6),
                        },
                        0xDC00..0xE000 => (char::REPLACEMENT_CHARACTER, 6),
                        code => (char::from_u32(code)?, 6),
                    };
                    // A `\u` escape (six bytes) is never shorter than what it decodes to (at most
                    // four), so this stays within the bytes the caller sized the buffer for.
                    let width = c.len_utf8();
                    c.encode_utf8(out.get_mut(len..len + width)?);
                    len += width;
                    at += n;
                }
                _ => return None,
            }
        }
    }
}

/// Appends `s` to `out` as a JSON string literal, quotes included, byte for byte as serde_json writes
/// it: `"` and `\` escaped, the control characters as `\b`, `\f`, `\n`, `\r`, `\t` or `\u00xx`,
/// everything else as it is. The plain runs between two such bytes are found eight bytes at a time
/// and copied whole, where serde_json looks each byte up in a table.
pub fn push_json_string(out: &mut String, s: &str) {
    let bytes = s.as_bytes();
    out.reserve(s.len() + 2);
    out.push('"');
    let mut run = 0;
    let mut at = 0;
    while let Some(stop) = next_stop(bytes, &mut at) {
        // Every stop is an ASCII byte: the run ends on a char boundary.
        out.push_str(&s[run..at]);
        match stop {
            b'"' => out.push_str("\\\""),
            b'\\' => out.push_str("\\\\"),
            b'\n' => out.push_str("\\n"),
            b'\r' => out.push_str("\\r"),
            b'\t' => out.push_str("\\t"),
            0x08 => out.push_str("\\b"),
            0x0c => out.push_str("\\f"),
            control => {
                const HEX: &[u8; 16] = b"0123456789abcdef";
                out.push_str("\\u00");
                out.push(char::from(HEX[usize::from(control >> 4)]));
                out.push(char::from(HEX[usize::from(control & 0xf)]));
            }
        }
        at += 1;
        run = at;
    }
    out.push_str(&s[run..]);
    out.push('"');
}

/// Whether `literal`, a JSON string literal (quotes included), is what [`push_json_string`] writes
/// for the text it stands for: every escape one that writer uses (`\"`, `\\`, `\n`, `\r`, `\t`,
/// `\b`, `\f`, and `\u00xx` in lowercase for the other control characters) and nothing else
/// escaped. Such a literal can be taken as it is where pare would decode it and write it again.
pub fn written_as_pare_writes(literal: &str) -> bool {
    let Some(inner) = literal.strip_prefix('"').and_then(|l| l.strip_suffix('"')) else { return false };
    let bytes = inner.as_bytes();
    let mut at = 0;
    while let Some(stop) = next_stop(bytes, &mut at) {
        if stop != b'\\' {
            return false;
        }
        at += 1;
        match bytes.get(at) {
            Some(b'"' | b'\\' | b'n' | b'r' | b't' | b'b' | b'f') => at += 1,
            Some(b'u') => {
                // `\u00xx` in lowercase, for a control character written with no short escape.
                let written = match bytes.get(at + 1..at + 5) {
                    Some(&[b'0', b'0', high @ (b'0' | b'1'), low @ (b'0'..=b'9' | b'a'..=b'f')]) => {
                        let low = if low <= b'9' { low - b'0' } else { low - b'a' + 10 };
                        !matches!((high - b'0') << 4 | low, 0x08 | 0x09 | 0x0a | 0x0c | 0x0d)
                    }
                    _ => false,
                };
                if !written {
                    return false;
                }
                at += 5;
            }
            _ => return false,
        }
    }
    true
}

/// Moves `at` to the next quote, backslash or control character of a string's bytes and returns it:
/// eight bytes at a time, the last few one by one. `None` at the end of the bytes.
#[inline(always)]
fn next_stop(bytes: &[u8], at: &mut usize) -> Option<u8> {
    loop {
        if *at + 8 <= bytes.len() {
            let word = u64::from_le_bytes(bytes[*at..*at + 8].try_into().expect("eight bytes"));
            match stops(word) {
                0 => *at += 8,
                mask => {
                    *at += mask.trailing_zeros() as usize / 8;
                    return Some(bytes[*at]);
                }
            }
        } else {
            match *bytes.get(*at)? {
                b @ (b'"' | b'\\' | 0..0x20) => return Some(b),
                _ => *at += 1,
            }
        }
    }
}

/// What each one-letter JSON escape (`\n`, `\"`…) stands for, by its letter; 0 for the others.
static SHORT_ESCAPES: [u8; 256] = {
    let mut table = [0u8; 256];
    table[b'"' as usize] = b'"';
    table[b'\\' as usize] = b'\\';
    table[b'/' as usize] = b'/';
    table[b'b' as usize] = 0x08;
    table[b'f' as usize] = 0x0c;
    table[b'n' as usize] = b'\n';
    table[b'r' as usize] = b'\r';
    table[b't' as usize] = b'\t';
    table
};

/// The four hex digits at `at` (of a `\u` escape) as a number.
/// The low half of a surrogate pair as the `\u` escape at `at`, when there is one.
fn low_half(bytes: &[u8], at: usize) -> Option<u32> {
    if bytes.get(at..at + 2) != Some(b"\\u") {
        return None;
    }
    hex4(bytes, at + 2).filter(|low| (0xDC00..0xE000).contains(low))
}

/// `json` with every `\u` escape of an unpaired surrogate (`\udc80` alone, `\ud800` not followed
/// by a low half) written `\ufffd`, so that serde_json reads it: JSON's grammar allows any four
/// hex digits (tool outputs carry such escapes when a program printed undecodable bytes), but a
/// Rust string cannot hold a lone surrogate and serde_json refuses to decode one. Where pare shows
/// or matches the text, a lone surrogate then reads as U+FFFD, as `Scanner::decode_string` reads
/// it; the bytes pare forwards unchanged keep the escape. Borrowed when there is none (the usual
/// case, found with one search for `\ud`).
pub fn lone_surrogates_replaced(json: &str) -> Cow<'_, str> {
    let bytes = json.as_bytes();
    if !(memchr::memmem::find(bytes, b"\\ud").is_some() || memchr::memmem::find(bytes, b"\\uD").is_some()) {
        return Cow::Borrowed(json);
    }
    let mut out: Option<String> = None;
    let (mut at, mut copied) = (0, 0);
    while let Some(found) = memchr::memchr(b'\\', &bytes[at..]) {
        at += found;
        if bytes.get(at + 1) != Some(&b'u') {
            // Any other escape is two bytes (an escaped backslash included).
            at += 2;
            continue;
        }
        let lone = match hex4(bytes, at + 2) {
            Some(0xD800..0xDC00) if low_half(bytes, at + 6).is_some() => {
                at += 12;
                continue;
            }
            Some(0xD800..0xE000) => true,
            _ => false,
        };
        if lone {
            let out = out.get_or_insert_with(|| String::with_capacity(json.len()));
            out.push_str(&json[copied..at]);
            out.push_str("\\ufffd");
            copied = at + 6;
        }
        at += 6;
    }
    match out {
        Some(mut out) => {
            out.push_str(&json[copied..]);
            Cow::Owned(out)
        }
        None => Cow::Borrowed(json),
    }
}

fn hex4(bytes: &[u8], at: usize) -> Option<u32> {
    let hex = bytes.get(at..at + 4)?;
    hex.iter().try_fold(0u32, |n, &b| Some(n * 16 + char::from(b).to_digit(16)?))
}

/// The high bit of each byte of `word` (little-endian) that ends a run of plain string bytes — a quote, a
/// backslash or a control character, which a JSON string must escape — and maybe of some bytes after
/// it: the borrow of the subtractions only runs upwards, so the lowest bit set is exact. serde_json
/// finds the end of a plain run the same way.
fn stops(word: u64) -> u64 {
    const ONES: u64 = u64::from_le_bytes([1; 8]);
    const HIGH: u64 = ONES << 7;
    let zero_byte = |x: u64| x.wrapping_sub(ONES) & !x;
    let control = word.wrapping_sub(ONES * 0x20) & !word;
    (control | zero_byte(word ^ (ONES * u64::from(b'"'))) | zero_byte(word ^ (ONES * u64::from(b'\\')))) & HIGH
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use serde_json::{Value, json};

    use super::*;
    use crate::wire::TopLevel;

    /// A split with owned strings: fields, the position of `messages`, the array, the messages.
    type Owned = (Vec<(String, String)>, usize, String, Vec<String>);

    /// What serde_json's parse of the same body gives, in the scan's terms (`None` when it refuses the
    /// body or finds no `messages` array).
    fn by_serde(body: &[u8]) -> Option<Owned> {
        let top = TopLevel::parse(body, "messages").ok()?;
        let (idx, raw, messages) = top.elements()?;
        let fields = top.fields.into_iter().map(|(k, v)| (k, v.get().to_owned())).collect();
        Some((fields, idx, raw.get().to_owned(), messages.into_iter().map(|m| m.get().to_owned()).collect()))
    }

    fn owned(split: Scanned<'_>) -> Owned {
        let fields = split.fields.into_iter().map(|(k, v)| (k.into_owned(), v.to_owned())).collect();
        let messages = split.elements.into_iter().map(str::to_owned).collect();
        (fields, split.array_idx, split.array_raw.to_owned(), messages)
    }

    /// The scan agrees with serde_json whenever it answers.
    fn agrees(body: &[u8]) -> Result<(), TestCaseError> {
        if let Some(split) = split(body, "messages") {
            prop_assert_eq!(Some(owned(split)), by_serde(body), "body: {:?}", String::from_utf8_lossy(body));
        }
        Ok(())
    }

    #[test]
    fn splits_like_serde_json_with_whitespace_and_escapes() {
        let body = " {\"model\" : \"m\",\n\t\"messages\" :[ {\"role\":\"user\",\"content\":\"a\\\"b\\\\\\u00e9\\n\"} ,\r\n[1,-2.5e+3,true,false,null,{}] , \"x\",0 ] , \"n\":-0.0E-1 }\n";
        let split = split(body.as_bytes(), "messages").expect("a valid chat body is scanned");
        assert_eq!(split.array_idx, 1);
        assert_eq!(
            split.elements,
            [
                "{\"role\":\"user\",\"content\":\"a\\\"b\\\\\\u00e9\\n\"}",
                "[1,-2.5e+3,true,false,null,{}]",
                "\"x\"",
                "0"
            ]
        );
        assert_eq!(split.fields, [(Cow::Borrowed("model"), "\"m\""), (Cow::Borrowed("n"), "-0.0E-1")]);
        assert_eq!(Some(owned(split)), by_serde(body.as_bytes()));
    }

    /// Each of these is invalid JSON (or a body the scan leaves to serde_json): the scan must not
    /// accept any of them.
    #[test]
    fn declines_what_it_must_not_accept() {
        for body in [
            r#"{"messages":[{"content":"a
b"}]}"#,
            r#"{"messages":[{"content":"tab	inside"}]}"#,
            r#"{"messages":["\x"]}"#,
            r#"{"messages":["\u12g4"]}"#,
            r#"{"messages":["\u12"]}"#,
            r#"{"messages":["open]}"#,
            r#"{"messages":[01]}"#,
            r#"{"messages":[1.]}"#,
            r#"{"messages":[.5]}"#,
            r#"{"messages":[1e]}"#,
            r#"{"messages":[-]}"#,
            r#"{"messages":[+1]}"#,
            r#"{"messages":[tru]}"#,
            r#"{"messages":[nul]}"#,
            r#"{"messages":[1,]}"#,
            r#"{"messages":[{"a":1,}]}"#,
            r#"{"messages":[{"a" 1}]}"#,
            r#"{"messages":[{1:1}]}"#,
            r#"{"messages":[[1,2}]}"#,
            r#"{"messages":[],}"#,
            r#"{"messages":[]} x"#,
            r#"{"messages":[]"#,
            r#"{"messages":{}}"#,
            r#"{"messages":[],"messages":[]}"#,
            r#"{"model":"a","model":"b","messages":[]}"#,
            r#"{"messag\u0065s":[]}"#,
            r#"{"model":"m"}"#,
            r#"[{"messages":[]}]"#,
            r#"{messages":[]}"#,
            r#"{"model":"m",model":1,"messages":[]}"#,
            "",
        ] {
            assert!(split(body.as_bytes(), "messages").is_none(), "scanned: {body}");
        }
        assert!(split(b"{\"messages\":[\"\xff\"]}", "messages").is_none(), "invalid UTF-8");
        let deep = format!("{{\"messages\":[{}{}]}}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
        assert!(split(deep.as_bytes(), "messages").is_none(), "nesting past MAX_DEPTH");
        let shallow = format!("{{\"messages\":[{}{}]}}", "[".repeat(MAX_DEPTH - 3), "]".repeat(MAX_DEPTH - 3));
        assert!(split(shallow.as_bytes(), "messages").is_some(), "nesting under MAX_DEPTH");
    }

    fn json_value() -> impl Strategy<Value = Value> {
        // Quotes, backslashes, control characters, non-ASCII and astral characters, long runs.
        super::super::testing::json_value(5, 6, "[a-z\"\\\\]{0,6}", "(\\PC|[\"\\\\\u{1}\u{1f}\n\t]|é|🦀){0,80}")
    }

    /// A chat body: a few plain top-level keys around `messages`, written compactly or pretty.
    fn chat_body() -> impl Strategy<Value = Vec<u8>> {
        (
            prop::collection::btree_map("[a-z_]{1,8}", json_value(), 0..5),
            prop::collection::vec(json_value(), 0..8),
            any::<prop::sample::Index>(),
            any::<bool>(),
        )
            .prop_map(|(fields, messages, at, pretty)| {
                let mut entries: Vec<(String, Value)> = fields.into_iter().filter(|(k, _)| k != "messages").collect();
                entries.insert(at.index(entries.len() + 1), ("messages".to_owned(), json!(messages)));
                let body = Value::Object(entries.into_iter().collect());
                if pretty { serde_json::to_vec_pretty(&body) } else { serde_json::to_vec(&body) }.unwrap()
            })
    }

    proptest! {
        /// Strings are written exactly as serde_json writes them.
        #[test]
        fn writes_strings_as_serde_json(s in "(\\PC|[\"\\\\\u{0}-\u{1f}\u{7f}]|é|🦀){0,80}") {
            let mut out = String::from("x");
            push_json_string(&mut out, &s);
            prop_assert_eq!(&out[1..], serde_json::to_string(&s).unwrap());
        }

        /// A literal is taken as pare writes it exactly when decoding it and writing it again gives
        /// it back: over literals that spell their characters in every way JSON allows.
        #[test]
        fn a_literal_is_as_pare_writes_it_when_writing_it_again_gives_it(
            pieces in prop::collection::vec(prop::sample::select(vec![
                "a", "é", "🦀", " ", "\\\"", "\\\\", "\\/", "\\n", "\\t", "\\r", "\\b", "\\f",
                "\\u0001", "\\u001f", "\\u001F", "\\u000a", "\\u0008", "\\u0041", "\\u00e9",
                "\\u00E9", "\\u007f", "\\ud83e\\udd80", "\\u2028",
            ]), 0..12),
        ) {
            let literal = format!("\"{}\"", pieces.concat());
            let text: String = serde_json::from_str(&literal).unwrap();
            let mut again = String::new();
            push_json_string(&mut again, &text);
            prop_assert_eq!(written_as_pare_writes(&literal), again == literal, "{}", literal);
        }

        /// What pare writes is taken as pare writes it.
        #[test]
        fn what_pare_writes_is_as_pare_writes_it(s in "(\\PC|[\"\\\\\u{0}-\u{1f}\u{7f}]|é|🦀){0,80}") {
            let mut literal = String::new();
            push_json_string(&mut literal, &s);
            prop_assert!(written_as_pare_writes(&literal), "{}", literal);
        }

        /// Every valid chat body serde_json writes is scanned, and split exactly as serde_json splits it.
        #[test]
        fn scans_every_body_serde_json_writes(body in chat_body()) {
            prop_assert!(split(&body, "messages").is_some(), "declined: {}", String::from_utf8_lossy(&body));
            agrees(&body)?;
        }

        /// After any small corruption — a byte replaced, inserted or removed, the body cut short — the
        /// scan either declines or agrees with serde_json: it never accepts what serde_json refuses.
        #[test]
        fn never_accepts_what_serde_json_refuses(body in chat_body(), edits in super::super::testing::edits()) {
            let body = super::super::testing::corrupt(body, edits);
            agrees(&body)?;
        }
    }

    proptest! {
        // Enough cases that a shared part ending in a number followed by a digit comes up.
        #![proptest_config(ProptestConfig::with_cases(2048))]

        /// A body that repeats another's bytes up to the end of one of its messages, then goes on
        /// with anything (the rest of that body, corrupted), is split from there exactly as a scan
        /// from its start splits it, or declined by both.
        #[test]
        fn a_resumed_scan_agrees_with_a_whole_one(
            body in chat_body(),
            at in any::<prop::sample::Index>(),
            digit in any::<bool>(),
            edits in super::super::testing::edits(),
        ) {
            let earlier = split(&body, "messages").expect("a body serde_json writes is scanned");
            prop_assume!(!earlier.elements.is_empty());
            let offset = |s: &str| s.as_ptr() as usize - body.as_ptr() as usize;
            let span = |s: &str| (offset(s), offset(s) + s.len());
            let kept: Vec<(usize, usize)> =
                earlier.elements[..=at.index(earlier.elements.len())].iter().map(|m| span(m)).collect();
            let fields: Vec<(String, (usize, usize))> = earlier.fields[..earlier.array_idx]
                .iter()
                .map(|(k, v)| (k.to_string(), span(v)))
                .collect();
            let end = kept.last().unwrap().1;
            let shared = end + usize::from(body[end - 1].is_ascii_digit());
            let resume = Resume { fields: &fields, array_start: offset(earlier.array_raw), elements: &kept };
            let mut later = body[..shared].to_vec();
            // A digit right after the shared bytes would lengthen a number that ended there.
            if digit {
                later.push(b'7');
            }
            later.extend(super::super::testing::corrupt(body[shared..].to_vec(), edits));
            let resumed = split_resumed(&later, "messages", Some(&resume)).map(owned);
            prop_assert_eq!(resumed, split(&later, "messages").map(owned), "body: {:?}", String::from_utf8_lossy(&later));
        }
    }
}
