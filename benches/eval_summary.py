#!/usr/bin/env python3
"""Side-by-side figures from `pare eval --json` reports: per source, coding (every source but
tau-bench) and all sessions — saved, uncached prefill vs raw, needle recall (kept/needles), requests
over the window (of them, could fit), validity, user + tail kept, determinism.

Usage: benches/eval_summary.py LABEL=REPORT.json [LABEL=REPORT.json ...]
"""

import json
import sys

FIELDS = [
    "sessions", "requests", "tokens_raw", "tokens_forwarded", "uncached_raw", "uncached_forwarded",
    "needles", "needles_kept", "over_window", "over_window_fitting", "valid_forwarded", "preserved",
    "deterministic", "epochs",
]


def total(parts):
    out = {k: 0 for k in FIELDS}
    for p in parts:
        for k in FIELDS:
            out[k] += p.get(k, 0)
    return out


def line(name, m):
    saved = 1 - m["tokens_forwarded"] / m["tokens_raw"] if m["tokens_raw"] else 0.0
    prefill = m["uncached_forwarded"] / m["uncached_raw"] if m["uncached_raw"] else 1.0
    recall = f'{m["needles_kept"] / m["needles"]:.3f} ({m["needles_kept"]}/{m["needles"]})' if m["needles"] else "—"
    valid = m["valid_forwarded"] == m["requests"] and m["preserved"] == m["requests"]
    determ = m["deterministic"] == m["sessions"]
    return (
        f"  {name:<28} {m['sessions']:>4} {saved * 100:6.1f}% {prefill:6.2f}x  {recall:<20} "
        f"over {m['over_window']} ({m['over_window_fitting']} fit)  valid+kept {'100%' if valid else 'NO'}"
        f"  determ {'100%' if determ else 'NO'}  epochs {m['epochs']}"
    )


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for arg in sys.argv[1:]:
        label, path = arg.split("=", 1)
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
        sources = report["sources"]
        print(f"{label}  (split: {report.get('split')})")
        for name in sorted(sources):
            print(line(name, sources[name]))
        print(line("coding", total(m for s, m in sources.items() if s != "tau-bench")))
        print(line("all", total(sources.values())))


if __name__ == "__main__":
    main()
