//! `pare export sft|dpo`: training data from the raw archived sessions (see [`crate::archive::export`]).

use std::io::Write;
use std::process::ExitCode;

use anyhow::Context;

use super::sessions::{archive_location, parse_since};
use super::{ExportArgs, ExportCommand, SftFormat as SftFormatArg};
use crate::archive::export::{SftFormat, export_dpo, export_sft};
use crate::archive::query::{ArchiveReader, SessionFilter};

pub fn run(args: ExportArgs) -> anyhow::Result<ExitCode> {
    let since_ms = args.since.as_deref().map(parse_since).transpose()?;
    let dir = archive_location(args.archive, args.config.as_deref())?;
    let reader = ArchiveReader::open(&dir)?;
    let filter = SessionFilter { since_ms, model: None, session: args.session.clone() };
    if let Some(id) = &args.session {
        reader.session(id)?;
    }
    let mut out: Box<dyn Write> = match &args.out {
        Some(path) => Box::new(std::io::BufWriter::new(
            create_private(path).with_context(|| format!("cannot create {}", path.display()))?,
        )),
        None => Box::new(std::io::BufWriter::new(std::io::stdout().lock())),
    };
    let (what, stats) = match args.command {
        ExportCommand::Dpo => ("preference pair(s)", export_dpo(&reader, &filter, &mut out)?),
        ExportCommand::Sft { format } => {
            let format = match format {
                SftFormatArg::Openai => SftFormat::OpenAi,
                SftFormatArg::Sharegpt => SftFormat::ShareGpt,
            };
            ("conversation(s)", export_sft(&reader, &filter, format, &mut out)?)
        }
    };
    out.flush()?;
    let n = crate::compact::markers::group_digits;
    let why = match stats.dpo.reasons() {
        _ if stats.rows == 0 && stats.sessions == 0 => ": no session matches".to_owned(),
        reasons if stats.rows == 0 && !reasons.is_empty() => format!(": {reasons}"),
        _ => String::new(),
    };
    eprintln!("exported {} {what} from {} session(s){why}", n(stats.rows), n(stats.sessions));
    Ok(ExitCode::SUCCESS)
}

/// Create (or truncate) `path` readable by its owner only (0600): an export holds the prompts and
/// tool outputs of every session it covers. A file that was already there loses its group and
/// other permissions too.
fn create_private(path: &std::path::Path) -> std::io::Result<std::fs::File> {
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        options.mode(0o600);
        let file = options.open(path)?;
        let mode = file.metadata()?.permissions().mode();
        if mode & 0o077 != 0 {
            file.set_permissions(std::fs::Permissions::from_mode(mode & 0o600))?;
        }
        Ok(file)
    }
    #[cfg(not(unix))]
    options.open(path)
}
