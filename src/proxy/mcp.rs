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
use serde_json::{Value, json};

use super::error::method_not_allowed;
use super::retrieve::{RetrieveError, select};
use super::state::Proxy;
use crate::compact::markers::RETRIEVE_TOOL;

/// Where the MCP server is mounted.
pub const MCP_PATH: &str = "/_pare/mcp";

/// The protocol revisions this server speaks, newest first: it answers `initialize` with the
/// client's revision when it is one of these, else the newest.
pub const PROTOCOL_VERSIONS: &[&str] = &["2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05"];

const PARSE_ERROR: i64 = -32700;
const INVALID_REQUEST: i64 = -32600;
const METHOD_NOT_FOUND: i64 = -32601;
const INVALID_PARAMS: i64 = -32602;

/// Answer one HTTP request to [`MCP_PATH`].
pub async fn handle(proxy: &Proxy, parts: &Parts, body: Bytes) -> Response<Bytes> {
    if parts.method != Method::POST {
        return method_not_allowed("POST");
    }
    let message: Value = match serde_json::from_slice(&body) {
        Ok(message) => message,
        Err(e) => return json(StatusCode::BAD_REQUEST, error(Value::Null, PARSE_ERROR, &format!("not JSON: {e}"))),
    };
    // A batch (revisions before 2025-06-18) is answered as one array of the requests' responses.
    let answers = match &message {
        Value::Array(batch) if !batch.is_empty() => {
            let mut answers = Vec::new();
            for one in batch {
                answers.extend(answer(proxy, one).await);
            }
            (!answers.is_empty()).then_some(Value::Array(answers))
        }
        one => answer(proxy, one).await,
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

fn json(status: StatusCode, value: Value) -> Response<Bytes> {
    let mut response = Response::new(Bytes::from(value.to_string()));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

fn error(id: Value, code: i64, message: &str) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}})
}

fn result(id: Value, result: Value) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "result": result})
}

/// The response to one JSON-RPC message; `None` for a notification or a response from the client.
async fn answer(proxy: &Proxy, message: &Value) -> Option<Value> {
    let Some(object) = message.as_object() else {
        return Some(error(Value::Null, INVALID_REQUEST, "a JSON-RPC message is an object"));
    };
    let id = object.get("id").cloned();
    let Some(method) = object.get("method").and_then(Value::as_str) else {
        // A response to a request of ours (we send none) or garbage with an id.
        return id
            .filter(|_| !object.contains_key("result") && !object.contains_key("error"))
            .map(|id| error(id, INVALID_REQUEST, "a JSON-RPC request names its method"));
    };
    let id = id?; // notifications (`notifications/initialized`, cancellations) need no answer
    let params = object.get("params").cloned().unwrap_or(Value::Null);
    Some(match method {
        "initialize" => result(id, initialize(&params)),
        "ping" => result(id, json!({})),
        "tools/list" => result(id, json!({"tools": [tool()]})),
        "tools/call" => match call(proxy, &params).await {
            Ok(value) => result(id, value),
            Err(message) => error(id, INVALID_PARAMS, &message),
        },
        other => error(id, METHOD_NOT_FOUND, &format!("method {other:?} is not offered by pare's MCP server")),
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
async fn call(proxy: &Proxy, params: &Value) -> Result<Value, String> {
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
    Ok(match select(proxy, &id, lines.as_deref(), grep.as_deref()).await {
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
