//! Tidy checks that keep the tree honest: doc paths that name no file or module, a `lib.rs` layout
//! that does not match `src/`, commit hashes in the Markdown docs (history belongs to git), and
//! proptest regression files whose source file is gone (their cases would never run again).
//!
//! Each check is a function over text (and a lookup of the tree) with its own unit tests on small
//! inputs, so that a check which could never fail is caught here too.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use regex::Regex;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The Markdown the project documents itself with: the top level and `docs/`.
fn markdown_files(root: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for dir in [root.to_path_buf(), root.join("docs")] {
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display())) {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|ext| ext == "md") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// Every file under `dir`, recursively, sorted.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for entry in entries {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

fn relative(root: &Path, path: &Path) -> String {
    path.strip_prefix(root).unwrap_or(path).to_string_lossy().replace('\\', "/")
}

/// The Markdown outside fenced code blocks, line for line (a fenced line becomes empty, so line
/// numbers stay): commands and sample output in fences may name example files and ids.
fn prose(markdown: &str) -> String {
    let mut in_fence = false;
    let mut out = String::with_capacity(markdown.len());
    for line in markdown.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("```") || trimmed.starts_with("~~~") {
            in_fence = !in_fence;
        } else if !in_fence {
            out.push_str(line);
        }
        out.push('\n');
    }
    out
}

/// The doc comments (`//!` and `///` lines) of a Rust file, line for line (other lines empty).
fn doc_comments(source: &str) -> String {
    let mut out = String::with_capacity(source.len() / 2);
    for line in source.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("//!") || trimmed.starts_with("///") {
            out.push_str(trimmed);
        }
        out.push('\n');
    }
    out
}

/// `{a,b}` groups expanded, as a shell expands them: `src/cli/{replay,eval}.rs` is two paths.
fn expand_braces(path: &str) -> Vec<String> {
    let (Some(open), Some(close)) = (path.find('{'), path.find('}')) else { return vec![path.to_owned()] };
    if close < open {
        return vec![path.to_owned()];
    }
    let (head, tail) = (&path[..open], &path[close + 1..]);
    path[open + 1..close]
        .split(',')
        .flat_map(|alternative| expand_braces(&format!("{head}{alternative}{tail}")))
        .collect()
}

/// The repository paths a text names (`src/…`, `tests/…`, `docs/…` and the other top-level
/// directories), with each line's number, braces expanded. A path must start a word: `/tmp/src/x`
/// and URLs are not repository paths.
fn named_paths(text: &str) -> Vec<(usize, String)> {
    let path = Regex::new(
        r"(?:^|[\s`(\[<])((?:src|tests|benches|examples|fuzz|rules|deploy|docs|proptest-regressions)/[A-Za-z0-9_.{},*/-]*)",
    )
    .unwrap();
    let mut found = Vec::new();
    for (line_idx, line) in text.lines().enumerate() {
        for captures in path.captures_iter(line) {
            let mut named = captures[1].to_owned();
            // Sentence punctuation after a path is not part of it (a brace group's commas are).
            while named.ends_with(['.', ',', ':', ';']) && !named.ends_with("..") {
                named.pop();
            }
            for expanded in expand_braces(&named) {
                found.push((line_idx + 1, expanded));
            }
        }
    }
    found
}

/// Whether `path` names something in the tree under `root`; a `*` matches within one path segment.
fn path_exists(root: &Path, path: &str) -> bool {
    if !path.contains('*') {
        return root.join(path).exists();
    }
    let (dir, pattern) = path.rsplit_once('/').unwrap_or(("", path));
    if dir.contains('*') {
        return false;
    }
    let glob = Regex::new(&format!("^{}$", regex::escape(pattern).replace(r"\*", "[^/]*"))).unwrap();
    std::fs::read_dir(root.join(dir))
        .map(|entries| entries.flatten().any(|e| glob.is_match(&e.file_name().to_string_lossy())))
        .unwrap_or(false)
}

/// The paths a text names that `exists` does not know, as `line: path`. A path through a hidden
/// directory (`tests/e2e/.node`, `.venv-e2e`) names something a run creates, not part of the tree.
fn missing_paths(text: &str, exists: impl Fn(&str) -> bool) -> Vec<String> {
    named_paths(text)
        .into_iter()
        .filter(|(_, p)| !p.split('/').any(|segment| segment.starts_with('.') && segment.len() > 2))
        .filter(|(_, p)| !exists(p))
        .map(|(line, p)| format!("{line}: {p}"))
        .collect()
}

/// Which named paths the doc comments of Rust files are held to: source files, Markdown and
/// directories. Other paths there are examples of what pare reads (`src/a.py` in a test's doc).
fn checked_in_rust_docs(path: &str) -> bool {
    path.ends_with(".rs") || path.ends_with(".md") || path.ends_with('/')
}

/// Words that look like git commit hashes: 7 to 40 lowercase hex digits with at least one digit and
/// one letter, standing alone (not inside a longer word or number).
fn commit_hashes(text: &str) -> Vec<String> {
    let hex = Regex::new(r"\b[0-9a-f]{7,40}\b").unwrap();
    let mut found = Vec::new();
    for (line_idx, line) in text.lines().enumerate() {
        for word in hex.find_iter(line).map(|m| m.as_str()) {
            if word.bytes().any(|b| b.is_ascii_digit()) && word.bytes().any(|b| b.is_ascii_lowercase()) {
                found.push(format!("{}: {word}", line_idx + 1));
            }
        }
    }
    found
}

/// The modules `lib.rs`'s `# Layout` section names, in order: each list item's leading [`name`].
fn layout_modules(lib_rs: &str) -> Vec<String> {
    let item = Regex::new(r"^//! - \[`([a-z_][a-z0-9_]*)`\]").unwrap();
    lib_rs
        .lines()
        .skip_while(|line| line.trim() != "//! # Layout")
        .take_while(|line| line.starts_with("//!"))
        .filter_map(|line| item.captures(line).map(|c| c[1].to_owned()))
        .collect()
}

/// The modules `lib.rs` declares (`pub mod name;`).
fn declared_modules(lib_rs: &str) -> BTreeSet<String> {
    let decl = Regex::new(r"(?m)^\s*(?:pub(?:\([a-z]+\))?\s+)?mod\s+([a-z_][a-z0-9_]*)\s*;").unwrap();
    decl.captures_iter(lib_rs).map(|c| c[1].to_owned()).collect()
}

/// The top-level modules in the tree: a file of `src/` other than `lib.rs` and `main.rs`, or a
/// directory of `src/` with a `mod.rs`.
fn tree_modules(src: &Path) -> BTreeSet<String> {
    let mut modules = BTreeSet::new();
    for entry in std::fs::read_dir(src).unwrap().flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if path.is_dir() && path.join("mod.rs").exists() {
            modules.insert(name);
        } else if let Some(stem) = name.strip_suffix(".rs") {
            if stem != "lib" && stem != "main" {
                modules.insert(stem.to_owned());
            }
        }
    }
    modules
}

/// How the layout, the declarations and the tree disagree; empty when they match.
fn layout_problems(layout: &[String], declared: &BTreeSet<String>, tree: &BTreeSet<String>) -> Vec<String> {
    let listed: BTreeSet<String> = layout.iter().cloned().collect();
    let mut problems = Vec::new();
    for name in tree.difference(&listed) {
        problems.push(format!("src/ has module `{name}`, the layout does not name it"));
    }
    for name in listed.difference(tree) {
        problems.push(format!("the layout names `{name}`, src/ has no such module"));
    }
    for name in declared.symmetric_difference(tree) {
        problems.push(format!("`{name}` is declared in lib.rs or in src/, not both"));
    }
    if listed.len() != layout.len() {
        problems.push("the layout names a module twice".to_owned());
    }
    problems
}

/// Whether `source` defines `name` as an item, or re-exports it with a `use`.
fn defines(source: &str, name: &str) -> bool {
    let name = regex::escape(name);
    let item = Regex::new(&format!(
        r"(?m)\b(?:fn|struct|enum|trait|type|const|static|mod|union)\s+{name}\b|macro_rules!\s*{name}\b|^\s*pub(?:\([a-z]+\))?\s+use\b[^;]*\b{name}\b"
    ))
    .unwrap();
    item.is_match(source)
}

/// The lookups a module path is resolved against: the source of a module of the library (by its
/// path below the crate root), and the source of an integration-test module (a file of `tests/it/`
/// by its name).
struct Sources<'a> {
    module: &'a dyn Fn(&[&str]) -> Option<String>,
    test_module: &'a dyn Fn(&str) -> Option<String>,
}

/// Whether a Rust path such as `wire::responses::check_items` names something that exists. Paths
/// that start with a library module walk its submodules; the first segment that is not a module must
/// be an item that module defines (what follows it, a method or a variant, is not checked). A path
/// `test_module::name` may also name a function of an integration-test module. Paths that start
/// elsewhere (another crate's) are not pare's to check and count as resolved.
fn resolves(path: &str, sources: &Sources<'_>) -> bool {
    let segments: Vec<&str> = path.split("::").collect();
    let in_crate = matches!(segments[0], "crate" | "pare");
    let segments = if in_crate { &segments[1..] } else { &segments[..] };
    let as_test = || {
        !in_crate
            && segments.len() == 2
            && (sources.test_module)(segments[0]).is_some_and(|source| defines(&source, segments[1]))
    };
    if !in_crate && (sources.module)(&segments[..1]).is_none() {
        // Not a library module: a function of a test module, or another crate's path.
        return (sources.test_module)(segments[0]).is_none() || as_test();
    }
    let mut n_modules = 0;
    while n_modules < segments.len() && (sources.module)(&segments[..n_modules + 1]).is_some() {
        n_modules += 1;
    }
    if n_modules == segments.len() {
        return true;
    }
    (sources.module)(&segments[..n_modules]).is_some_and(|source| defines(&source, segments[n_modules])) || as_test()
}

/// The backticked Rust paths (`a::b`, whole code spans only) of a text that do not resolve.
fn unresolved_rust_paths(text: &str, sources: &Sources<'_>) -> Vec<String> {
    let span = Regex::new(r"`([A-Za-z_][A-Za-z0-9_]*(?:::[A-Za-z_][A-Za-z0-9_]*)+)`").unwrap();
    let mut found = Vec::new();
    for (line_idx, line) in text.lines().enumerate() {
        for captures in span.captures_iter(line) {
            if !resolves(&captures[1], sources) {
                found.push(format!("{}: {}", line_idx + 1, &captures[1]));
            }
        }
    }
    found
}

/// The source of the library module at `segments` below `src/` (`[]` is `lib.rs`).
fn module_source(src: &Path, segments: &[&str]) -> Option<String> {
    if segments.is_empty() {
        return std::fs::read_to_string(src.join("lib.rs")).ok();
    }
    let base: PathBuf = segments.iter().collect();
    let file = src.join(&base).with_extension("rs");
    let dir = src.join(&base).join("mod.rs");
    std::fs::read_to_string(file).or_else(|_| std::fs::read_to_string(dir)).ok()
}

/// The regression files under `proptest-regressions/` (relative paths) whose source file — the same
/// path below `src/` with `.rs` for `.txt` — `exists` does not know.
fn orphaned_regressions(files: &[String], exists: impl Fn(&str) -> bool) -> Vec<String> {
    files
        .iter()
        .filter(|file| {
            let source = file.strip_suffix(".txt").map(|stem| format!("src/{stem}.rs"));
            !source.is_some_and(|source| exists(&source))
        })
        .cloned()
        .collect()
}

#[test]
fn doc_paths_name_files_that_exist() {
    let root = root();
    let mut problems = Vec::new();
    for file in markdown_files(&root) {
        for problem in missing_paths(&prose(&read(&file)), |p| path_exists(&root, p)) {
            problems.push(format!("{}:{problem}", relative(&root, &file)));
        }
    }
    for file in files_under(&root.join("src")).into_iter().chain(files_under(&root.join("tests/it"))) {
        if file.extension().is_some_and(|ext| ext == "rs") {
            let exists = |p: &str| !checked_in_rust_docs(p) || path_exists(&root, p);
            for problem in missing_paths(&doc_comments(&read(&file)), exists) {
                problems.push(format!("{}:{problem}", relative(&root, &file)));
            }
        }
    }
    assert!(problems.is_empty(), "doc paths that name no file:\n{}", problems.join("\n"));
}

#[test]
fn rust_paths_in_the_docs_name_modules_and_items_that_exist() {
    let root = root();
    let src = root.join("src");
    let module = |segments: &[&str]| module_source(&src, segments);
    let test_module = |name: &str| std::fs::read_to_string(root.join("tests/it").join(format!("{name}.rs"))).ok();
    let sources = Sources { module: &module, test_module: &test_module };
    let mut problems = Vec::new();
    for file in markdown_files(&root) {
        for problem in unresolved_rust_paths(&prose(&read(&file)), &sources) {
            problems.push(format!("{}:{problem}", relative(&root, &file)));
        }
    }
    assert!(problems.is_empty(), "Rust paths in the docs that name nothing:\n{}", problems.join("\n"));
}

#[test]
fn the_lib_rs_layout_names_every_module_of_the_tree() {
    let src = root().join("src");
    let lib_rs = read(&src.join("lib.rs"));
    let problems = layout_problems(&layout_modules(&lib_rs), &declared_modules(&lib_rs), &tree_modules(&src));
    assert!(problems.is_empty(), "src/lib.rs's layout against src/:\n{}", problems.join("\n"));
}

#[test]
fn the_docs_carry_no_commit_hashes() {
    let root = root();
    let mut problems = Vec::new();
    for file in markdown_files(&root) {
        for problem in commit_hashes(&prose(&read(&file))) {
            problems.push(format!("{}:{problem}", relative(&root, &file)));
        }
    }
    assert!(problems.is_empty(), "commit hashes in the docs (history belongs to git):\n{}", problems.join("\n"));
}

#[test]
fn every_proptest_regression_file_has_its_source() {
    let root = root();
    let dir = root.join("proptest-regressions");
    let files: Vec<String> = files_under(&dir).iter().map(|f| relative(&dir, f)).collect();
    let orphans = orphaned_regressions(&files, |p| root.join(p).is_file());
    assert!(orphans.is_empty(), "proptest-regressions files whose source is gone: {orphans:?}");
}

mod checkers {
    use super::*;

    #[test]
    fn a_path_to_a_missing_file_is_reported_with_its_line() {
        let exists = |p: &str| p == "src/wire/mod.rs" || p == "src/neutral/read.rs" || p == "docs/engine.md";
        let text = "see `src/wire/mod.rs` and docs/engine.md.\nthe reader (src/wire/read.rs) moved";
        assert_eq!(missing_paths(text, exists), vec!["2: src/wire/read.rs"]);
    }

    #[test]
    fn brace_groups_are_expanded_and_each_path_checked() {
        let exists = |p: &str| p == "src/cli/replay.rs";
        assert_eq!(missing_paths("`src/cli/{replay,eval}.rs`", exists), vec!["1: src/cli/eval.rs"]);
    }

    #[test]
    fn paths_outside_the_repository_and_in_fences_are_not_checked() {
        let text = "/tmp/corpus/src/x.rs and https://example.com/src/y.rs in tests/e2e/.node\n\
                    ```\npare check rules/mine.yaml\n```\n";
        assert_eq!(missing_paths(&prose(text), |_| false), Vec::<String>::new());
    }

    #[test]
    fn doc_comments_are_read_and_code_is_not() {
        let source = "//! lives in src/gone.rs\nlet x = \"src/also_gone.rs\";\n/// and src/gone2.rs\n";
        assert_eq!(missing_paths(&doc_comments(source), |_| false), vec!["1: src/gone.rs", "3: src/gone2.rs"]);
    }

    #[test]
    fn rust_docs_are_held_to_source_files_and_directories() {
        assert!(checked_in_rust_docs("src/wire/read.rs") && checked_in_rust_docs("src/wire/"));
        assert!(!checked_in_rust_docs("src/a.py"));
    }

    #[test]
    fn a_glob_matches_within_its_directory() {
        let root = root();
        assert!(path_exists(&root, "src/compact/rules/*.rs"));
        assert!(!path_exists(&root, "src/compact/rules/*.yaml"));
    }

    #[test]
    fn short_hex_words_with_digits_and_letters_are_commit_hashes() {
        let text = "measured at 2dbfbc6 (`3f468b4`), against ae84628c9d1e\n\
                    not: 1234567, deadbeef, cafe, a1b2c3, 0x1f2e3d4c, id_9f8e7d6c";
        assert_eq!(commit_hashes(text), vec!["1: 2dbfbc6", "1: 3f468b4", "1: ae84628c9d1e"]);
    }

    #[test]
    fn a_hash_inside_a_fence_is_an_example_not_history() {
        assert_eq!(commit_hashes(&prose("```\ngit show 2dbfbc6\n```\n")), Vec::<String>::new());
    }

    #[test]
    fn a_layout_that_misses_or_invents_a_module_is_reported() {
        let lib_rs =
            "//! # Layout\n//!\n//! - [`wire`]: formats.\n//! - [`gone`]: old.\n\npub mod wire;\npub mod neutral;\n";
        let tree: BTreeSet<String> = ["wire", "neutral"].map(String::from).into();
        let problems = layout_problems(&layout_modules(lib_rs), &declared_modules(lib_rs), &tree);
        assert_eq!(
            problems,
            vec![
                "src/ has module `neutral`, the layout does not name it",
                "the layout names `gone`, src/ has no such module",
            ]
        );
    }

    #[test]
    fn a_rust_path_through_a_moved_module_does_not_resolve() {
        let module = |segments: &[&str]| match segments {
            [] => Some("pub mod wire;\npub mod neutral;\npub struct Allocator;".to_owned()),
            ["wire"] => Some("pub mod recent;\npub struct ChatBody;".to_owned()),
            ["wire", "recent"] => Some("pub struct RecentBodies;".to_owned()),
            ["neutral"] => Some("mod read;\npub use read::{object_members, raw_members};".to_owned()),
            ["neutral", "read"] => Some("pub fn object_members() {}".to_owned()),
            _ => None,
        };
        let test_module = |name: &str| (name == "budget").then(|| "fn evicted_sessions_come_back() {}".to_owned());
        let sources = Sources { module: &module, test_module: &test_module };
        let text = "`wire::read` `wire::scan` `wire::ChatBody::parse` `wire::recent::RecentBodies` \
                    `neutral::object_members` `neutral::read` `crate::wire` `pare::Allocator` \
                    `serde_json::to_string` `budget::evicted_sessions_come_back` `budget::gone` `wire::Gone`";
        assert_eq!(
            unresolved_rust_paths(text, &sources),
            vec!["1: wire::read", "1: wire::scan", "1: budget::gone", "1: wire::Gone"]
        );
    }

    #[test]
    fn a_regression_file_without_its_source_is_an_orphan() {
        let files = ["neutral/scan.txt".to_owned(), "wire/scan.txt".to_owned()];
        let exists = |p: &str| p == "src/neutral/scan.rs";
        assert_eq!(orphaned_regressions(&files, exists), vec!["wire/scan.txt"]);
    }
}
