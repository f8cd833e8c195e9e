//! Replaying a session: its requests, in order, through the same [`ConversationCompactor`] path the proxy
//! uses, giving exactly the bodies the proxy would forward. Shared by `pare replay` and `pare eval`.

use crate::exchange::{CompactInput, CompactionSummary, ConversationCompactor, compact_fail_open};
use crate::wire::Wire;

/// One replayed request.
#[derive(Debug, Clone)]
pub struct Replayed {
    /// The body pare forwards (the raw bytes when nothing changed or compaction did not apply).
    pub forwarded: Vec<u8>,
    /// `None` when the body was not compacted at all (unparseable, or the compactor failed).
    pub summary: Option<CompactionSummary>,
    /// Why compaction did not apply, as the proxy would log it.
    pub skipped: Option<String>,
    /// The texts the forwarded markers name that compaction derived ([`crate::exchange::CompactOutput::lists`]): what
    /// the archive would store with this request.
    pub lists: std::sync::Arc<[String]>,
}

/// Forward one request of `session` as the proxy does: unparseable bodies, requests that ask the
/// server to compact ([`crate::wire::WireBody::server_compaction`]) and compactor failures (errors
/// or panics) forward the raw bytes.
pub fn replay_request(
    compactor: &dyn ConversationCompactor,
    wire: Wire,
    session: &str,
    raw: &[u8],
    window: Option<u64>,
) -> Replayed {
    replay_request_at(compactor, wire, "", session, raw, window)
}

/// [`replay_request`] for a request sent to `path` (a Gemini request names its model there:
/// [`crate::wire::parse_at`]).
pub fn replay_request_at(
    compactor: &dyn ConversationCompactor,
    wire: Wire,
    path: &str,
    session: &str,
    raw: &[u8],
    window: Option<u64>,
) -> Replayed {
    let body = match crate::wire::parse_at(wire, path, raw) {
        Ok(body) => body,
        Err(err) => {
            return Replayed {
                forwarded: raw.to_vec(),
                summary: None,
                skipped: Some(err.to_string()),
                lists: Default::default(),
            };
        }
    };
    if let Some(why) = body.server_compaction() {
        return Replayed {
            forwarded: raw.to_vec(),
            summary: None,
            skipped: Some(why.to_owned()),
            lists: Default::default(),
        };
    }
    let messages = body.messages();
    let hashes = crate::neutral::message_hashes(&messages);
    let input = CompactInput {
        session,
        raw,
        body: body.as_ref(),
        messages: &messages,
        hashes: &hashes,
        window,
        defer_counts: false,
    };
    match compact_fail_open(compactor, &input) {
        Ok(out) => {
            let forwarded = out.body.unwrap_or_else(|| raw.to_vec());
            Replayed { forwarded, summary: Some(out.summary), skipped: None, lists: out.lists }
        }
        Err(skipped) => {
            Replayed { forwarded: raw.to_vec(), summary: None, skipped: Some(skipped), lists: Default::default() }
        }
    }
}

/// The non-empty lines of a session file (one request body per line), without line endings.
pub fn session_lines(text: &[u8]) -> Vec<&[u8]> {
    text.split(|b| *b == b'\n')
        .map(|line| line.strip_suffix(b"\r").unwrap_or(line))
        .filter(|line| line.iter().any(|b| !b.is_ascii_whitespace()))
        .collect()
}

/// Replay every request of one session in order.
pub fn replay_session(
    compactor: &dyn ConversationCompactor,
    wire: Wire,
    session: &str,
    requests: &[&[u8]],
    window: Option<u64>,
) -> Vec<Replayed> {
    requests.iter().map(|raw| replay_request(compactor, wire, session, raw, window)).collect()
}
