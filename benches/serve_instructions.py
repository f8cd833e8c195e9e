#!/usr/bin/env python3
"""Instructions per request of `pare serve`, counted with callgrind: deterministic where wall time on
a shared machine is not, and comparable between builds (any release binary, the shipped one included).

Usage: benches/serve_instructions.py BINARY... [--ops small,new-large] [--check FILE] [--save FILE]

Each op runs `pare serve` (default config, the archive in a temporary directory) under
`valgrind --tool=callgrind` in front of a zero-delay stub upstream, sends N requests one at a time,
stops pare with SIGTERM, and sums the instructions of every thread (the archive writer's and the
counting thread's included). It runs with N = 1 and N = 1 + REPS; the difference over REPS cancels
the start, the first request's loading of the tokenizer tables and the shutdown. Ops:

- small: the two-message chat body of `cargo bench --bench proxy`, a new session each time
  (the same body with no answer in between), answered with a small JSON completion;
- new-large: an ~850 KB body of `benches/gen_long_body.py` shape (a system prompt, a task, then
  assistant tool calls and their results) cut to 1,200 messages (~150 KB: under callgrind the full
  6,730 messages take minutes per request) at a 16,384-token window, so that each request, a new
  session, starts an epoch (checked on the `x-pare-epoch` header).

--save FILE writes the counts of the first BINARY; --check FILE compares the first BINARY's counts
with FILE's and exits 1 when an op takes more than --tolerance (default 3 %) more instructions.
`benches/serve_instructions.json` holds the counts of the build BENCHMARKS.md reports: counts move
with valgrind's version and the CPU's features (valgrind hides SHA-NI: SHA-256 runs in software), so
compare on one machine, and save again when it changes.
Loopback only; every loop is bounded by N. Needs valgrind (`apt-get install valgrind`).
"""

import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ANSWER = json.dumps({"id": "chatcmpl-bench", "object": "chat.completion", "created": 1700000000, "model": "bench",
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                  "finish_reason": "stop"}],
                     "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}).encode()


class Stub(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", "0")))
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(ANSWER)))
        self.end_headers()
        self.wfile.write(ANSWER)

    def log_message(self, *args):
        pass


def small_body():
    return json.dumps({"model": "bench", "messages": [{"role": "system", "content": "You are a helpful assistant."},
                                                      {"role": "user", "content": "Say ok."}],
                       "temperature": 0}, separators=(",", ":")).encode()


def long_body(n):
    """benches/gen_long_body.py's body of n messages."""
    here = Path(__file__).resolve().parent
    return subprocess.run([sys.executable, str(here / "gen_long_body.py"), str(n)], check=True,
                          capture_output=True).stdout.strip()


# op -> (body, config, whether each request must start an epoch)
OPS = {
    "small": (small_body, "", False),
    "new-large": (lambda: long_body(1200), "budget:\n  default_context_window: 16384\n", True),
}


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(binary, body, config, epoch, n, stub_port):
    """Instructions of every thread of `pare serve` serving `body` n times."""
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        out = Path(tmp) / "cg.out"
        (Path(tmp) / "config.yaml").write_text(config)
        env = dict(os.environ, RUST_LOG="info")
        pare = subprocess.Popen(
            ["valgrind", "--tool=callgrind", "--separate-threads=no", f"--callgrind-out-file={out}",
             binary, "serve", "--config", str(Path(tmp) / "config.yaml"), "--listen", f"127.0.0.1:{port}", "--upstream", f"http://127.0.0.1:{stub_port}/v1",
             "--archive", str(Path(tmp) / "archive"), "--log-format", "json"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.time() + 120
            while True:
                try:
                    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
                    conn.connect()
                    break
                except OSError:
                    if time.time() > deadline or pare.poll() is not None:
                        raise SystemExit(f"{binary} did not start listening under valgrind")
                    time.sleep(0.2)
            for _ in range(n):
                conn.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"})
                response = conn.getresponse()
                response.read()
                if response.status != 200:
                    raise SystemExit(f"{binary}: status {response.status}")
                if epoch and response.getheader("x-pare-epoch", "0") == "0":
                    raise SystemExit(f"{binary}: the request started no epoch")
            conn.close()
            # Let the archive writer commit what the requests queued before stopping.
            time.sleep(1.0)
        finally:
            pare.send_signal(signal.SIGTERM)
            try:
                pare.wait(timeout=120)
            except subprocess.TimeoutExpired:
                pare.kill()
                pare.wait()
        total = 0
        for line in out.read_text(errors="replace").splitlines():
            if line.startswith("summary:") or line.startswith("totals:"):
                total = max(total, int(line.split()[1]))
        return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binaries", nargs="+")
    ap.add_argument("--ops", default="small,new-large")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--check", default=None)
    ap.add_argument("--save", default=None)
    ap.add_argument("--tolerance", type=float, default=0.03)
    args = ap.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    stub_port = server.server_address[1]
    ops = [op for op in args.ops.split(",") if op]
    counts = {}
    for binary in args.binaries:
        for op in ops:
            make_body, config, epoch = OPS[op]
            body = make_body()
            one = run(binary, body, config, epoch, 1, stub_port)
            many = run(binary, body, config, epoch, 1 + args.reps, stub_port)
            per = (many - one) / args.reps
            counts.setdefault(binary, {})[op] = per
            print(f"{binary:<40} {op:<10} {per / 1e6:9.3f} M instructions per request", flush=True)
    first = counts[args.binaries[0]]
    for binary in args.binaries[1:]:
        for op in ops:
            print(f"{op:<10} {args.binaries[0]} / {binary}: {first[op] / counts[binary][op]:.3f}")
    if args.save:
        Path(args.save).write_text(json.dumps({op: round(first[op]) for op in ops}, indent=1) + "\n")
    if args.check:
        stored = json.loads(Path(args.check).read_text())
        failed = False
        for op in ops:
            if op in stored:
                ratio = first[op] / stored[op]
                verdict = "ok" if ratio <= 1 + args.tolerance else "REGRESSED"
                failed |= verdict != "ok"
                print(f"{op:<10} {ratio:.3f} of the stored count: {verdict}")
        sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
