"""Speculative decoding as the serving engines run it: per-engine-family terms on top of the
roofline of fledge.perf.hwmodel, their constants fitted to published measurements, and the
cross-validated error every prediction carries.

One plain decode step of a batch of B requests, each at `context` cached tokens:

    plain = step + B x token_ms + forward(target, 1 row)

and one speculative round (accept length L tokens per request, bonus included):

    round = step + [drafter] round_extra + drafts(engine, shape) x (draft_fixed + forward(drafter, topk rows))
            + forward(target, n rows) + [topk > 1] tree_host
    speed-up = plain / (round / L + B x token_ms)
                                      (with whole requests: each request's prefill added to both)

where a forward is, per GPU of a tensor-parallel group of tp:

    forward = max(dense bytes / (bw_eff x bandwidth), dense FLOPs / (0.6 x peak), kernels x kernel_us)
              + expert bytes x dequant / (bw_eff x bandwidth) x (1 + rows per expert / moe_rows)
              + 2 x layers x (allreduce_scale x link latency + 2(tp-1)/tp x rows x H x 2 B / link bandwidth)
              + [CUDA graphs off] kernels x eager launch time

The terms, and why each is there:
  * `step` (ms): the fixed cost of any serving step — scheduler, sampling, host sync, kernel
    launches (graphs or eager) — that does not scale with the model's bytes. It is what makes
    small and MoE targets slower than their bytes say.
  * `token_ms` (ms): host work per emitted token of each request (output processing,
    detokenisation, streaming to the client), which a step of B requests pays B times. Speculation
    emits the same tokens, so it pays this as plain decoding does: per token, not per round. Where
    it dominates (an engine whose output path is slow, at high concurrency) speed-ups shrink
    towards 1 and throughput stops growing with the batch.
  * drafts(engine, shape): the draft forwards a round takes. vLLM drafts K tokens of a chain with
    K - 1 draft forwards after the pass over the accepted tokens that proposes the first (K in
    all); SGLang runs `num_steps` draft forwards and then the extend pass over the accepted tokens
    (steps + 1); TensorRT-LLM's one-model EAGLE-3 counts as SGLang. `draft_fixed` (ms) is each
    draft forward's fixed cost beyond its bytes (launches, top-k, bookkeeping): measured drafting
    costs ~1 ms per extra token on some engines where bytes alone say ~0.3.
  * The drafter is one target-shaped decoder layer and its LM head: an EAGLE-3 drafter's reduced
    vocabulary, or the target's full one for an EAGLE-1 drafter or an MTP layer, which makes each
    of their draft forwards read the whole LM head.
  * `tree_host` (ms): SGLang builds a topk > 1 tree's mask and positions on the host each round.
  * `round_extra` (ms): a round prepares three batches (draft, verify, extend) where a plain
    step prepares one.
  * An n-gram (prompt-lookup) round has no drafter: no draft forward, no draft or extend batch,
    so neither `draft_fixed` nor `round_extra`; it is one verify after a lookup in the tokens
    already seen (a GPU kernel inside the graph on TensorRT-LLM, microseconds against a forward's
    milliseconds; on vLLM host work per request that this model leaves unpriced).
  * MoE: rows spread over the experts a batch touches (uniform routing, modelspec.distinct_experts);
    a grouped GEMM reads each touched expert once but stops being free once its rows grow:
    `moe_rows` is the rows per expert at which an expert's time has doubled over its bytes. The n
    tokens a round verifies for one sequence share its context, so their routes overlap: they draw
    experts as 1 + (n - 1)(1 - `route_overlap`) independent tokens would (0: independent, as
    uniform routing has it; real routers send neighbouring tokens to many of the same experts).
  * `dequant`: quantised (INT4 / FP8) MLP and expert weights cost more than their bytes
    (dequantisation in the GEMM's inner loop); the factor multiplies their time.
  * All-reduce: two per layer; the link table's latency scaled by `allreduce_scale` (launch
    latency and NCCL protocol on top of the wire) plus bytes over its bus bandwidth.
  * `bw_eff`: the fraction of the memory bandwidth reached by the dense weights and the KV cache.
  * `kernel_us` (us): the least time a kernel takes even in a replayed CUDA graph (the gap between
    dependent kernels and a kernel's minimum duration). A forward is never faster than its kernels
    x kernel_us, however little each GPU of a tensor-parallel group holds: why a small MoE target
    at TP4 decodes no faster than at TP2.
Accept length is taken as measured (the row's own): this module predicts the round's cost.

Fitting: each engine family's constants are fitted on its rows by bounded robust least squares
(soft-L1) on log(predicted / measured) of the speed-up and the plain tok/s, each row's error
divided by the square root of its source's rows (every source weighs alike, however many shapes
it measured), with a weak pull towards the physical defaults (so a
constant the family's rows cannot inform stays near its default, and every constant stays inside
its stated range: a point the fit cannot explain shows as error, not as an absurd constant).
Leave-one-source-out cross-validation refits without each source and predicts it; its residuals,
per family, give each prediction's range and the verdict: "pays" when the whole range clears
1 + margin, "loses" when the whole range is below 1, "too close to call" otherwise. The range is
symmetric in the log, as wide as the split-conformal quantile of the n residuals' sizes
|log(measured / predicted)|: the ceil((n + 1) x COVERAGE)-th smallest, which a new error
exchangeable with them stays within at least COVERAGE of the time (the plain COVERAGE quantile
of n residuals undercovers a new one). A family with fewer than MIN_OWN residuals of its own
takes at least the range of every family's residuals pooled: from so few, one source sets the
width.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from fledge.core.errors import FledgeError
from fledge.core.shape import Shape
from fledge.perf import hwmodel
from fledge.perf.modelspec import BYTES, ModelSpec, distinct_experts

# name: (default, low, high): the range is the physically plausible one, the default its middle.
CONSTANTS = {
    "step": (0.6, 0.02, 6.0),
    "token_ms": (0.3, 0.0, 2.0),
    "draft_fixed": (0.3, 0.01, 3.0),
    "round_extra": (0.5, 0.0, 6.0),
    "tree_host": (0.5, 0.0, 4.0),
    "bw_eff": (0.75, 0.35, 0.95),
    "moe_rows": (32.0, 8.0, 512.0),
    "dequant": (1.3, 1.0, 2.0),
    "allreduce_scale": (1.0, 0.3, 4.0),
    "kernel_us": (2.0, 0.5, 8.0),
    "route_overlap": (0.3, 0.0, 0.9),
}
FAMILIES = ("vllm", "sglang", "trtllm")
# The share of new measurements the range every prediction carries is to hold: symmetric in the
# log, as wide as the conformal quantile of |log(measured / predicted)| (module doc). Sources err
# in both directions (one engine version drafts faster than the model, another slower), so a
# range shifted by the other sources' mean error would miss a source that errs the other way.
COVERAGE = 0.8
# Below this many residuals of its own, the 80% rank falls on one of a family's two largest
# errors: the range is then at least the pooled one.
MIN_OWN = 10


def family(engine: str) -> str:
    """The engine family of an engine's name as written ("SGLang 0.5.4", "TensorRT-LLM", "vllm")."""
    e = engine.lower().replace("-", "").replace("_", "").replace(" ", "")
    for name, keys in (("trtllm", ("tensorrt", "trtllm")), ("sglang", ("sglang",)), ("vllm", ("vllm",))):
        if any(k in e for k in keys):
            return name
    raise FledgeError(f"engine {engine!r}: not one of vLLM, SGLang, TensorRT-LLM")


DRAFTING = ("eagle", "block", "ngram")


def draft_forwards(fam: str, shape: Shape, drafting: str = "eagle") -> int:
    """Draft forwards of one round (module doc): vLLM K, SGLang and TensorRT-LLM steps + 1; a
    block drafter (DFlash, parallel drafting) one; n-gram lookup none."""
    if drafting == "ngram":
        return 0
    if drafting == "block":
        return 1
    return shape.num_steps if fam == "vllm" else shape.num_steps + 1


def defaults() -> dict:
    return {k: v[0] for k, v in CONSTANTS.items()}


def check_constants(c: dict, where: str) -> dict:
    """`c` with every constant present and inside its range (FledgeError naming `where` if not)."""
    out = defaults() | c
    for k, (_, lo, hi) in CONSTANTS.items():
        if not lo - 1e-9 <= out[k] <= hi + 1e-9:
            raise FledgeError(f"{where}: constant {k} = {out[k]} is outside its range [{lo}, {hi}]")
    return out


@dataclass(frozen=True)
class Deployment:
    """What a prediction depends on besides the constants: the models, the machine, the engine."""

    target: ModelSpec
    drafter: ModelSpec
    gpu: hwmodel.Gpu
    tp: int
    link: hwmodel.Link
    engine: str  # a family name
    drafting: str = "eagle"  # DRAFTING: how the draft tokens are made
    cuda_graphs: bool = True  # off: every kernel of every forward pays an eager launch

    def __post_init__(self):
        if self.tp < 1 or self.engine not in FAMILIES or self.drafting not in DRAFTING:
            raise FledgeError(f"deployment: tp {self.tp} must be >= 1, engine {self.engine!r} one of {FAMILIES}, "
                              f"drafting {self.drafting!r} one of {DRAFTING}")


def forward_ms(m: ModelSpec, d: Deployment, c: dict, tokens: int, batch: int, context: int) -> float:
    """One forward of `tokens` rows for each of `batch` sequences (module doc's formula)."""
    tp, rows, bw = d.tp, tokens * batch, d.gpu.hbm_gbs * 1e9 * c["bw_eff"]
    wb, qb = BYTES[m.dtype], BYTES[m.quant]
    dq = c["dequant"] if m.quant != m.dtype else 1.0
    dense_layers = m.layers - m.moe_layers
    attn = m.layers * m.attn_params() * wb + m.vocab * m.hidden * wb
    mlp = dense_layers * 3 * m.hidden * m.intermediate * qb
    active = m.layers * m.attn_params() + dense_layers * 3 * m.hidden * m.intermediate + m.vocab * m.hidden
    expert_s = 0.0
    if m.experts:
        # The draft tokens of one sequence share its context, so their routes overlap: they count as
        # fewer independent draws of experts than their rows.
        draws = batch * (1 + (tokens - 1) * (1 - c["route_overlap"]))
        touched = distinct_experts(m.experts, m.active, draws)
        attn += m.moe_layers * (m.shared_experts * m.expert_params() * wb + m.experts * m.hidden * wb)
        active += m.moe_layers * (m.shared_experts * m.expert_params() + m.experts * m.hidden)
        per_expert = rows * m.active / touched
        expert_s = (m.moe_layers * touched * m.expert_params() * qb * dq / tp / bw) * (1 + per_expert / c["moe_rows"])
    kv = batch * context * m.layers * m.kv_bytes_per_token(tp)
    peak = d.gpu.tflops["bf16" if m.quant == "int4" else m.quant if m.quant in d.gpu.tflops else m.dtype]
    flops = 2 * rows * active / tp + rows * m.layers * m.attn_flops_per_token(context) / tp
    floor_s = hwmodel.kernels(m) * c["kernel_us"] * 1e-6
    # The floor bounds the dense kernels (norms, attention, projections: many, each small on a GPU
    # of a tensor-parallel group); the experts' grouped GEMMs read megabytes each, so their time is
    # their bytes, on top.
    dense_s = max((attn / tp + mlp * dq / tp + kv) / bw, flops / (peak * 1e12 * 0.6), floor_s)
    comm_s = 0.0
    if tp > 1:
        msg = rows * m.hidden * 2.0
        comm_s = 2 * m.layers * (d.link.latency_us * 1e-6 * c["allreduce_scale"]
                                 + 2 * (tp - 1) / tp * msg / (d.link.bus_gbs * 1e9))
    eager_s = 0.0 if d.cuda_graphs else hwmodel.kernels(m) * d.gpu.launch_us * 1e-6
    return 1e3 * (dense_s + expert_s + comm_s + eager_s)


def token_host_ms(c: dict, batch: int) -> float:
    """Host time per token of one request spent on the batch's emitted tokens (`token_ms` each):
    the same with or without speculation, since both emit the same tokens."""
    return c["token_ms"] * batch


def plain_ms(d: Deployment, c: dict, batch: int, context: int) -> float:
    """ms per token of one request without speculation (prefill aside)."""
    return c["step"] + token_host_ms(c, batch) + forward_ms(d.target, d, c, 1, batch, context)


def round_ms(d: Deployment, c: dict, shape: Shape, batch: int, context: int) -> float:
    """One speculative round of `shape` (module doc)."""
    draft = c["draft_fixed"] + forward_ms(d.drafter, d, c, shape.topk, batch, context)
    tree = c["tree_host"] if shape.topk > 1 and d.engine == "sglang" else 0.0
    extra = 0.0 if d.drafting == "ngram" else c["round_extra"]
    return (c["step"] + extra + draft_forwards(d.engine, shape, d.drafting) * draft
            + forward_ms(d.target, d, c, shape.num_draft_tokens, batch, context) + tree)


def prefill_ms(d: Deployment, c: dict, prompt: int) -> float:
    """One request's prefill: a step and a forward of its prompt, attending to half of it."""
    return c["step"] + forward_ms(d.target, d, c, prompt, 1, prompt // 2)


@dataclass(frozen=True)
class Load:
    """How the deployment is driven: batch (or concurrency), context per sequence, and for whole
    requests (as serving benchmarks count output tok/s) the prompt and answer lengths."""

    batch: int
    context: int
    prompt: int = 0
    output_len: int = 0

    def __post_init__(self):
        if self.batch < 1 or self.context < 0 or self.prompt < 0 or self.output_len < 0:
            raise FledgeError(f"load {self}: batch >= 1, lengths >= 0")


def speeds(d: Deployment, c: dict, load: Load, shape: Shape, accept_length: float) -> tuple[float, float]:
    """(plain, speculative) ms per token of one request."""
    share = load.batch * prefill_ms(d, c, load.prompt) / load.output_len if load.output_len and load.prompt else 0.0
    return (plain_ms(d, c, load.batch, load.context) + share,
            round_ms(d, c, shape, load.batch, load.context) / accept_length + token_host_ms(c, load.batch) + share)


@dataclass(frozen=True)
class Range:
    """A predicted speed-up and its cross-validated range, with the verdict they give."""

    speedup: float
    low: float
    high: float

    def verdict(self, margin: float = 0.0) -> str:
        if self.low > 1 + margin:
            return "pays"
        if self.high < 1:
            return "loses"
        return "too close to call"

    @property
    def text(self) -> str:
        return f"{self.speedup:.2f}x (range {self.low:.2f}-{self.high:.2f}x)"


def with_range(speedup: float, residuals: list[float], pooled: list[float] = ()) -> Range:
    """`speedup` and the range its family's CV residuals (log measured / predicted) give, at least
    the `pooled` residuals' range where the family has fewer than MIN_OWN."""
    lo, hi = quantile_pair(residuals, pooled)
    return Range(speedup, speedup * math.exp(lo), speedup * math.exp(hi))


def conformal_halfwidth(residuals: list[float]) -> float:
    """The ceil((n + 1) x COVERAGE)-th smallest of the n residuals' sizes (the largest where n is
    too small for that rank)."""
    xs = sorted(abs(r) for r in residuals)
    return xs[min(math.ceil((len(xs) + 1) * COVERAGE), len(xs)) - 1]


def quantile_pair(residuals: list[float], pooled: list[float] = ()) -> tuple[float, float]:
    """(-h, h): h the conformal half-width of the residuals (module doc), at least the pooled
    one's when the residuals are fewer than MIN_OWN."""
    if not residuals and not pooled:
        raise FledgeError("no cross-validation residuals for this engine family: cannot state a range")
    h = conformal_halfwidth(residuals) if residuals else 0.0
    if len(residuals) < MIN_OWN and pooled:
        h = max(h, conformal_halfwidth(pooled))
    return -h, h


FIT_FILE = Path(__file__).with_name("servemodel_fit.json")  # written by bench/tune_crossval.py


@dataclass(frozen=True)
class Fitted:
    """One family's constants and the cross-validation residuals its ranges come from: its own,
    and every family's pooled (the floor of a family with few rows of its own)."""

    engine: str
    constants: dict
    residuals: list
    pooled: list
    note: str

    @property
    def spread(self) -> tuple[float, float]:
        return quantile_pair(self.residuals, self.pooled)


def fitted(engine: str, path: Path = FIT_FILE) -> Fitted:
    """The shipped fit of `engine`'s family; a family with fewer than MIN_OWN residuals takes at
    least every family's range, one with none of its own (or no constants) borrows them, and the
    note says which."""
    try:
        fit = json.loads(Path(path).read_text())
        consts, residuals = fit["constants"], fit["residuals"]
        pooled = [float(r) for rs in residuals.values() for r in rs]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise FledgeError(f"{path}: no fitted constants ({e}); run bench/tune_crossval.py") from None
    where = f"{fit.get('rows', '?')} published rows from {fit.get('sources', '?')} sources"
    own = residuals.get(engine, [])
    if engine in consts and own:
        info = fit.get("summary", {}).get("per_family", {}).get(engine, {})
        mine = f"{info.get('rows', len(own))} published speed-up rows from {info.get('sources', '?')} sources"
        floor = "" if len(own) >= MIN_OWN else f", at least as wide as every family's ({where})"
        return Fitted(engine, check_constants(consts[engine], str(path)), own, pooled,
                      f"{engine} constants fitted on its {mine}; ranges from their leave-one-source-out errors{floor}")
    base = consts.get(engine) or next(iter(consts.values()), defaults())
    return Fitted(engine, check_constants(base, str(path)), [], pooled,
                  f"{engine}: too few published rows of its own; constants "
                  f"{'its own' if engine in consts else 'of another family'}, ranges from every family's errors "
                  f"({where})")
