//! Where the archive lives: a directory holding the SQLite store, or a PostgreSQL database named by a
//! `postgres://` (or `postgresql://`) URL or by a libpq keyword string (`host=db user=pare
//! dbname=pare`: a text whose first word is a libpq keyword followed by `=`). Printed anywhere
//! (logs, errors, health, the UI, `sessions` headers), a location hides its password in every
//! spelling the PostgreSQL client reads: the URL's user part up to its first `@` (a password may
//! hold `/`, `?` or `#`), a `password` option however its name is percent-encoded
//! (`?pass%77ord=`), a keyword string's `password=` quoted or not. As a last guard, a shown
//! location that still holds the password in force (raw or percent-decoded) is replaced by one
//! built from the parsed settings, without options.
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

/// Default of `archive.max_connections`: the readers' connections one pare opens to a PostgreSQL
/// archive (the writer has one more of its own).
pub const DEFAULT_MAX_CONNECTIONS: usize = 4;

/// The keywords of libpq's connection strings: a location whose first word is one of them
/// followed by `=` is a keyword string, never a directory.
const LIBPQ_KEYWORDS: &[&str] = &[
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "passfile",
    "service",
    "options",
    "application_name",
    "connect_timeout",
    "client_encoding",
    "sslmode",
    "sslnegotiation",
    "sslcert",
    "sslkey",
    "sslrootcert",
    "sslpassword",
    "channel_binding",
    "target_session_attrs",
    "load_balance_hosts",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_count",
    "tcp_user_timeout",
    "gssencmode",
    "krbsrvname",
    "require_auth",
];

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
#[derive(Clone)]
pub struct PgLocation {
    config: postgres::Config,
    shown: String,
    /// The URL and the password in force: which connections of the readers' pool fit.
    key: String,
    /// Most connections the readers hold open at once (`archive.max_connections`).
    max_connections: usize,
}

impl Location {
    /// A location as the command line or `archive.url` gives it: a `postgres://` or
    /// `postgresql://` URL, or else a directory. Any other `scheme://`, and `postgres:` without
    /// `//`, is refused rather than taken for a directory of that name.
    pub fn parse(text: &str, password_file: Option<&Path>) -> Result<Location, LocationError> {
        if is_keyword_string(text) {
            return PgLocation::parse(text, password_file).map(|pg| Location::Postgres(Arc::new(pg)));
        }
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

    /// The same location with at most `n` connections for its readers (a PostgreSQL archive's
    /// `archive.max_connections`; at least one).
    pub fn with_max_connections(self, n: usize) -> Location {
        match self {
            Location::Postgres(pg) => {
                let pg = Arc::unwrap_or_clone(pg);
                Location::Postgres(Arc::new(PgLocation { max_connections: n.max(1), ..pg }))
            }
            dir => dir,
        }
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
        let shown = hide_password(shown, &config);
        Ok(PgLocation { config, shown, key, max_connections: DEFAULT_MAX_CONNECTIONS })
    }

    /// The URL with its password hidden.
    pub fn shown(&self) -> &str {
        &self.shown
    }

    pub(crate) fn key(&self) -> &str {
        &self.key
    }

    /// Most connections the readers hold open at once.
    pub fn max_connections(&self) -> usize {
        self.max_connections
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

/// Whether `text` names a PostgreSQL database rather than a directory: a `postgres://` or
/// `postgresql://` URL (or one missing its `//`), or a libpq keyword string.
pub fn names_database(text: &str) -> bool {
    let lower = text.to_ascii_lowercase();
    text.contains("://")
        || lower.starts_with("postgres:")
        || lower.starts_with("postgresql:")
        || is_keyword_string(text)
}

/// Whether `text` is a libpq keyword string: its first word is a libpq keyword followed by `=`.
fn is_keyword_string(text: &str) -> bool {
    let text = text.trim_start();
    let word_end = text.find(|c: char| c == '=' || c.is_whitespace()).unwrap_or(text.len());
    LIBPQ_KEYWORDS.contains(&&text[..word_end]) && text[word_end..].trim_start().starts_with('=')
}

/// `location` (a URL or a libpq keyword string) with every password the PostgreSQL client would
/// read in it replaced by `***`.
pub fn redact(location: &str) -> String {
    if is_keyword_string(location) {
        return redact_keywords(location);
    }
    let Some((scheme, rest)) = location.split_once("://") else { return location.to_owned() };
    // As the client reads a URL: the user part runs to the first `@`, wherever it is, and the
    // password is what follows its first `:`.
    let (user_info, tail) = match rest.split_once('@') {
        Some((user_info, tail)) => {
            let user_info = match user_info.split_once(':') {
                Some((user, _)) => format!("{}:***", redact_options(user)),
                None => redact_options(user_info),
            };
            (Some(user_info), tail)
        }
        None => (None, rest),
    };
    match user_info {
        Some(user_info) => format!("{scheme}://{user_info}@{}", redact_options(tail)),
        None => format!("{scheme}://{}", redact_options(tail)),
    }
}

/// `text` with the value of each `password` option of its query (after its first `?`) hidden; an
/// option's name is compared percent-decoded and without case, as a superset of what the client
/// reads.
fn redact_options(text: &str) -> String {
    let Some((before, query)) = text.split_once('?') else { return text.to_owned() };
    let options: Vec<String> = query
        .split('&')
        .map(|option| match option.split_once('=') {
            Some((key, _)) if is_password_key(key) => format!("{key}=***"),
            _ => option.to_owned(),
        })
        .collect();
    format!("{before}?{}", options.join("&"))
}

fn is_password_key(key: &str) -> bool {
    let decoded = percent_encoding::percent_decode_str(key).decode_utf8_lossy();
    let name = decoded.trim();
    name.eq_ignore_ascii_case("password") || name.eq_ignore_ascii_case("sslpassword")
}

/// A libpq keyword string with its `password` values hidden. It is read as the client reads it
/// (values bare or single-quoted, `\` escaping the next character); from a word it cannot read on,
/// the rest is hidden.
fn redact_keywords(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    loop {
        let trimmed = rest.trim_start();
        out.push_str(&rest[..rest.len() - trimmed.len()]);
        rest = trimmed;
        if rest.is_empty() {
            return out;
        }
        let key_end = rest.find(|c: char| c == '=' || c.is_whitespace()).unwrap_or(rest.len());
        let key = &rest[..key_end];
        let after_key = rest[key_end..].trim_start();
        let Some(value_part) = after_key.strip_prefix('=') else {
            out.push_str("***");
            return out;
        };
        let value_part = value_part.trim_start();
        let Some(value_len) = keyword_value_len(value_part) else {
            out.push_str(key);
            out.push_str("=***");
            return out;
        };
        out.push_str(key);
        out.push('=');
        if is_password_key(key) {
            out.push_str("***");
        } else {
            out.push_str(&value_part[..value_len]);
        }
        rest = &value_part[value_len..];
    }
}

/// The length in bytes of the value at the start of `text`, as libpq's reader takes it.
fn keyword_value_len(text: &str) -> Option<usize> {
    let quoted = text.starts_with('\'');
    let mut chars = text.char_indices().skip(usize::from(quoted));
    while let Some((at, c)) = chars.next() {
        match c {
            '\\' => {
                chars.next();
            }
            '\'' if quoted => return Some(at + 1),
            c if c.is_whitespace() && !quoted => return Some(at),
            _ => {}
        }
    }
    (!quoted && !text.is_empty()).then_some(text.len())
}

/// `shown` unless it still holds `config`'s password, raw or percent-decoded; then the location
/// rebuilt from the parsed settings (user, hosts, ports, database: no options), or a bare
/// `postgres://***` when even that holds it.
fn hide_password(shown: String, config: &postgres::Config) -> String {
    let Some(password) = config.get_password().filter(|p| !p.is_empty()) else { return shown };
    let password = String::from_utf8_lossy(password);
    let holds = |text: &str| {
        text.contains(password.as_ref())
            || percent_encoding::percent_decode_str(text).decode_utf8_lossy().contains(password.as_ref())
    };
    if !holds(&shown) {
        return shown;
    }
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .enumerate()
        .map(|(idx, host)| {
            let name = match host {
                postgres::config::Host::Tcp(name) => name.clone(),
                #[cfg(unix)]
                postgres::config::Host::Unix(path) => path.display().to_string(),
            };
            match config.get_ports().get(idx).or(config.get_ports().first()) {
                Some(port) => format!("{name}:{port}"),
                None => name,
            }
        })
        .collect();
    let rebuilt = format!(
        "postgres://{}:***@{}/{}",
        config.get_user().unwrap_or_default(),
        hosts.join(","),
        config.get_dbname().unwrap_or_default()
    );
    if holds(&rebuilt) { "postgres://***".to_owned() } else { rebuilt }
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

    /// Regression: a password holding `/` or `?` (base64 passwords do) was shown, and so was a
    /// `password` option whose name is percent-encoded. Each spelling the client reads a password
    /// from is hidden.
    #[test]
    fn every_spelling_of_a_password_is_redacted() {
        let cases = [
            ("postgres://u:ab/c?d=@h:5432/db?sslmode=disable", "postgres://u:***@h:5432/db?sslmode=disable"),
            ("postgres://u:ab%2Fc@h/db", "postgres://u:***@h/db"),
            ("postgres://u@h/db?pass%77ord=x&sslmode=require", "postgres://u@h/db?pass%77ord=***&sslmode=require"),
            ("postgres://u@h/db?%50ASSWORD=x", "postgres://u@h/db?%50ASSWORD=***"),
            ("postgres://h/db?password=x@y", "postgres://h/db?password=***@y"),
            ("host=h password=x dbname=d", "host=h password=*** dbname=d"),
            ("host=h password = 'a b\\' c' dbname=d", "host=h password=*** dbname=d"),
            ("host=h password=a\\ b dbname=d", "host=h password=*** dbname=d"),
            ("host=h password='unterminated", "host=h password=***"),
        ];
        for (url, shown) in cases {
            assert_eq!(redact(url), shown, "{url}");
        }
        // What the client reads is what is hidden.
        let Location::Postgres(pg) = Location::parse("postgres://u:ab/c?d=@h:5432/db", None).unwrap() else { panic!() };
        assert_eq!(pg.config.get_password(), Some(&b"ab/c?d="[..]));
        assert_eq!(pg.shown(), "postgres://u:***@h:5432/db");
        let Location::Postgres(pg) = Location::parse("postgres://u@h/db?pass%77ord=se%2Fcret", None).unwrap() else {
            panic!()
        };
        assert_eq!(pg.config.get_password(), Some(&b"se/cret"[..]));
        assert!(!pg.shown().contains("se"), "{}", pg.shown());
    }

    /// Regression: a libpq keyword string was taken for a directory.
    #[test]
    fn keyword_strings_are_postgres() {
        let Location::Postgres(pg) = Location::parse("host=db port=6432 user=u password=pw dbname=pare", None).unwrap()
        else {
            panic!("a keyword string is PostgreSQL")
        };
        assert_eq!(pg.config.get_password(), Some(&b"pw"[..]));
        assert_eq!(pg.shown(), "host=db port=6432 user=u password=*** dbname=pare");
        let no_host = Location::parse("dbname=pare password=pw", None).unwrap_err();
        assert!(matches!(&no_host, LocationError::BadUrl { why, .. } if why.contains("no host")), "{no_host}");
        assert!(!no_host.to_string().contains("pw"), "{no_host}");
        assert!(matches!(Location::parse("./a=b", None), Ok(Location::Dir(_))));
        assert!(matches!(Location::parse("hostname=x", None), Ok(Location::Dir(_))));
        assert!(names_database("host=db") && !names_database("/var/lib/pare"));
    }

    /// A shown location that still holds the password in force (here one with a `@` the client
    /// splits on first) is rebuilt from the parsed settings.
    #[test]
    fn a_password_left_in_the_shown_text_is_caught() {
        let mut config: postgres::Config = "postgres://u@h/db?sslmode=disable".parse().unwrap();
        config.password("sslmode");
        let shown = hide_password("postgres://u@h/db?sslmode=disable".into(), &config);
        assert!(shown.starts_with("postgres://u:***@h") && shown.ends_with("/db"), "{shown}");
    }
}
