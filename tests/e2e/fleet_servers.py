"""The servers of a pare fleet on 127.0.0.1, for tests/e2e/test_fleet.py and benches/fleet.py: a
throwaway PostgreSQL (Debian's, `initdb` into a temporary directory), `pare serve` replicas, and
Debian's nginx in front of them running deploy/nginx.conf with only its ports changed. Every server
logs into its directory, every wait is bounded, and `stop()` ends each process it started (its own
id, never by name)."""

import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pare_log

ROOT = Path(__file__).resolve().parents[2]
NGINX_SNIPPET = ROOT / "deploy" / "nginx.conf"
START_TIMEOUT_S = 30
STOP_TIMEOUT_S = 30


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def end(process, sig=signal.SIGTERM, timeout_s=STOP_TIMEOUT_S):
    """Signal `process` and wait for it; SIGKILL when it outlives `timeout_s`. Its exit code."""
    if process.poll() is not None:
        return process.returncode
    process.send_signal(sig)
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait(timeout=timeout_s)


def cpu_seconds(pids):
    """User plus system CPU time of these processes, from /proc/PID/stat (children not included)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


def children(pid):
    """The ids of `pid`'s child processes."""
    found = []
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            found += [int(c) for c in Path(path).read_text().split()]
        except OSError:
            continue
    return found


def postgres_bindir():
    """Where Debian keeps initdb and postgres: `pg_config --bindir`, else /usr/lib/postgresql/*/bin."""
    candidates = []
    if shutil.which("pg_config"):
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, timeout=10)
        candidates.append(out.stdout.strip())
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    for bindir in candidates:
        if bindir and Path(bindir, "initdb").exists():
            return Path(bindir)
    raise RuntimeError("no PostgreSQL server binaries (initdb) found: install Debian's postgresql")


class Postgres:
    """A throwaway PostgreSQL on 127.0.0.1:PORT, its data, socket and log in a temporary directory of its
    own, run as the `postgres` user when we are root; one database `pare` owned by the user `pare`, who
    logs in with a password over TCP."""

    USER = "pare"
    PASSWORD = "fleet-secret-7f3a"
    DATABASE = "pare"

    def __init__(self, log_dir, fsync=True, settings=()):
        # Its own directory under /tmp: the postgres user cannot enter a test's temporary directory
        # (root's, mode 0700). Removed by stop(), which copies the server's log to `log_dir`.
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix="pare-fleet-pg-"))
        self.bindir = postgres_bindir()
        self.port = free_port()
        self.process = None
        self.as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        try:
            self._create(fsync, settings)
        except BaseException:
            self.stop()
            raise
        self.url = f"postgres://{self.USER}:{self.PASSWORD}@127.0.0.1:{self.port}/{self.DATABASE}?sslmode=disable"

    def _create(self, fsync, settings):
        if self.as_postgres:
            shutil.chown(self.dir, "postgres", "postgres")
        superuser_pw = self.dir / "superuser.pw"
        superuser_pw.write_text("postgres-superuser\n")
        if self.as_postgres:
            shutil.chown(superuser_pw, "postgres", "postgres")
        self._run(self.bindir / "initdb", "-D", self.dir / "data", "-U", "postgres", "--pwfile", superuser_pw,
                  "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8", "--no-instructions")
        self.settings = ["-c", "listen_addresses=127.0.0.1", "-p", str(self.port), "-k", str(self.dir)]
        if not fsync:
            self.settings += ["-c", "fsync=off"]
        for setting in settings:
            self.settings += ["-c", setting]
        self.start()
        self.sql(f"CREATE ROLE {self.USER} LOGIN PASSWORD '{self.PASSWORD}'")
        self.sql(f"CREATE DATABASE {self.DATABASE} OWNER {self.USER}")

    def start(self):
        """Start the server on its data directory (again, after shutdown()) and wait until it accepts."""
        log = open(self.dir / "postgres.log", "ab")
        self.process = subprocess.Popen(
            [*self.as_postgres, self.bindir / "postgres", "-D", self.dir / "data", *self.settings],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        wait_for(self._ready, START_TIMEOUT_S, f"PostgreSQL on port {self.port}")

    def shutdown(self):
        """Stop the server (a fast shutdown), keeping its data for start()."""
        if self.process and self.process.poll() is None:
            # The postmaster itself (under runuser, its child): SIGINT is a fast shutdown.
            for pid in children(self.process.pid) if self.as_postgres else []:
                os.kill(pid, signal.SIGINT)
            end(self.process, signal.SIGINT)

    def _run(self, *args):
        result = subprocess.run([*self.as_postgres, *map(str, args)], capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{args[0]} failed: {result.stdout}{result.stderr}")
        return result.stdout

    def _ready(self):
        if self.process.poll() is not None:
            raise RuntimeError(f"postgres exited {self.process.returncode}: {(self.dir / 'postgres.log').read_text()[-2000:]}")
        probe = subprocess.run([self.bindir / "pg_isready", "-h", "127.0.0.1", "-p", str(self.port)],
                               capture_output=True, timeout=10)
        return probe.returncode == 0

    def sql(self, statement, database="postgres"):
        """Run one statement as the superuser over the Unix socket; its rows, tab-separated."""
        return self._run(self.bindir / "psql", "-h", self.dir, "-p", self.port, "-U", "postgres", "-d", database,
                         "-v", "ON_ERROR_STOP=1", "-qAtX", "-F", "\t", "-c", statement)

    def pids(self):
        """The postmaster and every backend, checkpointer, WAL writer… it started."""
        if not self.process or self.process.poll() is not None:
            return []
        # Under runuser the postmaster is runuser's child.
        top = children(self.process.pid) if self.as_postgres else [self.process.pid]
        return top + [c for pid in top for c in children(pid)]

    def stop(self):
        try:
            self.shutdown()
        finally:
            if (self.dir / "postgres.log").exists():
                shutil.copy(self.dir / "postgres.log", self.log_dir / "postgres.log")
            shutil.rmtree(self.dir, ignore_errors=True)


class Replica:
    """`pare serve` on 127.0.0.1:0 with JSON logs, kept in memory and in `log_path`, run in the
    directory of `log_path`."""

    def __init__(self, binary, args, log_path, env=None):
        self.log_path = Path(log_path)
        self.log = open(self.log_path, "a")
        self.lines = []
        self.lock = threading.Lock()
        self.ready = threading.Event()
        self.addr = None
        self.process = subprocess.Popen(
            # A relative path is the caller's, not the log directory's.
            [os.path.abspath(binary) if os.sep in str(binary) else str(binary), "serve", "--listen", "127.0.0.1:0", "--log-format", "json", *map(str, args)],
            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True,
            env=dict(os.environ, RUST_LOG="info", **(env or {})), cwd=self.log_path.parent,
        )
        self.reader = threading.Thread(target=self._read_logs, daemon=True)
        self.reader.start()
        if not self.ready.wait(START_TIMEOUT_S):
            self.stop()
            raise RuntimeError(f"pare did not start: {self.lines[-20:]}")
        self.port = int(self.addr.rsplit(":", 1)[1])
        self.url = f"http://{self.addr}"

    def _read_logs(self):
        pare_log.follow(self.process.stderr, self.lines, self.lock, self._listening, copy=self.log)

    def _listening(self, addr):
        self.addr = addr
        self.ready.set()

    def access_log(self):
        return pare_log.access_lines(self.lines, self.lock)

    def health(self):
        """`GET /_pare/health`, parsed."""
        with urllib.request.urlopen(f"{self.url}/_pare/health", timeout=10) as response:
            return json.loads(response.read())

    def kill(self):
        """SIGKILL: no shutdown, no flush. Returns once every line it logged has been read."""
        self.process.kill()
        self.process.wait(timeout=STOP_TIMEOUT_S)
        self.reader.join(STOP_TIMEOUT_S)

    def stop(self):
        """SIGTERM; its exit code once every line it logged has been read."""
        code = end(self.process)
        self.reader.join(STOP_TIMEOUT_S)
        return code


def nginx_snippet(replica_ports, listen_port, sticky=None):
    """deploy/nginx.conf with its replicas' and its own ports set; `sticky` "session" or "client"
    uncomments that hash line."""
    text = NGINX_SNIPPET.read_text()
    server_lines = re.findall(r"^    server 127\.0\.0\.1:\d+ (.*);$", text, re.M)
    assert server_lines, "deploy/nginx.conf lists its replicas as `server 127.0.0.1:PORT …;`"
    options = server_lines[0]
    servers = "".join(f"    server 127.0.0.1:{port} {options};\n" for port in replica_ports)
    text = re.sub(r"(^    server 127\.0\.0\.1:\d+ .*;\n)+", lambda _: servers, text, count=1, flags=re.M)
    text, n = re.subn(r"^    listen 127\.0\.0\.1:\d+;$", f"    listen 127.0.0.1:{listen_port};", text, flags=re.M)
    assert n == 1, "deploy/nginx.conf listens on `127.0.0.1:PORT`"
    if sticky:
        line = {"session": "hash $http_x_pare_session consistent;", "client": "hash $remote_addr consistent;"}[sticky]
        text, n = re.subn(rf"^    # {re.escape(line)}$", f"    {line}", text, flags=re.M)
        assert n == 1, f"deploy/nginx.conf has the commented line `# {line}`"
    return text


class Nginx:
    """Debian's nginx on 127.0.0.1:PORT in front of the replicas, everything it writes in `directory`."""

    def __init__(self, directory, replica_ports, sticky=None):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        binary = shutil.which("nginx") or "/usr/sbin/nginx"
        if not Path(binary).exists():
            raise RuntimeError("nginx not found: install Debian's nginx")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        (self.dir / "pare.conf").write_text(nginx_snippet(replica_ports, self.port, sticky))
        temp = "".join(f"    {kind}_temp_path {self.dir / kind};\n" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        # Workers run as root when we are (the temporary directory is root's alone).
        user = "user root;\n" if os.geteuid() == 0 else ""
        (self.dir / "nginx.conf").write_text(
            f"{user}worker_processes 1;\nevents {{ worker_connections 1024; }}\n"
            f"http {{\n    access_log {self.dir / 'access.log'};\n{temp}    include {self.dir / 'pare.conf'};\n}}\n"
        )
        globals_ = f"daemon off; pid {self.dir / 'nginx.pid'}; error_log {self.dir / 'error.log'} info;"
        command = [binary, "-p", str(self.dir), "-e", str(self.dir / "error.log"), "-c", str(self.dir / "nginx.conf"), "-g", globals_]
        check = subprocess.run([*command, "-t"], capture_output=True, text=True, timeout=30)
        if check.returncode != 0:
            raise RuntimeError(f"nginx -t refused the config: {check.stderr}")
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(self.dir / "stderr.log", "ab"))
        try:
            wait_for(self._listening, START_TIMEOUT_S, f"nginx on port {self.port}")
        except BaseException:
            self.stop()
            raise

    def _listening(self):
        if self.process.poll() is not None:
            raise RuntimeError(f"nginx exited {self.process.returncode}: {(self.dir / 'error.log').read_text()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
            return True
        except OSError:
            return False

    def pids(self):
        if self.process.poll() is not None:
            return []
        return [self.process.pid, *children(self.process.pid)]

    def stop(self):
        return end(self.process, signal.SIGQUIT)
