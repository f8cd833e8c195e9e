//! `pare serve`: load the configuration, apply command-line overrides, set up logging, build the
//! tokio runtime and run the proxy until SIGINT or SIGTERM.

use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use tracing_subscriber::EnvFilter;

use super::{ColorChoice, LogFormat, ModeArg, ServeArgs};
use crate::config::{Config, Mode, Overrides, default_worker_threads};
use crate::pipeline::Pipeline;

/// How long an idle thread of the blocking pool (large bodies are parsed and compacted there) stays
/// before it exits. A thread's allocator pages hold the blocks other threads freed until it runs
/// again or exits: after a burst of large requests, its exit is what returns that memory (tokio's
/// default, 10 s, kept ≈ 85 MiB resident that long after a burst: BENCHMARKS.md, *Memory*).
const BLOCKING_THREAD_KEEP_ALIVE: std::time::Duration = std::time::Duration::from_secs(1);

pub fn run(args: ServeArgs) -> anyhow::Result<ExitCode> {
    let config = load_config(&args)?;
    init_tracing(log_format(&args, &config)?, ansi(args.color, std::io::stderr().is_terminal()));
    let config = Arc::new(config);
    let runtime = runtime(&config).context("cannot start the tokio runtime")?;
    // The address first: a port in use is said at once, before the archive is opened and the
    // sessions' state rebuilt from it (which can take seconds on a large archive).
    let listener = runtime.block_on(crate::proxy::bind(&config.server.listen, &config))?;
    refuse_unusable_database(&config)?;
    let pipeline = Arc::new(Pipeline::from_config(config.clone()).context("cannot start")?);
    if let Some(archive) = pipeline.archive() {
        refuse_unwritable_archive(&config, &archive.health())?;
    }
    runtime.block_on(async {
        let served = crate::proxy::run(listener, config, pipeline.clone(), shutdown_signal()).await;
        // In-flight exchanges are done (or past the grace deadline): commit every queued record,
        // once the projections it waits for (mode `observe`) are done.
        if let Some(observer) = pipeline.observer().cloned() {
            let _ = tokio::task::spawn_blocking(move || observer.drain(crate::observe::DRAIN_LIMIT)).await;
        }
        if let Some(archive) = pipeline.archive() {
            archive.close_async().await;
        }
        served
    })?;
    Ok(ExitCode::SUCCESS)
}

/// An archive directory the user named (`--archive`, `archive.dir`) that cannot be written is a
/// mistake to fix before serving: pare refuses to start rather than proxy with every record lost.
/// The default directory is best effort: pare starts, counts the lost records and reports them on
/// `/_pare/health`.
fn refuse_unwritable_archive(config: &Config, health: &crate::archive::ArchiveHealth) -> anyhow::Result<()> {
    // A PostgreSQL archive that cannot be reached yet is waited for (its records are held, then
    // written): a replica starts while the database is away.
    if health.writable || config.archive.dir.is_none() || config.archive.url.is_some() {
        return Ok(());
    }
    let cause = health.last_error.as_deref().unwrap_or("the store cannot be opened");
    anyhow::bail!(
        "cannot write the archive directory {}: {cause} (fix its permissions, pass another --archive DIR, or set \
         archive.enabled: false)",
        health.dir
    )
}

/// A PostgreSQL archive that refuses pare as configured (authentication, an unknown database, TLS
/// the server does not offer) would fail every write: pare refuses to start, in one line. One that
/// cannot be reached yet (the server is not up) is waited for: pare starts degraded and says so.
fn refuse_unusable_database(config: &Config) -> anyhow::Result<()> {
    use crate::archive::store::{Reachability, probe};
    if !config.archive.enabled || config.archive.url.is_none() {
        return Ok(());
    }
    let Ok(location) = config.archive.location() else { return Ok(()) };
    match probe(&location) {
        Reachability::Ready => Ok(()),
        Reachability::Unreachable(why) => {
            tracing::warn!(archive = %location, error = %why,
                "the archive database cannot be reached yet; serving, its records wait for it");
            Ok(())
        }
        Reachability::Refused(why) => {
            anyhow::bail!("the archive database {location} refuses pare: {why} (fix archive.url or the server)")
        }
    }
}

/// The runtime that serves connections: multi-threaded (large bodies leave a worker with
/// `block_in_place`, and an exchange is finished in a task after its last byte) with
/// `server.worker_threads` workers, half the cores when unset ([`default_worker_threads`]).
pub fn runtime(config: &Config) -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(config.server.worker_threads.unwrap_or_else(default_worker_threads))
        .enable_all()
        .thread_keep_alive(BLOCKING_THREAD_KEEP_ALIVE)
        .build()
}

/// The configuration file (or the defaults) with the command line's overrides applied, refused
/// with every problem — of the file, the flags, the rule pack it selects and its overrides — in
/// the listing `pare check` prints.
pub fn load_config(args: &ServeArgs) -> anyhow::Result<Config> {
    let overrides = Overrides {
        listen: args.listen.clone(),
        upstream: args.upstream.clone(),
        archive: args.archive.clone(),
        mode: args.mode.map(|mode| match mode {
            ModeArg::Epoch => Mode::Epoch,
            ModeArg::Eager => Mode::Eager,
            ModeArg::Off => Mode::Off,
            ModeArg::Observe => Mode::Observe,
        }),
    };
    Ok(Config::load_overridden(args.config.as_deref(), &overrides)?)
}

fn log_format(args: &ServeArgs, config: &Config) -> anyhow::Result<LogFormat> {
    if let Some(format) = args.log_format {
        return Ok(format);
    }
    match config.log.format.as_deref() {
        None | Some("text") => Ok(LogFormat::Text),
        Some("json") => Ok(LogFormat::Json),
        Some(other) => anyhow::bail!("log.format {other:?} is neither \"text\" nor \"json\""),
    }
}

/// Whether text logs carry ANSI colours: `auto` only on a terminal and when `NO_COLOR` is unset
/// (a journal, a file or a pipe gets plain text).
fn ansi(choice: ColorChoice, stderr_is_terminal: bool) -> bool {
    match choice {
        ColorChoice::Always => true,
        ColorChoice::Never => false,
        ColorChoice::Auto => stderr_is_terminal && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty()),
    }
}

/// Logs go to stderr; the level comes from `RUST_LOG` (default `info`).
fn init_tracing(format: LogFormat, ansi: bool) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi);
    let result = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).with_current_span(false).try_init(),
    };
    if let Err(err) = result {
        eprintln!("pare: logging already initialised: {err}");
    }
}

/// Resolves on the first SIGINT or SIGTERM.
pub(crate) async fn shutdown_signal() {
    let interrupt = async {
        if let Err(err) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %err, "cannot listen for SIGINT");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(err) => {
                tracing::error!(error = %err, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = interrupt => tracing::info!("SIGINT received"),
        () = terminate => tracing::info!("SIGTERM received"),
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    fn args() -> ServeArgs {
        ServeArgs {
            config: None,
            listen: None,
            upstream: None,
            archive: None,
            mode: None,
            log_format: None,
            color: ColorChoice::Auto,
        }
    }

    #[test]
    fn the_runtime_has_the_configured_workers_or_half_the_cores() {
        let mut config = Config::default();
        let cores = std::thread::available_parallelism().unwrap().get();
        assert_eq!(default_worker_threads(), (cores / 2).max(1));
        assert_eq!(runtime(&config).unwrap().metrics().num_workers(), default_worker_threads());
        config.server.worker_threads = Some(3);
        assert_eq!(runtime(&config).unwrap().metrics().num_workers(), 3);
    }

    #[test]
    fn flags_override_the_config() {
        let mut args = args();
        args.listen = Some("127.0.0.1:9999".into());
        args.upstream = Some("http://10.0.0.5:8000/v1".into());
        args.archive = Some("/tmp/pare-archive".into());
        args.mode = Some(ModeArg::Off);
        let config = load_config(&args).unwrap();
        assert_eq!(config.server.listen, "127.0.0.1:9999");
        assert_eq!(config.upstream.url, "http://10.0.0.5:8000/v1");
        assert_eq!(config.archive.dir, Some(PathBuf::from("/tmp/pare-archive")));
        assert_eq!(config.compaction.mode, Mode::Off);
    }

    #[test]
    fn without_flags_the_defaults_apply() {
        assert_eq!(load_config(&args()).unwrap(), Config::default());
    }

    #[test]
    fn colour_follows_the_flag_and_otherwise_the_terminal() {
        assert!(ansi(ColorChoice::Always, false));
        assert!(!ansi(ColorChoice::Never, true));
        assert!(!ansi(ColorChoice::Auto, false));
    }

    #[test]
    fn the_log_format_flag_wins_over_the_config() {
        let mut config = Config::default();
        config.log.format = Some("json".into());
        assert_eq!(log_format(&args(), &config).unwrap(), LogFormat::Json);
        let mut text = args();
        text.log_format = Some(LogFormat::Text);
        assert_eq!(log_format(&text, &config).unwrap(), LogFormat::Text);
        config.log.format = Some("yaml".into());
        assert!(log_format(&args(), &config).unwrap_err().to_string().contains("yaml"));
    }
}
