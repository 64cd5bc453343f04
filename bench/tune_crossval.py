"""Leave-one-source-out cross-validation of `fledge tune`'s serving model on the corpus of
published measurements.

    python bench/tune_crossval.py [--corpus bench/published] [--margin 0]

For each engine family (vLLM, SGLang, TensorRT-LLM) and each source in it, the family's
constants (fledge.perf.servemodel) are fitted without that source and its rows predicted, each
with its own accept length; each row's range comes from the other sources' residuals. Prints the
table (row, predicted, measured, error, range, verdict) and the summary; writes
bench/results/tune_crossval_cpu.json, and the constants fitted on every row with the residuals
(what `fledge tune` reads for its ranges) to fledge/perf/servemodel_fit.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from machine import git_commit

from fledge.core.files import atomic_write_json
from fledge.core.report import print_table
from fledge.perf import corpus
from fledge.perf import servemodel as S

ROOT = Path(__file__).resolve().parents[1]


def _pct(x) -> str:
    return "–" if x is None else f"{x:.1f}%"


def _signed(x) -> str:
    return "    –  " if x is None else f"{x:+6.1f}%"


def _shown(folder: Path) -> str:
    folder = folder.resolve()
    return str(folder.relative_to(ROOT)) if folder.is_relative_to(ROOT) else str(folder)


FAMILIES = {"vllm": "vLLM", "sglang": "SGLang", "trtllm": "TensorRT-LLM"}


def docs_table(summary: dict) -> str:
    """The summary as docs/tune.md shows it (copied from this, never typed)."""
    lines = [("| | speed-up rows (sources) | speed-up mean \\|error\\| | plain tok/s rows | plain tok/s mean \\|error\\| "
              f"| verdicts right | measured inside its range (nominal {summary['range_nominal_percent']:.0f}%) |"),
             "|---|---|---|---|---|---|---|",
             (f"| all | {summary['rows']} ({summary['sources']}) | {_pct(summary['speedup_mean_abs_error_percent'])} (max "
             f"{_pct(summary['speedup_max_abs_error_percent'])}) | {summary['plain_rows']} | "
             f"{_pct(summary['plain_mean_abs_error_percent'])} | {summary['verdicts_right']} of {summary['rows']} "
             f"({summary['too_close_to_call']} too close to call) | {_pct(summary['range_coverage_percent'])} |")]
    for fam, f in sorted(summary["per_family"].items(), key=lambda kv: list(FAMILIES).index(kv[0])):
        lines.append(f"| {FAMILIES.get(fam, fam)} | {f['rows']} ({f['sources']}) | {_pct(f['speedup_mean_abs_error_percent'])} "
                     f"| {f['plain_rows']} | {_pct(f['plain_mean_abs_error_percent'])} | {f['verdicts_right']} of "
                     f"{f['rows']} | {_pct(f['range_coverage_percent'])} |")
    return "\n".join(lines)


def _extra_ms(r: dict, accept: float) -> dict:
    """What a round costs beyond a plain step, in ms, as predicted and as the row's own figures
    imply (round = accept x plain / speed-up): where a source's error sits in the draft and
    verify costs rather than in the plain step."""
    def extra(plain, speedup):
        return accept * plain / speedup - plain

    pred = extra(r["plain_ms_predicted"], r["speedup_predicted"])
    meas = extra(r["plain_ms_measured"], r["speedup_measured"]) if r["plain_ms_measured"] else None
    return {"extra_ms_predicted": pred, "extra_ms_measured": meas}


def per_source(table: list[dict]) -> dict:
    """Each source's signed errors: speed-up, plain step, and a round's extra cost over a step."""
    out = {}
    for src in sorted({t["source"] for t in table}):
        mine = [t for t in table if t["source"] == src]
        plain = [t["plain_ms_predicted"] / t["plain_ms_measured"] - 1 for t in mine if t["plain_ms_measured"]]
        extra = [t["extra_ms_predicted"] / t["extra_ms_measured"] - 1 for t in mine
                 if t["extra_ms_measured"] and t["extra_ms_measured"] > 0]
        out[src] = {"family": mine[0]["family"], "rows": len(mine),
                    "speedup_mean_error_percent": 100 * statistics.mean(t["error_percent"] / 100 for t in mine),
                    "plain_mean_error_percent": 100 * statistics.mean(plain) if plain else None,
                    "extra_mean_error_percent": 100 * statistics.mean(extra) if extra else None}
    return out


def run(folder: Path, margin: float) -> dict:
    rows = corpus.load_rows(folder)
    cs, skipped = corpus.cases(rows)
    cv = corpus.crossval(cs, margin)
    table = []
    for r in cv["rows"]:
        c = r["case"]
        table.append({"source": r["source"], "file": c.row.get("_file"), "family": r["family"],
                      "target": c.row.get("target"), "gpu": c.row.get("gpu"), "tp": c.deployment.tp,
                      "batch": c.load.batch, "shape": c.shape.label, "accept_length": c.accept_length,
                      "speedup_predicted": r["speedup_predicted"], "speedup_measured": r["speedup_measured"],
                      "error_percent": 100 * (r["speedup_predicted"] / r["speedup_measured"] - 1),
                      "explainable": r["explainable"], "low": r["low"], "high": r["high"], "verdict": r["verdict"], "verdict_right": r["verdict_right"],
                      "plain_ms_predicted": r["plain_ms_predicted"], "plain_ms_measured": r["plain_ms_measured"],
                      **_extra_ms(r, c.accept_length)})
    commit, corpus_commit = git_commit(ROOT), git_commit(folder)
    return {"machine": "this CPU (the fit and the cross-validation; the measurements are the sources')",
            "commit": commit, "corpus": _shown(folder), "corpus_commit": corpus_commit, "margin": margin, "rows_read": len(rows),
            "skipped": [{"source": r.get("source"), "target": r.get("target"), "why": why} for r, why in skipped],
            "table": table, "plain_table": [{"source": r["source"], "family": r["family"],
                                             "target": r["case"].row.get("target"), "gpu": r["case"].row.get("gpu"),
                                             "batch": r["case"].load.batch, "plain_ms_predicted": r["plain_ms_predicted"],
                                             "plain_ms_measured": r["plain_ms_measured"]} for r in cv["plain_rows"]], "summary": cv["summary"], "summary_explainable": cv["summary_explainable"],
            "per_source": per_source(table), "constants": cv["constants"],
            "residuals": cv["residuals"], "coverage": S.COVERAGE}


def show(report: dict) -> None:
    head = ["source", "target", "engine", "gpu", "tp", "batch", "shape", "accept", "pred", "meas", "error", "range",
            "verdict", "right"]
    body = [[t["source"][:22], str(t["target"])[:20], t["family"], str(t["gpu"])[:12], t["tp"], t["batch"], t["shape"],
             f"{t['accept_length']:.2f}", f"{t['speedup_predicted']:.2f}x", f"{t['speedup_measured']:.2f}x",
             f"{t['error_percent']:+.1f}%", f"{t['low']:.2f}-{t['high']:.2f}", t["verdict"],
             ("yes" if t["verdict_right"] else "NO") + ("" if t["explainable"] else " *")] for t in report["table"]]
    print_table([head] + body)
    for title, s in (("every row", report["summary"]),
                     (("rows the model can explain (* above: measured speed-up above the accept length, which no "
                       "round can give; left out of the fit)"), report["summary_explainable"])):
        print(f"\n{title}: {s['rows']} rows from {s['sources']} sources, leave-one-source-out")
        print(f"  speed-up mean |error| {_pct(s['speedup_mean_abs_error_percent'])}, max "
              f"{_pct(s['speedup_max_abs_error_percent'])}; plain tok/s mean |error| "
              f"{_pct(s['plain_mean_abs_error_percent'])} over {s['plain_rows']} rows of {s['plain_sources']} sources "
              "(rows without an accept length included)")
        print(f"  verdicts right {s['verdicts_right']}/{s['rows']} ({s['too_close_to_call']} too close to call); best "
              f"shape right in {s['best_shape_right']}/{s['best_shape_groups']} settings with several shapes; "
              f"measured inside its range {_pct(s['range_coverage_percent'])} "
              f"(nominal {s['range_nominal_percent']:.0f}%)")
        for fam, f in s["per_family"].items():
            print(f"  {fam:<7} {f['rows']:>3} rows, {f['sources']:>2} sources: speed-up "
                  f"{_pct(f['speedup_mean_abs_error_percent'])}, plain {_pct(f['plain_mean_abs_error_percent'])} "
                  f"({f['plain_rows']} rows), "
                  f"verdicts right {f['verdicts_right']}/{f['rows']}")
    print("\nper source, mean signed error (predicted / measured - 1): speed-up, plain step, a round's extra cost "
          "over a plain step")
    for src, e in report["per_source"].items():
        print(f"  {src:<30} {e['family']:<7} {e['rows']:>3} rows  speed-up {e['speedup_mean_error_percent']:+6.1f}%  "
              f"plain {_signed(e['plain_mean_error_percent'])}  extra {_signed(e['extra_mean_error_percent'])}")
    print("\nfor docs/tune.md:\n" + docs_table(report["summary"]) + "\n")
    print(f"{report['rows_read']} rows read, {len(report['skipped'])} skipped")
    for fam, c in report["constants"].items():
        print(f"  {fam} constants: " + ", ".join(f"{k} {v:.3g}" for k, v in c.items()))
    whys = {}
    for sk in report["skipped"]:
        whys[sk["why"]] = whys.get(sk["why"], 0) + 1
    for why, n in sorted(whys.items(), key=lambda x: -x[1]):
        print(f"  skipped {n}: {why}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, default=ROOT / "bench" / "published")
    ap.add_argument("--margin", type=float, default=0.0, help="a verdict 'pays' needs the range above 1 + margin")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "tune_crossval_cpu.json")
    ap.add_argument("--fit-out", type=Path, default=ROOT / "fledge" / "perf" / "servemodel_fit.json",
                    help="the constants and residuals `fledge tune` reads")
    args = ap.parse_args(argv)
    report = run(args.corpus, args.margin)
    show(report)
    atomic_write_json(args.out, report)
    atomic_write_json(args.fit_out, {"kind": "fledge servemodel fit", "commit": report["commit"],
                                     "rows": report["summary"]["rows"], "sources": report["summary"]["sources"],
                                     "constants": report["constants"], "residuals": report["residuals"],
                                     "summary": {k: v for k, v in report["summary"].items()}})
    print(f"wrote {args.out} and {args.fit_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
