//! `pare eval`.

use std::process::ExitCode;

pub fn run(_args: super::EvalArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("`pare eval` is not built yet")
}
