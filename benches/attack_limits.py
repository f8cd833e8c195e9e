"""The attacks of BENCHMARKS.md's *Limits under attack and at scale* rows on fake content ids, slow
greps, MCP batches of retrieves and compaction's working set, against one `pare serve` binary.

Usage: attack_limits.py PARE_BINARY [fake-ids|grep|mcp-batch|engine|compress|tiny-next]...

Each case starts its own `pare serve` (archive on, in a temporary directory, window 4,096 tokens) in
front of a stub upstream on loopback that answers every chat request with a short text, and prints
one line of figures. Peak memory is the growth of pare's `VmHWM` over the case.
"""
import hashlib, http.client, json, os, socket, subprocess, sys, tempfile, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ANSWER = json.dumps({"id": "c", "object": "chat.completion", "model": "m", "choices": [{"index": 0,
    "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}).encode()


class Stub(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _answer(self, body):
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._answer(b'{"object": "list", "data": [{"id": "m", "object": "model"}]}')

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self._answer(ANSWER)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Pare:
    def __init__(self, binary, stub_port):
        self.dir = tempfile.mkdtemp(prefix="pare-attack-")
        self.port = free_port()
        config = os.path.join(self.dir, "config.yaml")
        with open(config, "w") as f:
            f.write(f"""server:
  listen: 127.0.0.1:{self.port}
upstream:
  url: http://127.0.0.1:{stub_port}
archive:
  enabled: true
  dir: {self.dir}/archive
budget:
  default_context_window: 4096
  output_reserve: 512
  detect_window: false
""")
        self.proc = subprocess.Popen([binary, "serve", "--config", config], stderr=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL)
        for _ in range(200):
            try:
                self.request("GET", "/_pare/health")
                return
            except OSError:
                time.sleep(0.05)
        raise SystemExit("pare did not start")

    def request(self, method, path, body=None, headers=None, timeout=120):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        conn.request(method, path, body=body, headers=headers or {"content-type": "application/json"})
        response = conn.getresponse()
        data = response.read()
        conn.close()
        return response.status, data

    def hwm_kb(self):
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM"):
                    return int(line.split()[1])
        return 0

    def committed(self):
        _, body = self.request("GET", "/_pare/health")
        return json.loads(body)["archive"]["committed_records"]

    def wait_committed(self, n, at_most=120):
        started = time.monotonic()
        while self.committed() < n and time.monotonic() - started < at_most:
            time.sleep(0.01)

    def stop(self):
        self.proc.terminate()
        self.proc.wait(30)


def tool_pair(k, output):
    call = f"call_{k}"
    return [{"role": "assistant", "content": None, "tool_calls": [{"id": call, "type": "function",
             "function": {"name": "bash", "arguments": json.dumps({"command": f"cat f{k}"})}}]},
            {"role": "tool", "tool_call_id": call, "content": output}]


def chat(messages):
    return json.dumps({"model": "m", "messages": messages}).encode()


def session_with(outputs, user):
    messages = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "go"}]
    for k, output in enumerate(outputs):
        messages += tool_pair(k, output)
    messages.append({"role": "user", "content": user})
    return chat(messages)


def content_id(text):
    return "pare:" + hashlib.sha256(text.encode()).hexdigest()[:12]


def fake_ids(pare, n=100_000):
    fake = " ".join(f"pare:{k * 7919 % (1 << 48):012x}" for k in range(n))
    body = session_with([f"output {k}\n" * 200 for k in range(20)], fake)
    started = time.monotonic()
    status, _ = pare.request("POST", "/v1/chat/completions", body, {"content-type": "application/json",
                                                                      "x-pare-session": "attacker"})
    answered = time.monotonic()
    probe = chat([{"role": "user", "content": "a new session"}])
    pare.request("POST", "/v1/chat/completions", probe, {"content-type": "application/json",
                                                         "x-pare-session": "victim"})
    pare.wait_committed(2)
    print(f"fake-ids: {n} ids ({len(body) / 1e6:.1f} MB body, status {status}): answered in {answered - started:.2f} s; "
          f"a new session sent then committed {time.monotonic() - answered:.2f} s later")


def stored_output(pare, size):
    """A `size`-byte output (lines of 4,000 random `a` and `b`) hidden behind a marker and stored; its id."""
    import random
    rng = random.Random(7)
    output = "".join("".join(rng.choice("ab") for _ in range(4000)) + "\n" for _ in range(size // 4001))
    body = session_with([output] + [f"small {k}\n" * 300 for k in range(12)], "go on")
    pare.request("POST", "/v1/chat/completions", body)
    pare.wait_committed(1)
    ident = content_id(output)
    status, _ = pare.request("GET", f"/_pare/retrieve/{ident}?lines=1")
    if status != 200:
        raise SystemExit(f"the output was not stored (retrieve answered {status})")
    return ident, len(output)


def grep(pare, pattern=r"a[ab]{30}b{29}"):
    ident, size = stored_output(pare, 4 << 20)
    from urllib.parse import quote
    results = []
    def one():
        started = time.monotonic()
        status, body = pare.request("GET", f"/_pare/retrieve/{ident}?grep={quote(pattern)}")
        results.append((status, time.monotonic() - started, body.endswith(b"pattern]\n")))
    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    started = time.monotonic()
    pare.request("GET", "/v1/models")
    models = time.monotonic() - started
    for t in threads:
        t.join()
    alone = []
    for _ in range(5):
        started = time.monotonic()
        pare.request("GET", "/v1/models")
        alone.append(time.monotonic() - started)
    print(f"grep: 4 greps of {pattern!r} over {size / 1e6:.1f} MB: GET /v1/models {models * 1e3:.1f} ms beside "
          f"them ({min(alone) * 1e3:.1f} ms alone); greps took {', '.join(f'{r[1]:.2f}' for r in results)} s, "
          f"{sum(r[2] for r in results)} stopped at the time budget")
    long = "a" * (20 << 20)
    started = time.monotonic()
    status, body = pare.request("POST", "/_pare/mcp", json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
        "params": {"name": "retrieve", "arguments": {"id": ident, "grep": long}}}).encode())
    print(f"grep: a 20 MB pattern through MCP: {time.monotonic() - started:.2f} s, answer {len(body):,} bytes")


def mcp_batch(pare, sizes=(100, 32)):
    ident, size = stored_output(pare, 4 << 20)
    for n in sizes:
        before = pare.hwm_kb()
        batch = [{"jsonrpc": "2.0", "id": k, "method": "tools/call",
                  "params": {"name": "retrieve", "arguments": {"id": ident}}} for k in range(n)]
        started = time.monotonic()
        status, body = pare.request("POST", "/_pare/mcp", json.dumps(batch).encode())
        answers = json.loads(body) if status == 200 else []
        answers = answers if isinstance(answers, list) else []
        whole = sum(1 for a in answers if a.get("result", {}).get("isError") is False)
        print(f"mcp-batch: {n} retrieves of a {size / 1e6:.1f} MB content in one batch: status {status}, "
              f"{len(answers)} responses, {whole} answered whole, VmHWM +{(pare.hwm_kb() - before) / 1024:.0f} MiB, "
              f"{time.monotonic() - started:.2f} s")


def tiny_outputs(n):
    messages = [{"role": "user", "content": "go"}]
    for k in range(n):
        messages += tool_pair(k, "ok")
    return messages


def engine(pare, n=120_000, at_once=(1, 3)):
    body = chat(tiny_outputs(n))
    for parallel in at_once:
        before = pare.hwm_kb()
        statuses = []
        def one():
            statuses.append(pare.request("POST", "/v1/chat/completions", body)[0])
        started = time.monotonic()
        threads = [threading.Thread(target=one) for _ in range(parallel)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print(f"engine: {parallel} × {len(body) / 1e6:.1f} MB of {n:,} tiny outputs at once: statuses {sorted(statuses)}, "
              f"VmHWM +{(pare.hwm_kb() - before) / 1024:.0f} MiB, {time.monotonic() - started:.2f} s")


def tiny_next(pare, n=120_000):
    """One body of `n` tiny outputs, then two new sessions one after the other: how long after the
    big one was answered each new session is answered, and when both are committed."""
    body = chat(tiny_outputs(n))
    started = time.monotonic()
    status, _ = pare.request("POST", "/v1/chat/completions", body, {"content-type": "application/json",
                                                                      "x-pare-session": "big"})
    answered = time.monotonic()
    times = []
    for k in range(2):
        probe = chat([{"role": "user", "content": f"a new session {k}"}])
        pare.request("POST", "/v1/chat/completions", probe, {"content-type": "application/json",
                                                             "x-pare-session": f"next-{k}"})
        times.append(time.monotonic() - answered)
    def stored(sessions):
        import sqlite3
        db = sqlite3.connect(f"file:{pare.dir}/archive/archive.sqlite3?mode=ro", uri=True)
        try:
            return db.execute(f"SELECT count(*) FROM exchanges WHERE session IN ({sessions})").fetchone()[0]
        finally:
            db.close()

    def wait_stored(sessions, n, at_most=120):
        while stored(sessions) < n and time.monotonic() - answered < at_most:
            time.sleep(0.01)
        return time.monotonic() - answered

    committed = wait_stored("'next-0', 'next-1'", 2)
    big = wait_stored("'big'", 1)
    print(f"tiny-next: {len(body) / 1e6:.1f} MB of {n:,} tiny outputs (status {status}) answered in "
          f"{answered - started:.2f} s; the next two sessions answered {times[0]:.2f} and {times[1]:.2f} s later, "
          f"committed {committed:.2f} s later; the big body committed {big:.2f} s later")


def compress(pare, n=120_000):
    body = json.dumps({"model": "m", "messages": tiny_outputs(n)}).encode()
    before = pare.hwm_kb()
    started = time.monotonic()
    status, _ = pare.request("POST", "/v1/compress", body)
    print(f"compress: {len(body) / 1e6:.1f} MB of {n:,} tiny outputs: status {status}, "
          f"VmHWM +{(pare.hwm_kb() - before) / 1024:.0f} MiB, {time.monotonic() - started:.2f} s")


CASES = {"fake-ids": fake_ids, "grep": grep, "mcp-batch": mcp_batch, "engine": engine, "compress": compress,
         "tiny-next": tiny_next}


def main():
    binary, cases = sys.argv[1], sys.argv[2:] or list(CASES)
    stub = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    for case in cases:
        pare = Pare(binary, stub.server_address[1])
        try:
            CASES[case](pare)
        finally:
            pare.stop()
    stub.shutdown()


if __name__ == "__main__":
    main()
