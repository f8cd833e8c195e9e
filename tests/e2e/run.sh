#!/usr/bin/env bash
# The end-to-end suite: real clients (the official openai, anthropic, google-genai and mcp SDKs, Hermes
# Agent, Codex CLI, Claude Code, Gemini CLI, a LiteLLM proxy, Chromium) against a debug build of pare in
# front of scripted stub upstreams. Creates its own venvs (.venv-e2e; .venv-litellm for LiteLLM, whose
# pins conflict with Hermes'; .venv-hermes-mcp for Hermes with its `mcp` extra) and npm prefix
# tests/e2e/.node, each reinstalled only when its pin list changes.
# PARE_BIN, when set, names the pare binary to test; else it is built (honouring CARGO_TARGET_DIR).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
venv="$root/.venv-e2e"
python="${PYTHON:-$(command -v python3.11 || command -v python3)}"

# A venv at $1 with the pins of requirements file $2, reinstalled only when that file changes.
venv_with() {
    local dir="$1" requirements="$2"
    if [[ ! -x "$dir/bin/python" ]]; then
        echo "e2e: creating $dir with $python"
        "$python" -m venv "$dir"
    fi
    local stamp="$dir/.requirements.sha256" want
    want="$(sha256sum "$requirements" | cut -d' ' -f1)"
    if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
        echo "e2e: installing $requirements"
        timeout 900 "$dir/bin/python" -m pip install --quiet --disable-pip-version-check -r "$requirements"
        echo "$want" > "$stamp"
        echo "e2e: $(du -sh "$dir" | cut -f1) in $dir"
    fi
}
venv_with "$venv" tests/e2e/requirements.txt
# test_litellm_gateway.py runs a LiteLLM proxy from a venv of its own (its pins conflict with Hermes').
venv_with "$root/.venv-litellm" tests/e2e/requirements-litellm.txt
export LITELLM_BIN="$root/.venv-litellm/bin/litellm"
# test_hermes_mcp.py runs Hermes with its `mcp` extra, whose MCP SDK pin conflicts with test_mcp.py's.
venv_with "$root/.venv-hermes-mcp" tests/e2e/requirements-hermes-mcp.txt
export HERMES_MCP_BIN="$root/.venv-hermes-mcp/bin/hermes"

# test_ui_chromium.py drives Debian's headless Chromium (CI runs as root on Debian).
if [[ ! -x /usr/bin/chromium ]] && command -v apt-get >/dev/null; then
    echo "e2e: installing chromium with apt-get"
    timeout 900 apt-get install -y -qq chromium || { apt-get update -qq && timeout 900 apt-get install -y -qq chromium; }
fi

node_prefix="$root/tests/e2e/.node"
node_stamp="$node_prefix/.packages.sha256"
want="$(sha256sum tests/e2e/node-packages.txt | cut -d' ' -f1)"
if [[ ! -f "$node_stamp" || "$(cat "$node_stamp")" != "$want" ]]; then
    command -v npm >/dev/null || { echo "e2e: npm is required (Codex CLI, Claude Code)" >&2; exit 1; }
    mapfile -t packages < <(grep -v '^\s*\(#\|$\)' tests/e2e/node-packages.txt)
    echo "e2e: installing ${packages[*]} into $node_prefix"
    mkdir -p "$node_prefix"
    timeout 900 npm install --prefix "$node_prefix" --no-save --no-audit --no-fund --loglevel=error "${packages[@]}"
    echo "$want" > "$node_stamp"
    echo "e2e: $(du -sh "$node_prefix" | cut -f1) in $node_prefix"
fi

if [[ -z "${PARE_BIN:-}" ]]; then
    PARE_BIN="$(timeout 900 cargo build --quiet --bin pare --message-format=json \
        | "$venv/bin/python" -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "pare":
        print(m["executable"])')"
fi
export PARE_BIN
echo "e2e: pare at $PARE_BIN"

cd tests/e2e
exec timeout 900 "$venv/bin/python" -m pytest -p no:cacheprovider -q "$@"
