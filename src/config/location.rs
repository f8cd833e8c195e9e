//! Where the archive lives: a directory holding the SQLite store, or a PostgreSQL database named by a
//! `postgres://` (or `postgresql://`) URL. Printed anywhere (logs, errors, health, `sessions`
//! headers), a location hides its password.
//!
//! A URL's password comes from the URL itself, else `archive.password_file` (its first line), else
//! the `PGPASSWORD` environment variable. TLS follows the URL's `sslmode`: `disable`, `prefer` (the
//! default: TLS when the server offers it) or `require`; the server's certificate is verified with
//! the platform's roots, as pare's upstream client verifies it (rustls).

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// How long connecting to PostgreSQL may take.
pub const PG_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Where an archive is.
#[derive(Clone)]
pub enum Location {
    /// A directory holding the SQLite store.
    Dir(PathBuf),
    /// A PostgreSQL database.
    Postgres(Arc<PgLocation>),
}

/// Why an archive location is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LocationError {
    #[error("archive location {0:?} is a URL pare does not store to (give a directory or a postgres:// URL)")]
    UnknownScheme(String),
    #[error("archive location {0:?} is not a URL (write postgres://USER@HOST/DATABASE, or give a directory)")]
    NotAUrl(String),
    #[error("archive URL {shown} is not valid: {why}")]
    BadUrl { shown: String, why: String },
    #[error("cannot read the archive password file {path}: {why}")]
    PasswordFile { path: PathBuf, why: String },
}

/// A PostgreSQL archive: how to connect, and the URL as shown (password hidden).
pub struct PgLocation {
    config: postgres::Config,
    shown: String,
    /// The URL and the password in force: which connections of the readers' pool fit.
    key: String,
}

impl Location {
    /// A location as the command line or `archive.url` gives it: a `postgres://` or
    /// `postgresql://` URL, or else a directory. Any other `scheme://`, and `postgres:` without
    /// `//`, is refused rather than taken for a directory of that name.
    pub fn parse(text: &str, password_file: Option<&Path>) -> Result<Location, LocationError> {
        let lower = text.to_ascii_lowercase();
        if let Some((scheme, _)) = lower.split_once("://")
            && !scheme.is_empty()
            && scheme.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
        {
            if scheme != "postgres" && scheme != "postgresql" {
                return Err(LocationError::UnknownScheme(redact(text)));
            }
            return PgLocation::parse(text, password_file).map(|pg| Location::Postgres(Arc::new(pg)));
        }
        if lower.starts_with("postgres:") || lower.starts_with("postgresql:") {
            return Err(LocationError::NotAUrl(redact(text)));
        }
        Ok(Location::Dir(PathBuf::from(text)))
    }

    /// The directory of a SQLite archive.
    pub fn dir(&self) -> Option<&Path> {
        match self {
            Location::Dir(dir) => Some(dir),
            Location::Postgres(_) => None,
        }
    }
}

impl From<PathBuf> for Location {
    fn from(dir: PathBuf) -> Location {
        Location::Dir(dir)
    }
}

impl From<&PathBuf> for Location {
    fn from(dir: &PathBuf) -> Location {
        Location::Dir(dir.clone())
    }
}

impl From<&Location> for Location {
    fn from(location: &Location) -> Location {
        location.clone()
    }
}

impl From<&Path> for Location {
    fn from(dir: &Path) -> Location {
        Location::Dir(dir.to_owned())
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Dir(dir) => write!(f, "{}", dir.display()),
            Location::Postgres(pg) => f.write_str(&pg.shown),
        }
    }
}

impl fmt::Debug for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Location({self})")
    }
}

impl PgLocation {
    fn parse(url: &str, password_file: Option<&Path>) -> Result<PgLocation, LocationError> {
        let shown = redact(url);
        let mut config = postgres::Config::from_str(url)
            .map_err(|e| LocationError::BadUrl { shown: shown.clone(), why: e.to_string() })?;
        if config.get_hosts().is_empty() {
            return Err(LocationError::BadUrl { shown, why: "it names no host".into() });
        }
        if config.get_password().is_none() {
            let password = match password_file {
                Some(path) => Some(read_password_file(path)?),
                None => std::env::var("PGPASSWORD").ok().filter(|p| !p.is_empty()),
            };
            if let Some(password) = password {
                config.password(password);
            }
        }
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(PG_CONNECT_TIMEOUT);
        }
        config.application_name("pare");
        let password = config.get_password().map(<[u8]>::to_vec).unwrap_or_default();
        let key = format!("{url}\u{0}{}", String::from_utf8_lossy(&password));
        Ok(PgLocation { config, shown, key })
    }

    /// The URL with its password hidden.
    pub fn shown(&self) -> &str {
        &self.shown
    }

    pub(crate) fn key(&self) -> &str {
        &self.key
    }

    /// A new connection (TLS as `sslmode` says). Blocking: never call it on an async task.
    pub(crate) fn connect(&self) -> Result<postgres::Client, postgres::Error> {
        if self.config.get_ssl_mode() == postgres::config::SslMode::Disable {
            return self.config.connect(postgres::NoTls);
        }
        match tls_connector() {
            Some(tls) => self.config.connect(tls.clone()),
            // No verifier could be built (no roots on this host): only a server without TLS can
            // be reached, and `require` fails as it should.
            None => self.config.connect(postgres::NoTls),
        }
    }
}

fn tls_connector() -> Option<&'static tokio_postgres_rustls::MakeRustlsConnect> {
    static TLS: OnceLock<Option<tokio_postgres_rustls::MakeRustlsConnect>> = OnceLock::new();
    TLS.get_or_init(|| {
        crate::outbound::install_crypto_provider();
        use rustls_platform_verifier::ConfigVerifierExt;
        match rustls::ClientConfig::with_platform_verifier() {
            Ok(config) => Some(tokio_postgres_rustls::MakeRustlsConnect::new(config)),
            Err(e) => {
                tracing::warn!(error = %e, "no TLS verifier for the PostgreSQL archive; connecting without TLS");
                None
            }
        }
    })
    .as_ref()
}

fn read_password_file(path: &Path) -> Result<String, LocationError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| LocationError::PasswordFile { path: path.to_owned(), why: e.to_string() })?;
    let password = text.lines().next().unwrap_or_default().to_owned();
    if password.is_empty() {
        return Err(LocationError::PasswordFile { path: path.to_owned(), why: "its first line is empty".into() });
    }
    Ok(password)
}

/// `url` with the password of its user part and of a `password=` query option replaced by `***`.
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return url.to_owned() };
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let authority = match authority.rsplit_once('@') {
        Some((user_info, host)) => match user_info.split_once(':') {
            Some((user, _)) => format!("{user}:***@{host}"),
            None => format!("{user_info}@{host}"),
        },
        None => authority.to_owned(),
    };
    let tail = match tail.split_once('?') {
        Some((path, query)) => {
            let options: Vec<String> = query
                .split('&')
                .map(|option| match option.split_once('=') {
                    Some((key, _)) if key.eq_ignore_ascii_case("password") => format!("{key}=***"),
                    _ => option.to_owned(),
                })
                .collect();
            format!("{path}?{}", options.join("&"))
        }
        None => tail.to_owned(),
    };
    format!("{scheme}://{authority}{tail}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_directories_are_told_apart() {
        assert!(matches!(Location::parse("/var/lib/pare", None), Ok(Location::Dir(_))));
        assert!(matches!(Location::parse("./archive", None), Ok(Location::Dir(_))));
        let pg = Location::parse("postgres://pare:s3cret@127.0.0.1:5432/pare", None).unwrap();
        assert_eq!(pg.to_string(), "postgres://pare:***@127.0.0.1:5432/pare");
        assert!(matches!(
            Location::parse("postgresql://db.example/pare?sslmode=require", None),
            Ok(Location::Postgres(_))
        ));
    }

    /// Regression: `--archive postgres://…` was taken for a directory named `postgres:`.
    #[test]
    fn other_schemes_and_schemes_without_slashes_are_refused() {
        assert_eq!(
            Location::parse("mysql://u:pw@h/db", None).unwrap_err(),
            LocationError::UnknownScheme("mysql://u:***@h/db".into())
        );
        assert_eq!(Location::parse("postgres:pare", None).unwrap_err(), LocationError::NotAUrl("postgres:pare".into()));
        let bad = Location::parse("postgres://u:pw@h/db?sslmode=sometimes", None).unwrap_err();
        assert!(
            matches!(&bad, LocationError::BadUrl { shown, .. } if shown == "postgres://u:***@h/db?sslmode=sometimes"),
            "{bad}"
        );
        assert!(!bad.to_string().contains("pw@"), "{bad}");
    }

    #[test]
    fn passwords_never_show() {
        assert_eq!(
            redact("postgres://a:b@h/d?password=x&sslmode=disable"),
            "postgres://a:***@h/d?password=***&sslmode=disable"
        );
        assert_eq!(redact("postgres://a@h"), "postgres://a@h");
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("pw");
        std::fs::write(&file, "from-file\n").unwrap();
        let Location::Postgres(pg) = Location::parse("postgres://a@h/d", Some(&file)).unwrap() else { panic!() };
        assert_eq!(pg.config.get_password(), Some(&b"from-file"[..]));
        assert_eq!(pg.shown(), "postgres://a@h/d");
        assert!(!format!("{:?}", Location::Postgres(pg)).contains("from-file"));
    }
}
