"""Regeneration against a real vLLM OpenAI server (CPU, SmolLM2), not a mock: the server is
SIGKILLed mid-run, the run records the failures and leaves only whole lines; against another
server of the same model and arguments (the session's plain one) the rerun writes every
conversation exactly once, and the greedy answers written before the kill equal what that server
answers now; feature capture from that plain server (started without extract_hidden_states) is
refused in one line.

vLLM runs from the venv built by scripts/setup_vllm.sh, started by scripts/vllm_serve.py. Without
that venv this skips, unless FLEDGE_REQUIRE_VLLM is set (CI), where it fails instead.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import pytest
from conftest import load_script

from fledge.core.config import RegenConfig
from fledge.core.errors import FledgeError
from fledge.core.target import resolve_target
from fledge.data.regen import ServerBackend, regenerate
from fledge.train.capture_run import TargetShape, make_capture

NAME = "smollm2-135m"
QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What is 3 plus 4?",
             "Say hello in Spanish.", "What animal barks?", "Which planet is called the red planet?",
             "What do bees make?", "How many legs does a spider have?", "What is frozen water called?",
             "Name a fruit that is yellow.", "What color is the sky on a clear day?", "What is 10 minus 2?"]
FOLLOW_UP = "Explain in one sentence."


@pytest.fixture(scope="module")
def serve(vllm_venv):
    """scripts/vllm_serve.py as a module (skip or fail if the vLLM venv is absent)."""
    return load_script("vllm_serve")


def write_conversations(path: Path) -> dict[str, list[str]]:
    """12 chats; every third has a follow-up, so some samples need a second, dependent turn."""
    users = {f"c{i:02d}": [q, FOLLOW_UP] if i % 3 == 0 else [q] for i, q in enumerate(QUESTIONS)}
    with open(path, "w") as f:
        for cid, turns in users.items():
            msgs = [m for u in turns
                    for m in ({"role": "user", "content": u}, {"role": "assistant", "content": "old"})]
            f.write(json.dumps({"id": cid, "source": "test", "messages": msgs}) + "\n")
    return users


def kill_when_written(server, out: Path, lines: int, delay: float, within: float):
    """SIGKILL the server's process group (a crash, not a shutdown) `delay` s after `out` has
    `lines` lines, so the next chunk's requests are cut off while the server is generating."""
    killed = threading.Event()

    def watch():
        end = time.monotonic() + within
        while time.monotonic() < end:
            if out.exists() and out.read_bytes().count(b"\n") >= lines:
                time.sleep(delay)
                server.stop(signal.SIGKILL)
                killed.set()
                return
            time.sleep(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread, killed


def check_rows(out: Path, users: dict[str, list[str]]) -> dict[str, dict]:
    """Only whole JSON lines, ids unique, each a valid regeneration of its conversation."""
    raw = out.read_bytes()
    assert raw.endswith(b"\n")
    rows = [json.loads(line) for line in raw.splitlines()]
    by_id = {r["id"]: r for r in rows}
    assert len(by_id) == len(rows), "a conversation was written twice"
    for cid, r in by_id.items():
        msgs = r["messages"]
        assert [m["role"] for m in msgs] == ["user", "assistant"] * (len(msgs) // 2) and msgs
        assert [m["content"] for m in msgs[::2]] == users[cid][: len(msgs) // 2]
        assert all(m["content"].strip() for m in msgs[1::2]), f"{cid}: empty answer"
        if r["finish"] == "stop":  # only a cut-off answer may end the conversation early
            assert len(msgs) == 2 * len(users[cid])
    return by_id


@pytest.mark.slow
@pytest.mark.vllm
def test_regen_survives_server_kill_and_restart(tmp_path, serve, vllm_plain):
    convs, out, log = tmp_path / "c.jsonl", tmp_path / "r.jsonl", tmp_path / "vllm.log"
    users = write_conversations(convs)
    cfg = RegenConfig(max_new_tokens=24, max_len=1024, chunk=4)  # a chunk is written before the next starts
    target = resolve_target(NAME)
    first = serve.start(target, NAME, log=log, timeout=240)
    try:
        backend = ServerBackend([first.url], NAME, cfg, concurrency=4, timeout=60, retries=2, backoff=0.5)
        watcher, killed = kill_when_written(first, out, cfg.chunk, delay=0.5, within=120)
        counts = regenerate(convs, out, backend, cfg)
        print("run cut by the kill:", counts)
        watcher.join(10)
        assert killed.is_set(), "the server was never killed"
        assert counts["written"] >= 1 and counts["failed"] >= 1
        assert counts["written"] + counts["failed"] == len(users)
        assert counts["request_errors"], "the failed requests were not recorded"
        assert json.loads(out.with_suffix(".summary.json").read_text()) == counts
        before = check_rows(out, users)
        assert len(before) == counts["written"]

        # The rerun goes to another server of the same model and arguments: the session's plain one.
        second = vllm_plain
        backend = ServerBackend([second.url], NAME, cfg, concurrency=4, timeout=60, retries=2, backoff=0.5)
        counts = regenerate(convs, out, backend, cfg)
        assert counts["already_done"] == len(before) and counts["failed"] == 0
        assert counts["written"] == len(users) - len(before)
        after = check_rows(out, users)
        assert sorted(after) == sorted(users)

        # Greedy: each turn written before the kill is what the restarted server answers now.
        turns = [(r["messages"][:j], r["messages"][j]["content"])
                 for r in before.values() for j in range(1, len(r["messages"]), 2)]
        fresh = backend.answer([prefix for prefix, _ in turns], seeds=[0] * len(turns))
        assert all(a.finish != "error" for a in fresh)
        assert [a.text for a in fresh] == [answer for _, answer in turns]

        # Features from a server started without extract_hidden_states: one line, pointing at the launch line
        shape = TargetShape.read(NAME)
        capture = make_capture("vllm", second.url, NAME, shape, (2, 15, 27), retries=0)
        with pytest.raises(FledgeError, match="names no hidden-states file; start the server with --speculative-config"):
            capture.one(list(range(1, 9)))
    finally:
        first.stop(signal.SIGKILL)
    print(f"vLLM start: {first.start_s} s")
