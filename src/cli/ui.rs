//! `pare ui`: the audit UI over an archive alone (no proxy), read-only, until SIGINT or SIGTERM.

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;

use super::UiArgs;
use super::sessions::archive_location;
use crate::config::Config;
use crate::ui::Ui;

pub fn run(args: UiArgs) -> anyhow::Result<ExitCode> {
    let config = Config::load(args.config.as_deref())?;
    let dir = archive_location(args.archive, args.config.as_deref())?;
    crate::archive::query::ArchiveReader::open(&dir)?;
    let owner = crate::proxy::token::OwnerToken::for_ui(&config, dir.dir())?;
    let prices = Arc::new(crate::budget::price::Prices::from_config(&config));
    let ui = Arc::new(Ui::new(dir).with_prices(prices));
    let runtime =
        tokio::runtime::Builder::new_multi_thread().enable_all().build().context("cannot start the tokio runtime")?;
    runtime.block_on(async {
        let listener = crate::proxy::bind(&args.listen, &config).await?;
        let addr = listener.local_addr().context("cannot read the listening address")?;
        eprintln!("pare ui: {}", owner.ui_url(addr));
        crate::proxy::ui_server::run(listener, ui, &config, &owner, super::serve::shutdown_signal()).await;
        anyhow::Ok(())
    })?;
    Ok(ExitCode::SUCCESS)
}
