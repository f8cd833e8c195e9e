#!/usr/bin/env python3
"""pare builds and nginx side by side in one run: the latency each adds in front of the same zero-delay
upstream, and pare's CPU time per small request.

Usage: benches/side_by_side.py BINARY... [--rounds R] [--small N] [--large N] [--large-messages M]
                               [--no-nginx] [--json]

nginx (`nginx` on PATH) serves as the zero-delay upstream (a fixed JSON completion, `return 200`)
and, as a second server, as the bare-hop reference proxying to it (`proxy_pass`, keep-alive to the
upstream, the request body buffered as pare buffers it). Each BINARY runs `pare serve` with the
default config and its archive in a temporary directory. Per round and per target, in an order
rotated each round: N small requests (the two-message chat body of `cargo bench --bench proxy`)
and N large ones (`benches/gen_long_body.py M`, ~850 KB at M = 6730: the same body again with no
answer, so a new session and an epoch each), each sent directly and through the target in turn
(the order alternating), concurrency 1, one keep-alive connection each. Reported per target, the
median over rounds of: the added p50 (median of the paired differences), pare's CPU per small
request (`/proc/<pid>/task/*/schedstat`, over the round's small requests) and its peak RSS.
Loopback only; every loop is bounded by the counts. Numbers are printed, never asserted.
"""

import argparse
import http.client
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ANSWER = ('{"id":"chatcmpl-bench","object":"chat.completion","created":1700000000,"model":"bench",'
          '"choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],'
          '"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}')

NGINX_CONF = """worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  client_body_temp_path {dir}/body;
  proxy_temp_path {dir}/proxy;
  fastcgi_temp_path {dir}/fcgi;
  uwsgi_temp_path {dir}/uwsgi;
  scgi_temp_path {dir}/scgi;
  upstream stub {{ server 127.0.0.1:{stub}; keepalive 16; }}
  server {{
    listen 127.0.0.1:{stub};
    client_max_body_size 64m;
    client_body_buffer_size 16m;
    location / {{ default_type application/json; return 200 '{answer}'; }}
  }}
  server {{
    listen 127.0.0.1:{proxy};
    client_max_body_size 64m;
    client_body_buffer_size 16m;
    location / {{
      proxy_pass http://stub;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_request_buffering on;
      proxy_buffering off;
    }}
  }}
}}
"""


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port, proc, what):
    deadline = time.time() + 30
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited before listening")
        try:
            http.client.HTTPConnection("127.0.0.1", port, timeout=5).connect()
            return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"{what} is not listening")


def cpu_threads(pid):
    """Each live thread's CPU time so far, ns (`schedstat`: the clock ticks of `stat` are 10 ms, a
    few small requests' worth)."""
    times = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            times[task.name] = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return times


def cpu_since(pid, before):
    """Seconds of CPU the process's threads used since `before` ([`cpu_threads`]); a thread that
    ended meanwhile (an idle blocking-pool thread) counts nothing."""
    after = cpu_threads(pid)
    return sum(ns - before.get(tid, 0) for tid, ns in after.items()) / 1e9


def peak_mib(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def post(conn, body):
    started = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"})
    response = conn.getresponse()
    response.read()
    if response.status != 200:
        raise SystemExit(f"status {response.status}")
    return (time.perf_counter() - started) * 1e6


def paired(direct, target, body, n):
    """Median of (through − direct) over n interleaved pairs, µs."""
    added = []
    for i in range(n):
        if i % 2 == 0:
            d = post(direct, body)
            t = post(target, body)
        else:
            t = post(target, body)
            d = post(direct, body)
        added.append(t - d)
    return statistics.median(added)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binaries", nargs="+")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--small", type=int, default=400)
    ap.add_argument("--large", type=int, default=6)
    ap.add_argument("--large-messages", type=int, default=6730)
    ap.add_argument("--no-nginx", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not shutil.which("nginx"):
        raise SystemExit("nginx not found (apt-get install nginx)")
    here = Path(__file__).resolve().parent
    small = json.dumps({"model": "bench", "messages": [{"role": "system", "content": "You are a helpful assistant."},
                                                       {"role": "user", "content": "Say ok."}],
                        "temperature": 0}, separators=(",", ":")).encode()
    large = subprocess.run([sys.executable, str(here / "gen_long_body.py"), str(args.large_messages)], check=True,
                           capture_output=True).stdout.strip()
    procs, targets = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            stub, proxy = free_port(), free_port()
            (Path(tmp) / "nginx.conf").write_text(NGINX_CONF.format(dir=tmp, stub=stub, proxy=proxy, answer=ANSWER))
            nginx = subprocess.Popen(["nginx", "-c", f"{tmp}/nginx.conf"], stderr=subprocess.DEVNULL)
            procs.append(nginx)
            wait_listening(stub, nginx, "nginx")
            if not args.no_nginx:
                targets["nginx"] = (proxy, None)
            for i, binary in enumerate(args.binaries):
                port = free_port()
                pare = subprocess.Popen(
                    [binary, "serve", "--listen", f"127.0.0.1:{port}", "--upstream", f"http://127.0.0.1:{stub}/v1",
                     "--archive", f"{tmp}/archive-{i}", "--log-format", "json"],
                    env=dict(os.environ, RUST_LOG="info"), stdout=subprocess.DEVNULL,
                    stderr=open(f"{tmp}/pare-{i}.log", "wb"))
                procs.append(pare)
                wait_listening(port, pare, binary)
                targets[f"{i}:{binary}"] = (port, pare.pid)
            direct = http.client.HTTPConnection("127.0.0.1", stub, timeout=120)
            conns = {name: http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                     for name, (port, _) in targets.items()}
            # Warm up: connections, page faults, the tokenizer's tables.
            for name in targets:
                paired(direct, conns[name], small, 50)
                paired(direct, conns[name], large, 1)
            results = {name: {"small_added_us": [], "large_added_us": [], "cpu_small_us": []} for name in targets}
            names = list(targets)
            for r in range(args.rounds):
                order = names[r % len(names):] + names[:r % len(names)]
                for name in order:
                    pid = targets[name][1]
                    before = cpu_threads(pid) if pid else None
                    results[name]["small_added_us"].append(paired(direct, conns[name], small, args.small))
                    if pid:
                        results[name]["cpu_small_us"].append(cpu_since(pid, before) * 1e6 / args.small)
                    results[name]["large_added_us"].append(paired(direct, conns[name], large, args.large))
                print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
            summary = {}
            for name, (_, pid) in targets.items():
                row = {key: round(statistics.median(v), 1) for key, v in results[name].items() if v}
                row["rounds"] = {key: [round(x, 1) for x in v] for key, v in results[name].items() if v}
                if pid:
                    row["peak_rss_mib"] = round(peak_mib(pid), 1)
                summary[name] = row
            if args.json:
                print(json.dumps(summary, indent=1))
            else:
                print(f"{'target':<40} {'small added p50':>16} {'large added p50':>16} {'CPU/small req':>14} {'peak RSS':>9}")
                for name, row in summary.items():
                    cpu = f"{row['cpu_small_us']:.1f} µs" if "cpu_small_us" in row else "—"
                    rss = f"{row['peak_rss_mib']:.0f} MiB" if "peak_rss_mib" in row else "—"
                    print(f"{name:<40} {row['small_added_us']:>13.1f} µs {row['large_added_us'] / 1000:>13.2f} ms "
                          f"{cpu:>14} {rss:>9}")
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()


if __name__ == "__main__":
    main()
