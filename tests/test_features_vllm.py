"""Features captured from a real vLLM server (CPU build, fp32) equal HF's, and train the same
drafter: 16 samples of the shared SmolLM2 ShareGPT answer sets (tests/fixtures/sharegpt16.tok.jsonl,
`fledge tokenize` of 16 short greedy answers of regen_s0). The README's "features from your vLLM
server" block runs here as written at test sizes: its first line prints the launch line the
module's one capture server is started from (its start takes minutes on two cores), the others
capture, train from the shards and streamed, and check the drafter against its features."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import sys
import time
from pathlib import Path

import forked
import pytest
import torch
import transformers

from fledge.cli import main as cli_main
from fledge.core.errors import FledgeError
from fledge.core.target import load_target
from fledge.data.vocab import save_vocab
from fledge.train.capture_run import TargetShape, make_capture
from fledge.train.features import (
    FeatureOptions,
    FeatureStore,
    features_meta,
    load_samples,
    write_features,
)

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "fixtures" / "sharegpt16.tok.jsonl"
TARGET, AUX, MAX_LEN = "smollm2-135m", (2, 15, 27), 256
TRAIN = "--max-steps 3 --batch-size 2 --ttt-steps 2 --log-every 1 --eval-every 1000 --save-every 1000 --eval-samples 2 --warmup 0"
# (README text, test text, occurrences in the block): each must match, so a README edit that
# drops one fails here instead of running at full size.
OVERRIDES = [
    ("/tmp/fledge-states", "{tmp}/states", 1),
    ("--max-len 512", f"--max-len {MAX_LEN}", 4),
    ("data/mt/tok/train.tok.jsonl", str(DATA), 3),
    ("data/mt/", "{tmp}/data/mt/", 5),
    ("runs/", "{tmp}/runs/", 3),
    ("--server http://localhost:8000", "--server {url} --dtype fp32 --shard-size 8", 1),
    ("--features http://localhost:8000", "--features {url}", 1),
    ("--max-steps 40 --batch-size 4", TRAIN, 2),
]
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def readme_block() -> list[str]:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- vllm-features[^>]*-->\s*```sh\n(.*?)```\s*<!-- /vllm-features -->", text, re.DOTALL)
    assert m, "README.md: no vllm-features block"
    script = m.group(1)
    for old, new, n in OVERRIDES:
        assert script.count(old) == n, f"README vllm-features block: expected {n}x {old!r}"
        script = script.replace(old, new)
    lines = [line for line in script.splitlines() if line.strip()]
    assert [shlex.split(x)[1] for x in lines] == ["features", "features", "train", "train", "doctor"]
    return lines


def run_line(line: str, **fill) -> int:
    return cli_main(shlex.split(line.format(**fill))[1:])


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("readme_vllm")


@pytest.fixture(scope="module")
def server(vllm_venv, workdir):
    """Started from the launch line the README's first command prints."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from vllm_serve import start
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert run_line(readme_block()[0], tmp=workdir, url="") == 0
    words = shlex.split(printed.getvalue())
    assert words[0] == f"PYTHONPATH={ROOT}" and words[1:3] == ["vllm", "serve"]
    args = words[3:]
    assert args[1:4] == ["--served-model-name", TARGET, "--max-model-len"] and int(args[4]) == MAX_LEN + 1
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(ROOT)  # vLLM imports fledge's connector from this checkout
    try:
        srv = start(Path(args[0]), TARGET, max_model_len=int(args[4]), log=workdir / "vllm.log", timeout=900,
                    extra=tuple(args[5:]))
    finally:
        os.environ.pop("PYTHONPATH") if old is None else os.environ.__setitem__("PYTHONPATH", old)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def readme_runs(server, workdir):
    """The README block's capture, two trainings and doctor, in order; the work directory."""
    (workdir / "data" / "mt").mkdir(parents=True)
    save_vocab(workdir / "data" / "mt" / "vocab.safetensors", torch.arange(2048), 49152, {})
    for line in readme_block()[1:]:
        rc = run_line(line, tmp=workdir, url=server.url)
        assert rc in ((0, 1) if "doctor" in line else (0,)), f"{line}: exit {rc}"  # doctor 1: WARNs of a 3-step drafter
    return workdir


@pytest.fixture(scope="module")
def captured(readme_runs):
    return readme_runs / "data" / "mt" / "feats"


@pytest.fixture(scope="module")
def target():
    return load_target(TARGET)


def curve(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["objective"]) for r in rows if r["kind"] == "train"]


def test_vllm_features_equal_hf_hidden_states(captured):
    """Each aux id against HF's hidden_states[L], the final-norm state against hidden_states[-1]."""
    meta = json.loads((captured / "meta.json").read_text())
    assert meta["engine"]["name"] == "vllm" and meta["engine"]["layer_ids"] == [2, 15, 27, 30]
    assert meta["aux_layer_ids"] == list(AUX) and meta["hidden"] == "post-norm"
    samples = load_samples(DATA, MAX_LEN, 49152)
    assert len(samples) == 16
    store = FeatureStore(captured, {"num_samples": 16}, 576, [len(s.input_ids) for s in samples])
    hf = transformers.AutoModelForCausalLM.from_pretrained(TargetShape.read(TARGET).path, dtype=torch.float32).eval()
    worst = {}
    with torch.no_grad():
        for s in samples:
            hs = hf(s.input_ids[None], output_hidden_states=True).hidden_states
            aux, hidden = store.get(s.index)
            pairs = [(f"aux {L}", a, hs[L][0]) for L, a in zip(AUX, aux.chunk(3, -1))] + [("final-norm", hidden, hs[-1][0])]
            for name, ours, ref in pairs:
                assert ours.shape == ref.shape
                d = (ours - ref).abs().max().item()
                worst[name] = max(worst.get(name, 0.0), d)
                assert d <= 1e-6 * ref.abs().max().item() + 1e-3, (name, s.id, d)
    print(f"\nmax |vLLM - HF| over 16 samples: {worst}")


def test_training_from_vllm_features_matches_hf(readme_runs, target, tmp_path):
    """The README's drafters, trained from vLLM's shards and streamed from vLLM, against the same
    steps from in-process features."""
    samples = load_samples(DATA, MAX_LEN, 49152)
    local = tmp_path / "feats_local"
    write_features(target.model, AUX, samples, local, features_meta(TARGET, DATA, MAX_LEN), FeatureOptions("fp32", 8))
    files_line = readme_block()[2]
    assert run_line(files_line.replace("{tmp}/data/mt/feats", str(local)).replace("{tmp}/runs/mt-vllm", str(tmp_path / "local")),
                    tmp=readme_runs) == 0
    curves = {"local": curve(tmp_path / "local"), "vllm files": curve(readme_runs / "runs" / "mt-vllm"),
              "vllm streamed": curve(readme_runs / "runs" / "mt-stream")}
    assert [s for s, _ in curves["local"]] == [1, 2, 3]
    gaps = {k: max(abs(a[1] - b[1]) for a, b in zip(v, curves["local"])) for k, v in curves.items()}
    print(f"\nloss curves {curves}; max |Δloss| against in-process {gaps}")
    assert all([s for s, _ in v] == [1, 2, 3] for v in curves.values())
    assert gaps["vllm files"] < 1e-4 and gaps["vllm streamed"] < 1e-4
    assert max(abs(a[1] - b[1]) for a, b in zip(curves["vllm files"], curves["vllm streamed"])) < 1e-5


def test_killed_streamed_training_resumes_to_the_same_curve(readme_runs, server, tmp_path):
    """kill -9 during `fledge train --features URL` once a checkpoint is saved; the same command
    resumes it to the curve of the README's uninterrupted streamed run, each step once."""
    line = readme_block()[3].replace("{tmp}/runs/mt-stream", str(tmp_path / "cut")).replace("--save-every 1000", "--save-every 1")
    argv = shlex.split(line.format(tmp=readme_runs, url=server.url))[1:]
    proc = forked.fledge(argv)
    meta = tmp_path / "cut" / "checkpoint" / "meta.json"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.is_alive() and not meta.exists():
        time.sleep(0.05)
    assert proc.is_alive(), "the run finished (or failed) before it could be killed"
    proc.kill()
    proc.join()
    saved = json.loads(meta.read_text())["step"]
    assert 1 <= saved < 3
    assert cli_main(argv) == 0
    ours, ref = curve(tmp_path / "cut"), curve(readme_runs / "runs" / "mt-stream")
    assert [s for s, _ in ours] == [1, 2, 3]
    gap = max(abs(a[1] - b[1]) for a, b in zip(ours, ref))
    print(f"\nkilled after step {saved}, resumed: max |Δloss| against the uninterrupted run {gap}")
    assert gap < 1e-5


def test_capture_refuses_what_the_server_does_not_hold(server, captured):
    shape = TargetShape.read(TARGET)
    ids = load_samples(DATA, MAX_LEN, 49152)[0].input_ids.tolist()
    # aux ids the server does not capture
    with pytest.raises(FledgeError, match=r"captures layers \[2, 15, 27, 30\], these features need \[3, 15, 27, 30\]"):
        make_capture("vllm", server.url, TARGET, shape, (3, 15, 27), retries=0).one(ids)
    # a server for another model: by name, and by the width of what it returns
    with pytest.raises(FledgeError, match="not 'other-model': a server for another model"):
        make_capture("vllm", server.url, "other-model", shape, AUX, retries=0).engine()
    narrow = TargetShape(shape.path, shape.num_layers, 64, shape.vocab_size)
    with pytest.raises(FledgeError, match=r"states of shape \[\d+, 4, 576\], expected \[T, 4, 64\]"):
        make_capture("vllm", server.url, TARGET, narrow, AUX, retries=0).one(ids)
    # states shorter than the sample (what prefix caching or chunked prefill leave): the file
    # of a real request read against a longer sample
    cap = make_capture("vllm", server.url, TARGET, shape, AUX, retries=0)
    with pytest.raises(FledgeError, match="states for .* tokens, the sample has .*--no-enable-prefix-caching"):
        cap.read_states(cap.request(ids), ids + [ids[-1]])


def test_killed_capture_resumes_without_loss_or_duplicates(server, captured, tmp_path):
    """kill -9 during `fledge features --server`; the rerun finishes the rest, and every sample's
    features are those of the uninterrupted capture."""
    out = tmp_path / "killed"
    line = readme_block()[1].replace("{tmp}/data/mt/feats", str(out)).replace("--shard-size 8", "--shard-size 2")
    argv = shlex.split(line.format(url=server.url))[1:]
    proc = forked.fledge(argv)
    manifest = out / "manifest.json"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.is_alive():
        if manifest.exists() and len(json.loads(manifest.read_text())["shards"]) >= 2:
            break
        time.sleep(0.1)
    assert proc.is_alive(), "the capture finished before it could be killed"
    proc.kill()
    proc.join()
    assert 2 <= len(json.loads(manifest.read_text())["shards"]) < 8
    assert cli_main(argv) == 0
    assert len(json.loads(manifest.read_text())["shards"]) == 8
    assert sorted(p.name for p in out.iterdir()) == sorted(["meta.json", "manifest.json"] +
                                                           [f"shard_{i:05d}.safetensors" for i in range(8)])
    a, b = FeatureStore(out, {}, 576), FeatureStore(captured, {}, 576)
    for i in range(16):
        for x, y in zip(a.get(i), b.get(i)):
            assert x.shape == y.shape
            torch.testing.assert_close(x, y, atol=1e-3, rtol=1e-5)
