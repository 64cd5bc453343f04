"""Features captured from a real vLLM server (CPU build, fp32) equal HF's, and train the same
drafter: 16 samples of the shared SmolLM2 ShareGPT answer sets (tests/fixtures/sharegpt16.tok.jsonl,
`fledge tokenize` of 16 short greedy answers of regen_s0). One capture server for the module:
its start takes minutes on two cores."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers

from fledge.cli import main as cli_main
from fledge.core.errors import FledgeError
from fledge.core.target import load_target
from fledge.data.vocab import save_vocab
from fledge.train.capture import launch_args
from fledge.train.capture_run import TargetShape, make_capture
from fledge.train.features import FeatureOptions, FeatureStore, features_meta, load_samples, write_features
from fledge.train.loop import TrainConfig, train

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "fixtures" / "sharegpt16.tok.jsonl"
TARGET, AUX, MAX_LEN = "smollm2-135m", (2, 15, 27), 256
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(vllm_venv, tmp_path_factory):
    sys.path.insert(0, str(ROOT / "scripts"))
    from vllm_serve import start
    tmp = tmp_path_factory.mktemp("capture_server")
    shape = TargetShape.read(TARGET)
    extra = launch_args(shape.path, TARGET, AUX, shape.num_layers, tmp / "states", 2 * MAX_LEN)[5:]
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(ROOT)  # vLLM imports fledge's connector from this checkout
    try:
        srv = start(shape.path, TARGET, max_model_len=2 * MAX_LEN, log=tmp / "vllm.log", timeout=900, extra=tuple(extra))
    finally:
        os.environ.pop("PYTHONPATH") if old is None else os.environ.__setitem__("PYTHONPATH", old)
    yield srv
    srv.stop()


def capture_args(url, out, *extra):
    return ["features", "--target", TARGET, "--data", str(DATA), "--out", str(out), "--dtype", "fp32",
            "--max-len", str(MAX_LEN), "--server", url, *extra]


@pytest.fixture(scope="module")
def captured(server, tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm_features") / "feats"
    assert cli_main(capture_args(server.url, out, "--shard-size", "8")) == 0
    return out


@pytest.fixture(scope="module")
def target():
    return load_target(TARGET)


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


def test_training_from_vllm_features_matches_hf(captured, server, target, tmp_path):
    """The same drafter steps from in-process features, vLLM's shards and vLLM streamed."""
    save_vocab(tmp_path / "vocab.safetensors", torch.arange(2048), 49152, {})
    samples = load_samples(DATA, MAX_LEN, 49152)
    local = tmp_path / "feats_local"
    write_features(target.model, AUX, samples, local, features_meta(TARGET, DATA, MAX_LEN), FeatureOptions("fp32", 8))
    curves = {}
    for name, feats in (("local", local), ("vllm files", captured), ("vllm streamed", server.url)):
        cfg = TrainConfig(data=str(DATA), out=str(tmp_path / name.replace(" ", "_")), target=TARGET, features=str(feats),
                          vocab=str(tmp_path / "vocab.safetensors"), max_len=MAX_LEN, batch_size=2, max_steps=3,
                          ttt_steps=2, log_every=1, eval_every=1000, save_every=1000, eval_samples=2, warmup=0.0)
        train(cfg, target)
        rows = [json.loads(x) for x in (tmp_path / name.replace(" ", "_") / "metrics.jsonl").read_text().splitlines()]
        curves[name] = [r["objective"] for r in rows if r["kind"] == "train"]
    assert len(curves["local"]) == 3
    gaps = {k: max(abs(a - b) for a, b in zip(v, curves["local"])) for k, v in curves.items()}
    print(f"\nloss curves {curves}; max |Δloss| against in-process {gaps}")
    assert gaps["vllm files"] < 1e-4 and gaps["vllm streamed"] < 1e-4
    assert max(abs(a - b) for a, b in zip(curves["vllm files"], curves["vllm streamed"])) < 1e-5


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
    cmd = [sys.executable, "-m", "fledge.cli", *capture_args(server.url, out, "--shard-size", "2")]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    manifest = out / "manifest.json"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if manifest.exists() and len(json.loads(manifest.read_text())["shards"]) >= 2:
            break
        time.sleep(0.1)
    assert proc.poll() is None, "the capture finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert 2 <= len(json.loads(manifest.read_text())["shards"]) < 8
    assert cli_main(capture_args(server.url, out, "--shard-size", "2")) == 0
    assert len(json.loads(manifest.read_text())["shards"]) == 8
    assert sorted(p.name for p in out.iterdir()) == sorted(["meta.json", "manifest.json"] +
                                                           [f"shard_{i:05d}.safetensors" for i in range(8)])
    a, b = FeatureStore(out, {}, 576), FeatureStore(captured, {}, 576)
    for i in range(16):
        for x, y in zip(a.get(i), b.get(i)):
            assert x.shape == y.shape
            torch.testing.assert_close(x, y, atol=1e-3, rtol=1e-5)
