#!/usr/bin/env bash
# The end-to-end suite: real clients (the official openai SDK, Hermes Agent) against a release-free
# debug build of pare in front of a scripted stub upstream. Creates its own venv in .venv-e2e.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
venv="$root/.venv-e2e"
python="${PYTHON:-$(command -v python3.11 || command -v python3)}"

if [[ ! -x "$venv/bin/python" ]]; then
    echo "e2e: creating $venv with $python"
    "$python" -m venv "$venv"
fi
stamp="$venv/.requirements.sha256"
want="$(sha256sum tests/e2e/requirements.txt | cut -d' ' -f1)"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
    echo "e2e: installing tests/e2e/requirements.txt"
    timeout 900 "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r tests/e2e/requirements.txt
    echo "$want" > "$stamp"
fi

timeout 900 cargo build --quiet --bin pare
export PARE_BIN="$root/target/debug/pare"

cd tests/e2e
exec timeout 900 "$venv/bin/python" -m pytest -p no:cacheprovider -q "$@"
