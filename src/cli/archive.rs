//! `pare archive copy FROM TO`: every session of one archive into another (see
//! [`crate::archive::copy`]), each side a directory or a PostgreSQL URL; `pare archive prune --before
//! DATE`: every session last active before DATE deleted, the store vacuumed
//! ([`crate::archive::retention`]).

use std::path::Path;
use std::process::ExitCode;

use crate::archive::Location;
use crate::archive::copy::copy as copy_archive;
use crate::config::Config;

pub fn copy(from: &str, to: &str, config: Option<&Path>) -> anyhow::Result<ExitCode> {
    let config = Config::load(config)?;
    let password_file = config.archive.password_file.as_deref();
    let (from, to) = (Location::parse(from, password_file)?, Location::parse(to, password_file)?);
    let report = copy_archive(&from, &to)?;
    for problem in &report.verify.problems {
        println!("FAIL {problem}");
    }
    for mismatch in &report.mismatches {
        println!("MISMATCH {mismatch}");
    }
    println!(
        "copied {} session(s), {} request(s), {} response(s), {} new blob(s) from {from} to {to}; target verified: {} body(ies), {} problem(s), {} mismatch(es)",
        report.sessions,
        report.exchanges,
        report.responses,
        report.blobs_copied,
        report.verify.bodies,
        report.verify.problems.len(),
        report.mismatches.len()
    );
    if report.ok() {
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!("pare archive copy: the target does not match the source (see FAIL / MISMATCH above)");
        Ok(ExitCode::from(1))
    }
}

pub fn prune(before: &str, archive: Option<String>, config: Option<&Path>) -> anyhow::Result<ExitCode> {
    use crate::archive::retention::{Reclaim, prune};
    let before_ms = crate::archive::time::parse_since(before).map_err(|e| anyhow::anyhow!("--before {e}"))?;
    let location = super::sessions::archive_location(archive, config)?;
    let report = prune(&location, before_ms, Reclaim::Vacuum)?;
    println!(
        "pruned {} session(s), {} request(s), {} response(s), {} blob(s) freed from {location}; store {} -> {} bytes",
        report.sessions,
        report.exchanges,
        report.responses,
        report.blobs_freed,
        report.bytes_before,
        report.bytes_after
    );
    if let Some(why) = &report.vacuum_error {
        eprintln!("pare archive prune: the sessions are deleted, but vacuuming failed: {why}");
    }
    Ok(ExitCode::SUCCESS)
}
