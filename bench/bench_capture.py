"""Features from a vLLM capture server against fledge's in-process target: agreement with HF's
`hidden_states[L]` and throughput, on the same samples in one run.

    python bench/bench_capture.py [--data tests/fixtures/sharegpt16.tok.jsonl] [--max-len 256] [--url URL]

Without --url it starts vLLM (CPU build, scripts/setup_vllm.sh) with the capture launch line of
`fledge features --print-launch` for the built-in target in fp32, and stops it after. Reports
max |diff| per aux id and for the final-norm state against HF transformers (`output_hidden_states`),
tokens/s of `fledge features --server` and of `fledge features` in this process (the baseline),
and bytes/token on disk. Prints a table; writes bench/results/capture_<machine>.json.
"""

from __future__ import annotations

import argparse
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
from fledge.train.capture import launch_args
from fledge.train.capture_run import TargetShape, make_capture
from fledge.train.features import (
    FeatureOptions,
    ServerFeatures,
    features_meta,
    load_samples,
    write_features,
    write_source_features,
)

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(ROOT / "tests" / "fixtures" / "sharegpt16.tok.jsonl"))
    ap.add_argument("--max-len", type=int, default=256)
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
    finally:
        if server:
            server.stop()
    from fledge.train.features import FeatureStore
    store = FeatureStore(tmp / "vllm", {}, shape.hidden_size)
    hf = transformers.AutoModelForCausalLM.from_pretrained(resolve_target(TARGET), dtype=torch.float32).eval()
    diff, scale = [0.0] * 4, [0.0] * 4
    with torch.no_grad():
        for s in samples:
            hs = hf(s.input_ids[None], output_hidden_states=True).hidden_states
            aux, hidden = store.get(s.index)
            refs = [hs[i][0] for i in AUX] + [hs[-1][0]]
            ours = list(aux.chunk(3, -1)) + [hidden]
            for j, (a, r) in enumerate(zip(ours, refs)):
                diff[j] = max(diff[j], (a - r).abs().max().item())
                scale[j] = max(scale[j], r.abs().max().item())
    names = [f"aux {i}" for i in AUX] + ["final-norm"]
    result = {"target": TARGET, "dtype": "fp32", "samples": len(samples), "tokens": served["tokens"],
              "vllm_version": store.meta["engine"]["version"], "concurrency": args.concurrency,
              "max_abs_diff": dict(zip(names, diff)), "max_abs_state": dict(zip(names, scale)),
              "vllm_tokens_per_s": served["tokens_per_s"], "in_process_tokens_per_s": local["tokens_per_s"],
              "bytes_per_token": served["bytes_per_token"], "when": time.strftime("%Y-%m-%d")}
    rows = [["state", "max |vLLM - HF|", "max |HF|"]] + [[n, f"{d:.3g}", f"{s:.4g}"] for n, d, s in zip(names, diff, scale)]
    print_table(rows)
    print()
    print_table([["capture", "tokens/s", "bytes/token"],
                 [f"vLLM server (concurrency {args.concurrency})", served["tokens_per_s"], served["bytes_per_token"]],
                 ["fledge in-process (baseline)", local["tokens_per_s"], local["bytes_per_token"]]])
    out = result_path("capture", "cpu")
    atomic_write_json(out, result)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
