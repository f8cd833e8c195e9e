//! `pare export`.

use std::process::ExitCode;

pub fn run(_args: super::ExportArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("`pare export` is not built yet")
}
