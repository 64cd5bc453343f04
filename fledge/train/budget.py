"""Planning a run's step count to fit `fledge train --time-budget SECONDS`.

The budget plans the step count instead of `--max-steps`. On CUDA the first batch
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

import itertools
import math
import random
from bisect import bisect_left, bisect_right

import torch

from fledge.core.errors import FledgeError
from fledge.train.features import padded_length
from fledge.train.run import (
    Run,
    accumulate,
    evaluate,
    global_batch,
    micro_batch,
    rank_max,
)

# Exit code of a run paused by its time budget: "try again later" (BSD sysexits' EX_TEMPFAIL).
EXIT_BUDGET = 75



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
