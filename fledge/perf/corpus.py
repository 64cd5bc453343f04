"""Published measurements as cases of fledge.perf.servemodel: reading the corpus (one JSON list of
row records per source), fitting each engine family's constants, and leave-one-source-out
cross-validation.

A row (keys of the corpus): source, url, quote, target, arch {family, params_b, active_params_b,
layers, hidden, heads, kv_heads, head_dim, vocab, moe {experts, active, expert_intermediate} or
null, attention (mha, gqa, mla)}, quant, gpu, gpu_count, tp, ep,
interconnect, engine, engine_version, cuda_graphs, batch, batch_kind, input_len, output_len,
method, shape {num_steps, topk, num_draft_tokens}, accept_length, plain_tok_s, spec_tok_s,
tok_s_kind, plain_tpot_ms, spec_tpot_ms, speedup, notes. A row the model cannot read (no
architecture, an unknown GPU, no accept length, no speed-up) is skipped with its reason.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from fledge.core.errors import FledgeError
from fledge.core.shape import Shape
from fledge.perf import hwmodel, modelspec
from fledge.perf import servemodel as S

REFERENCE = "h100"  # the device a row that names none is scaled from (Case.device_from_plain)
PLAIN_WEIGHT = 0.5  # a plain tok/s residual counts half a speed-up residual in the fit
# The pull of each constant towards its default, per unit of (value / default - 1); of the forms
# tried (this, on the log, and weaker), the one with the lowest leave-one-source-out error.
PRIOR_WEIGHT = 0.15
# Each row's residual is scaled by (its source's rows) ** (SOURCE_POWER - 1): at 0.5 every source
# weighs the same in the squared part of the loss (and as sqrt(rows) in its linear part), so a
# source that measured one setup at 24 shapes does not outvote ten sources of one row each.
SOURCE_POWER = 0.5
# The loss on a log error: "soft_l1" counts a large error about linearly (as the reported mean
# |error| does), so one source the terms cannot explain does not drag every constant after it.
LOSS, LOSS_SCALE = "soft_l1", 0.1


@dataclass(frozen=True)
class Case:
    """One readable row: what the model needs and what was measured."""

    row: dict
    deployment: S.Deployment
    load: S.Load
    shape: Shape | None
    accept_length: float | None  # None: the row serves the plain decoding fit only
    speedup: float | None  # measured, speculative over plain
    plain_ms: float | None  # measured ms per token of one request, when the row gives it
    device_from_plain: bool = False  # no GPU named: the device is the one whose plain speed is the row's

    @property
    def speculates(self) -> bool:
        return bool(self.accept_length and self.speedup and self.shape)

    @property
    def explainable(self) -> bool:
        """A round never costs less than a plain step, so no speed-up exceeds the accept length:
        a row measuring more used another accept length or baseline than its figures say."""
        return not self.speculates or self.speedup <= self.accept_length * 1.02

    @property
    def source(self) -> str:
        return self.row["source"]

    @property
    def family(self) -> str:
        return self.deployment.engine

    def predict(self, c: dict) -> tuple[float | None, float]:
        """(speed-up, plain ms per token of a request) under constants `c` (no speed-up for a
        row without an accept length)."""
        d = self.deployment
        if self.device_from_plain:
            d = replace(d, gpu=_device_for(d, c, self.load, self.plain_ms))
        if not self.speculates:
            return None, S.speeds(d, c, self.load, Shape(1, 1, 2), 1.0)[0]
        plain, spec = S.speeds(d, c, self.load, self.shape, self.accept_length)
        return plain / spec, plain


def _device_for(d: S.Deployment, c: dict, load: S.Load, plain_ms: float) -> hwmodel.Gpu:
    """The reference device with its bandwidth and FLOP/s scaled (by bisection, 1/20 to 5 times)
    until the model's plain step takes `plain_ms`: for a row that names no GPU, its own plain
    speed stands for the device's."""
    def scaled(x):
        return replace(d.gpu, hbm_gbs=d.gpu.hbm_gbs * x, tflops={k: v * x for k, v in d.gpu.tflops.items()})

    lo, hi = math.log(0.05), math.log(5.0)
    for _ in range(40):
        mid = (lo + hi) / 2
        plain = S.speeds(replace(d, gpu=scaled(math.exp(mid))), c, load, Shape(1, 1, 2), 1.0)[0]
        lo, hi = (mid, hi) if plain > plain_ms else (lo, mid)
    return scaled(math.exp((lo + hi) / 2))


def load_rows(folder) -> list[dict]:
    """Every row of every JSON list in `folder` (other JSON files, such as an index, are skipped)."""
    rows = []
    files = sorted(Path(folder).glob("*.json"))
    if not files:
        raise FledgeError(f"{folder}: no corpus files (*.json lists of rows)")
    for path in files:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise FledgeError(f"{path}: not JSON ({e})") from None
        if isinstance(data, list):
            rows += [{**r, "_file": path.name} for r in data if isinstance(r, dict)]
    return rows


# MLA as DeepSeek-V3 and Kimi-K2 ship it: (q_lora_rank, kv_lora_rank, qk_nope, qk_rope, v_head).
MLA = (1536, 512, 128, 64, 128)


def spec_from_arch(arch: dict, quant: str | None) -> modelspec.ModelSpec:
    """A ModelSpec from the corpus's architecture summary. The MLP width is what the parameter
    count leaves after attention and the embeddings (input and output, untied); for MoE, the
    shared experts are what the active count leaves after the routed ones."""
    h, layers, vocab = int(arch["hidden"]), int(arch["layers"]), int(arch.get("vocab") or 128256)
    heads = int(arch.get("heads") or h // 128)
    kv = int(arch.get("kv_heads") or heads)
    head_dim = int(arch.get("head_dim") or h // heads)
    mla = MLA if arch.get("attention") == "mla" else None
    base = modelspec.ModelSpec(layers, h, heads, kv, head_dim, 4 * h, vocab, mla=mla)
    fixed = layers * base.attn_params() + 2 * vocab * h
    moe = arch.get("moe")
    if moe:
        e, a, ei = int(moe["experts"]), int(moe["active"]), int(moe["expert_intermediate"])
        dense, di = int(moe.get("dense_layers") or 0), int(moe.get("dense_intermediate") or round(2.6 * h))
        fixed += dense * 3 * h * di
        active = float(arch.get("active_params_b") or 0) * 1e9
        shared = max(0, round((active - fixed) / ((layers - dense) * 3 * h * ei) - a)) if active else 0
        return modelspec.ModelSpec(layers, h, heads, kv, head_dim, di, vocab, e, a, ei, shared, dense, mla,
                                 quant=quant or "bf16")
    inter = max(h, round((float(arch["params_b"]) * 1e9 - fixed) / (layers * 3 * h)))
    return modelspec.ModelSpec(layers, h, heads, kv, head_dim, inter, vocab, mla=mla, quant=quant or "bf16")


def _quant(q) -> str | None:
    q = str(q or "").lower()
    if any(k in q for k in ("int4", "w4", "awq", "gptq", "fp4", "mxfp4", "nvfp4", "4bit", "4-bit")):
        return "int4"
    if "fp8" in q or "w8" in q or "int8" in q:
        return "fp8"
    if "fp16" in q or "bf16" in q or "16" in q:
        return "bf16"
    return None


def _drafting(method) -> str:
    m = str(method or "eagle").lower()
    if any(k in m for k in ("ngram", "n-gram", "suffix", "lookahead", "prompt_lookup")):
        return "ngram"
    if any(k in m for k in ("dflash", "parallel", "p-eagle", "peagle", "block")):
        return "block"
    return "eagle"


# The draft vocabulary of the published EAGLE-3 drafters; EAGLE-1 drafters and MTP layers predict
# through the target's own LM head, which costs each of their draft forwards the full vocabulary.
EAGLE3_DRAFT_VOCAB = 32000


def _draft_vocab(method, target: modelspec.ModelSpec) -> int:
    m = str(method or "").lower()
    return target.vocab if m in ("eagle", "eagle1", "eagle-1", "mtp", "nextn") else EAGLE3_DRAFT_VOCAB


def _shape(row: dict) -> Shape:
    s = row.get("shape") or {}
    steps, topk, tokens = s.get("num_steps"), s.get("topk") or 1, s.get("num_draft_tokens")
    if steps is None and tokens is None:
        raise FledgeError("no shape")
    if topk == 1:
        steps = steps or tokens - 1
        return Shape(int(steps), 1, int(steps) + 1)
    return Shape(int(steps), int(topk), int(tokens or hwmodel.max_nodes(int(steps), int(topk))))


def _per_request(row: dict) -> bool:
    kind = str(row.get("tok_s_kind") or "").lower()
    return not any(k in kind for k in ("total", "throughput", "system", "aggregate")) or "per" in kind


def case(row: dict) -> Case:
    """The Case of a row (FledgeError saying why a row cannot be one)."""
    arch, gpu = row.get("arch"), hwmodel.gpu_key(str(row.get("gpu") or ""))
    if not isinstance(arch, dict) or not arch:
        raise FledgeError("no architecture")
    unnamed = not row.get("gpu")
    if gpu is None and not unnamed:
        raise FledgeError(f"GPU {row.get('gpu')!r} not in the table")
    target = spec_from_arch(arch, _quant(row.get("quant")))
    if not row.get("tp") and int(row.get("gpu_count") or 1) > 8:
        raise FledgeError("several nodes without their TP/EP split (one tensor-parallel group is what the model prices)")
    tp = int(row.get("tp") or row.get("gpu_count") or 1)
    link = "pcie" if "pcie" in str(row.get("interconnect") or "").lower() else "nvlink"
    drafter = modelspec.default_drafter(target, _draft_vocab(row.get("method"), target))
    d = S.Deployment(target, drafter, hwmodel.GPUS[gpu or REFERENCE], tp, hwmodel.LINKS[link],
                     S.family(str(row.get("engine") or "")), _drafting(row.get("method")),
                     row.get("cuda_graphs") is not False)
    try:
        shape = _shape(row)
    except FledgeError:
        shape = None
    speedup = row.get("speedup")
    if row.get("plain_tok_s") and row.get("spec_tok_s"):
        speedup = row["spec_tok_s"] / row["plain_tok_s"]
    elif row.get("plain_tpot_ms") and row.get("spec_tpot_ms"):
        speedup = row["plain_tpot_ms"] / row["spec_tpot_ms"]
    batch = int(row.get("batch") or 1)
    tpot = bool(row.get("plain_tpot_ms")) and not row.get("plain_tok_s")
    prompt, out = int(row.get("input_len") or 0), int(row.get("output_len") or 0)
    context = prompt + out // 2 if prompt or out else 1024
    load = S.Load(batch, context, 0 if tpot else prompt, 0 if tpot else out)
    plain = None
    if row.get("plain_tpot_ms"):
        plain = float(row["plain_tpot_ms"])
    elif row.get("plain_tok_s"):
        plain = 1e3 / row["plain_tok_s"] * (1 if _per_request(row) else batch)
    if not (row.get("accept_length") and speedup and shape) and not plain:
        raise FledgeError("no accept length, and no plain speed")
    accept = float(row["accept_length"]) if row.get("accept_length") else None
    if unnamed and not (plain and accept):
        raise FledgeError("no GPU named, and no plain speed to stand for it")
    return Case(row, d, load, shape, accept, float(speedup) if speedup else None, plain, unnamed)


def cases(rows: list[dict]) -> tuple[list[Case], list[tuple[dict, str]]]:
    """The readable rows as Cases, and the rest with their reasons."""
    good, skipped = [], []
    for r in rows:
        try:
            good.append(case(r))
        except (FledgeError, KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            skipped.append((r, str(e)))
    return good, skipped


def free_constants(cs: list[Case]) -> list[str]:
    """The constants `cs` can inform: a tree's host time needs SGLang trees, the MoE and
    dequant terms MoE or quantised targets, the per-token host work batches above 1 (at batch 1
    it is one more fixed cost), the all-reduce one tensor parallelism."""
    free = ["step", "draft_fixed", "round_extra", "bw_eff", "kernel_us"]
    if any(c.speculates and c.shape.topk > 1 and c.family == "sglang" for c in cs):
        free.append("tree_host")
    if any(c.deployment.target.experts for c in cs):
        free += ["moe_rows", "route_overlap"]
    if any(c.deployment.target.quant != c.deployment.target.dtype for c in cs):
        free.append("dequant")
    if any(c.load.batch > 1 for c in cs):
        free.append("token_ms")
    if any(c.deployment.tp > 1 for c in cs):
        free.append("allreduce_scale")
    return free


def fit(cs: list[Case]) -> dict:
    """Bounded least squares (module doc of servemodel) of the constants `cs` can inform."""
    from scipy.optimize import least_squares

    base = S.defaults()
    cs = [c for c in cs if c.explainable]
    free = free_constants(cs)
    if not cs:
        return base
    lo = [S.CONSTANTS[k][1] / base[k] for k in free]
    hi = [S.CONSTANTS[k][2] / base[k] for k in free]

    def unpack(x):
        return {**base, **{k: base[k] * v for k, v in zip(free, x)}}

    per_source = {}
    for c in cs:
        per_source[c.source] = per_source.get(c.source, 0) + 1
    # Normalised to a mean of 1 over the rows: the weights move rows between sources, not the
    # balance between the rows and the pull towards the defaults.
    norm = len(cs) / sum(n ** SOURCE_POWER for n in per_source.values())
    weight = {src: norm * n ** (SOURCE_POWER - 1) for src, n in per_source.items()}

    def residuals(x):
        c, out = unpack(x), []
        for cs_ in cs:
            speedup, plain = cs_.predict(c)
            w = weight[cs_.source]
            if speedup:
                out.append(w * math.log(speedup / cs_.speedup))
            if cs_.plain_ms and not cs_.device_from_plain:
                out.append(w * PLAIN_WEIGHT * math.log(plain / cs_.plain_ms))
        return out + [PRIOR_WEIGHT * (v - 1) for v in x]

    res = least_squares(residuals, [1.0] * len(free), bounds=(lo, hi), method="trf", loss=LOSS, f_scale=LOSS_SCALE)
    return unpack(res.x)


def crossval(cs: list[Case], margin: float = 0.0) -> dict:
    """Leave each source out of its family's fit and predict its rows; each row's range comes from
    the residuals of the family's other sources, at least every family's other sources' where
    those are few (servemodel.quantile_pair; no row's range has seen its own source).
    Rows without an accept length are predicted for plain decoding only."""
    table, plain_rows, constants, seen = [], [], {}, set()
    for fam in S.FAMILIES:
        mine = [c for c in cs if c.family == fam]
        if not mine:
            continue
        constants[fam] = fit(mine)
        for src in sorted({c.source for c in mine}):
            train = [c for c in mine if c.source != src] or [c for c in cs if c.source != src]
            const = fit(train)
            for c in (c for c in mine if c.source == src):
                speedup, plain = c.predict(const)
                key = (src, json.dumps(c.row.get("arch"), sort_keys=True), c.row.get("gpu"), c.load, c.plain_ms)
                if c.plain_ms and not c.device_from_plain and key not in seen:  # one baseline shared by several speculative rows counts once
                    seen.add(key)
                    plain_rows.append({"case": c, "source": src, "family": fam, "plain_ms_predicted": plain,
                                       "plain_ms_measured": c.plain_ms})
                if speedup:
                    table.append({"case": c, "source": src, "family": fam, "explainable": c.explainable,
                                  "speedup_predicted": speedup, "speedup_measured": c.speedup,
                                  "plain_ms_predicted": plain, "plain_ms_measured": c.plain_ms,
                                  "residual": math.log(c.speedup / speedup)})
    for r in table:
        usable = [o for o in table if o["explainable"] and o["source"] != r["source"]]
        rng = S.with_range(r["speedup_predicted"], [o["residual"] for o in usable if o["family"] == r["family"]],
                           [o["residual"] for o in usable])
        r.update(low=rng.low, high=rng.high, verdict=rng.verdict(margin),
                 verdict_right=bool(_right(rng, r["speedup_measured"], margin)))
    residuals = {fam: [r["residual"] for r in table if r["family"] == fam and r["explainable"]] for fam in constants}
    return {"rows": table, "plain_rows": plain_rows, "constants": constants, "residuals": residuals,
            "summary": summary(table, plain_rows),
            "summary_explainable": summary([r for r in table if r["explainable"]], plain_rows)}


def _right(rng: S.Range, measured: float, margin: float) -> bool:
    v = rng.verdict(margin)
    if v == "pays":
        return measured > 1
    if v == "loses":
        return measured < 1
    return rng.low <= measured <= rng.high


def _mean_abs(errors: list[float]) -> float | None:
    return 100 * statistics.mean(abs(e) for e in errors) if errors else None


def _coverage(table: list[dict]) -> float | None:
    """The share of rows whose measured speed-up lies inside their stated range (calibration: it
    should be near the range's nominal share, servemodel.COVERAGE)."""
    if not table:
        return None
    return 100 * sum(bool(r["low"] <= r["speedup_measured"] <= r["high"]) for r in table) / len(table)


def summary(table: list[dict], plain_rows: list[dict]) -> dict:
    """Mean |error| of the speed-up (overall, per family), of plain tok/s, the verdicts right,
    the best shape right where a source measured several shapes of one setting."""
    def err(r, key):
        return r[f"{key}_predicted"] / r[f"{key}_measured"] - 1

    out = {"rows": len(table), "sources": len({r["source"] for r in table}),
           "speedup_mean_abs_error_percent": _mean_abs([err(r, "speedup") for r in table]),
           "speedup_max_abs_error_percent": max((100 * abs(err(r, "speedup")) for r in table), default=None),
           "plain_mean_abs_error_percent": _mean_abs([err(r, "plain_ms") for r in plain_rows]),
           "plain_rows": len(plain_rows), "plain_sources": len({r["source"] for r in plain_rows}),
           "verdicts_right": sum(r["verdict_right"] for r in table),
           "too_close_to_call": sum(r["verdict"] == "too close to call" for r in table),
           "range_coverage_percent": _coverage(table), "range_nominal_percent": 100 * S.COVERAGE,
           "per_family": {}}
    for fam in sorted({r["family"] for r in table + plain_rows}):
        mine = [r for r in table if r["family"] == fam]
        out["per_family"][fam] = {"rows": len(mine), "sources": len({r["source"] for r in mine}),
                                  "speedup_mean_abs_error_percent": _mean_abs([err(r, "speedup") for r in mine]),
                                  "plain_mean_abs_error_percent": _mean_abs(
                                      [err(r, "plain_ms") for r in plain_rows if r["family"] == fam]),
                                  "plain_rows": sum(r["family"] == fam for r in plain_rows),
                                  "verdicts_right": sum(r["verdict_right"] for r in mine),
                                  "range_coverage_percent": _coverage(mine)}
    groups = {}
    for r in table:
        c = r["case"]
        key = (r["source"], c.row.get("_file"), json.dumps(c.row.get("arch"), sort_keys=True)[:200], c.row.get("gpu"),
               c.deployment.tp, c.load.batch, c.load.prompt, c.load.output_len, c.row.get("engine_version"))
        groups.setdefault(key, []).append(r)
    multi = [g for g in groups.values() if len({x["case"].shape for x in g}) > 1]
    out["best_shape_groups"] = len(multi)
    out["best_shape_right"] = sum(_best_right(g) for g in multi)
    return out


def _best_right(group: list[dict], tie: float = 0.05) -> bool:
    """The predicted best shape is the measured best, or measured within `tie` of it."""
    best_measured = max(r["speedup_measured"] for r in group)
    pick = max(group, key=lambda r: r["speedup_predicted"])
    return pick["speedup_measured"] >= best_measured * (1 - tie)
