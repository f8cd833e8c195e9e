//! `pare check FILE`: validate a configuration file or a rule pack and list every problem with its
//! line. Exit 0 when clean, 1 when there is any problem, 2 when the file cannot be read.
//!
//! A file whose top level has `rules:` is a rule pack (the shape of `rules/*.yaml`); anything else is a
//! configuration (the shape of `compaction.example.yaml`), checked together with the pack it selects
//! and its `compaction.rules` overrides.

use std::process::ExitCode;

use anyhow::Context;

use crate::compact::pack::{check_overrides, check_pack, pack_text};
use crate::config::yaml::{self, NodeValue};
use crate::config::{Config, ConfigError, Problem};

pub fn run(args: super::CheckArgs) -> anyhow::Result<ExitCode> {
    let text = std::fs::read_to_string(&args.file).with_context(|| format!("cannot read {}", args.file.display()))?;
    let (kind, problems) =
        if is_rule_pack(&text) { ("rule pack", check_pack(&text)) } else { ("config", check_config(&text)) };
    if problems.is_empty() {
        println!("{}: ok ({kind})", args.file.display());
        return Ok(ExitCode::SUCCESS);
    }
    eprintln!("{}", ConfigError { path: Some(args.file.clone()), problems });
    Ok(ExitCode::from(1))
}

/// A rule pack has a top-level `rules:` key, which a configuration never has.
fn is_rule_pack(text: &str) -> bool {
    matches!(yaml::parse(text), Ok(root) if matches!(&root.value, NodeValue::Map(entries) if entries.iter().any(|(k, _, _)| k == "rules")))
}

/// Every problem of a configuration — its own, those of the pack it selects and of its overrides —
/// in line order.
fn check_config(text: &str) -> Vec<Problem> {
    let (config, mut problems) = Config::from_yaml_all(text);
    let (Some(config), Ok(root)) = (config, yaml::parse(text)) else { return problems };
    problems.extend(check_selected_pack(&config, &root));
    problems.sort_by_key(|p| p.line.unwrap_or(u64::MAX));
    problems
}

/// The problems of the pack a configuration selects and of its `compaction.rules` overrides.
fn check_selected_pack(config: &Config, root: &yaml::Node) -> Vec<Problem> {
    let pack_line = root.line_of("compaction.pack");
    let pack = &config.compaction.pack;
    let pack_source = match pack_text(pack) {
        Ok(source) => source,
        Err(err) => return vec![Problem { line: pack_line, path: "compaction.pack".into(), message: err.to_string() }],
    };
    let mut problems: Vec<Problem> = check_pack(&pack_source)
        .into_iter()
        .map(|p| Problem {
            line: pack_line,
            path: "compaction.pack".into(),
            message: match p.line {
                Some(line) => format!("rule pack `{pack}` line {line}: {}: {}", p.path, p.message),
                None => format!("rule pack `{pack}`: {}: {}", p.path, p.message),
            },
        })
        .collect();
    if let Some(overrides) = &config.compaction.rules {
        for mut p in check_overrides(&pack_source, overrides) {
            p.path = p.path.replace('[', ".").replace(']', "");
            p.line = p.line.or_else(|| root.line_of(&p.path));
            problems.push(p);
        }
    }
    problems
}
