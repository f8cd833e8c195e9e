"""`pare export dpo|sft` files load with Hugging Face `datasets` and have the columns TRL expects.

Two archives: the crafted one committed under tests/fixtures/archive/crafted/ (branches and retries;
kept current by the Rust test `archive::committed_e2e_archive_verifies_and_exports_the_goldens`), and
one recorded by a real `pare serve` in front of the stub upstream. The pare binary is $PARE_BIN, else
target/debug/pare (built with cargo when missing).
"""

import json
import os
import urllib.request
import shutil
import subprocess
from pathlib import Path

import pytest
from datasets import load_dataset
from stub_upstream import WEATHER_TOOL

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "archive" / "crafted" / "archive.sqlite3"


@pytest.fixture(scope="module")
def pare_bin() -> str:
    explicit = os.environ.get("PARE_BIN")
    if explicit:
        return explicit
    binary = REPO / "target" / "debug" / "pare"
    if not binary.exists():
        subprocess.run(["cargo", "build", "--quiet", "--bin", "pare"], cwd=REPO, check=True, timeout=1800)
    return str(binary)


@pytest.fixture()
def archive_dir(tmp_path: Path) -> Path:
    target = tmp_path / "archive"
    target.mkdir(mode=0o700)
    shutil.copy(FIXTURE, target / "archive.sqlite3")
    return target


def run_pare(pare_bin: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([pare_bin, *args], capture_output=True, text=True, timeout=120, check=False)


def load(path: Path):
    return load_dataset("json", data_files=str(path), split="train")


def assert_messages(messages):
    assert isinstance(messages, list) and messages
    for m in messages:
        assert m["role"] in {"system", "user", "assistant", "tool"}
        assert "content" in m


def test_archive_verifies(pare_bin, archive_dir):
    result = run_pare(pare_bin, "sessions", "verify", "--archive", str(archive_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout


def test_dpo_export_loads_in_trl_conversational_format(pare_bin, archive_dir, tmp_path):
    out = tmp_path / "dpo.jsonl"
    result = run_pare(pare_bin, "export", "dpo", "--archive", str(archive_dir), "--out", str(out))
    assert result.returncode == 0, result.stderr
    ds = load(out)
    assert {"prompt", "chosen", "rejected"} <= set(ds.column_names)
    assert ds.num_rows == 2
    mined = sorted(row["provenance"]["mined"] for row in ds)
    assert mined == ["branch", "retry"]
    for row in ds:
        assert_messages(row["prompt"])
        assert [m["role"] for m in row["chosen"]] == ["assistant"]
        assert [m["role"] for m in row["rejected"]] == ["assistant"]
        assert row["chosen"] != row["rejected"]
        assert row["prompt"][-1]["role"] != "assistant"


def test_dpo_session_filter(pare_bin, archive_dir, tmp_path):
    out = tmp_path / "dpo.jsonl"
    args = ["export", "dpo", "--archive", str(archive_dir), "--session", "branchy", "--out", str(out)]
    assert run_pare(pare_bin, *args).returncode == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["provenance"]["session"] for r in rows] == ["branchy"]


def test_sft_openai_export_loads_with_messages_and_tools(pare_bin, archive_dir, tmp_path):
    out = tmp_path / "sft.jsonl"
    result = run_pare(pare_bin, "export", "sft", "--format", "openai", "--archive", str(archive_dir), "--out", str(out))
    assert result.returncode == 0, result.stderr
    ds = load(out)
    assert "messages" in ds.column_names and "tools" in ds.column_names
    assert ds.num_rows == 2
    for row in ds:
        assert_messages(row["messages"])
        assert row["messages"][-1]["role"] == "assistant"


def post_chat(url, body):
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "authorization": "Bearer sk-test-SECRET"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def test_sft_from_an_archive_recorded_by_pare_serve(pare_bin, stub, tmp_path):
    """Drive `pare serve` through a tool call and its answer, stop it, export: one conversation."""
    from conftest import PareProcess

    os.environ.setdefault("PARE_BIN", pare_bin)
    archive = tmp_path / "served"
    process = PareProcess(f"{stub.url}/v1", archive)
    try:
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        first = post_chat(process.url, {"model": "stub-model", "messages": messages, "tools": [WEATHER_TOOL]})
        call = first["choices"][0]["message"]
        assert call["tool_calls"][0]["function"]["name"] == "get_weather"
        messages += [call, {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"], "content": "sunny, 24 C"}]
        second = post_chat(process.url, {"model": "stub-model", "messages": messages, "tools": [WEATHER_TOOL]})
        answer = second["choices"][0]["message"]["content"]
    finally:
        assert process.stop() == 0
    out = tmp_path / "sft.jsonl"
    result = run_pare(pare_bin, "export", "sft", "--archive", str(archive), "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "SECRET" not in out.read_text()
    ds = load(out)
    assert ds.num_rows == 1
    roles = [m["role"] for m in ds[0]["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant"]
    assert ds[0]["messages"][1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert ds[0]["messages"][-1]["content"] == answer
    assert ds[0]["tools"][0]["function"]["name"] == "get_weather"
    verified = run_pare(pare_bin, "sessions", "verify", "--archive", str(archive))
    assert verified.returncode == 0, verified.stdout


def test_sft_sharegpt_export_loads_with_conversations(pare_bin, archive_dir, tmp_path):
    out = tmp_path / "sft.jsonl"
    result = run_pare(pare_bin, "export", "sft", "--format", "sharegpt", "--archive", str(archive_dir), "--out", str(out))
    assert result.returncode == 0, result.stderr
    ds = load(out)
    assert ds.column_names == ["conversations", "tools"]
    for row in ds:
        assert {turn["from"] for turn in row["conversations"]} <= {"system", "human", "gpt", "tool"}
        assert row["conversations"][-1]["from"] == "gpt"
    # The tool schemas ride along as a JSON string where the session had any.
    tools = [json.loads(row["tools"]) for row in ds if row["tools"] is not None]
    assert tools and all(t[0]["type"] == "function" for t in tools)
