"""`fledge serve-sweep`: what a drafter buys as served, at each chain depth k, in one command.

The target is served plain once and kept up; then, one engine start at a time, it is served
with the drafter drafting chains of k (vLLM's eagle3, --speculative-config), health-waited,
measured interleaved with the plain server (`fledge.perf.bench.measure_interleaved`: the same
prompts, turns alternating, so a busy machine slows both alike), and stopped. The accept length
is the server's own, from its /metrics counters over its turns. Beside each row: the calibrated
prediction of `fledge tune` (fledge.perf.calibrate fitted to the plain server's points, then
predicting each k from the accept length the server reported), so the model's error is on the
table. Writes a table, and with --json / --png a JSON and a figure.

`--dry-run` prints the launch lines instead: for the engines fledge does not start (SGLang, a
remote cluster), run them there and compare a pair with `fledge bench --url SPEC --baseline-url
PLAIN`.
"""

from __future__ import annotations

import shlex
import tempfile
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from fledge.core.catalog import BUILTINS
from fledge.core.errors import FledgeError
from fledge.core.files import atomic_write_json
from fledge.core.report import print_table, save_figure, subplots
from fledge.perf import calibrate, modelspec
from fledge.perf.bench import measure_interleaved, served
from fledge.perf.launch import Serve, cpu_vllm, free_port, shell_line, start
from fledge.perf.serving import ServerBench, first_user_turns, parse_levels


def make_serves(args, target: str, ks: list[int]) -> dict[int, Serve]:
    """The server of each k (0: plain): fledge's vLLM CPU venv unless --python names another
    engine's interpreter (then the line is the engine's plain one, with --extra)."""
    name = args.served_name or Path(target).name
    extra = tuple(shlex.split(args.extra or ""))
    if args.python or args.engine != "vllm":
        base = Serve(args.engine, target, name, host=args.host, port=8000, python=args.python or "python", extra=extra)
    else:
        base = cpu_vllm(target, name, 0, args.max_model_len, args.dtype, extra=extra)
    drafter = str(Path(args.drafter).resolve()) if Path(args.drafter).exists() else args.drafter
    return {k: replace(base, drafter=drafter if k else None, k=k, port=args.port + i if args.dry_run else free_port())
            for i, k in enumerate([0, *ks])}


def predict(rows: list[dict], plain: dict[int, float], args, target: str) -> dict:
    """tune's calibrated model: fit on the plain server's ms per token at each concurrency, then
    each row's tok/s per request from its k and the accept length the server reported."""
    tgt, drf = modelspec.load_specs(target, args.drafter, args.dtype, None, None)
    graphs = args.cuda_graphs
    points = [{"k": 0, "accept_length": 1.0, "concurrency": c, "ms_per_token": 1e3 / tok_s} for c, tok_s in plain.items()]
    x = calibrate.fit(points, tgt, drf, args.gpu, 1, "nvlink", graphs, args.context)
    hw = calibrate.hardware(args.gpu, 1, "nvlink", graphs, x)
    for r in rows:
        point = {"k": r["k"], "accept_length": r["accept_length"] or 1.0, "concurrency": r["concurrency"]}
        r["predicted_tok_s"] = 1e3 / calibrate.predict_point(point, tgt, drf, hw, args.context)
        r["predicted_speedup"] = r["predicted_tok_s"] / (1e3 / calibrate.predict_point(
            {**point, "k": 0, "accept_length": 1.0}, tgt, drf, hw, args.context))
    return {"gpu": args.gpu, "cuda_graphs": graphs, "context": args.context, "constants": x, "points": points}


def sweep(args, serves: dict[int, Serve], prompts: list, levels: list[int], log_dir: Path,
          done=lambda rows, starts, failed: None) -> tuple[list[dict], dict, dict]:
    """Rows (k, concurrency) measured against the plain server, each server's start time, and the
    k whose server failed (its error, naming its log); `done(rows, starts, failed)` after each k,
    so a long sweep cut short keeps what it measured. A speculating server that dies costs its k
    only; the plain one failing ends the sweep."""
    cfg = ServerBench("", prompts, None, args.max_new_tokens, tuple(levels), args.requests or len(prompts), 3600.0,
                      args.timeout)
    rows, starts, failed, plain_server = [], {}, {}, None
    try:
        if args.plain_url:
            plain = served("plain", args.plain_url, None, args.timeout)
        else:
            plain_server = start(serves[0], log_dir / "plain.log", args.start_timeout)
            starts[0] = plain_server.start_s
            plain = served("plain", plain_server.url + "/v1", None, args.timeout)
        for k in tqdm([k for k in serves if k], desc="serve-sweep: k"):
            try:
                measure_k(k, args, serves[k], plain, cfg, levels, log_dir, rows, starts)
            except FledgeError as e:
                if plain_server is not None and plain_server.proc.poll() is not None:
                    raise
                failed[k] = str(e)
                tqdm.write(f"k = {k}: {e}")
            done(rows, starts, failed)
    finally:
        if plain_server is not None:
            plain_server.stop()
    return rows, starts, failed


def measure_k(k: int, args, serve: Serve, plain, cfg: ServerBench, levels: list[int], log_dir: Path,
              rows: list[dict], starts: dict) -> None:
    """Start the server of k, measure it against the plain one at each level (rows appended), stop it."""
    server = start(serve, log_dir / f"k{k}.log", args.start_timeout)
    starts[k] = server.start_s
    try:
        spec = served(f"k={k}", server.url + "/v1", None, args.timeout)
        for c in levels:
            p, s = measure_interleaved([plain, spec], cfg, c, max(1, min(args.rounds, cfg.requests)))
            rows.append({"k": k, "concurrency": c, "tok_s": s["per_request_tok_s"],
                         "plain_tok_s": p["per_request_tok_s"], "speedup": s["per_request_tok_s"] /
                         p["per_request_tok_s"], "accept_length": s["accept_length"], "server_k": s["k"],
                         "errors": s["errors"] + p["errors"], "speculative": s, "plain": p})
            tqdm.write(f"k = {k}, concurrency {c}: {s['per_request_tok_s']:.1f} tok/s against plain "
                       f"{p['per_request_tok_s']:.1f} ({rows[-1]['speedup']:.2f}x), accept length "
                       + (f"{s['accept_length']:.2f}" if s["accept_length"] else "not reported"))
    finally:
        server.stop()


def pooled_plain(rows: list[dict], levels: list[int]) -> dict[int, float]:
    """The plain server's tok/s per request at each level, averaged over its turns beside every k."""
    return {c: sum(mine) / len(mine) for c in levels if (mine := [r["plain_tok_s"] for r in rows if r["concurrency"] == c])}


def plot(rows: list[dict], path) -> None:
    """tok/s per request by k (measured, its interleaved plain, predicted) and the accept length."""
    fig, (a, b) = subplots(1, 2, figsize=(11, 4))
    for c in sorted({r["concurrency"] for r in rows}):
        mine = [r for r in rows if r["concurrency"] == c]
        ks = [r["k"] for r in mine]
        a.plot(ks, [r["tok_s"] for r in mine], marker="o", label=f"speculative, conc {c}")
        a.plot(ks, [r["plain_tok_s"] for r in mine], marker="x", linestyle="--", label=f"plain (interleaved), conc {c}")
        if all("predicted_tok_s" in r for r in mine):
            a.plot(ks, [r["predicted_tok_s"] for r in mine], marker="^", linestyle=":", label=f"tune, calibrated, conc {c}")
        b.plot(ks, [r["accept_length"] or float("nan") for r in mine], marker="o", label=f"conc {c}")
    a.set_xlabel("k (draft tokens per round)")
    a.set_ylabel("decode tok/s per request")
    b.set_xlabel("k (draft tokens per round)")
    b.set_ylabel("accept length (server's /metrics)")
    for ax in (a, b):
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


def table(rows: list[dict]) -> None:
    head = ["k", "conc", "tok/s", "plain tok/s", "x plain", "accept", "tune tok/s", "tune x"]
    print_table([head] + [[r["k"], r["concurrency"], f"{r['tok_s']:.1f}", f"{r['plain_tok_s']:.1f}", f"{r['speedup']:.2f}",
                           f"{r['accept_length']:.2f}" if r["accept_length"] else "-",
                           f"{r['predicted_tok_s']:.1f}" if "predicted_tok_s" in r else "-",
                           f"{r['predicted_speedup']:.2f}" if "predicted_speedup" in r else "-"] for r in rows])


def run_sweep(args) -> int:
    ks, levels = parse_levels(args.ks, "--ks"), parse_levels(args.concurrency, "--concurrency")
    if args.engine != "vllm" and not args.dry_run:
        raise FledgeError(f"--engine {args.engine}: fledge starts vLLM only; --dry-run prints the {args.engine} lines")
    target = args.target
    if target in BUILTINS and not Path(target).exists():
        from fledge.core.target import resolve_target
        target = str(resolve_target(target))
    serves = make_serves(args, target, ks)
    if args.dry_run:
        for k, s in serves.items():
            print(f"# {'plain' if k == 0 else f'k = {k}'}\n{shell_line(s)}")
        print("# measure a plain and a speculating server, interleaved, with the accept length: "
              "fledge bench --url http://SPEC:PORT/v1 --baseline-url http://PLAIN:PORT/v1 --concurrency 1")
        return 0
    if not Path(args.drafter).is_dir():
        raise FledgeError(f"{args.drafter}: no such drafter directory")
    prompts = first_user_turns(args.prompt_file, args.num_prompts)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="fledge-serve-sweep."))
    log_dir.mkdir(parents=True, exist_ok=True)

    def report(rows: list[dict], starts: dict, failed: dict, fit: dict | None = None, complete: bool = False) -> dict:
        out = {"engine": args.engine, "target": args.target, "drafter": args.drafter, "ks": ks, "concurrency": levels,
               "prompt_source": args.prompt_file or "mtbench", "prompts": len(prompts), "max_tokens": args.max_new_tokens,
               "requests": args.requests or len(prompts), "rounds": args.rounds, "complete": complete,
               "lines": {k: shell_line(s) for k, s in serves.items()}, "server_start_s": starts, "failed": failed,
               "plain_tok_s": pooled_plain(rows, levels), "rows": rows, "calibration": fit}
        if args.json:
            atomic_write_json(args.json, out)
        return out

    rows, starts, failed = sweep(args, serves, prompts, levels, log_dir, report)
    plain = pooled_plain(rows, levels)
    fit = predict(rows, plain, args, target) if args.gpu and Path(target).is_dir() and rows else None
    report(rows, starts, failed, fit, complete=True)
    table(rows)
    print("plain decoding, pooled over its interleaved turns: " + ", ".join(f"{v:.1f} tok/s at concurrency {c}"
                                                                              for c, v in plain.items())
          + f"; accept length from the server's /metrics; vLLM logs in {log_dir}")
    if args.png and rows:
        plot(rows, args.png)
    return 1 if failed else 0
