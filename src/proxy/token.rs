//! The owner token, the secret that reads pare's own endpoints and the gateway: configured
//! (`server.auth_token`, else `server.owner_token`), or made at first start and kept 0600 in a file
//! beside the archive (`server.owner_token_file`), read back on every later start; and the pace at
//! which wrong tokens are answered ([`FailedTokens`]).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::config::location::Location;
use crate::config::{Config, MIN_TOKEN_CHARS};

/// Where the owner token in force came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenSource {
    /// `server.owner_token` or `server.auth_token`: the user knows it, pare never prints it.
    Configured,
    /// Read from this file, or made there (`made`) at this start.
    File { path: PathBuf, made: bool },
    /// Archiving is off and no token is configured: one for this run only, kept nowhere.
    Run,
}

/// The owner token and where it came from.
#[derive(Clone)]
pub struct OwnerToken {
    pub token: String,
    pub source: TokenSource,
}

impl std::fmt::Debug for OwnerToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnerToken").field("source", &self.source).finish_non_exhaustive()
    }
}

/// Why the owner token cannot be had.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("cannot make the owner token file {path}: {source}")]
    Make { path: PathBuf, source: std::io::Error },
    #[error("cannot read the owner token file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error(
        "the owner token file {path} holds {chars} characters, fewer than {MIN_TOKEN_CHARS}: delete it to have a new one made"
    )]
    Short { path: PathBuf, chars: usize },
    #[error("cannot draw random bytes for the owner token: {0}")]
    Random(String),
}

impl OwnerToken {
    /// The token of `pare serve` under `config` archiving to `archive` (`None`: archiving is off):
    /// configured, else the one kept in `server.owner_token_file`, else in `token` in the archive's
    /// directory (`archive.dir` for a PostgreSQL archive), made there when absent; with archiving
    /// off and no file named, one for this run.
    pub fn for_serve(config: &Config, archive: Option<&Location>) -> Result<OwnerToken, TokenError> {
        if let Some(token) = configured(config) {
            return Ok(token);
        }
        match (&config.server.owner_token_file, archive) {
            (Some(file), _) => kept(file),
            (None, None) => Ok(OwnerToken { token: random_token()?, source: TokenSource::Run }),
            (None, Some(location)) => OwnerToken::for_ui(config, location.dir()),
        }
    }

    /// The token of `pare ui` over the archive in `archive_dir` (`None`: a PostgreSQL archive,
    /// whose token is kept where `pare serve` keeps it).
    pub fn for_ui(config: &Config, archive_dir: Option<&Path>) -> Result<OwnerToken, TokenError> {
        if let Some(token) = configured(config) {
            return Ok(token);
        }
        let path = match (&config.server.owner_token_file, archive_dir) {
            (None, Some(dir)) => dir.join("token"),
            _ => config.server.owner_token_path(&config.archive),
        };
        kept(&path)
    }

    /// The URL that opens the audit UI at `addr` and sets the token's cookie; the token itself
    /// appears only when pare made or read it (a configured token is the user's to type).
    pub fn ui_url(&self, addr: std::net::SocketAddr) -> String {
        match self.source {
            TokenSource::Configured => format!("http://{addr}{}/", crate::ui::PREFIX),
            _ => format!("http://{addr}{}/?token={}", crate::ui::PREFIX, self.token),
        }
    }

    /// The file the token is kept in, when it is kept in one.
    pub fn file(&self) -> Option<&Path> {
        match &self.source {
            TokenSource::File { path, .. } => Some(path),
            _ => None,
        }
    }
}

fn configured(config: &Config) -> Option<OwnerToken> {
    // `auth_token` guards every path, so it is the one token when set (the config check refuses both).
    let token = config.server.auth_token.as_deref().or(config.server.owner_token.as_deref())?;
    Some(OwnerToken { token: token.trim().to_owned(), source: TokenSource::Configured })
}

/// The token in `path` (its first line), made there first when the file does not exist: 32 hex
/// digits (128 random bits), the file 0600 and its directory 0700 when pare makes them.
fn kept(path: &Path) -> Result<OwnerToken, TokenError> {
    match std::fs::read_to_string(path) {
        Ok(text) => return read_back(path, &text),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => return Err(TokenError::Read { path: path.to_owned(), source }),
    }
    let token = random_token()?;
    let make = |source| TokenError::Make { path: path.to_owned(), source };
    if let Some(dir) = path.parent().filter(|dir| !dir.as_os_str().is_empty()) {
        let mut builder = std::fs::DirBuilder::new();
        builder.recursive(true);
        #[cfg(unix)]
        std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
        builder.create(dir).map_err(make)?;
    }
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    match options.open(path) {
        Ok(mut file) => {
            file.write_all(format!("{token}\n").as_bytes()).and_then(|()| file.sync_all()).map_err(make)?;
            Ok(OwnerToken { token, source: TokenSource::File { path: path.to_owned(), made: true } })
        }
        // Another pare made it meanwhile: its token is the one.
        Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => {
            let text =
                std::fs::read_to_string(path).map_err(|source| TokenError::Read { path: path.to_owned(), source })?;
            read_back(path, &text)
        }
        Err(source) => Err(make(source)),
    }
}

fn read_back(path: &Path, text: &str) -> Result<OwnerToken, TokenError> {
    let token = text.lines().next().unwrap_or("").trim();
    let chars = token.chars().count();
    if chars < MIN_TOKEN_CHARS {
        return Err(TokenError::Short { path: path.to_owned(), chars });
    }
    Ok(OwnerToken { token: token.to_owned(), source: TokenSource::File { path: path.to_owned(), made: false } })
}

fn random_token() -> Result<String, TokenError> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).map_err(|e| TokenError::Random(e.to_string()))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// How long each wrong token holds the one turn: wrong tokens are answered at most this often.
pub const FAILURE_PAUSE: Duration = Duration::from_millis(100);

/// Wrong tokens waiting for their turn beyond which every request that needs a token is refused
/// with 429 before its token is compared: the waiting requests' memory stays bounded, and a flood
/// of guesses learns nothing faster.
pub const MAX_WAITING_FAILURES: usize = 256;

/// The pace of wrong tokens, across all clients (behind a proxy every client has its address):
/// each wrong token waits its turn, then holds it for [`FAILURE_PAUSE`] before its 401, so
/// guessing runs at most 1 / `FAILURE_PAUSE` per second however many connections guess. A right
/// token never waits; a request without one is answered at once.
#[derive(Debug)]
pub struct FailedTokens {
    turn: tokio::sync::Mutex<()>,
    waiting: Arc<AtomicUsize>,
    pause: Duration,
}

impl Default for FailedTokens {
    fn default() -> Self {
        FailedTokens::with_pause(FAILURE_PAUSE)
    }
}

impl FailedTokens {
    pub fn with_pause(pause: Duration) -> FailedTokens {
        FailedTokens { turn: tokio::sync::Mutex::new(()), waiting: Arc::default(), pause }
    }

    /// Whether so many wrong tokens wait that no token is compared now.
    pub fn saturated(&self) -> bool {
        self.waiting.load(Ordering::Relaxed) >= MAX_WAITING_FAILURES
    }

    /// Wait this wrong token's turn and its pause.
    pub async fn pause(&self) {
        struct Waiting(Arc<AtomicUsize>);
        impl Drop for Waiting {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::Relaxed);
            }
        }
        self.waiting.fetch_add(1, Ordering::Relaxed);
        let _waiting = Waiting(self.waiting.clone());
        let _turn = self.turn.lock().await;
        tokio::time::sleep(self.pause).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_made_once_0600_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("archive").join("token");
        let made = kept(&path).unwrap();
        assert_eq!(made.source, TokenSource::File { path: path.clone(), made: true });
        assert_eq!(made.token.len(), 32);
        assert!(made.token.bytes().all(|b| b.is_ascii_hexdigit()));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        }
        let again = kept(&path).unwrap();
        assert_eq!((again.token, again.source), (made.token, TokenSource::File { path: path.clone(), made: false }));
        std::fs::write(&path, "short\n").unwrap();
        assert!(matches!(kept(&path), Err(TokenError::Short { chars: 5, .. })));
    }

    #[test]
    fn a_configured_token_is_never_printed() {
        let mut config = Config::default();
        config.server.owner_token = Some("0123456789abcdef".into());
        let token = OwnerToken::for_serve(&config, None).unwrap();
        let addr = "127.0.0.1:8787".parse().unwrap();
        assert_eq!(token.ui_url(addr), "http://127.0.0.1:8787/_pare/ui/");
        assert!(!format!("{token:?}").contains("0123456789abcdef"));
        config.server.owner_token = None;
        let run = OwnerToken::for_serve(&config, None).unwrap();
        assert_eq!(run.source, TokenSource::Run);
        assert_eq!(run.ui_url(addr), format!("http://127.0.0.1:8787/_pare/ui/?token={}", run.token));
    }

    #[tokio::test(start_paused = true)]
    async fn wrong_tokens_take_turns() {
        let failures = Arc::new(FailedTokens::default());
        let started = tokio::time::Instant::now();
        let waits: Vec<_> = (0..5)
            .map(|_| {
                let failures = failures.clone();
                tokio::spawn(async move { failures.pause().await })
            })
            .collect();
        for wait in waits {
            wait.await.unwrap();
        }
        assert_eq!(started.elapsed(), FAILURE_PAUSE * 5);
        assert!(!failures.saturated());
    }
}
