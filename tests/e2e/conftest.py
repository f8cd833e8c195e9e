"""Fixtures of the end-to-end suite: the stub upstream and pare in front of it (a real process)."""

import json
import os
import signal
import subprocess
import threading
import time

import pytest

from stub_upstream import StubUpstream

START_TIMEOUT_S = 30


class PareProcess:
    """`pare serve` on 127.0.0.1:0 in front of `upstream_url`; its log lines are kept."""

    def __init__(self, upstream_url, archive_dir):
        binary = os.environ.get("PARE_BIN")
        if not binary:
            raise RuntimeError("PARE_BIN must name the pare binary (tests/e2e/run.sh sets it)")
        env = dict(os.environ, RUST_LOG="info")
        self.process = subprocess.Popen(
            [binary, "serve", "--listen", "127.0.0.1:0", "--upstream", upstream_url,
             "--archive", str(archive_dir), "--log-format", "json"],
            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, text=True,
        )
        self.lines = []
        self.lock = threading.Lock()
        self.ready = threading.Event()
        self.addr = None
        threading.Thread(target=self._read_logs, daemon=True).start()
        if not self.ready.wait(START_TIMEOUT_S):
            self.process.kill()
            raise RuntimeError(f"pare did not start: {self.lines}")
        self.url = f"http://{self.addr}"

    def _read_logs(self):
        for line in self.process.stderr:
            try:
                event = json.loads(line)
            except ValueError:
                event = {"message": line.rstrip()}
            with self.lock:
                self.lines.append(event)
            if event.get("message") == "pare listening":
                self.addr = event["addr"]
                self.ready.set()

    def access_log(self):
        """The per-request lines pare logged so far."""
        with self.lock:
            return [e for e in self.lines if e.get("target") == "pare::access"]

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


def wait_until(predicate, timeout_s=10.0, what="a condition"):
    """Poll `predicate` until it holds; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
