"""A real fleet: three `pare serve` replicas on one PostgreSQL archive (`archive.durability: strict`,
the same config) behind Debian's nginx running deploy/nginx.conf round-robin, in front of the stub
upstreams. Through nginx, the `openai` SDK (Chat Completions, one session unstreamed without a session
header, one streamed with `x-pare-session`), the `anthropic` SDK (Messages, streamed, no header) and
Codex CLI (Responses, README's provider config, no header) each run a multi-turn session with tool
calls; their turns interleave, so round-robin sends consecutive requests of one session to different
replicas. After some turns one replica is killed with SIGKILL and the sessions go on through nginx.
The window is small (8k tokens) so that epochs happen mid-session.

Afterwards: the archive is in PostgreSQL; every request the clients sent is archived exactly once;
each conversation is one session; `pare sessions verify` passes; what the stub received equals what
`pare replay` predicts from the archived raw requests; `pare export sft|dpo` work from PostgreSQL.
Apart: two replicas keep answering while PostgreSQL is stopped, and write what waited once it is back.

`PARE_FLEET_ARCHIVE=sqlite` runs the same fleet on one SQLite archive directory that the replicas
share instead of PostgreSQL (the same code path in pare)."""

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import anthropic
import openai
import pytest

from conftest import NODE_BIN
from fleet_servers import Nginx, Postgres, Replica, wait_for
from stub_messages import MESSAGES_ANSWER
from stub_messages import SHELL_TOOL as MESSAGES_SHELL_TOOL
from stub_responses import RESPONSES_ANSWER
from stub_upstream import PLAIN_ANSWER, WEATHER_ANSWER, WEATHER_TOOL, StubUpstream
from test_codex import CODEX_TIMEOUT_S, codex_config, report_of

REPLICAS = 3
ROUNDS = 10
# The replica killed, and after which round (the sessions have ROUNDS rounds).
VICTIM = 1
KILL_AFTER = 4
WINDOW = 8192
# The clients' whole run stops starting rounds past this (each request has its own timeout too).
RUN_DEADLINE_S = 300
CLI_TIMEOUT_S = 60
CHAT_MODEL = "fleet-chat-model"
MESSAGES_MODEL = "claude-stub-4"
# Every conversation's first user message names it: compaction never touches user messages.
MARKERS = {"chat": "[fleet chat-plain]", "chat-stream": "[fleet chat-stream]", "messages": "[fleet messages]"}
STREAM_SESSION = "fleet-chat-stream"
CONVERSATION_PATHS = {"/v1/chat/completions": "chat", "/v1/responses": "responses", "/v1/messages": "messages"}

CONFIG = f"""\
archive:
  durability: strict
budget:
  default_context_window: {WINDOW}
  anthropic_context_window: {WINDOW}
  detect_window: false
models:
  # Codex's model: its instructions and tools alone fill a small window.
  - match: "^stub-model$"
    context_window: 65536
"""


def server_section(directory):
    """README's fleet recipe: one owner token for every replica, in a file of its own."""
    return f"server:\n  allowed_hosts: [pare.example]\n  owner_token_file: {directory / 'owner-token'}\n"


def status_of(url, headers=None):
    """The status of `GET url` (an error status too)."""
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def test_nginx_keeps_pares_endpoints_off_the_public_side(tmp_path):
    """README's fleet recipe behind deploy/nginx.conf: through nginx, `/_pare/` answers 404 (health
    aside, which shows only its status) and the gateway needs the owner token; on a replica's own port
    a request that names a forwarded client is not local, so the UI and metrics need the token."""
    stub = StubUpstream()
    config = tmp_path / "pare.yaml"
    config.write_text(server_section(tmp_path))
    archive = ["--archive", str(tmp_path / "archive")]
    replicas, nginx = [], None
    try:
        for i in range(2):
            replicas.append(Replica(os.environ["PARE_BIN"], ["--config", config, "--upstream", f"{stub.url}/v1", *archive],
                                    tmp_path / f"replica-{i}.log"))
        nginx = Nginx(tmp_path / "nginx", [r.port for r in replicas])
        token = (tmp_path / "owner-token").read_text().strip()
        public = {"Host": "pare.example"}
        for path in ["/_pare/ui/", "/_pare/retrieve/pare:0123456789ab", "/_pare/mcp", "/_pare/metrics"]:
            assert status_of(f"{nginx.url}{path}", public)[0] == 404, path
            assert status_of(f"{nginx.url}{path}", dict(public, **{"x-pare-token": token}))[0] == 404, path
        code, body = status_of(f"{nginx.url}/_pare/health", public)
        assert code == 200 and set(json.loads(body)) == {"status", "version"}, body
        assert status_of(f"{nginx.url}/v1/retrieve/0123456789ab", public)[0] == 401
        assert status_of(f"{nginx.url}/v1/models", public)[0] == 200, "the agents' paths pass"
        forwarded = {"X-Forwarded-For": "203.0.113.7"}
        for path in ["/_pare/ui/", "/_pare/metrics"]:
            assert status_of(f"{replicas[0].url}{path}", forwarded)[0] == 401, path
            assert status_of(f"{replicas[1].url}{path}", dict(forwarded, **{"x-pare-token": token}))[0] == 200, path
        assert status_of(f"{replicas[0].url}/_pare/metrics")[0] == 200, "a local scrape needs no token"
    finally:
        if nginx:
            nginx.stop()
        for replica in replicas:
            replica.stop()
        stub.close()


def tool_output(label, turn):
    """A deterministic tool result of about 600 tokens: what a forecast service returned."""
    rows = [f"{label} turn {turn} station {s:02d}: {14 + (s * 7 + turn) % 11} C, wind {s * 3 % 17} km/h, "
            f"humidity {40 + (s * 13 + turn) % 50} %, pressure {1000 + s * 2} hPa" for s in range(24)]
    return "\n".join(rows) + "\n"


@dataclass
class Conversation:
    """One client session: the bodies it sent, in order, and the x-pare-* headers of each answer."""

    name: str
    sent: list = field(default_factory=list)
    headers: list = field(default_factory=list)
    error: str = ""


class ChatSession:
    """The `openai` SDK's Chat Completions tool loop, one weather question per round."""

    def __init__(self, base_url, conversation, stream, session_header=None):
        self.conversation = conversation
        self.stream = stream
        hooks = {"request": [lambda request: conversation.sent.append(request.content)]}
        self.sdk = openai.OpenAI(
            base_url=f"{base_url}/v1", api_key="sk-e2e-fleet", timeout=60, max_retries=0,
            default_headers={"x-pare-session": session_header} if session_header else None,
            http_client=openai.DefaultHttpxClient(event_hooks=hooks),
        )
        self.messages = [{"role": "system", "content": "You are a weather agent. Use get_weather."}]

    def call(self):
        args = dict(model=CHAT_MODEL, messages=self.messages, tools=[WEATHER_TOOL])
        if not self.stream:
            raw = self.sdk.chat.completions.with_raw_response.create(**args)
            message = raw.parse().choices[0].message
            self.conversation.headers.append(dict(raw.headers))
            calls = [c.model_dump(exclude_none=True) for c in message.tool_calls or []]
            return message.content, calls
        content, calls = "", {}
        with self.sdk.chat.completions.with_streaming_response.create(**args, stream=True) as response:
            self.conversation.headers.append(dict(response.headers))
            for chunk in response.parse():
                if not chunk.choices:
                    continue
                delta = chunk.choices[0].delta
                content += delta.content or ""
                for part in delta.tool_calls or []:
                    entry = calls.setdefault(part.index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
                    entry["id"] = part.id or entry["id"]
                    if part.function:
                        entry["function"]["name"] += part.function.name or ""
                        entry["function"]["arguments"] += part.function.arguments or ""
        return content or None, [calls[i] for i in sorted(calls)]

    def round(self, turn, marker):
        opening = f"{marker} " if turn == 0 else ""
        self.messages.append({"role": "user", "content": f"{opening}Round {turn}: what is the weather in Paris?"})
        content, calls = self.call()
        assert calls and calls[0]["function"]["name"] == "get_weather", (content, calls)
        self.messages.append({"role": "assistant", "content": None, "tool_calls": calls})
        self.messages.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": tool_output("paris", turn)})
        content, calls = self.call()
        assert content == WEATHER_ANSWER and not calls, (content, calls)
        self.messages.append({"role": "assistant", "content": content})


class MessagesSession:
    """The `anthropic` SDK's streamed Messages tool loop with thinking, one shell command per round."""

    def __init__(self, base_url, conversation):
        self.conversation = conversation
        hooks = {"request": [lambda request: conversation.sent.append(request.content)]}
        self.sdk = anthropic.Anthropic(
            base_url=base_url, api_key="sk-ant-e2e-fleet", timeout=60, max_retries=0,
            http_client=anthropic.DefaultHttpxClient(event_hooks=hooks),
        )
        self.messages = []

    def call(self):
        args = dict(model=MESSAGES_MODEL, max_tokens=4096, messages=self.messages, tools=[MESSAGES_SHELL_TOOL],
                    thinking={"type": "enabled", "budget_tokens": 1024})
        with self.sdk.messages.stream(**args) as events:
            final = events.get_final_message()
            self.conversation.headers.append(dict(events.response.headers))
        return final

    def round(self, turn, marker):
        opening = f"{marker} " if turn == 0 else ""
        self.messages.append({"role": "user", "content": [{"type": "text", "text": f"{opening}Round {turn}: list the logs."}]})
        first = self.call()
        uses = [b for b in first.content if b.type == "tool_use"]
        assert uses, first
        self.messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]})
        result = {"type": "tool_result", "tool_use_id": uses[0].id, "content": tool_output("logs", turn)}
        self.messages.append({"role": "user", "content": [result]})
        second = self.call()
        text = "".join(b.text for b in second.content if b.type == "text")
        assert text == MESSAGES_ANSWER, second
        self.messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in second.content]})


class CodexSession:
    """Codex CLI with README's provider config: `codex exec`, then `codex exec resume --last`."""

    def __init__(self, base_url, directory):
        self.home = directory / "codex-home"
        self.home.mkdir(parents=True)
        (self.home / "config.toml").write_text(codex_config(base_url))
        self.workdir = directory / "codex-work"
        self.workdir.mkdir()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "CODEX_"))}
        self.env.update(CODEX_HOME=str(self.home), HOME=str(directory), OPENAI_API_KEY="sk-e2e-codex", NO_COLOR="1")
        self.runs = []

    def run(self, prompt, resume):
        command = [str(NODE_BIN / "codex"), "exec", *(["resume", "--last"] if resume else []), "--skip-git-repo-check", prompt]
        completed = subprocess.run(command, cwd=self.workdir, env=self.env, stdin=subprocess.DEVNULL,
                                   capture_output=True, text=True, timeout=CODEX_TIMEOUT_S)
        self.runs.append(completed)
        assert completed.returncode == 0 and RESPONSES_ANSWER in completed.stdout, report_of(completed)


@dataclass
class FleetRun:
    """What the run left: the servers (stopped), the clients' conversations, the stub's record."""

    directory: Path
    archive: str
    backend: str
    config: Path
    replicas: list
    nginx: Nginx
    postgres: Postgres
    stub_requests: list
    conversations: dict
    codex: CodexSession
    killed_at: dict
    stopped: dict

    def cli(self, *args, check=True):
        """`pare ARGS --archive ARCHIVE` (the same binary as the replicas)."""
        result = subprocess.run([os.environ["PARE_BIN"], *args, "--archive", self.archive],
                                capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
        if check:
            assert result.returncode == 0, f"pare {' '.join(args)}: exit {result.returncode}\n{result.stdout}\n{result.stderr}"
        return result

    def sessions(self):
        lines = self.cli("sessions", "list", "--json").stdout.splitlines()
        return {s["id"]: s for s in map(json.loads, lines)}

    def bodies(self, session, kind):
        """A session's archived request bodies, `kind` "raw" or "forwarded", in order."""
        return self.cli("sessions", "show", session, f"--{kind}").stdout.encode().split(b"\n")[:-1]

    def stub_bodies(self, path, predicate=lambda body: True):
        return [r["body"] for r in self.stub_requests
                if r["method"] == "POST" and r["path"].split("?")[0] == path and predicate(r)]


def first_user_text(path, body):
    """The text of a conversation body's first user message (chat, Messages)."""
    parsed = json.loads(body)
    for message in parsed.get("messages") or []:
        if message.get("role") != "user":
            continue
        content = message["content"]
        if isinstance(content, str):
            return content
        return "".join(b.get("text", "") for b in content if isinstance(b, dict))
    return ""


def stub_bodies_of(run, name):
    """The bodies the stub received for one of the clients' conversations, in order."""
    if name == "codex":
        return run.stub_bodies("/v1/responses", lambda r: r["headers"].get("originator") == "codex_exec")
    path = "/v1/messages" if name == "messages" else "/v1/chat/completions"
    return run.stub_bodies(path, lambda r: MARKERS[name] in first_user_text(path, r["body"]))


def conversation_exchanges(replica):
    """The conversation requests a replica's access log shows it answered."""
    return [line for line in replica.access_log() if line.get("path") in CONVERSATION_PATHS and line.get("method") == "POST"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Start PostgreSQL, the stub, three replicas and nginx; run the four sessions with a replica
    killed midway; stop everything (on failure too). The run's errors are kept, not raised, so that
    each test below reports on the archive whatever happened to the clients."""
    directory = tmp_path_factory.mktemp("fleet")
    backend = os.environ.get("PARE_FLEET_ARCHIVE", "postgres")
    config = directory / "pare.yaml"
    started = []
    postgres = stub = None
    try:
        if backend == "postgres":
            postgres = Postgres(directory / "postgres", fsync=False)
            started.append(postgres)
            archive = postgres.url
            # The replicas read the URL from the config, as README's fleet recipe has it; the
            # commands below take it as --archive URL.
            config.write_text(CONFIG.replace("archive:\n", f"archive:\n  url: {archive}\n", 1) + server_section(directory))
            archive_args = []
        else:
            archive = str(directory / "archive")
            config.write_text(CONFIG + server_section(directory))
            archive_args = ["--archive", archive]
        stub = StubUpstream()
        replicas = []
        for i in range(REPLICAS):
            replica = Replica(os.environ["PARE_BIN"], ["--config", config, "--upstream", f"{stub.url}/v1", *archive_args],
                              directory / f"replica-{i}.log")
            replicas.append(replica)
            started.append(replica)
        nginx = Nginx(directory / "nginx", [r.port for r in replicas])
        started.append(nginx)

        conversations = {name: Conversation(name) for name in ("chat", "chat-stream", "messages")}
        chat = ChatSession(nginx.url, conversations["chat"], stream=False)
        chat_stream = ChatSession(nginx.url, conversations["chat-stream"], stream=True, session_header=STREAM_SESSION)
        messages = MessagesSession(nginx.url, conversations["messages"])
        codex = CodexSession(nginx.url, directory)
        clients = {"chat": chat, "chat-stream": chat_stream, "messages": messages}
        codex_error = ""
        killed_at = {}

        def codex_step(prompt, resume):
            nonlocal codex_error
            if codex_error:
                return
            try:
                codex.run(prompt, resume)
            except (AssertionError, subprocess.TimeoutExpired) as error:
                codex_error = str(error)

        deadline = time.monotonic() + RUN_DEADLINE_S
        codex_step("Write the marker file and show it.", resume=False)
        for turn in range(ROUNDS):
            if time.monotonic() > deadline:
                for conversation in conversations.values():
                    conversation.error = conversation.error or f"stopped before round {turn}: the run took over {RUN_DEADLINE_S} s"
                break
            if turn == 1:
                # A replica that cannot write the archive makes every strict request wait
                # archive.commit_timeout_ms: stop there rather than wait that long for each request.
                trouble = [f"replica {i}: {h['status']}: {h.get('archive', {}).get('last_error')}"
                           for i, h in enumerate(r.health() for r in replicas) if h["status"] != "ok"]
                if trouble:
                    for conversation in conversations.values():
                        conversation.error = conversation.error or f"stopped after round 0: {trouble}"
                    codex_error = codex_error or f"stopped after round 0: {trouble}"
                    break
            for name, client in clients.items():
                if conversations[name].error:
                    continue
                try:
                    client.round(turn, MARKERS[name])
                except (AssertionError, openai.APIError, anthropic.APIError) as error:
                    conversations[name].error = f"round {turn}: {type(error).__name__}: {error}"
            if turn == KILL_AFTER - 1:
                # Every exchange answered so far is in the access logs (a line is written as its
                # answer ends), so that the victim's count below is all it served.
                def logged():
                    received = [r for r in stub.recorded() if r["method"] == "POST" and r["path"].split("?")[0] in CONVERSATION_PATHS]
                    return sum(len(conversation_exchanges(r)) for r in replicas) == len(received)

                wait_for(logged, 10, "the replicas' access lines of every exchange so far")
                replicas[VICTIM].kill()
                killed_at = {"answered": len(conversation_exchanges(replicas[VICTIM])), "round": turn + 1}
                codex_step("Show the marker file again.", resume=True)
        codex_step("Say that you are done.", resume=True)
        conversations["codex"] = Conversation("codex", error=codex_error)
        # The survivors stop on SIGTERM, which flushes their archive writers, before the archive is read.
        stopped = {i: replica.stop() for i, replica in enumerate(replicas) if i != VICTIM}
        nginx.stop()
        yield FleetRun(directory, archive, backend, config, replicas, nginx, postgres, stub.recorded(),
                       conversations, codex, killed_at, stopped)
    finally:
        stop_all(started)
        if stub:
            stub.close()
        if os.environ.get("PARE_FLEET_KEEP"):
            shutil.copytree(directory, Path(os.environ["PARE_FLEET_KEEP"]), dirs_exist_ok=True)



def stop_all(servers):
    """Stop every server started, the last first, whatever one of them raises."""
    for server in reversed(servers):
        try:
            server.stop()
        except Exception:  # noqa: BLE001 - every server gets its stop
            pass

def test_clients_finish_their_sessions_through_nginx(fleet):
    errors = {name: c.error for name, c in fleet.conversations.items() if c.error}
    assert not errors, errors
    assert len(fleet.codex.runs) == 3
    assert all(code == 0 for code in fleet.stopped.values()), f"replicas' exit codes on SIGTERM: {fleet.stopped}"
    assert all(len(c.sent) == 2 * ROUNDS for name, c in fleet.conversations.items() if name != "codex")


def test_round_robin_spread_the_sessions_and_the_kill_hit_a_serving_replica(fleet):
    served = [len(conversation_exchanges(r)) for r in fleet.replicas]
    assert all(n > 0 for n in served), served
    assert fleet.killed_at.get("answered", 0) > 0 and served[VICTIM] == fleet.killed_at["answered"], (served, fleet.killed_at)
    # Requests after the kill went to the two survivors.
    total = sum(len(stub_bodies_of(fleet, name)) for name in ("chat", "chat-stream", "messages", "codex"))
    assert sum(served) == total, (served, total)


def test_the_archive_is_in_postgres_and_its_password_is_never_logged(fleet):
    if fleet.backend != "postgres":
        pytest.skip("PARE_FLEET_ARCHIVE=sqlite")
    assert not (fleet.directory / "postgres:").exists(), "pare took the URL for a directory"
    for replica in fleet.replicas:
        text = replica.log_path.read_text()
        assert Postgres.PASSWORD not in text, f"{replica.log_path} shows the database password"
    tables = fleet.postgres.sql(
        "SELECT count(*) FROM pg_tables WHERE schemaname NOT IN ('pg_catalog', 'information_schema')", database=Postgres.DATABASE
    )
    assert int(tables) > 0, "pare created no table in the database"
    for args in (("sessions", "list"), ("sessions", "verify")):
        result = fleet.cli(*args, check=False)
        assert Postgres.PASSWORD not in result.stdout + result.stderr, f"pare {' '.join(args)} shows the database password"


def sessions_of(fleet):
    """Archived session id → (its raw bodies, its forwarded bodies)."""
    return {sid: (fleet.bodies(sid, "raw"), fleet.bodies(sid, "forwarded")) for sid in fleet.sessions()}


@pytest.fixture(scope="module")
def archived(fleet):
    return sessions_of(fleet)


def owner(raw_bodies):
    """Which client conversation a session's raw bodies belong to (by its marker), or `codex`."""
    names = set()
    for body in raw_bodies:
        text = body.decode(errors="replace")
        found = [name for name, marker in MARKERS.items() if marker in text]
        names.update(found or (["codex"] if '"input"' in text else ["?"]))
    return names


def test_every_request_is_archived_exactly_once(fleet, archived):
    received = sum(len(fleet.stub_bodies(path)) for path in CONVERSATION_PATHS)
    stored = sum(len(raw) for raw, _ in archived.values())
    assert stored == received, f"{stored} requests archived, the stub received {received}"
    all_raw = [body for raw, _ in archived.values() for body in raw]
    for name in ("chat", "chat-stream", "messages"):
        sent = fleet.conversations[name].sent
        assert sent, name
        for body in sent:
            assert all_raw.count(body) == 1, f"{name}: a request sent once is archived {all_raw.count(body)} times"


def test_each_conversation_is_one_session(fleet, archived):
    by_owner = {}
    for sid, (raw, _) in archived.items():
        names = owner(raw)
        assert len(names) == 1, f"session {sid} mixes conversations {names}"
        by_owner.setdefault(names.pop(), []).append(sid)
    split = {name: sids for name, sids in by_owner.items() if len(sids) > 1}
    assert not split, f"conversations split across sessions: {split}"
    assert set(by_owner) == {"chat", "chat-stream", "messages", "codex"}, by_owner
    for name in ("chat", "chat-stream", "messages"):
        (sid,) = by_owner[name]
        assert archived[sid][0] == fleet.conversations[name].sent, f"{name}: the session's raw requests are what the SDK sent, in order"
        answered = {h.get("x-pare-session") for h in fleet.conversations[name].headers}
        assert answered == {sid}, f"{name}: replicas answered with sessions {answered}, archived as {sid}"
    assert by_owner["chat-stream"] == [STREAM_SESSION]
    (codex_sid,) = by_owner["codex"]
    assert len(archived[codex_sid][0]) == len(stub_bodies_of(fleet, "codex"))


def test_sessions_verify_passes(fleet):
    result = fleet.cli("sessions", "verify", check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_forwarded_bodies_are_what_replay_predicts(fleet, archived):
    wires = {"chat": "chat", "chat-stream": "chat", "messages": "messages", "codex": "responses"}
    problems = []
    for sid, (raw, forwarded) in sorted(archived.items()):
        names = owner(raw)
        if len(names) != 1:
            problems.append(f"session {sid} mixes conversations {names}")
            continue
        (name,) = names
        received = stub_bodies_of(fleet, name)
        if forwarded != [body for body in received if body in forwarded]:
            problems.append(f"{name} ({sid}): the archived forwarded bodies are not bodies the stub received, in its order")
        session_file = fleet.directory / f"replay-{sid}.jsonl"
        session_file.write_bytes(b"".join(body + b"\n" for body in raw))
        replay = subprocess.run([os.environ["PARE_BIN"], "replay", "--config", str(fleet.config), "--wire", wires[name], str(session_file)],
                                capture_output=True, timeout=CLI_TIMEOUT_S)
        assert replay.returncode == 0, replay.stderr.decode()
        predicted = replay.stdout.split(b"\n")[:-1]
        differing = [i + 1 for i, (p, f) in enumerate(zip(predicted, forwarded)) if p != f]
        if len(predicted) != len(forwarded) or differing:
            problems.append(f"{name} ({sid}): requests {differing} of {len(forwarded)} were forwarded otherwise than pare replay predicts")
    # One session per conversation, each forwarding what replay predicts over all its raw requests.
    for name in ("chat", "chat-stream", "messages", "codex"):
        sessions = [sid for sid, (raw, _) in archived.items() if owner(raw) == {name}]
        whole = [body for sid in sessions for body in archived[sid][1]]
        if len(sessions) != 1 or whole != stub_bodies_of(fleet, name):
            problems.append(f"{name}: the stub received {len(stub_bodies_of(fleet, name))} bodies, {len(sessions)} session(s) archived {len(whole)} of them")
    assert not problems, "\n".join(problems)


def test_epochs_happened_mid_session(fleet):
    for name in ("chat", "chat-stream", "messages"):
        epochs = [int(h.get("x-pare-epoch", 0)) for h in fleet.conversations[name].headers]
        assert epochs and epochs[0] == 0 and max(epochs) >= 1, f"{name}: epochs {epochs}"
    received = stub_bodies_of(fleet, "chat")
    assert any(len(f) < len(s) for f, s in zip(received, fleet.conversations["chat"].sent)), "compaction removed tokens"


def test_exports_work_from_the_archive(fleet):
    sft = fleet.directory / "sft.jsonl"
    fleet.cli("export", "--out", str(sft), "sft")
    conversations = [json.loads(line) for line in sft.read_text().splitlines()]
    text = sft.read_text()
    assert len(conversations) >= 3 and all(MARKERS[name] in text for name in ("chat", "chat-stream", "messages")), text[:2000]
    dpo = fleet.directory / "dpo.jsonl"
    fleet.cli("export", "--out", str(dpo), "dpo")
    assert all(json.loads(line) for line in dpo.read_text().splitlines())


def test_replicas_keep_proxying_while_postgres_is_down(tmp_path):
    """PostgreSQL stopped under two strict replicas behind nginx: every request is still answered,
    within archive.commit_timeout_ms and a margin; health says degraded with the database's error; once
    the database is back the waiting records are written, nothing is lost and the chains verify."""
    if os.environ.get("PARE_FLEET_ARCHIVE", "postgres") != "postgres":
        pytest.skip("PARE_FLEET_ARCHIVE=sqlite")
    started, stub = [], StubUpstream()
    try:
        postgres = Postgres(tmp_path / "postgres", fsync=False)
        started.append(postgres)
        config = tmp_path / "pare.yaml"
        config.write_text(f"archive:\n  url: {postgres.url}\n  durability: strict\n  commit_timeout_ms: 2000\n"
                          + server_section(tmp_path))
        replicas = [Replica(os.environ["PARE_BIN"], ["--config", config, "--upstream", f"{stub.url}/v1"], tmp_path / f"replica-{i}.log")
                    for i in range(2)]
        started += replicas
        nginx = Nginx(tmp_path / "nginx", [r.port for r in replicas])
        started.append(nginx)
        sdk = openai.OpenAI(base_url=f"{nginx.url}/v1", api_key="sk-e2e-fleet", timeout=30, max_retries=0)

        def ask(i):
            began = time.monotonic()
            answer = sdk.chat.completions.create(model=CHAT_MODEL, messages=[{"role": "user", "content": f"[fleet db-down] question {i}"}])
            return answer.choices[0].message.content, time.monotonic() - began

        answers = [ask(i) for i in range(2)]
        postgres.shutdown()
        answers += [ask(i) for i in range(2, 5)]
        assert all(text == PLAIN_ANSWER for text, _ in answers), answers
        assert all(seconds < 2 + 3 for _, seconds in answers[2:]), f"a request waited past commit_timeout_ms: {answers}"
        health = [r.health() for r in replicas]
        assert all(h["status"] == "degraded" and h["archive"]["writable"] is False for h in health), health
        assert all("***" in h["archive"]["last_error"] and Postgres.PASSWORD not in json.dumps(h) for h in health), health

        postgres.start()
        wait_for(lambda: all(r.health()["status"] == "ok" for r in replicas), 30, "the replicas to write the records that waited")
        answers.append(ask(5))
        assert all(r.health()["archive"]["lost_records"] == 0 for r in replicas)
        assert [r.stop() for r in replicas] == [0, 0]
        nginx.stop()
        run = FleetRun(tmp_path, postgres.url, "postgres", config, replicas, nginx, postgres, stub.recorded(), {}, None, {}, {})
        sessions = run.sessions()
        assert sum(s["requests"] for s in sessions.values()) == len(answers) == len(run.stub_bodies("/v1/chat/completions"))
        assert run.cli("sessions", "verify", check=False).returncode == 0
    finally:
        stop_all(started)
        stub.close()
