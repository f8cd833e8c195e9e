//! `pare check FILE`: validate a configuration file or a rule pack and list every problem with its
//! line. Exit 0 when clean, 1 when there is any problem, 2 when the file cannot be read.
//!
//! A file whose top level has `rules:` is a rule pack (the shape of `rules/*.yaml`); anything else is a
//! configuration (the shape of `compaction.example.yaml`), checked together with the pack it selects
//! and its `compaction.rules` overrides — the same check, with the same listing, that `pare serve`
//! runs before it starts. A configuration archiving to PostgreSQL is also connected once: a
//! database that refuses pare (authentication, an unknown database, TLS the server lacks) is a
//! problem (exit 1); one that cannot be reached yet is said, and the check passes (`pare serve`
//! starts and waits for it).

use std::process::ExitCode;

use anyhow::Context;

use crate::config::pack::check_pack;
use crate::config::yaml::{self, NodeValue};
use crate::config::{Config, ConfigError, Problem};

pub fn run(args: super::CheckArgs) -> anyhow::Result<ExitCode> {
    let text = std::fs::read_to_string(&args.file).with_context(|| format!("cannot read {}", args.file.display()))?;
    let (kind, problems) =
        if is_rule_pack(&text) { ("rule pack", check_pack(&text)) } else { ("config", check_config(&text)) };
    if problems.is_empty() {
        if kind == "config"
            && let Ok(config) = Config::from_yaml(&text)
            && config.archive.enabled
            && config.archive.url.is_some()
            && let Ok(location) = config.archive.location()
        {
            use crate::archive::store::{Reachability, probe};
            match probe(&location) {
                Reachability::Ready => {}
                Reachability::Unreachable(why) => {
                    println!(
                        "{}: ok ({kind}); the archive database {location} cannot be reached yet: {why} (pare serve \
                         starts and waits for it)",
                        args.file.display()
                    );
                    return Ok(ExitCode::SUCCESS);
                }
                Reachability::Refused(why) => {
                    eprintln!("{}: the archive database {location} refuses pare: {why}", args.file.display());
                    return Ok(ExitCode::from(1));
                }
            }
        }
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
/// in line order: the check `pare serve` runs before it starts ([`Config::from_yaml_all`]).
fn check_config(text: &str) -> Vec<Problem> {
    Config::from_yaml_all(text).1
}
