//! A throwaway PostgreSQL server for the tests: one per test binary (started on first use: `initdb`
//! into a temporary directory, `127.0.0.1` on a free port, its unix socket in that directory,
//! fsync on), one database per test ([`database`]). A watchdog shell stops the server and removes
//! its directory when the test process exits. Run as root, `initdb` and `postgres` run as the
//! `postgres` user (`runuser`), which owns the directory. Without PostgreSQL's binaries the tests
//! fail and say to install Debian's `postgresql`.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// PostgreSQL's program directory: `pg_config --bindir`, else the newest `/usr/lib/postgresql/*/bin`.
fn bindir() -> PathBuf {
    let from_pg_config = Command::new("pg_config")
        .arg("--bindir")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()))
        .filter(|dir| dir.join("initdb").exists() && dir.join("postgres").exists());
    if let Some(dir) = from_pg_config {
        return dir;
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_string_lossy().parse::<u32>().ok()?;
            let bin = entry.path().join("bin");
            bin.join("initdb").exists().then_some((version, bin))
        })
        .collect();
    versions.sort();
    match versions.pop() {
        Some((_, bin)) => bin,
        None => panic!(
            "PostgreSQL's server binaries (initdb, postgres) are missing: install Debian's `postgresql` \
             (apt-get install postgresql) to run the archive's PostgreSQL tests"
        ),
    }
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0").unwrap_or(false)
}

/// `program` from PostgreSQL's bindir, run as the `postgres` user when the tests run as root.
fn pg_command(program: &str) -> Command {
    let path = bindir().join(program);
    if is_root() {
        let mut command = Command::new("runuser");
        command.args(["-u", "postgres", "--"]).arg(path);
        command
    } else {
        Command::new(path)
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// One PostgreSQL server in a temporary directory.
pub struct PgServer {
    root: PathBuf,
    pub port: u16,
    /// Outlives this process on purpose: it stops the server once the process is gone.
    _watchdog: Option<Child>,
}

impl PgServer {
    /// Create and start a server; it stops when this process exits (or with [`PgServer::stop`]).
    pub fn start() -> PgServer {
        let root = tempfile::Builder::new().prefix("pare-pg-").tempdir().unwrap().keep();
        if is_root() {
            let status = Command::new("chown").args(["-R", "postgres:"]).arg(&root).status().unwrap();
            assert!(status.success(), "cannot give {} to the postgres user", root.display());
        }
        let data = root.join("data");
        let out = pg_command("initdb")
            .args(["-D"])
            .arg(&data)
            .args(["-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-instructions"])
            .output()
            .expect("running initdb");
        assert!(out.status.success(), "initdb failed: {}", String::from_utf8_lossy(&out.stderr));
        let mut server = PgServer { root, port: free_port(), _watchdog: None };
        server.resume();
        // The watchdog: when this test process is gone, stop the server and remove its directory.
        let script = format!(
            "while kill -0 {pid} 2>/dev/null; do sleep 0.5; done; {stop}; rm -rf '{root}'",
            pid = std::process::id(),
            stop = server.stop_command_line(),
            root = server.root.display()
        );
        let watchdog = Command::new("sh")
            .args(["-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting the watchdog of the test PostgreSQL server");
        server._watchdog = Some(watchdog);
        server
    }

    fn data(&self) -> PathBuf {
        self.root.join("data")
    }

    fn stop_command_line(&self) -> String {
        let pg_ctl = bindir().join("pg_ctl");
        let run_as = if is_root() { "runuser -u postgres -- " } else { "" };
        format!("{run_as}'{}' -D '{}' -m fast -w stop >/dev/null 2>&1", pg_ctl.display(), self.data().display())
    }

    /// Start the server (again), waiting until it accepts connections.
    pub fn resume(&self) {
        let out = pg_command("pg_ctl")
            .arg("-D")
            .arg(self.data())
            .arg("-l")
            .arg(self.root.join("log"))
            .args(["-w", "-t", "30", "-o"])
            .arg(format!(
                "-c listen_addresses=127.0.0.1 -p {} -k {} -c fsync=on -c max_connections=300",
                self.port,
                self.root.display()
            ))
            .arg("start")
            .output()
            .expect("running pg_ctl start");
        let log = std::fs::read_to_string(self.root.join("log")).unwrap_or_default();
        assert!(
            out.status.success(),
            "the test PostgreSQL server did not start: {}\n{log}",
            String::from_utf8_lossy(&out.stderr)
        );
        let deadline = Instant::now() + Duration::from_secs(30);
        while postgres::Client::connect(&self.url("postgres"), postgres::NoTls).is_err() {
            assert!(Instant::now() < deadline, "the test PostgreSQL server accepts no connection");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stop the server (fast shutdown: connections are cut).
    pub fn stop(&self) {
        let status = Command::new("sh").args(["-c", &self.stop_command_line()]).status().unwrap();
        assert!(status.success(), "pg_ctl stop failed");
    }

    /// Make role `user` (created with `password`) authenticate by password over TCP; every other
    /// role stays trusted.
    pub fn require_password(&self, user: &str, password: &str) {
        let mut admin = postgres::Client::connect(&self.url("postgres"), postgres::NoTls).unwrap();
        admin.batch_execute(&format!("CREATE ROLE {user} LOGIN PASSWORD '{password}'")).unwrap();
        let hba = self.data().join("pg_hba.conf");
        let rest = std::fs::read_to_string(&hba).unwrap();
        std::fs::write(&hba, format!("host all {user} 127.0.0.1/32 scram-sha-256\n{rest}")).unwrap();
        admin.batch_execute("SELECT pg_reload_conf()").unwrap();
        // The reload is asynchronous: wait until a password-less connection of `user` is refused.
        let deadline = Instant::now() + Duration::from_secs(10);
        let bare = format!("postgres://{user}@127.0.0.1:{}/postgres?sslmode=disable", self.port);
        while postgres::Client::connect(&bare, postgres::NoTls).is_ok() {
            assert!(Instant::now() < deadline, "pg_hba.conf was not reloaded");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The URL of database `name` (TLS off: the test server has no certificate).
    pub fn url(&self, name: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{name}?sslmode=disable", self.port)
    }

    /// A new, empty database; its URL.
    pub fn database(&self) -> String {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let name = format!("t{}_{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
        let mut client = postgres::Client::connect(&self.url("postgres"), postgres::NoTls).unwrap();
        client.batch_execute(&format!("CREATE DATABASE {name}")).unwrap();
        self.url(&name)
    }
}

/// The test binary's shared server.
pub fn shared() -> &'static PgServer {
    static SERVER: OnceLock<PgServer> = OnceLock::new();
    SERVER.get_or_init(PgServer::start)
}

/// A new, empty database on the shared server; its URL. Call it off any async task (the blocking
/// client runs a runtime of its own).
pub fn database() -> String {
    shared().database()
}
