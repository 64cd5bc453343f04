"""Feature shards and capture clients without a serving engine: the manifest refuses torn,
missing and mismatching shards before training; bad `fledge features` input is one line; a
killed run resumes to the same bytes; the SGLang client reads replies in SGLang's format."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import forked
import pytest
import torch
from test_train import write_data

from fledge.cli import main as cli_main
from fledge.core.conventions import aux_ids_to_sglang
from fledge.core.errors import FledgeError
from fledge.train.capture import FinalNorm, VllmCapture, norm_weight
from fledge.train.capture_sglang import SglangCapture


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    from test_target import save_tiny_dir
    path = tmp_path_factory.mktemp("tiny_target")
    save_tiny_dir(path)
    return path


def features(tmp_path, target_dir, *extra, data=None, out="feats"):
    return cli_main(["features", "--target", str(target_dir), "--data", data or str(tmp_path / "data.jsonl"),
                     "--out", str(tmp_path / out), "--dtype", "fp32", "--shard-size", "4", "--device", "cpu", *extra])


def one_error(capsys) -> str:
    text = capsys.readouterr().err
    err = [line for line in text.splitlines() if line.startswith("fledge")]
    assert len(err) == 1 and err[0].startswith("fledge: error:"), text[-2000:]
    return err[0]


def train_fails(capsys, tmp_path, target_dir, feats, match):
    args = ["train", "--data", str(tmp_path / "data.jsonl"), "--out", str(tmp_path / "run"), "--target",
            str(target_dir), "--features", str(feats), "--max-steps", "1", "--batch-size", "2", "--ttt-steps", "1"]
    assert cli_main(args) == 2
    assert match in one_error(capsys)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before the first step


def test_manifest_refuses_broken_shards(tmp_path, target_dir, capsys):
    write_data(tmp_path / "data.jsonl", n=12)
    assert features(tmp_path, target_dir) == 0
    feats = tmp_path / "feats"
    manifest = json.loads((feats / "manifest.json").read_text())["shards"]
    assert sorted(manifest) == [f"shard_{i:05d}.safetensors" for i in range(3)]
    assert all(e["bytes"] == (feats / n).stat().st_size and e["samples"] == 4 for n, e in manifest.items())
    capsys.readouterr()
    shard = feats / "shard_00001.safetensors"
    whole = shard.read_bytes()

    shard.write_bytes(whole[:len(whole) // 2])  # torn
    train_fails(capsys, tmp_path, target_dir, feats, "shard_00001.safetensors: torn or changed")
    shard.write_bytes(whole[:-1] + bytes([whole[-1] ^ 1]))  # same size, other bytes
    train_fails(capsys, tmp_path, target_dir, feats, "torn or changed")
    shard.unlink()  # missing
    train_fails(capsys, tmp_path, target_dir, feats, "listed in manifest.json but missing")

    # a rerun writes exactly the shard that is gone, to the same bytes, and leaves the others
    before = {n: (feats / n).stat().st_mtime_ns for n in manifest if n != shard.name}
    assert features(tmp_path, target_dir) == 0
    assert shard.read_bytes() == whole
    assert {n: (feats / n).stat().st_mtime_ns for n in before} == before

    # shards of other samples (same count, other lengths): the data changed under the same meta
    write_data(tmp_path / "other.jsonl", n=12, seed=5)
    assert features(tmp_path, target_dir, data=str(tmp_path / "other.jsonl"), out="other") == 0
    meta = json.loads((feats / "meta.json").read_text())
    (tmp_path / "other" / "meta.json").write_text(json.dumps(meta))
    capsys.readouterr()
    train_fails(capsys, tmp_path, target_dir, tmp_path / "other", "disagree with the data's")

    (feats / "manifest.json").unlink()
    train_fails(capsys, tmp_path, target_dir, feats, "no manifest.json")


@pytest.mark.parametrize("case", ["meta_not_json", "meta_list", "shard_size_0", "batch_size_0", "string_ids"])
def test_bad_features_input_is_one_line(tmp_path, target_dir, capsys, case):
    data = write_data(tmp_path / "data.jsonl", n=6)
    extra, match = (), ""
    if case in ("meta_not_json", "meta_list"):
        (tmp_path / "feats").mkdir()
        (tmp_path / "feats" / "meta.json").write_text("{not json" if case == "meta_not_json" else "[1, 2]")
        match = "meta.json is not JSON" if case == "meta_not_json" else "must be a JSON object, not a list"
    elif case == "shard_size_0":
        extra, match = ("--shard-size", "0"), "--shard-size: 0"
    elif case == "batch_size_0":
        extra, match = ("--batch-size", "0"), "--batch-size: 0"
    else:
        lines = Path(data).read_text().splitlines()
        rec = json.loads(lines[2])
        rec["input_ids"] = [str(t) for t in rec["input_ids"]]
        lines[2] = json.dumps(rec)
        Path(data).write_text("\n".join(lines) + "\n")
        match = "data.jsonl:3: 'input_ids' and 'loss_mask' must hold integers"
    assert features(tmp_path, target_dir, *extra) == 2
    assert match in one_error(capsys)


def test_killed_features_run_resumes_to_the_same_shards(tmp_path, target_dir):
    """kill -9 of a `fledge features` process (forked, see tests/forked.py) while shards are being
    written; the rerun's directory equals an uninterrupted one."""
    write_data(tmp_path / "data.jsonl", n=40, lo=60, hi=120)
    assert features(tmp_path, target_dir, "--shard-size", "2", "--batch-size", "1", out="whole") == 0
    proc = forked.fledge(["features", "--target", target_dir, "--data", tmp_path / "data.jsonl", "--out",
                          tmp_path / "killed", "--dtype", "fp32", "--shard-size", "2", "--batch-size", "1", "--device",
                          "cpu"])
    manifest = tmp_path / "killed" / "manifest.json"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.is_alive():
        if manifest.exists() and len(json.loads(manifest.read_text())["shards"]) >= 3:
            break
        time.sleep(0.05)
    assert proc.is_alive(), "the run finished before it could be killed"
    proc.kill()
    proc.join()
    done = len(json.loads(manifest.read_text())["shards"])
    assert 3 <= done < 20
    assert features(tmp_path, target_dir, "--shard-size", "2", "--batch-size", "1", out="killed") == 0
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert json.loads((killed / "manifest.json").read_text()) == json.loads((whole / "manifest.json").read_text())
    assert sorted(p.name for p in killed.iterdir()) == sorted(p.name for p in whole.iterdir())  # no stray files


def test_final_norm_read_from_the_checkpoint_alone(target_dir):
    """The norm fledge applies to vLLM's pre-norm state is the target's own (HF's module)."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    norm = FinalNorm.from_target_dir(target_dir)
    assert torch.equal(norm_weight(target_dir), model.model.norm.weight.detach())
    x = torch.randn(5, model.config.hidden_size) * 30
    torch.testing.assert_close(norm(x), model.model.norm(x), atol=1e-6, rtol=1e-6)


def test_unreachable_server_is_one_line(target_dir):
    norm = FinalNorm.from_target_dir(target_dir)
    cap = VllmCapture("http://127.0.0.1:9", "tiny", (2, 4, 5), 8, 64, norm, timeout=5, retries=0)
    with pytest.raises(FledgeError, match=r"cannot reach the capture server \(server not answering"):
        cap.engine()


# --------------------------------------------------------------------------- SGLang, recorded format
class Recorded(BaseHTTPRequestHandler):
    """Answers /get_model_info and /generate as SGLang does, from `replies` (path → function of the body)."""
    replies: dict = {}

    def _send(self, obj):
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send(self.replies[self.path](None))

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self._send(self.replies[self.path](body))

    def log_message(self, *args):
        pass


@pytest.fixture
def sglang():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorded)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


def test_sglang_capture_reads_its_format(sglang, target_dir):
    """Rows [aux_1, aux_2, aux_3, final] per prompt token in meta_info.hidden_states[0] (then a
    row per generated token, ignored); aux ids recorded in SGLang's spelling (canonical - 1);
    a stock reply (final state only), a short one, and another model are refused."""
    h, ids = 64, list(range(3, 14))
    table = torch.randn(len(ids), 4 * h)
    width = {"w": 4 * h, "rows": len(ids)}
    Recorded.replies = {
        "/get_model_info": lambda b: {"model_path": str(target_dir), "is_generation": True},
        "/generate": lambda b: {"text": "x", "meta_info": {
            "prompt_tokens": len(b["input_ids"]), "completion_tokens": 1,
            "hidden_states": [table[:width["rows"], :width["w"]].tolist(), torch.randn(width["w"]).tolist()]}}}
    url = f"http://127.0.0.1:{sglang.server_port}"
    norm = FinalNorm.from_target_dir(target_dir)
    cap = SglangCapture(url, target_dir.name, (2, 4, 5), 8, h, norm, retries=0)
    engine = cap.engine()
    assert engine["name"] == "sglang" and engine["layer_ids"] == list(aux_ids_to_sglang((2, 4, 5), 8)) == [1, 3, 4]
    [(aux, hidden)] = cap.many([ids])
    assert torch.equal(aux, table[:, :3 * h]) and torch.equal(hidden, table[:, 3 * h:])
    width["w"] = h
    with pytest.raises(FledgeError, match="returns only the final state"):
        cap.one(ids)
    width.update(w=4 * h, rows=len(ids) - 2)
    with pytest.raises(FledgeError, match="states for 9 tokens, the sample has 11: disable the radix cache"):
        cap.one(ids)
    with pytest.raises(FledgeError, match="a server for another model"):
        SglangCapture(url, "other-model", (2, 4, 5), 8, h, norm, retries=0).engine()


def test_server_without_extract_hidden_states_is_one_line(sglang, tmp_path, target_dir, capsys):
    """A plain vLLM server answers the completion but names no states file (its reply's
    `kv_transfer_params` is null, as recorded from vLLM 0.32 without a KV connector)."""
    write_data(tmp_path / "data.jsonl", n=4)
    Recorded.replies = {
        "/v1/models": lambda b: {"object": "list", "data": [{"id": "tiny", "object": "model", "max_model_len": 1024}]},
        "/version": lambda b: {"version": "0.32.0"},
        "/v1/completions": lambda b: {"id": "cmpl-1", "object": "text_completion", "model": "tiny", "choices": [
            {"index": 0, "text": "\n", "finish_reason": "length", "prompt_token_ids": b["prompt"], "token_ids": [198]}],
            "kv_transfer_params": None}}
    url = f"http://127.0.0.1:{sglang.server_port}"
    assert features(tmp_path, target_dir, "--server", url, "--served-name", "tiny") == 2
    assert "names no hidden-states file; start the server with --speculative-config extract_hidden_states" in one_error(capsys)
    assert not list((tmp_path / "feats").glob("shard_*"))
    assert features(tmp_path, target_dir, "--server", url, "--served-name", "other", out="o2") == 2
    assert "serves ['tiny'], not 'other': a server for another model" in one_error(capsys)


def test_doctor_compares_a_drafter_with_its_features(tmp_path):
    """features_checks: aux layers, width, final norm and target of engine-captured features
    against an exported drafter; a mismatch in each is a FAIL naming both sides."""
    from conftest import tiny_config

    from fledge.core.config import DraftConfig
    from fledge.doctor.features_check import features_checks
    from fledge.drafter.checkpoint import export_checkpoint
    from fledge.drafter.eagle3 import Eagle3Draft
    cfg = DraftConfig.from_target(tiny_config("llama"), aux_layer_ids=(2, 4, 5))
    out = export_checkpoint(Eagle3Draft(cfg), tmp_path / "drafter", layout="eagle3")
    meta = {"target": "tiny", "aux_layer_ids": [2, 4, 5], "hidden_size": 64, "hidden": "post-norm",
            "engine": {"name": "sglang", "version": "0.5", "layer_ids": [1, 3, 4], "final_state": "post-norm"}}
    feats = tmp_path / "feats"
    feats.mkdir()

    def statuses(**change):
        (feats / "meta.json").write_text(json.dumps({**meta, **change}))
        return {c.name: c for c in features_checks(out, feats)}

    assert {n: c.status for n, c in statuses().items()} == dict.fromkeys(
        ["features.aux_layers", "features.width", "features.final_norm", "features.target"], "PASS")
    bad = statuses(aux_layer_ids=[3, 4, 5], engine={**meta["engine"], "layer_ids": [2, 3, 4]})
    assert bad["features.aux_layers"].status == "FAIL" and "hold [3, 4, 5]" in bad["features.aux_layers"].why
    bad = statuses(engine={**meta["engine"], "layer_ids": [2, 4, 5]})  # SGLang ids written unshifted
    assert bad["features.aux_layers"].status == "FAIL" and "name different layers" in bad["features.aux_layers"].why
    assert statuses(hidden_size=32)["features.width"].status == "FAIL"
    assert statuses(hidden="pre-norm")["features.final_norm"].status == "FAIL"
    # `fledge doctor --features`: the same checks, a FAIL exits 2
    statuses()
    assert cli_main(["doctor", str(out), "--features", str(feats)]) in (0, 1)
    statuses(hidden_size=32)
    assert cli_main(["doctor", str(out), "--features", str(feats)]) == 2


def test_print_launch_names_the_layers_and_the_flags(target_dir, capsys):
    """The capture server's line: aux ids then N (the pre-norm last layer), fledge's connector,
    the storage, prefix caching and chunked prefill off, room for the longest sample."""
    assert cli_main(["features", "--target", str(target_dir), "--aux-layers", "2,4,5", "--max-len", "99",
                     "--print-launch", "--storage", "/mnt/states"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("PYTHONPATH=") and f"vllm serve {target_dir}" in line
    for part in ('"eagle_aux_hidden_state_layer_ids": [2, 4, 5, 8]', '"method": "extract_hidden_states"',
                 '"kv_connector": "CPUHiddenStatesConnector"', '"kv_connector_module_path": "fledge.train.vllm_connector"',
                 '"shared_storage_path": "/mnt/states"', "--no-enable-prefix-caching", "--no-enable-chunked-prefill",
                 "--max-model-len 100"):
        assert part in line, part


def test_five_layer_features_train_a_dflash_drafter_reading_them(tmp_path, target_dir, capsys):
    """A DFlash drafter may read more target layers than EAGLE-3's three: `fledge features
    --aux-layers` stores them (5 x H wide), training reads them, and a run whose drafter
    reads other layers is refused before its first step."""
    from fledge.train.features import FeatureStore
    write_data(tmp_path / "data.jsonl", n=8)
    assert features(tmp_path, target_dir, "--aux-layers", "1,2,4,6,7") == 0
    store = FeatureStore(tmp_path / "feats", {}, 64)
    assert store.meta["aux_layer_ids"] == [1, 2, 4, 6, 7] and store.get(0)[0].shape[-1] == 5 * 64
    base = ["train", "--data", str(tmp_path / "data.jsonl"), "--target", str(target_dir), "--features",
            str(tmp_path / "feats"), "--method", "dflash", "--max-steps", "2", "--batch-size", "2", "--ttt-steps", "2",
            "--blocks-per-sample", "4", "--mask-token-id", "300", "--eval-samples", "2"]
    assert cli_main([*base, "--out", str(tmp_path / "run"), "--aux-layers", "1,2,4,6,7"]) == 0
    cfg = json.loads((tmp_path / "run" / "draft" / "config.json").read_text())
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 1, 3, 5, 6]  # DFlash counts layer outputs
    capsys.readouterr()
    train_fails_args = [*base, "--out", str(tmp_path / "other")]  # the default three layers
    assert cli_main(train_fails_args) == 2
    assert "aux layers" in one_error(capsys)
    assert not (tmp_path / "other" / "metrics.jsonl").exists()
