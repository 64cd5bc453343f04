"""Training scale-out: per-GPU throughput and loss agreement of DDP / FSDP2 runs against one GPU.

    python bench/bench_scale.py RUN_1GPU RUN_DDP RUN_FSDP --ranks N [--png scale.png]

Each RUN is a `fledge train --out` directory of the same data, steps and GLOBAL batch (`torchrun
--nproc-per-node N ... --parallel ddp` / `fsdp`). Throughput: the mean logged `target_tok_s`
after the first --skip windows (start-up, warm-up); efficiency = (tok/s on N GPUs / N) / (tok/s
on 1). Loss agreement: the largest relative difference of the objective at the same steps (bf16
and another reduction order make it small, not zero).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from machine import machine_name, result_path

from fledge.core.errors import FledgeError
from fledge.core.files import atomic_write_json, read_jsonl
from fledge.core.report import save_figure, subplots


def load_run(path: Path) -> list[dict]:
    rows = [r for _, r in read_jsonl(path / "metrics.jsonl") if r["kind"] == "train"]
    if not rows:
        raise FledgeError(f"{path / 'metrics.jsonl'}: no train records")
    return rows


def summarize(runs: dict[str, list[dict]], ranks: dict[str, int], skip: int) -> dict:
    base_name = next(iter(runs))
    base = {r["step"]: r["objective"] for r in runs[base_name]}
    out = {}
    for name, rows in runs.items():
        timed = rows[skip:] or rows[-1:]
        tok_s = statistics.mean(r["target_tok_s"] for r in timed)
        diffs = [abs(r["objective"] - base[r["step"]]) / abs(base[r["step"]]) for r in rows if r["step"] in base]
        out[name] = {"ranks": ranks[name], "tok_s": tok_s, "tok_s_per_gpu": tok_s / ranks[name],
                     "windows_timed": len(timed), "final_objective": rows[-1]["objective"],
                     "max_rel_loss_diff_vs_1gpu": max(diffs) if diffs else None}
    one = out[base_name]["tok_s_per_gpu"]
    for row in out.values():
        row["scaling_efficiency"] = row["tok_s_per_gpu"] / one
    return out


def plot(runs: dict[str, list[dict]], summary: dict, path: str) -> None:
    fig, (a, b) = subplots(1, 2, figsize=(11, 4))
    for name, rows in runs.items():
        a.plot([r["step"] for r in rows], [r["objective"] for r in rows], "o-", ms=3, label=name)
    a.set(title="training objective (same global batch)", xlabel="optimizer step")
    a.legend()
    b.bar(list(summary), [r["tok_s_per_gpu"] for r in summary.values()])
    b.set(title="target tokens/s per GPU")
    save_figure(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="the 1-GPU run first, then the multi-GPU runs")
    p.add_argument("--ranks", type=int, required=True, help="GPUs of every run after the first")
    p.add_argument("--skip", type=int, default=2, help="first log windows left out of the throughput")
    p.add_argument("--out", help="JSON path (default bench/results/scale_<machine>x<ranks>.json)")
    p.add_argument("--png")
    args = p.parse_args(argv)
    try:
        runs = {path.name: load_run(path) for path in args.runs}
    except (FledgeError, OSError) as e:
        print(f"bench_scale: error: {e}", file=sys.stderr)
        return 2
    ranks = {name: 1 if i == 0 else args.ranks for i, name in enumerate(runs)}
    summary = summarize(runs, ranks, args.skip)
    print(f"{'run':>8} {'GPUs':>4} {'tok/s':>10} {'tok/s/GPU':>10} {'efficiency':>10} {'max loss diff':>13}")
    for name, r in summary.items():
        diff = "-" if r["max_rel_loss_diff_vs_1gpu"] is None else f"{100 * r['max_rel_loss_diff_vs_1gpu']:.2f}%"
        print(f"{name:>8} {r['ranks']:>4} {r['tok_s']:>10.0f} {r['tok_s_per_gpu']:>10.0f} "
              f"{100 * r['scaling_efficiency']:>9.1f}% {diff:>13}")
    # The runs were made on this machine's GPUs, where this script runs after them.
    out = args.out or result_path("scale", machine_name("cuda" if torch.cuda.is_available() else "cpu", args.ranks))
    atomic_write_json(out, {"skip_windows": args.skip, "runs": summary})
    print(f"wrote {out}")
    if args.png:
        plot(runs, summary, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
