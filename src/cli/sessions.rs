//! `pare sessions`.

use std::process::ExitCode;

pub fn run(_args: super::SessionsArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("`pare sessions` is not built yet")
}
