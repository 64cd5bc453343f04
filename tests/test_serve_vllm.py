"""The engineer who serves with vLLM, against the real vLLM CPU build (SmolLM2 and the shipped
drafter): the launch line fledge prints runs and passes `doctor --launch`, which refuses it
serving another model; `bench --url` reads the speculating server's accept length from /metrics
and compares it with a plain server interleaved; a wrong model name is answered with the served
names; a plain vLLM log is a baseline; `serve-sweep` serves k, measures and writes its files.

The session's plain and speculating servers (conftest: k = 3) serve the whole module; the sweep
starts one more (k = 1) beside the plain one. Without the vLLM venv this skips, unless
FLEDGE_REQUIRE_VLLM is set.
"""

from __future__ import annotations

import json
import shlex
import time
from pathlib import Path

import pytest
from conftest import SPEC_K

from fledge.cli import main
from fledge.core.openai_client import Client, ServerError
from fledge.doctor.checks import FAIL, PASS, exit_code
from fledge.doctor.doctor import doctor
from fledge.perf.calibrate import scrape
from fledge.perf.serving import parse_log

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "drafters" / "smollm2-135m"
NAME = "smollm2-135m"
K = SPEC_K
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Explain what a list is in Python.",
             "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def servers(vllm_plain, vllm_spec, vllm_logs):
    """(plain, speculating) servers started through scripts/vllm_serve.py, and their log dir."""
    return vllm_plain, vllm_spec, vllm_logs


@pytest.fixture(scope="module")
def conversations(tmp_path_factory) -> Path:
    """A conversations file as `fledge prep` writes it (JSONL records with messages)."""
    path = tmp_path_factory.mktemp("prep") / "heldout.jsonl"
    path.write_text("".join(json.dumps({"id": f"c{i}", "source": "test", "messages": [
        {"role": "user", "content": q}, {"role": "assistant", "content": "old answer"}]}) + "\n"
        for i, q in enumerate(QUESTIONS)))
    return path


def test_doctor_passes_the_line_that_runs_and_refuses_another_model(servers):
    """The line the speculating server was started from (the CPU venv's, --enforce-eager and
    all) passes every check with no --target; the same line serving another model, or the
    drafter itself, is refused."""
    _, spec, _ = servers
    results = doctor(SHIPPED, None, spec.line)
    assert exit_code(results) == 0, [c for c in results if c.status != PASS]
    assert {c.name for c in results} >= {"target", "launch.model", "launch.draft_path", "launch.algorithm"}
    words = shlex.split(spec.line)
    model_at = words.index("--model") + 1
    for other in ("Qwen/Qwen3-8B", str(SHIPPED)):
        line = shlex.join(words[:model_at] + [other] + words[model_at + 1:])
        checks = {c.name: c for c in doctor(SHIPPED, None, line)}
        assert checks["launch.model"].status == FAIL, checks["launch.model"]


def test_bench_url_reads_accept_length_and_compares_with_plain(servers, conversations, tmp_path):
    plain, spec, _ = servers
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    before = scrape(Client(spec.url).metrics())
    rc = main(["bench", "--url", spec.url + "/v1", "--baseline-url", plain.url + "/v1", "--prompt-file",
               str(conversations), "--num-prompts", "4", "--requests", "4", "--rounds", "2", "--concurrency", "1",
               "--max-new-tokens", "24", "--json", str(out), "--png", str(png)])
    after = scrape(Client(spec.url).metrics())
    assert rc == 0
    r = json.loads(out.read_text())
    level, base = r["levels"][0], r["baseline_levels"][0]
    # The accept length is the server's own over the run: its counters read independently agree.
    drafts = after["drafts"] - before["drafts"]
    assert drafts > 0 and level["k"] == K and base["k"] == 0 and base["accept_length"] is None
    assert level["accept_length"] == pytest.approx(1 + (after["accepted"] - before["accepted"]) / drafts)
    assert 1.0 <= level["accept_length"] <= K + 1
    assert level["speedup"] == pytest.approx(level["per_request_tok_s"] / base["per_request_tok_s"])
    # Greedy speculation is lossless: both servers wrote the same number of tokens to the same prompts.
    assert (level["requests"], level["errors"], level["tokens"]) == (4, 0, base["tokens"])
    assert [p[0]["content"] for p in r["prompts"]] == QUESTIONS  # the first user turns, not raw JSON lines
    assert (r["max_tokens"], r["model"], r["baseline_model"]) == (24, NAME, NAME)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_wrong_model_name_lists_the_served_names(servers):
    plain, _, _ = servers
    with pytest.raises(ServerError) as e:
        Client(plain.url).chat({"model": "Qwen/Qwen3-8B", "messages": [{"role": "user", "content": "hi"}],
                                "max_tokens": 2})
    assert e.value.status == 404 and f"it serves {NAME}" in str(e.value) and "\n" not in str(e.value)


def test_bench_log_takes_a_plain_vllm_log_as_baseline(servers, capsys):
    """vLLM logs its generation throughput every few seconds while it generates: requests go to
    both servers until each log holds such a line (bounded), then --log/--baseline-log read them."""
    plain, spec, logs = servers
    body = {"model": NAME, "messages": [{"role": "user", "content": "Count from one to fifty in words."}],
            "max_tokens": 48, "temperature": 0}
    for server, log in ((plain, logs / "plain.log"), (spec, logs / "spec.log")):
        for _ in range(40):
            if "Avg generation throughput" in log.read_text(errors="replace") and "Running: 1 reqs" in log.read_text(
                    errors="replace"):
                break
            Client(server.url, 300).chat(body)
            time.sleep(0.5)
    base = parse_log(logs / "plain.log")
    assert base["engine"] == "vllm" and not base["speculative"] and base["gen_throughput_mean"] > 0
    capsys.readouterr()
    assert main(["bench", "--log", str(logs / "spec.log"), "--baseline-log", str(logs / "plain.log")]) == 0
    printed = capsys.readouterr().out
    assert "speedup" in printed and "baseline_gen_throughput_mean" in printed and "accept_length" in printed


def test_serve_sweep_serves_each_k_beside_plain(servers, conversations, tmp_path):
    """One command: k = 1 served, health-waited, measured against the running plain server,
    stopped; the row has the server's accept length, the ratio and tune's prediction."""
    plain, _, _ = servers
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    rc = main(["serve-sweep", "--target", NAME, "--drafter", str(SHIPPED), "--ks", "1", "--plain-url",
               plain.url + "/v1", "--prompt-file", str(conversations), "--num-prompts", "2", "--max-new-tokens", "16",
               "--rounds", "2", "--log-dir", str(tmp_path / "logs"), "--json", str(out), "--png", str(png)])
    assert rc == 0
    r = json.loads(out.read_text())
    (row,) = r["rows"]
    assert (row["k"], row["server_k"], row["errors"]) == (1, 1, 0) and 1.0 <= row["accept_length"] <= 2.0
    assert row["speedup"] == pytest.approx(row["tok_s"] / row["plain_tok_s"])
    assert row["predicted_tok_s"] > 0 and r["calibration"]["gpu"] == "cpu"
    assert '"num_speculative_tokens": 1' in r["lines"]["1"] and set(r["server_start_s"]) == {"1"}
    assert (tmp_path / "logs" / "k1.log").stat().st_size > 0  # the k = 1 server's own log
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
