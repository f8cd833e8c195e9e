#!/usr/bin/env bash
# Check deploy/pare.service with systemd-analyze (no systemd as PID 1 needed): `verify` must print
# nothing (it exits 0 on an unknown key, so any output is a failure) and `security --offline` must rate
# its exposure at most 2.0 of 10. ExecStart points at the built binary, since verify checks it exists.
# Installs Debian's systemd package when systemd-analyze is missing (as root).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if ! command -v systemd-analyze >/dev/null; then
    echo "deploy: installing Debian's systemd package for systemd-analyze"
    apt-get update -qq && apt-get install -y -qq --no-install-recommends systemd >/dev/null
fi
cargo build --quiet --bin pare
target_dir="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')"
unit_dir="$(mktemp -d)"
trap 'rm -rf "$unit_dir"' EXIT
sed "s#/usr/local/bin/pare#$target_dir/debug/pare#" deploy/pare.service > "$unit_dir/pare.service"

out="$(systemd-analyze verify "$unit_dir/pare.service" 2>&1)" || { echo "$out"; exit 1; }
if [[ -n "$out" ]]; then
    echo "$out"
    exit 1
fi
# The threshold is on systemd-analyze's 0–100 scale: 20 is an exposure of 2.0.
systemd-analyze security --offline=yes --threshold=20 "$unit_dir/pare.service" | tail -1
echo "deploy/pare.service: ok"
