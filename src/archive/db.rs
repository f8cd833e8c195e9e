//! One connection over either archive backend: SQLite (the embedded default) or PostgreSQL
//! (`archive.url`). Every archive query is written once, in SQLite's spelling with `?N`
//! placeholders; this layer is where the two dialects differ: placeholders become `$N`,
//! `INSERT OR IGNORE` becomes `ON CONFLICT DO NOTHING`, `instr` becomes `strpos`, and a new row's
//! id is read back with `RETURNING id` instead of `last_insert_rowid()`.
//!
//! Parameters are typed ([`Param`]: integer, text, bytes, null) and rows are read into owned
//! [`Value`]s, so a caller reads a column the same way on both backends ([`Row::get`]). Booleans
//! are stored as integers on both (0/1), so one SQL text compares them the same way.
//!
//! A PostgreSQL connection prepares each statement once and keeps it; the readers' connections
//! come from a per-URL pool ([`Db::open_pooled`]) so a lookup on the proxy's path does not pay for
//! a connection (a few milliseconds). The pool is bounded (`archive.max_connections`: at most that
//! many readers' connections are open at once, and a reader waits up to [`POOL_WAIT`] for one), so
//! a burst of readers never exhausts the server's `max_connections`. A pooled connection found
//! broken (the server restarted, the network dropped it) is closed, the pool's idle connections
//! with it, and the statement is run once more on a new connection, outside a transaction only.
//! The client is the blocking `postgres` crate: it must never be called on an async task (it runs
//! its own runtime), only on a thread of its own or the blocking pool.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::config::location::PgLocation;

/// Which SQL dialect a connection speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    Sqlite,
    Postgres,
}

/// A failure of the database layer.
#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("{0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("{}", pg_message(.0))]
    Postgres(#[from] postgres::Error),
    #[error("column {column} holds {found}, expected {expected}")]
    Type { column: usize, expected: &'static str, found: &'static str },
    #[error("the query returned no row")]
    NoRow,
    #[error("all {max} connections to the archive database stayed busy for {waited:?} (archive.max_connections)")]
    PoolBusy { max: usize, waited: Duration },
}

/// A PostgreSQL error with its server message and detail (the client's own `Display` says only
/// "db error" for those).
fn pg_message(e: &postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => match db.detail() {
            Some(detail) => format!("{}: {} ({detail})", db.severity(), db.message()),
            None => format!("{}: {}", db.severity(), db.message()),
        },
        None => {
            use std::error::Error;
            match e.source() {
                Some(source) => format!("{e}: {source}"),
                None => e.to_string(),
            }
        }
    }
}

impl DbError {
    /// Whether retrying the transaction may succeed: a serialization failure, a deadlock, or a
    /// unique violation (two writers raced to the same new row).
    pub fn is_conflict(&self) -> bool {
        match self {
            DbError::Postgres(e) => e.code().is_some_and(|code| {
                *code == postgres::error::SqlState::T_R_SERIALIZATION_FAILURE
                    || *code == postgres::error::SqlState::T_R_DEADLOCK_DETECTED
                    || *code == postgres::error::SqlState::UNIQUE_VIOLATION
            }),
            DbError::Sqlite(rusqlite::Error::SqliteFailure(e, _)) => {
                matches!(e.code, rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked)
                    || e.extended_code == rusqlite::ffi::SQLITE_CONSTRAINT_UNIQUE
            }
            _ => false,
        }
    }

    /// Whether connecting failed for a reason that waiting will not fix: authentication (SQLSTATE
    /// class 28: a wrong password, no `pg_hba.conf` entry), an unknown database (3D000), no right
    /// to connect (42501), a TLS handshake that failed (`sslmode=require` against a server
    /// without TLS, a certificate that does not verify), or settings the client or server refuses
    /// (a password the server asks for and none was given).
    pub fn is_permanent(&self) -> bool {
        let DbError::Postgres(e) = self else { return false };
        if let Some(code) = e.code() {
            let code = code.code();
            return code.starts_with("28") || code == "3D000" || code == "42501";
        }
        // The client's error kinds are not public; their `Display` opens with the kind.
        let text = e.to_string();
        ["error performing TLS handshake", "invalid configuration", "authentication error", "invalid connection string"]
            .iter()
            .any(|kind| text.starts_with(kind))
    }

    /// Whether the connection itself is gone (the server stopped or is shutting down, the network
    /// dropped): the writer then reconnects before it retries.
    pub fn is_connection_lost(&self) -> bool {
        match self {
            DbError::Postgres(e) => {
                e.is_closed()
                    || match e.code() {
                        // Connection exceptions (08…) and operator intervention (57P01 admin
                        // shutdown, 57P02 crash shutdown, 57P03 cannot connect now).
                        Some(code) => code.code().starts_with("08") || code.code().starts_with("57P"),
                        None => e.as_db_error().is_none(),
                    }
            }
            _ => false,
        }
    }
}

/// `text` as the archive stores it on either backend: PostgreSQL's text types refuse U+0000, so
/// each becomes U+FFFD (Unicode's replacement character, its mark for a character that could not
/// be kept). The text columns (model, method, path, why compaction was skipped, how an answer
/// ended) are an index over the bodies, which are stored byte for byte as blobs.
pub fn storable(text: &str) -> std::borrow::Cow<'_, str> {
    if text.contains('\0') { text.replace('\0', "\u{FFFD}").into() } else { text.into() }
}

/// JSON text as the archive stores it: a string holding U+0000 is written `\u0000`, which
/// PostgreSQL's `jsonb` refuses (the readers cast JSON columns to it), so such strings, keys
/// included, hold U+FFFD instead ([`storable`]).
pub fn storable_json(json: String) -> String {
    fn replace(value: &mut serde_json::Value) {
        match value {
            serde_json::Value::String(s) => {
                if let std::borrow::Cow::Owned(clean) = storable(s) {
                    *s = clean;
                }
            }
            serde_json::Value::Array(items) => items.iter_mut().for_each(replace),
            serde_json::Value::Object(map) => {
                *map = std::mem::take(map)
                    .into_iter()
                    .map(|(key, mut value)| {
                        replace(&mut value);
                        (storable(&key).into_owned(), value)
                    })
                    .collect();
            }
            _ => {}
        }
    }
    if !json.contains("\\u0000") {
        return json;
    }
    match serde_json::from_str::<serde_json::Value>(&json) {
        Ok(mut value) => {
            replace(&mut value);
            value.to_string()
        }
        Err(_) => json,
    }
}

/// One query parameter.
#[derive(Debug, Clone, Copy)]
pub enum Param<'a> {
    Null,
    Int(i64),
    Text(&'a str),
    Bytes(&'a [u8]),
}

impl From<i64> for Param<'_> {
    fn from(n: i64) -> Self {
        Param::Int(n)
    }
}

impl From<bool> for Param<'_> {
    fn from(b: bool) -> Self {
        Param::Int(i64::from(b))
    }
}

impl<'a> From<&'a str> for Param<'a> {
    fn from(s: &'a str) -> Self {
        Param::Text(s)
    }
}

impl<'a> From<&'a String> for Param<'a> {
    fn from(s: &'a String) -> Self {
        Param::Text(s)
    }
}

impl<'a> From<&'a [u8]> for Param<'a> {
    fn from(b: &'a [u8]) -> Self {
        Param::Bytes(b)
    }
}

impl<'a> From<&'a Vec<u8>> for Param<'a> {
    fn from(b: &'a Vec<u8>) -> Self {
        Param::Bytes(b)
    }
}

impl<'a> From<&'a [u8; 32]> for Param<'a> {
    fn from(b: &'a [u8; 32]) -> Self {
        Param::Bytes(b)
    }
}

impl<'a, T: Into<Param<'a>>> From<Option<T>> for Param<'a> {
    fn from(value: Option<T>) -> Self {
        value.map_or(Param::Null, Into::into)
    }
}

impl<'a, T: Copy + Into<Param<'a>>> From<&Option<T>> for Param<'a> {
    fn from(value: &Option<T>) -> Self {
        value.map_or(Param::Null, Into::into)
    }
}

/// `params![a, b]`: query parameters, each converted with [`Param::from`].
macro_rules! params {
    ($($p:expr),* $(,)?) => {
        &[$($crate::archive::db::Param::from($p)),*] as &[$crate::archive::db::Param<'_>]
    };
}
pub(crate) use params;

impl rusqlite::ToSql for Param<'_> {
    fn to_sql(&self) -> rusqlite::Result<rusqlite::types::ToSqlOutput<'_>> {
        use rusqlite::types::{ToSqlOutput, ValueRef};
        Ok(ToSqlOutput::Borrowed(match self {
            Param::Null => ValueRef::Null,
            Param::Int(n) => ValueRef::Integer(*n),
            Param::Text(s) => ValueRef::Text(s.as_bytes()),
            Param::Bytes(b) => ValueRef::Blob(b),
        }))
    }
}

impl postgres::types::ToSql for Param<'_> {
    fn to_sql(
        &self,
        ty: &postgres::types::Type,
        out: &mut bytes::BytesMut,
    ) -> Result<postgres::types::IsNull, Box<dyn std::error::Error + Sync + Send>> {
        use postgres::types::{IsNull, Type};
        match self {
            Param::Null => Ok(IsNull::Yes),
            Param::Int(n) => match *ty {
                Type::INT4 => i32::try_from(*n)?.to_sql(ty, out),
                Type::INT2 => i16::try_from(*n)?.to_sql(ty, out),
                Type::BOOL => (*n != 0).to_sql(ty, out),
                Type::TEXT | Type::VARCHAR => n.to_string().as_str().to_sql(ty, out),
                _ => n.to_sql(ty, out),
            },
            Param::Text(s) => s.to_sql(ty, out),
            Param::Bytes(b) => b.to_sql(ty, out),
        }
    }

    fn accepts(_: &postgres::types::Type) -> bool {
        true
    }

    postgres::types::to_sql_checked!();
}

/// One column value, owned.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Null,
    Int(i64),
    Real(f64),
    Text(String),
    Bytes(Vec<u8>),
}

impl Value {
    fn kind(&self) -> &'static str {
        match self {
            Value::Null => "null",
            Value::Int(_) => "an integer",
            Value::Real(_) => "a real",
            Value::Text(_) => "text",
            Value::Bytes(_) => "bytes",
        }
    }
}

/// A type a column reads as.
pub trait FromValue: Sized {
    const EXPECTED: &'static str;
    fn from_value(value: &Value) -> Option<Self>;
}

impl FromValue for i64 {
    const EXPECTED: &'static str = "an integer";
    fn from_value(value: &Value) -> Option<i64> {
        match value {
            Value::Int(n) => Some(*n),
            _ => None,
        }
    }
}

impl FromValue for bool {
    const EXPECTED: &'static str = "a boolean";
    fn from_value(value: &Value) -> Option<bool> {
        match value {
            Value::Int(n) => Some(*n != 0),
            _ => None,
        }
    }
}

impl FromValue for String {
    const EXPECTED: &'static str = "text";
    fn from_value(value: &Value) -> Option<String> {
        match value {
            Value::Text(s) => Some(s.clone()),
            _ => None,
        }
    }
}

impl FromValue for Vec<u8> {
    const EXPECTED: &'static str = "bytes";
    fn from_value(value: &Value) -> Option<Vec<u8>> {
        match value {
            Value::Bytes(b) => Some(b.clone()),
            // SQLite hands back what was stored; an empty blob may read as text.
            Value::Text(s) => Some(s.as_bytes().to_vec()),
            _ => None,
        }
    }
}

impl<T: FromValue> FromValue for Option<T> {
    const EXPECTED: &'static str = T::EXPECTED;
    fn from_value(value: &Value) -> Option<Option<T>> {
        match value {
            Value::Null => Some(None),
            other => T::from_value(other).map(Some),
        }
    }
}

/// One result row.
#[derive(Debug, Clone, PartialEq)]
pub struct Row(pub Vec<Value>);

impl Row {
    /// Column `idx` as `T`.
    pub fn get<T: FromValue>(&self, idx: usize) -> Result<T, DbError> {
        let value = self.0.get(idx).unwrap_or(&Value::Null);
        T::from_value(value).ok_or(DbError::Type { column: idx, expected: T::EXPECTED, found: value.kind() })
    }

    /// The values, to write into another store as they are.
    pub fn values(&self) -> &[Value] {
        &self.0
    }
}

impl<'a> From<&'a Value> for Param<'a> {
    fn from(value: &'a Value) -> Param<'a> {
        match value {
            Value::Null => Param::Null,
            Value::Int(n) => Param::Int(*n),
            Value::Real(r) => Param::Int(*r as i64),
            Value::Text(s) => Param::Text(s),
            Value::Bytes(b) => Param::Bytes(b),
        }
    }
}

/// A PostgreSQL client with the statements it prepared.
pub(crate) struct PgConn {
    client: postgres::Client,
    statements: HashMap<String, postgres::Statement>,
}

impl PgConn {
    fn statement(&mut self, sql: &str) -> Result<postgres::Statement, DbError> {
        if let Some(statement) = self.statements.get(sql) {
            return Ok(statement.clone());
        }
        let statement = self.client.prepare(&translate(sql))?;
        self.statements.insert(sql.to_owned(), statement.clone());
        Ok(statement)
    }
}

/// Longest a reader waits for one of the pool's connections when all are busy.
pub const POOL_WAIT: Duration = Duration::from_secs(10);

/// The readers' connections to one PostgreSQL archive: at most `max` open at once (in use or
/// idle), the idle ones kept for the next reader.
struct Pool {
    location: PgLocation,
    state: Mutex<PoolState>,
    /// Signalled when a connection goes back idle or is closed (a slot frees).
    freed: Condvar,
}

struct PoolState {
    idle: Vec<PgConn>,
    /// Connections open: idle plus in use.
    open: usize,
    max: usize,
}

impl Pool {
    fn state(&self) -> std::sync::MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// An idle connection, else a new one when the bound allows, else the first to free within
    /// [`POOL_WAIT`].
    fn take(&self) -> Result<PgConn, DbError> {
        let started = Instant::now();
        let mut state = self.state();
        loop {
            if let Some(conn) = state.idle.pop() {
                if conn.client.is_closed() {
                    state.open -= 1;
                    continue;
                }
                return Ok(conn);
            }
            if state.open < state.max {
                state.open += 1;
                drop(state);
                return self.connect_in_slot();
            }
            let waited = started.elapsed();
            if waited >= POOL_WAIT {
                return Err(DbError::PoolBusy { max: state.max, waited });
            }
            state = self.freed.wait_timeout(state, POOL_WAIT - waited).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    /// A new connection, not counted (for a slot already counted as open).
    fn fresh(&self) -> Result<PgConn, DbError> {
        Ok(PgConn { client: self.location.connect()?, statements: HashMap::new() })
    }

    /// A new connection in a slot already counted as open; the slot is given back when it fails.
    fn connect_in_slot(&self) -> Result<PgConn, DbError> {
        self.fresh().inspect_err(|_| self.release_slot())
    }

    fn release_slot(&self) {
        self.state().open -= 1;
        self.freed.notify_one();
    }

    /// Take back a connection a reader is done with: kept idle when it can serve another.
    fn give_back(&self, conn: PgConn, reusable: bool) {
        let mut state = self.state();
        if reusable && !conn.client.is_closed() {
            state.idle.push(conn);
        } else {
            state.open -= 1;
        }
        drop(state);
        self.freed.notify_one();
    }

    /// Close the idle connections: one was found broken, the others most likely are too (the
    /// server restarted).
    fn drop_idle(&self) {
        let mut state = self.state();
        let idle = std::mem::take(&mut state.idle);
        state.open -= idle.len();
        drop(state);
        self.freed.notify_all();
        // Closed outside the lock: closing says goodbye to the server.
        drop(idle);
    }
}

fn pool_of(location: &PgLocation) -> Arc<Pool> {
    static POOLS: OnceLock<Mutex<HashMap<String, Arc<Pool>>>> = OnceLock::new();
    let pools = POOLS.get_or_init(Default::default);
    let mut pools = pools.lock().unwrap_or_else(|p| p.into_inner());
    let pool = Arc::clone(pools.entry(location.key().to_owned()).or_insert_with(|| {
        Arc::new(Pool {
            location: location.clone(),
            state: Mutex::new(PoolState { idle: Vec::new(), open: 0, max: location.max_connections() }),
            freed: Condvar::new(),
        })
    }));
    // The bound in force is the last one configured for this URL.
    pool.state().max = location.max_connections();
    pool
}

enum Inner {
    Sqlite(rusqlite::Connection),
    Postgres {
        conn: RefCell<Option<Box<PgConn>>>,
        pool: Option<Arc<Pool>>,
        /// Between `begin` and `commit`/`rollback`: a statement that fails there is not run again
        /// on another connection, and the connection is not given back to the pool.
        in_transaction: Cell<bool>,
    },
}

/// A connection to an archive store.
pub struct Db {
    inner: Inner,
    /// Statements sent so far ([`Db::statements`]).
    sent: Cell<u64>,
}

impl Drop for Db {
    fn drop(&mut self) {
        if let Inner::Postgres { conn, pool: Some(pool), in_transaction } = &mut self.inner {
            match conn.get_mut().take() {
                Some(conn) => pool.give_back(*conn, !in_transaction.get()),
                None => pool.release_slot(),
            }
        }
    }
}

impl Db {
    pub fn sqlite(conn: rusqlite::Connection) -> Db {
        conn.set_prepared_statement_cache_capacity(64);
        Db { inner: Inner::Sqlite(conn), sent: Cell::new(0) }
    }

    /// A connection of its own to the PostgreSQL archive at `location` (the writer's).
    pub fn connect(location: &PgLocation) -> Result<Db, DbError> {
        let client = location.connect()?;
        Ok(Db {
            inner: Inner::Postgres {
                conn: RefCell::new(Some(Box::new(PgConn { client, statements: HashMap::new() }))),
                pool: None,
                in_transaction: Cell::new(false),
            },
            sent: Cell::new(0),
        })
    }

    /// A connection from the pool of `location`'s readers, given back when dropped. Waits for one
    /// while `archive.max_connections` are in use, at most [`POOL_WAIT`].
    pub fn open_pooled(location: &PgLocation) -> Result<Db, DbError> {
        let pool = pool_of(location);
        let conn = pool.take()?;
        Ok(Db {
            inner: Inner::Postgres {
                conn: RefCell::new(Some(Box::new(conn))),
                pool: Some(pool),
                in_transaction: Cell::new(false),
            },
            sent: Cell::new(0),
        })
    }

    pub fn dialect(&self) -> Dialect {
        match self.inner {
            Inner::Sqlite(_) => Dialect::Sqlite,
            Inner::Postgres { .. } => Dialect::Postgres,
        }
    }

    /// The SQLite connection, for what only SQLite has (pragmas).
    pub fn as_sqlite(&self) -> Option<&rusqlite::Connection> {
        match &self.inner {
            Inner::Sqlite(conn) => Some(conn),
            Inner::Postgres { .. } => None,
        }
    }

    /// Run `f` on the PostgreSQL connection. A pooled connection found broken outside a
    /// transaction is replaced (the pool's idle ones closed with it) and `f` runs once more.
    fn with_pg<T>(&self, f: impl Fn(&mut PgConn) -> Result<T, DbError>) -> Result<T, DbError> {
        let Inner::Postgres { conn, pool, in_transaction } = &self.inner else { unreachable!("with_pg on SQLite") };
        let mut conn = conn.borrow_mut();
        let Some(pool) = pool else { return f(conn.as_mut().expect("the writer's connection is present")) };
        if conn.is_none() {
            // Replacing a broken connection failed earlier: this slot has none yet.
            *conn = Some(Box::new(pool.fresh()?));
        }
        let result = f(conn.as_mut().expect("set above"));
        match result {
            Err(e) if e.is_connection_lost() && !in_transaction.get() => {
                tracing::debug!(archive = %pool.location.shown(), error = %e, "a pooled archive connection is broken; reconnecting");
                // The slot stays counted as open while the broken connection is replaced; when
                // the new one cannot be made, the slot is given back as this `Db` drops.
                *conn = None;
                pool.drop_idle();
                let fresh = conn.insert(Box::new(pool.fresh()?));
                f(fresh)
            }
            other => other,
        }
    }

    /// Requests sent to the database on this connection so far: one per statement with
    /// parameters, one per batch of statements without ([`Db::execute_batch`], [`Db::begin_then`]).
    /// On PostgreSQL each is a round trip.
    pub fn statements(&self) -> u64 {
        self.sent.get()
    }

    fn count(&self) {
        self.sent.set(self.sent.get() + 1);
    }

    /// Run statements without parameters, separated by `;` (schema, transactions).
    pub fn execute_batch(&self, sql: &str) -> Result<(), DbError> {
        self.count();
        match &self.inner {
            Inner::Sqlite(conn) => Ok(conn.execute_batch(sql)?),
            Inner::Postgres { .. } => self.with_pg(|pg| Ok(pg.client.batch_execute(sql)?)),
        }
    }

    /// Run one statement; returns the number of rows it changed.
    pub fn execute(&self, sql: &str, params: &[Param<'_>]) -> Result<usize, DbError> {
        self.count();
        match &self.inner {
            Inner::Sqlite(conn) => Ok(conn.prepare_cached(sql)?.execute(rusqlite::params_from_iter(params.iter()))?),
            Inner::Postgres { .. } => self.with_pg(|pg| {
                let statement = pg.statement(sql)?;
                let args: Vec<&(dyn postgres::types::ToSql + Sync)> =
                    params.iter().map(|p| p as &(dyn postgres::types::ToSql + Sync)).collect();
                Ok(pg.client.execute(&statement, &args)? as usize)
            }),
        }
    }

    /// Insert one row into a table with an `id` key; returns that id.
    pub fn insert_id(&self, sql: &str, params: &[Param<'_>]) -> Result<i64, DbError> {
        match &self.inner {
            Inner::Sqlite(conn) => {
                self.count();
                conn.prepare_cached(sql)?.execute(rusqlite::params_from_iter(params.iter()))?;
                Ok(conn.last_insert_rowid())
            }
            Inner::Postgres { .. } => self.query_one(&format!("{sql} RETURNING id"), params)?.get(0),
        }
    }

    /// Every row of a query.
    pub fn query_all(&self, sql: &str, params: &[Param<'_>]) -> Result<Vec<Row>, DbError> {
        self.count();
        match &self.inner {
            Inner::Sqlite(conn) => {
                let mut statement = conn.prepare_cached(sql)?;
                let n = statement.column_count();
                let mut rows = statement.query(rusqlite::params_from_iter(params.iter()))?;
                let mut out = Vec::new();
                while let Some(row) = rows.next()? {
                    let mut values = Vec::with_capacity(n);
                    for idx in 0..n {
                        use rusqlite::types::ValueRef;
                        values.push(match row.get_ref(idx)? {
                            ValueRef::Null => Value::Null,
                            ValueRef::Integer(n) => Value::Int(n),
                            ValueRef::Real(r) => Value::Real(r),
                            ValueRef::Text(t) => Value::Text(String::from_utf8_lossy(t).into_owned()),
                            ValueRef::Blob(b) => Value::Bytes(b.to_vec()),
                        });
                    }
                    out.push(Row(values));
                }
                Ok(out)
            }
            Inner::Postgres { .. } => self.with_pg(|pg| {
                let statement = pg.statement(sql)?;
                let args: Vec<&(dyn postgres::types::ToSql + Sync)> =
                    params.iter().map(|p| p as &(dyn postgres::types::ToSql + Sync)).collect();
                let rows = pg.client.query(&statement, &args)?;
                rows.iter().map(pg_row).collect()
            }),
        }
    }

    /// The first row of a query, if any.
    pub fn query_opt(&self, sql: &str, params: &[Param<'_>]) -> Result<Option<Row>, DbError> {
        Ok(self.query_all(sql, params)?.into_iter().next())
    }

    /// The first row of a query that returns one.
    pub fn query_one(&self, sql: &str, params: &[Param<'_>]) -> Result<Row, DbError> {
        self.query_opt(sql, params)?.ok_or(DbError::NoRow)
    }

    /// Start a write transaction: SQLite takes its write lock at once (`BEGIN IMMEDIATE`), so two
    /// writers wait for each other instead of failing on upgrade.
    pub fn begin(&self) -> Result<(), DbError> {
        self.execute_batch(match self.dialect() {
            Dialect::Sqlite => "BEGIN IMMEDIATE",
            Dialect::Postgres => "BEGIN",
        })?;
        self.set_in_transaction(true);
        Ok(())
    }

    /// [`Db::begin`], then the first column of the first row of `select` (a statement without
    /// parameters), if any: on PostgreSQL both in one round trip.
    pub fn begin_then(&self, select: &str) -> Result<Option<String>, DbError> {
        match &self.inner {
            Inner::Sqlite(_) => {
                self.begin()?;
                self.query_opt(select, &[])?.map(|row| row.get::<String>(0)).transpose()
            }
            Inner::Postgres { .. } => {
                self.count();
                let messages = self.with_pg(|pg| Ok(pg.client.simple_query(&format!("BEGIN; {select}"))?))?;
                self.set_in_transaction(true);
                Ok(messages.iter().find_map(|message| match message {
                    postgres::SimpleQueryMessage::Row(row) => row.get(0).map(str::to_owned),
                    _ => None,
                }))
            }
        }
    }

    pub fn commit(&self) -> Result<(), DbError> {
        self.execute_batch("COMMIT")?;
        self.set_in_transaction(false);
        Ok(())
    }

    pub fn rollback(&self) -> Result<(), DbError> {
        self.execute_batch("ROLLBACK")?;
        self.set_in_transaction(false);
        Ok(())
    }

    fn set_in_transaction(&self, value: bool) {
        if let Inner::Postgres { in_transaction, .. } = &self.inner {
            in_transaction.set(value);
        }
    }

    /// Whether `table` exists.
    pub fn has_table(&self, table: &str) -> Result<bool, DbError> {
        let sql = match self.dialect() {
            Dialect::Sqlite => "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?1)",
            Dialect::Postgres => "SELECT to_regclass(?1) IS NOT NULL",
        };
        self.query_one(sql, params![table])?.get(0)
    }

    /// SQL reading the integer at `key` of the JSON text in `column` (NULL when absent).
    pub fn json_int(&self, column: &str, key: &str) -> String {
        match self.dialect() {
            Dialect::Sqlite => format!("json_extract({column}, '$.{key}')"),
            Dialect::Postgres => format!("CAST(CAST({column} AS jsonb) ->> '{key}' AS BIGINT)"),
        }
    }

    /// SQL testing whether `column` is one of the integers of the list parameter `param` (one
    /// parameter for any number of values: the list as JSON text on SQLite, an array on PostgreSQL).
    pub fn in_list(&self, column: &str, param: usize) -> String {
        match self.dialect() {
            Dialect::Sqlite => format!("{column} IN (SELECT value FROM json_each(?{param}))"),
            Dialect::Postgres => format!("{column} = ANY(CAST(CAST(?{param} AS TEXT) AS BIGINT[]))"),
        }
    }

    /// The list parameter [`Db::in_list`] reads, as text (`{1,2}` for PostgreSQL, `[1,2]` for SQLite).
    pub fn list_param(&self, values: &[i64]) -> String {
        let joined = values.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
        match self.dialect() {
            Dialect::Sqlite => format!("[{joined}]"),
            Dialect::Postgres => format!("{{{joined}}}"),
        }
    }
}

fn pg_row(row: &postgres::Row) -> Result<Row, DbError> {
    use postgres::types::Type;
    let mut values = Vec::with_capacity(row.len());
    for (idx, column) in row.columns().iter().enumerate() {
        let value = match *column.type_() {
            Type::INT8 => row.try_get::<_, Option<i64>>(idx)?.map(Value::Int),
            Type::INT4 => row.try_get::<_, Option<i32>>(idx)?.map(|n| Value::Int(n.into())),
            Type::INT2 => row.try_get::<_, Option<i16>>(idx)?.map(|n| Value::Int(n.into())),
            Type::BOOL => row.try_get::<_, Option<bool>>(idx)?.map(|b| Value::Int(b.into())),
            Type::FLOAT8 => row.try_get::<_, Option<f64>>(idx)?.map(Value::Real),
            Type::BYTEA => row.try_get::<_, Option<Vec<u8>>>(idx)?.map(Value::Bytes),
            Type::VOID => None,
            _ => row.try_get::<_, Option<String>>(idx)?.map(Value::Text),
        };
        values.push(value.unwrap_or(Value::Null));
    }
    Ok(Row(values))
}

/// SQLite's spelling of a statement in PostgreSQL's: `?N` → `$N`, `INSERT OR IGNORE` →
/// `ON CONFLICT DO NOTHING`, `instr(` → `strpos(`. Text inside quotes is left alone.
pub fn translate(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len() + 24);
    let mut in_quote = false;
    let mut chars = sql.char_indices().peekable();
    let mut ignore = false;
    while let Some((at, c)) = chars.next() {
        if c == '\'' {
            in_quote = !in_quote;
            out.push(c);
            continue;
        }
        if in_quote {
            out.push(c);
            continue;
        }
        if c == '?' && chars.peek().is_some_and(|(_, d)| d.is_ascii_digit()) {
            out.push('$');
            continue;
        }
        let rest = &sql[at..];
        if rest.starts_with("INSERT OR IGNORE ") {
            out.push_str("INSERT ");
            ignore = true;
            for _ in 0.."INSERT OR IGNORE ".len() - 1 {
                chars.next();
            }
            continue;
        }
        if rest.starts_with("instr(") && !sql[..at].ends_with(|p: char| p.is_ascii_alphanumeric() || p == '_') {
            out.push_str("strpos(");
            for _ in 0.."instr(".len() - 1 {
                chars.next();
            }
            continue;
        }
        out.push(c);
    }
    if ignore {
        out.push_str(" ON CONFLICT DO NOTHING");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_translate_to_postgres() {
        assert_eq!(
            translate("INSERT OR IGNORE INTO t (a, b) VALUES (?1, ?12)"),
            "INSERT INTO t (a, b) VALUES ($1, $12) ON CONFLICT DO NOTHING"
        );
        assert_eq!(translate("SELECT instr(x, ?2) WHERE y = '?1'"), "SELECT strpos(x, $2) WHERE y = '?1'");
    }

    #[test]
    fn text_is_made_storable() {
        assert_eq!(storable("gpt\0x"), "gpt\u{FFFD}x");
        assert!(matches!(storable("plain"), std::borrow::Cow::Borrowed("plain")));
        let json = serde_json::json!({"a\u{0}": ["x\u{0}", {"b": "\\u0000 is text"}], "n": 1.5}).to_string();
        assert_eq!(storable_json(json), "{\"a\u{FFFD}\":[\"x\u{FFFD}\",{\"b\":\"\\\\u0000 is text\"}],\"n\":1.5}");
        let escaped_backslash = r#"{"b":"\\u0000"}"#.to_owned();
        assert_eq!(storable_json(escaped_backslash.clone()), escaped_backslash);
    }

    #[test]
    fn rows_read_typed_on_sqlite() {
        let db = Db::sqlite(rusqlite::Connection::open_in_memory().unwrap());
        db.execute_batch("CREATE TABLE t (id INTEGER PRIMARY KEY, n INTEGER, s TEXT, b BLOB)").unwrap();
        let id =
            db.insert_id("INSERT INTO t (n, s, b) VALUES (?1, ?2, ?3)", params![7i64, "x", &[1u8, 2][..]]).unwrap();
        let row = db.query_one("SELECT n, s, b, NULL FROM t WHERE id = ?1", params![id]).unwrap();
        assert_eq!(row.get::<i64>(0).unwrap(), 7);
        assert_eq!(row.get::<String>(1).unwrap(), "x");
        assert_eq!(row.get::<Vec<u8>>(2).unwrap(), vec![1, 2]);
        assert_eq!(row.get::<Option<i64>>(3).unwrap(), None);
        assert!(matches!(row.get::<i64>(1), Err(DbError::Type { column: 1, .. })));
        let list = db.list_param(&[7, 9]);
        let n: i64 = db
            .query_one(&format!("SELECT count(*) FROM t WHERE {}", db.in_list("n", 1)), params![&list])
            .unwrap()
            .get(0)
            .unwrap();
        assert_eq!(n, 1);
    }
}
