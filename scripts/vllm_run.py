"""Greedy generation in real vLLM (CPU), with or without a drafter (EAGLE-3, P-EAGLE or DFlash); writes one JSON.

Runs INSIDE the venv built by scripts/setup_vllm.sh, started with the LD_PRELOAD from its
vllm.env; it does not import fledge (that venv has vLLM's own torch, not fledge's).

    $VENV/bin/python scripts/vllm_run.py --target DIR [--drafter DIR] --prompts P.json --out R.json
    $VENV/bin/python scripts/vllm_run.py --jobs     # one JSON list of those arguments a line on stdin

P.json is a JSON list of prompt strings. R.json holds the generated token ids per prompt,
vLLM's spec-decode counters, the aux layer ids vLLM logged it captures, and timings.

`--jobs` runs one engine after another in this process, so vLLM is imported once (~17 s on a
2-core CPU) for all of them; after each job it prints "ok" or "failed" alone on a line of
stdout (vLLM's own output goes to stderr).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import logging.handlers
import os
import re
import sys
import time
import traceback
from pathlib import Path

# The engine core must run in this process, so its log records (the aux-layer line) reach
# our handler; and vLLM must not configure logging, because its dictConfig, re-applied when
# the engine starts, would drop any handler we add to its logger.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["VLLM_CONFIGURE_LOGGING"] = "0"

AUX_LOG = re.compile(r"Using auxiliary layers from speculative config: \(([\d, ]*)\)")


def spec_counters(metrics) -> dict:
    """vLLM's spec-decode counters by short name (the Vector is per draft position)."""
    from vllm.v1.metrics.reader import Vector

    return {m.name.removeprefix("vllm:spec_decode_"): m.values if isinstance(m, Vector) else m.value
            for m in metrics if m.name.startswith("vllm:spec_decode_")}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="target model: plain HF safetensors directory")
    ap.add_argument("--drafter", help="drafter checkpoint directory (omit for no speculation)")
    ap.add_argument("--method", default="eagle3", choices=("eagle3", "dflash"), help="the drafter's kind")
    ap.add_argument("--prompts", required=True, help="JSON list of prompt strings")
    ap.add_argument("--out", required=True, help="where to write the result JSON")
    ap.add_argument("--parallel-drafting", action="store_true",
                    help="eagle3: draft every token in one forward (a P-EAGLE drafter: ptd_token_id, mask_hidden)")
    ap.add_argument("--num-spec-tokens", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="float32", help="float32 keeps greedy ties stable across batch shapes")
    ap.add_argument("--max-model-len", type=int, default=1024)
    return ap


def run(args: argparse.Namespace) -> None:
    """One engine: start it, generate greedily, write args.out."""
    log = logging.handlers.BufferingHandler(capacity=1 << 30)  # keeps every record: never flushes
    logging.getLogger().addHandler(log)
    try:
        generate(args, log)
    finally:
        logging.getLogger().removeHandler(log)


def generate(args: argparse.Namespace, log: logging.handlers.BufferingHandler) -> None:
    from vllm import LLM, SamplingParams

    spec = None
    if args.drafter:
        spec = {"method": args.method, "model": args.drafter, "num_speculative_tokens": args.num_spec_tokens,
                **({"parallel_drafting": True} if args.parallel_drafting else {})}
    prompts = json.loads(Path(args.prompts).read_text())

    t0 = time.perf_counter()
    llm = LLM(model=args.target, speculative_config=spec, dtype=args.dtype, enforce_eager=True,
              max_model_len=args.max_model_len, disable_log_stats=False, seed=0)
    t1 = time.perf_counter()
    # ignore_eos: every prompt yields exactly max_tokens, so both runs compare the same length.
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True))
    t2 = time.perf_counter()

    aux = [m.group(1) for rec in log.buffer if (m := AUX_LOG.search(rec.getMessage()))]
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    result = {
        "target": args.target,
        "drafter": args.drafter,
        "num_spec_tokens": args.num_spec_tokens if args.drafter else 0,
        "outputs": tokens,
        "aux_layer_ids": [int(i) for i in aux[-1].split(",") if i.strip()] if aux else None,
        "spec_decode": spec_counters(llm.get_metrics()),
        "start_s": round(t1 - t0, 2),
        "generate_s": round(t2 - t1, 3),
        "tok_per_s": round(sum(map(len, tokens)) / (t2 - t1), 2),
    }
    Path(f"{args.out}.tmp").write_text(json.dumps(result, indent=2))
    os.replace(f"{args.out}.tmp", args.out)


def jobs(ap: argparse.ArgumentParser) -> None:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    for line in sys.stdin:
        try:
            run(ap.parse_args(json.loads(line)))
            status = "ok"
        except (Exception, SystemExit):  # argparse exits on bad arguments; the next job still runs
            traceback.print_exc()
            status = "failed"
        # The next engine initialises the (one-process) distributed state again.
        gc.collect()
        cleanup_dist_env_and_memory()
        print(status, flush=True)


def main():
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    ap = parser()
    if sys.argv[1:] == ["--jobs"]:
        jobs(ap)
    else:
        run(ap.parse_args())


if __name__ == "__main__":
    main()
