//! pare's MCP server at `/_pare/mcp`: the streamable HTTP transport, answering each JSON-RPC request
//! of a `POST` with one JSON response, and one tool, `retrieve` (`id`, optional `lines`, `grep`),
//! which gives back the content a marker's `pare:` id names ([`super::retrieve::select`]).
//!
//! The server is stateless: it issues no `Mcp-Session-Id`, offers no server-to-client stream
//! (`GET` answers 405, as the transport allows) and sends no notifications, so every `POST` is
//! answered on its own. The methods are those a tool server needs: `initialize`,
//! `notifications/initialized`, `ping`, `tools/list`, `tools/call`. They are written here with serde
//! rather than with the official Rust SDK (`rmcp`): its streamable HTTP server is a tower service
//! with its own session manager and SSE machinery, several crates pare does not otherwise build,
//! for five methods that fit in this file.

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue};
use http::request::Parts;
use http::{Method, Response, StatusCode};
use serde_json::value::RawValue;
use serde_json::{Value, json};

use super::error::method_not_allowed;
use super::limits::Share;
use super::retrieve::{RetrieveError, select};
use super::state::Proxy;
use crate::compact::markers::RETRIEVE_TOOL;

/// The protocol revisions this server speaks, newest first: it answers `initialize` with the
/// client's revision when it is one of these, else the newest.
pub const PROTOCOL_VERSIONS: &[&str] = &["2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05"];

/// Most messages one batch may hold; a longer batch is refused whole (`-32600`).
pub const MAX_BATCH: usize = 32;

const PARSE_ERROR: i64 = -32700;
const INVALID_REQUEST: i64 = -32600;
const METHOD_NOT_FOUND: i64 = -32601;
const INVALID_PARAMS: i64 = -32602;

/// One JSON-RPC message as received: its id kept as the client wrote it (a number past 64 bits, a
/// string), never read as a number.
#[derive(serde::Deserialize)]
struct Message {
    jsonrpc: Option<Value>,
    /// `Some` whenever the member is present, `null` included (absent: a notification).
    #[serde(default, deserialize_with = "present")]
    id: Option<Box<RawValue>>,
    method: Option<Value>,
    #[serde(default)]
    params: Value,
    result: Option<Value>,
    error: Option<Value>,
}

fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Box<RawValue>>, D::Error> {
    <Box<RawValue> as serde::Deserialize>::deserialize(d).map(Some)
}

/// Answer one HTTP request to [`super::paths::MCP_PATH`]. The retrieved contents of all its calls are held in
/// one share of the request budget until the answer is written.
pub async fn handle(proxy: &Proxy, parts: &Parts, body: Bytes) -> Response<Bytes> {
    if parts.method != Method::POST {
        return method_not_allowed("POST");
    }
    let parse_error =
        |e: serde_json::Error| json(StatusCode::BAD_REQUEST, error(&null(), PARSE_ERROR, &format!("not JSON: {e}")));
    let message: Box<RawValue> = match serde_json::from_slice(&body) {
        Ok(message) => message,
        Err(e) => return parse_error(e),
    };
    let mut share = proxy.buffers.share();
    // A batch (revisions before 2025-06-18) is answered as one array of the requests' responses,
    // written into one string as they come (each answer's text is held once).
    let answers = if message.get().starts_with('[') {
        let batch: Vec<Box<RawValue>> = match serde_json::from_str(message.get()) {
            Ok(batch) => batch,
            Err(e) => return parse_error(e),
        };
        if batch.is_empty() {
            Some(error(&null(), INVALID_REQUEST, "a batch holds at least one message"))
        } else if batch.len() > MAX_BATCH {
            let why = format!("a batch holds at most {MAX_BATCH} messages, not {}", batch.len());
            Some(error(&null(), INVALID_REQUEST, &why))
        } else {
            let mut answers = String::from("[");
            for one in &batch {
                if let Some(answer) = answer(proxy, one, &mut share).await {
                    if answers.len() > 1 {
                        answers.push(',');
                    }
                    answers.push_str(&answer);
                }
            }
            answers.push(']');
            (answers.len() > 2).then_some(answers)
        }
    } else {
        answer(proxy, &message, &mut share).await
    };
    match answers {
        Some(answer) => json(StatusCode::OK, answer),
        // Only notifications or responses: accepted, nothing to say.
        None => {
            let mut response = Response::new(Bytes::new());
            *response.status_mut() = StatusCode::ACCEPTED;
            response
        }
    }
}

fn null() -> Box<RawValue> {
    RawValue::from_string("null".into()).expect("json")
}

fn json(status: StatusCode, text: String) -> Response<Bytes> {
    let mut response = Response::new(Bytes::from(text));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// A response, its id written as the request wrote it.
fn reply(id: &RawValue, outcome: Result<Value, Value>) -> String {
    #[derive(serde::Serialize)]
    struct Reply<'a> {
        jsonrpc: &'static str,
        id: &'a RawValue,
        #[serde(skip_serializing_if = "Option::is_none")]
        result: Option<Value>,
        #[serde(skip_serializing_if = "Option::is_none")]
        error: Option<Value>,
    }
    let (result, error) = match outcome {
        Ok(result) => (Some(result), None),
        Err(error) => (None, Some(error)),
    };
    serde_json::to_string(&Reply { jsonrpc: "2.0", id, result, error }).expect("a reply serializes")
}

fn error(id: &RawValue, code: i64, message: &str) -> String {
    reply(id, Err(json!({"code": code, "message": message})))
}

fn result(id: &RawValue, result: Value) -> String {
    reply(id, Ok(result))
}

/// The response to one JSON-RPC message; `None` for a notification or a response from the client.
async fn answer(proxy: &Proxy, message: &RawValue, share: &mut Share) -> Option<String> {
    let object = message.get().starts_with('{');
    let Some(message) = object.then(|| serde_json::from_str::<Message>(message.get()).ok()).flatten() else {
        return Some(error(&null(), INVALID_REQUEST, "a JSON-RPC message is an object"));
    };
    // An id is a string, a number or null; anything else cannot be answered under it.
    let id = match message.id {
        Some(id) if id.get().starts_with(['{', '[', 't', 'f']) => {
            return Some(error(&null(), INVALID_REQUEST, "a JSON-RPC id is a string or a number"));
        }
        id => id,
    };
    if message.jsonrpc.as_ref().and_then(Value::as_str) != Some("2.0") {
        let id = id.unwrap_or_else(null);
        return Some(error(&id, INVALID_REQUEST, "pare's MCP server speaks JSON-RPC \"2.0\" only"));
    }
    let Some(method) = message.method else {
        // A response to a request of ours (we send none) is accepted silently; anything else
        // without a method is an invalid request, answered even without an id.
        if id.is_some() && (message.result.is_some() || message.error.is_some()) {
            return None;
        }
        return Some(error(&id.unwrap_or_else(null), INVALID_REQUEST, "a JSON-RPC request names its method"));
    };
    let Some(method) = method.as_str() else {
        return Some(error(&id.unwrap_or_else(null), INVALID_REQUEST, "a JSON-RPC method is a string"));
    };
    let id = id?; // notifications (`notifications/initialized`, cancellations) need no answer
    let params = message.params;
    Some(match method {
        "initialize" => result(&id, initialize(&params)),
        "ping" => result(&id, json!({})),
        "tools/list" => result(&id, json!({"tools": [tool()]})),
        "tools/call" => match call(proxy, &params, share).await {
            Ok(value) => result(&id, value),
            Err(message) => error(&id, INVALID_PARAMS, &message),
        },
        other => error(&id, METHOD_NOT_FOUND, &format!("method {other:?} is not offered by pare's MCP server")),
    })
}

fn initialize(params: &Value) -> Value {
    let asked = params.get("protocolVersion").and_then(Value::as_str);
    let version = asked.filter(|v| PROTOCOL_VERSIONS.contains(v)).unwrap_or(PROTOCOL_VERSIONS[0]);
    json!({
        "protocolVersion": version,
        "capabilities": {"tools": {"listChanged": false}},
        "serverInfo": {"name": "pare", "title": "pare compaction proxy", "version": env!("CARGO_PKG_VERSION")},
        "instructions": "pare compacts this agent's context. A marker such as `[tool: … ; pare:0123456789ab]` \
            stands for content pare hid; call `retrieve` with that id to get the content back exactly as it \
            was, or only some lines of it (`lines`, `grep`).",
    })
}

/// The `retrieve` tool's definition.
fn tool() -> Value {
    json!({
        "name": RETRIEVE_TOOL,
        "title": "Retrieve hidden content (pare)",
        "description": "Get back content that pare (the compaction proxy) replaced by a marker: the text a \
            `pare:` id in a marker names, exactly as it was sent. Use `lines` for a range of its lines or \
            `grep` for the lines matching a regular expression (with their line numbers) to read less.",
        "inputSchema": {
            "type": "object",
            "properties": {
                "id": {"type": "string", "description": "The id from the marker, e.g. pare:0123456789ab"},
                "lines": {"type": "string", "description": "Lines to return, A-B (1-based, inclusive) or A- to the end"},
                "grep": {"type": "string", "description": "A regular expression: return the matching lines as `N: line`"},
            },
            "required": ["id"],
            "additionalProperties": false,
        },
        "annotations": {"readOnlyHint": true, "idempotentHint": true, "openWorldHint": false},
    })
}

/// `tools/call`: the result (a tool error, such as an unknown id, is a result with `isError`), or
/// the message of a protocol error (an unknown tool, arguments that are not strings).
async fn call(proxy: &Proxy, params: &Value, share: &mut Share) -> Result<Value, String> {
    let name = params.get("name").and_then(Value::as_str).unwrap_or_default();
    if name != RETRIEVE_TOOL {
        return Err(format!("unknown tool {name:?} (pare offers {RETRIEVE_TOOL:?})"));
    }
    let arguments = params.get("arguments").cloned().unwrap_or_else(|| json!({}));
    let text = |key: &str| -> Result<Option<String>, String> {
        match arguments.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(Value::Number(n)) if key == "lines" => Ok(Some(n.to_string())),
            Some(other) => Err(format!("argument {key:?} must be a string, not {other}")),
        }
    };
    let Some(id) = text("id")? else { return Err("argument \"id\" is required".into()) };
    let (lines, grep) = (text("lines")?, text("grep")?);
    Ok(match select(proxy, &id, lines.as_deref(), grep.as_deref(), share).await {
        Ok(content) => json!({"content": [{"type": "text", "text": content}], "isError": false}),
        Err(err) => tool_error(&err),
    })
}

fn tool_error(err: &RetrieveError) -> Value {
    json!({"content": [{"type": "text", "text": err.to_string()}], "isError": true})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn initialize_answers_the_clients_revision_when_known() {
        assert_eq!(initialize(&json!({"protocolVersion": "2025-03-26"}))["protocolVersion"], "2025-03-26");
        assert_eq!(initialize(&json!({"protocolVersion": "1999-01-01"}))["protocolVersion"], PROTOCOL_VERSIONS[0]);
        assert_eq!(initialize(&json!({}))["capabilities"]["tools"]["listChanged"], false);
    }

    #[test]
    fn the_tool_requires_an_id() {
        assert_eq!(tool()["inputSchema"]["required"], json!(["id"]));
        assert_eq!(tool()["name"], RETRIEVE_TOOL);
    }
}
