//! `pare replay`: a session file's requests, in order, as the proxy would forward them (JSONL out).

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;

use super::ModeArg;
use crate::budget::SessionCompactor;
use crate::budget::replay::{replay_request_at, session_lines};
use crate::compact::Engine;
use crate::config::{Config, Mode};

/// The mode a `--mode` flag selects.
pub(crate) fn mode_of(arg: ModeArg) -> Mode {
    match arg {
        ModeArg::Epoch => Mode::Epoch,
        ModeArg::Eager => Mode::Eager,
        ModeArg::Off => Mode::Off,
        ModeArg::Observe => Mode::Observe,
    }
}

/// The compactor the proxy would run for `config` with `--mode` applied.
pub(crate) fn compactor(config: &Config, mode: Option<ModeArg>) -> anyhow::Result<SessionCompactor> {
    compactor_with_engine(config, mode, Arc::new(Engine::from_config(config)?))
}

/// [`compactor`] over a given engine (eval shares the engine to find protected tails).
pub(crate) fn compactor_with_engine(
    config: &Config,
    mode: Option<ModeArg>,
    engine: Arc<Engine>,
) -> anyhow::Result<SessionCompactor> {
    let mut config = config.clone();
    if let Some(mode) = mode {
        config.compaction.mode = mode_of(mode);
    }
    Ok(SessionCompactor::new(&config, engine)?)
}

pub fn run(args: super::ReplayArgs) -> anyhow::Result<ExitCode> {
    let config = Config::load(args.config.as_deref())?;
    let compactor = compactor(&config, args.mode)?;
    let text =
        std::fs::read(&args.session).with_context(|| format!("cannot read session `{}`", args.session.display()))?;
    let session = args.session.display().to_string();
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    for (i, raw) in session_lines(&text).into_iter().enumerate() {
        let replayed = replay_request_at(&compactor, args.wire, &args.path, &session, raw, args.window);
        if let Some(why) = &replayed.skipped {
            eprintln!("pare: {}: request {}: forwarded unchanged: {why}", args.session.display(), i + 1);
        }
        out.write_all(&replayed.forwarded)?;
        out.write_all(b"\n")?;
    }
    out.flush()?;
    Ok(ExitCode::SUCCESS)
}
