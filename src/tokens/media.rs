//! Media parts — images, audio, documents — in every wire's spelling, each counted as a fixed
//! estimate of its kind, never as its (base64) text: providers bill an image by its pixels and a
//! PDF by its pages, not by the bytes that carry them.
//!
//! | wire | image | audio | document, video, other file |
//! |---|---|---|---|
//! | Chat Completions | `image_url` | `input_audio` | `file` |
//! | Responses | `input_image` | `input_audio` | `input_file` |
//! | Messages | `image` | — | `document` |
//! | Gemini | `inlineData` / `fileData` with an `image/*` MIME type | … `audio/*` | … any other |

use memchr::memmem;
use serde_json::{Map, Value};

/// What a media part is, as far as its count goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MediaKind {
    Image,
    Audio,
    /// A PDF or another document, a video, any other file.
    Document,
}

/// The tokens counted for one media part of each kind (`budget.image_tokens`,
/// `budget.audio_tokens`, `budget.document_tokens`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MediaTokens {
    pub image: u64,
    pub audio: u64,
    pub document: u64,
}

impl Default for MediaTokens {
    fn default() -> Self {
        MediaTokens { image: 765, audio: 1000, document: 3000 }
    }
}

impl MediaTokens {
    pub fn of(&self, kind: MediaKind) -> u64 {
        match kind {
            MediaKind::Image => self.image,
            MediaKind::Audio => self.audio,
            MediaKind::Document => self.document,
        }
    }
}

/// The media kind of a content part whose `type` is `kind` and whose other members are `members`
/// (Gemini's parts have no `type`: their one member names them).
pub fn kind_of_part(kind: Option<&str>, members: &Map<String, Value>) -> Option<MediaKind> {
    for key in ["inlineData", "inline_data", "fileData", "file_data"] {
        if let Some(Value::Object(data)) = members.get(key) {
            let mime = data.get("mimeType").or_else(|| data.get("mime_type")).and_then(Value::as_str).unwrap_or("");
            return Some(kind_of_mime(mime));
        }
    }
    match kind? {
        "image_url" | "image" | "input_image" => Some(MediaKind::Image),
        "input_audio" => Some(MediaKind::Audio),
        "file" | "input_file" | "document" => Some(MediaKind::Document),
        _ => None,
    }
}

/// The media kind of a JSON object, when it is a media part.
pub fn kind_of_object(object: &Map<String, Value>) -> Option<MediaKind> {
    kind_of_part(object.get("type").and_then(Value::as_str), object)
}

fn kind_of_mime(mime: &str) -> MediaKind {
    let top = mime.split('/').next().unwrap_or("").trim().to_ascii_lowercase();
    match top.as_str() {
        "image" => MediaKind::Image,
        "audio" => MediaKind::Audio,
        _ => MediaKind::Document,
    }
}

/// Whether `json` may hold a media part (a quick look at its bytes; a yes is checked by parsing).
pub fn may_hold_media(json: &str) -> bool {
    const MARKS: [&str; 7] =
        ["\"image", "\"input_", "\"file", "\"document\"", "\"inlineData\"", "\"inline_data\"", "Data\""];
    MARKS.iter().any(|mark| memmem::find(json.as_bytes(), mark.as_bytes()).is_some())
}

/// Take every media part out of the arrays in `value` (at any depth: a tool result may hold
/// images) and return their tokens; what is left is counted as text.
pub fn take_media(value: &mut Value, tokens: &MediaTokens) -> u64 {
    match value {
        Value::Array(items) => {
            let mut n = 0;
            items.retain_mut(|item| {
                if let Value::Object(object) = item
                    && let Some(kind) = kind_of_object(object)
                {
                    n += tokens.of(kind);
                    return false;
                }
                n += take_media(item, tokens);
                true
            });
            n
        }
        Value::Object(object) => object.values_mut().map(|member| take_media(member, tokens)).sum(),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_wires_media_parts_are_recognised() {
        let parts = [
            (r#"{"type":"image_url","image_url":{"url":"data:image/png;base64,AA"}}"#, MediaKind::Image),
            (r#"{"type":"input_audio","input_audio":{"data":"AA","format":"wav"}}"#, MediaKind::Audio),
            (r#"{"type":"file","file":{"file_data":"AA","filename":"a.pdf"}}"#, MediaKind::Document),
            (r#"{"type":"input_image","image_url":"data:image/png;base64,AA"}"#, MediaKind::Image),
            (r#"{"type":"input_file","file_data":"AA","filename":"a.pdf"}"#, MediaKind::Document),
            (r#"{"type":"image","source":{"type":"base64","media_type":"image/png","data":"AA"}}"#, MediaKind::Image),
            (
                r#"{"type":"document","source":{"type":"base64","media_type":"application/pdf","data":"AA"}}"#,
                MediaKind::Document,
            ),
            (r#"{"inlineData":{"mimeType":"image/png","data":"AA"}}"#, MediaKind::Image),
            (r#"{"inline_data":{"mime_type":"audio/mp3","data":"AA"}}"#, MediaKind::Audio),
            (r#"{"fileData":{"mimeType":"video/mp4","fileUri":"gs://b/v.mp4"}}"#, MediaKind::Document),
        ];
        for (part, kind) in parts {
            let object: Map<String, Value> = serde_json::from_str(part).unwrap();
            assert_eq!(kind_of_object(&object), Some(kind), "{part}");
            assert!(may_hold_media(part), "{part}");
        }
        let text: Map<String, Value> = serde_json::from_str(r#"{"type":"text","text":"an image"}"#).unwrap();
        assert_eq!(kind_of_object(&text), None);
    }

    #[test]
    fn media_is_taken_out_at_any_depth() {
        let mut value: Value = serde_json::from_str(
            r#"[{"type":"tool_result","content":[{"type":"text","text":"shot"},{"type":"image","source":{"data":"AAAA"}}]},{"inlineData":{"mimeType":"application/pdf","data":"AA"}}]"#,
        )
        .unwrap();
        assert_eq!(take_media(&mut value, &MediaTokens::default()), 765 + 3000);
        assert_eq!(value.to_string(), r#"[{"type":"tool_result","content":[{"type":"text","text":"shot"}]}]"#);
    }
}
