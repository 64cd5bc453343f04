"""Regeneration: engine answers equal HF greedy answers; resume never duplicates or loses
samples; the server back-end retries, fails over and records what still failed."""

import http.server
import json
import threading
from types import SimpleNamespace

import pytest
import torch
import transformers

from conftest import make_tiny
from fledge.regen import EngineBackend, RegenConfig, ServerBackend, regenerate
from fledge.target import resolve_target
from fledge.util import read_jsonl


@pytest.fixture(scope="module")
def tiny_chat_target():
    tok = transformers.AutoTokenizer.from_pretrained(resolve_target("smollm2-135m"))
    return SimpleNamespace(model=make_tiny("llama", seed=5, vocab_size=len(tok)), tokenizer=tok, name="tiny")


def _convs(path, n=5):
    rows = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "old"},
                {"role": "user", "content": f"follow-up {i}"}, {"role": "assistant", "content": "old"}]
        rows.append({"id": f"c{i}", "source": "t", "messages": msgs[: 2 + 2 * (i % 2)]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_engine_answers_equal_hf_greedy_and_resume(tmp_path, tiny_chat_target):
    t = tiny_chat_target
    _convs(tmp_path / "c.jsonl")
    cfg = RegenConfig(max_new_tokens=6, max_len=256, chunk=2)
    backend = EngineBackend(t, cfg, batch_size=3, device="cpu", dtype=torch.float32)
    out = tmp_path / "r.jsonl"
    counts = regenerate(tmp_path / "c.jsonl", out, backend, cfg, limit=3)
    assert counts["written"] == 3
    rows = {r["id"]: r for _, r in read_jsonl(out)}
    for r in rows.values():
        msgs = r["messages"]
        assert [m["role"] for m in msgs][::2] == ["user"] * (len(msgs) // 2)
        # Every assistant turn is HF's greedy continuation of the regenerated prefix.
        for k in range(1, len(msgs), 2):
            ids = t.tokenizer.apply_chat_template(msgs[:k], add_generation_prompt=True, return_tensors="pt",
                                                  return_dict=True)["input_ids"]
            ref = t.model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=backend.eos)
            new = ref[0, ids.shape[1]:].tolist()
            new = new[:-1] if new and new[-1] in backend.eos else new
            assert msgs[k]["content"] == t.tokenizer.decode(new)
    # A crash mid-write leaves a torn tail; the rerun cuts it and continues without duplicates.
    with open(out, "a") as f:
        f.write('{"id": "c3", "messa')
    counts = regenerate(tmp_path / "c.jsonl", out, backend, cfg)
    assert counts["already_done"] == 3 and counts["written"] == 2
    ids = [r["id"] for _, r in read_jsonl(out)]
    assert sorted(ids) == [f"c{i}" for i in range(5)]


class _Handler(http.server.BaseHTTPRequestHandler):
    fail_first = 0
    calls = 0

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).calls += 1
        if "too long" in body["messages"][-1]["content"]:
            # what vLLM answers when the prompt exceeds max_model_len
            msg = json.dumps({"object": "error", "message": "This model's maximum context length is 64 tokens."})
            self.send_response(400)
            self.send_header("Content-Length", str(len(msg)))
            self.end_headers()
            self.wfile.write(msg.encode())
            return
        if type(self).calls <= type(self).fail_first:
            self.send_response(500)
            self.end_headers()
            return
        text = "echo: " + body["messages"][-1]["content"]
        data = json.dumps({"choices": [{"message": {"content": text}, "finish_reason": "stop"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


def _serve(fail_first):
    handler = type("H", (_Handler,), {"fail_first": fail_first, "calls": 0})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


def test_server_backend_retries_and_fails_over(tmp_path):
    _convs(tmp_path / "c.jsonl", n=6)
    srv, url = _serve(fail_first=3)
    dead = "http://127.0.0.1:9"  # discard port: connection refused
    cfg = RegenConfig(max_new_tokens=8)
    backend = ServerBackend([dead, url], "m", cfg, concurrency=4, timeout=5, retries=3, backoff=0.01)
    counts = regenerate(tmp_path / "c.jsonl", tmp_path / "r.jsonl", backend, cfg)
    srv.shutdown()
    assert counts["written"] == 6 and counts["failed"] == 0
    assert backend.failures  # the dead server and the 500s were seen and retried
    for _, r in read_jsonl(tmp_path / "r.jsonl"):
        users = [m["content"] for m in r["messages"] if m["role"] == "user"]
        assistants = [m["content"] for m in r["messages"] if m["role"] == "assistant"]
        assert assistants == ["echo: " + u for u in users]


def test_unreachable_servers_record_failures_then_resume(tmp_path):
    _convs(tmp_path / "c.jsonl", n=4)
    cfg = RegenConfig(max_new_tokens=8)
    down = ServerBackend(["http://127.0.0.1:9"], "m", cfg, retries=1, backoff=0.01)
    counts = regenerate(tmp_path / "c.jsonl", tmp_path / "r.jsonl", down, cfg)
    assert counts["failed"] == 4 and counts["written"] == 0
    srv, url = _serve(fail_first=0)
    counts = regenerate(tmp_path / "c.jsonl", tmp_path / "r.jsonl", ServerBackend([url], "m", cfg), cfg)
    srv.shutdown()
    assert counts["written"] == 4 and counts["failed"] == 0


def test_prompt_too_long_for_server_ends_conversation_without_retry(tmp_path):
    rows = [{"id": "ok", "messages": [{"role": "user", "content": "hi"}]},
            {"id": "long", "messages": [{"role": "user", "content": "too long"}]},
            {"id": "late", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                        {"role": "user", "content": "too long"}]}]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    srv, url = _serve(fail_first=0)
    cfg = RegenConfig(max_new_tokens=8)
    backend = ServerBackend([url], "m", cfg, retries=3, backoff=0.01)
    counts = regenerate(tmp_path / "c.jsonl", tmp_path / "r.jsonl", backend, cfg)
    srv.shutdown()
    # One request each: a 400 is not retried. "late" keeps its first answered turn.
    assert srv.RequestHandlerClass.calls == 4 and counts["failed"] == 0
    assert counts["written"] == 2 and counts["skipped_context"] == 1 and counts["skipped_no_turn"] == 0
    out = {r["id"]: r for _, r in read_jsonl(tmp_path / "r.jsonl")}
    assert out["late"]["finish"] == "context" and len(out["late"]["messages"]) == 2


def test_engine_prompt_without_room_ends_the_conversation(tmp_path, tiny_chat_target):
    rows = [{"id": "short", "messages": [{"role": "user", "content": "hi"}]},
            {"id": "long", "messages": [{"role": "user", "content": "word " * 200}]}]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = RegenConfig(max_new_tokens=4, max_len=64)
    backend = EngineBackend(tiny_chat_target, cfg, batch_size=2, device="cpu", dtype=torch.float32)
    counts = regenerate(tmp_path / "c.jsonl", tmp_path / "r.jsonl", backend, cfg)
    assert counts["written"] == 1 and counts["skipped_context"] == 1
    assert counts["skipped_no_turn"] == 0 and counts["failed"] == 0
    assert [r["id"] for _, r in read_jsonl(tmp_path / "r.jsonl")] == ["short"]
