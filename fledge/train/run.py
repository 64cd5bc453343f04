"""A training run's state and one optimizer step: data order, the draft and its optimizer, micro-
batches across ranks, the eval.

Losses are sums over trained rows divided by the global count of trained rows of the whole
optimizer step (known from the data alone), so any split across ranks and micro-batches gives
the same gradient: two ranks with batch b equal one rank with batch 2b.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from fledge.core.config import DraftConfig, TrainConfig, is_url
from fledge.core.devices import pick_device
from fledge.core.errors import FledgeError
from fledge.data.tokenize import check_tokenized
from fledge.data.vocab import load_vocab_ids
from fledge.drafter.checkpoint import load_checkpoint
from fledge.drafter.eagle3 import Eagle3Draft
from fledge.train.capture_run import StreamedFeatures, open_stream
from fledge.train.dflash import BlockTrain, build_block_draft, default_mask_token
from fledge.train.features import (
    FeatureStore,
    Sample,
    TargetHead,
    aux_layer_ids_for,
    cut_loops,
    feature_model,
    features_meta,
    load_samples,
    online_features,
    pad_batch,
)
from fledge.train.ttt import TTT, replay_counts, summarize


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
    store: FeatureStore | StreamedFeatures | None
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


def _build_eagle3(cfg: TrainConfig, target, rank: int = 0) -> Eagle3Draft:
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
        try:
            if cfg.draft_intermediate_size:
                draft.widen_mlp(cfg.draft_intermediate_size, cfg.seed)
            if cfg.draft_layers:
                draft.add_layers(cfg.draft_layers, cfg.seed)
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
        fc_norm=cfg.fc_norm, norm_output=cfg.norm_output, num_hidden_layers=cfg.draft_layers or 1)
    draft = Eagle3Draft.from_target(dcfg, model, ids)
    if cfg.head != "fresh":
        draft.init_head_from(model)
    return draft


def build_draft(cfg: TrainConfig, target, rank: int = 0):
    """The drafter a run starts from, by method (DFlash: fledge.train.dflash). A P-EAGLE run
    starts from EAGLE-3's (fresh or --init's) and gains mask slots, unless --init has them."""
    tcfg = target.model.config.get_text_config()
    if cfg.method == "dflash":
        return build_block_draft(cfg, target, draft_vocab_ids(cfg.vocab, tcfg.vocab_size) if cfg.vocab
                                 else torch.arange(tcfg.vocab_size))
    draft = _build_eagle3(cfg, target, rank)
    if cfg.method == "peagle" and not draft.cfg.parallel:
        draft.add_mask_slots(cfg.mask_token_id if cfg.mask_token_id is not None
                             else default_mask_token(target.tokenizer, tcfg.vocab_size))
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
    for path in filter(None, (cfg.data, cfg.eval_data)):
        check_tokenized(path, target.tokenizer, target.name)
    samples = load_samples(cfg.data, cfg.max_len, tcfg.vocab_size)
    store = None
    if cfg.features and not is_url(cfg.features):
        store = FeatureStore(cfg.features, {**features_meta(target.name, cfg.data, cfg.max_len),
                                            "num_samples": len(samples)}, tcfg.hidden_size,
                             [len(s.input_ids) for s in samples])
    train, evals = split_eval(samples, cfg, tcfg.vocab_size)
    if cfg.loop_cut:
        train, cut = cut_loops(train, cfg.loop_cut)
        if rank == 0:
            print(f"fledge train: --loop-cut {cfg.loop_cut} cut {cut['cut']} of {cut['samples']} samples; "
                  f"{cut['trained_tokens_kept']:,} of {cut['trained_tokens']:,} trained tokens kept", file=sys.stderr)
    draft = build_draft(cfg, target, rank)
    fmodel = feature_model(model)
    aux_ids = aux_layer_ids_for(model, draft.cfg.aux_layer_ids)
    if cfg.features and is_url(cfg.features):
        store = open_stream(cfg.features, target, samples, aux_ids)
    if store and tuple(store.meta["aux_layer_ids"]) != aux_ids:
        raise FledgeError(f"--features {cfg.features}: aux layers {store.meta['aux_layer_ids']}, drafter reads {list(aux_ids)}")
    if cfg.fc_norm and not draft.cfg.fc_norm:
        scales = aux_scales(fmodel, aux_ids, train[:cfg.batch_size], cfg.pad_multiple, device)
        draft.add_fc_norm(scales)
        if rank == 0:
            print(f"fledge train: --init gained fc_norm, weights at its aux states' median RMS "
                  f"{[round(x, 3) for x in scales.tolist()]}", file=sys.stderr)
    draft.lm_head.weight.requires_grad_(cfg.head != "frozen")  # set on resume too: the optimizer's groups follow it
    ttt = (BlockTrain(draft, cfg.ttt_steps, cfg.step_decay, cfg.blocks_per_sample, loss=cfg.loss)
           if cfg.method == "dflash" else TTT(draft, cfg.ttt_steps, cfg.step_decay, loss=cfg.loss,
                                              cod=(cfg.cod, cfg.cod_floor) if cfg.cod else None)).to(device)
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
        # One group for the whole draft: a step (Eagle3Draft.step) calls submodules directly, so
        # only the root's forward hook can gather parameters; a drafter's few layers gain little finer.
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
    if run.store is not None:  # a streamed store fetches this step's and the next step's features meanwhile
        for b in [batch] + ([global_batch(run, step + 1)] if step + 1 < run.total_steps else []):
            for m in range(cfg.grad_accum):
                run.store.prefetch([run.train[i].index for i in micro_batch(run, b, run.rank, m)])
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
