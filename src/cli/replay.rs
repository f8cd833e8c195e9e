//! `pare replay`.

use std::process::ExitCode;

pub fn run(_args: super::ReplayArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("`pare replay` is not built yet")
}
