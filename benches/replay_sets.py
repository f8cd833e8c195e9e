#!/usr/bin/env python3
"""Runs of the real-session replay for several pare binaries in turn, and each one's medians.

Usage: benches/replay_sets.py RUNS NAME=BINARY [NAME=BINARY ...] -- REPLAY_ARGS...

Each of RUNS rounds runs `benches/replay_sessions.py BINARY --passthrough --json REPLAY_ARGS...`
once per binary, the order rotating by one each round (round 1 starts with the first binary,
round 2 with the second…), so that no binary always runs right after another one's run. A line per
run, then per binary the medians over its runs: warm < 200 KB p50 (with its range), its p99, warm
≥ 200 KB p50, the pass-through hop's p50 and pare's CPU time over the replay. The host moves all
of these between runs: compare binaries within one set, not across sets.

Example: benches/replay_sets.py 8 before=/tmp/pare-a after=target/release/pare -- \
             --small-requests 1 --sessions /tmp/corpus/sessions/openhands/...jsonl ...
"""

import json
import statistics
import subprocess
import sys
from pathlib import Path

REPLAY = Path(__file__).with_name("replay_sessions.py")


def med(values):
    """The median of the values that are there (a replay without ≥ 200 KB requests has none)."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def main():
    args = sys.argv[1:]
    if "--" not in args or len(args) < 3:
        sys.exit(__doc__)
    split = args.index("--")
    runs, binaries, replay_args = int(args[0]), [a.split("=", 1) for a in args[1:split]], args[split + 1 :]
    results = {name: [] for name, _ in binaries}
    for i in range(runs):
        for name, binary in binaries[i % len(binaries) :] + binaries[: i % len(binaries)]:
            out = subprocess.run(
                [sys.executable, str(REPLAY), binary, "--passthrough", "--json", *replay_args],
                capture_output=True,
                text=True,
                check=True,
            )
            r = json.loads(out.stdout)
            results[name].append(r)
            warm = r["replay"]["warm<200KB"]
            print(
                f"{i} {name}: warm p50 {warm['p50_us']:.0f} µs p99 {warm['p99_us'] / 1000:.2f} ms, "
                f"pass-through p50 {r['passthrough<200KB']['p50_us']:.0f} µs, pare CPU {r['replay']['pare_cpu_s']} s",
                flush=True,
            )
    for name, rs in results.items():
        p50 = [r["replay"]["warm<200KB"]["p50_us"] for r in rs]
        print(
            f"{name}: warm < 200 KB p50 {statistics.median(p50):.0f} µs ({min(p50):.0f}–{max(p50):.0f}), "
            f"p99 {med(r['replay']['warm<200KB']['p99_us'] for r in rs) / 1000:.2f} ms, "
            f"≥ 200 KB p50 {med(r['replay']['warm>=200KB']['p50_us'] for r in rs):.0f} µs, "
            f"pass-through p50 {med(r['passthrough<200KB']['p50_us'] for r in rs):.0f} µs, "
            f"pare CPU {med(r['replay']['pare_cpu_s'] for r in rs):.2f} s"
        )


if __name__ == "__main__":
    main()
