//! `pare compact`.

use std::process::ExitCode;

pub fn run(_args: super::CompactArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("`pare compact` is not built yet")
}
