"""Inputs of `fledge tune model` and `what-if` from the CLI: a CPU server's defaults, the roofline
hardware (a table entry, a `tune calibrate` profile, overrides), and the serving model's timings
at any batch (fledge.perf.servemodel under one engine family's fitted constants)."""

from __future__ import annotations

from fledge.core.errors import FledgeError
from fledge.core.shape import Shape
from fledge.perf import hwmodel, servemodel
from fledge.perf.calibrate import load_profile
from fledge.perf.hwmodel import Timings


def cpu_defaults(args) -> None:
    """A CPU server's sane defaults: short contexts, no CUDA graphs, fp32 (args changed in place
    where the user left them unset)."""
    on_cpu = args.gpu == "cpu"
    args.context = args.context if args.context is not None else 256 if on_cpu else 2048
    args.no_cuda_graphs = args.no_cuda_graphs or on_cpu
    if on_cpu and not args.dtype:
        args.dtype = "fp32"


def machine(args, profile: str | None = None, overrides: dict | None = None) -> tuple[hwmodel.Hardware, str]:
    """The roofline Hardware from `profile` (a `tune calibrate` output), then the device named
    by --gpu/--tp/--interconnect and `overrides` (hwmodel.hardware's keyword names; None: unset)."""
    base = load_profile(profile, "--hardware-profile")["hardware"] if profile else {}
    gpu = args.gpu or base.get("gpu")
    if not gpu:
        raise FledgeError(f"--model needs --gpu NAME (one of {', '.join(hwmodel.GPUS)}) or --hardware-profile FILE")
    over = {**base.get("overrides", {}), **{k: v for k, v in (overrides or {}).items() if v is not None}}
    tp, link = args.tp or base.get("tp", 1), args.interconnect or base.get("interconnect", "nvlink")
    hw = hwmodel.hardware(gpu, tp, link, cuda_graphs=not args.no_cuda_graphs and base.get("cuda_graphs", True), **over)
    label = f"{tp} x {gpu}" + (f" over {link}" if tp > 1 else "") + (f", calibrated by {profile}" if profile else "")
    return hw, label


def served_timings(target, drafter, args, fit: servemodel.Fitted):
    """`timings_at(batch)` of the serving model (fledge.perf.servemodel) under `fit`'s constants."""
    if args.gpu not in hwmodel.GPUS:
        raise FledgeError(f"--gpu {args.gpu!r}: unknown; pass one of {', '.join(hwmodel.GPUS)}")
    tp = args.tp or 1
    d = servemodel.Deployment(target, drafter, hwmodel.GPUS[args.gpu], tp, hwmodel.LINKS[args.interconnect or "nvlink"],
                              fit.engine, cuda_graphs=not args.no_cuda_graphs)
    c, ctx = fit.constants, args.context

    def timings_at(batch: int) -> Timings:
        draft = {k: c["draft_fixed"] + servemodel.forward_ms(drafter, d, c, k, batch, ctx) for k in TOPKS}
        verify = {n: servemodel.forward_ms(target, d, c, n, batch, ctx) for n in hwmodel.VERIFY_SIZES}
        return Timings(servemodel.plain_ms(d, c, batch, ctx) - servemodel.token_host_ms(c, batch), verify, draft,
                       c["step"] + c["round_extra"], batch,
                       servemodel.prefill_ms(d, c, ctx) if args.output_len else 0.0, args.output_len or 0,
                       servemodel.draft_forwards(fit.engine, Shape(1, 1, 2)) - 1,
                       c["tree_host"] if fit.engine == "sglang" else 0.0, servemodel.token_host_ms(c, batch))
    return timings_at


TOPKS = (1, 2, 4, 8)
