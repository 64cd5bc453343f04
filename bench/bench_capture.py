"""Features from a vLLM capture server against fledge's in-process target and HF transformers:
agreement with HF's `hidden_states[L]`, the loss curve of a drafter trained on each, and
throughput, on the same samples in one run.

    python bench/bench_capture.py [--data tests/fixtures/sharegpt16.tok.jsonl] [--max-len 256] [--steps 5] [--url URL]

Without --url it starts vLLM (CPU build, scripts/setup_vllm.sh) with the capture launch line of
`fledge features --print-launch` for the built-in target in fp32, and stops it after. Reports
max |diff| per aux id and for the final-norm state against HF transformers (`output_hidden_states`);
max |Δloss| over `--steps` drafter steps trained from vLLM's shards and streamed from the server,
against the same steps from in-process features; tokens/s of `fledge features --server`, of
`fledge features` in this process and of HF transformers' forward in this process (one sample a
forward, the baselines); and bytes/token on disk. Prints tables; writes bench/results/capture_<machine>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from machine import result_path

from fledge.core.files import atomic_write_json
from fledge.core.report import print_table
from fledge.core.target import load_target, resolve_target
from fledge.data.vocab import save_vocab
from fledge.train.capture import launch_args
from fledge.train.capture_run import TargetShape, make_capture
from fledge.train.features import (
    FeatureOptions,
    FeatureStore,
    ServerFeatures,
    features_meta,
    load_samples,
    write_features,
    write_source_features,
)
from fledge.train.loop import TrainConfig, train

ROOT = Path(__file__).resolve().parents[1]
TARGET = "smollm2-135m"
AUX = (2, 15, 27)


def start_server(storage: Path, max_len: int):
    sys.path.insert(0, str(ROOT / "scripts"))
    from vllm_serve import start
    os.environ["PYTHONPATH"] = str(ROOT)  # the server imports fledge's connector
    shape = TargetShape.read(TARGET)
    args = launch_args(shape.path, TARGET, AUX, shape.num_layers, storage, 2 * max_len)
    return start(shape.path, TARGET, max_model_len=2 * max_len, log=storage.parent / "vllm.log", extra=tuple(args[5:]))


def train_curve(tmp: Path, name: str, features: str, data: str, max_len: int, steps: int, target) -> list[float]:
    """The objective of each of `steps` drafter steps trained from `features` (a directory or a URL)."""
    out = tmp / "runs" / name
    cfg = TrainConfig(data=data, out=str(out), target=TARGET, features=features, vocab=str(tmp / "vocab.safetensors"),
                      max_len=max_len, batch_size=2, max_steps=steps, ttt_steps=2, log_every=1, eval_every=10**6,
                      save_every=10**6, eval_samples=2, warmup=0.0)
    train(cfg, target)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["objective"] for r in rows if r["kind"] == "train"]


def hf_against(store: FeatureStore, samples, path: Path) -> tuple[list[float], list[float], float]:
    """(max |diff| and max |state| per aux id and the final-norm state, HF's tokens/s)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    diff, scale, seconds = [0.0] * 4, [0.0] * 4, 0.0
    with torch.no_grad():
        for s in samples:
            t0 = time.perf_counter()
            hs = hf(s.input_ids[None], output_hidden_states=True).hidden_states
            seconds += time.perf_counter() - t0
            aux, hidden = store.get(s.index)
            refs = [hs[i][0] for i in AUX] + [hs[-1][0]]
            for j, (a, r) in enumerate(zip([*aux.chunk(3, -1), hidden], refs)):
                diff[j] = max(diff[j], (a - r).abs().max().item())
                scale[j] = max(scale[j], r.abs().max().item())
    return diff, scale, round(sum(len(s.input_ids) for s in samples) / seconds, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(ROOT / "tests" / "fixtures" / "sharegpt16.tok.jsonl"))
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5, help="drafter steps trained from each source of features")
    ap.add_argument("--url", help="a running capture server for the built-in target with aux 2,15,27")
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fledge-bench-capture-"))
    server = None if args.url else start_server(tmp / "states", args.max_len)
    url = args.url or server.url
    try:
        shape = TargetShape.read(TARGET)
        samples = load_samples(args.data, args.max_len, shape.vocab_size)
        meta = features_meta(TARGET, args.data, args.max_len)
        opts = FeatureOptions("fp32", 8)
        cap = make_capture("vllm", url, TARGET, shape, AUX, concurrency=args.concurrency)
        served = write_source_features(ServerFeatures(cap), AUX, samples, tmp / "vllm", meta, opts)
        target = load_target(TARGET)
        local = write_features(target.model, AUX, samples, tmp / "local", meta, opts)
        save_vocab(tmp / "vocab.safetensors", torch.arange(2048), shape.vocab_size, {})
        curves = {name: train_curve(tmp, name.replace(" ", "_"), feats, args.data, args.max_len, args.steps, target)
                  for name, feats in (("in-process", str(tmp / "local")), ("vllm files", str(tmp / "vllm")),
                                      ("vllm streamed", url))}
    finally:
        if server:
            server.stop()
    store = FeatureStore(tmp / "vllm", {}, shape.hidden_size)
    diff, scale, hf_rate = hf_against(store, samples, resolve_target(TARGET))
    names = [f"aux {i}" for i in AUX] + ["final-norm"]
    dloss = {k: max(abs(a - b) for a, b in zip(v, curves["in-process"])) for k, v in curves.items() if k != "in-process"}
    result = {"target": TARGET, "dtype": "fp32", "samples": len(samples), "tokens": served["tokens"],
              "vllm_version": store.meta["engine"]["version"], "concurrency": args.concurrency,
              "max_abs_diff": dict(zip(names, diff)), "max_abs_state": dict(zip(names, scale)),
              "train_steps": args.steps, "loss_curves": curves, "max_abs_dloss_vs_in_process": dloss,
              "vllm_tokens_per_s": served["tokens_per_s"], "in_process_tokens_per_s": local["tokens_per_s"],
              "hf_tokens_per_s": hf_rate, "bytes_per_token": served["bytes_per_token"],
              "when": time.strftime("%Y-%m-%d")}
    print_table([["state", "max |vLLM - HF|", "max |HF|"]] +
                [[n, f"{d:.3g}", f"{s:.4g}"] for n, d, s in zip(names, diff, scale)])
    print()
    print_table([["features", f"max |Δloss| over {args.steps} steps vs in-process"]] +
                [[k, f"{v:.3g}"] for k, v in dloss.items()])
    print()
    print_table([["capture", "tokens/s", "bytes/token"],
                 [f"vLLM server (concurrency {args.concurrency})", served["tokens_per_s"], served["bytes_per_token"]],
                 ["fledge features in process (baseline)", local["tokens_per_s"], local["bytes_per_token"]],
                 ["HF transformers forward in process (baseline)", hf_rate, "-"]])
    out = result_path("capture", "cpu")
    atomic_write_json(out, result)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
