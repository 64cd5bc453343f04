"""Does training's held-out figure predict the engine? For each prompt the engine writes its
greedy answer, then runs an EAGLE-3 chain on it; the same text then goes through training's
eval path (target features, TTT's hit map) and gives SpecForge's simulated accept length
(train.summarize) and the chain replayed round by round (conventions.chain_replay). Prints a
table; writes JSON.

    python bench/replay_check.py --drafter drafters/smollm2-135m --prompts FILE [--num-prompts 8]

Replay and engine walk the same rounds of the same text and may differ only by ties and by
the last round, which max_new_tokens cuts in the text but not in the engine's count.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from tqdm import tqdm

from fledge.bench import load_prompts, load_rig
from fledge.conventions import accept_length
from fledge.engine import SamplingParams, generate_ar
from fledge.engine.drafters import Eagle3Drafter, SpecConfig
from fledge.engine.spec import generate_spec
from fledge.features import TargetHead, feature_model, online_features
from fledge.train import TTT, replay_counts, summarize
from fledge.util import FledgeError, atomic_write_json
from machine import machine_name, result_path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--drafter", default="drafters/smollm2-135m")
    p.add_argument("--prompts", default="mtbench", help="conversations file or built-in set (first user turns)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=7, help="the chain's num_steps (= TTT steps evaluated)")
    p.add_argument("--device")
    p.add_argument("--dtype")
    p.add_argument("--out", help="JSON path (default bench/results/replay_check_<machine>.json)")
    a = p.parse_args(argv)
    try:
        rig = load_rig(a.target, a.drafter, a.device, a.dtype)
        prompts = load_prompts(a.prompts, a.num_prompts, rig.tokenizer)
    except FledgeError as e:
        print(f"replay_check: {e}", file=sys.stderr)
        return 2
    params = SamplingParams(temperature=0.0, max_new_tokens=a.max_new_tokens)
    spec = SpecConfig(a.steps, 1, a.steps + 1)
    head = TargetHead.from_model(rig.hf, rig.draft.target_ids(), rig.device)
    feats, ttt = feature_model(rig.hf), TTT(rig.draft, a.steps, 0.8, compiled_loss=False)
    engine_acc, stats, replay, rows, t0 = [], torch.zeros(3, a.steps), torch.zeros(2, dtype=torch.float64), [], time.time()
    for prompt in tqdm(prompts, desc="prompts"):
        answer = generate_ar(rig.target, [prompt], params, rig.eos)[0][0]
        out, st = generate_spec(rig.target, Eagle3Drafter(rig.draft, spec, rig.target), prompt, params, rig.eos)
        ids = torch.tensor([prompt + answer], device=rig.device)
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[0, len(prompt):] = True
        aux, hidden = online_features(feats, tuple(rig.draft.cfg.aux_layer_ids), ids, torch.ones_like(ids))
        probs, top = head.view(hidden)
        with torch.no_grad():
            _, s, hits = ttt(ids, aux, probs, top, mask, torch.ones(a.steps, device=rig.device), hit_map=True)
        r = replay_counts(hits.cpu(), mask.cpu())
        stats, replay = stats + s.cpu(), replay + r
        engine_acc += st.accepted
        rows.append({"prompt_tokens": len(prompt), "answer_tokens": len(answer), "same_text": out == answer,
                     "engine_accept_len": st.accept_length(), "replay_accept_len": accept_length(int(r[0]), int(r[1])),
                     "simulated_accept_len": summarize(s.cpu())["accept_len"]})
    rec = summarize(stats, replay)
    result = {"target": a.target, "drafter": a.drafter, "prompts": a.prompts, "num_prompts": len(prompts),
              "max_new_tokens": a.max_new_tokens, "chain": [a.steps, 1, a.steps + 1], "device": str(rig.device),
              "dtype": str(rig.draft.fc.weight.dtype).replace("torch.", ""),
              "engine_accept_len": accept_length(sum(engine_acc), len(engine_acc)),
              "replay_accept_len": rec["replay_accept_len"], "simulated_accept_len": rec["accept_len"],
              "engine_rounds": len(engine_acc), "engine_accepted": sum(engine_acc),
              "replay_rounds": int(replay[1]), "replay_accepted": int(replay[0]),
              "acc": rec["acc"], "same_text": sum(r["same_text"] for r in rows), "seconds": round(time.time() - t0, 1),
              "rows": rows,
              "definitions": "accept lengths with the bonus token (SGLang's). engine: generate_spec's rounds; "
                             "replay: conventions.chain_replay over TTT's hit map of the engine's AR text; "
                             "simulated: train.summarize, 1 + sum_j prod_{i<=j} acc_i"}
    a.out = a.out or result_path("replay_check", machine_name(rig.device))
    atomic_write_json(a.out, result)
    print(f"{'prompts':>8} {'engine':>8} {'replay':>8} {'simulated':>10}  (chain {a.steps}, accept length with bonus)")
    print(f"{len(prompts):>8} {result['engine_accept_len']:>8.3f} {result['replay_accept_len']:>8.3f} "
          f"{result['simulated_accept_len']:>10.3f}")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
