"""`fledge demo`: the whole loop in miniature on the built-in target, on this machine.

prompts (MT-Bench) → the target answers them (regen) → ids + loss masks → draft vocab →
EAGLE-3 training (a few steps) → export → doctor → speculative decoding vs AR on held-out
prompts. Sizes are chosen to finish in minutes on a 2-core CPU: the drafter it trains is far
too small to be useful; what the demo proves is that every step runs and hands the next one
valid files. A shipped drafter (drafters/<target>/), when present, shows the real speed-up in
the last step, twice: as shipped, and as a CPU favours it. On a GPU a draft step is nearly free
beside the target's forward; on a CPU the drafter's head (24K rows for the shipped one) is read
at every step and costs a sizeable share of a target forward, so the demo also runs it with a
head cut to its first rows and a short chain. Every output is checked against plain decoding.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from collections import Counter
from pathlib import Path

import torch

from fledge.core.errors import FledgeError
from fledge.core.files import atomic_write_json
from fledge.core.shape import Shape
from fledge.core.target import encode_chat, eos_ids, load_target
from fledge.data.prep import load_conversations
from fledge.data.regen import EngineBackend, RegenConfig, regenerate
from fledge.data.tokenize import build_training_set
from fledge.data.vocab import build_vocab, coverage, save_vocab
from fledge.doctor.checks import exit_code, report
from fledge.doctor.doctor import doctor
from fledge.drafter.checkpoint import export_checkpoint, load_checkpoint
from fledge.engine.decode import generate_ar
from fledge.engine.drafters import Eagle3Drafter
from fledge.engine.hf import build_engine_target
from fledge.engine.sampling import SamplingParams
from fledge.engine.spec import generate_spec
from fledge.train.loop import TrainConfig, train

SHIPPED = Path(__file__).resolve().parent.parent / "drafters"


def _step(rows: list, name: str, t0: float, what: str) -> float:
    now = time.perf_counter()
    rows.append([name, f"{now - t0:.1f}", what])
    print(f"[demo] {name:<9} {now - t0:6.1f} s  {what}", flush=True)
    return now


def cpu_head(draft, rows: int, target_model):
    """The drafter with its head cut to its first `rows` rows (the lowest target ids: a BPE
    vocabulary numbers its frequent pieces first). On a CPU the head's 24K rows are most of a
    draft step; verification stays exact, so a smaller head only changes what is drafted."""
    if rows < draft.cfg.draft_vocab_size:
        draft.change_vocab(draft.target_ids()[:rows].cpu(), target_model)
    return draft


def _gpu_figure() -> str:
    """The shipped drafter's (5,4,16) figure on MT-Bench from its bench file, said with where it was measured."""
    path = SHIPPED.parent / "bench" / "results" / "drafter_h200.json"
    try:
        d = json.loads(path.read_text())
        row = next(r for r in d["sets"]["mtbench"]["rows"] if r["drafter"] == "shipped" and r["shape"] == [5, 4, 16])
    except (OSError, ValueError, KeyError, StopIteration):
        return "the GPU figure: see README's current figures"
    return f"on an H200 (bf16, {path.name}, commit {d['commit']}) the same drafter gives {row['speedup']:.2f}x at (5,4,16)"


def _compare(drafters: dict, prompts, engine, eos, new_tokens: int, repeats: int) -> tuple[dict, int]:
    """Plain decoding and each drafter on the same prompts, interleaved prompt by prompt and
    repeated (a load change on a shared machine hits every config alike): per config the decode
    tok/s of each repeat, the speed-up's median and spread, accept length; and how many
    speculative outputs equal plain decoding's."""
    params = SamplingParams(max_new_tokens=new_tokens)
    runs = {name: [] for name in ("AR", *drafters)}
    accepts, round_ms, equal = {n: [] for n in drafters}, {n: [] for n in drafters}, 0
    for _ in range(repeats):
        tokens, seconds = Counter(), Counter()
        for p in prompts:
            t = time.perf_counter()
            ref = generate_ar(engine, [p], params, eos)[0][0]
            tokens["AR"], seconds["AR"] = tokens["AR"] + len(ref), seconds["AR"] + time.perf_counter() - t
            for name, d in drafters.items():
                t = time.perf_counter()
                out, stats = generate_spec(engine, d, p, params, eos)
                tokens[name], seconds[name] = tokens[name] + len(out), seconds[name] + time.perf_counter() - t
                accepts[name].append(stats.summary()["accept_length"])
                round_ms[name].append(stats.summary()["round_ms_per_step"])
                equal += out == ref
        for name in runs:
            runs[name].append(tokens[name] / seconds[name])
    out = {"AR": {"tok_s": runs["AR"], "ms_per_token": 1e3 / statistics.median(runs["AR"])}}
    for name in drafters:
        ratios = [a / b for a, b in zip(runs[name], runs["AR"])]
        out[name] = {"tok_s": runs[name], "speedups": ratios, "speedup": statistics.median(ratios),
                     "accept_length": statistics.mean(accepts[name]), "round_ms": statistics.median(round_ms[name])}
    return out, equal


def _speed_step(args, target, held, work) -> tuple[dict, bool]:
    """The last step: the shipped drafter (or the miniature one) against plain decoding on
    held-out prompts, as shipped and as the CPU favours (a head of `--cpu-head-rows` rows and a
    chain of `--cpu-steps`), with every output checked against plain decoding."""
    speed, same = _speed_step(args, target, held, work)
    _step(rows, "compare", t0, "AR vs EAGLE-3 (accept length = SGLang's, incl. the bonus token)")
    atomic_write_json(work / "demo.json", {"steps": rows, **speed, "doctor_exit": code,
                                           "wall_s": round(sum(float(r[1]) for r in rows), 1)})
    print(f"\nwrote {work / 'demo.json'}; the whole demo took {sum(float(r[1]) for r in rows):.0f} s")
    return 0 if same and code < 2 else 1
