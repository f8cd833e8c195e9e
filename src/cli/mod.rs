//! The command line: argument definitions and dispatch. Each subcommand lives in its own file and
//! calls into the library; only `serve` builds a tokio runtime, so offline commands stay light.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};

mod check;
mod compact;
mod eval;
mod export;
mod replay;
mod serve;
pub(crate) mod sessions;
mod ui;

/// pare — a transparent OpenAI-compatible compaction proxy.
#[derive(Debug, Parser)]
#[command(name = "pare", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the proxy.
    Serve(ServeArgs),
    /// Compact one request body (FILE or `-` for stdin) and write the forwarded body to stdout.
    Compact(CompactArgs),
    /// Replay a session file (one request body per line) and print what the proxy would forward.
    Replay(ReplayArgs),
    /// Compute the metrics of MISSION.md over a corpus directory of session files.
    Eval(EvalArgs),
    /// Audit the archive: list, show, verify and delete sessions.
    Sessions(SessionsArgs),
    /// Export training data from the raw archived sessions.
    Export(ExportArgs),
    /// Validate a config file or a rule pack; lists every problem with its line.
    Check(CheckArgs),
    /// Browse the archive in a web browser (read-only): sessions, requests raw ↔ forwarded, exports.
    #[command(after_help = "Example:\n  pare ui --archive ~/.local/share/pare --listen 127.0.0.1:8788\n  \
                            then open http://127.0.0.1:8788/_pare/ui/")]
    Ui(UiArgs),
}

/// How compaction decides when to run (see ARCHITECTURE.md, "Epochs").
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ModeArg {
    Epoch,
    Eager,
    Off,
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Configuration file (YAML); built-in defaults equal compaction.example.yaml.
    #[arg(long, short = 'c', env = "PARE_CONFIG")]
    pub config: Option<PathBuf>,
    /// Address to listen on (default 127.0.0.1:8787).
    #[arg(long, env = "PARE_LISTEN")]
    pub listen: Option<String>,
    /// Upstream base URL, with or without a trailing `/v1`.
    #[arg(long, env = "PARE_UPSTREAM")]
    pub upstream: Option<String>,
    /// Archive directory (default $XDG_DATA_HOME/pare).
    #[arg(long, env = "PARE_ARCHIVE")]
    pub archive: Option<PathBuf>,
    /// Compaction mode.
    #[arg(long, value_enum)]
    pub mode: Option<ModeArg>,
    /// Log format (default `log.format` from the config, else text).
    #[arg(long, value_enum, env = "PARE_LOG_FORMAT")]
    pub log_format: Option<LogFormat>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Args)]
pub struct CompactArgs {
    #[arg(long, short = 'c')]
    pub config: Option<PathBuf>,
    /// Context window in tokens; enables the budget (tiers, elision) on top of the rules.
    #[arg(long)]
    pub window: Option<u64>,
    /// Print to stderr what each rule saved (tokens, messages).
    #[arg(long)]
    pub stats: bool,
    /// Print to stderr, per changed message, before → after.
    #[arg(long)]
    pub diff: bool,
    /// Wire format of the request bodies: `chat` (Chat Completions) or `responses` (OpenAI Responses).
    #[arg(long, value_enum, default_value = "chat")]
    pub wire: crate::wire::Wire,
    /// Request body file, or `-` for stdin.
    #[arg(default_value = "-")]
    pub input: String,
}

#[derive(Debug, Args)]
pub struct ReplayArgs {
    #[arg(long, short = 'c')]
    pub config: Option<PathBuf>,
    #[arg(long)]
    pub window: Option<u64>,
    #[arg(long, value_enum)]
    pub mode: Option<ModeArg>,
    /// Wire format of the request bodies: `chat` (Chat Completions) or `responses` (OpenAI Responses).
    #[arg(long, value_enum, default_value = "chat")]
    pub wire: crate::wire::Wire,
    /// Session file: one request body per line.
    pub session: PathBuf,
}

#[derive(Debug, Args)]
pub struct EvalArgs {
    #[arg(long, short = 'c')]
    pub config: Option<PathBuf>,
    #[arg(long)]
    pub window: u64,
    #[arg(long, value_enum)]
    pub mode: Option<ModeArg>,
    /// Print the per-session and total figures as JSON.
    #[arg(long)]
    pub json: bool,
    /// Wire format of the sessions: `chat`, or `responses` (files of Responses bodies; with
    /// `--convert`, chat sessions converted to Responses bodies first).
    #[arg(long, value_enum, default_value = "chat")]
    pub wire: crate::wire::Wire,
    /// Read each chat session and convert it to Responses bodies before evaluating (`--wire responses`).
    #[arg(long)]
    pub convert: bool,
    /// What forwards the requests: pare, or a peer's strategy (mask:N, clear:K@F, truncate).
    #[arg(long, default_value = "pare")]
    pub strategy: crate::strategy::Strategy,
    /// Only the sessions of one side of the split by task (tune or holdout).
    #[arg(long, value_enum)]
    pub split: Option<SplitArg>,
    /// Evaluate the sessions of a pare archive (its raw requests) instead of a corpus directory.
    #[arg(long, conflicts_with = "corpus")]
    pub archive: Option<PathBuf>,
    /// Directory searched recursively for `*.jsonl` session files.
    #[arg(required_unless_present = "archive")]
    pub corpus: Option<PathBuf>,
}

/// One side of `pare eval`'s split by task.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SplitArg {
    Tune,
    Holdout,
}

#[derive(Debug, Args)]
pub struct SessionsArgs {
    /// Archive directory (default $XDG_DATA_HOME/pare, or archive.dir from --config).
    #[arg(long, global = true, env = "PARE_ARCHIVE")]
    pub archive: Option<PathBuf>,
    #[arg(long, short = 'c', global = true)]
    pub config: Option<PathBuf>,
    #[command(subcommand)]
    pub command: SessionsCommand,
}

#[derive(Debug, Subcommand)]
pub enum SessionsCommand {
    /// One line per session: id, start, last activity, requests, model, tokens raw → forwarded.
    List {
        /// Only sessions active since this date (YYYY-MM-DD or RFC 3339).
        #[arg(long)]
        since: Option<String>,
        #[arg(long)]
        model: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// A readable transcript of one session.
    Show {
        id: String,
        #[arg(long, group = "view")]
        raw: bool,
        #[arg(long, group = "view")]
        forwarded: bool,
        #[arg(long, group = "view")]
        diff: bool,
        /// Only this request (1-based sequence number).
        #[arg(long)]
        request: Option<u64>,
    },
    /// Recompute every raw body, check its hash and the chain; non-zero exit on any problem.
    Verify { id: Option<String> },
    /// Delete one session and everything recorded for it.
    Delete { id: String },
}

#[derive(Debug, Args)]
pub struct ExportArgs {
    #[arg(long, global = true, env = "PARE_ARCHIVE")]
    pub archive: Option<PathBuf>,
    #[arg(long, short = 'c', global = true)]
    pub config: Option<PathBuf>,
    /// Output file (default stdout).
    #[arg(long, global = true)]
    pub out: Option<PathBuf>,
    /// Only this session.
    #[arg(long, global = true)]
    pub session: Option<String>,
    /// Only sessions active since this date.
    #[arg(long, global = true)]
    pub since: Option<String>,
    #[command(subcommand)]
    pub command: ExportCommand,
}

#[derive(Debug, Subcommand)]
pub enum ExportCommand {
    /// Preference pairs in TRL's conversational format, mined from branches and retries.
    Dpo,
    /// One conversation per session.
    Sft {
        #[arg(long, value_enum, default_value = "openai")]
        format: SftFormat,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SftFormat {
    Openai,
    Sharegpt,
}

#[derive(Debug, Args)]
pub struct UiArgs {
    /// Archive directory (default $XDG_DATA_HOME/pare, or archive.dir from --config).
    #[arg(long, env = "PARE_ARCHIVE")]
    pub archive: Option<PathBuf>,
    /// Configuration file: its rule pack names the rules in the request view, and its `server`
    /// section allows a non-loopback address (with `auth_token`).
    #[arg(long, short = 'c', env = "PARE_CONFIG")]
    pub config: Option<PathBuf>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8788")]
    pub listen: String,
}

#[derive(Debug, Args)]
pub struct CheckArgs {
    /// A config file (compaction.example.yaml's shape) or a rule pack (rules/*.yaml's shape).
    pub file: PathBuf,
}

/// Entry point of the binary.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => serve::run(args),
        Command::Compact(args) => compact::run(args),
        Command::Replay(args) => replay::run(args),
        Command::Eval(args) => eval::run(args),
        Command::Sessions(args) => sessions::run(args),
        Command::Export(args) => export::run(args),
        Command::Check(args) => check::run(args),
        Command::Ui(args) => ui::run(args),
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("pare: {err:#}");
            ExitCode::from(2)
        }
    }
}
