"""`fledge train`: EAGLE-3 training-time test (TTT), single process or torchrun (DDP / FSDP2).

The run in four parts: `ttt` (the unrolled forward and its loss), `run` (data order, the run's
state and one optimizer step), `resume` (the resume state saved every few steps and on a pause)
and `budget` (planning the step count for `--time-budget`). This module is the loop over them,
its logging, and the export of the finished drafter.

SIGINT or SIGTERM pauses a run after its current optimizer step, checkpoint saved (exit 130);
the same command resumes it exactly, as it resumes one killed outright from its last save.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from fledge.core.config import TrainConfig, from_args
from fledge.core.errors import FledgeError
from fledge.core.files import atomic_write_text, keeping, output_lock, read_jsonl
from fledge.core.report import print_table, save_figure, subplots
from fledge.drafter.checkpoint import export_checkpoint
from fledge.drafter.dflash import DFlashDraft
from fledge.drafter.dflash_checkpoint import export_dflash
from fledge.drafter.eagle3 import Eagle3Draft
from fledge.train.budget import plan_budget
from fledge.train.resume import (
    Paused,
    checkpoint_meta,
    full_state,
    load_checkpoint_state,
    pause_on_signal,
    resume_key,
    save_checkpoint,
)
from fledge.train.run import Run, any_rank, evaluate, setup, start_schedule, train_step
from fledge.train.ttt import summarize


def export(run: Run) -> Path:
    """Write the served checkpoint (rank 0) from the full state: works sharded or not."""
    model_sd, _ = full_state(run)
    out = Path(run.cfg.out) / "draft"
    if run.rank == 0:
        dflash = run.cfg.method == "dflash"
        draft = (DFlashDraft if dflash else Eagle3Draft)(run.ttt.draft.cfg)
        draft.load_state_dict({k.removeprefix("draft."): v for k, v in model_sd.items()})
        if dflash:
            export_dflash(draft, out, verifier=run.verifier, overwrite=True)
        else:
            export_checkpoint(draft, out, layout="eagle3", verifier=run.verifier, overwrite=True)
    return out


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
    from fledge.core.target import load_target
    cfg = from_args(TrainConfig, args)
    begun = time.monotonic()  # a time budget counts the target's loading too
    rank0 = int(os.environ.get("RANK", 0)) == 0
    try:
        with (output_lock(cfg.out) if rank0 else contextlib.nullcontext(),  # one run per --out (rank 0 writes it)
              keeping(cfg.out, "the last checkpoint is kept: rerun the same command to resume", own_name=True)):
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
