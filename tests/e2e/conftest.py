"""Fixtures of the end-to-end suite: the stub upstream and pare in front of it (a real process)."""

import json
import os
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

import pare_log
from stub_upstream import StubUpstream

START_TIMEOUT_S = 30
PARE_CLI_TIMEOUT_S = 30
# The project-local npm prefix tests/e2e/run.sh installs Codex CLI and Claude Code into.
NODE_BIN = Path(__file__).resolve().parent / ".node" / "node_modules" / ".bin"


class PareProcess:
    """`pare serve` on 127.0.0.1:0 in front of `upstream_url`; its log lines are kept."""

    def __init__(self, upstream_url, archive_dir, extra_args=()):
        binary = os.environ.get("PARE_BIN")
        if not binary:
            raise RuntimeError("PARE_BIN must name the pare binary (tests/e2e/run.sh sets it)")
        env = dict(os.environ, RUST_LOG="info")
        self.process = subprocess.Popen(
            [binary, "serve", "--listen", "127.0.0.1:0", "--upstream", upstream_url,
             "--archive", str(archive_dir), "--log-format", "json", *extra_args],
            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, text=True,
        )
        self.binary = binary
        self.archive = Path(archive_dir)
        self.lines = []
        self.lock = threading.Lock()
        self.ready = threading.Event()
        self.addr = None
        threading.Thread(target=self._read_logs, daemon=True).start()
        if not self.ready.wait(START_TIMEOUT_S):
            self.process.kill()
            raise RuntimeError(f"pare did not start: {self.lines}")
        self.url = f"http://{self.addr}"

    @property
    def token(self):
        """The owner token pare made at first start, kept beside the archive (README, "Who reads the
        archive"): what pare's own endpoints and the gateway need."""
        return (self.archive / "token").read_text().strip()

    def open(self, path, timeout=30):
        """`GET path` on pare with the owner token (`urllib`'s response, to use with `with`)."""
        request = urllib.request.Request(f"{self.url}{path}", headers={"x-pare-token": self.token})
        return urllib.request.urlopen(request, timeout=timeout)

    def _read_logs(self):
        pare_log.follow(self.process.stderr, self.lines, self.lock, self._listening)

    def _listening(self, addr):
        self.addr = addr
        self.ready.set()

    def access_log(self):
        """The per-request lines pare logged so far."""
        return pare_log.access_lines(self.lines, self.lock)

    def _run_cli(self, *args):
        return subprocess.run(
            [self.binary, *args, "--archive", str(self.archive)],
            capture_output=True, text=True, timeout=PARE_CLI_TIMEOUT_S,
        )

    def cli(self, *args):
        """Run `pare ARGS --archive DIR` against this server's archive; its stdout."""
        result = self._run_cli(*args)
        assert result.returncode == 0, f"pare {' '.join(args)}: {result.stderr}"
        return result.stdout

    def sessions(self):
        """`pare sessions list --json`: session id → its line."""
        lines = self.cli("sessions", "list", "--json").splitlines()
        return {s["id"]: s for s in map(json.loads, lines)}

    def settled_sessions(self):
        """`sessions()` once the archive has caught up with earlier traffic (two reads a quarter second
        apart agree): the snapshot a test compares its own new sessions against. The writer commits in
        groups, so records of an earlier test can land just after a plain snapshot."""
        deadline = time.monotonic() + 10
        last = self.sessions()
        while time.monotonic() < deadline:
            time.sleep(0.25)
            now = self.sessions()
            if now == last:
                return now
            last = now
        return last

    def bodies(self, session, kind):
        """The exact bodies of a session's requests, `kind` "raw" (as received) or "forwarded"."""
        return self.cli("sessions", "show", session, f"--{kind}").encode().split(b"\n")[:-1]

    def stop(self):
        """SIGTERM, then wait: pare must exit 0 on its own."""
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=40)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise


@pytest.fixture(scope="session")
def stub():
    server = StubUpstream()
    yield server
    server.close()


@pytest.fixture(scope="session")
def pare(stub, tmp_path_factory):
    process = PareProcess(f"{stub.url}/v1", tmp_path_factory.mktemp("archive"))
    yield process
    assert process.stop() == 0, "pare did not exit cleanly on SIGTERM"


@pytest.fixture()
def fresh(stub, pare):
    """The stub with a clean request record."""
    stub.clear()
    return stub


def json_object_around(body, needle):
    """The bytes of the innermost JSON object in `body` that contains `needle`."""
    text = body.decode()
    at = text.index(needle)
    decoder = json.JSONDecoder()
    start = at
    while start > 0:
        start = text.rindex("{", 0, start)
        try:
            _, end = decoder.raw_decode(text, start)
        except ValueError:
            continue
        if end > at:
            return text[start:end].encode()
    raise AssertionError(f"{needle!r} is in no JSON object")


def new_requests(before, after):
    """Requests archived between two `sessions()` snapshots, per session id."""
    grown = {sid: s["requests"] - before.get(sid, {}).get("requests", 0) for sid, s in after.items()}
    return {sid: n for sid, n in grown.items() if n}


def wait_until(predicate, timeout_s=10.0, what="a condition"):
    """Poll `predicate` until it holds; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
