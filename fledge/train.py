"""`fledge train`: EAGLE-3 training-time test (TTT), single process or torchrun (DDP / FSDP2).

Alignment (x = token ids, aux_t = the target's 3 aux states after reading x_0..x_t):
  step 0, row t: the draft reads aux_t and embed(x_{t+1}) at position t and predicts x_{t+2};
          its target is the target's distribution at position t+1 (the one that produced x_{t+2}).
  step j, row t: it reads its own step j-1 output at row t and embed(x_{t+1+j}) at position t+j,
          predicts x_{t+2+j} against the target's distribution at position t+1+j.
  Row t is trained at step j iff loss_mask[t+2+j] (the predicted token is an assistant token).
Keys at step j are [step-0 keys | step-1 keys | ... | step-j keys]: causal over step 0 (the
context the target verified) and only the same row in later steps (the row's own earlier
drafts). That is exactly what a draft sees at inference with a KV cache after context row t
(tests/test_train.py checks the two against each other).

Losses are sums over trained rows divided by the global count of trained rows of the whole
optimizer step (known from the data alone), so any split across ranks and micro-batches gives
the same gradient: two ranks with batch b equal one rank with batch 2b.

SIGINT or SIGTERM pauses a run after its current optimizer step, checkpoint saved (exit 130);
the same command resumes it exactly, as it resumes one killed outright from its last save.

`--time-budget SECONDS` plans the step count instead of `--max-steps`. On CUDA the first batch
of each padded length costs a one-time warm-up (kernel selection, compilation, allocation): on
an H200 a first pass took ~1 s, a warm one ~0.23 s, so timing first passes alone plans for a
run ~4x slower than the real one. The warm-up (`measure`; none of it changes the run: grads
dropped, RNG put back) runs global batch 0 untimed, then three batches twice each (the first
ones of epoch 0 to bring a new padded length): the second passes are warm steps, from which
`fit_step_time` takes a fixed cost and a cost per padded token (batches differ in length
several-fold, so the warm steps' mean alone misplans: on an H200 it planned 0.44 s a step for
a run whose steps took 0.24 s); the first minus the second pass is the one-time cost of a new
length (`seconds_per_new_shape`); then the eval twice (the run's evals are all warm: the eval
set is the same each time). The batch plan is a function of the data, so each planned step's
padded tokens (`step_tokens`) and the lengths the steps meet for the first time
(`first_shapes`, `new_shapes`) are known in advance: planned = spent + the steps' fitted
seconds + new_shapes x seconds_per_new_shape + evals, and the plan is
the most steps that fit the budget (`budget_steps`). The LR schedule is built for that count,
which `metrics.jsonl` records (a `plan` record, with the figures above) and every checkpoint
keeps (`total_steps` in its meta.json), so a resumed run continues the same plan and never
plans again (its budget is then only a deadline). A run still short of its plan when the
budget runs out pauses as on SIGINT, exit 75 (EX_TEMPFAIL). The budget counts from before the
target loads to the last step; the export after it comes on top.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import json
import math
import os
import random
import signal
import sys
import time
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from fledge.checkpoint import export_checkpoint, load_checkpoint
from fledge.config import DraftConfig, TrainConfig
from fledge.conventions import accept_length, chain_replay
from fledge.draft import Eagle3Draft
from fledge.features import (FeatureStore, Sample, TargetHead, aux_layer_ids_for, cut_loops, feature_model,
                             features_meta, load_samples, online_features, pad_batch, padded_length)
from fledge.util import (FledgeError, atomic_dir, atomic_write_text, pick_device, print_table, read_jsonl,
                         save_figure, settle_dir, subplots, write_file)
from fledge.vocab import load_vocab_ids

# Fields that change nothing about the numbers, so a resume may differ in them (a resumed run
# keeps the step count its checkpoint records, so a new time budget is only a new deadline).
RESUME_FREE = {"out", "log_every", "eval_every", "save_every", "device", "time_budget"}
# Exit code of a run paused by its time budget: "try again later" (BSD sysexits' EX_TEMPFAIL).
EXIT_BUDGET = 75


# --------------------------------------------------------------------------- the TTT forward
def shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, t + n] at column t, zero past the end."""
    return torch.cat([x[:, n:], x.new_zeros(x.shape[0], min(n, x.shape[1]), *x.shape[2:])], 1)


def ttt_mask(t: int, step: int, device) -> torch.Tensor:
    """[1,1,t,(step+1)t] bool: causal over step-0 keys, own row (the diagonal) in later steps."""
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    eye = torch.eye(t, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * step, 1)[None, None]


def unroll(draft: Eagle3Draft, ids, aux, steps: int) -> list[torch.Tensor]:
    """Per-step draft outputs [B,T,H] (`Eagle3Draft.finish`'s) of the training-time test; see module doc."""
    b, t = ids.shape
    hidden, keys, values, outs = aux, [], [], []
    for j in range(steps):
        pos = (torch.arange(t, device=ids.device) + j).expand(b, t)
        q, k, v, residual = draft.project(shift(ids, 1 + j), hidden, pos)
        keys.append(k)
        values.append(v)
        hidden = draft.attend(q, torch.cat(keys, 2), torch.cat(values, 2), ttt_mask(t, j, ids.device), residual)
        outs.append(hidden)
    return outs


def draft_loss(logits, probs, top, rows, kind: str = "kl"):
    """(summed soft cross-entropy, summed training objective, top-1 hit of each row [n]) of draft
    logits [n, Vd] against the target at flat positions `rows` of probs [N, Vd] (the target's
    distribution over the draft vocab) and top [N] (the target's argmax as a draft id, -1
    outside the draft vocab: a miss). The soft CE is what every kind reports, so runs with
    different objectives compare on one figure. The objective, by `kind` (one of LOSSES):
      kl      the soft CE: forward KL to the target up to its entropy (the EAGLE-3 recipe).
      greedy  the soft CE plus the hard CE of the target's argmax. Greedy verification accepts a
              draft iff it is the argmax, and a tree ranks nodes by the draft's probabilities:
              the soft CE alone fits q to p, which under-ranks the argmax wherever p is flat.
      lk      per row, lam * soft CE + (1 - lam) * (1 - alpha), alpha = sum(min(p, q)) the
              acceptance rate of sampled verification and lam = 1 - alpha held constant: KL's
              strong gradients where the draft is far from p, the acceptance rate itself where it
              is close (total variation's gradient vanishes far away; an LK-style hybrid). Per
              row, not per batch, so any split across ranks and micro-batches gives the same
              gradient."""
    logp = logits.float().log_softmax(-1)
    p, t = probs[rows], top[rows]
    ce = -(p * logp).sum(-1)
    if kind == "kl":
        objective = ce
    elif kind == "greedy":
        objective = ce - torch.where(t >= 0, logp.gather(-1, t.clamp_min(0)[:, None])[:, 0], 0.0)
    else:
        alpha = torch.minimum(p, logp.exp()).sum(-1)
        lam = 1 - alpha.detach()
        objective = lam * ce + (1 - lam) * (1 - alpha)
    return ce.sum(), objective.sum(), logp.argmax(-1) == t


# On CUDA the loss is compiled: eager, each TTT step wrote the gathered fp32 target rows, the
# fp32 logits and their log-softmax, each as wide as the draft vocab, and read them back for the
# product and again in the backward: two thirds of a step's kernel time went to such elementwise
# and indexing kernels (127 of 196 ms on an H200: SmolLM2-135M, batch 64 x 512 tokens, 7 TTT
# steps, a 16,384-token draft vocab; bench/results/profile_train_h200.json). Compiled, the
# gather and the product fold into the reductions. Row counts vary by batch and step: dynamic
# shapes.
draft_loss_compiled = torch.compile(draft_loss, dynamic=True)


class TTT(nn.Module):
    """The draft plus its unrolled loss, as one module so DDP/FSDP2 hooks see one forward.
    `loss`: the objective (draft_loss's kind); `compiled_loss`: draft_loss through
    torch.compile; None = on CUDA."""

    def __init__(self, draft: Eagle3Draft, steps: int, decay: float, compiled_loss: bool | None = None,
                 loss: str = "kl"):
        super().__init__()
        self.draft, self.steps, self.decay, self.compiled_loss, self.loss = draft, steps, decay, compiled_loss, loss

    def forward(self, ids, aux, probs, top, loss_mask, norm, hit_map: bool = False):
        """Returns (loss, stats [3, steps] = summed soft CE, top-1 hits, trained rows).
        `norm[j]` divides step j's summed objective (global trained rows / world size).
        `hit_map`: also return hits [steps, B, T], step j's hit at draft row t (False where
        untrained)."""
        loss, stats = 0.0, []
        hits_at = torch.zeros(self.steps, *ids.shape, dtype=torch.bool, device=ids.device) if hit_map else None
        compiled = ids.is_cuda if self.compiled_loss is None else self.compiled_loss
        loss_of = draft_loss_compiled if compiled else draft_loss
        T = ids.shape[1]
        flat_probs, flat_top = probs.reshape(-1, probs.shape[-1]), top.reshape(-1)
        for j, out in enumerate(unroll(self.draft, ids, aux, self.steps)):
            b, t = shift(loss_mask, 2 + j).nonzero(as_tuple=True)
            ce, objective, hits = loss_of(self.draft.logits(out[b, t]), flat_probs, flat_top, b * T + t + 1 + j,
                                          self.loss)
            loss = loss + self.decay ** j * objective / norm[j]
            stats.append(torch.stack([ce.detach(), hits.sum().float(), torch.tensor(float(b.numel()), device=ce.device)]))
            if hit_map:
                hits_at[j, b, t] = hits
        return (loss, torch.stack(stats, 1)) + ((hits_at,) if hit_map else ())


def summarize(stats: torch.Tensor, replay: torch.Tensor | None = None) -> dict:
    """Per-step loss/accuracy and the simulated accept length (SpecForge's, bonus excluded; and
    SGLang's, bonus included, via conventions.accept_length). `replay` [2] = (accepted drafts,
    rounds) of a chain replayed over held-out text (replay_counts): `replay_accept_len`, the
    figure to compare with the engine's chain of `steps` on such text."""
    ce, hits, n = stats.double().clamp_min(0).unbind(0)
    acc = (hits / n.clamp_min(1)).tolist()
    accepted = sum(math.prod(acc[:j + 1]) for j in range(len(acc)))  # P(first j+1 drafts all right)
    out = {"loss": (ce / n.clamp_min(1)).tolist(), "acc": acc, "accept_len_no_bonus": accepted,
           "accept_len": accept_length(accepted, 1)}
    if replay is not None:
        out["replay_accept_len"] = accept_length(int(replay[0]), int(replay[1]))
    return out


def replay_counts(hits: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """(accepted drafts, rounds) [2] of the greedy chain conventions.chain_replay walks over each
    row of a batch, from TTT's hit map [steps, B, T]."""
    leading = hits.long().cumprod(0).sum(0).tolist()  # right drafts in a row, per draft row
    rounds = [r for lead, m in zip(leading, loss_mask.tolist()) for r in chain_replay(lead, m)]
    return torch.tensor([sum(rounds), len(rounds)], dtype=torch.float64)


# --------------------------------------------------------------------------- data order
def epoch_batches(lengths: list[int], global_batch: int, seed: int, epoch: int) -> list[list[int]]:
    """Shuffled global batches of similar lengths (sorted within windows of 32 batches, so a
    micro-batch pads little), a pure function of (seed, epoch): resuming needs only the step."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(len(lengths), generator=g).tolist()
    win = 32 * global_batch
    order = [i for w in range(0, len(perm), win) for i in sorted(perm[w:w + win], key=lambda i: lengths[i])]
    batches = [order[i:i + global_batch] for i in range(0, len(order) - global_batch + 1, global_batch)]
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]


def split_eval(samples: list[Sample], cfg: TrainConfig, vocab: int) -> tuple[list[Sample], list[Sample]]:
    if cfg.eval_data:
        return samples, load_samples(cfg.eval_data, cfg.max_len, vocab)
    n = min(cfg.eval_samples, len(samples) // 10)
    perm = torch.randperm(len(samples), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    return [samples[i] for i in sorted(perm[n:])], [samples[i] for i in sorted(perm[:n])]


# --------------------------------------------------------------------------- the run
@dataclass
class Run:
    """Everything a step needs, built once by `setup`."""
    cfg: TrainConfig
    model: nn.Module       # TTT, wrapped for DDP (or sharded in place by FSDP2)
    ttt: TTT               # the unwrapped module (state dicts)
    target: nn.Module      # what computes the features (features.feature_model)
    verifier: str          # the target as engines load it: its resolved HF directory, not a fledge alias
    head: TargetHead
    aux_ids: tuple
    store: FeatureStore | None
    train: list[Sample]
    evals: list[Sample]
    opt: torch.optim.Optimizer
    per_epoch: int         # optimizer steps per pass over the training set
    rank: int
    world: int
    device: torch.device
    plan: dict = dataclasses.field(default_factory=dict)  # epoch -> its global batches
    total_steps: int = 0   # set with `sched` by `start_schedule` once the step count is known
    sched: torch.optim.lr_scheduler.LambdaLR | None = None


def draft_vocab_ids(path: str, vocab_size: int) -> torch.Tensor:
    ids, vocab = load_vocab_ids(path)
    if vocab != vocab_size:
        raise FledgeError(f"--vocab {path}: made for a {vocab}-token vocab; the target has {vocab_size}")
    return ids


def build_draft(cfg: TrainConfig, target, rank: int = 0) -> Eagle3Draft:
    model = target.model
    tcfg = model.config.get_text_config()
    if cfg.init:
        draft = load_checkpoint(cfg.init, embed_from=model)
        if (draft.cfg.hidden_size, draft.cfg.vocab_size) != (tcfg.hidden_size, tcfg.vocab_size):
            raise FledgeError(f"--init {cfg.init}: drafter for H={draft.cfg.hidden_size}, vocab {draft.cfg.vocab_size}; "
                              f"target has H={tcfg.hidden_size}, vocab {tcfg.vocab_size}")
        if cfg.aux_layers is not None and tuple(cfg.aux_layers) != tuple(draft.cfg.aux_layer_ids):
            raise FledgeError(f"--aux-layers {list(cfg.aux_layers)}: --init {cfg.init} reads layers "
                              f"{list(draft.cfg.aux_layer_ids)}; its fc weights belong to those")
        if cfg.draft_intermediate_size:
            try:
                draft.widen_mlp(cfg.draft_intermediate_size, cfg.seed)
            except FledgeError as e:
                raise FledgeError(f"--init {cfg.init}: {e}") from None
        if cfg.vocab:
            try:
                moved = draft.change_vocab(draft_vocab_ids(cfg.vocab, tcfg.vocab_size), model)
            except FledgeError as e:
                raise FledgeError(f"--vocab {cfg.vocab}: {e}") from None
            if rank == 0:
                print(f"fledge train: --init's head moved to --vocab: {moved['kept']:,} rows kept, {moved['added']:,} "
                      f"added, {moved['dropped']:,} dropped", file=sys.stderr)
        if cfg.norm_output:  # adds no weights; fc_norm's are calibrated in setup, where the features are
            draft.cfg = draft.cfg.replace(norm_output=True)
        return draft
    ids = draft_vocab_ids(cfg.vocab, tcfg.vocab_size) if cfg.vocab else torch.arange(tcfg.vocab_size)
    dcfg = DraftConfig.from_target(tcfg, draft_vocab_size=ids.numel(), aux_layer_ids=cfg.aux_layers,
                                   intermediate_size=cfg.draft_intermediate_size).replace(
        fc_norm=cfg.fc_norm, norm_output=cfg.norm_output)
    draft = Eagle3Draft.from_target(dcfg, model, ids)
    if cfg.head != "fresh":
        draft.init_head_from(model)
    return draft


@torch.no_grad()
def aux_scales(fmodel, aux_ids, samples: list[Sample], pad_multiple: int, device) -> torch.Tensor:
    """Each aux state's median RMS over the tokens of `samples` [3]: where the fc_norm weights
    of a warm start without them begin (Eagle3Draft.add_fc_norm). The median, because a few
    tokens (the first ones, attention sinks) carry states far larger than the rest, which a mean
    would follow: on SmolLM2 the mid and high aux states' RMS reach ~990 there against medians of
    7 and 21 (four short prompts, fp32 on a CPU). The same samples on every rank, so every rank
    starts from the same weights."""
    ids, _, attn = (x.to(device) for x in pad_batch(samples, pad_multiple))
    aux, _ = online_features(fmodel, aux_ids, ids, attn)
    real = aux[attn.bool()].float()
    return torch.stack([x.pow(2).mean(-1).sqrt().median() for x in real.chunk(3, -1)]).cpu()


def setup(cfg: TrainConfig, target) -> Run:
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    device = pick_device(cfg.device or (f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:  # "--device cuda": this rank's GPU
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before NCCL starts, so each rank binds its own GPU
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    model = target.model.to(device).eval()
    if device.type == "cuda" and cfg.bf16:
        model = model.to(torch.bfloat16)  # the served target runs bf16: train on the features it produces
    tcfg = model.config.get_text_config()
    samples = load_samples(cfg.data, cfg.max_len, tcfg.vocab_size)
    store = None
    if cfg.features:
        store = FeatureStore(cfg.features, {**features_meta(target.name, cfg.data, cfg.max_len),
                                            "num_samples": len(samples)}, tcfg.hidden_size)
    train, evals = split_eval(samples, cfg, tcfg.vocab_size)
    if cfg.loop_cut:
        train, cut = cut_loops(train, cfg.loop_cut)
        if rank == 0:
            print(f"fledge train: --loop-cut {cfg.loop_cut} cut {cut['cut']} of {cut['samples']} samples; "
                  f"{cut['trained_tokens_kept']:,} of {cut['trained_tokens']:,} trained tokens kept", file=sys.stderr)
    draft = build_draft(cfg, target, rank)
    fmodel = feature_model(model)
    aux_ids = aux_layer_ids_for(model, draft.cfg.aux_layer_ids)
    if store and tuple(store.meta["aux_layer_ids"]) != aux_ids:
        raise FledgeError(f"--features {cfg.features}: aux layers {store.meta['aux_layer_ids']}, drafter reads {list(aux_ids)}")
    if cfg.fc_norm and not draft.cfg.fc_norm:
        scales = aux_scales(fmodel, aux_ids, train[:cfg.batch_size], cfg.pad_multiple, device)
        draft.add_fc_norm(scales)
        if rank == 0:
            print(f"fledge train: --init gained fc_norm, weights at its aux states' median RMS "
                  f"{[round(x, 3) for x in scales.tolist()]}", file=sys.stderr)
    draft.lm_head.weight.requires_grad_(cfg.head != "frozen")  # set on resume too: the optimizer's groups follow it
    ttt = TTT(draft, cfg.ttt_steps, cfg.step_decay, loss=cfg.loss).to(device)
    wrapped = parallelize(ttt, cfg.parallel, world, device)
    per_epoch = len(train) // (cfg.batch_size * world * cfg.grad_accum)
    if per_epoch == 0:
        raise FledgeError(f"{cfg.data}: {len(train)} training samples, fewer than one global batch "
                          f"({cfg.batch_size} x {world} ranks x {cfg.grad_accum} accumulation)")
    opt = torch.optim.AdamW([p for p in ttt.parameters() if p.requires_grad], lr=cfg.lr,
                            betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    return Run(cfg, wrapped, ttt, fmodel, str(target.path or target.name), TargetHead.from_model(model, draft.target_ids().cpu(), device), aux_ids,
               store, train, evals, opt, per_epoch, rank, world, device)


def start_schedule(run: Run, total: int) -> None:
    """Fix the run's length: linear warm-up over `--warmup` of `total` steps, then cosine decay to 0."""
    warm = max(1, int(run.cfg.warmup * total))
    cosine = lambda s: 0.5 * (1 + math.cos(math.pi * min(1.0, max(0.0, (s - warm) / max(1, total - warm)))))  # noqa: E731
    run.total_steps = total
    run.sched = torch.optim.lr_scheduler.LambdaLR(run.opt, lambda s: min((s + 1) / warm, cosine(s)))


def parallelize(ttt: TTT, how: str, world: int, device) -> nn.Module:
    if world == 1:
        return ttt
    if how == "fsdp":
        from torch.distributed.fsdp import fully_shard
        # One group for the whole draft: its halves (project/attend) call submodules directly,
        # so only the root's forward hook can gather parameters; one layer gains nothing finer.
        fully_shard(ttt)
        return ttt
    return nn.parallel.DistributedDataParallel(ttt, device_ids=[device.index] if device.type == "cuda" else None)


def batch_tensors(run: Run, samples: list[Sample], from_store: bool):
    """(ids, loss_mask, aux, probs, top) for one micro-batch, on the run's device."""
    ids, mask, attn = (x.to(run.device) for x in pad_batch(samples, run.cfg.pad_multiple))
    if run.store is not None and from_store:
        aux, hidden = run.store.batch([s.index for s in samples], ids.shape[1], run.device)
    else:
        aux, hidden = online_features(run.target, run.aux_ids, ids, attn)
    probs, top = run.head.view(hidden)
    return ids, mask, aux, probs, top


def autocast(run: Run):
    return torch.autocast("cuda", torch.bfloat16, enabled=run.device.type == "cuda" and run.cfg.bf16)


def train_step(run: Run, step: int) -> tuple[torch.Tensor, int]:
    """One optimizer step over global batch `step`; returns the all-reduced stats [3, k] and
    the target tokens of the global batch."""
    stats, ntok = accumulate(run, step)
    torch.nn.utils.clip_grad_norm_([p for p in run.ttt.parameters() if p.requires_grad], run.cfg.clip)
    run.opt.step()
    run.sched.step()
    run.opt.zero_grad(set_to_none=True)
    return stats, ntok


def global_batch(run: Run, step: int) -> list[int]:
    """The sample indices of global batch `step` (one epoch's batches cached in `run.plan`)."""
    epoch, k = divmod(step, run.per_epoch)
    if epoch not in run.plan:
        gb = run.cfg.batch_size * run.world * run.cfg.grad_accum
        run.plan = {epoch: epoch_batches([len(s.input_ids) for s in run.train], gb, run.cfg.seed, epoch)}
    return run.plan[epoch][k]


def micro_batch(run: Run, batch: list[int], rank: int, m: int) -> list[int]:
    """Rank `rank`'s accumulation micro-batch `m` of a global batch."""
    return batch[(m * run.world + rank) * run.cfg.batch_size:][:run.cfg.batch_size]


def accumulate(run: Run, step: int) -> tuple[torch.Tensor, int]:
    """The forward and backward passes of global batch `step`, gradients summed into `.grad`;
    returns the all-reduced stats [3, k] and the target tokens of the global batch."""
    cfg = run.cfg
    batch = global_batch(run, step)
    norm = sum(run.train[i].step_counts(cfg.ttt_steps) for i in batch).clamp_min(1).to(run.device) / run.world
    stats = torch.zeros(3, cfg.ttt_steps, device=run.device)
    for m in range(cfg.grad_accum):
        mine = [run.train[i] for i in micro_batch(run, batch, run.rank, m)]
        ids, mask, aux, probs, top = batch_tensors(run, mine, True)
        with grad_sync(run.model, m == cfg.grad_accum - 1), autocast(run):
            loss, s = run.model(ids, aux, probs, top, mask, norm)
        loss.backward()
        stats += s
    return all_reduce(stats), sum(len(run.train[i].input_ids) for i in batch)


def grad_sync(model, sync: bool):
    """Skip the gradient all-reduce on all but the last accumulation micro-batch."""
    if isinstance(model, nn.parallel.DistributedDataParallel) and not sync:
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(x)
    return x


@torch.no_grad()
def evaluate(run: Run) -> dict:
    """Held-out stats over online features; each rank takes every world-th sample (equal
    counts: under FSDP2 every rank must run every forward)."""
    evals = run.evals[:len(run.evals) // run.world * run.world]
    mine = sorted(evals[run.rank::run.world], key=lambda s: len(s.input_ids))
    stats = torch.zeros(3, run.cfg.ttt_steps, device=run.device)
    replay = torch.zeros(2, dtype=torch.float64)
    ones = torch.ones(run.cfg.ttt_steps, device=run.device)
    for b in range(0, len(mine), run.cfg.batch_size):
        ids, mask, aux, probs, top = batch_tensors(run, mine[b:b + run.cfg.batch_size], False)
        with autocast(run):
            _, s, hits = run.ttt(ids, aux, probs, top, mask, ones, hit_map=True)
        stats += s
        replay += replay_counts(hits.cpu(), mask.cpu())
    return summarize(all_reduce(stats), all_reduce(replay.to(run.device)).cpu())


# --------------------------------------------------------------------------- checkpoints
def resume_key(run: Run) -> dict:
    """What must match for a checkpoint to continue this run exactly."""
    keep = {k: v for k, v in dataclasses.asdict(run.cfg).items() if k not in RESUME_FREE}
    return json.loads(json.dumps({**keep, "aux_layers": list(run.aux_ids), "world": run.world,
                                  "data_sha": features_meta("", run.cfg.data, run.cfg.max_len)["data_sha"]}))


def full_state(run: Run):
    """Full (unsharded) model and optimizer state dicts on the CPU; a collective under FSDP2."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    return get_state_dict(run.ttt, run.opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_checkpoint(run: Run, step: int, key: dict) -> None:
    model_sd, optim_sd = full_state(run)
    if run.rank == 0:
        rng = {"torch": torch.get_rng_state(), "python": random.getstate(),
               "cuda": torch.cuda.get_rng_state_all() if run.device.type == "cuda" else None}
        buf = io.BytesIO()  # torch's own writer names no file when the disk fills: write the bytes ourselves
        torch.save({"model": model_sd, "optim": optim_sd, "sched": run.sched.state_dict(), "step": step,
                    "rng": rng}, buf)
        with atomic_dir(Path(run.cfg.out) / "checkpoint", overwrite=True) as tmp:
            write_file(tmp / "state.pt", buf.getvalue())
            meta = {"step": step, "total_steps": run.total_steps, "key": key}
            write_file(tmp / "meta.json", json.dumps(meta, indent=1).encode())
    if dist.is_initialized():
        dist.barrier()


def _refuse_resume(ck: Path, step, why: str) -> FledgeError:
    at = f"from step {step}" if step is not None else "(step unknown)"
    return FledgeError(f"{ck}: cannot resume {at}: {why}; remove {ck} to start again from step 0, or use a new --out")


def read_resume_meta(ck: Path) -> tuple[int, dict, int | None]:
    """(step, resume key, the run's step count) from `<ck>/meta.json`; FledgeError if it is
    missing or malformed. The step count is None where meta.json records none."""
    try:
        meta = json.loads((ck / "meta.json").read_text())
        step, key, total = meta["step"], meta["key"], meta.get("total_steps")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        why = e.strerror if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
        raise _refuse_resume(ck, None, f"meta.json unreadable ({why})") from None
    if not (isinstance(step, int) and step >= 0 and isinstance(key, dict)):
        raise _refuse_resume(ck, None, f"meta.json holds step {step!r} and key of type {type(key).__name__}")
    if total is not None and not (isinstance(total, int) and total >= max(step, 1)):
        raise _refuse_resume(ck, step, f"meta.json holds total_steps {total!r}")
    return step, key, total


def read_resume_state(ck: Path, step: int) -> dict:
    """`<ck>/state.pt` read with weights_only=True: tensors and plain containers only, so a
    planted pickle cannot run code. FledgeError naming the step if it is missing, truncated,
    foreign or of another step than meta.json says."""
    try:
        state = torch.load(ck / "state.pt", map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise _refuse_resume(ck, step, "state.pt is missing") from None
    except Exception:  # truncated zip, garbage, a refused object: torch raises assorted types
        raise _refuse_resume(ck, step, "state.pt is truncated, corrupt, or holds objects beyond tensors and plain "
                                       "data (never unpickled: they could run code)") from None
    keys = {"model", "optim", "sched", "step", "rng"}
    if not (isinstance(state, dict) and keys <= state.keys()) or state["step"] != step:
        got = state.get("step") if isinstance(state, dict) else None
        raise _refuse_resume(ck, step, f"state.pt is not the state of that step (holds step {got})")
    return state


def checkpoint_meta(run: Run, key: dict) -> tuple[int, int | None] | None:
    """(step, the run's step count or None) of `<out>/checkpoint`, None if there is none;
    FledgeError for a checkpoint of another config."""
    ck = settle_dir(Path(run.cfg.out) / "checkpoint")
    if not ck.exists():
        return None
    step, old, total = read_resume_meta(ck)
    if old != key:
        diff = sorted(k for k in set(old) | set(key) if old.get(k) != key.get(k))
        raise FledgeError(f"{ck}: checkpoint of another config ({', '.join(diff)} differ); use a new --out")
    return step, total


def load_checkpoint_state(run: Run, step: int) -> None:
    """Restore weights, optimizer, schedule and RNG from `<out>/checkpoint` (at `step`, as
    `checkpoint_meta` read it). The data position is the step itself (see epoch_batches)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    ck = Path(run.cfg.out) / "checkpoint"
    state = read_resume_state(ck, step)
    set_state_dict(run.ttt, run.opt, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(full_state_dict=True))
    run.sched.load_state_dict(state["sched"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    if state["rng"]["cuda"] is not None and run.device.type == "cuda":
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])


def export(run: Run) -> Path:
    """Write the served checkpoint (rank 0) from the full state: works sharded or not."""
    model_sd, _ = full_state(run)
    out = Path(run.cfg.out) / "draft"
    if run.rank == 0:
        draft = Eagle3Draft(run.ttt.draft.cfg)
        draft.load_state_dict({k.removeprefix("draft."): v for k, v in model_sd.items()})
        export_checkpoint(draft, out, layout="eagle3", verifier=run.verifier, overwrite=True)
    return out


class Paused(Exception):
    """Training stopped between optimizer steps by SIGINT/SIGTERM (`exit_code` 130) or by its
    time budget (EXIT_BUDGET), its checkpoint saved: the same command resumes it exactly."""

    def __init__(self, step: int, total: int, checkpoint: Path, budget: float | None = None):
        why = f"the time budget of {budget:g} s ran out" if budget is not None else "paused"
        super().__init__(f"{why} at step {step} of {total}; {checkpoint} holds the run: rerun the same command to "
                         "resume")
        self.exit_code = 130 if budget is None else EXIT_BUDGET


@contextlib.contextmanager
def pause_on_signal():
    """Yields a flag (a one-element list) that the first SIGINT or SIGTERM sets; a second one
    interrupts as it normally would. So a run cut by `timeout -s INT` (a 10-minute GPU call)
    or by Ctrl-C loses nothing past its last optimizer step. Outside the main thread, where no
    handler can be installed, the flag never rises."""
    flag, old = [False], {}

    def handler(signum, frame):
        if flag[0]:
            raise KeyboardInterrupt
        flag[0] = True

    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            old[sig] = signal.signal(sig, handler)
    except ValueError:  # not the main thread
        pass
    try:
        yield flag
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def any_rank(flags: list[bool], device) -> list[bool]:
    """Each flag: whether any rank raised it. Ranks must stop at the same step (checkpoints are
    collective), for a signal one of them saw or a budget one of them ran out of."""
    return [bool(x) for x in rank_max(torch.tensor([float(f) for f in flags]), device).tolist()]


def rank_max(x: torch.Tensor, device) -> torch.Tensor:
    """The elementwise max of `x` (a CPU tensor) over the ranks."""
    if not dist.is_initialized():
        return x
    x = x.to(device)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x.cpu()


# --------------------------------------------------------------------------- the time budget
def planned_seconds(step_s: list[float], eval_s: float, eval_every: int | None, first_s: float = 0.0,
                    new_at: list[int] = ()) -> float:
    """Seconds the optimizer steps costing `step_s` (one entry a step, in order) take with their
    evals (every `eval_every` steps and at the last; `eval_every` None: no eval) and the one-time
    cost `first_s` of each new padded length they meet (`new_at`: the steps meeting one,
    ascending, one entry per length)."""
    steps = len(step_s)
    evals = -(-steps // eval_every) * eval_s if eval_every else 0.0
    return sum(step_s) + bisect_left(new_at, steps) * first_s + evals


def budget_steps(budget: float, spent: float, step_s: list[float], eval_s: float, eval_every: int | None,
                 first_s: float = 0.0, new_at: list[int] = ()) -> int:
    """The most leading steps of `step_s` whose `planned_seconds` fit in `budget` after `spent`;
    FledgeError if not even one does."""
    left, ran = budget - spent, [0.0, *itertools.accumulate(step_s)]
    evals = lambda n: -(-n // eval_every) * eval_s if eval_every else 0.0  # noqa: E731
    cost = lambda n: ran[n] + bisect_left(new_at, n) * first_s + evals(n)  # noqa: E731  planned_seconds, O(log n)
    steps = bisect_right(range(len(ran)), left, key=cost) - 1
    if steps < 1:
        raise FledgeError(f"--time-budget {budget:g}: no optimizer step fits (setting up and measuring took "
                          f"{spent:.1f} s, a step takes {step_s[0]:.2g} s, an eval {eval_s:.2g} s): give at least "
                          f"{math.ceil(spent + cost(1))} s")
    return steps


def sample_lengths(run: Run) -> list[int]:
    return [len(s.input_ids) for s in run.train]


def step_shapes(run: Run, lengths: list[int], step: int) -> list[list[tuple[int, int]]]:
    """(rows, padded length) of each accumulation micro-batch of optimizer step `step`, rank by
    rank (`lengths`: sample_lengths)."""
    batch, pad = global_batch(run, step), run.cfg.pad_multiple
    return [[(len(mb), padded_length(max(lengths[i] for i in mb), pad))
             for mb in (micro_batch(run, batch, r, m) for m in range(run.cfg.grad_accum))]
            for r in range(run.world)]


def step_tokens(run: Run, lengths: list[int], step: int) -> int:
    """Padded tokens of optimizer step `step` on the rank that pads most: what its time scales with."""
    return max(sum(rows * t for rows, t in rank) for rank in step_shapes(run, lengths, step))


def first_shapes(run: Run, steps) -> list[int]:
    """Positions in `steps` (optimizer steps, in the order they run) at which a rank meets a
    padded micro-batch length for the first time, one entry per length, as many as the rank
    meeting most (ranks wait for each other). Stops early once every rank has met every length."""
    lengths = sample_lengths(run)
    every = {padded_length(n, run.cfg.pad_multiple) for n in lengths}
    seen, out = [set() for _ in range(run.world)], []
    for pos, step in enumerate(steps):
        if all(s == every for s in seen):
            break
        new = 0
        for s, rank in zip(seen, step_shapes(run, lengths, step)):
            mine = {t for _, t in rank}
            new = max(new, len(mine - s))
            s |= mine
        out += [pos] * new
    return out


def fit_step_time(tokens: list[int], seconds: list[float]) -> tuple[float, float]:
    """(fixed seconds, seconds per padded token) of a warm step, least squares over the timed
    steps, both kept >= 0: batches of similar lengths pad from ~100 to 2,048 tokens a row, so
    three steps' mean time alone can miss a run's mean by half."""
    mx, my = sum(tokens) / len(tokens), sum(seconds) / len(seconds)
    sxx = sum((x - mx) ** 2 for x in tokens)
    per = sum((x - mx) * (y - my) for x, y in zip(tokens, seconds)) / sxx if sxx else my / max(mx, 1)
    fixed = my - per * mx
    if per < 0:
        return my, 0.0
    if fixed < 0:
        return 0.0, sum(x * y for x, y in zip(tokens, seconds)) / max(sum(x * x for x in tokens), 1)
    return fixed, per


def measure(run: Run, clock) -> tuple[float, float, float, float, list[int]]:
    """(fixed seconds of a warm step, its seconds per padded token, one-time seconds of a new
    padded length, seconds per warm eval, the steps the warm-up ran) for a time budget's plan
    (see the module doc): batch 0 untimed, then each of three batches twice, then the eval
    twice. Gradients are dropped and RNG states put back, so the run goes on as if none of it
    happened; the optimizer's own step is not timed (it is small beside the passes)."""
    rng = (torch.get_rng_state(), random.getstate(),
           torch.cuda.get_rng_state_all() if run.device.type == "cuda" else None)
    fresh = [s for s in dict.fromkeys(first_shapes(run, range(run.per_epoch))) if s > 0]
    warm = [0] + (fresh + [1, 2, 3])[:3]
    new = first_shapes(run, warm)
    reads = []
    for i, step in enumerate(warm):
        for _ in range(2 if i else 1):
            accumulate(run, step)[0].cpu()  # the copy waits for the GPU
            run.opt.zero_grad(set_to_none=True)
            reads.append(clock())
    for _ in range(2):
        if run.evals:
            evaluate(run)
        reads.append(clock())
    took = [b - a for a, b in zip(reads, reads[1:])]  # batch 1 cold, warm, ..., batch 3 warm, eval cold, warm
    lengths = sample_lengths(run)
    fixed, per = fit_step_time([step_tokens(run, lengths, s) for s in warm[1:]], took[1:6:2])
    first = sum(c - w for i, (c, w) in enumerate(zip(took[0:6:2], took[1:6:2]), 1) if i in new)
    first_s = max(0.0, first / max(1, len(new) - new.count(0)))
    torch.set_rng_state(rng[0])
    random.setstate(rng[1])
    if rng[2] is not None:
        torch.cuda.set_rng_state_all(rng[2])
    figures = rank_max(torch.tensor([fixed, per, first_s, took[-1]], dtype=torch.float64), run.device).tolist()
    return *figures, warm


def plan_budget(run: Run, begun: float, clock) -> dict:
    """The `plan` record of a time-budget run: its step count and what it was planned from.
    Every rank plans from the slowest rank's figures, so all plan the same count."""
    fixed, per, first_s, eval_s, warm = measure(run, clock)
    spent = float(rank_max(torch.tensor([clock() - begun], dtype=torch.float64), run.device))
    if fixed + per <= 0:
        raise FledgeError("--time-budget: the measured steps took no time on this clock; plan with --max-steps")
    # Each step's planned seconds, until the steps alone overrun the budget: no plan gets further.
    lengths, step_s, total = sample_lengths(run), [], 0.0
    while not step_s or total <= run.cfg.time_budget - spent:
        step_s.append(fixed + per * step_tokens(run, lengths, len(step_s)))
        total += step_s[-1]
    new_at = [p - len(warm) for p in first_shapes(run, warm + list(range(len(step_s)))) if p >= len(warm)]
    eval_every = run.cfg.eval_every if run.evals else None
    steps = budget_steps(run.cfg.time_budget, spent, step_s, eval_s, eval_every, first_s, new_at)
    return {"kind": "plan", "step": 0, "time_budget": run.cfg.time_budget, "total_steps": steps,
            "seconds_per_step": sum(step_s[:steps]) / steps, "step_fixed_s": fixed, "step_s_per_token": per,
            "seconds_per_new_shape": first_s, "new_shapes": bisect_left(new_at, steps),
            "seconds_per_eval": eval_s if eval_every else None, "spent_s": spent,
            "planned_s": spent + planned_seconds(step_s[:steps], eval_s, eval_every, first_s, new_at)}


# --------------------------------------------------------------------------- logging
def write_curves(path: Path, history: list[dict]) -> None:
    fig, axes = subplots(1, 3, figsize=(14, 4))
    for kind, style in (("train", "-"), ("eval", "o-")):
        rows = [r for r in history if r["kind"] == kind]
        if rows:
            steps = [r["step"] for r in rows]
            axes[0].plot(steps, [r["objective"] for r in rows], style, label=kind)
            axes[1].plot(steps, [r["acc"][0] for r in rows], style, label=f"{kind} step 0")
            axes[2].plot(steps, [r["accept_len"] for r in rows], style, label=f"{kind} (with bonus)")
            replayed = [(r["step"], r["replay_accept_len"]) for r in rows if "replay_accept_len" in r]
            if replayed:
                axes[2].plot(*zip(*replayed), "s--", label=f"{kind}, chain replayed")
    for ax, title in zip(axes, ("weighted soft CE", "top-1 accuracy, step 0", "accept length")):
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.legend()
    save_figure(fig, path)


def record(kind: str, step: int, stats: dict, decay: float, **extra) -> dict:
    objective = sum(decay ** j * v for j, v in enumerate(stats["loss"]))
    return {"kind": kind, "step": step, "objective": objective, **stats, **extra}


def print_eval(rec: dict) -> None:
    """An eval record as `fledge train` and `fledge adapt` print it: per TTT step soft CE and
    accuracy, then the accept lengths."""
    steps = enumerate(zip(rec["loss"], rec["acc"]))
    print_table([["step", "soft CE", "acc"], *([j, f"{l:.4f}", f"{a:.3f}"] for j, (l, a) in steps)])
    print(f"simulated accept length: {rec['accept_len']:.3f} with the bonus token (SGLang), "
          f"{rec['accept_len_no_bonus']:.3f} without (SpecForge)")
    if "replay_accept_len" in rec:
        print(f"replayed chain of {len(rec['acc'])} (rounds walked as the engine verifies them, "
              f"bonus included): {rec['replay_accept_len']:.3f}")


# --------------------------------------------------------------------------- the loop
def check_finite(stats: torch.Tensor, step: int, first: bool) -> None:
    """Stop a run whose loss went NaN or inf (stats: a step's summed CE per TTT step, on the
    CPU) before the bad step is saved: the checkpoint keeps the last finite step."""
    if bool(torch.isfinite(stats).all()):
        return
    why = (" (the first forward of this run): the target's features or the drafter's weights are not finite"
           if first else ": nothing of it was saved; rerun with a lower --lr or --clip in a new --out")
    raise FledgeError(f"training loss is NaN or inf at step {step}{why}")


def train(cfg: TrainConfig, target, clock=time.monotonic, begun: float | None = None) -> dict:
    """Train (resuming from `<out>/checkpoint` if present); returns the last eval record.
    Raises `Paused` after a SIGINT/SIGTERM or once `cfg.time_budget` seconds of `clock` have
    passed since `begun` (default: the call), the checkpoint saved at the step it stopped."""
    begun = clock() if begun is None else begun
    run = setup(cfg, target)
    out = Path(cfg.out)
    key = resume_key(run)
    resumed = checkpoint_meta(run, key)  # refuses a foreign checkpoint before anything is written
    start, total = resumed or (0, None)
    plan = plan_budget(run, begun, clock) if resumed is None and cfg.time_budget else None
    start_schedule(run, plan["total_steps"] if plan else total or cfg.max_steps or run.per_epoch * cfg.epochs)
    if resumed:
        load_checkpoint_state(run, start)
    metrics = out / "metrics.jsonl"
    history = [r for _, r in read_jsonl(metrics, on_bad=lambda *a: None)] if resumed and metrics.exists() else []
    # Lines past the checkpoint's step belong to the attempt that was killed.
    history = [r for r in history if r["step"] <= start] + ([plan] if plan else [])
    if run.rank == 0:
        atomic_write_text(metrics, "".join(json.dumps(r) + "\n" for r in history))
        if plan:
            print(f"fledge train: {plan['total_steps']} steps fit the time budget of {cfg.time_budget:g} s "
                  f"({plan['seconds_per_step']:.3g} s a step, {plan['seconds_per_new_shape']:.2g} s once for each of "
                  f"{plan['new_shapes']} new batch lengths; {plan['spent_s']:.1f} s spent setting up and measuring)",
                  file=sys.stderr)
    last = {}
    t0, tokens, window = time.perf_counter(), 0, torch.zeros(3, cfg.ttt_steps)
    # The bar closes however the loop ends, so an error's one line starts a line of its own.
    with (tqdm(total=run.total_steps, initial=start, unit="step", disable=run.rank != 0) as bar,
          open(metrics, "a") if run.rank == 0 else contextlib.nullcontext() as f, pause_on_signal() as stop):
        for step in range(start, run.total_steps):
            stats, ntok = train_step(run, step)
            stats = stats.cpu()  # the step's one sync, which the finite check below rides on
            check_finite(stats, step + 1, step == start)
            tokens, window = tokens + ntok, window + stats
            done = step + 1
            new = []
            if done % cfg.log_every == 0 or done == run.total_steps:
                dt = time.perf_counter() - t0
                new.append(record("train", done, summarize(window), cfg.step_decay, lr=run.sched.get_last_lr()[0],
                                  target_tok_s=tokens / dt, target_tokens=tokens, seconds=dt))
                bar.set_postfix(loss=f"{new[-1]['objective']:.3f}", acc0=f"{new[-1]['acc'][0]:.2f}",
                                tok_s=f"{tokens / dt:.0f}")
                t0, tokens, window = time.perf_counter(), 0, torch.zeros_like(window)
            paused = time.perf_counter()  # eval and checkpoints are not training: kept out of tok/s
            if done % cfg.eval_every == 0 or done == run.total_steps:
                last = record("eval", done, evaluate(run), cfg.step_decay) if run.evals else last
                new += [last] if last else []
            if run.rank == 0:
                for r in new:
                    f.write(json.dumps(r) + "\n")
                f.flush()
                history += new
                if any(r["kind"] == "eval" for r in new):
                    write_curves(out / "curves.png", history)
            saved = done % cfg.save_every == 0 or done == run.total_steps
            if saved:
                save_checkpoint(run, done, key)
            t0 += time.perf_counter() - paused
            bar.update(1)
            if done < run.total_steps:
                late = cfg.time_budget is not None and clock() - begun >= cfg.time_budget
                signalled, late = any_rank([stop[0], late], run.device)
                if signalled or late:
                    if not saved:
                        save_checkpoint(run, done, key)
                    raise Paused(done, run.total_steps, out / "checkpoint", None if signalled else cfg.time_budget)
    path = export(run)
    if dist.is_initialized():
        dist.barrier()
    return {"draft": str(path), "eval": last, "steps": run.total_steps}


def run_train(args) -> int:
    from fledge.target import load_target
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k in fields and v is not None})
    begun = time.monotonic()  # a time budget counts the target's loading too
    try:
        result = train(cfg, load_target(cfg.target), begun=begun)
    except Paused as e:
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"fledge train: {e}", file=sys.stderr)
        if dist.is_initialized():
            dist.destroy_process_group()
        return e.exit_code
    if int(os.environ.get("RANK", 0)) == 0:
        if result["eval"]:
            print_eval(result["eval"])
        atomic_write_text(Path(cfg.out) / "result.json", json.dumps(result, indent=1) + "\n")
        print(f"drafter: {result['draft']}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0
