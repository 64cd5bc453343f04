"""Derive a NEW target for the `fledge adapt` experiment: fine-tune every weight of a causal LM
on a tokenized set (fledge's training-set JSONL; loss on the loss_mask tokens), and save it as
an HF directory with the source's tokenizer and chat template (so `--target DIR` works).

    python scripts/finetune_target.py --target smollm2-135m --data domain.tok.jsonl \
        --out runs/smollm2-domain --steps 300 --batch-size 16 --lr 2e-5 --device cuda

A few minutes of work on one GPU, so not resumable: the output directory appears only when
done (rerun from scratch after a kill). It holds finetune.json: the arguments, the seconds and
the loss curve, so the derivation of NEW is documented next to its weights.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from fledge.features import load_samples, pad_batch
from fledge.target import load_target
from fledge.util import FledgeError, atomic_dir


def finetune(model, samples, steps: int, batch_size: int, lr: float, device, seed: int = 0) -> list[float]:
    """AdamW with cosine decay over shuffled batches (bf16 autocast on CUDA); returns the losses."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    model.train()
    losses, order = [], []
    for _ in tqdm(range(steps), unit="step"):
        if len(order) < batch_size:
            order += torch.randperm(len(samples), generator=g).tolist()
        batch, order = [samples[i] for i in order[:batch_size]], order[batch_size:]
        ids, mask, attn = (x.to(device) for x in pad_batch(batch, 64))
        with torch.autocast("cuda", torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
        keep = mask[:, 1:]  # logits at t predict x_{t+1}
        loss = F.cross_entropy(logits[:, :-1][keep].float(), ids[:, 1:][keep])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="source target (HF dir, GGUF, built-in name)")
    p.add_argument("--data", required=True, help="tokenized training set JSONL (input_ids, loss_mask)")
    p.add_argument("--out", required=True, help="HF directory to write (atomically)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    target = load_target(args.target, device=device)
    samples = load_samples(args.data, args.max_len, target.model.config.get_text_config().vocab_size)
    with atomic_dir(args.out, overwrite=args.overwrite) as tmp:
        t0 = time.time()
        losses = finetune(target.model, samples, args.steps, args.batch_size, args.lr, device)
        seconds = time.time() - t0
        target.model.eval().to(torch.bfloat16 if device.type == "cuda" else torch.float32).save_pretrained(tmp)
        target.tokenizer.save_pretrained(tmp)
        k = max(1, len(losses) // 10)
        summary = {"source": args.target, "data": args.data, "samples": len(samples), "steps": args.steps,
                   "batch_size": args.batch_size, "lr": args.lr, "max_len": args.max_len, "seconds": round(seconds, 1),
                   "epochs": round(args.steps * args.batch_size / len(samples), 2),
                   "loss_first_tenth": sum(losses[:k]) / k, "loss_last_tenth": sum(losses[-k:]) / k,
                   "loss_every_tenth": [sum(losses[i:i + k]) / len(losses[i:i + k]) for i in range(0, len(losses), k)]}
        (tmp / "finetune.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"loss first {k} steps {summary['loss_first_tenth']:.4f}, last {k} {summary['loss_last_tenth']:.4f}; "
          f"{seconds:.0f}s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except FledgeError as e:
        raise SystemExit(f"finetune_target: error: {e}") from None
