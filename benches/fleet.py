#!/usr/bin/env python3
"""One pare on SQLite against replicas on PostgreSQL behind nginx, side by side in one run.

Usage: benches/fleet.py PARE_BINARY [--baseline OTHER_BINARY] [--replicas N] [--sessions FILE_OR_DIR ...]
                        [--max-sessions N] [--window TOKENS] [--load-seconds S] [--load-concurrency C]
                        [--load-request FILE] [--keep DIR]

PARE_BINARY is a release build (`cargo build --release`: target/release/pare); with `--baseline`,
every setup runs with each build in turn, in the same run (rows labelled by build). Needs Debian's
postgresql, nginx and hey (`apt-get install postgresql nginx hey`); starts its own throwaway
PostgreSQL (tests/e2e/fleet_servers.py: `initdb` into a temporary directory, fsync on) and nginx
running deploy/nginx.conf, everything on 127.0.0.1. Every pare runs `archive.durability: strict`.

- replay: the requests of the session files (one chat body per line) through each setup, interleaved
  with direct calls to a zero-delay stub, as benches/replay_sessions.py does (its stub and its replay
  loop): pare's added latency (through − direct) p50/p99 for warm requests under 200 KB, and the
  number of epochs the replicas started (`pare_epochs_total` of each one's /_pare/metrics, summed: a
  replica that compacts its own view of a session starts epochs a single pare would not), the
  requests compacted twice (`pare_stale_state_total`) and caught up (`pare_caught_up_total`), and
  PostgreSQL's CPU time per replayed request. Setups: one pare on SQLite, direct and behind
  nginx (the hop's own cost); N replicas (default 2) on PostgreSQL behind nginx, sticky (nginx.conf's
  `hash $remote_addr consistent` line: the bench is one client, so one replica serves it all) and
  round-robin. Each setup gets an archive of its own (a new SQLite directory, a new database), and
  each replica one small request of its own before anything is measured (the tokenizer's tables).
- load: `hey -z S -c C` posting one corpus request over and over (each is a one-request session of its
  own: pare never joins a request to an equal earlier one) to one pare on SQLite and to the
  replicas through nginx round-robin: requests/s, p99, the CPU time of pare (all replicas) and of
  PostgreSQL (postmaster and every backend, /proc) over the run, PostgreSQL's CPU per request and
  the requests/s one core of it would sustain at that cost (requests / its CPU seconds).
- bytes per archived request: what the replay added to the archive in each backend (after the
  warm-up, so that the empty tables' and indexes' first pages do not count), SQLite's pages in use
  against the sum of `pg_total_relation_size` over pare's tables.

Prints a markdown table per part. Loopback only; every loop is bounded by the session files, and the
load by S seconds per setup.
"""

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import urllib.request
from http.server import ThreadingHTTPServer
from pathlib import Path
from threading import Thread

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benches"))
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

import replay_sessions as rs  # noqa: E402  (the replay's stub and loop)
from fleet_servers import Nginx, Postgres, Replica, cpu_seconds  # noqa: E402

# BENCHMARKS.md's real sessions: the first 4 files of openhands/ and of mini-swe-agent/ in the shared
# corpus (unpacked to /tmp/corpus) and the first 2 long ones (/tmp/long), 547 requests.
DEFAULT_SESSIONS = [("/tmp/corpus/sessions/openhands", 4), ("/tmp/corpus/sessions/mini-swe-agent", 4),
                    ("/tmp/long/sessions/mini-swe-agent", 2)]


def config_text(window):
    return (
        "archive:\n  durability: strict\n"
        f"budget:\n  detect_window: false\n  default_context_window: {window}\n"
    )


class Setup:
    """pare (one, or REPLICAS behind nginx) on one archive, in `directory`."""

    def __init__(self, binary, directory, stub_port, archive, replicas, nginx, sticky=None, window=32768):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True)
        config = self.dir / "pare.yaml"
        config.write_text(config_text(window))
        self.replicas, self.nginx = [], None
        try:
            for i in range(replicas):
                self.replicas.append(Replica(binary, ["--config", config, "--upstream", f"http://127.0.0.1:{stub_port}/v1",
                                                      "--archive", archive], self.dir / f"replica-{i}.log"))
            if nginx:
                self.nginx = Nginx(self.dir / "nginx", [r.port for r in self.replicas], sticky=sticky)
        except BaseException:
            self.stop()
            raise
        self.port = self.nginx.port if self.nginx else self.replicas[0].port

    def pare_cpu(self):
        return sum(cpu_seconds([r.process.pid]) for r in self.replicas if r.process.poll() is None)

    def warm_up(self):
        """One small request to each replica directly: it loads its tokenizer's tables (tens of
        milliseconds in a release build) before anything is measured, as a long-running pare has."""
        for i, replica in enumerate(self.replicas):
            body = json.dumps({"model": "warm-up", "messages": [{"role": "user", "content": f"warm up replica {i}"}]}).encode()
            request = urllib.request.Request(f"{replica.url}/v1/chat/completions", data=body, headers={"content-type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as response:
                response.read()

    def counter(self, name):
        """A counter of /_pare/metrics summed over its labels and the replicas (0 when a build has
        none of that name)."""
        total = 0
        for replica in self.replicas:
            with urllib.request.urlopen(f"{replica.url}/_pare/metrics", timeout=10) as response:
                text = response.read().decode()
            total += sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                         if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "))
        return int(total)

    def stop(self):
        if self.nginx:
            self.nginx.stop()
        for replica in self.replicas:
            replica.stop()


def sqlite_bytes(directory):
    """The pages in use of the archive's SQLite database (its WAL read through: while pare runs the
    WAL holds copies of pages not yet written back, so file sizes say little)."""
    with sqlite3.connect(f"file:{Path(directory) / 'archive.sqlite3'}?mode=ro", uri=True) as db:
        pages, free, page_size = (db.execute(f"PRAGMA {p}").fetchone()[0] for p in ("page_count", "freelist_count", "page_size"))
    return (pages - free) * page_size


class Databases:
    """New databases on one throwaway PostgreSQL, and the size of pare's tables in one."""

    def __init__(self, postgres):
        self.pg = postgres
        self.n = 0

    def create(self):
        self.n += 1
        name = f"pare_bench_{self.n}"
        self.pg.sql(f"CREATE DATABASE {name} OWNER {Postgres.USER}")
        url = self.pg.url.replace(f"/{Postgres.DATABASE}?", f"/{name}?")
        return name, url

    def relations(self, name):
        """The sum of pg_total_relation_size over the tables in the database's own schemas."""
        return int(self.pg.sql(
            "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE c.relkind IN ('r', 'p', 'm') AND n.nspname NOT IN ('pg_catalog', 'information_schema') "
            "AND n.nspname NOT LIKE 'pg_toast%'", database=name))


def postgres_cpu(pg):
    """CPU seconds of the postmaster (with its exited backends, reaped) and of its live processes."""
    tick = os.sysconf("SC_CLK_TCK")
    pids = pg.pids()
    if not pids:
        return 0.0
    postmaster = pids[0]
    fields = Path(f"/proc/{postmaster}/stat").read_text().rsplit(")", 1)[1].split()
    reaped = (int(fields[13]) + int(fields[14])) / tick  # cutime, cstime
    return cpu_seconds(pids) + reaped


def fmt_ms(us):
    return "—" if us is None else f"{us / 1000:.2f} ms"


def replay_part(args, builds, files, stub_port, work, databases, pg):
    rows, sizes = [], []
    n = args.replicas
    setups = [
        ("one pare, SQLite", "sqlite", 1, False, None),
        ("one pare, SQLite, behind nginx", "sqlite", 1, True, None),
        (f"{n} replicas, PostgreSQL, nginx sticky (client address)", "postgres", n, True, "client"),
        (f"{n} replicas, PostgreSQL, nginx round-robin", "postgres", n, True, None),
    ]
    runs = [(setup, build) for setup in setups for build in builds]
    for i, ((label, backend, replicas, nginx, sticky), (build, binary)) in enumerate(runs):
        if backend == "sqlite":
            archive = work / f"replay-{i}" / "archive"
            size = lambda: sqlite_bytes(archive)  # noqa: E731
        else:
            db, archive = databases.create()
            size = lambda db=db: databases.relations(db)  # noqa: E731
        setup = Setup(binary, work / f"replay-{i}", stub_port, str(archive), replicas, nginx, sticky, args.window)
        try:
            setup.warm_up()
            # pare's tables exist and hold the warm-up requests: what the replay adds is its own.
            size_before = size()
            before, pg_before = setup.pare_cpu(), postgres_cpu(pg)
            groups, n_requests, _ = rs.replay(files, stub_port, setup.port, setup.replicas[0].process.pid)
            cpu, pg_cpu = setup.pare_cpu() - before, postgres_cpu(pg) - pg_before
            counters = [setup.counter(c) for c in ("pare_epochs_total", "pare_stale_state_total", "pare_caught_up_total")]
            size_after = size()
        finally:
            setup.stop()
        warm = groups["warm<200KB"]
        pg_per_request = pg_cpu / n_requests if backend == "postgres" else None
        rows.append((label, build, n_requests, rs.pct(warm, 50), rs.pct(warm, 99), *counters, cpu, pg_per_request))
        if build == builds[0][0] and (backend, nginx, sticky) in (("sqlite", False, None), ("postgres", True, "client")):
            what = "SQLite (pages in use)" if backend == "sqlite" else "PostgreSQL (pg_total_relation_size of pare's tables)"
            sizes.append((what, n_requests, size_after, size_after - size_before))
        print(f"replay: {label} ({build}): {n_requests} requests done", file=sys.stderr)
    return rows, sizes


def hey(url, body_file, seconds, concurrency):
    """requests/s, p99 in ms and the answers' status counts of a `hey` run (its per-request CSV)."""
    out = subprocess.run(
        ["hey", "-z", f"{seconds}s", "-c", str(concurrency), "-m", "POST", "-T", "application/json",
         "-D", str(body_file), "-o", "csv", f"{url}/v1/chat/completions"],
        capture_output=True, text=True, timeout=seconds + 60,
    ).stdout
    rows = [line.split(",") for line in out.splitlines()[1:] if line.strip()]
    latencies = [float(r[0]) * 1000 for r in rows]
    codes = {}
    for r in rows:
        codes[int(r[6])] = codes.get(int(r[6]), 0) + 1
    return len(rows) / seconds, rs.pct(latencies, 99), codes


def load_part(args, builds, body_file, stub_port, work, databases, pg):
    rows = []
    setups = [("one pare, SQLite", "sqlite", 1, False),
              (f"{args.replicas} replicas, PostgreSQL, nginx round-robin", "postgres", args.replicas, True)]
    runs = [(setup, build) for setup in setups for build in builds]
    for i, ((label, backend, replicas, nginx), (build, binary)) in enumerate(runs):
        archive = work / f"load-{i}" / "archive" if backend == "sqlite" else databases.create()[1]
        setup = Setup(binary, work / f"load-{i}", stub_port, str(archive), replicas, nginx, None, args.window)
        try:
            setup.warm_up()
            pare_before, pg_before = setup.pare_cpu(), postgres_cpu(pg)
            rps, p99, codes = hey(f"http://127.0.0.1:{setup.port}", body_file, args.load_seconds, args.load_concurrency)
            pare_cpu, pg_cpu = setup.pare_cpu() - pare_before, postgres_cpu(pg) - pg_before
        finally:
            setup.stop()
        rows.append((label, build, rps, p99, codes, pare_cpu, pg_cpu if backend == "postgres" else None,
                     rps * args.load_seconds))
        print(f"load: {label} ({build}): {rps:.0f} requests/s", file=sys.stderr)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("binary")
    ap.add_argument("--baseline", default=None, help="another build run beside it in every setup (e.g. /work/baseline/pare)")
    ap.add_argument("--replicas", type=int, default=2, help="replicas on PostgreSQL (default 2)")
    ap.add_argument("--sessions", nargs="*", default=None, help="session files or directories (default: BENCHMARKS.md's set)")
    ap.add_argument("--max-sessions", type=int, default=10, help="at most the first N session files (default 10)")
    ap.add_argument("--window", type=int, default=32768, help="the models' context window (default 32768: epochs happen)")
    ap.add_argument("--load-seconds", type=int, default=20)
    ap.add_argument("--load-concurrency", type=int, default=8)
    ap.add_argument("--load-request", default=None, help="the body the load posts (default: a mid-size request of the first session)")
    ap.add_argument("--pg-setting", action="append", default=[], metavar="NAME=VALUE",
                    help="a PostgreSQL server setting (-c), e.g. synchronous_commit=off; repeatable")
    ap.add_argument("--keep", default=None, help="leave the logs and archives in this new directory")
    args = ap.parse_args()
    if args.sessions:
        files = rs.session_files(args.sessions, args.max_sessions)
    else:
        files = [f for directory, n in DEFAULT_SESSIONS for f in rs.session_files([directory], n)][: args.max_sessions]
    if not files:
        sys.exit("no session files (unpack the corpora: zstd -dc sessions.tar.zst | tar -x -C /tmp/corpus, "
                 "zstd -dc long.tar.zst | tar -x -C /tmp/long)")
    work = Path(args.keep or tempfile.mkdtemp(prefix="pare-fleet-bench-"))
    if work.exists() and any(work.iterdir()):
        sys.exit(f"--keep {work}: not empty")
    work.mkdir(parents=True, exist_ok=True)

    stub = ThreadingHTTPServer(("127.0.0.1", 0), rs.Stub)
    stub.daemon_threads = True
    Thread(target=stub.serve_forever, daemon=True).start()
    stub_port = stub.server_address[1]
    pg = Postgres(work / "postgres", settings=args.pg_setting)
    try:
        databases = Databases(pg)
        builds = [("this build", args.binary)] + ([("baseline", args.baseline)] if args.baseline else [])
        replay_rows, sizes = replay_part(args, builds, files, stub_port, work, databases, pg)
        if args.load_request:
            body = Path(args.load_request).read_bytes().strip()
        else:
            lines = [l for l in files[0].read_text().splitlines() if l.strip()]
            body = lines[len(lines) // 2].encode()
        body_file = work / "load-request.json"
        body_file.write_bytes(body)
        load_rows = load_part(args, builds, body_file, stub_port, work, databases, pg)
    finally:
        pg.stop()
        stub.shutdown()

    n_requests = replay_rows[0][2]
    print(f"\nReplay: {len(files)} sessions, {n_requests} requests, window {args.window}, durability strict.\n")
    print("| setup | build | warm < 200 KB added p50 | p99 | epochs started | compacted twice | caught up | pare CPU | PostgreSQL CPU per request |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, build, n, p50, p99, epochs, stale, caught, cpu, pg in replay_rows:
        pg_text = "—" if pg is None else f"{pg * 1000:.2f} ms"
        print(f"| {label} | {build} | {fmt_ms(p50)} | {fmt_ms(p99)} | {epochs} | {stale} | {caught} | {cpu:.2f} s | {pg_text} |")
    print(f"\nLoad: hey -z {args.load_seconds}s -c {args.load_concurrency}, one {len(body) / 1024:.0f} KB request posted over and over.\n")
    print("| setup | build | requests/s | p99 | answers | pare CPU | PostgreSQL CPU | per request | requests/s per PostgreSQL core |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, build, rps, p99, codes, pare_cpu, pg_cpu, n in load_rows:
        answers = ", ".join(f"{k} × {c}" for c, k in sorted(codes.items()))
        if pg_cpu is None:
            pg_text = per_request = per_core = "—"
        else:
            pg_text = f"{pg_cpu:.2f} s"
            per_request = f"{pg_cpu / n * 1000:.2f} ms" if n else "—"
            per_core = f"{n / pg_cpu:.0f}" if pg_cpu else "—"
        print(f"| {label} | {build} | {rps:.0f} | {fmt_ms(None if p99 is None else p99 * 1000)} | {answers} | "
              f"{pare_cpu:.2f} s | {pg_text} | {per_request} | {per_core} |")
    print(f"\nArchive of the replay ({n_requests} requests), measured with pare running:\n")
    print("| backend | after the replay | added by the replay | per archived request |")
    print("|---|---|---|---|")
    for label, n, total, added in sizes:
        print(f"| {label} | {total:,} B | {added:,} B | {added / n:,.0f} B |")
    print(f"\nlogs and archives: {work}", file=sys.stderr)


if __name__ == "__main__":
    main()
