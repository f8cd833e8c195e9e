#!/usr/bin/env python3
"""`POST /v1/compress` against the chat path on a small body, for one or more pare binaries side by side.

Usage: benches/gateway_compress.py BIN [BIN ...] [--rounds N] [--requests K]

Starts a zero-delay Chat Completions stub upstream (a thread of this script) and, per binary, a pare
on 127.0.0.1 with an archive in a temporary directory. Each round sends K requests of each kind to
each binary in turn (interleaved, so that the machine's load falls on all alike) over one keep-alive
connection: a two-message chat request through `/v1/chat/completions` (a new session each) and the
same two messages to `/v1/compress`. Prints per binary and kind the median latency of every request
in milliseconds, and the median of compress − chat over the rounds' medians. Bounded: N × K requests
per kind and binary, each with a 10 s timeout.
"""

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

COMPLETION = json.dumps(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11},
    }
).encode()


class Upstream(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def setup(self):
        super().setup()
        # The head and the body go out as two writes: without this, Nagle holds the body for the
        # peer's delayed ACK (40 ms).
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(COMPLETION)))
        self.end_headers()
        self.wfile.write(COMPLETION)

    def do_GET(self):
        self.send_response(404)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(port, deadline_s=30):
    end = time.time() + deadline_s
    while time.time() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"pare on port {port} did not start")


def messages(i):
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": f"Say hello to caller {i}."},
    ]


def timed(conn, path, body, headers):
    start = time.perf_counter()
    conn.request("POST", path, body=body, headers=headers)
    response = conn.getresponse()
    response.read()
    elapsed = (time.perf_counter() - start) * 1000
    if response.status != 200:
        raise SystemExit(f"{path}: HTTP {response.status}")
    return elapsed


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("bins", nargs="+")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args()

    upstream = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    upstream_url = f"http://127.0.0.1:{upstream.server_address[1]}/v1"

    pares = []
    with tempfile.TemporaryDirectory() as tmp:
        for n, binary in enumerate(args.bins):
            port = free_port()
            archive = os.path.join(tmp, f"archive{n}")
            process = subprocess.Popen(
                [binary, "serve", "--listen", f"127.0.0.1:{port}", "--upstream", upstream_url, "--archive", archive],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env={**os.environ, "RUST_LOG": "warn"},
            )
            pares.append((binary, port, process))
        try:
            for _, port, _ in pares:
                wait_up(port)
            headers = {"content-type": "application/json"}
            samples = {(b, kind): [] for b, _, _ in pares for kind in ("chat", "compress")}
            round_medians = {(b, kind): [] for b, _, _ in pares for kind in ("chat", "compress")}
            counter = 0
            for _ in range(args.rounds):
                for n, (binary, port, _) in enumerate(pares):
                    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                    # The gateway needs the owner token pare keeps beside its archive (none before
                    # pare had one).
                    token_file = os.path.join(tmp, f"archive{n}", "token")
                    if os.path.exists(token_file):
                        headers["x-pare-token"] = open(token_file).read().strip()
                    else:
                        headers.pop("x-pare-token", None)
                    for kind in ("chat", "compress"):
                        this_round = []
                        for _ in range(args.requests):
                            counter += 1
                            if kind == "chat":
                                body = json.dumps({"model": "m", "messages": messages(counter)})
                                path = "/v1/chat/completions"
                            else:
                                body = json.dumps({"model": "m", "messages": messages(counter)})
                                path = "/v1/compress"
                            this_round.append(timed(conn, path, body, headers))
                        samples[(binary, kind)].extend(this_round)
                        round_medians[(binary, kind)].append(statistics.median(this_round))
                    conn.close()
            for binary, _, _ in pares:
                chat = statistics.median(samples[(binary, "chat")])
                compress = statistics.median(samples[(binary, "compress")])
                gaps = [c - h for c, h in zip(round_medians[(binary, "compress")], round_medians[(binary, "chat")])]
                print(
                    f"{binary}: chat p50 {chat:.3f} ms, compress p50 {compress:.3f} ms, "
                    f"compress − chat (median of {args.rounds} rounds) {statistics.median(gaps):+.3f} ms"
                )
        finally:
            for _, _, process in pares:
                process.terminate()
                process.wait(timeout=10)
            upstream.shutdown()


if __name__ == "__main__":
    main()
