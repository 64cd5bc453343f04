"""Where a training step's time goes: one `fledge train` step (online target features, the
unrolled TTT forward and backward, the optimizer) on a SmolLM2-135M-shaped target with random
weights and random tokens, so no download is needed (kernel times depend on shapes, not values).

    python bench/profile_train.py [--compare] [--batch 64 --seq 512 --ttt-steps 7] [--out JSON]

The step's wall time split into features / TTT forward+backward / optimizer (medians), target
tok/s, and on CUDA its kernels by category. `--compare` first runs the reference step (draft
columns gathered from the full logits, eager soft CE) on the same model and inputs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict

import torch
import torch.nn.functional as F
import transformers
from machine import machine_name, result_path
from torch.profiler import ProfilerActivity
from torch.profiler import profile as torch_profile

from fledge.core.config import DraftConfig
from fledge.core.files import atomic_write_json
from fledge.drafter.eagle3 import Eagle3Draft
from fledge.train.features import (
    TargetHead,
    aux_layer_ids_for,
    feature_model,
    online_features,
)
from fledge.train.ttt import TTT

# SmolLM2-135M-Instruct's architecture (its config.json): what the timings depend on.
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                    rms_norm_eps=1e-5, tie_word_embeddings=True, hidden_act="silu")

# Kernel name fragments, tried in this order (memory-efficient attention kernels are named
# fmha_cutlass*, so attention is tried before matmul).
CATEGORIES = (("attention", ("fmha", "attention", "flash", "attn")),
              ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "matmul")),
              ("softmax", ("softmax",)))


def category(kernel: str) -> str:
    name = kernel.lower()
    return next((cat for cat, keys in CATEGORIES if any(k in name for k in keys)), "other")


def smollm2_random(dtype, device) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMOLLM2_135M)).to(dtype).eval()


def kernels_ms(step, iters: int) -> dict[str, float]:
    """GPU milliseconds per step of each kernel name, from torch.profiler."""
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    acc = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            acc[e.name] += e.time_range.elapsed_us() / 1e3 / iters
    return dict(acc)


def gathered_view(head: TargetHead, hidden):
    """TargetHead.view the reference way: the draft columns gathered out of the full logits."""
    logits = F.linear(hidden.to(head.weight.dtype), head.weight, head.bias)
    return logits[..., head.draft_ids].float().softmax(-1), head.to_draft[logits.argmax(-1)]


def profile(model, batch: int, seq: int, ttt_steps: int, draft_vocab: int, steps: int = 8, warmup: int = 3,
            before: bool = False) -> dict:
    """Time `steps` training steps after `warmup`, then profile two (kernels on CUDA only).
    `before`: the reference step (gathered head columns, eager loss)."""
    dev = next(model.parameters()).device
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cfg = model.config.get_text_config()
    g = torch.Generator().manual_seed(0)
    draft_ids = torch.randperm(cfg.vocab_size, generator=g)[:draft_vocab].sort().values
    draft = Eagle3Draft.from_target(DraftConfig.from_target(cfg, draft_vocab_size=draft_vocab), model, draft_ids)
    ttt = TTT(draft, ttt_steps, 0.8, compiled_loss=False if before else None).to(dev)
    opt = torch.optim.AdamW([p for p in ttt.parameters() if p.requires_grad], lr=1e-4, betas=(0.9, 0.95))
    target, aux_ids = feature_model(model), aux_layer_ids_for(model)
    head = TargetHead.from_model(model, draft.target_ids().cpu(), dev)
    view = (lambda h: gathered_view(head, h)) if before else head.view  # noqa: E731
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(dev)
    attn = torch.ones_like(ids)
    mask = attn.clone()
    mask[:, :seq // 4] = 0  # a prompt: no loss there, as in the data
    norm = torch.full((ttt_steps,), float(batch * seq), device=dev)
    losses = []

    def step() -> tuple[float, float, float]:
        """One training step; the ms of its features, TTT forward+backward and optimizer."""
        t0 = time.perf_counter()
        aux, hidden = online_features(target, aux_ids, ids, attn)
        probs, tops = view(hidden)
        sync()
        t1 = time.perf_counter()
        with torch.autocast("cuda", torch.bfloat16, enabled=cuda):
            loss, _ = ttt(ids, aux, probs, tops, mask, norm)
        losses.append(loss.item())
        loss.backward()
        sync()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3, (time.perf_counter() - t2) * 1e3

    for _ in range(warmup):
        step()
    times = [step() for _ in range(steps)]
    feats, fwd_bwd, optim = (statistics.median(x) for x in zip(*times))
    total = statistics.median(sum(t) for t in times)
    out = {"variant": "reference (gathered head, eager loss)" if before else
           f"now (draft-vocab head rows, {'compiled' if cuda else 'eager'} loss)",
           "first_loss": losses[0], "batch": batch, "seq": seq, "ttt_steps": ttt_steps, "draft_vocab": draft_vocab,
           "steps": steps, "step_ms": total, "features_ms": feats, "ttt_fwd_bwd_ms": fwd_bwd, "optimizer_ms": optim,
           "target_tok_s": batch * seq / total * 1e3}
    if cuda:
        for _ in range(3):
            step()
        per = kernels_ms(step, iters=2)
        cats = defaultdict(float)
        for name, ms in per.items():
            cats[category(name)] += ms
        out["kernel_ms"] = sum(per.values())
        out["kernel_ms_by_category"] = dict(sorted(cats.items(), key=lambda kv: -kv[1]))
        out["top_kernels"] = [[name[:100], ms] for name, ms in sorted(per.items(), key=lambda kv: -kv[1])[:12]]
    return out


def print_report(r: dict) -> None:
    print(f"{r['variant']}: train step, batch {r['batch']} x {r['seq']} tokens, TTT {r['ttt_steps']} steps, draft vocab "
          f"{r['draft_vocab']}: {r['step_ms']:.1f} ms ({r['target_tok_s']:,.0f} target tok/s), first loss {r['first_loss']:.5f}")
    print(f"  features {r['features_ms']:.1f} ms | TTT forward+backward {r['ttt_fwd_bwd_ms']:.1f} ms | "
          f"optimizer {r['optimizer_ms']:.1f} ms")
    if "kernel_ms" in r:
        print(f"  kernels {r['kernel_ms']:.1f} ms a step: " + ", ".join(
            f"{k} {v:.1f} ({v / r['kernel_ms']:.0%})" for k, v in r["kernel_ms_by_category"].items()))
        for name, ms in r["top_kernels"]:
            print(f"    {ms:8.2f} ms  {name}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=512, help="tokens a sequence (the shipped drafter's data: 524 on average)")
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--draft-vocab", type=int, default=16384)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compare", action="store_true", help="also the reference step first, same model and inputs")
    p.add_argument("--out")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    model = smollm2_random(torch.bfloat16 if dev.type == "cuda" else torch.float32, dev)
    variants = [profile(model, args.batch, args.seq, args.ttt_steps, args.draft_vocab, args.steps, before=True)] \
        if args.compare else []
    variants.append(profile(model, args.batch, args.seq, args.ttt_steps, args.draft_vocab, args.steps))
    for r in variants:
        print_report(r)
    out = args.out or result_path("profile_train", machine_name(dev))
    atomic_write_json(out, {"variants": variants})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
