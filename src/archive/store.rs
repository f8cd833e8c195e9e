//! The store: opening it, its schema, and blob storage (content-addressed by SHA-256,
//! zstd-compressed when that pays). SQLite (directory 0700, files 0600, WAL, `synchronous=NORMAL`) by
//! default; PostgreSQL when the archive's location is a URL ([`crate::config::location`]), with the same
//! tables in PostgreSQL's types, created and brought up to date on open ([`migrate_postgres`]).
//!
//! Why `synchronous=NORMAL` in WAL mode: a commit is written to the WAL before `COMMIT` returns, so a
//! crash of pare itself (kill -9, panic, OOM) loses nothing committed and never corrupts earlier
//! records; only an OS crash or power loss can roll back the last commits (never corrupt). `FULL` would
//! add an fsync per group commit for that last case; the background writer would absorb it, but the
//! requirement (at most ~100 ms lost on a crash) is met without it.

use std::path::{Path, PathBuf};

use rusqlite::{Connection, OpenFlags};
use sha2::{Digest, Sha256};

use super::ArchiveError;
use super::db::{Db, params};
use crate::config::location::{Location, PgLocation};

/// The `meta` key of the prune generation (`archive::retention`).
pub const PRUNE_GENERATION: &str = "prune_generation";

/// File name of the store inside the archive directory.
pub const DB_FILE: &str = "archive.sqlite3";

const SCHEMA: &str = r#"
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
) WITHOUT ROWID;

-- Content-addressed pieces of bodies: messages, large top-level values, response bodies.
CREATE TABLE IF NOT EXISTS blobs (
    id      INTEGER PRIMARY KEY,
    sha256  BLOB NOT NULL UNIQUE,
    codec   INTEGER NOT NULL,      -- 0 = stored as is, 1 = zstd
    raw_len INTEGER NOT NULL,
    data    BLOB NOT NULL
);

-- Which sessions use which blobs (so deleting a session can free its blobs).
CREATE TABLE IF NOT EXISTS session_blobs (
    session TEXT NOT NULL,
    blob    INTEGER NOT NULL,
    PRIMARY KEY (session, blob)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS session_blobs_blob ON session_blobs (blob);

CREATE TABLE IF NOT EXISTS sessions (
    id               TEXT PRIMARY KEY,
    started_ms       INTEGER NOT NULL,
    last_ms          INTEGER NOT NULL,
    n_requests       INTEGER NOT NULL,
    n_records        INTEGER NOT NULL,  -- exchanges + responses: length of the hash chain
    head_hash        BLOB NOT NULL,     -- hash of the last record of the chain
    model            TEXT,
    tokens_raw       INTEGER NOT NULL DEFAULT 0,
    tokens_forwarded INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS sessions_last ON sessions (last_ms);

-- One chat request: the raw body as a template over blobs, the forwarded body the same way.
CREATE TABLE IF NOT EXISTS exchanges (
    id           INTEGER PRIMARY KEY,
    session      TEXT NOT NULL,
    seq          INTEGER NOT NULL,      -- 1-based within the session
    chain_idx    INTEGER NOT NULL,      -- 0-based position in the session's hash chain
    at_ms        INTEGER NOT NULL,
    method       TEXT NOT NULL,
    path         TEXT NOT NULL,
    model        TEXT,
    headers      TEXT NOT NULL,         -- JSON object of the stored (non-secret) request headers
    raw_sha256   BLOB NOT NULL,
    raw_len      INTEGER NOT NULL,
    raw_template BLOB NOT NULL,
    fwd_sha256   BLOB,                  -- NULL: forwarded unchanged
    fwd_len      INTEGER,
    fwd_template BLOB,
    summary      TEXT,                  -- CompactionSummary as JSON
    skipped      TEXT,                  -- why compaction did not apply
    key_req      INTEGER,               -- session key of the request's messages (session tracking)
    prev_hash    BLOB NOT NULL,
    hash         BLOB NOT NULL,
    UNIQUE (session, seq)
);
CREATE INDEX IF NOT EXISTS exchanges_at ON exchanges (at_ms);

-- The upstream's answer to one exchange.
CREATE TABLE IF NOT EXISTS responses (
    exchange    INTEGER PRIMARY KEY REFERENCES exchanges (id),
    session     TEXT NOT NULL,
    chain_idx   INTEGER NOT NULL,
    at_ms       INTEGER NOT NULL,
    status      INTEGER,               -- NULL: no response head (pare answered itself)
    headers     TEXT NOT NULL,
    stream      INTEGER NOT NULL,
    partial     INTEGER NOT NULL,      -- 1: the body was cut short
    end_reason  TEXT NOT NULL,
    body_blob   INTEGER,               -- raw body bytes (the SSE stream for streams)
    body_sha256 BLOB NOT NULL,
    body_len    INTEGER NOT NULL,
    assembled   TEXT,                  -- the assistant message as JSON
    key_ext     INTEGER,
    prev_hash   BLOB NOT NULL,
    hash        BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_session ON responses (session);

-- What the upstream reported it billed for one answer (its `usage`, read by `archive::usage`): one
-- row per answer that reported any figure, NULL where it reported that one not.
CREATE TABLE IF NOT EXISTS response_usage (
    exchange    INTEGER PRIMARY KEY REFERENCES exchanges (id),
    session     TEXT NOT NULL,
    prompt      INTEGER,               -- every prompt token, cached or not
    cached      INTEGER,               -- read from the upstream's prompt cache
    cache_write INTEGER,               -- written to it
    output      INTEGER
);
CREATE INDEX IF NOT EXISTS response_usage_session ON response_usage (session);

-- A session's compaction state after an exchange, stored when the exchange changed it (see `plan`).
CREATE TABLE IF NOT EXISTS plans (
    id           INTEGER PRIMARY KEY,
    exchange     INTEGER NOT NULL,      -- exchanges.id of the request that left this state
    session      TEXT NOT NULL,
    format       INTEGER NOT NULL,      -- layout of the packed columns (plan::FORMAT)
    epoch        INTEGER NOT NULL,
    advanced_at  INTEGER NOT NULL,      -- raw message count at the last eager advance
    saturated    INTEGER NOT NULL,
    raw_hashes   BLOB,                  -- NULL: no frozen prefix; else 16 bytes per raw message it covers
    prefix_blobs BLOB,                  -- per prefix message, 8 bytes: blobs.id, or -(i + 1): raw message i of the exchange
    prefix_seen  BLOB                   -- arrival time of each prefix message (ms), 8 bytes each; may be empty
);
CREATE INDEX IF NOT EXISTS plans_session ON plans (session, id);

-- What became of each raw message a plan's frozen prefix covers (`plan`): 8 bytes per message.
CREATE TABLE IF NOT EXISTS plan_items (
    exchange INTEGER PRIMARY KEY,      -- the plan's exchange (plans.exchange)
    session  TEXT NOT NULL,
    items    BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS plan_items_session ON plan_items (session);

-- Contents a forwarded marker names (`pare:` + hex of the SHA-256 of the text): each is the blob of
-- the same SHA-256, holding the text exactly as the agent sent it.
CREATE TABLE IF NOT EXISTS contents (
    sha256 BLOB PRIMARY KEY
) WITHOUT ROWID;

-- The sessions that stored a session key (`ArchiveReader::sessions_with_keys`).
CREATE INDEX IF NOT EXISTS exchanges_key_req ON exchanges (key_req) WHERE key_req IS NOT NULL;
CREATE INDEX IF NOT EXISTS responses_key_ext ON responses (key_ext) WHERE key_ext IS NOT NULL;
"#;

/// The PostgreSQL schema, in the order it was introduced: opening a database applies the versions
/// it lacks ([`migrate_postgres`]). The tables mirror SQLite's (integers as BIGINT, booleans as
/// 0/1 BIGINT, bytes as BYTEA, row ids as identities), so one SQL text serves both.
const PG_MIGRATIONS: &[&str] = &[
    r#"
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS blobs (
    id      BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    sha256  BYTEA NOT NULL UNIQUE,
    codec   BIGINT NOT NULL,
    raw_len BIGINT NOT NULL,
    data    BYTEA NOT NULL
);
CREATE TABLE IF NOT EXISTS session_blobs (
    session TEXT NOT NULL,
    blob    BIGINT NOT NULL,
    PRIMARY KEY (session, blob)
);
CREATE INDEX IF NOT EXISTS session_blobs_blob ON session_blobs (blob);
CREATE TABLE IF NOT EXISTS sessions (
    id               TEXT PRIMARY KEY,
    started_ms       BIGINT NOT NULL,
    last_ms          BIGINT NOT NULL,
    n_requests       BIGINT NOT NULL,
    n_records        BIGINT NOT NULL,
    head_hash        BYTEA NOT NULL,
    model            TEXT,
    tokens_raw       BIGINT NOT NULL DEFAULT 0,
    tokens_forwarded BIGINT NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS sessions_last ON sessions (last_ms);
CREATE TABLE IF NOT EXISTS exchanges (
    id           BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    session      TEXT NOT NULL,
    seq          BIGINT NOT NULL,
    chain_idx    BIGINT NOT NULL,
    at_ms        BIGINT NOT NULL,
    method       TEXT NOT NULL,
    path         TEXT NOT NULL,
    model        TEXT,
    headers      TEXT NOT NULL,
    raw_sha256   BYTEA NOT NULL,
    raw_len      BIGINT NOT NULL,
    raw_template BYTEA NOT NULL,
    fwd_sha256   BYTEA,
    fwd_len      BIGINT,
    fwd_template BYTEA,
    summary      TEXT,
    skipped      TEXT,
    key_req      BIGINT,
    prev_hash    BYTEA NOT NULL,
    hash         BYTEA NOT NULL,
    UNIQUE (session, seq)
);
CREATE INDEX IF NOT EXISTS exchanges_at ON exchanges (at_ms);
CREATE TABLE IF NOT EXISTS responses (
    exchange    BIGINT PRIMARY KEY REFERENCES exchanges (id),
    session     TEXT NOT NULL,
    chain_idx   BIGINT NOT NULL,
    at_ms       BIGINT NOT NULL,
    status      BIGINT,
    headers     TEXT NOT NULL,
    stream      BIGINT NOT NULL,
    partial     BIGINT NOT NULL,
    end_reason  TEXT NOT NULL,
    body_blob   BIGINT,
    body_sha256 BYTEA NOT NULL,
    body_len    BIGINT NOT NULL,
    assembled   TEXT,
    key_ext     BIGINT,
    prev_hash   BYTEA NOT NULL,
    hash        BYTEA NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_session ON responses (session);
CREATE TABLE IF NOT EXISTS response_usage (
    exchange    BIGINT PRIMARY KEY REFERENCES exchanges (id),
    session     TEXT NOT NULL,
    prompt      BIGINT,
    cached      BIGINT,
    cache_write BIGINT,
    output      BIGINT
);
CREATE INDEX IF NOT EXISTS response_usage_session ON response_usage (session);
CREATE TABLE IF NOT EXISTS plans (
    id           BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    exchange     BIGINT NOT NULL,
    session      TEXT NOT NULL,
    format       BIGINT NOT NULL,
    epoch        BIGINT NOT NULL,
    advanced_at  BIGINT NOT NULL,
    saturated    BIGINT NOT NULL,
    raw_hashes   BYTEA,
    prefix_blobs BYTEA,
    prefix_seen  BYTEA
);
CREATE INDEX IF NOT EXISTS plans_session ON plans (session, id);
CREATE TABLE IF NOT EXISTS contents (
    sha256 BYTEA PRIMARY KEY
);
CREATE INDEX IF NOT EXISTS exchanges_key_req ON exchanges (key_req) WHERE key_req IS NOT NULL;
CREATE INDEX IF NOT EXISTS responses_key_ext ON responses (key_ext) WHERE key_ext IS NOT NULL;
INSERT INTO meta (key, value) VALUES ('format', '1') ON CONFLICT DO NOTHING;
"#,
    r#"
CREATE TABLE IF NOT EXISTS plan_items (
    exchange BIGINT PRIMARY KEY,
    session  TEXT NOT NULL,
    items    BYTEA NOT NULL
);
CREATE INDEX IF NOT EXISTS plan_items_session ON plan_items (session);
"#,
];

/// The advisory lock key under which replicas migrate one database in turn.
const MIGRATION_LOCK: i64 = 0x7061_7265_0001;

/// Blobs shorter than this are stored as is; compression would not pay for its frame.
const COMPRESS_MIN_LEN: usize = 128;
const ZSTD_LEVEL: i32 = 3;

/// Open the store at `location` read-write, creating it (or its schema) when missing.
pub fn open_location_rw(location: &Location) -> Result<Db, ArchiveError> {
    match location {
        Location::Dir(dir) => open_rw(dir),
        Location::Postgres(pg) => {
            let db = Db::connect(pg).map_err(|e| ArchiveError::open(location, e))?;
            migrate_postgres(&db).map_err(|e| ArchiveError::open(location, e))?;
            // The row writers share-lock in each transaction (`retention`).
            db.execute(
                "INSERT INTO meta (key, value) VALUES (?1, '0') ON CONFLICT DO NOTHING",
                params![PRUNE_GENERATION],
            )
            .map_err(|e| ArchiveError::open(location, e))?;
            Ok(db)
        }
    }
}

/// Open the existing store at `location` for reading. PostgreSQL connections come from the
/// readers' pool. Fails with [`ArchiveError::NoStore`] when there is no store there yet.
pub fn open_location_ro(location: &Location) -> Result<Db, ArchiveError> {
    match location {
        Location::Dir(dir) => open_ro(dir),
        Location::Postgres(pg) => open_pg_ro(location, pg),
    }
}

fn open_pg_ro(location: &Location, pg: &PgLocation) -> Result<Db, ArchiveError> {
    let db = Db::open_pooled(pg).map_err(|e| ArchiveError::open(location, e))?;
    if !db.has_table("responses").map_err(|e| ArchiveError::open(location, e))? {
        return Err(ArchiveError::NoStore(location.to_string()));
    }
    Ok(db)
}

/// What connecting to an archive database at start-up found.
#[derive(Debug, PartialEq, Eq)]
pub enum Reachability {
    /// Connected (or a directory: nothing to reach).
    Ready,
    /// Not now (the server is not up, the network is down): pare starts and its writer waits.
    Unreachable(String),
    /// Never, as configured (authentication, an unknown database, TLS the server does not offer):
    /// pare refuses to start.
    Refused(String),
}

/// Connect once to the archive database at `location`, for `pare check` and `pare serve` to
/// refuse at start what would fail every write.
pub fn probe(location: &Location) -> Reachability {
    let Location::Postgres(pg) = location else { return Reachability::Ready };
    match Db::connect(pg).and_then(|db| db.query_one("SELECT 1", params![]).map(drop)) {
        Ok(()) => Reachability::Ready,
        Err(e) if e.is_permanent() => Reachability::Refused(e.to_string()),
        Err(e) => Reachability::Unreachable(e.to_string()),
    }
}

/// Bring a PostgreSQL archive's schema up to date: apply, in one transaction, the versions of
/// `PG_MIGRATIONS` it lacks, and record the version in `meta`. Replicas that start together
/// take turns (a transaction-scoped advisory lock): the first migrates, the others find it done.
pub fn migrate_postgres(db: &Db) -> Result<(), super::db::DbError> {
    db.execute_batch("BEGIN")?;
    let result = (|| {
        db.query_one("SELECT pg_advisory_xact_lock(?1)", params![MIGRATION_LOCK])?;
        let version: i64 = match db.has_table("meta")? {
            false => 0,
            true => db
                .query_opt("SELECT value FROM meta WHERE key = 'schema_version'", params![])?
                .map(|row| row.get::<String>(0))
                .transpose()?
                .and_then(|v| v.parse().ok())
                .unwrap_or(0),
        };
        for (idx, migration) in PG_MIGRATIONS.iter().enumerate() {
            if (idx as i64) < version {
                continue;
            }
            db.execute_batch(migration)?;
        }
        db.execute(
            "INSERT INTO meta (key, value) VALUES ('schema_version', ?1)
             ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            params![&PG_MIGRATIONS.len().to_string()],
        )?;
        Ok(())
    })();
    match result {
        Ok(()) => db.commit(),
        Err(e) => {
            let _ = db.rollback();
            Err(e)
        }
    }
}

/// The schema version a PostgreSQL archive is at (0: none).
pub fn postgres_schema_version(db: &Db) -> Result<i64, super::db::DbError> {
    Ok(db
        .query_opt("SELECT value FROM meta WHERE key = 'schema_version'", params![])?
        .map(|row| row.get::<String>(0))
        .transpose()?
        .and_then(|v| v.parse().ok())
        .unwrap_or(0))
}

/// The number of PostgreSQL schema versions this pare knows.
pub const PG_SCHEMA_VERSION: i64 = PG_MIGRATIONS.len() as i64;

/// Create the archive directory (0700) if needed and open the SQLite store read-write (file 0600).
pub fn open_rw(dir: &Path) -> Result<Db, ArchiveError> {
    create_private_dir(dir)?;
    let path = dir.join(DB_FILE);
    create_private_file(&path)?;
    let conn = Connection::open_with_flags(
        &path,
        OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_CREATE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(|e| ArchiveError::open_file(&path, e))?;
    restrict_file(&path)?;
    conn.busy_timeout(std::time::Duration::from_secs(5)).map_err(|e| ArchiveError::open_file(&path, e))?;
    conn.pragma_update(None, "journal_mode", "WAL").map_err(|e| ArchiveError::open_file(&path, e))?;
    conn.pragma_update(None, "synchronous", "NORMAL").map_err(|e| ArchiveError::open_file(&path, e))?;
    conn.pragma_update(None, "foreign_keys", "ON").map_err(|e| ArchiveError::open_file(&path, e))?;
    conn.execute_batch(SCHEMA).map_err(|e| ArchiveError::open_file(&path, e))?;
    conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('format', '1')", [])
        .map_err(|e| ArchiveError::open_file(&path, e))?;
    conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES (?1, '0')", [PRUNE_GENERATION])
        .map_err(|e| ArchiveError::open_file(&path, e))?;
    for suffix in ["-wal", "-shm"] {
        let side = PathBuf::from(format!("{}{suffix}", path.display()));
        if side.exists() {
            restrict_file(&side)?;
        }
    }
    Ok(Db::sqlite(conn))
}

/// Open an existing SQLite store for reading (the CLI). Fails with [`ArchiveError::NoStore`] when
/// there is no store in `dir`, or only a file whose schema a starting writer has not written yet.
pub fn open_ro(dir: &Path) -> Result<Db, ArchiveError> {
    let path = dir.join(DB_FILE);
    if !path.exists() {
        return Err(ArchiveError::NoStore(path.display().to_string()));
    }
    let conn = Connection::open_with_flags(&path, OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX)
        .map_err(|e| ArchiveError::open_file(&path, e))?;
    conn.busy_timeout(std::time::Duration::from_secs(5)).map_err(|e| ArchiveError::open_file(&path, e))?;
    // The writer creates the tables in order: `responses` there means every chained table is; the
    // tables after it (usage, plans, contents) may be missing from an older archive.
    let has_schema: bool = conn
        .query_row("SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'responses')", [], |r| {
            r.get(0)
        })
        .map_err(|e| ArchiveError::open_file(&path, e))?;
    if !has_schema {
        return Err(ArchiveError::NoStore(path.display().to_string()));
    }
    Ok(Db::sqlite(conn))
}

/// Create the archive directory 0700; an existing one that others may read or enter is closed to
/// them (0700, said in the log): the store holds every prompt and what the tools returned. When
/// that cannot be done (a directory pare does not own), the log says so and the store is still
/// used, its files 0600.
fn create_private_dir(dir: &Path) -> Result<(), ArchiveError> {
    if dir.is_dir() {
        restrict_dir(dir);
        return Ok(());
    }
    let mut builder = std::fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::DirBuilderExt;
        builder.mode(0o700);
    }
    builder.create(dir).map_err(|e| ArchiveError::Io { path: dir.to_owned(), source: e })
}

/// Take group and other permissions off an existing archive directory.
fn restrict_dir(dir: &Path) {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let Ok(meta) = std::fs::metadata(dir) else { return };
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 == 0 {
            return;
        }
        match std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode & 0o700)) {
            Ok(()) => {
                tracing::warn!(archive = %dir.display(), was = %format!("{mode:o}"), now = %format!("{:o}", mode & 0o700),
                "the archive directory was open to other users; restricted to its owner")
            }
            Err(err) => tracing::warn!(archive = %dir.display(), mode = %format!("{mode:o}"), error = %err,
                "the archive directory is open to other users and cannot be restricted; its files stay private (0600)"),
        }
    }
}

/// Create the database file 0600 before SQLite opens it: SQLite gives the `-wal` and `-shm` files the
/// main file's permissions, so no file of the store is ever readable by others, not even briefly.
fn create_private_file(path: &Path) -> Result<(), ArchiveError> {
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(false);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    options.open(path).map(drop).map_err(|e| ArchiveError::Io { path: path.to_owned(), source: e })
}

fn restrict_file(path: &Path) -> Result<(), ArchiveError> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let meta = std::fs::metadata(path).map_err(|e| ArchiveError::Io { path: path.to_owned(), source: e })?;
        if meta.permissions().mode() & 0o077 != 0 {
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
                .map_err(|e| ArchiveError::Io { path: path.to_owned(), source: e })?;
        }
    }
    Ok(())
}

/// Lowercase hexadecimal of `bytes` (hashes in reports and logs).
pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes.iter().fold(String::with_capacity(bytes.len() * 2), |mut out, b| {
        let _ = write!(out, "{b:02x}");
        out
    })
}

pub fn sha256(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// Insert a blob unless one with the same content exists; returns its id.
pub fn put_blob(db: &Db, hash: &[u8; 32], content: &[u8]) -> Result<i64, super::db::DbError> {
    if let Some(row) = db.query_opt("SELECT id FROM blobs WHERE sha256 = ?1", params![hash])? {
        return row.get(0);
    }
    let (codec, data) = encode_blob(content);
    db.insert_id(
        "INSERT INTO blobs (sha256, codec, raw_len, data) VALUES (?1, ?2, ?3, ?4)",
        params![hash, codec, content.len() as i64, &data],
    )
}

/// [`put_blob`], and link the blob to `session` (`session_blobs`). On PostgreSQL a new blob is
/// inserted and linked in one statement, so storing one costs two round trips (the lookup by hash,
/// then that statement), and a blob the database holds is never sent again.
pub fn put_blob_linked(db: &Db, hash: &[u8; 32], content: &[u8], session: &str) -> Result<i64, super::db::DbError> {
    if let Some(row) = db.query_opt("SELECT id FROM blobs WHERE sha256 = ?1", params![hash])? {
        let id = row.get(0)?;
        db.execute("INSERT OR IGNORE INTO session_blobs (session, blob) VALUES (?1, ?2)", params![session, id])?;
        return Ok(id);
    }
    let (codec, data) = encode_blob(content);
    match db.dialect() {
        super::db::Dialect::Sqlite => {
            let id = db.insert_id(
                "INSERT INTO blobs (sha256, codec, raw_len, data) VALUES (?1, ?2, ?3, ?4)",
                params![hash, codec, content.len() as i64, &data],
            )?;
            db.execute("INSERT OR IGNORE INTO session_blobs (session, blob) VALUES (?1, ?2)", params![session, id])?;
            Ok(id)
        }
        super::db::Dialect::Postgres => db
            .query_one(
                "WITH blob AS (INSERT INTO blobs (sha256, codec, raw_len, data) VALUES (?1, ?2, ?3, ?4) RETURNING id),
                      link AS (INSERT INTO session_blobs (session, blob) SELECT CAST(?5 AS TEXT), id FROM blob)
                 SELECT id FROM blob",
                params![hash, codec, content.len() as i64, &data, session],
            )?
            .get(0),
    }
}

/// Insert a blob exactly as stored elsewhere (`pare archive copy`), unless one with the same hash
/// exists; returns its id.
pub fn put_stored_blob(db: &Db, blob: &StoredBlob) -> Result<i64, super::db::DbError> {
    if let Some(row) = db.query_opt("SELECT id FROM blobs WHERE sha256 = ?1", params![&blob.sha256])? {
        return row.get(0);
    }
    db.insert_id(
        "INSERT INTO blobs (sha256, codec, raw_len, data) VALUES (?1, ?2, ?3, ?4)",
        params![&blob.sha256, blob.codec, blob.raw_len, &blob.data],
    )
}

fn encode_blob(content: &[u8]) -> (i64, Vec<u8>) {
    thread_local! {
        /// One compression context per thread (the writer's), reused: making one allocates and
        /// zeroes its tables, which cost more than compressing a typical message.
        static COMPRESSOR: std::cell::RefCell<Option<zstd::bulk::Compressor<'static>>> =
            const { std::cell::RefCell::new(None) };
    }
    if content.len() >= COMPRESS_MIN_LEN {
        let compressed = COMPRESSOR.with_borrow_mut(|compressor| {
            if compressor.is_none() {
                *compressor = zstd::bulk::Compressor::new(ZSTD_LEVEL).ok();
            }
            compressor.as_mut()?.compress(content).ok()
        });
        if let Some(compressed) = compressed
            && compressed.len() + compressed.len() / 8 < content.len()
        {
            return (1, compressed);
        }
    }
    (0, content.to_vec())
}

/// A blob as stored, before decompression.
pub struct StoredBlob {
    pub sha256: Vec<u8>,
    pub codec: i64,
    pub raw_len: i64,
    pub data: Vec<u8>,
}

pub fn get_blob(db: &Db, id: i64) -> Result<StoredBlob, ArchiveError> {
    let row = db
        .query_opt("SELECT sha256, codec, raw_len, data FROM blobs WHERE id = ?1", params![id])?
        .ok_or(ArchiveError::MissingBlob(id))?;
    Ok(StoredBlob { sha256: row.get(0)?, codec: row.get(1)?, raw_len: row.get(2)?, data: row.get(3)? })
}

/// Decompress a stored blob. Checks the length, not the hash (see `verify`).
pub fn decode_blob(id: i64, blob: &StoredBlob) -> Result<Vec<u8>, ArchiveError> {
    let out = match blob.codec {
        0 => blob.data.clone(),
        1 => zstd::bulk::decompress(&blob.data, blob.raw_len.max(0) as usize)
            .map_err(|e| ArchiveError::CorruptBlob { id, why: format!("zstd: {e}") })?,
        other => {
            return Err(ArchiveError::CorruptBlob { id, why: format!("unknown codec {other}") });
        }
    };
    if out.len() as i64 != blob.raw_len {
        return Err(ArchiveError::CorruptBlob { id, why: format!("length {} instead of {}", out.len(), blob.raw_len) });
    }
    Ok(out)
}

/// Read and decompress a blob.
pub fn read_blob(conn: &Db, id: i64) -> Result<Vec<u8>, ArchiveError> {
    let stored = get_blob(conn, id)?;
    decode_blob(id, &stored)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blobs_dedup_and_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let conn = open_rw(dir.path()).unwrap();
        let big = "tool output line\n".repeat(200);
        let a = put_blob(&conn, &sha256(big.as_bytes()), big.as_bytes()).unwrap();
        let b = put_blob(&conn, &sha256(big.as_bytes()), big.as_bytes()).unwrap();
        assert_eq!(a, b);
        let small = put_blob(&conn, &sha256(b"x"), b"x").unwrap();
        assert_ne!(a, small);
        assert_eq!(read_blob(&conn, a).unwrap(), big.as_bytes());
        assert_eq!(read_blob(&conn, small).unwrap(), b"x");
        let codec: i64 = conn.query_one("SELECT codec FROM blobs WHERE id = ?1", params![a]).unwrap().get(0).unwrap();
        assert_eq!(codec, 1, "a repetitive blob is compressed");
    }

    /// The writer's reused compression context writes the bytes a fresh one writes, whatever it
    /// compressed before.
    #[test]
    fn a_reused_compressor_gives_the_one_shot_bytes() {
        let texts: Vec<String> =
            (0..20).map(|i| format!("line {i} of some tool output\n").repeat(10 + i * 37)).collect();
        for text in texts.iter().chain(texts.iter().rev()) {
            let (codec, data) = encode_blob(text.as_bytes());
            assert_eq!(codec, 1);
            assert_eq!(data, zstd::bulk::compress(text.as_bytes(), ZSTD_LEVEL).unwrap());
        }
    }

    #[cfg(unix)]
    #[test]
    fn store_is_private() {
        use std::os::unix::fs::PermissionsExt;
        let parent = tempfile::tempdir().unwrap();
        let dir = parent.path().join("nested/pare");
        drop(open_rw(&dir).unwrap());
        assert_eq!(std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777, 0o700);
        let file = std::fs::metadata(dir.join(DB_FILE)).unwrap();
        assert_eq!(file.permissions().mode() & 0o777, 0o600);
    }

    /// Regression: an existing archive directory kept whatever permissions it had (0755: every user
    /// of the host could list and read the store's directory).
    #[cfg(unix)]
    #[test]
    fn an_existing_open_directory_is_restricted_to_its_owner() {
        use std::os::unix::fs::PermissionsExt;
        let parent = tempfile::tempdir().unwrap();
        let dir = parent.path().join("pare");
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        drop(open_rw(&dir).unwrap());
        assert_eq!(std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777, 0o700);
    }
}
