"""Serving-log parsers on lines in the engines' real formats, the server bench against a local
streaming server (127.0.0.1 only, bounded loops), the rank probe, the engine path on CPU."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from conftest import make_tiny

from fledge.cli import main
from fledge.core.errors import FledgeError
from fledge.engine.rig import (
    EngineRig,
    RankProbe,
    measure_draft_ms,
    measure_verify_ms,
    probe_profile,
    run_ar,
)
from fledge.perf.serving import ServerBench, bench_server, one_request, parse_log

# Formats: sglang scheduler_metrics_mixin.log_decode_stats (current, then an older version without
# "accept rate"), a non-speculative line; vllm v1/spec_decode/metrics.py SpecDecodingLogging.log.
SGLANG_LOG = """\
[2025-06-01 10:00:00] Prefill batch, #new-seq: 1, #new-token: 42, #cached-token: 0, token usage: 0.00, #running-req: 0, #queue-req: 0,
[2025-06-01 10:00:01] Decode batch, #running-req: 1, #token: 120, token usage: 0.00, accept len: {a}, accept rate: 0.45, cuda graph: True, gen throughput (token/s): 120.50, #queue-req: 0,
[2025-06-01 10:00:02] Decode batch, #running-req: 2, #token: 300, token usage: 0.01, accept len: {b}, cuda graph: True, gen throughput (token/s): 99.50, #queue-req: 0
"""
VLLM_LINE = ("INFO 06-01 10:00:0{i} [metrics.py:96] SpecDecoding metrics: Mean acceptance length: {mal:.2f}, "
             "Accepted throughput: 12.30 tokens/s, Drafted throughput: 30.00 tokens/s, Accepted: {acc} tokens, "
             "Drafted: {dr} tokens, Per-position acceptance rate: {rates}, Avg Draft acceptance rate: {avg:.1f}%\n")


def test_sglang_log(tmp_path):
    a, b = round(random.uniform(1, 4), 2), round(random.uniform(1, 4), 2)
    log = tmp_path / "sglang.log"
    log.write_text(SGLANG_LOG.format(a=a, b=b))
    s = parse_log(log)
    assert s["engine"] == "sglang" and s["lines"] == 2 and s["speculative"]
    assert s["accept_length"] == pytest.approx((a + b) / 2)
    assert s["gen_throughput_mean"] == pytest.approx(110.0)
    assert s["accept_rate_as_logged"] == pytest.approx(0.45)
    base = tmp_path / "base.log"
    base.write_text("Decode batch, #running-req: 1, #token: 9, token usage: 0.00, cuda graph: True, "
                    "gen throughput (token/s): 86.20, #queue-req: 0,\n")
    s = parse_log(base)
    assert not s["speculative"] and s["gen_throughput_mean"] == pytest.approx(86.2) and "accept_length" not in s


def test_vllm_log_profile(tmp_path):
    rng, k, lines, drafts_all, acc_all, reach_w = random.Random(), 3, [], 0, 0, [0.0] * 3
    for i in range(3):
        drafts = rng.randint(50, 500)
        per_pos = sorted((rng.randint(0, drafts) for _ in range(k)), reverse=True)  # accepted at position j
        acc = sum(per_pos)
        rates = ", ".join(f"{x / drafts:.3f}" for x in per_pos)
        lines.append(VLLM_LINE.format(i=i, mal=1 + acc / drafts, acc=acc, dr=drafts * k, rates=rates,
                                      avg=100 * acc / (drafts * k)))
        drafts_all, acc_all = drafts_all + drafts, acc_all + acc
        reach_w = [w + float(f"{x / drafts:.3f}") * drafts for w, x in zip(reach_w, per_pos)]
    log = tmp_path / "vllm.log"
    log.write_text("INFO starting server\n" + "".join(lines))
    s = parse_log(log)
    assert s["engine"] == "vllm" and s["lines"] == 3 and s["num_speculative_tokens"] == k
    assert s["accept_length"] == pytest.approx(1 + acc_all / drafts_all)
    reach = [w / drafts_all for w in reach_w]
    assert s["reached_depth"] == pytest.approx(reach)
    cond = [p[0] for p in s["profile"]]
    assert cond[0] == pytest.approx(reach[0]) and cond[1] * reach[0] == pytest.approx(reach[1])


def test_unparseable_log_is_one_error_line(tmp_path, capsys):
    log = tmp_path / "x.log"
    log.write_text("hello\nDecode batch, but nothing else\n")
    assert main(["bench", "--log", str(log)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "x.log" in err


# --------------------------------------------------------------------------- server
class FakeServer(BaseHTTPRequestHandler):
    tokens, delay, seen, mode = 12, 0.005, [], "ok"  # mode "html": a page, status 200; "cut": no [DONE]

    def log_message(self, *a):
        pass

    def do_GET(self):
        body = json.dumps({"data": [{"id": "tiny"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append(req)
        self.send_response(200)
        mode = self.mode.split()[-1] if len(self.seen) % 2 == 0 or not self.mode.startswith("every-other") else "ok"
        if mode == "html":
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(b"<html><body>Welcome to nginx!</body></html>")
            return
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = min(self.tokens, req["max_tokens"])
        if mode == "cut":
            self.wfile.write(f"data: {json.dumps({'choices': [{'delta': {'content': 'half'}}]})}\n\n".encode())
            return
        for i in range(n):
            time.sleep(self.delay)
            self.wfile.write(f"data: {json.dumps({'choices': [{'delta': {'content': f't{i} '}}]})}\n\n".encode())
            self.wfile.flush()
        usage = {"choices": [], "usage": {"completion_tokens": n, "prompt_tokens": 5}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())


@pytest.fixture
def server():
    FakeServer.seen, FakeServer.mode = [], "ok"
    srv = ThreadingHTTPServer(("127.0.0.1", 0), FakeServer)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_one_streamed_request(server):
    r = one_request(server + "/v1", "tiny", "hi", 8, 10)
    assert r["tokens"] == 8
    assert 0 < r["ttft_ms"] < 1e3 * r["seconds"]
    assert r["decode_tok_s"] < 7 / (7 * FakeServer.delay)  # can't beat the server's pacing
    assert FakeServer.seen[-1]["stream"] is True and FakeServer.seen[-1]["model"] == "tiny"


def test_concurrency_levels_are_bounded(server):
    levels = bench_server(ServerBench(server, ["a", "b", "c"], max_tokens=6, concurrency=(1, 3), requests=5))
    assert [lv["concurrency"] for lv in levels] == [1, 3]
    assert all(lv["requests"] == 5 and lv["errors"] == 0 and lv["tokens"] == 30 for lv in levels)
    assert len(FakeServer.seen) == 10
    t0 = time.perf_counter()  # the time bound: far more requests asked than fit in 0.3 s
    lv = bench_server(ServerBench(server, ["a"], max_tokens=12, requests=10_000, duration_s=0.3))[0]
    assert lv["requests"] < 100 and time.perf_counter() - t0 < 5


@pytest.mark.parametrize("mode", ["html", "cut"])
def test_answers_without_done_are_failures(server, mode, capsys, tmp_path):
    """An HTML page with status 200 and a stream cut before `data: [DONE]` are failed requests:
    counted as such, and a run where every request fails exits 2 with one line."""
    FakeServer.mode = mode
    cfg = ServerBench(server, ["a"], model="tiny", max_tokens=6, requests=3)
    with pytest.raises(FledgeError, match="all 3 requests failed.*DONE"):
        bench_server(cfg)
    capsys.readouterr()
    out = tmp_path / "b.json"
    assert main(["bench", "--url", server, "--model", "tiny", "--requests", "2", "--concurrency", "1",
                 "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "all 2 requests failed" in err[0] and not out.exists()
    if mode == "html":
        assert "text/html" in err[0]
    # Every other request cut: half count as requests, half as failures, by their problem.
    FakeServer.mode = "every-other " + mode
    lv = bench_server(ServerBench(server, ["a"], model="tiny", max_tokens=6, requests=4))[0]
    assert (lv["requests"], lv["errors"], lv["tokens"]) == (2, 2, 12)
    assert sum(lv["failures"].values()) == 2 and all("DONE" in k for k in lv["failures"])


def test_server_not_answering(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(FledgeError, match="not answering"):
        one_request(f"http://127.0.0.1:{port}", "m", "hi", 4, 2)
    assert main(["bench", "--url", f"http://127.0.0.1:{port}", "--requests", "1", "--timeout", "2"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


# --------------------------------------------------------------------------- engine
class _Stub:
    spec = type("S", (), {"topk": 3, "num_steps": 3})()
    aux_ids = None
    vocab = None

    def observe(self, *a):
        pass


def test_rank_probe_counts_sibling_ranks_on_the_spine_and_off_it():
    from fledge.engine.tree import make_tree

    # root → tokens 10, 11, 12 (ranks 0, 1, 2); node 1 (token 10) → 30, 31; node 2 (token 11) → 20, 21, 22
    tree = make_tree(torch.tensor([5]), torch.tensor([[10, 11, 12, 30, 31, 20, 21, 22]]),
                     torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]]))
    probe = RankProbe(_Stub())
    for path, n in [([5, 10, 30], 3), ([5, 10, 31], 3), ([5, 10, 7], 2), ([5, 11, 21], 3), ([5, 11, 20], 3),
                    ([5, 12, 12], 2), ([5, 5, 5], 1)]:
        probe.tree = tree
        probe.observe(torch.tensor([path]), None, torch.tensor([n]), None, None)
    spine, off = 1, 0
    assert probe.reached[spine] == [7, 3, 0] and probe.reached[off] == [0, 2, 0]  # leaves are never expanded
    assert probe.hits[spine] == [[3, 2, 1], [1, 1, 0], [0, 0, 0]]
    assert probe.hits[off] == [[0, 0, 0], [1, 1, 0], [0, 0, 0]]
    prof = probe.profile()
    assert prof["spine"][0] == pytest.approx([3 / 7, 2 / 7, 1 / 7]) and prof["spine"][1] == pytest.approx([1 / 3, 1 / 3, 0])
    assert prof["ranks"][1] == pytest.approx([0.5, 0.5, 0])
    # Rows nothing reached take both tables pooled: depth 1 off the spine is the spine's row.
    assert prof["ranks"][0] == prof["spine"][0] and prof["ranks"][2] == prof["spine"][2] == [0, 0, 0]


def test_verify_timing_warms_each_size_and_takes_the_median(monkeypatch):
    """A size whose one call stalls keeps its median; each size is warmed, then timed, before
    the next is built (the engine replays a graph only until its next capture)."""
    from fledge.engine import rounds

    calls = []

    def fake_verify(target, cache, tree, cache_len, aux_ids):
        n = tree.tokens.shape[1]
        calls.append(n)
        stall = n == 4 and calls.count(4) == 5  # the third timed call of size 4
        time.sleep(0.3 if stall else 0.004 * n)

    monkeypatch.setattr(rounds, "verify_forward", fake_verify)
    target = type("T", (), {"new_cache": lambda self, b, n: None, "cuda_graph_ok": False})()
    draft = type("D", (), {"cfg": type("C", (), {"aux_layer_ids": None})()})()
    rig = EngineRig(None, None, target, draft, [], torch.device("cpu"))
    ms = measure_verify_ms(rig, [1, 4, 8], context=10, iters=5, warmup=2)
    assert calls == [1] * 7 + [4] * 7 + [8] * 7
    assert ms[1] < ms[4] < ms[8] and ms[4] < 100  # the 300 ms call is not the median


@pytest.mark.slow  # ~20 s alone, minutes on a loaded 2-core machine
def test_engine_measurements_run_on_cpu():
    from fledge.core.config import DraftConfig
    from fledge.drafter.eagle3 import Eagle3Draft
    from fledge.engine import build_engine_target
    from fledge.perf.acceptance import Profile
    from fledge.perf.tune import Timings, grid, rank_all
    from fledge.perf.tune_engine import validate, validation_shapes

    hf = make_tiny("llama")
    draft = Eagle3Draft.from_target(DraftConfig.from_target(hf.config), hf).eval()
    rig = EngineRig(hf, None, build_engine_target(hf, torch.float32, torch.device("cpu")), draft, [], torch.device("cpu"))
    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    prompts = [torch.randint(0, 301, (9,), generator=g).tolist() for _ in range(2)]
    ar = run_ar(rig, prompts, 12)
    verify = measure_verify_ms(rig, [1, 4], context=20, iters=2)
    draft_ms, overhead = measure_draft_ms(rig, prompts[:1], [1, 2], 8)
    assert ar["ar_ms"] > 0 and all(v > 0 for v in verify.values()) and set(draft_ms) == {1, 2} and overhead >= 0
    prof = probe_profile(rig, prompts[:1], 3, 2, 12)
    assert len(prof["ranks"]) == 3 and prof["rounds"] >= 11  # >= one round per token after the first
    assert len(prof["spine"]) == 3 and prof["reached_spine"][0] == prof["rounds"] and prof["reached"][0] == 0
    preds = rank_all(Profile(prof["ranks"], prof["spine"]), Timings(ar["ar_ms"], verify, draft_ms, overhead),
                     grid(6, (1, 2, 4)))
    by_shape = {p.shape: p for p in preds}
    rows = validate(rig, prompts[:1], [by_shape[s] for s in validation_shapes(preds)], 8, 1e3 / ar["ar_ms"])
    assert len(rows) >= 6 and {r["topk"] for r in rows} >= {1, 2} and all(r["tok_s_measured"] > 0 for r in rows)


def test_vllm_log_feeds_tune(tmp_path):
    """`fledge bench --log` → JSON → `fledge tune what-if --accept-json`: the chain profile
    read from vLLM's per-position rates reproduces the logged accept length."""
    log, prof = tmp_path / "vllm.log", tmp_path / "p.json"
    log.write_text(VLLM_LINE.format(i=0, mal=2.5, acc=300, dr=600, rates="0.800, 0.500, 0.200", avg=50.0))
    assert main(["bench", "--log", str(log), "--json", str(prof)]) == 0
    out = tmp_path / "t.json"
    assert main(["tune", "what-if", "--ar-ms", "10", "--verify-ms", "1:10,4:12", "--draft-ms", "1",
                 "--accept-json", str(prof), "--max-depth", "3", "--json", str(out)]) == 0
    chain3 = next(p for p in json.loads(out.read_text())["predictions"] if p["num_steps"] == 3)
    assert chain3["accept_length"] == pytest.approx(1 + 0.8 + 0.5 + 0.2)
    assert chain3["tok_s"] == pytest.approx(1e3 * 2.5 / (3 * 1 + 12))


def test_plots_are_written(tmp_path):
    from fledge.perf.acceptance import Profile
    from fledge.perf.bench import plot_engine
    from fledge.perf.tune import Timings, grid, plot, rank_all

    results = [{"shape": f"s{s} k1 n{s + 1}", "tok_s": random.uniform(20, 80),
                "depth_acceptance": sorted((random.random() for _ in range(s)), reverse=True)} for s in (2, 4)]
    plot_engine(results, 40.0, tmp_path / "engine.png")
    preds = rank_all(Profile([[0.7, 0.1]] * 4), Timings(10, {1: 10, 16: 14}, {1: 1, 2: 1.2}), grid(4, (1, 2)))
    plot(preds, 100.0, tmp_path / "tune.png", validation=[{"label": preds[0].shape.label, "tok_s_measured": 90.0}])
    assert all((tmp_path / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for f in ("engine.png", "tune.png"))


def test_serve_sweep_records_a_server_that_fails_and_goes_on(server, tmp_path):
    """Each k's engine exits while starting: every k is recorded as failed with its log, the sweep
    goes on to the next, writes its JSON and exits 1, with no row measured."""
    prompts = tmp_path / "c.jsonl"
    prompts.write_text(json.dumps({"id": "c0", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    out = tmp_path / "sweep.json"
    rc = main(["serve-sweep", "--target", str(tmp_path), "--drafter", str(tmp_path), "--ks", "1,2", "--python", "false",
               "--plain-url", server + "/v1", "--prompt-file", str(prompts), "--log-dir", str(tmp_path / "logs"),
               "--json", str(out)])
    r = json.loads(out.read_text())
    assert rc == 1 and r["complete"] and r["rows"] == [] and r["calibration"] is None
    assert set(r["failed"]) == {"1", "2"} and all("exited with 1 while starting" in e and f"k{k}.log" in e
                                                  for k, e in r["failed"].items())
