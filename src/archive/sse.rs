//! Server-sent events: the one parser every answer dialect (Chat Completions, Responses, Messages)
//! reads its stream with, fed chunk by chunk as the stream passes through or given a whole body.
//!
//! It follows the WHATWG "event stream interpretation" rules pare needs: lines end with CRLF, LF or
//! a lone CR (a CRLF split between two chunks is one line end); a line starting with `:` is a
//! comment; `field: value` loses one space after the colon, a line without a colon is a field with
//! an empty value; `data` lines are joined with `\n`; `event` names the event; a blank line
//! dispatches the event, and one without any `data` line is not dispatched. A UTF-8 byte order mark
//! at the start is skipped, bytes that are not UTF-8 are read lossily. `id` and `retry` only matter
//! to a reconnecting client and are ignored.
//!
//! One bound: a line, or an event's data, longer than [`MAX_EVENT_BYTES`] is skipped and its event
//! is not dispatched, so an upstream that never ends a line or an event holds no more of pare's
//! memory than that.
//!
//! One leniency, for answers cut short: at the end of a body, [`Parser::finish`] reads a last line
//! without its line end and dispatches an event that has data but no blank line after it (the
//! WHATWG rules drop both). Whether a stream ended is never read from its bytes: the dialects look
//! at the events.

use std::borrow::Cow;

/// One dispatched event.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Event {
    /// The `event` field; empty when the stream named none (the type is then `message`).
    pub event: String,
    /// The `data` lines, joined with `\n`.
    pub data: String,
}

impl Event {
    /// What the event is: its `event` field, else the `type` member of its data read as JSON (the
    /// Responses and Messages APIs name each event both ways alike; some servers send only the data).
    pub fn type_name(&self) -> Option<Cow<'_, str>> {
        if !self.event.is_empty() {
            return Some(Cow::Borrowed(&self.event));
        }
        #[derive(serde::Deserialize)]
        struct Typed<'a> {
            #[serde(rename = "type", borrow)]
            kind: Option<Cow<'a, str>>,
        }
        serde_json::from_str::<Typed<'_>>(&self.data).ok()?.kind
    }
}

/// The most bytes of one line, and of one event's data, a [`Parser`] holds (16 MiB: an answer's
/// largest event, a Responses `response.completed` with every output item, is far smaller).
pub const MAX_EVENT_BYTES: usize = 16 * 1024 * 1024;

/// An incremental event-stream parser: feed it bytes in any split, it calls back once per event.
#[derive(Debug)]
pub struct Parser {
    /// [`MAX_EVENT_BYTES`], or less in tests.
    limit: usize,
    /// The current line's bytes, when it started in an earlier chunk.
    line: Vec<u8>,
    /// The current line ran over the limit: the rest of it is skipped.
    overlong_line: bool,
    /// The pending event had a line, or data, over the limit: it is not dispatched.
    overlong_event: bool,
    /// The last byte fed was a CR: a LF right after it ends no second line.
    after_cr: bool,
    /// A line was read already (the byte order mark can only open the first).
    started: bool,
    /// The event being read.
    pending: Event,
    /// `pending` has a `data` line (its data may still be empty).
    has_data: bool,
}

impl Default for Parser {
    fn default() -> Self {
        Parser::with_limit(MAX_EVENT_BYTES)
    }
}

impl Parser {
    pub fn new() -> Parser {
        Parser::default()
    }

    /// A parser holding at most `limit` bytes of a line and of an event's data.
    fn with_limit(limit: usize) -> Parser {
        Parser {
            limit,
            line: Vec::new(),
            overlong_line: false,
            overlong_event: false,
            after_cr: false,
            started: false,
            pending: Event::default(),
            has_data: false,
        }
    }

    /// Read `bytes`, calling `on_event` for every event they complete.
    pub fn feed(&mut self, mut bytes: &[u8], on_event: &mut dyn FnMut(&Event)) {
        if bytes.is_empty() {
            return;
        }
        if self.after_cr && bytes.first() == Some(&b'\n') {
            bytes = &bytes[1..];
        }
        self.after_cr = false;
        while let Some(at) = memchr::memchr2(b'\n', b'\r', bytes) {
            if self.overlong_line || self.line.len() + at > self.limit {
                self.overlong_line = false;
                self.line.clear();
                self.overlong_event = true;
                self.started = true;
            } else if self.line.is_empty() {
                self.line_ended(&bytes[..at], on_event);
            } else {
                let mut line = std::mem::take(&mut self.line);
                line.extend_from_slice(&bytes[..at]);
                self.line_ended(&line, on_event);
                line.clear();
                self.line = line;
            }
            let crlf = bytes[at] == b'\r' && bytes.get(at + 1) == Some(&b'\n');
            if bytes[at] == b'\r' && at + 1 == bytes.len() {
                self.after_cr = true;
            }
            bytes = &bytes[at + if crlf { 2 } else { 1 }..];
        }
        if self.overlong_line || self.line.len() + bytes.len() > self.limit {
            self.overlong_line = true;
            self.line = Vec::new();
        } else {
            self.line.extend_from_slice(bytes);
        }
    }

    /// The body ended: read a last line left without its line end, and dispatch an event left
    /// without its blank line when it has data (see the module docs).
    pub fn finish(mut self, on_event: &mut dyn FnMut(&Event)) {
        if self.overlong_line {
            self.overlong_event = true;
            self.started = true;
        } else if !self.line.is_empty() {
            let line = std::mem::take(&mut self.line);
            self.line_ended(&line, on_event);
        }
        self.dispatch(on_event);
    }

    fn line_ended(&mut self, line: &[u8], on_event: &mut dyn FnMut(&Event)) {
        let line = if self.started { line } else { line.strip_prefix("\u{feff}".as_bytes()).unwrap_or(line) };
        self.started = true;
        if line.is_empty() {
            self.dispatch(on_event);
            return;
        }
        if line[0] == b':' {
            return;
        }
        let (field, value) = match memchr::memchr(b':', line) {
            Some(colon) => {
                let value = &line[colon + 1..];
                (&line[..colon], value.strip_prefix(b" ").unwrap_or(value))
            }
            None => (line, &b""[..]),
        };
        match field {
            b"data" => {
                if self.overlong_event || self.pending.data.len() + 1 + value.len() > self.limit {
                    self.overlong_event = true;
                    self.pending.data = String::new();
                    return;
                }
                if self.has_data {
                    self.pending.data.push('\n');
                }
                self.has_data = true;
                self.pending.data.push_str(&String::from_utf8_lossy(value));
            }
            b"event" => {
                self.pending.event.clear();
                self.pending.event.push_str(&String::from_utf8_lossy(value));
            }
            _ => {}
        }
    }

    fn dispatch(&mut self, on_event: &mut dyn FnMut(&Event)) {
        if self.has_data && !self.overlong_event {
            on_event(&self.pending);
        }
        self.overlong_event = false;
        self.pending.data.clear();
        self.pending.event.clear();
        self.has_data = false;
    }
}

/// Every event of a whole body, in order (cut short or not: see [`Parser::finish`]).
pub fn each_event(body: &[u8], mut on_event: impl FnMut(&Event)) {
    let mut parser = Parser::new();
    parser.feed(body, &mut on_event);
    parser.finish(&mut on_event);
}

/// Whether a body that was not declared an event stream reads as one (its first bytes are a field).
pub fn looks_like_sse(body: &[u8]) -> bool {
    let start = body.iter().position(|b| !b.is_ascii_whitespace()).unwrap_or(body.len());
    [&b"data:"[..], b"event:", b":"].iter().any(|p| body[start..].starts_with(p))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(event: &str, data: &str) -> Event {
        Event { event: event.to_owned(), data: data.to_owned() }
    }

    /// The events of `body` fed in the given chunks, and then finished.
    fn parse_chunks(chunks: &[&[u8]]) -> Vec<Event> {
        parse_chunks_within(MAX_EVENT_BYTES, chunks)
    }

    /// [`parse_chunks`] by a parser that holds at most `limit` bytes of a line or an event.
    fn parse_chunks_within(limit: usize, chunks: &[&[u8]]) -> Vec<Event> {
        let mut events = Vec::new();
        let mut parser = Parser::with_limit(limit);
        for chunk in chunks {
            parser.feed(chunk, &mut |e| events.push(e.clone()));
        }
        parser.finish(&mut |e| events.push(e.clone()));
        events
    }

    fn parse(body: &str) -> Vec<Event> {
        parse_chunks(&[body.as_bytes()])
    }

    /// Every way of splitting `body` in two gives the events of the whole.
    fn same_in_any_two_chunks(body: &str) {
        let whole = parse(body);
        for at in 0..=body.len() {
            let (a, b) = body.as_bytes().split_at(at);
            assert_eq!(parse_chunks(&[a, b"", b]), whole, "split at {at} of {body:?}");
        }
        let bytes: Vec<&[u8]> = body.as_bytes().chunks(1).collect();
        assert_eq!(parse_chunks(&bytes), whole, "byte by byte: {body:?}");
    }

    #[test]
    fn data_lines_are_joined_with_newlines() {
        assert_eq!(parse("data: a\ndata: b\ndata:c\n\n"), [ev("", "a\nb\nc")]);
        assert_eq!(parse("data:  two spaces\n\n"), [ev("", " two spaces")], "one space is dropped, not two");
        assert_eq!(parse("data\n\n"), [ev("", "")], "a field without a colon has an empty value");
        assert_eq!(parse("data:\ndata:\n\n"), [ev("", "\n")]);
    }

    #[test]
    fn the_event_field_names_the_event_and_is_reset_after_dispatch() {
        assert_eq!(parse("event: message_stop\ndata: {}\n\ndata: 2\n\n"), [ev("message_stop", "{}"), ev("", "2")]);
        assert_eq!(parse("event: a\nevent: b\ndata: x\n\n"), [ev("b", "x")]);
    }

    #[test]
    fn comments_other_fields_and_events_without_data_are_not_dispatched() {
        assert_eq!(parse(": keep-alive\n\n"), []);
        assert_eq!(parse("event: ping\n\n"), [], "no data line: nothing dispatched");
        assert_eq!(parse("id: 7\nretry: 100\nfoo: bar\ndata: x\n\n"), [ev("", "x")]);
        assert_eq!(parse(": data: not a field\ndata: y\n\n"), [ev("", "y")]);
        assert_eq!(parse("event: gone\n\ndata: z\n\n"), [ev("", "z")], "a blank line resets the name");
    }

    #[test]
    fn crlf_lf_and_lone_cr_all_end_lines() {
        let expected = [ev("e", "a\nb"), ev("", "c")];
        assert_eq!(parse("event: e\ndata: a\ndata: b\n\ndata: c\n\n"), expected);
        assert_eq!(parse("event: e\r\ndata: a\r\ndata: b\r\n\r\ndata: c\r\n\r\n"), expected);
        assert_eq!(parse("event: e\rdata: a\rdata: b\r\rdata: c\r\r"), expected);
        assert_eq!(parse("event: e\r\ndata: a\rdata: b\n\r\ndata: c\r\n\n"), expected, "mixed");
    }

    #[test]
    fn a_field_split_across_chunks_reads_as_the_whole() {
        for body in [
            "event: response.completed\ndata: {\"type\":\"response.completed\"}\n\n",
            "data: a\r\ndata: b\r\n\r\n: c\r\ndata: [DONE]\r\n\r\n",
            "data: x\r\rdata: y\r\r",
            "data: caf\u{e9} \u{1F980}\n\n",
        ] {
            same_in_any_two_chunks(body);
        }
        assert_eq!(
            parse_chunks(&[b"data: one\r", b"\ndata: two\r", b"\n\r", b"\n"]),
            [ev("", "one\ntwo")],
            "a CRLF split between chunks is one line end"
        );
    }

    #[test]
    fn a_byte_order_mark_opens_only_the_first_line() {
        assert_eq!(parse("\u{feff}data: a\n\n"), [ev("", "a")]);
        assert_eq!(parse("data: a\n\n\u{feff}data: b\n\n"), [ev("", "a")], "later, it is part of a field name");
    }

    #[test]
    fn a_body_cut_short_gives_its_last_event_with_data() {
        assert_eq!(parse("data: a\n\ndata: b"), [ev("", "a"), ev("", "b")]);
        assert_eq!(parse("data: a\n\ndata: b\n"), [ev("", "a"), ev("", "b")]);
        assert_eq!(parse("data: a\n\nevent: x"), [ev("", "a")]);
    }

    #[test]
    fn done_inside_a_json_string_is_data_not_an_end() {
        let body = "data: {\"content\":\"a line data: [DONE]\\n\\n\"}\n\ndata: [DONE]\n\n";
        let events = parse(body);
        assert_eq!(events.len(), 2);
        assert_eq!(events[0].data, "{\"content\":\"a line data: [DONE]\\n\\n\"}");
        assert_eq!(events[1].data, "[DONE]");
    }

    #[test]
    fn the_type_is_the_event_name_else_the_data_type() {
        assert_eq!(ev("message_stop", "{\"type\":\"other\"}").type_name().as_deref(), Some("message_stop"));
        assert_eq!(ev("", "{\"a\":[1],\"type\":\"message_stop\"}").type_name().as_deref(), Some("message_stop"));
        assert_eq!(ev("", "{\"type\":\"a\\\"b\"}").type_name().as_deref(), Some("a\"b"));
        assert_eq!(ev("", "{\"a\":1}").type_name(), None);
        assert_eq!(ev("", "[DONE]").type_name(), None);
    }

    /// Bytes made of what an event stream is made of: lines of a field (`data`, `event`, another, a
    /// comment, none), a colon or not, a space or not and a value (empty, ASCII, a multi-byte
    /// character, a byte order mark, bytes that are not UTF-8), each ended by LF, CR or CRLF, or not
    /// ended at all (the body cut short).
    fn stream_bytes() -> impl proptest::strategy::Strategy<Value = Vec<u8>> {
        use proptest::prelude::*;
        let field = prop::sample::select(vec![&b"data"[..], b"event", b"id", b"", b":note"]);
        let value = prop::sample::select(vec![
            &b""[..],
            b"x",
            b"[DONE]",
            "\u{feff}".as_bytes(),
            "é".as_bytes(),
            b"\xc3",
            b"\xff",
        ]);
        let end = prop::sample::select(vec![&b"\n"[..], b"\r", b"\r\n", b""]);
        let line = (field, any::<bool>(), any::<bool>(), value, end).prop_map(|(field, colon, space, value, end)| {
            let colon: &[u8] = if colon { b":" } else { b"" };
            let space: &[u8] = if space { b" " } else { b"" };
            [field, colon, space, value, end].concat()
        });
        prop::collection::vec(line, 0..24).prop_map(|lines| lines.concat())
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 512, failure_persistence: None, ..Default::default() })]

        /// However an upstream's stream is cut into chunks (at random points, or byte by byte), the
        /// parser reads the events of the whole, with its bound on a line and an event or with a
        /// bound so small that lines and events run over it.
        #[test]
        fn any_stream_in_any_chunks_reads_as_the_whole(
            body in stream_bytes(),
            cuts in proptest::collection::vec(proptest::prelude::any::<proptest::sample::Index>(), 0..6),
            small in proptest::option::of(1usize..24),
        ) {
            let limit = small.unwrap_or(MAX_EVENT_BYTES);
            let mut at: Vec<usize> = cuts.iter().map(|c| c.index(body.len() + 1)).collect();
            at.sort_unstable();
            let chunks: Vec<&[u8]> =
                [0].iter().chain(&at).zip(at.iter().chain([&body.len()])).map(|(&a, &b)| &body[a..b]).collect();
            let whole = parse_chunks_within(limit, &[&body]);
            proptest::prop_assert_eq!(&parse_chunks_within(limit, &chunks), &whole);
            let bytes: Vec<&[u8]> = body.chunks(1).collect();
            proptest::prop_assert_eq!(&parse_chunks_within(limit, &bytes), &whole, "byte by byte");
        }
    }

    /// A line or an event's data over the bound is skipped with its event; the events around it are
    /// read, and what the parser holds stays within the bound however long the line goes on.
    #[test]
    fn a_line_or_an_event_over_the_bound_is_skipped_with_its_event() {
        let long = "x".repeat(40);
        let body = format!("data: a\n\ndata: {long}\n\ndata: b\ndata: {long}\n\n: {long}\ndata: c\n\ndata: d\n\n");
        assert_eq!(parse_chunks_within(32, &[body.as_bytes()]), [ev("", "a"), ev("", "d")]);
        assert_eq!(parse_chunks_within(1024, &[body.as_bytes()]).len(), 5);
        let mut parser = Parser::with_limit(32);
        for _ in 0..1000 {
            parser.feed(long.as_bytes(), &mut |_| panic!("no event yet"));
            assert!(parser.line.capacity() <= 32 && parser.pending.data.capacity() <= 32);
        }
        let mut events = Vec::new();
        parser.feed(b"\n\ndata: after\n\n", &mut |e| events.push(e.clone()));
        assert_eq!(events, [ev("", "after")]);
    }

    #[test]
    fn a_body_that_starts_with_a_field_looks_like_sse() {
        assert!(looks_like_sse(b"\n data: {}"));
        assert!(looks_like_sse(b"event: x\n"));
        assert!(looks_like_sse(b": comment\n"));
        assert!(!looks_like_sse(b"{\"data\": 1}"));
        assert!(!looks_like_sse(b""));
        assert!(!looks_like_sse(b"  \n"));
    }
}
