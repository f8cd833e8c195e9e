"""Added latency of pare and of LiteLLM's proxy, side by side, against the same zero-delay upstream.

Not a test: it prints medians and p99 of the latency each proxy adds over a direct call. Requests to the
three targets (direct, pare, LiteLLM) are interleaved one by one on keep-alive connections so that
machine noise hits all three alike.

    python3 -m venv /tmp/litellm-venv && /tmp/litellm-venv/bin/pip install 'litellm[proxy]'
    cargo build --release
    /tmp/litellm-venv/bin/python benches/peer_litellm.py [--requests N]

The upstream is tests/e2e/stub_upstream.py (Python, the same for all three targets).
"""

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
from stub_upstream import StubUpstream  # noqa: E402

MASTER_KEY = "sk-bench-master"


def wait_ready(url, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except Exception:
            time.sleep(0.2)
    raise SystemExit(f"not ready: {url}")


def post(conn, path, body, headers):
    start = time.perf_counter()
    conn.request("POST", path, body=body, headers=headers)
    response = conn.getresponse()
    response.read()
    elapsed = time.perf_counter() - start
    if response.status != 200:
        raise SystemExit(f"{path}: status {response.status}")
    return elapsed


def connect(port):
    conn = http.client.HTTPConnection("127.0.0.1", port)
    conn.connect()
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--pare", default=os.path.join(ROOT, "target", "release", "pare"))
    args = parser.parse_args()

    stub = StubUpstream()
    # A zero-delay upstream must not wait on Nagle + delayed ACK (the stub writes head and body apart).
    stub.server.RequestHandlerClass.disable_nagle_algorithm = True
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        pare_port, litellm_port = 18931, 18932
        procs.append(subprocess.Popen(
            [args.pare, "serve", "--upstream", stub.url, "--listen", f"127.0.0.1:{pare_port}",
             "--archive", os.path.join(tmp, "archive")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "RUST_LOG": "warn"}))
        config = os.path.join(tmp, "litellm.yaml")
        with open(config, "w") as f:
            f.write(
                "model_list:\n"
                "  - model_name: bench\n"
                "    litellm_params:\n"
                "      model: openai/bench\n"
                f"      api_base: {stub.url}/v1\n"
                "      api_key: sk-upstream\n"
                "general_settings:\n"
                f"  master_key: {MASTER_KEY}\n"
                "litellm_settings:\n"
                "  telemetry: false\n")
        litellm = os.path.join(os.path.dirname(sys.executable), "litellm")
        procs.append(subprocess.Popen(
            [litellm, "--config", config, "--port", str(litellm_port), "--host", "127.0.0.1", "--num_workers", "1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"}))
        try:
            wait_ready(f"http://127.0.0.1:{pare_port}/_pare/health")
            wait_ready(f"http://127.0.0.1:{litellm_port}/health/liveliness")
            body = json.dumps({"model": "bench", "messages": [{"role": "user", "content": "Say hello."}]})
            targets = {
                "direct": (connect(stub.port), {}),
                "pare": (connect(pare_port), {}),
                "litellm": (connect(litellm_port), {"Authorization": f"Bearer {MASTER_KEY}"}),
            }
            times = {name: [] for name in targets}
            for i in range(args.requests + 20):
                for name, (conn, extra) in targets.items():
                    t = post(conn, "/v1/chat/completions", body, {"Content-Type": "application/json", **extra})
                    if i >= 20:  # warm-up
                        times[name].append(t)
            direct = statistics.median(times["direct"])
            print(f"requests per target: {args.requests} (interleaved, concurrency 1, small body)")
            print(f"{'target':8} {'p50 ms':>8} {'p99 ms':>8} {'added p50 ms':>13}")
            for name, ts in times.items():
                p50, p99 = statistics.median(ts), percentile(ts, 0.99)
                print(f"{name:8} {p50 * 1e3:8.3f} {p99 * 1e3:8.3f} {(p50 - direct) * 1e3:13.3f}")
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
            stub.close()


if __name__ == "__main__":
    main()
