"""The audit UI in a real browser: traffic through `pare serve`, then headless Chromium opens the
sessions index, a session and a request, takes a screenshot of each and dumps the DOM it built.

Set UI_SCREENSHOT_DIR to keep the screenshots (docs/ui-*.png are made this way)."""

import json
import os
import re
import shutil
import subprocess
import urllib.request

import pytest

from conftest import PareProcess, wait_until

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SESSION = "e2e-ui-coding"
HOSTILE_SESSION = "e2e-ui-hostile"
HOSTILE = "<script>document.title='PWNED'</script><img src=x onerror=\"document.body.dataset.pwned=1\"> & done"

CONFIG = """
compaction:
  mode: eager
budget:
  default_context_window: 4096
  output_reserve: 512
  detect_window: false
"""

SOURCE = "\n".join(
    [
        '"""Inventory: stock levels and restocking."""',
        "",
        "from dataclasses import dataclass, field",
        "",
        "",
        "@dataclass",
        "class Item:",
        "    sku: str",
        "    name: str",
        "    quantity: int = 0",
        "    reorder_level: int = 5",
        "",
    ]
    + [
        line
        for k in range(14)
        for line in (
            f"def helper_{k}(items, sku):",
            f'    """Look up {k}: the item with `sku`, or None."""',
            "    for item in items:",
            "        if item.sku == sku:",
            f"            return item  # path {k}",
            "    return None",
            "",
        )
    ]
)

PYTEST_FAIL = "\n".join(
    ["============================= test session starts ==============================",
     "collected 12 items", "", "tests/test_inventory.py ..........F.                                    [100%]", "",
     "=================================== FAILURES ===================================",
     "_______________________________ test_restock_caps _______________________________", ""]
    + [f"    def frame_{k}():\n        assert restock(item, 10) == 8" for k in range(12)]
    + ["E       AssertionError: assert 10 == 8", "", "src/inventory.py:88: AssertionError",
       "=========================== short test summary info ============================",
       "FAILED tests/test_inventory.py::test_restock_caps - AssertionError: assert 10 == 8",
       "========================= 1 failed, 11 passed in 0.08s ========================="]
)

STEPS = [
    ("terminal", {"command": "ls -la"}, "total 24\ndrwxr-xr-x  5 dev dev 4096 .\n-rw-r--r--  1 dev dev  812 README.md\n"
     "drwxr-xr-x  2 dev dev 4096 src\ndrwxr-xr-x  2 dev dev 4096 tests\n-rw-r--r--  1 dev dev  301 pyproject.toml"),
    ("read_file", {"path": "src/inventory.py"}, SOURCE),
    ("terminal", {"command": "python -m pytest -q"}, PYTEST_FAIL),
    ("search_files", {"pattern": "def restock"}, "src/inventory.py:84: def restock(item, amount):"),
    ("patch", {"path": "src/inventory.py"}, '{"success": true, "diff": "-    item.quantity += amount\\n+    item.quantity = min(item.quantity + amount, item.cap)"}'),
    ("terminal", {"command": "python -m pytest -q"}, PYTEST_FAIL.replace("10 == 8", "9 == 8")),
    ("read_file", {"path": "tests/test_inventory.py"}, SOURCE.replace("helper", "test_helper")),
    ("patch", {"path": "src/inventory.py"}, '{"success": true}'),
    ("terminal", {"command": "python -m pytest -q"}, "............\n12 passed in 0.07s"),
    ("terminal", {"command": "git diff --stat"}, " src/inventory.py | 4 ++--\n 1 file changed, 2 insertions(+), 2 deletions(-)"),
]


def post(url, body, session, stream=False):
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(dict(body, stream=stream)).encode(),
        headers={"content-type": "application/json", "x-pare-session": session, "authorization": "Bearer sk-e2e-dummy"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
        return response.read()


def get(process, path):
    with process.open(path) as response:
        return response.status, response.read().decode()


def chromium(*args):
    """Run headless Chromium (no network beyond 127.0.0.1, nothing kept after the run)."""
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", *args],
        capture_output=True, text=True, timeout=120, check=False,
    )


@pytest.fixture(scope="module")
def ui_pare(stub, tmp_path_factory):
    """pare in eager mode with a 4k window, and the traffic the screenshots show."""
    config = tmp_path_factory.mktemp("ui-config") / "pare.yaml"
    config.write_text(CONFIG)
    process = PareProcess(f"{stub.url}/v1", tmp_path_factory.mktemp("ui-archive"), ["--config", str(config)])
    messages = [
        {"role": "system", "content": "You are a careful coding agent. Use the tools to inspect and fix the repository. " * 6},
        {"role": "user", "content": "The restock test fails: restocking must never exceed the item's cap. Fix it."},
    ]
    for k, (tool, args, output) in enumerate(STEPS):
        post(process.url, {"model": "qwen2.5-coder-14b-instruct", "messages": messages}, SESSION, stream=k % 2 == 1)
        call_id = f"call_{k + 1}"
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": tool, "arguments": json.dumps(args)}}]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
    post(process.url, {"model": "qwen2.5-coder-14b-instruct", "messages": messages}, SESSION)
    for k, model in enumerate(["llama-3.1-8b-instruct", "gpt-oss-20b", "qwen2.5-coder-14b-instruct"]):
        post(process.url, {"model": model, "messages": [{"role": "user", "content": f"Summarise notes {k}."}]},
             f"e2e-ui-short-{k}", stream=True)
    post(process.url, {"model": "stub-model", "messages": [{"role": "user", "content": HOSTILE}]}, HOSTILE_SESSION)

    def recorded():
        status, page = get(process, f"/_pare/ui/session/{SESSION}")
        return status == 200 and f"request/{len(STEPS) + 1}\"" in page

    wait_until(recorded, what="the archive to hold the session")
    yield process
    assert process.stop() == 0


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    out = os.environ.get("UI_SCREENSHOT_DIR")
    return out if out else str(tmp_path_factory.mktemp("screenshots"))


def view(url, name, shots, tmp_path, height=1000):
    """Screenshot and DOM of `url` as Chromium renders it. `url` carries the owner token
    (`?token=`, as pare logs the UI's URL): pare sets the cookie and redirects to the page."""
    assert CHROMIUM, "chromium is not installed (tests/e2e/run.sh installs Debian's chromium)"
    profile = tmp_path / f"profile-{name}"
    path = os.path.join(shots, f"ui-{name}.png")
    shot = chromium(f"--user-data-dir={profile}", f"--screenshot={path}", f"--window-size=1400,{height}", url)
    assert os.path.getsize(path) > 10_000, f"no screenshot of {url}: {shot.stderr[-2000:]}"
    dom = chromium(f"--user-data-dir={profile}-dom", "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    return dom.stdout


def test_index_lists_the_sessions(ui_pare, shots, tmp_path):
    dom = view(f"{ui_pare.url}/_pare/ui/?token={ui_pare.token}", "index", shots, tmp_path, height=620)
    rows = re.findall(r'href="/_pare/ui/session/([^"]+)"', dom)
    assert SESSION in rows and HOSTILE_SESSION in rows
    assert len(rows) == 5, rows
    assert "qwen2.5-coder-14b-instruct" in dom and "llama-3.1-8b-instruct" in dom
    assert "1–5 of 5 sessions" in dom


def test_session_shows_one_row_per_request(ui_pare, shots, tmp_path):
    dom = view(f"{ui_pare.url}/_pare/ui/session/{SESSION}?token={ui_pare.token}", "session", shots, tmp_path, height=720)
    requests = re.findall(rf'href="/_pare/ui/session/{SESSION}/request/(\d+)"', dom)
    assert [int(n) for n in requests] == list(range(1, len(STEPS) + 2))
    assert dom.count('class="bar"') == len(STEPS) + 1
    assert "✓ verified" in dom
    assert "Hello from the stub." in dom, "the answers are summarised"
    # The stub reports 8 of 11 prompt tokens cached on each JSON answer; the streamed ones did not
    # ask for usage (no stream_options), so the upstream reported none for them.
    n_json = len(STEPS) // 2 + 1
    hits = re.search(r'<div id="upstream-cache"><b>([^<]*)</b>', dom)
    assert hits and hits.group(1) == f"72.7 % of {11 * n_json}", hits and hits.group(1)
    assert dom.count("8 / 11 (72.7 %)") == n_json, "each JSON answer's upstream cache figures"
    assert dom.count(">not reported</span>") == len(STEPS) + 1 - n_json, "streamed answers: not reported, not 0"
    assert "Attributable savings" in dom


def test_request_shows_raw_and_forwarded_side_by_side(ui_pare, shots, tmp_path):
    last = len(STEPS) + 1
    dom = view(f"{ui_pare.url}/_pare/ui/session/{SESSION}/request/{last}?token={ui_pare.token}", "request", shots, tmp_path, height=1000)
    assert "sent by the agent" in dom and "forwarded" in dom
    assert 'class="badge rule"' in dom, "the rule behind each rewrite is named"
    assert "Download raw body" in dom and "Compaction report" in dom


def test_hostile_text_is_shown_never_run(ui_pare, tmp_path):
    url = f"{ui_pare.url}/_pare/ui/session/{HOSTILE_SESSION}/request/1?token={ui_pare.token}"
    dom = view(url, "hostile", str(tmp_path), tmp_path, height=600)
    assert "&lt;script&gt;document.title='PWNED'&lt;/script&gt;" in dom, "the script tag is shown as text"
    assert "<script" not in dom, "no script element was created"
    assert "PWNED" not in re.search(r"<title>(.*?)</title>", dom).group(1), "a script ran"
    assert "data-pwned" not in dom, "an event handler ran"


def test_the_ui_without_the_token_shows_nothing(ui_pare, tmp_path):
    """Another user of the machine opens the UI without the token: 401, no session listed."""
    dom = chromium(f"--user-data-dir={tmp_path / 'profile-anonymous'}", "--dump-dom", f"{ui_pare.url}/_pare/ui/")
    assert SESSION not in dom.stdout and "wrong pare token" in dom.stdout, dom.stdout[:2000]
