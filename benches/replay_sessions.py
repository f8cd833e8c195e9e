#!/usr/bin/env python3
"""Real sessions through `pare serve`, side by side with direct calls, and a burst of large sessions.

Usage: benches/replay_sessions.py PARE_BINARY [--small-requests N] [--sessions DIR_OR_FILE ...]
                                   [--max-sessions N] [--window TOKENS] [--burst N]
                                   [--burst-kb KB] [--burst-source FILE] [--settle SECONDS]
                                   [--passthrough] [--keep-log FILE] [--json]

- replay: every request of each chosen session file (one chat body per line) is sent to a zero-delay
  stub upstream directly and through pare, the two interleaved (the order alternates), one at a time.
  The stub answers each request with the assistant message the session's next request carries, so pare
  tracks the session as it would a live agent. Reported: pare's added latency (through − direct)
  p50/p99 for warm requests under 200 KB (the session's 2nd request on, no epoch started), for warm
  requests of 200 KB or more, for epoch requests (the `x-pare-epoch` header went up) and for first
  requests; pare's RSS idle, after the replay, and its peak (VmHWM).
- small requests: pare's idle RSS, then N small distinct requests (the first one loads the encoding's
  tables) with their added latency, and the RSS after.
- burst: N distinct sessions of one ~KB request each (a long corpus request with a unique first user
  message), 8 at a time; pare's peak RSS, and every second from the burst's start until --settle
  seconds after its end its RSS and the records waiting for the archive writer.

Loopback only; every loop is bounded by the session files and N. Numbers are printed, never asserted.
"""

import argparse
import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ANSWERS = {}  # request id (x-bench-answer) -> assistant message
ANSWERS_LOCK = threading.Lock()
OK = {"role": "assistant", "content": "ok"}


class Stub(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # The head and the body are two writes: without TCP_NODELAY, delayed ACKs stall the second.
    disable_nagle_algorithm = True

    def do_POST(self):
        n = int(self.headers.get("content-length", "0"))
        self.rfile.read(n)
        with ANSWERS_LOCK:
            message = ANSWERS.get(self.headers.get("x-bench-answer", ""), OK)
        body = json.dumps({"id": "chatcmpl-bench", "object": "chat.completion", "model": "bench",
                           "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                           "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self.send_response(404)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def rss_kib(pid, field="VmRSS"):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def cpu_secs(pid):
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values, p):
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def post(conn, body, headers, path="/v1/chat/completions"):
    start = time.perf_counter_ns()
    conn.request("POST", path, body=body, headers=headers)
    response = conn.getresponse()
    response.read()
    elapsed = (time.perf_counter_ns() - start) / 1000
    return elapsed, response


def session_files(paths, limit):
    files = []
    for p in map(Path, paths):
        files += sorted(p.rglob("*.jsonl")) if p.is_dir() else [p]
    return files[:limit]


def start_pare(binary, stub_port, workdir, extra, window=None):
    config = Path(workdir) / "pare.yaml"
    config.write_text("budget:\n  detect_window: false\n" + (f"  default_context_window: {window}\n" if window else ""))
    cmd = [binary, "serve", "--config", str(config), "--listen", "127.0.0.1:0",
           "--upstream", f"http://127.0.0.1:{stub_port}/v1", "--archive", str(Path(workdir) / "archive")] + extra
    # pare's log goes to a file, as under a service manager: a thread of this process reading it would
    # wake at each access line, just as the client reads its answer, and take the interpreter's lock
    # from it (adding tens of microseconds to the requests sent through pare, not to the direct ones).
    log_path = Path(workdir) / "pare.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    # pare logs the address it listens on.
    deadline = time.time() + 30
    while time.time() < deadline and proc.poll() is None:
        for line in log_path.read_text(errors="replace").splitlines():
            if "127.0.0.1:" in line and ("listen" in line or "serving" in line):
                return proc, int(re.findall(r"127\.0\.0\.1:(\d+)", line)[0])
        time.sleep(0.05)
    proc.kill()
    sys.exit("pare did not report its address")


def replay(files, stub_port, pare_port, pid):
    direct = http.client.HTTPConnection("127.0.0.1", stub_port)
    through = http.client.HTTPConnection("127.0.0.1", pare_port)
    groups = {"warm<200KB": [], "warm>=200KB": [], "epoch": [], "first": []}
    cpu_before = cpu_secs(pid)
    n = 0
    for f in files:
        lines = [l for l in f.read_text().splitlines() if l.strip()]
        epoch = 0
        for k, line in enumerate(lines):
            body = line.encode()
            answer_id = f"{f.name}:{k}"
            if k + 1 < len(lines):
                nxt = json.loads(lines[k + 1]).get("messages", [])
                answer = next((m for m in reversed(nxt[:len(json.loads(line).get("messages", [])) + 1])
                               if m.get("role") == "assistant"), OK)
                with ANSWERS_LOCK:
                    ANSWERS[answer_id] = answer
            headers = {"content-type": "application/json", "x-bench-answer": answer_id}
            if n % 2 == 0:
                t_direct, _ = post(direct, body, headers)
                t_pare, response = post(through, body, headers)
            else:
                t_pare, response = post(through, body, headers)
                t_direct, _ = post(direct, body, headers)
            n += 1
            new_epoch = int(response.getheader("x-pare-epoch") or epoch)
            added = t_pare - t_direct
            if k == 0:
                groups["first"].append(added)
            elif new_epoch > epoch:
                groups["epoch"].append(added)
            elif len(body) < 200 * 1024:
                groups["warm<200KB"].append(added)
            else:
                groups["warm>=200KB"].append(added)
            epoch = new_epoch
    cpu = cpu_secs(pid) - cpu_before
    return groups, n, cpu


def burst(n, kb, source, pare_port, pid, settle):
    # The session's largest request; when it is smaller than the target, its longest tool output is
    # repeated until the body weighs about `kb` (the corpus's requests stop near 400 KB).
    base = max((l for l in source.read_text().splitlines() if l.strip()), key=len)
    body = json.loads(base)
    first_user = next(i for i, m in enumerate(body["messages"]) if m.get("role") == "user")
    longest = max((i for i, m in enumerate(body["messages"]) if isinstance(m.get("content"), str)),
                  key=lambda i: len(body["messages"][i]["content"]))
    text = body["messages"][longest]["content"]
    missing = kb * 1024 - len(base)
    if missing > 0:
        body["messages"][longest] = dict(body["messages"][longest],
                                         content=text + ("\n" + text) * (missing // (len(text) + 1) + 1))

    def one(i):
        b = dict(body)
        b["messages"] = list(body["messages"])
        m = dict(b["messages"][first_user])
        m["content"] = f"[burst session {i}] " + (m["content"] if isinstance(m["content"], str) else "")
        b["messages"][first_user] = m
        data = json.dumps(b).encode()
        conn = http.client.HTTPConnection("127.0.0.1", pare_port, timeout=120)
        post(conn, data, {"content-type": "application/json"})
        conn.close()
        return len(data)

    # Every second from the burst's start to the end of --settle: RSS and the records waiting for the
    # archive writer (/_pare/health).
    trace, done = [], threading.Event()

    def sample():
        conn = http.client.HTTPConnection("127.0.0.1", pare_port, timeout=10)
        while not done.wait(1):
            conn.request("GET", "/_pare/health")
            health = json.loads(conn.getresponse().read())
            trace.append((round(time.time() - start, 1), round(rss_kib(pid) / 1024, 1),
                          (health.get("archive") or {}).get("queue_depth")))

    start = time.time()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with ThreadPoolExecutor(8) as pool:
        sizes = list(pool.map(one, range(n)))
    took = time.time() - start
    rss_end = rss_kib(pid)
    time.sleep(settle)
    done.set()
    sampler.join()
    conn = http.client.HTTPConnection("127.0.0.1", pare_port)
    conn.request("GET", "/_pare/health")
    health = json.loads(conn.getresponse().read())
    archive = health.get("archive") or {}
    return {"sessions": n, "mean_kb": sum(sizes) / len(sizes) / 1024, "seconds": round(took, 1),
            "memory": health.get("memory"), "archive_lost": archive.get("lost_records"),
            "archive_committed": archive.get("committed_records"), "archive_queue_waits": archive.get("queue_waits"),
            "peak_mib": rss_kib(pid, "VmHWM") / 1024, "rss_end_of_burst_mib": rss_end / 1024,
            f"rss_after_{int(settle)}s_mib": rss_kib(pid) / 1024,
            "trace_s_rss_mib_queue": trace}


def passthrough(files, stub_port, pare_port):
    """The same request bodies under 200 KB sent to a path pare passes through untouched (no
    archive, no parse, no compaction), direct and through pare in turn: the floor under the warm
    requests' added latency (the extra hop through hyper and reqwest)."""
    direct = http.client.HTTPConnection("127.0.0.1", stub_port)
    through = http.client.HTTPConnection("127.0.0.1", pare_port)
    headers = {"content-type": "application/json"}
    added = []
    for f in files:
        for line in (l for l in f.read_text().splitlines() if l.strip()):
            body = line.encode()
            if len(body) >= 200 * 1024:
                continue
            if len(added) % 2 == 0:
                t_direct, _ = post(direct, body, headers, PASSTHROUGH_PATH)
                t_pare, _ = post(through, body, headers, PASSTHROUGH_PATH)
            else:
                t_pare, _ = post(through, body, headers, PASSTHROUGH_PATH)
                t_direct, _ = post(direct, body, headers, PASSTHROUGH_PATH)
            added.append(t_pare - t_direct)
    return {"n": len(added), "p50_us": pct(added, 50), "p99_us": pct(added, 99)}


# A path pare forwards as it is (only the conversation paths are compacted).
PASSTHROUGH_PATH = "/v1/embeddings"


def small_requests(n, stub_port, pare_port, pid):
    """N small distinct requests, direct and through pare in turn: the first one loads the encoding."""
    direct = http.client.HTTPConnection("127.0.0.1", stub_port)
    through = http.client.HTTPConnection("127.0.0.1", pare_port)
    added = []
    for i in range(n):
        body = json.dumps({"model": "gpt-4o", "messages": [{"role": "system", "content": "You are a coding agent."},
                                                            {"role": "user", "content": f"List the files {i}."}]}).encode()
        t_direct, _ = post(direct, body, {"content-type": "application/json"})
        t_pare, _ = post(through, body, {"content-type": "application/json"})
        added.append(round((t_pare - t_direct) / 1000, 2))
    return {"added_ms": added, "rss_after_mib": rss_kib(pid) / 1024}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("--sessions", nargs="*", default=[])
    ap.add_argument("--max-sessions", type=int, default=20)
    ap.add_argument("--small-requests", type=int, default=0, help="N small requests first (the first loads the tables)")
    ap.add_argument("--burst", type=int, default=0)
    ap.add_argument("--burst-kb", type=int, default=850)
    ap.add_argument("--burst-source", default=None, help="session file whose request near --burst-kb is copied")
    ap.add_argument("--settle", type=float, default=30)
    ap.add_argument("--serve-arg", action="append", default=[])
    ap.add_argument("--window", type=int, default=None, help="the models' context window (more epochs when small)")
    ap.add_argument("--passthrough", action="store_true",
                    help="also send the sessions' bodies under 200 KB to a pass-through path (the hop's floor)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep-log", default=None, help="copy pare's log here when done")
    args = ap.parse_args()

    stub = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    out = {}
    with tempfile.TemporaryDirectory() as workdir:
        proc, port = start_pare(args.binary, stub.server_port, workdir, args.serve_arg, args.window)
        try:
            time.sleep(1)
            out["idle_rss_mib"] = rss_kib(proc.pid) / 1024
            if args.small_requests:
                out["small_requests"] = small_requests(args.small_requests, stub.server_port, port, proc.pid)
            files = session_files(args.sessions, args.max_sessions)
            if files:
                groups, n, cpu = replay(files, stub.server_port, port, proc.pid)
                out["replay"] = {"sessions": len(files), "requests": n, "pare_cpu_s": round(cpu, 2)}
                for name, values in groups.items():
                    out["replay"][name] = {"n": len(values), "p50_us": pct(values, 50), "p99_us": pct(values, 99)}
                out["rss_after_replay_mib"] = rss_kib(proc.pid) / 1024
                out["peak_rss_replay_mib"] = rss_kib(proc.pid, "VmHWM") / 1024
                if args.passthrough:
                    out["passthrough<200KB"] = passthrough(files, stub.server_port, port)
            if args.burst:
                source = Path(args.burst_source) if args.burst_source else files[0]
                out["burst"] = burst(args.burst, args.burst_kb, source, port, proc.pid, args.settle)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            if args.keep_log:
                shutil.copy(Path(workdir) / "pare.log", args.keep_log)
    stub.shutdown()
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
