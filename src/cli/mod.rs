//! The command line: argument definitions and dispatch. Each subcommand lives in its own file and
//! calls into the library; only `serve` builds a tokio runtime, so offline commands stay light.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};

mod archive;
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
#[command(
    name = "pare",
    version,
    about,
    long_about = None,
    after_help = "Example:\n  pare serve --upstream http://127.0.0.1:8080/v1   (then use http://127.0.0.1:8787/v1)"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the proxy.
    #[command(after_help = "Example:\n  pare serve --upstream http://127.0.0.1:8080/v1 --archive ./pare-archive\n  \
                            (then point the agent at http://127.0.0.1:8787/v1)")]
    Serve(ServeArgs),
    /// Compact one request body (FILE or `-` for stdin) and write the forwarded body to stdout.
    #[command(after_help = "Example:\n  pare compact --window 32000 --stats --diff request.json > forwarded.json")]
    Compact(CompactArgs),
    /// Replay a session file (one request body per line) and print what the proxy would forward.
    #[command(after_help = "Example:\n  pare replay --window 16000 --mode epoch session.jsonl > forwarded.jsonl")]
    Replay(ReplayArgs),
    /// Measure compaction over a corpus of session files: tokens saved, uncached prefill, needle
    /// recall, validity, determinism.
    #[command(after_help = "Example:\n  pare eval --window 16000 --mode eager sessions/")]
    Eval(EvalArgs),
    /// Audit the archive: list, show, verify and delete sessions.
    #[command(after_help = "Example:\n  pare sessions list --archive /var/lib/pare")]
    Sessions(SessionsArgs),
    /// Export training data from the raw archived sessions.
    #[command(after_help = "Example:\n  pare export --since 2026-11-01 --out sft.jsonl sft")]
    Export(ExportArgs),
    /// Validate a config file or a rule pack; lists every problem with its line.
    #[command(after_help = "Example:\n  pare check compaction.yaml")]
    Check(CheckArgs),
    /// Browse the archive in a web browser (read-only): sessions, requests raw ↔ forwarded, exports.
    #[command(after_help = "Example:\n  pare ui --archive ~/.local/share/pare --listen 127.0.0.1:8788\n  \
                            then open http://127.0.0.1:8788/_pare/ui/")]
    Ui(UiArgs),
    /// Manage whole archives: copy every session between backends (SQLite directory, PostgreSQL URL),
    /// prune sessions by age.
    #[command(subcommand, after_help = "Example:\n  pare archive copy ./pare-archive postgres://pare@127.0.0.1/pare")]
    Archive(ArchiveCommand),
}

#[derive(Debug, Subcommand)]
pub enum ArchiveCommand {
    /// Copy every session of FROM into TO (each a directory or a postgres:// URL), then verify TO
    /// and compare each session's counts and chain head with FROM; non-zero exit on any mismatch.
    #[command(after_help = "Example:\n  pare archive copy ~/.local/share/pare postgres://pare@db.internal/pare")]
    Copy {
        /// Source archive: a directory or a postgres:// URL.
        from: String,
        /// Target archive: a directory or a postgres:// URL.
        to: String,
        /// Configuration file whose `archive.password_file` gives a URL's password.
        #[arg(long, short = 'c')]
        config: Option<PathBuf>,
    },
    /// Delete every session last active before DATE, whole (every chain left verifies), then
    /// vacuum the store to reclaim the space.
    #[command(
        after_help = "Example:\n  pare archive prune --before 2026-01-01 --archive postgres://pare@db.internal/pare"
    )]
    Prune {
        /// YYYY-MM-DD (midnight UTC) or an RFC 3339 timestamp.
        #[arg(long)]
        before: String,
        /// Archive directory or postgres:// URL (default $XDG_DATA_HOME/pare, or archive.dir /
        /// archive.url of --config).
        #[arg(long)]
        archive: Option<String>,
        /// Configuration file (its archive location and `archive.password_file`).
        #[arg(long, short = 'c')]
        config: Option<PathBuf>,
    },
}

/// How compaction decides when to run (see ARCHITECTURE.md, "Epochs").
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ModeArg {
    /// Forward raw until the high-water mark, then compact once and keep that prefix (prompt cache).
    Epoch,
    /// Apply the rules on every request (upstreams without a prompt cache).
    Eager,
    /// Forward every request unchanged (archive only).
    Off,
    /// Forward every request unchanged, and measure what `epoch` would have forwarded.
    Observe,
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
    /// Archive directory, or a postgres:// URL (default $XDG_DATA_HOME/pare).
    #[arg(long, env = "PARE_ARCHIVE")]
    pub archive: Option<String>,
    /// Compaction mode.
    #[arg(long, value_enum)]
    pub mode: Option<ModeArg>,
    /// Log format (default `log.format` from the config, else text).
    #[arg(long, value_enum, env = "PARE_LOG_FORMAT")]
    pub log_format: Option<LogFormat>,
    /// Colour in text logs: `auto` when stderr is a terminal (and NO_COLOR is unset).
    #[arg(long, value_enum, default_value = "auto", env = "PARE_COLOR")]
    pub color: ColorChoice,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ColorChoice {
    Auto,
    Always,
    Never,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per event.
    Text,
    /// One JSON object per line.
    Json,
}

#[derive(Debug, Args)]
pub struct CompactArgs {
    /// Configuration file (YAML); built-in defaults equal compaction.example.yaml.
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
    /// Wire format of the request bodies: `chat` (Chat Completions), `responses` (OpenAI Responses),
    /// `messages` (Anthropic Messages) or `gemini` (the Gemini API).
    #[arg(long, value_enum, default_value = "chat")]
    pub wire: crate::wire::Wire,
    /// The path the requests were sent to, as the proxy received it: a Gemini request names its model
    /// there (`/v1beta/models/gemini-2.5-pro:generateContent`), which selects its `models:` entry.
    #[arg(long, default_value = "")]
    pub path: String,
    /// Request body file, or `-` for stdin.
    #[arg(default_value = "-")]
    pub input: String,
}

#[derive(Debug, Args)]
pub struct ReplayArgs {
    /// Configuration file (YAML); built-in defaults equal compaction.example.yaml.
    #[arg(long, short = 'c')]
    pub config: Option<PathBuf>,
    /// Context window in tokens (default: the configured or detected window of the model).
    #[arg(long)]
    pub window: Option<u64>,
    /// Compaction mode (default `compaction.mode` from the config).
    #[arg(long, value_enum)]
    pub mode: Option<ModeArg>,
    /// Wire format of the request bodies: `chat` (Chat Completions), `responses` (OpenAI Responses),
    /// `messages` (Anthropic Messages) or `gemini` (the Gemini API).
    #[arg(long, value_enum, default_value = "chat")]
    pub wire: crate::wire::Wire,
    /// The path the requests were sent to, as the proxy received it: a Gemini request names its model
    /// there (`/v1beta/models/gemini-2.5-pro:generateContent`), which selects its `models:` entry.
    #[arg(long, default_value = "")]
    pub path: String,
    /// Session file: one request body per line.
    pub session: PathBuf,
}

#[derive(Debug, Args)]
pub struct EvalArgs {
    /// Configuration file (YAML); built-in defaults equal compaction.example.yaml.
    #[arg(long, short = 'c')]
    pub config: Option<PathBuf>,
    /// Context window in tokens every session is replayed against (default: each request's model's
    /// window from the config's `models:`, else `budget.default_context_window`; no upstream is asked).
    #[arg(long)]
    pub window: Option<u64>,
    /// Compaction mode (default `compaction.mode` from the config).
    #[arg(long, value_enum)]
    pub mode: Option<ModeArg>,
    /// Print the per-session and total figures as JSON.
    #[arg(long)]
    pub json: bool,
    /// Wire format of the sessions: `chat`, `responses`, `messages` or `gemini` (files of request
    /// bodies in that format; with `--convert`, chat sessions converted to that format first).
    #[arg(long, value_enum, default_value = "chat")]
    pub wire: crate::wire::Wire,
    /// Read each chat session and convert it to `--wire`'s bodies before evaluating (Responses when
    /// `--wire` is not given).
    #[arg(long)]
    pub convert: bool,
    /// What forwards the requests: pare, or a peer's strategy (mask:N, clear:K@F, truncate).
    #[arg(long, default_value = "pare")]
    pub strategy: crate::eval::strategy::Strategy,
    /// Only the sessions of one side of the split by task (tune or holdout).
    #[arg(long, value_enum)]
    pub split: Option<SplitArg>,
    /// Evaluate the sessions of a pare archive (its raw requests: a directory or a postgres:// URL)
    /// instead of a corpus directory.
    #[arg(long, conflicts_with = "corpus")]
    pub archive: Option<String>,
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
    /// Archive directory or postgres:// URL (default $XDG_DATA_HOME/pare, or archive.dir /
    /// archive.url from --config).
    #[arg(long, global = true, env = "PARE_ARCHIVE")]
    pub archive: Option<String>,
    /// Configuration file whose `archive.dir` names the archive.
    #[arg(long, short = 'c', global = true)]
    pub config: Option<PathBuf>,
    #[command(subcommand)]
    pub command: SessionsCommand,
}

#[derive(Debug, Subcommand)]
pub enum SessionsCommand {
    /// One line per session: id, start, last activity, requests, wire, model, epochs, saved (forwarded
    /// tokens), attributable savings, uncached prefill with pare / without and its saving, upstream
    /// cache hits, tokens raw → forwarded: the columns of the UI's index.
    #[command(
        after_help = "Example:\n  pare sessions list --since 2026-11-01 --model gpt-4o\n  pare sessions list --json | jq -s 'map(.uncached_prefill_pare_tokens) | add'"
    )]
    List {
        /// Only sessions active since this time: YYYY-MM-DD (midnight UTC) or RFC 3339
        /// (2026-11-24T18:00:00Z).
        #[arg(long, value_name = "YYYY-MM-DD|RFC3339")]
        since: Option<String>,
        /// Only sessions whose model contains this text.
        #[arg(long)]
        model: Option<String>,
        /// JSON Lines instead of the table: one JSON object per session, one per line (not an array;
        /// `jq -s` reads them as one). A figure not known is `null`.
        #[arg(long)]
        json: bool,
    },
    /// A readable transcript of one session (its last request, or `--request N`).
    #[command(after_help = "Example:\n  pare sessions show 01JDQ3V5X8M2K7ZQ4N6R9T1WAB --diff")]
    Show {
        /// Session id, as `pare sessions list` prints it.
        id: String,
        /// Print the exact request bodies the agent sent.
        #[arg(long, group = "view")]
        raw: bool,
        /// Print the exact request bodies pare forwarded.
        #[arg(long, group = "view")]
        forwarded: bool,
        /// Per request, what compaction changed since the previous request: each rewritten message
        /// as the original next to its replacement, with the rule that made it.
        #[arg(long, group = "view")]
        diff: bool,
        /// Only this request (1-based sequence number).
        #[arg(long)]
        request: Option<u64>,
    },
    /// Recompute every raw body, check its hash and the chain; non-zero exit on any problem.
    #[command(after_help = "Example:\n  pare sessions verify --archive /var/lib/pare")]
    Verify {
        /// Only this session (default: every session).
        id: Option<String>,
    },
    /// Delete one session and everything recorded for it.
    #[command(after_help = "Example:\n  pare sessions delete 01JDQ3V5X8M2K7ZQ4N6R9T1WAB")]
    Delete {
        /// Session id, as `pare sessions list` prints it.
        id: String,
    },
}

#[derive(Debug, Args)]
pub struct ExportArgs {
    /// Archive directory or postgres:// URL (default $XDG_DATA_HOME/pare, or archive.dir /
    /// archive.url from --config).
    #[arg(long, global = true, env = "PARE_ARCHIVE")]
    pub archive: Option<String>,
    /// Configuration file whose `archive.dir` names the archive.
    #[arg(long, short = 'c', global = true)]
    pub config: Option<PathBuf>,
    /// Output file (default stdout).
    #[arg(long, global = true)]
    pub out: Option<PathBuf>,
    /// Only this session.
    #[arg(long, global = true)]
    pub session: Option<String>,
    /// Only sessions active since this time: YYYY-MM-DD (midnight UTC) or RFC 3339
    /// (2026-11-24T18:00:00Z).
    #[arg(long, global = true, value_name = "YYYY-MM-DD|RFC3339")]
    pub since: Option<String>,
    #[command(subcommand)]
    pub command: ExportCommand,
}

#[derive(Debug, Subcommand)]
pub enum ExportCommand {
    /// Preference pairs in TRL's conversational format, mined from branches and retries.
    #[command(after_help = "Example:\n  pare export --since 2026-11-01 --out pairs.jsonl dpo")]
    Dpo,
    /// One conversation per session.
    #[command(after_help = "Example:\n  pare export --out sft.jsonl sft --format sharegpt")]
    Sft {
        /// Line format of the conversations.
        #[arg(long, value_enum, default_value = "openai")]
        format: SftFormat,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SftFormat {
    /// `{"messages": [...]}` with OpenAI roles.
    Openai,
    /// `{"conversations": [{"from", "value"}]}`.
    Sharegpt,
}

#[derive(Debug, Args)]
pub struct UiArgs {
    /// Archive directory or postgres:// URL (default $XDG_DATA_HOME/pare, or archive.dir /
    /// archive.url from --config).
    #[arg(long, env = "PARE_ARCHIVE")]
    pub archive: Option<String>,
    /// Configuration file: its archive location, and its `server` section allows a non-loopback
    /// address (with `auth_token`).
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
        Command::Archive(ArchiveCommand::Copy { from, to, config }) => archive::copy(&from, &to, config.as_deref()),
        Command::Archive(ArchiveCommand::Prune { before, archive, config }) => {
            archive::prune(&before, archive, config.as_deref())
        }
    };
    match result {
        Ok(code) => code,
        // A reader that went away (`pare sessions show ID | head`) ends the output, not in an error.
        Err(err)
            if err.chain().any(|e| {
                e.downcast_ref::<std::io::Error>().is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
            }) =>
        {
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("pare: {}", error_chain(&err));
            ExitCode::from(2)
        }
    }
}

/// An error and its causes, each said once: a message that already quotes its cause (an error type
/// that writes its `source` into its own message) is not followed by the cause again.
fn error_chain(err: &anyhow::Error) -> String {
    let mut out = err.to_string();
    for cause in err.chain().skip(1) {
        let text = cause.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn a_cause_quoted_by_its_error_is_said_once() {
        let io = std::io::Error::new(std::io::ErrorKind::AddrInUse, "Address already in use (os error 98)");
        let err = anyhow::Error::new(crate::proxy::ServeError::Bind { addr: "127.0.0.1:8787".into(), source: io });
        assert_eq!(error_chain(&err), "cannot listen on 127.0.0.1:8787: Address already in use (os error 98)");
        let wrapped = anyhow::anyhow!("disk full").context("cannot write the report");
        assert_eq!(error_chain(&wrapped), "cannot write the report: disk full");
    }

    /// Every subcommand says what each of its flags and arguments is for, and shows an example.
    #[test]
    fn every_flag_has_help_and_every_command_an_example() {
        fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
            let path = format!("{path} {}", cmd.get_name());
            for arg in cmd.get_arguments() {
                let id = arg.get_id().as_str();
                if id != "help" && id != "version" && arg.get_help().is_none() && arg.get_long_help().is_none() {
                    missing.push(format!("{path}: --{id} has no help"));
                }
            }
            if cmd.get_after_help().is_none() {
                missing.push(format!("{path}: no example (after_help)"));
            }
            for sub in cmd.get_subcommands() {
                walk(sub, &path, missing);
            }
        }
        let mut missing = Vec::new();
        walk(&Cli::command(), "", &mut missing);
        assert!(missing.is_empty(), "{missing:#?}");
    }
}
