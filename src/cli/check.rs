//! `pare check`.

use std::process::ExitCode;

pub fn run(_args: super::CheckArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("`pare check` is not built yet")
}
