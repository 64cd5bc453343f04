"""Step times (Timings, what `fledge tune` ranks shapes with) of a target and its EAGLE-3 drafter
from their configs and the hardware, no GPU.

One forward of `tokens` rows per sequence for `batch` sequences at `context` cached tokens, per
GPU of a tensor-parallel group of `tp`:

    forward = launches + max(bytes / bandwidth, FLOPs / peak) + all-reduces

and a serving step adds the host once (scheduler, sampling, detokenizing). Approximations,
stated once:
  * Memory and compute overlap perfectly (the roofline max); each reaches a fixed fraction of
    its peak (`bw_efficiency`, `flops_efficiency`). Weights are read once per forward; KV is read
    once per sequence; activations and KV writes are left out.
  * MoE routing is uniform and independent per token: m = tokens x batch rows touch
    E(1 - (1 - k/E)^m) distinct experts per layer in expectation, each read in full. Real routers
    are skewed, so the union is a little smaller (the model errs slow on wide verifies).
  * Tensor parallelism splits every weight matrix and the MoE experts evenly over the GPUs (no
    expert parallelism); GQA KV heads split over min(tp, kv_heads) GPUs; the MLA latent cache is
    replicated. Each layer does two all-reduces of rows x hidden bf16 values, each costing
    latency + 2(tp-1)/tp x bytes / bus bandwidth (nccl-tests' bus-bandwidth convention); the
    logits gather and the embedding are left out.
  * Quantization (`quant`) sets the bytes of the MLP and routed-expert weights only; attention,
    shared experts, norms and the LM head stay in `dtype` — as INT4 checkpoints of MoE models
    ship (Kimi-K2.5's ignores self_attn, shared_experts and lm_head). INT4 is weight-only
    (W4A16, 4 bits plus one 16-bit scale per group of 32): its math runs at the `dtype` peak.
  * Launches cost a fixed time per forward and per kernel, a fixed number of kernels per layer;
    CUDA graphs shrink that cost, they do not remove it.
  * The drafter is one decoder layer whose q/k/v read 2H (embedding and hidden state), plus the
    fc that folds 3H aux states to H (run once per round), the draft LM head, and its own KV.
  * A speculative round is num_steps draft forwards (topk rows per sequence each), one verify
    forward, and the drafter's pass over the accepted tokens (taken as 2 rows per sequence) with
    the fc; the host's step time once, plus `round_host_ms`. vLLM drafts one forward fewer per
    round than SGLang (its first draft step is that pass); the model counts SGLang's.
  * Whole requests (`tune model --output-len`): a request's prefill is one forward of its prompt, and
    the batch's decode waits for it (no overlap of prefill and decode).
  * The efficiencies, host times and kernel counts are estimates, not measurements: they are the
    constants `fledge tune calibrate` fits to a live server.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, replace

from fledge.core.config import check_number
from fledge.core.errors import FledgeError
from fledge.core.shape import Shape
from fledge.perf.modelspec import BYTES, ModelSpec, distinct_experts


@dataclass(frozen=True)
class Gpu:
    """Peak figures of one device: memory bandwidth (GB/s) and dense tensor FLOP/s (TFLOP/s) by
    math dtype, and what a kernel launch costs (us) with and without CUDA graphs."""

    hbm_gbs: float
    tflops: dict
    launch_us: float = 4.0  # cudaLaunchKernel host cost, a few us per kernel on current drivers
    graph_launch_us: float = 1.0  # a replayed graph still leaves ~1 us between dependent kernels

    def __post_init__(self):
        check_number("--hbm-gbs", float(self.hbm_gbs), 0, low_open=True, what="gpu")
        for dtype, v in self.tflops.items():
            check_number(f"--tflops ({dtype})", float(v), 0, low_open=True, what="gpu")
        check_number("launch_us", float(self.launch_us), 0, what="gpu")
        check_number("graph_launch_us", float(self.graph_launch_us), 0, what="gpu")


GPUS = {
    # NVIDIA H100 SXM5 datasheet: 3.35 TB/s HBM3, 989 TFLOP/s bf16 and 1,979 fp8 (dense).
    "h100": Gpu(3350, {"bf16": 989, "fp16": 989, "fp8": 1979, "fp32": 67}),
    # NVIDIA H200 SXM datasheet: 4.8 TB/s HBM3e, same tensor cores as H100 SXM.
    "h200": Gpu(4800, {"bf16": 989, "fp16": 989, "fp8": 1979, "fp32": 67}),
    # NVIDIA A100 80GB SXM datasheet: 2,039 GB/s, 312 TFLOP/s bf16; no fp8 units (fp8 runs as bf16).
    "a100": Gpu(2039, {"bf16": 312, "fp16": 312, "fp8": 312, "fp32": 19.5}),
    # NVIDIA L40S datasheet: 864 GB/s, 362 bf16 and 733 fp8 (dense, half the sparse figures).
    "l40s": Gpu(864, {"bf16": 362, "fp16": 362, "fp8": 733, "fp32": 91.6}),
    # NVIDIA RTX PRO 6000 Blackwell datasheet: 1,792 GB/s GDDR7, 4 PFLOP/s fp4 with sparsity;
    # dense fp8 = 4000 / 2 (sparsity) / 2 (fp4 -> fp8) = 1,000, bf16 half that; fp32 125.
    "rtx-pro-6000": Gpu(1792, {"bf16": 500, "fp16": 500, "fp8": 1000, "fp32": 125}),
    # NVIDIA H20 (China-market Hopper): 4.0 TB/s HBM3, 148 TFLOP/s bf16 and 296 fp8 dense.
    "h20": Gpu(4000, {"bf16": 148, "fp16": 148, "fp8": 296, "fp32": 44}),
    # NVIDIA B200 datasheet (HGX B200, per GPU): 8 TB/s HBM3e, 2.25 PFLOP/s bf16 and 4.5 fp8 dense.
    "b200": Gpu(8000, {"bf16": 2250, "fp16": 2250, "fp8": 4500, "fp32": 75}),
    # AMD Instinct MI300X datasheet: 5.3 TB/s HBM3, 1,307 TFLOP/s bf16 and 2,615 fp8 dense.
    "mi300x": Gpu(5300, {"bf16": 1307, "fp16": 1307, "fp8": 2615, "fp32": 163}),
    # NVIDIA L4 datasheet: 300 GB/s GDDR6, 121 TFLOP/s bf16 and 242 fp8 dense.
    "l4": Gpu(300, {"bf16": 121, "fp16": 121, "fp8": 242, "fp32": 30}),
    # NVIDIA A10G (AWS g5): 600 GB/s GDDR6, 70 TFLOP/s bf16 dense.
    "a10g": Gpu(600, {"bf16": 70, "fp16": 70, "fp8": 70, "fp32": 35}),
    # NVIDIA GeForce RTX 4090: 1,008 GB/s GDDR6X, 165 TFLOP/s bf16 dense (fp32 accumulate), 330 fp8.
    "rtx-4090": Gpu(1008, {"bf16": 165, "fp16": 165, "fp8": 330, "fp32": 83}),
    # NVIDIA GeForce RTX 3090: 936 GB/s GDDR6X, 71 TFLOP/s bf16 dense (fp32 accumulate); no fp8 units.
    "rtx-3090": Gpu(936, {"bf16": 71, "fp16": 71, "fp8": 71, "fp32": 35.6}),
    # NVIDIA A40 datasheet: 696 GB/s GDDR6, 150 TFLOP/s bf16 dense; no fp8 units.
    "a40": Gpu(696, {"bf16": 150, "fp16": 150, "fp8": 150, "fp32": 37.4}),
    # A server CPU socket's order of magnitude only (DDR5, a few cores of AVX-512); PyTorch eager
    # costs ~15 us of dispatch per op. Run `fledge tune calibrate` rather than trust these.
    "cpu": Gpu(20, {"bf16": 0.2, "fp16": 0.2, "fp8": 0.2, "fp32": 0.2}, launch_us=15.0, graph_launch_us=15.0),
}


@dataclass(frozen=True)
class Link:
    """All-reduce over the tensor-parallel group: latency (us) and bus bandwidth (GB/s)."""

    latency_us: float
    bus_gbs: float

    def __post_init__(self):
        check_number("--allreduce-us", float(self.latency_us), 0, what="interconnect")
        check_number("--allreduce-gbs", float(self.bus_gbs), 0, low_open=True, what="interconnect")


LINKS = {
    # 8 GPUs on PCIe without NVLink: an 8-byte NCCL all_reduce_perf takes 42 us on 8 x RTX 4090
    # (github.com/NVIDIA/nccl/issues/1530) and 54 us on 8 x RTX 3090 (NVIDIA/nccl#1439); 8 x RTX
    # 5090 on PCIe 5 reach 28 GB/s bus bandwidth on large messages (NVIDIA/nccl#1639).
    "pcie": Link(45.0, 28.0),
    # NVLink 4 through NVSwitch (HGX H100/H200): 450 GB/s each way per GPU (datasheet), of which
    # NCCL's ring reaches ~80% on large messages; small all-reduces take ~10 us.
    "nvlink": Link(10.0, 360.0),
}


@dataclass
class Hardware:
    """The machine and the free constants `fledge tune calibrate` fits (every one overridable)."""

    gpu: Gpu
    tp: int = 1
    link: Link = field(default_factory=lambda: LINKS["nvlink"])
    cuda_graphs: bool = True
    bw_efficiency: float = 0.8  # decode GEMVs reach ~80-90% of the HBM peak
    flops_efficiency: float = 0.6  # small-batch GEMMs reach about half the tensor-core peak
    host_ms: float = 0.3  # per serving step: scheduler, sampling, detokenizer, host sync
    forward_ms: float = 0.02  # per forward before its first kernel: a graph replay, or eager framework code
    # A round prepares three batches (draft, verify, draft extend) where a plain step prepares one.
    round_host_ms: float = 0.6

    def __post_init__(self):
        check_number("--tp", self.tp, 1, integer=True, what="hardware")
        check_number("--bw-efficiency", float(self.bw_efficiency), 0, 1, low_open=True, what="hardware")
        check_number("--flops-efficiency", float(self.flops_efficiency), 0, 1, low_open=True, what="hardware")
        for name in ("host_ms", "forward_ms", "round_host_ms"):
            check_number(f"--{name.replace('_', '-')}", float(getattr(self, name)), 0, what="hardware")

    @property
    def launch_us(self) -> float:
        return self.gpu.graph_launch_us if self.cuda_graphs else self.gpu.launch_us


# Other spellings of the table's devices: same silicon, or close enough for a roofline.
GPU_ALIASES = {"h800": "h100", "h100-sxm": "h100", "h100-pcie": "h100", "h100-nvl": "h100", "gh200": "h200",
               "h200-nvl": "h200", "a800": "a100", "a100-80g": "a100", "a100-sxm": "a100", "b100": "b200",
               "rtx-pro-6000-blackwell": "rtx-pro-6000", "rtx-6000-pro": "rtx-pro-6000", "4090": "rtx-4090",
               "3090": "rtx-3090", "a100-40gb": "a100", "a100-40g": "a100"}


def gpu_key(name: str) -> str | None:
    """The GPUS key of a device as people write it ("NVIDIA H100 80GB HBM3", "8xH200"), or None."""
    s = re.sub(r"^\d+\s*[x×]\s*", "", name.strip().lower()).replace("nvidia", "").replace("geforce", "")
    s = re.sub(r"\b(\d+\s*gb|hbm3e?|gddr\d\w*|server edition|workstation edition|max-q)\b", "", s)
    s = "-".join(s.replace("_", " ").split())
    for cand in (s, s.split("-")[0], "-".join(s.split("-")[:2]), "-".join(s.split("-")[:3])):
        if cand in GPUS:
            return cand
        if cand in GPU_ALIASES:
            return GPU_ALIASES[cand]
    return None


def hardware(gpu: str, tp: int = 1, interconnect: str = "nvlink", **overrides) -> Hardware:
    """A Hardware from table names; `overrides` replace any Gpu, Link or Hardware field."""
    if gpu not in GPUS:
        raise FledgeError(f"--gpu {gpu!r}: unknown; pass one of {', '.join(GPUS)} (and --hbm-gbs/--tflops to adjust)")
    if interconnect not in LINKS:
        raise FledgeError(f"--interconnect {interconnect!r}: pass one of {', '.join(LINKS)}")
    o = {k: v for k, v in overrides.items() if v is not None}
    g = GPUS[gpu]
    g = replace(g, **{k: o.pop(k) for k in ("hbm_gbs", "launch_us", "graph_launch_us") if k in o})
    if "tflops" in o:
        g = replace(g, tflops={**g.tflops, **o.pop("tflops")})
    link = replace(LINKS[interconnect], **{k: o.pop(k) for k in ("latency_us", "bus_gbs") if k in o})
    return Hardware(g, tp, link, **o)


# --------------------------------------------------------------------------- timings
@dataclass
class Timings:
    """Milliseconds per step of one batch, what `fledge tune` ranks shapes with. `verify_ms`
    maps tokens verified per request (the tree size n) to the target forward time; `draft_ms`
    maps topk to one draft step; `overhead_ms` is the rest of a round.

    With `output_len` > 0, rates are of whole requests, as a serving benchmark's output
    throughput counts them: each request's prefill (`prefill_ms`, which the whole batch waits
    for) is spread over its `output_len` new tokens. Speculation shortens only the decode part,
    so its speed-up shrinks as prefill's share grows (batch x prefill against output_len steps).
    With 0, rates are of decode rounds alone."""

    ar_ms: float
    verify_ms: dict[int, float]
    draft_ms: dict[int, float]
    overhead_ms: float = 0.0
    batch: int = 1
    prefill_ms: float = 0.0
    output_len: int = 0
    extra_drafts: int = 0  # draft forwards a round takes beyond num_steps (SGLang's extend pass: 1)
    tree_ms: float = 0.0  # host time to build a topk > 1 tree, per round
    token_host_ms: float = 0.0  # host time per token of a request, paid alike with and without speculation

    def __post_init__(self):
        self.verify_ms = {int(k): float(v) for k, v in sorted(self.verify_ms.items())}
        self.draft_ms = {int(k): float(v) for k, v in sorted(self.draft_ms.items())}
        check_number("--ar-ms", float(self.ar_ms), 0, low_open=True)
        if not self.verify_ms or min(self.verify_ms) < 1:
            raise FledgeError(f"--verify-ms {self.verify_ms}: need n >= 1 tokens")
        for n, ms in self.verify_ms.items():
            check_number(f"--verify-ms ({n} tokens)", ms, 0, low_open=True)
        if not self.draft_ms:
            raise FledgeError("--draft-ms: no draft step time given")
        for k, ms in self.draft_ms.items():
            check_number(f"--draft-ms (topk {k})", ms, 0)
        check_number("--overhead-ms", float(self.overhead_ms), 0)
        check_number("--batch", self.batch, 1, integer=True)
        check_number("prefill_ms", float(self.prefill_ms), 0)
        check_number("--output-len", self.output_len, 0, integer=True)
        check_number("token_host_ms", float(self.token_host_ms), 0)

    def verify(self, n: int) -> float:
        return _interp(self.verify_ms, n)

    def draft(self, topk: int) -> float:
        return _interp(self.draft_ms, topk)

    def round_ms(self, shape: Shape) -> float:
        """One speculative round of `shape`: its draft steps, its verify, the rest."""
        return ((shape.num_steps + self.extra_drafts) * self.draft(shape.topk) + self.verify(shape.num_draft_tokens)
                + self.overhead_ms + (self.tree_ms if shape.topk > 1 else 0.0))

    @property
    def prefill_per_token_ms(self) -> float:
        """Prefill time a request's stream pays per new token (0 for decode-only rates)."""
        return self.batch * self.prefill_ms / self.output_len if self.output_len else 0.0

    @property
    def per_token_ms(self) -> float:
        """What a request's stream pays per new token whether it speculates or not: its prefill's
        share and the host's per-token work."""
        return self.prefill_per_token_ms + self.token_host_ms

    @property
    def plain_ms(self) -> float:
        """Milliseconds per token of a request without speculation."""
        return self.ar_ms + self.per_token_ms

    def spec_ms(self, accept_length: float, round_ms: float) -> float:
        """Milliseconds per token of a request whose rounds take `round_ms` and accept `accept_length`."""
        return round_ms / accept_length + self.per_token_ms


def _interp(table: dict[int, float], x: float) -> float:
    """Piecewise linear through the measured points; flat below the first (and everywhere for a
    single point), extended along the last segment beyond the last (forward time grows ~linearly
    once compute-bound)."""
    xs = sorted(table)
    if x <= xs[0] or len(xs) == 1:
        return table[xs[0]]
    a, b = next(((a, b) for a, b in zip(xs, xs[1:]) if x <= b), xs[-2:])
    return table[a] + (table[b] - table[a]) * (x - a) / (b - a)


# --------------------------------------------------------------------------- times
@dataclass
class StepTime:
    """One forward on one GPU, in ms, and its parts."""

    memory_ms: float
    compute_ms: float
    comm_ms: float
    launch_ms: float

    @property
    def total_ms(self) -> float:
        return self.launch_ms + max(self.memory_ms, self.compute_ms) + self.comm_ms


KERNELS_PER_LAYER = {"dense": 12, "moe": 20}  # norms, projections, rope, attention, MLP; MoE adds routing
KERNELS_PER_HEAD = {"target": 4, "draft": 10}  # logits and sampling; a draft step adds top-k and tree bookkeeping


def kernels(m: ModelSpec) -> int:
    """Kernels one forward of `m` launches."""
    return m.layers * KERNELS_PER_LAYER["moe" if m.experts else "dense"] + KERNELS_PER_HEAD["draft" if m.draft else "target"]


def forward(m: ModelSpec, hw: Hardware, tokens: int, batch: int, context: int) -> StepTime:
    """`tokens` new rows per sequence for `batch` sequences, `context` tokens cached each."""
    tp, rows = hw.tp, tokens * batch
    wb, qb = BYTES[m.dtype], BYTES[m.quant]
    mlp_layers = m.layers - m.moe_layers
    weights = m.layers * m.attn_params() * wb + mlp_layers * 3 * m.hidden * m.intermediate * qb + m.vocab * m.hidden * wb
    active = m.layers * m.attn_params() + mlp_layers * 3 * m.hidden * m.intermediate + m.vocab * m.hidden
    if m.experts:
        touched = distinct_experts(m.experts, m.active, rows)
        weights += m.moe_layers * (touched * m.expert_params() * qb + m.shared_experts * m.expert_params() * wb
                                   + m.experts * m.hidden * wb)
        active += m.moe_layers * ((m.active + m.shared_experts) * m.expert_params() + m.experts * m.hidden)
    kv = batch * context * m.layers * m.kv_bytes_per_token(tp)
    flops = 2 * rows * active / tp + rows * m.layers * m.attn_flops_per_token(context) / tp
    peak = hw.gpu.tflops["bf16" if m.quant == "int4" else m.quant if m.quant in hw.gpu.tflops else m.dtype]
    comm = 0.0
    if tp > 1:
        msg = rows * m.hidden * 2.0
        comm = 2 * m.layers * (hw.link.latency_us * 1e-6 + 2 * (tp - 1) / tp * msg / (hw.link.bus_gbs * 1e9))
    n_kernels = kernels(m)
    return StepTime(memory_ms=1e3 * (weights / tp + kv) / (hw.gpu.hbm_gbs * 1e9 * hw.bw_efficiency),
                    compute_ms=1e3 * flops / (peak * 1e12 * hw.flops_efficiency),
                    comm_ms=1e3 * comm, launch_ms=hw.forward_ms + 1e-3 * n_kernels * hw.launch_us)


def prefill_ms(target: ModelSpec, hw: Hardware, prompt: int) -> float:
    """One request's prefill: the host step and a forward of its `prompt` tokens, each attending
    to half the prompt on average (causal)."""
    return hw.host_ms + forward(target, hw, prompt, 1, prompt // 2).total_ms


VERIFY_SIZES, TOPKS = (1, 2, 4, 8, 16, 32, 64), (1, 2, 4, 8)


def step_times(target: ModelSpec, drafter: ModelSpec, hw: Hardware, batch: int, context: int, output_len: int = 0,
               verify_sizes=VERIFY_SIZES, topks=TOPKS) -> Timings:
    """AR step = host + one-row forward; a round = steps x draft(topk) + verify(n) + overhead,
    overhead = host + the drafter's pass over the accepted tokens + `round_host_ms`. With
    `output_len`, of whole requests whose prompt is `context` tokens (Timings)."""
    verify = {n: forward(target, hw, n, batch, context).total_ms for n in verify_sizes}
    draft = {k: forward(drafter, hw, k, batch, context).total_ms for k in topks}
    extend = forward(drafter, hw, 2, batch, context).total_ms
    fc_ms = 1e3 * 3 * drafter.hidden ** 2 * BYTES[drafter.dtype] / hw.tp / (hw.gpu.hbm_gbs * 1e9 * hw.bw_efficiency)
    return Timings(hw.host_ms + forward(target, hw, 1, batch, context).total_ms, verify, draft,
                   hw.host_ms + hw.round_host_ms + extend + fc_ms, batch,
                   prefill_ms(target, hw, context) if output_len else 0.0, output_len)


def breakdown(target: ModelSpec, drafter: ModelSpec, hw: Hardware, batch: int, context: int) -> dict:
    """The forwards `step_times` adds up, each in its parts."""
    return {"ar": asdict(forward(target, hw, 1, batch, context)),
            **{f"verify_{n}": asdict(forward(target, hw, n, batch, context)) for n in VERIFY_SIZES},
            **{f"draft_topk{k}": asdict(forward(drafter, hw, k, batch, context)) for k in TOPKS}}
