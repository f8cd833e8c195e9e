#!/usr/bin/env bash
# Instructions per operation on the engine bench's request, counted with callgrind (deterministic on a
# shared machine): each operation runs N = 1 and N = 11 times; the difference over 10 cancels the
# building of the request and the engine. Needs valgrind (`apt-get install valgrind`).
#
#   benches/instructions.sh [OP...]     default: every operation of examples/instructions.rs
#
# compact-pool also reports what stays on the calling thread (callgrind --separate-threads=yes).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "valgrind not found (apt-get install valgrind)" >&2; exit 1; }
cargo build --release --example instructions >&2
bin=target/release/examples/instructions
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
ops=("$@")
[ ${#ops[@]} -gt 0 ] || ops=(serde-parse serde-roundtrip parse archive-split archive-split-along compact compact-pool)
# Run $op $1 times under callgrind, one profile per thread.
run() { valgrind --tool=callgrind --separate-threads=yes --callgrind-out-file="$out/cg.$1" "$bin" "$op" "$1" 2>/dev/null; }
millions() { awk -v n="$1" 'BEGIN { printf "%.2f", n / 1e6 }'; }
# Instructions in the profiles of the run of $1 repetitions: every thread, or only the calling one (-01).
sum() { cat "$out"/cg."$1"-${2:-*} | awk '/^summary:/ { s += $2 } END { print s }'; }
for op in "${ops[@]}"; do
  rm -f "$out"/cg.*
  run 1
  run 11
  total=$(( ($(sum 11) - $(sum 1)) / 10 ))
  line=$(printf '%-16s %6s M instructions' "$op" "$(millions "$total")")
  if [ "$op" = compact-pool ]; then
    calling=$(( ($(sum 11 01) - $(sum 1 01)) / 10 ))
    line+=$(printf ' (calling thread %s M)' "$(millions "$calling")")
  fi
  echo "$line"
done
