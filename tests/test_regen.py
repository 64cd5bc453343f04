"""Regeneration: engine answers equal HF greedy answers; resume never duplicates or loses
samples; the server back-end retries, fails over and records what still failed."""

import http.server
import json
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import transformers
from conftest import make_tiny

from fledge import cli
from fledge.core.config import RegenConfig
from fledge.core.errors import FledgeError
from fledge.core.files import read_jsonl
from fledge.core.target import resolve_target
from fledge.data.prep import load_conversations
from fledge.data.regen import EngineBackend, ServerBackend, regenerate


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
    cfg = RegenConfig(max_new_tokens=6, max_len=256, chunk=2, batch_size=3)
    backend = EngineBackend(t, cfg, device="cpu", dtype=torch.float32)
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
    cfg = RegenConfig(max_new_tokens=4, max_len=64, batch_size=2)
    backend = EngineBackend(tiny_chat_target, cfg, device="cpu", dtype=torch.float32)
    counts = regenerate(tmp_path / "c.jsonl", tmp_path / "r.jsonl", backend, cfg)
    assert counts["written"] == 1 and counts["skipped_context"] == 1
    assert counts["skipped_no_turn"] == 0 and counts["failed"] == 0
    assert [r["id"] for _, r in read_jsonl(tmp_path / "r.jsonl")] == ["short"]


def test_complete_last_line_without_newline_is_kept(tmp_path, tiny_chat_target):
    _convs(tmp_path / "c.jsonl", n=3)
    cfg = RegenConfig(max_new_tokens=4, max_len=256, batch_size=3)
    backend = EngineBackend(tiny_chat_target, cfg, device="cpu", dtype=torch.float32)
    out = tmp_path / "r.jsonl"
    regenerate(tmp_path / "c.jsonl", out, backend, cfg)
    full = out.read_bytes()
    out.write_bytes(full.rstrip(b"\n"))  # finished, but the newline never made it
    counts = regenerate(tmp_path / "c.jsonl", out, backend, cfg)
    assert counts["already_done"] == 3 and counts["written"] == 0
    assert out.read_bytes() == full
    out.write_bytes(full[:-20])  # torn inside the last record: that one is redone
    counts = regenerate(tmp_path / "c.jsonl", out, backend, cfg)
    assert counts["already_done"] == 2 and counts["written"] == 1
    assert sorted(r["id"] for _, r in read_jsonl(out)) == ["c0", "c1", "c2"]


def test_nan_target_stops_before_writing(tmp_path, tiny_chat_target):
    t = tiny_chat_target
    model = make_tiny("llama", seed=5, vocab_size=len(t.tokenizer))
    with torch.no_grad():
        model.model.layers[3].mlp.down_proj.weight[0, 0] = float("nan")
    _convs(tmp_path / "c.jsonl", n=2)
    cfg = RegenConfig(max_new_tokens=4, max_len=256, batch_size=2)
    backend = EngineBackend(SimpleNamespace(model=model, tokenizer=t.tokenizer, name="nan-target"), cfg,
                            device="cpu", dtype=torch.float32)
    with pytest.raises(FledgeError, match="nan-target: the first forward gives NaN/Inf logits"):
        regenerate(tmp_path / "c.jsonl", tmp_path / "r.jsonl", backend, cfg)
    assert not (tmp_path / "r.jsonl").exists()


class _FaultHandler(http.server.BaseHTTPRequestHandler):
    """Answers by what the last user turn asks for: a fault, a slow reply, or `seed=<seed>`."""
    calls: dict = {}

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ask = body["messages"][-1]["content"]
        type(self).calls[ask] = type(self).calls.get(ask, 0) + 1
        status, reply = 200, {"choices": [{"message": {"content": f"seed={body['seed']}"}, "finish_reason": "stop"}]}
        if ask == "http400":
            status, reply = 400, {"object": "error", "message": "unknown model"}
        elif ask == "http503":
            status, reply = 503, {}
        elif ask == "error200":
            reply = {"object": "error", "message": "engine crashed"}
        elif ask in ("null", "int", "list"):
            reply = {"choices": [{"message": {"content": {"null": None, "int": 3, "list": ["a"]}[ask]}}]}
        elif ask == "nochoices":
            reply = {"choices": []}
        elif ask == "slow":
            time.sleep(3.0)
        data = json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


def _serve_faults():
    handler = type("F", (_FaultHandler,), {"calls": {}})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


FAULTS = {"http400": "HTTP 400", "http503": "HTTP 503", "error200": "error body", "null": "content is missing",
          "int": "content is int", "list": "content is list", "nochoices": "fewer choices", "slow": "no reply"}


def test_server_faults_are_counted_and_never_written(tmp_path, capsys):
    rows = [{"id": ask, "messages": [{"role": "user", "content": ask}]} for ask in [*FAULTS, "fine"]]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    srv, url = _serve_faults()
    cfg = RegenConfig(max_new_tokens=8)
    backend = ServerBackend([url], "m", cfg, concurrency=9, timeout=1.0, retries=1, backoff=0.01)
    counts = regenerate(tmp_path / "c.jsonl", tmp_path / "r.jsonl", backend, cfg)
    srv.shutdown()
    assert counts["written"] == 1 and counts["failed"] == len(FAULTS)
    for ask, reason in FAULTS.items():
        assert reason in counts["failed_samples"][ask], (ask, counts["failed_samples"])
    # 5xx and timeouts are retried; a 4xx, an error body or a malformed reply is not
    retried = {"http503", "slow"}
    assert {a: n for a, n in srv.RequestHandlerClass.calls.items()} == {
        **{a: 2 if a in retried else 1 for a in FAULTS}, "fine": 1}
    assert sum(counts["request_errors"].values()) == len(FAULTS) + len(retried)
    assert [r["id"] for _, r in read_jsonl(tmp_path / "r.jsonl")] == ["fine"]
    assert json.loads((tmp_path / "r.summary.json").read_text())["failed_samples"] == counts["failed_samples"]
    err = capsys.readouterr().err
    assert all(f"warning: {ask}: request failed" in err for ask in FAULTS)


def test_cli_exits_nonzero_when_every_request_fails(tmp_path, capsys):
    rows = [{"id": f"b{i}", "messages": [{"role": "user", "content": "http400"}]} for i in range(3)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    srv, url = _serve_faults()
    rc = cli.main(["regen", str(tmp_path / "c.jsonl"), str(tmp_path / "r.jsonl"), "--server", url])
    assert rc == 1
    assert "3 of 3 samples failed" in capsys.readouterr().err
    assert not (tmp_path / "r.jsonl").exists()  # nothing kept: no output file left behind
    assert json.loads((tmp_path / "r.summary.json").read_text())["failed"] == 3
    (tmp_path / "r.jsonl").touch()  # a file that was there before the run stays
    assert cli.main(["regen", str(tmp_path / "c.jsonl"), str(tmp_path / "r.jsonl"), "--server", url]) == 1
    srv.shutdown()
    assert (tmp_path / "r.jsonl").exists() and not (tmp_path / "r.jsonl").read_text()


def test_server_seed_follows_the_sample_not_its_place(tmp_path):
    rows = [{"id": f"s{i}", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(6)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    srv, url = _serve_faults()
    cfg = RegenConfig(max_new_tokens=8, temperature=1.0, seed=3, chunk=2)
    full, part = tmp_path / "full.jsonl", tmp_path / "part.jsonl"
    regenerate(tmp_path / "c.jsonl", full, ServerBackend([url], "m", cfg), cfg)
    lines = full.read_text().splitlines(keepends=True)
    part.write_text(lines[0] + lines[3])  # a run that wrote s0 and s3 before it was stopped
    regenerate(tmp_path / "c.jsonl", part, ServerBackend([url], "m", cfg), cfg)
    srv.shutdown()
    assert {r["id"]: r for _, r in read_jsonl(part)} == {r["id"]: r for _, r in read_jsonl(full)}
    assert len({r["messages"][-1]["content"] for _, r in read_jsonl(full)}) == 6  # one seed per sample


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_engine_resume_mid_chunk_equals_an_uninterrupted_run(tmp_path, tiny_chat_target, temperature):
    _convs(tmp_path / "c.jsonl", n=6)
    cfg = RegenConfig(max_new_tokens=6, max_len=256, chunk=4, temperature=temperature, seed=1, batch_size=4)
    backend = EngineBackend(tiny_chat_target, cfg, device="cpu", dtype=torch.float32)
    full, part = tmp_path / "full.jsonl", tmp_path / "part.jsonl"
    regenerate(tmp_path / "c.jsonl", full, backend, cfg)
    lines = full.read_text().splitlines(keepends=True)
    part.write_text("".join(lines[:2]) + lines[2][:30])  # stopped mid-chunk, mid-line
    counts = regenerate(tmp_path / "c.jsonl", part, backend, cfg)
    assert counts["already_done"] == 2 and counts["written"] == 4
    assert {r["id"]: r for _, r in read_jsonl(part)} == {r["id"]: r for _, r in read_jsonl(full)}


def test_progress_moves_per_answer(tmp_path):
    srv, url = _serve_faults()
    cfg = RegenConfig(max_new_tokens=8)
    seen = []
    answers = ServerBackend([url], "m", cfg, concurrency=2).answer(
        [[{"role": "user", "content": f"q{i}"}] for i in range(5)], [0] * 5, progress=seen.append)
    srv.shutdown()
    assert seen == [1] * 5 and [a.text for a in answers] == ["seed=0"] * 5


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory, tiny_chat_target):
    d = tmp_path_factory.mktemp("tiny_target")
    tiny_chat_target.model.save_pretrained(d)
    tiny_chat_target.tokenizer.save_pretrained(d)
    return d


@pytest.mark.slow
def test_kill_9_then_rerun_equals_an_uninterrupted_run(tmp_path, tiny_target_dir, capsys):
    """A real sampled `fledge regen` process (forked, see tests/forked.py) killed with SIGKILL
    mid-run, then rerun (in this process: the same code path).
    Greedy resumes take the same path and are checked in process
    (test_engine_resume_mid_chunk_equals_an_uninterrupted_run)."""
    temperature = 1.0
    import signal

    import forked

    from fledge.core.target import load_target
    n = 24
    rows = [{"id": f"k{i}", "messages": [{"role": "user", "content": f"tell me about {i} things"}]} for i in range(n)]
    convs, out, ref = tmp_path / "c.jsonl", tmp_path / "r.jsonl", tmp_path / "ref.jsonl"
    convs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["regen", str(convs), str(out), "--target", str(tiny_target_dir), "--max-new-tokens", "12",
            "--max-len", "256", "--chunk", "3", "--batch-size", "3", "--temperature", str(temperature), "--seed", "7"]
    proc = forked.fledge(args)
    deadline = time.time() + 180
    while time.time() < deadline and proc.is_alive():
        if out.exists() and out.read_bytes().count(b"\n") >= 4:
            proc.kill()
            break
        time.sleep(0.002)
    assert forked.wait(proc, 30) == -signal.SIGKILL, "the run ended before the kill"
    cut = out.read_bytes()
    written_before = cut.count(b"\n")
    assert written_before < n
    assert cli.main(args) == 0

    cfg = RegenConfig(max_new_tokens=12, max_len=256, chunk=3, temperature=temperature, seed=7, batch_size=3)
    backend = EngineBackend(load_target(str(tiny_target_dir)), cfg, device="cpu", dtype=torch.float32)
    regenerate(convs, ref, backend, cfg)
    lines = out.read_text().splitlines()
    ids = [json.loads(ln)["id"] for ln in lines]  # a torn line would not parse
    duplicates, lost = len(ids) - len(set(ids)), n - len(set(ids))
    torn = not cut.endswith(b"\n")
    with capsys.disabled():
        print(f"\nkill -9 after {written_before} of {n} lines (torn tail: {torn}): "
              f"{duplicates} duplicates, {lost} lost, 0 torn lines after the rerun")
    assert duplicates == 0 and lost == 0
    assert {r["id"]: r for _, r in read_jsonl(out)} == {r["id"]: r for _, r in read_jsonl(ref)}


def test_mtbench_turns_are_answered_turn_by_turn(tmp_path, tiny_chat_target):
    """An MT-Bench record (two consecutive user turns, as prep stores it) comes back as turn 1,
    its answer, turn 2, the answer to the whole exchange; --max-turns 1 keeps turn 1 only."""
    t = tiny_chat_target
    src = tmp_path / "question.jsonl"
    src.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": ["first question", "second one"]}) + "\n")
    rec = {"id": "81", "source": "mt", "messages": load_conversations(str(src))[0][0]["messages"]}
    (tmp_path / "c.jsonl").write_text(json.dumps(rec) + "\n")
    first = t.tokenizer.apply_chat_template(rec["messages"][:1], add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
    # The random model's third greedy token ends its turn: a cut-off answer would end the conversation.
    stop = t.model.generate(first, max_new_tokens=3, do_sample=False)[0, -1].item()
    for max_turns, roles in ((None, ["user", "assistant", "user", "assistant"]), (1, ["user", "assistant"])):
        cfg = RegenConfig(max_new_tokens=5, max_len=256, max_turns=max_turns, batch_size=2)
        backend = EngineBackend(t, cfg, device="cpu", dtype=torch.float32)
        backend.eos = [stop]
        out = tmp_path / f"r{max_turns}.jsonl"
        regenerate(tmp_path / "c.jsonl", out, backend, cfg)
        (_, row), = read_jsonl(out)
        msgs = row["messages"]
        assert [m["role"] for m in msgs] == roles
        assert [m["content"] for m in msgs[::2]] == ["first question", "second one"][:len(roles) // 2]
        for k in range(1, len(msgs), 2):  # each answer is HF's greedy reply to the chat up to its turn
            ids = t.tokenizer.apply_chat_template(msgs[:k], add_generation_prompt=True, return_tensors="pt",
                                                  return_dict=True)["input_ids"]
            new = t.model.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=backend.eos)[0, ids.shape[1]:]
            new = new.tolist()
            assert msgs[k]["content"] == t.tokenizer.decode(new[:-1] if new and new[-1] in backend.eos else new)
