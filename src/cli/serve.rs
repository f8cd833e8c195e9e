//! `pare serve`.

use std::process::ExitCode;

pub fn run(_args: super::ServeArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("`pare serve` is not built yet")
}
