//! `pare check FILE`: validate a configuration file or a rule pack and list every problem with its
//! line. Exit 0 when clean, 1 when there is any problem, 2 when the file cannot be read.

use std::process::ExitCode;

use anyhow::Context;

use crate::config::{Config, ConfigError};

pub fn run(args: super::CheckArgs) -> anyhow::Result<ExitCode> {
    let text = std::fs::read_to_string(&args.file).with_context(|| format!("cannot read {}", args.file.display()))?;
    let kind = "config";
    let result = Config::from_yaml(&text).map(|_| ());
    match result {
        Ok(()) => {
            println!("{}: ok ({kind})", args.file.display());
            Ok(ExitCode::SUCCESS)
        }
        Err(err) => {
            let err = ConfigError { path: Some(args.file.clone()), ..err };
            eprintln!("{err}");
            Ok(ExitCode::from(1))
        }
    }
}
