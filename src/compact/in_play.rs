//! What a conversation is working on now: the identifiers of its task, its last assistant turns and
//! its protected tail, with their dotted and path parts ([`InPlay`]); what relevance keeps old
//! output lines for (`compact::relevance`).

use rustc_hash::FxHashSet;

use super::markers::identifiers;

/// The identifiers the conversation works on now (see the module docs).
#[derive(Debug, Default)]
pub struct InPlay {
    keys: FxHashSet<String>,
}

impl InPlay {
    /// The identifiers of `texts` (and their dotted and path parts) in play.
    pub fn of_texts<'t>(texts: impl IntoIterator<Item = &'t str>) -> InPlay {
        let mut keys = FxHashSet::default();
        for text in texts {
            for token in identifiers(text) {
                for key in keys_of(token) {
                    if !keys.contains(key) {
                        keys.insert(key.to_owned());
                    }
                }
            }
        }
        InPlay { keys }
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    pub(super) fn contains(&self, key: &str) -> bool {
        self.keys.contains(key)
    }
}

/// What an identifier token is matched by: itself, and each part of a dotted name or a path that
/// is a name on its own (`self._remake_table` → `_remake_table`; `django/db/schema.py` →
/// `schema.py`), so that a call and a definition meet.
pub(super) fn keys_of(token: &str) -> impl Iterator<Item = &str> {
    let parts = token.split(['.', '/']).filter(|p| is_name_part(p));
    // A file's name (`schema.py`), not a directory's or a program's (`python`).
    let base = token.rsplit('/').next().filter(|b| b.len() != token.len() && b.len() >= 4 && b.contains('.'));
    std::iter::once(token).chain(parts.filter(move |p| p.len() != token.len())).chain(base)
}

/// A part of a dotted name worth matching alone: 4+ chars and not a plain lowercase word (`get`,
/// `items`, `objects` name too many lines to choose any).
fn is_name_part(part: &str) -> bool {
    // Dunder names (`__init__`, `__name__`) are in every Python file.
    let dunder = part.starts_with("__") && part.ends_with("__");
    part.len() >= 4
        && !dunder
        && part.bytes().any(|b| b.is_ascii_alphabetic())
        && (part.contains('_')
            || part.bytes().any(|b| b.is_ascii_digit())
            || part.as_bytes().windows(2).any(|w| w[0].is_ascii_lowercase() && w[1].is_ascii_uppercase()))
}
