"""The arguments of the measuring subcommands: `bench`, `serve-sweep` and `tune` with its modes.
Torch-free like fledge.cli_args, whose `handler` names each one's step module."""

from __future__ import annotations

import argparse

from fledge.cli_args import add_chat_template, handler
from fledge.cli_checks import (
    fraction,
    nonneg_float,
    number,
    positive_float,
    positive_int,
)


def add_bench(sub) -> None:
    p = sub.add_parser("bench", help="measure spec decoding: a server (--url), a serving log (--log), or the engine")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--url", help="OpenAI-compatible server, e.g. http://127.0.0.1:30000/v1")
    src.add_argument("--log", help="SGLang or vLLM server log to summarise")
    src.add_argument("--target", help="engine: target (built-in name, GGUF, HF dir)")
    p.add_argument("--drafter", help="engine: EAGLE-3 or DFlash checkpoint directory")
    p.add_argument("--shapes", help="engine: STEPS,TOPK,TOKENS;... to run (default: 3,1,4;7,1,8;5,4,16 for EAGLE-3; "
                                    "for DFlash chains K,1,K+1 of the longest its block allows, 3/4 and 1/2 of it; "
                                    "for P-EAGLE chains of 7, 5 and 3)")
    p.add_argument("--probe", action="store_true", help="engine: also measure acceptance by depth and rank (for tune)")
    p.add_argument("--probe-steps", type=positive_int, default=6)
    p.add_argument("--probe-topk", type=positive_int, default=4)
    p.add_argument("--prompts", help="engine: conversations file or built-in set (default mtbench)")
    p.add_argument("--num-prompts", type=positive_int, default=10)
    p.add_argument("--prompt-file", help="server: conversations (a file `fledge prep` writes, any format it reads, or "
                                         "a built-in set); the first user turn of --num-prompts of them")
    p.add_argument("--model", help="server: model name (default: the first the server lists)")
    p.add_argument("--baseline-url", help="server: a plain (non-speculating) server of the same target, measured "
                                          "interleaved with --url; the table gives the ratio")
    p.add_argument("--rounds", type=int, default=4, help="server, with --baseline-url: turns each level's requests "
                                                         "are cut into, the servers alternating")
    p.add_argument("--baseline-log", help="log, with --log: a plain server's log; the ratio of generation throughput")
    p.add_argument("--concurrency", default="1,4,16", help="server: comma-separated levels")
    p.add_argument("--requests", type=positive_int, default=16, help="server: requests per level")
    p.add_argument("--duration", type=positive_float, default=120.0, help="server: seconds per level, at most")
    p.add_argument("--timeout", type=positive_float, default=120.0, help="server: seconds per request")
    p.add_argument("--max-new-tokens", type=positive_int, default=256)
    p.add_argument("--device")
    p.add_argument("--dtype")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--png", help="plot here: engine, acceptance by depth and tok/s by shape; server, tok/s by "
                                 "concurrency per server")
    add_chat_template(p)
    p.set_defaults(func=handler("fledge.perf.bench:run_bench"))


def add_serve_sweep(sub) -> None:
    p = sub.add_parser("serve-sweep", help="serve the target plain and with the drafter at each k; measure interleaved",
                       description="Starts vLLM plain (kept up) and with the drafter drafting chains of each k, one "
                       "server at a time; measures each against the plain one interleaved; reads the accept length "
                       "from the server's /metrics; prints a table with tune's calibrated prediction beside each row. "
                       "--dry-run prints the launch lines (SGLang, remote clusters: run them yourself).")
    p.add_argument("--target", required=True, help="the served model: HF directory, hub id, or a built-in name")
    p.add_argument("--drafter", required=True, help="EAGLE-3 drafter directory")
    p.add_argument("--ks", default="1,2,3,4,5", help="chain depths (num_speculative_tokens) to serve")
    p.add_argument("--engine", choices=["vllm", "sglang"], default="vllm", help="sglang: --dry-run only")
    p.add_argument("--python", help="the engine's python (default: fledge's vLLM CPU venv, scripts/setup_vllm.sh)")
    p.add_argument("--extra", help="more engine arguments, quoted: \"--tensor-parallel-size 8\"")
    p.add_argument("--served-name", help="served model name (default: the target directory's name)")
    p.add_argument("--host", default="127.0.0.1", help="--dry-run lines: the host to bind")
    p.add_argument("--port", type=int, default=8000, help="--dry-run lines: the first port (each line the next)")
    p.add_argument("--max-model-len", type=int, default=1024, help="CPU venv: vLLM's --max-model-len")
    p.add_argument("--dtype", default="float32", help="CPU venv: served dtype (also the prediction's)")
    p.add_argument("--plain-url", help="a plain server already up (its /v1 URL) instead of starting one")
    p.add_argument("--prompt-file", help="conversations (`fledge prep` output, any format it reads, or a built-in set; "
                                         "default mtbench): the first user turn of --num-prompts of them")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--requests", type=int, help="requests per server and level (default: one per prompt)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--concurrency", default="1", help="comma-separated levels")
    p.add_argument("--rounds", type=int, default=4, help="turns each level's requests are cut into, servers alternating")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds a server may take to answer /health")
    p.add_argument("--gpu", default="cpu", help="hardware table entry tune calibrates from (empty: no prediction)")
    p.add_argument("--cuda-graphs", action="store_true", help="the prediction assumes CUDA graphs (off on the CPU)")
    p.add_argument("--context", type=int, default=256, help="the prediction's context length (prompt + half the answer)")
    p.add_argument("--log-dir", help="vLLM's logs (default: a new temporary directory)")
    p.add_argument("--dry-run", action="store_true", help="print the launch lines and exit")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--png", help="plot tok/s and accept length by k here")
    p.set_defaults(func=handler("fledge.perf.sweep:run_sweep"))


class Moved(argparse.Action):
    """An old spelling of a tune option or mode: one line naming the new one, exit 2."""

    def __init__(self, option_strings, dest, new: str, nargs=0, **kw):
        super().__init__(option_strings, dest, nargs=nargs, help=f"old spelling: now {new}", **kw)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        parser.exit(2, f"fledge: error: tune {option_string} is now {self.new}\n")


def _moved(p, flags: dict) -> None:
    for flag, (new, nargs) in flags.items():
        p.add_argument(flag, action=Moved, new=new, nargs=nargs)


def _tune_acceptance(p) -> None:
    p.add_argument("--accept-length", type=number(float, 1), help="measured accept length (SGLang's, bonus incl.); see --accept-shape")
    p.add_argument("--accept-shape", help="STEPS,TOPK,TOKENS the --accept-length was measured at (default: a chain of "
                                          "--accept-steps)")
    p.add_argument("--accept-steps", type=positive_int, default=3, help="chain length --accept-length was measured at")
    p.add_argument("--accept-profile", help="per-depth acceptance, ranks by '/': '0.7/0.1,0.6/0.12,0.5'")
    p.add_argument("--accept-json", help="acceptance profile from `fledge bench --json` (engine --probe, a vLLM --log) "
                                         "or `tune calibrate --out`")


def _tune_common(p) -> None:
    p.add_argument("--max-depth", type=number(int, 1, 64), default=8, help="deepest speculation (draft steps) to consider (engine "
                                                            "mode: also the probe's depth)")
    p.add_argument("--batch", type=positive_int, default=1, help="batch size the timings are for")
    p.add_argument("--margin", type=nonneg_float, default=0.05, help="a shape pays only above this fractional gain")
    p.add_argument("--json", help="write the predictions here")
    p.add_argument("--png", help="plot speed-up by shape (and by concurrency) here")
    _moved(p, {"--max-steps": ("--max-depth", 1), "--profile-json": ("--accept-json", 1),
               "--profile": ("--hardware-profile", 1)})


def _tune_models(p, need_model: bool) -> None:
    p.add_argument("--model", required=need_model, help="target config: a config.json, a model directory, or a built-in")
    p.add_argument("--drafter", help="drafter directory or config.json (default: one target-shaped EAGLE-3 layer); "
                                     "printed in the vLLM flags")
    p.add_argument("--dtype", help="activations and unquantised weights: bf16 (default), fp16, fp32")
    p.add_argument("--quant", choices=["bf16", "fp16", "fp8", "int4", "fp32"], help="MLP/expert weights (default: from "
                                                                                     "the config)")
    p.add_argument("--draft-vocab", type=positive_int, help="drafter LM head rows (default: its config, else 32000)")


def _tune_machine(p) -> None:
    from fledge.perf.hwmodel import GPUS  # torch-free, as this module must stay
    from fledge.perf.servemodel import FAMILIES

    p.add_argument("--gpu", help=f"closest device in the table: {', '.join(GPUS)}")
    p.add_argument("--tp", type=positive_int, help="tensor-parallel GPUs (default 1)")
    p.add_argument("--interconnect", choices=["pcie", "nvlink"], help="link between the TP GPUs (default nvlink)")
    p.add_argument("--engine", choices=FAMILIES, help="the engine you serve with: its fitted constants, and the "
                                                          "verdict leads with what it can run (vLLM: chains)")
    p.add_argument("--context", type=positive_int, help="tokens in each sequence's KV cache (default 2048; 256 on --gpu cpu)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="the server runs without CUDA graphs (default on "
                                                                 "--gpu cpu)")


def add_tune(sub) -> None:
    p = sub.add_parser("tune", help="will speculation pay, with which flags: predict tok/s per shape",
                       description="Modes: `model` (configs + hardware + engine: fitted on published measurements, "
                       "every prediction with its range), `calibrate` (your plain server measured: predict the "
                       "speculating one), `engine` (measure fledge's engine), `what-if` (your own timings).")
    _moved(p, {"--what-if": ("`fledge tune what-if`", 0), "--model": ("`fledge tune model --model ...`", 1),
               "--target": ("`fledge tune engine --target ...`", 1)})
    modes = p.add_subparsers(dest="mode", required=True, metavar="{model,calibrate,engine,what-if}")

    m = modes.add_parser("model", help="predict from the configs, the hardware and the engine (no GPU)")
    _tune_models(m, True)
    _tune_machine(m)
    _tune_acceptance(m)
    _tune_common(m)
    m.add_argument("--output-len", type=positive_int, help="new tokens a request generates: rates of whole requests, their "
                                                  "prefill included, as serving benchmarks count them")
    m.add_argument("--concurrency", default="1,2,4,8,16,32,64,128,256", help="levels of the speed-up-by-concurrency sweep")
    m.add_argument("--hardware-profile", help="a `tune calibrate --out` profile: the model calibrated on your server")
    for flag, typ, h in [("--hbm-gbs", positive_float, "memory bandwidth, GB/s"),
                         ("--tflops", positive_float, "peak dense TFLOP/s of the math dtype"),
                         ("--allreduce-us", nonneg_float, "all-reduce latency, us"),
                         ("--allreduce-gbs", positive_float, "all-reduce bus bandwidth, GB/s"),
                         ("--host-ms", nonneg_float, "host time per serving step, ms"),
                         ("--bw-efficiency", fraction, "fraction of peak bandwidth reached"),
                         ("--flops-efficiency", fraction, "fraction of peak FLOP/s reached")]:
        m.add_argument(flag, type=typ, help=f"override: {h}")
    m.set_defaults(func=handler("fledge.perf.tune:run_model"))

    c = modes.add_parser("calibrate", help="measure your plain server (and any speculating one); predict speculation")
    c.add_argument("--url", action="append", required=True, help="OpenAI-compatible server (repeat for several)")
    c.add_argument("--metrics-url", action="append", help="its Prometheus /metrics (default: URL's host + /metrics)")
    _tune_models(c, False)
    _tune_machine(c)
    c.add_argument("--levels", help="concurrency levels to measure (default 1,2,4,...,256; 1,2,4 on --gpu cpu)")
    c.add_argument("--requests", type=positive_int, default=4, help="requests per level (at least the level's concurrency)")
    c.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens each request generates")
    c.add_argument("--predict-ks", default="1,2,3,4,5", help="chains to predict from the measured plain server")
    _tune_acceptance(c)
    c.add_argument("--out", help="profile JSON to write (default fledge-profile.json)")
    c.add_argument("--merge", help="an earlier profile whose points join this fit (servers measured one at a time)")
    c.set_defaults(func=handler("fledge.perf.calibrate:cmd_calibrate"))

    e = modes.add_parser("engine", help="measure fledge's own engine, predict every shape, optionally run them")
    e.add_argument("--target", required=True, help="target (built-in name, GGUF, HF dir)")
    e.add_argument("--drafter", required=True, help="drafter checkpoint")
    e.add_argument("--device", help="default cuda if available, else cpu")
    e.add_argument("--dtype", help="default bfloat16 on cuda, float32 on cpu")
    e.add_argument("--prompts", help="conversations JSONL for the acceptance probe (default: built-in prompts)")
    e.add_argument("--num-prompts", type=positive_int, default=8)
    e.add_argument("--max-new-tokens", type=positive_int, default=128)
    e.add_argument("--probe-topk", type=positive_int, default=4, help="topk of the full tree the rank probe drafts")
    e.add_argument("--accept-json", help="an acceptance profile instead of the probe")
    e.add_argument("--validate", action="store_true", help="also run >= 8 shapes for real: predicted vs measured")
    e.add_argument("--shapes", help="with --validate: STEPS,TOPK,TOKENS;... to run (default: 8 picked from the ranking)")
    _tune_common(e)
    e.set_defaults(func=handler("fledge.perf.tune_engine:run_engine"))

    w = modes.add_parser("what-if", help="your own timings and acceptance (no GPU)")
    w.add_argument("--ar-ms", type=positive_float, required=True, help="plain decoding: ms per step")
    w.add_argument("--verify-ms", required=True, help="target forward ms by tokens verified per request, e.g. "
                                                      "'1:11.6,8:30,16:34'")
    w.add_argument("--draft-ms", help="ms per draft step, one number or by topk '1:1.2,4:1.6' (absent: predicted from "
                                      "--model and --gpu)")
    w.add_argument("--overhead-ms", type=nonneg_float, default=0.0, help="per-round extra (sampling, KV moves, host)")
    _tune_models(w, False)
    _tune_machine(w)
    _tune_acceptance(w)
    _tune_common(w)
    w.set_defaults(func=handler("fledge.perf.tune:run_what_if"))
