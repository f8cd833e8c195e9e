"""Reading a `pare serve` process's JSON log (stderr): the e2e fixtures and the benches share it."""

import json


def follow(stream, lines, lock, on_listening, copy=None):
    """Append each log line of `stream` to `lines` (under `lock`) as an event dict; call
    `on_listening(addr)` when pare says it listens. `copy`, when given, gets every raw line."""
    for line in stream:
        if copy is not None:
            copy.write(line)
            copy.flush()
        try:
            event = json.loads(line)
        except ValueError:
            event = {"message": line.rstrip()}
        with lock:
            lines.append(event)
        if event.get("message") == "pare listening":
            on_listening(event["addr"])


def access_lines(lines, lock):
    """The per-request lines pare logged so far."""
    with lock:
        return [e for e in lines if e.get("target") == "pare::access"]
