"""Does fledge's engine measure the acceptance that vLLM serves? Same drafter, same prompts.

    python bench/bench_vllm_accept.py --drafter DIR [--num-prompts 8] [--max-tokens 64] [--k 3]

Both sides: the target in fp32 on this CPU, greedy, a chain of k drafts, the MT-Bench first
turns rendered in the target's chat template, generation continued past EOS (vLLM's
`ignore_eos`) so both decode exactly max-tokens. Accept length is SGLang's (accepted + 1 per
verify step; vLLM's "mean acceptance length" is the same quantity). Prints a table and
writes bench/results/vllm_accept_cpu.json; the goal is agreement within ±10%.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from machine import result_path

from fledge.core.conventions import accept_length
from fledge.core.files import atomic_write_json
from fledge.core.shape import Shape
from fledge.core.target import load_target
from fledge.core.vllm_cpu import venv_env, venv_python
from fledge.engine.drafters import load_drafter
from fledge.engine.hf import build_engine_target
from fledge.engine.sampling import SamplingParams
from fledge.engine.spec import generate_spec
from fledge.engine.stats import SpecStats
from fledge.perf.bench import first_user_turns

RUNNER = Path(__file__).resolve().parents[1] / "scripts" / "vllm_run.py"


def prompts_text(tokenizer, source: str, n: int) -> list[str]:
    return [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
            for m in first_user_turns(source, n)]


def run_vllm(target_dir: Path, drafter: str, prompts: list[str], k: int, max_tokens: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "p.json").write_text(json.dumps(prompts))
        cmd = [str(venv_python()), str(RUNNER), "--target", str(target_dir), "--drafter", drafter,
               "--prompts", f"{tmp}/p.json", "--out", f"{tmp}/r.json", "--num-spec-tokens", str(k),
               "--max-tokens", str(max_tokens), "--max-model-len", "2048"]
        res = subprocess.run(cmd, env=venv_env(), capture_output=True, text=True, timeout=1800)
        if res.returncode:
            sys.exit(f"vLLM failed:\n{res.stderr[-3000:]}")
        return json.loads((Path(tmp) / "r.json").read_text())


def run_fledge(target, drafter: str, prompts: list[str], k: int, max_tokens: int):
    engine = build_engine_target(target.model, torch.float32, "cpu")
    d = load_drafter(drafter, Shape(k, 1, k + 1), target.model, engine, "cpu", torch.float32)
    params = SamplingParams(max_new_tokens=max_tokens)
    # Each prompt tokenized as vLLM tokenizes a string prompt; no EOS, as vLLM's ignore_eos.
    runs = [generate_spec(engine, d, target.tokenizer(text)["input_ids"], params, eos_ids=[]) for text in prompts]
    return [out for out, _ in runs], SpecStats.merge([st for _, st in runs])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drafter", required=True, help="exported EAGLE-3 drafter (eagle3 layout)")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--prompts", default="mtbench")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=3, help="draft tokens per step (vLLM num_speculative_tokens)")
    p.add_argument("--out", default=str(result_path("vllm_accept", "cpu")))
    args = p.parse_args(argv)

    target = load_target(args.target)
    prompts = prompts_text(target.tokenizer, args.prompts, args.num_prompts)
    t0 = time.perf_counter()
    v = run_vllm(target.path, args.drafter, prompts, args.k, args.max_tokens)
    t1 = time.perf_counter()
    f_out, f_stats = run_fledge(target, args.drafter, prompts, args.k, args.max_tokens)
    t2 = time.perf_counter()

    sd = v["spec_decode"]
    v_al = accept_length(sd["num_accepted_tokens"], sd["num_drafts"])
    v_pos = [a / max(sd["num_drafts"], 1) for a in sd["num_accepted_tokens_per_pos"]]
    f_al = f_stats.accept_length()
    same = sum(a == b for a, b in zip(f_out, v["outputs"]))
    report = {
        "target": args.target, "drafter": args.drafter, "prompts": len(prompts), "max_tokens": args.max_tokens,
        "k": args.k, "dtype": "float32", "device": "cpu",
        "accept_length_definition": "SGLang: (accepted draft tokens + 1 bonus) per verify step",
        "vllm": {"accept_length": v_al, "acceptance_by_position": v_pos, "drafts": sd["num_drafts"],
                 "seconds": round(t1 - t0, 1)},
        "fledge": {"accept_length": f_al, "acceptance_by_depth": f_stats.depth_acceptance(),
                   "verify_steps": f_stats.steps, "seconds": round(t2 - t1, 1)},
        "relative_difference": (f_al - v_al) / v_al,
        "identical_outputs": same,
    }
    print(f"{'engine':<8}{'accept len':>11}  by position / depth")
    print(f"{'vLLM':<8}{v_al:>11.3f}  " + " ".join(f"{x:.3f}" for x in v_pos))
    print(f"{'fledge':<8}{f_al:>11.3f}  " + " ".join(f"{x:.3f}" for x in f_stats.depth_acceptance()))
    print(f"difference {100 * report['relative_difference']:+.1f}% (goal within ±10%); "
          f"identical greedy outputs {same}/{len(prompts)}")
    atomic_write_json(args.out, report)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
