//! Splitting a request body into content-addressed pieces (one per message, one per large top-level
//! value) plus a small template, and the template's binary encoding.
//!
//! An agent re-sends its whole history on every request, so storing bodies whole grows with the square
//! of a session. Here a body becomes a list of [`Part`]s: literal bytes (the JSON punctuation and small
//! fields), references to blobs (large top-level values such as `tools`), and the `messages` array as a
//! list of message blobs with the exact separator bytes between them. The message list is stored as a
//! delta against the session's previous body ("the first `n_shared` messages of exchange `base`, then
//! these"), so a request costs only its new messages plus a few bytes. Concatenating the parts gives
//! back the original bytes exactly, whitespace included.

use sha2::{Digest, Sha256};

use crate::wire::{Spans, Split};

/// Top-level values at least this long are stored as blobs (deduplicated across requests).
const BLOB_MIN_LEN: usize = 64;

/// Every this many requests a session's message list is stored whole (a key frame), so reading one
/// body never walks more than this many deltas.
pub const KEYFRAME_EVERY: u64 = 32;

/// One piece of a body as split from its bytes (borrowing the body).
#[derive(Debug, PartialEq, Eq)]
pub enum Piece<'a> {
    Lit(&'a [u8]),
    Blob(&'a [u8]),
    Messages(MessagesPiece<'a>),
}

/// The `messages` array: bytes up to the first message, each message with the bytes before it, and the
/// bytes after the last message up to and including `]`.
#[derive(Debug, PartialEq, Eq)]
pub struct MessagesPiece<'a> {
    pub open: &'a [u8],
    /// `(separator before the message, message bytes)`; the first separator is empty.
    pub items: Vec<(&'a [u8], &'a [u8])>,
    pub close: &'a [u8],
}

/// Split a body. A body that is not a JSON object with a `messages` array (chat) or an `input` array
/// (Responses) is one blob.
pub fn split(body: &[u8]) -> Vec<Piece<'_>> {
    split_json(body).unwrap_or_else(|| if body.is_empty() { Vec::new() } else { vec![Piece::Blob(body)] })
}

/// [`split`] along where the body's values lie, as a parse of the same bytes found them
/// ([`Split::spans_in`]) or as the compactor wrote them ([`Split::to_vec_and_spans`]): the proxy
/// has parsed or written every body before the archive stores it, so the writer need not parse it
/// again. Spans that do not fit the body (another body's) are not used: the body is split as [`split`]
/// does.
pub fn split_along<'a>(body: &'a [u8], spans: Option<&Spans>) -> Vec<Piece<'a>> {
    match spans.and_then(|spans| pieces(body, spans)) {
        Some(pieces) => pieces,
        None => split(body),
    }
}

fn split_json(body: &[u8]) -> Option<Vec<Piece<'_>>> {
    // The proxy's own parse: one validating pass over the body that gives each value's bytes in place.
    let parsed = Split::parse(body, "messages").or_else(|_| Split::parse(body, "input")).ok()?;
    pieces(body, &parsed.spans_in(body)?)
}

/// The pieces of `body` along `spans`: its top-level values of at least [`BLOB_MIN_LEN`] bytes and
/// its `messages` array, in body order, the array split at each message. `None` when the spans do not
/// fit the body (overlapping, past its end, messages outside the array).
fn pieces<'a>(body: &'a [u8], spans: &Spans) -> Option<Vec<Piece<'a>>> {
    let mut values: Vec<(usize, usize, bool)> = Vec::with_capacity(spans.fields.len() + 1);
    let blobs = spans.fields.iter().filter(|(start, end)| end.saturating_sub(*start) >= BLOB_MIN_LEN);
    values.extend(blobs.map(|&(start, end)| (start, end, false)));
    values.push((spans.array.0, spans.array.1, true));
    values.sort_unstable();
    let mut pieces = Vec::with_capacity(values.len() * 2 + 1);
    let mut at = 0;
    for (start, end, is_messages) in values {
        if start < at || end < start || end > body.len() {
            return None;
        }
        if start > at {
            pieces.push(Piece::Lit(&body[at..start]));
        }
        if is_messages {
            pieces.push(Piece::Messages(split_messages(body, start, end, &spans.elements)?));
        } else {
            pieces.push(Piece::Blob(&body[start..end]));
        }
        at = end;
    }
    if at < body.len() {
        pieces.push(Piece::Lit(&body[at..]));
    }
    Some(pieces)
}

fn split_messages<'a>(
    body: &'a [u8],
    start: usize,
    end: usize,
    messages: &[(usize, usize)],
) -> Option<MessagesPiece<'a>> {
    let mut items = Vec::with_capacity(messages.len());
    let mut at = start;
    let mut open: &[u8] = &body[start..start];
    for (idx, &(m_start, m_end)) in messages.iter().enumerate() {
        if m_start < at || m_end < m_start || m_end > end {
            return None;
        }
        if idx == 0 {
            open = &body[at..m_start];
            items.push((&body[m_start..m_start], &body[m_start..m_end]));
        } else {
            items.push((&body[at..m_start], &body[m_start..m_end]));
        }
        at = m_end;
    }
    Some(MessagesPiece { open, items, close: &body[at..end] })
}

/// The SHA-256 state after a body's first `at` bytes (the end of its last message), kept in the
/// session's archive cursor: the session's next body repeats those bytes, and its hash goes on from here
/// over the rest only. The hash is the same SHA-256 of the whole body.
#[derive(Clone)]
pub struct Midstate {
    at: usize,
    state: Sha256,
}

impl Midstate {
    /// How many bytes of its body the state covers.
    pub fn at(&self) -> usize {
        self.at
    }
}

/// SHA-256 of `body`, and the state after its first `at` bytes. When `earlier` (the midstate of an
/// earlier body) covers bytes `body` starts with too — the caller has checked it: the archive writer
/// compares digests, as it does not keep the earlier body — hashing goes on from it.
pub fn sha256_resume(body: &[u8], at: usize, earlier: Option<&Midstate>) -> ([u8; 32], Midstate) {
    let at = at.min(body.len());
    let (mut state, from) = match earlier {
        Some(mid) if mid.at <= at && mid.at <= body.len() => (mid.state.clone(), mid.at),
        _ => (Sha256::new(), 0),
    };
    state.update(&body[from..at]);
    let mid = Midstate { at, state: state.clone() };
    state.update(&body[at..]);
    (state.finalize().into(), mid)
}

/// One entry of a stored message list: the separator before the message and the message's blob id.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Item {
    pub sep: Vec<u8>,
    pub blob: i64,
}

/// A body as stored: what [`Piece`]s became once their blobs have ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    Lit(Vec<u8>),
    Blob(i64),
    Messages(StoredMessages),
}

/// A message list stored as a delta: the first `n_shared` items of exchange `base`'s list of the same
/// kind (raw or forwarded), then `new`. `base == 0` means a key frame (no base).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredMessages {
    pub base: i64,
    pub n_shared: u64,
    pub open: Vec<u8>,
    pub new: Vec<Item>,
    pub close: Vec<u8>,
}

/// Why a stored template could not be decoded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("template is corrupt: {0}")]
pub struct TemplateError(pub &'static str);

const TEMPLATE_VERSION: u8 = 1;

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn varint(&mut self) -> Result<u64, TemplateError> {
        let mut v: u64 = 0;
        for shift in (0..64).step_by(7) {
            let (&b, rest) = self.buf.split_first().ok_or(TemplateError("truncated varint"))?;
            self.buf = rest;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(TemplateError("varint too long"))
    }
    fn bytes(&mut self) -> Result<&'a [u8], TemplateError> {
        let len = usize::try_from(self.varint()?).map_err(|_| TemplateError("length too large"))?;
        if len > self.buf.len() {
            return Err(TemplateError("truncated bytes"));
        }
        let (head, rest) = self.buf.split_at(len);
        self.buf = rest;
        Ok(head)
    }
    fn id(&mut self) -> Result<i64, TemplateError> {
        i64::try_from(self.varint()?).map_err(|_| TemplateError("id out of range"))
    }
}

/// Encode a template.
pub fn encode(parts: &[Part]) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    out.push(TEMPLATE_VERSION);
    put_varint(&mut out, parts.len() as u64);
    for part in parts {
        match part {
            Part::Lit(bytes) => {
                out.push(0);
                put_bytes(&mut out, bytes);
            }
            Part::Blob(id) => {
                out.push(1);
                put_varint(&mut out, *id as u64);
            }
            Part::Messages(m) => {
                out.push(2);
                put_varint(&mut out, m.base as u64);
                put_varint(&mut out, m.n_shared);
                put_bytes(&mut out, &m.open);
                put_bytes(&mut out, &m.close);
                put_varint(&mut out, m.new.len() as u64);
                for item in &m.new {
                    put_bytes(&mut out, &item.sep);
                    put_varint(&mut out, item.blob as u64);
                }
            }
        }
    }
    out
}

/// Decode a template written by [`encode`].
pub fn decode(buf: &[u8]) -> Result<Vec<Part>, TemplateError> {
    let (&version, rest) = buf.split_first().ok_or(TemplateError("empty"))?;
    if version != TEMPLATE_VERSION {
        return Err(TemplateError("unknown version"));
    }
    let mut r = Reader { buf: rest };
    let n = r.varint()?;
    let mut parts = Vec::with_capacity(n.min(1024) as usize);
    for _ in 0..n {
        let (&tag, rest) = r.buf.split_first().ok_or(TemplateError("truncated part"))?;
        r.buf = rest;
        parts.push(match tag {
            0 => Part::Lit(r.bytes()?.to_vec()),
            1 => Part::Blob(r.id()?),
            2 => {
                let base = r.id()?;
                let n_shared = r.varint()?;
                let open = r.bytes()?.to_vec();
                let close = r.bytes()?.to_vec();
                let n_new = r.varint()?;
                let mut new = Vec::with_capacity(n_new.min(4096) as usize);
                for _ in 0..n_new {
                    let sep = r.bytes()?.to_vec();
                    new.push(Item { sep, blob: r.id()? });
                }
                Part::Messages(StoredMessages { base, n_shared, open, new, close })
            }
            _ => return Err(TemplateError("unknown part tag")),
        });
    }
    if !r.buf.is_empty() {
        return Err(TemplateError("trailing bytes"));
    }
    Ok(parts)
}

/// A body as a flat sequence of segments once its message list is resolved: what is hashed and
/// concatenated to recover the bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    Lit(Vec<u8>),
    Blob(i64),
}

/// Flatten parts whose message list has been resolved to `items`.
pub fn flatten(parts: &[Part], items: &[Item]) -> Vec<Segment> {
    let mut out = Vec::with_capacity(items.len() * 2 + parts.len() + 2);
    for part in parts {
        match part {
            Part::Lit(b) => out.push(Segment::Lit(b.clone())),
            Part::Blob(id) => out.push(Segment::Blob(*id)),
            Part::Messages(m) => {
                out.push(Segment::Lit(m.open.clone()));
                for item in items {
                    if !item.sep.is_empty() {
                        out.push(Segment::Lit(item.sep.clone()));
                    }
                    out.push(Segment::Blob(item.blob));
                }
                out.push(Segment::Lit(m.close.clone()));
            }
        }
    }
    out
}

/// The message part of a template, if any.
pub fn messages_part(parts: &[Part]) -> Option<&StoredMessages> {
    parts.iter().find_map(|p| match p {
        Part::Messages(m) => Some(m),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn join(pieces: &[Piece<'_>]) -> Vec<u8> {
        let mut out = Vec::new();
        for p in pieces {
            match p {
                Piece::Lit(b) | Piece::Blob(b) => out.extend_from_slice(b),
                Piece::Messages(m) => {
                    out.extend_from_slice(m.open);
                    for (sep, msg) in &m.items {
                        out.extend_from_slice(sep);
                        out.extend_from_slice(msg);
                    }
                    out.extend_from_slice(m.close);
                }
            }
        }
        out
    }

    /// Each body rejoins to its exact bytes, and a chat body's messages are split out (`Some(n)`: that
    /// many messages) whichever parse reads it.
    #[test]
    fn split_rejoins_byte_for_byte() {
        let cases: &[(&[u8], Option<usize>)] = &[
            (br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#, Some(1)),
            (b"{ \"messages\" : [ \n {\"role\":\"system\",\"content\":\"s\"} ,\n\t{\"role\":\"user\",\"content\":\"\\u00e9\"}  ] , \"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"read_file\",\"parameters\":{}}}] }\n", Some(2)),
            (br#"{"messages":[],"model":"m"}"#, Some(0)),
            (br#"{"messages":[ ],"model":"m"}"#, Some(0)),
            // Bodies the fast scan leaves to serde_json: repeated keys (first position, last value),
            // an escaped key.
            (br#"{"messages":[{"role":"user","content":"a"}],"model":"m","messages":[{"role":"user","content":"b"},{"role":"user","content":"c"}],"model":"n"}"#, Some(2)),
            (br#"{"messag\u0065s":[{"role":"user","content":"a"}],"tools":[{"type":"function","function":{"name":"f","parameters":{}}}]}"#, Some(1)),
            (b"not json at all", None),
            (br#"{"model":"m"}"#, None),
            (br#"{"model":"m","messages":{}}"#, None),
            (b"", None),
        ];
        for (body, n_messages) in cases {
            let pieces = split(body);
            assert_eq!(join(&pieces), body.to_vec(), "body {:?}", String::from_utf8_lossy(body));
            let found = pieces.iter().find_map(|p| match p {
                Piece::Messages(m) => Some(m.items.len()),
                _ => None,
            });
            assert_eq!(found, *n_messages, "body {:?}", String::from_utf8_lossy(body));
            // Along the spans of the proxy's parse of the same bytes: the same pieces, no second parse.
            let spans = Split::parse(body, "messages").ok().and_then(|parsed| parsed.spans_in(body));
            assert_eq!(spans.is_some(), n_messages.is_some(), "body {:?}", String::from_utf8_lossy(body));
            assert_eq!(split_along(body, spans.as_ref()), pieces, "body {:?}", String::from_utf8_lossy(body));
        }
    }

    /// Spans that do not fit the body they are given (another body's) are not used.
    #[test]
    fn spans_that_do_not_fit_are_not_used() {
        let long: &[u8] = br#"{"model":"m","messages":[{"role":"system","content":"a long system prompt"},{"role":"user","content":"hi"}]}"#;
        let short: &[u8] = br#"{"messages":[{"role":"user","content":"hi"}]}"#;
        let spans_of = |body: &[u8]| Split::parse(body, "messages").unwrap().spans_in(body).unwrap();
        assert_eq!(split_along(short, Some(&spans_of(long))), split(short));
        // A message that starts before the one it follows ends.
        let mut swapped = spans_of(short);
        swapped.elements.push((0, 1));
        assert_eq!(split_along(short, Some(&swapped)), split(short));
        // Spans that fit are what the pieces follow: listing no message leaves the array whole.
        let mut no_messages = spans_of(long);
        no_messages.elements.clear();
        let Some(Piece::Messages(m)) =
            split_along(long, Some(&no_messages)).into_iter().find(|p| matches!(p, Piece::Messages(_)))
        else {
            panic!("no messages piece")
        };
        assert!(m.items.is_empty() && m.close.starts_with(b"[{"));
    }

    #[test]
    fn messages_and_large_values_become_blobs() {
        let body = br#"{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":"u"}],"tools":[{"type":"function","function":{"name":"read_file","parameters":{"type":"object"}}}]}"#;
        let pieces = split(body);
        let Some(Piece::Messages(m)) = pieces.iter().find(|p| matches!(p, Piece::Messages(_))) else {
            panic!("no messages piece in {pieces:?}")
        };
        assert_eq!(m.items.len(), 2);
        assert_eq!(m.items[1].0, b",");
        assert!(pieces.iter().any(|p| matches!(p, Piece::Blob(b) if b.starts_with(b"[{\"type\""))));
    }

    /// A hash that goes on from an earlier body's midstate is the whole body's SHA-256, whatever the
    /// earlier body shares with it (the midstate is passed on only when the covered bytes are equal,
    /// as the writer checks).
    #[test]
    fn a_resumed_hash_is_the_whole_bodys_sha256() {
        fn sha256_from(body: &[u8], at: usize, earlier: Option<(&[u8], &Midstate)>) -> ([u8; 32], Midstate) {
            let earlier = earlier.filter(|(bytes, mid)| bytes.get(..mid.at) == body.get(..mid.at));
            sha256_resume(body, at, earlier.map(|(_, mid)| mid))
        }
        let earlier = br#"{"messages":[{"role":"user","content":"a"},{"role":"user","content":"b"}],"n":1}"#;
        let (hash, mid) = sha256_from(earlier, 53, None);
        assert_eq!(hash, crate::archive::store::sha256(earlier));
        let bodies: [&[u8]; 4] = [
            br#"{"messages":[{"role":"user","content":"a"},{"role":"user","content":"b"},{"role":"user"}],"n":1}"#,
            br#"{"messages":[{"role":"user","content":"X"},{"role":"user","content":"b"},{"role":"user"}],"n":1}"#,
            br#"{"messages":[]}"#,
            b"",
        ];
        for body in bodies {
            for at in [0, 10, 53, 80, 200] {
                let (hash, next) = sha256_from(body, at, Some((earlier, &mid)));
                assert_eq!(hash, crate::archive::store::sha256(body), "{at}");
                // And the next body on from this one.
                let (again, _) = sha256_from(earlier, 53, Some((body, &next)));
                assert_eq!(again, crate::archive::store::sha256(earlier), "{at}");
            }
        }
    }

    #[test]
    fn template_round_trips_and_rejects_garbage() {
        let parts = vec![
            Part::Lit(b"{\"model\":\"m\",\"messages\":".to_vec()),
            Part::Messages(StoredMessages {
                base: 17,
                n_shared: 300,
                open: b"[".to_vec(),
                new: vec![Item { sep: b",".to_vec(), blob: 1 << 40 }, Item { sep: Vec::new(), blob: 3 }],
                close: b"]".to_vec(),
            }),
            Part::Blob(5),
            Part::Lit(b"}".to_vec()),
        ];
        let encoded = encode(&parts);
        assert_eq!(decode(&encoded).unwrap(), parts);
        assert!(decode(&encoded[..encoded.len() - 1]).is_err());
        assert_eq!(decode(&[9]), Err(TemplateError("unknown version")));
    }
}
