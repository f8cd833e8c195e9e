//! The sessions `pare eval` reads: a directory of session files or a pare archive, all of them or
//! one side of a split by task.
//!
//! **The split.** A session's *task* is what its runs share: a SWE-bench instance
//! (`owner__repo-1234`) named in the session's id, else the id without a `-trialN` suffix, else the
//! id itself. The task's xxh3 hash decides its side: even → `tune`, odd → `holdout`. Every run of a
//! task falls on the same side, on any corpus, with no list to keep: `pare eval --split holdout`
//! reports on sessions whose tasks no setting was tuned on.

use std::path::{Path, PathBuf};
use std::sync::LazyLock;

use regex::Regex;
use xxhash_rust::xxh3::xxh3_64;

use crate::archive::ArchiveError;
use crate::archive::query::{ArchiveReader, SessionFilter};
use crate::archive::read::BodyKind;

/// Why a corpus could not be read.
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    #[error("cannot read corpus `{path}`: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("corpus `{0}` holds no *.jsonl session files")]
    Empty(PathBuf),
}

/// Every `*.jsonl` file under `dir`, sorted by path (so reports are stable).
pub fn session_files(dir: &Path) -> Result<Vec<PathBuf>, EvalError> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), EvalError> {
        let entries = std::fs::read_dir(dir).map_err(|source| EvalError::Io { path: dir.to_owned(), source })?;
        for entry in entries {
            let path = entry.map_err(|source| EvalError::Io { path: dir.to_owned(), source })?.path();
            if path.is_dir() {
                walk(&path, out)?;
            } else if path.extension().is_some_and(|e| e == "jsonl") {
                out.push(path);
            }
        }
        Ok(())
    }
    let mut files = Vec::new();
    walk(dir, &mut files)?;
    files.sort();
    if files.is_empty() {
        return Err(EvalError::Empty(dir.to_owned()));
    }
    Ok(files)
}

/// One side of the split by task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    Tune,
    Holdout,
}

impl Split {
    pub fn name(self) -> &'static str {
        match self {
            Split::Tune => "tune",
            Split::Holdout => "holdout",
        }
    }
}

static SWE_BENCH_TASK: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?:^|_)([A-Za-z0-9][A-Za-z0-9.-]*__[A-Za-z0-9.-]*-\d+)(?:__|$)").expect("static regex")
});
static TRIAL: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"-trial\d+$").expect("static regex"));

/// The task a session id names (see the module docs).
pub fn task_of(id: &str) -> &str {
    if let Some(task) = SWE_BENCH_TASK.captures(id).and_then(|c| c.get(1)) {
        return task.as_str();
    }
    match TRIAL.find(id) {
        Some(trial) => &id[..trial.start()],
        None => id,
    }
}

/// The side of the split a session falls on.
pub fn split_of(id: &str) -> Split {
    if xxh3_64(task_of(id).as_bytes()) % 2 == 0 { Split::Tune } else { Split::Holdout }
}

/// One session to evaluate: where it comes from and its request bodies.
#[derive(Debug, Clone)]
pub struct SessionInput {
    /// The corpus source (a session file's parent directory; `archive` for an archive).
    pub source: String,
    pub id: String,
    pub requests: Requests,
}

/// A session's requests: a file of one body per line (read when evaluated), or bodies in hand.
#[derive(Debug, Clone)]
pub enum Requests {
    File(PathBuf),
    Bodies(Vec<Vec<u8>>),
}

/// Every session file under `dir` (see [`session_files`]).
pub fn from_dir(dir: &Path) -> Result<Vec<SessionInput>, EvalError> {
    Ok(session_files(dir)?
        .into_iter()
        .map(|path| SessionInput {
            source: path
                .parent()
                .and_then(Path::file_name)
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            id: path.file_stem().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
            requests: Requests::File(path),
        })
        .collect())
}

/// Every session of the pare archive at `location` (a directory or a PostgreSQL URL): its raw
/// request bodies in the order they arrived, exactly as the agent sent them.
pub fn from_archive(location: impl Into<crate::archive::Location>) -> Result<Vec<SessionInput>, ArchiveError> {
    let reader = ArchiveReader::open(location)?;
    let mut out = Vec::new();
    for session in reader.sessions(&SessionFilter::default())? {
        let mut bodies = Vec::new();
        for exchange in reader.exchanges(&session.id)? {
            if exchange.method == "POST" {
                bodies.push(reader.body(&session.id, exchange.seq, BodyKind::Raw)?);
            }
        }
        if !bodies.is_empty() {
            out.push(SessionInput { source: "archive".to_owned(), id: session.id, requests: Requests::Bodies(bodies) });
        }
    }
    Ok(out)
}

/// `sessions` on one side of the split, or all of them.
pub fn select(sessions: Vec<SessionInput>, split: Option<Split>) -> Vec<SessionInput> {
    sessions.into_iter().filter(|s| split.is_none_or(|side| split_of(&s.id) == side)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tasks_are_read_from_session_ids() {
        assert_eq!(task_of("pr816__deepseek_chat_dev__pylint-dev__astroid-1268"), "pylint-dev__astroid-1268");
        assert_eq!(task_of("pr816__deepseek_chat_dev_rerun__pylint-dev__astroid-1268"), "pylint-dev__astroid-1268");
        assert_eq!(task_of("pr816__deepseek_chat_test_1-100__django__django-10924"), "django__django-10924");
        assert_eq!(task_of("v0.15-claude-3-5-sonnet__astropy__astropy-12907"), "astropy__astropy-12907");
        assert_eq!(task_of("pr816__deepseek_chat_dev__pvlib__pvlib-python-1606"), "pvlib__pvlib-python-1606");
        assert_eq!(
            task_of("replay__marshmallow-code__marshmallow-1867__function_calling__install-1"),
            "marshmallow-code__marshmallow-1867"
        );
        assert_eq!(task_of("airline-task00-trial3"), "airline-task00");
        assert_eq!(task_of("captured_requests"), "captured_requests");
    }

    #[test]
    fn runs_of_one_task_fall_on_one_side() {
        let runs = ["a__deepseek_chat_dev__pydicom__pydicom-1413", "b__deepseek_chat_dev_rerun__pydicom__pydicom-1413"];
        assert_eq!(split_of(runs[0]), split_of(runs[1]));
        let trials: Vec<Split> = (0..5).map(|k| split_of(&format!("retail-task07-trial{k}"))).collect();
        assert!(trials.iter().all(|s| *s == trials[0]));
        // Both sides are met over a few tasks.
        let sides: Vec<Split> = (0..16).map(|k| split_of(&format!("airline-task{k:02}-trial0"))).collect();
        assert!(sides.contains(&Split::Tune) && sides.contains(&Split::Holdout));
    }
}
