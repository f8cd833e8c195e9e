#!/usr/bin/env python3
"""PostgreSQL's CPU and statements per archived warm request, for one or more pare binaries side by side.

Usage: benches/pg_archive.py PARE_BINARY... [--clients C] [--requests N] [--output-bytes B]

Starts a throwaway PostgreSQL (tests/e2e/fleet_servers.py, fsync on, pg_stat_statements loaded) and a
zero-delay stub on 127.0.0.1; then, for each binary in turn, one `pare serve` with `archive.url` on a
new database and `archive.durability: strict`, and C clients that each send one session of N warm
requests at once, each request its session's previous one plus a tool call and a B-byte output (the
first request of each session is not counted). Prints per binary: requests/s, the CPU time of
PostgreSQL (postmaster and every backend, /proc) per archived request, the statements pare ran per
request (`pg_stat_statements` calls, BEGIN and COMMIT included) and the requests/s one database core
would archive at that CPU cost. Every loop is bounded by C × N requests.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benches"))
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

import attack_limits as al  # noqa: E402  (the stub)
from fleet_servers import Postgres, cpu_seconds, free_port  # noqa: E402


def postgres_cpu(pg):
    """CPU seconds of the postmaster (with its exited backends, reaped) and of its live processes."""
    tick = os.sysconf("SC_CLK_TCK")
    pids = pg.pids()
    fields = Path(f"/proc/{pids[0]}/stat").read_text().rsplit(")", 1)[1].split()
    return cpu_seconds(pids) + (int(fields[13]) + int(fields[14])) / tick


def session_bodies(client, n, output_bytes):
    messages = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": f"task {client}: fix the bug"}]
    for k in range(n + 1):
        call = f"call_{client}_{k}"
        messages.append({"role": "assistant", "content": None, "tool_calls": [{"id": call, "type": "function",
                         "function": {"name": "bash", "arguments": json.dumps({"command": f"cat f{k}.py"})}}]})
        line = f"def f_{client}_{k}(x):  # line of file {k}\n"
        messages.append({"role": "tool", "tool_call_id": call, "content": (line * (output_bytes // len(line) + 1))[:output_bytes]})
        yield json.dumps({"model": "m", "messages": messages}).encode()


def post(port, body, session):
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                     headers={"content-type": "application/json", "x-pare-session": session})
    with urllib.request.urlopen(request, timeout=60) as response:
        response.read()


def run(binary, pg, database, url, stub_port, args, work):
    port = free_port()
    config = work / f"{database}.yaml"
    config.write_text(f"""server:
  listen: 127.0.0.1:{port}
upstream:
  url: http://127.0.0.1:{stub_port}
archive:
  enabled: true
  url: {url}
  durability: strict
budget:
  default_context_window: 200000
  detect_window: false
""")
    log = open(work / f"{database}.log", "wb")
    process = subprocess.Popen([binary, "serve", "--config", str(config)], stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(400):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/_pare/health", timeout=2).read()
                break
            except OSError:
                time.sleep(0.05)
        sessions = [list(session_bodies(c, args.requests, args.output_bytes)) for c in range(args.clients)]
        for c, bodies in enumerate(sessions):
            post(port, bodies[0], f"{database}-{c}")
        pg.sql("SELECT pg_stat_statements_reset()", database=database)
        cpu_before = postgres_cpu(pg)
        started = time.monotonic()

        def client(c):
            for body in sessions[c][1:]:
                post(port, body, f"{database}-{c}")

        threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - started
        cpu = postgres_cpu(pg) - cpu_before
        calls = int(pg.sql("SELECT coalesce(sum(calls), 0) FROM pg_stat_statements s JOIN pg_database d "
                           f"ON d.oid = s.dbid WHERE d.datname = '{database}' AND query NOT LIKE '%pg_stat_statements%'",
                           database=database))
        top = pg.sql("SELECT calls, left(regexp_replace(query, '\\s+', ' ', 'g'), 70) FROM pg_stat_statements s "
                     f"JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = '{database}' ORDER BY calls DESC LIMIT 12",
                     database=database)
    finally:
        process.terminate()
        process.wait(30)
    n = args.clients * args.requests
    return n, elapsed, cpu, calls, top


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("binaries", nargs="+")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--output-bytes", type=int, default=2000)
    args = ap.parse_args()
    stub = ThreadingHTTPServer(("127.0.0.1", 0), al.Stub)
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    work = Path(tempfile.mkdtemp(prefix="pare-pg-archive-"))
    pg = Postgres(work / "pg", settings=["shared_preload_libraries=pg_stat_statements",
                                         "pg_stat_statements.track=all", "pg_stat_statements.track_utility=on"])
    rows = []
    try:
        for i, binary in enumerate(args.binaries):
            database = f"pare_archive_{i}"
            pg.sql(f"CREATE DATABASE {database} OWNER {Postgres.USER}")
            pg.sql("CREATE EXTENSION IF NOT EXISTS pg_stat_statements", database=database)
            url = pg.url.replace(f"/{Postgres.DATABASE}?", f"/{database}?")
            n, elapsed, cpu, calls, top = run(binary, pg, database, url, stub.server_address[1], args, work)
            rows.append((binary, n, elapsed, cpu, calls))
            print(f"{binary}: most called statements:\n{top}", file=sys.stderr)
    finally:
        pg.stop()
        stub.shutdown()
    print(f"{args.clients} clients × {args.requests} warm requests ({args.output_bytes}-byte outputs), strict\n")
    print("| binary | requests/s | PostgreSQL CPU per request | statements per request | requests/s per database core |")
    print("|---|---|---|---|---|")
    for binary, n, elapsed, cpu, calls in rows:
        per = cpu / n
        print(f"| `{binary}` | {n / elapsed:.0f} | {per * 1e3:.2f} ms | {calls / n:.1f} | {1 / per if per else float('inf'):.0f} |")


if __name__ == "__main__":
    main()
