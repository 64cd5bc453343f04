"""The engine as a measuring instrument: a target and a drafter loaded once (`EngineRig`), plain and
speculative runs timed the same way (`run_ar`, `run_shape`), verify and draft costs for tune, and the
acceptance-by-rank probe. bench, tune and doctor's probe all measure through it."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from tqdm import tqdm

from fledge.core.devices import pick_device, pick_dtype
from fledge.core.shape import Shape, max_nodes


class RankProbe:
    """Wraps an EAGLE-3 drafter to record, for every verify round, the sibling rank of each
    node on the accepted path, in two tables by where the path stands: on the spine (every
    node so far the drafter's top guess, the path a chain drafts) or off it. `reached[t][d]`
    counts rounds whose path reached an expanded node at depth d-1 with spine status t (1 on
    the spine, 0 off it), `hits[t][d][r]` those where its rank-r child was accepted. Agreement
    is correlated along the greedy path, so one table over both would under-predict chains.
    Give it a full tree (num_draft_tokens = max_nodes): then a node's children are all kept,
    in the drafter's rank order. Eager on purpose (`device_only` False): recording needs the
    host between propose and observe."""

    device_only = False

    def __init__(self, drafter):
        self.inner, self.spec, self.aux_ids, self.vocab = drafter, drafter.spec, drafter.aux_ids, drafter.vocab
        K, S = self.spec.topk, self.spec.num_steps
        self.reached = [[0] * S for _ in range(2)]
        self.hits = [[[0] * K for _ in range(S)] for _ in range(2)]
        self.tree = None

    def start(self, batch, max_len):
        self.tree = None
        self.inner.start(batch, max_len)

    def propose(self, inp):
        self.tree = self.inner.propose(inp)
        return self.tree

    def observe(self, tokens, aux, n, next_token, start):
        if self.tree is not None:
            self._record(tokens[0].tolist(), int(n[0]))
        self.inner.observe(tokens, aux, n, next_token, start)

    def _record(self, path: list[int], n: int) -> None:
        toks, parents = self.tree.tokens[0].tolist(), self.tree.parents[0].tolist()
        node, spine = 0, 1
        for d in range(len(self.reached[0])):
            kids = [j for j in range(1, len(toks)) if parents[j] == node]  # siblings in rank order
            if not kids:
                return
            self.reached[spine][d] += 1
            match = [j for j in kids if d + 1 < n and toks[j] == path[d + 1]]
            if not match:
                return
            rank = kids.index(match[0])
            self.hits[spine][d][rank] += 1
            node, spine = match[0], spine and rank == 0

    def profile(self) -> dict[str, list[list[float]]]:
        """{"spine": rows for spine parents, "ranks": rows for the others}. A row nothing
        reached (depth 1 off the spine, always; deep rows in short probes) takes both tables'
        counts pooled, so it says what the probe saw rather than "never accepted"."""
        pooled = [[a + b for a, b in zip(h0, h1)] for h0, h1 in zip(*self.hits)]
        pooled_n = [a + b for a, b in zip(*self.reached)]

        def rows(t):
            return [[h / r for h in row] if r else [h / m if m else 0.0 for h in prow]
                    for row, r, prow, m in zip(self.hits[t], self.reached[t], pooled, pooled_n)]

        return {"spine": rows(1), "ranks": rows(0)}


@dataclass
class EngineRig:
    """A target and drafter loaded once; spec shapes are cheap wrappers around them."""

    hf: object
    tokenizer: object
    target: object
    draft: object
    eos: list
    device: object
    compiled: bool = False  # the target's layer functions and the drafter's halves, torch.compile'd

    def drafter(self, shape):
        """The engine's drafter of `shape`: EAGLE-3's step by step, or P-EAGLE's one forward
        where the drafter was trained for parallel drafting."""
        from fledge.engine.drafters import Eagle3Drafter
        from fledge.engine.parallel import ParallelDrafter

        kind = ParallelDrafter if self.draft.cfg.parallel else Eagle3Drafter
        return kind(self.draft, shape, self.target, compile=self.compiled)


def load_rig(target: str, drafter: str, device: str | None, dtype: str | None,
             chat_template: str | None = None) -> EngineRig:
    """The engine as `fledge generate --compile` and `bench/bench_engine.py --compile` run it on
    CUDA (CUDA graphs, fused rounds, fused reductions up to GEMV_ROWS rows, the few-rows kernel
    for verify-sized forwards); eager on the CPU."""
    from fledge.core.target import eos_ids, load_target
    from fledge.drafter.checkpoint import load_checkpoint
    from fledge.engine.hf import build_engine_target
    from fledge.engine.layers import GEMV_ROWS, LayerFns

    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    compile = dev.type == "cuda"
    t = load_target(target, dtype=dt, device=dev, chat_template=chat_template, chat=True)
    draft = load_checkpoint(drafter, embed_from=t.model).eval().cast(dev, dt)
    fns = LayerFns.compiled(gemv_rows=GEMV_ROWS, few_rows=16) if compile else LayerFns()
    return EngineRig(t.model, t.tokenizer, build_engine_target(t.model, dt, dev, fns=fns), draft,
                     eos_ids(t.tokenizer, t.model.generation_config), dev, compile)


def engine_path(rig: EngineRig) -> str:
    graphs = rig.device.type == "cuda"
    return (f"{'compiled' if rig.compiled else 'eager'} layers, CUDA graphs {'on' if graphs else 'off'}, "
            "fused greedy rounds")


def run_ar(rig: EngineRig, prompts, max_new_tokens: int, outputs: list | None = None) -> dict:
    """Plain decoding on the engine, batch 1: ms per decode step and decode tok/s (each prompt's
    tokens appended to `outputs`, if given)."""
    from fledge.engine.decode import generate_ar
    from fledge.engine.sampling import SamplingParams

    generate_ar(rig.target, [prompts[0]], SamplingParams(max_new_tokens=8), rig.eos)  # warm-up/capture
    ms = steps = 0
    for p in tqdm(prompts, desc="plain decoding", leave=False):
        rows, st = generate_ar(rig.target, [p], SamplingParams(max_new_tokens=max_new_tokens), rig.eos)
        ms, steps = ms + st["decode_ms"], steps + st["decode_steps"]
        if outputs is not None:
            outputs.append(rows[0])
    return {"ar_ms": ms / max(steps, 1), "tok_s": 1e3 * steps / max(ms, 1e-9)}


def run_shape(rig: EngineRig, drafter, prompts, max_new_tokens: int, desc: str, outputs: list | None = None):
    """Every prompt through the engine's speculative decoding as shipped (greedy: fused rounds,
    one graph each on CUDA), the timing path of `fledge bench` and `fledge tune`: merged
    SpecStats and decode tok/s (prefill excluded: the cost model predicts decode rounds); each
    prompt's tokens appended to `outputs`, if given."""
    from fledge.engine.sampling import SamplingParams
    from fledge.engine.spec import generate_spec
    from fledge.engine.stats import SpecStats

    generate_spec(rig.target, drafter, prompts[0], SamplingParams(max_new_tokens=8), rig.eos)  # compile, capture
    done = [generate_spec(rig.target, drafter, p, SamplingParams(max_new_tokens=max_new_tokens), rig.eos)
            for p in tqdm(prompts, desc=desc, leave=False)]
    if outputs is not None:
        outputs.extend(out for out, _ in done)
    runs = [st for _, st in done]
    stats = SpecStats.merge(runs)
    decode_tok_s = 1e3 * (stats.generated_tokens - len(runs)) / max(stats.wall_ms - stats.prefill_ms, 1e-9)
    return stats, decode_tok_s


def measure_verify_ms(rig: EngineRig, sizes, context: int, iters: int = 20, warmup: int = 3) -> dict[int, float]:
    """Target forward time for n tokens verified per round (a chain of n, the engine's verify
    path, as a CUDA graph where the engine uses one), at `context` tokens already cached: the
    median of `iters` calls after `warmup`, so one stray slow call moves nothing. Each size is
    built, warmed and timed before the next, so a graph replays only while the cache and tree
    it captured are alive (a graph reading freed memory is an illegal memory access on CUDA)."""
    import torch

    from fledge.engine import rounds
    from fledge.engine.graphs import now
    from fledge.engine.tree import chain

    dev, out = rig.device, {}
    for n in tqdm(sizes, desc="verify timing", leave=False):
        cache = rig.target.new_cache(1, -(-(context + n) // 64) * 64)
        cache_len = torch.tensor([context], device=dev)
        tree = chain(torch.zeros(1, dtype=torch.long, device=dev), torch.zeros(1, n - 1, dtype=torch.long, device=dev))

        def fn(tok, cl, tree=tree, cache=cache):
            return rounds.verify_forward(rig.target, cache, tree, cl, rig.draft.cfg.aux_layer_ids)

        graph = dev.type == "cuda" and rig.target.cuda_graph_ok
        call = rounds.static_call(fn, [tree.tokens, cache_len], graph) if graph else fn
        for _ in range(warmup):
            call(tree.tokens, cache_len)
        times = []
        for _ in range(iters):
            t0 = now(dev)
            call(tree.tokens, cache_len)
            times.append(1e3 * (now(dev) - t0))
        out[n] = statistics.median(times)
    return out


def measure_draft_ms(rig: EngineRig, prompts, topks, max_new_tokens: int, context: int = 64,
                     iters: int = 3) -> tuple[dict[int, float], float]:
    """Per draft step by topk, and the rest of a round (observe, acceptance, KV compaction, host).
    A fused round is one graph, timed whole: its verify is timed alone on the same target
    (`measure_verify_ms`), and round - verify is fitted as a + b * num_steps from runs at 2 and
    6 steps: b is the draft step, a the rest."""
    draft, fixed = {}, []
    # One bar over the runs: each is minutes on a large target, and the inner bars restart per run.
    runs = tqdm(total=2 * len(topks), desc="draft timing (runs of 2 and 6 steps per topk)", unit="run")
    for k in topks:
        rest = {}
        for s in (2, 6):
            shape = Shape(s, k, min(16, max_nodes(s, k)))
            runs.set_postfix_str(shape.label)
            st, _ = run_shape(rig, rig.drafter(shape), prompts, max_new_tokens, f"draft timing {shape.label}")
            verify = measure_verify_ms(rig, [shape.num_draft_tokens], context, iters)[shape.num_draft_tokens]
            rest[s] = st.summary()["round_ms_per_step"] - verify
            runs.update()
        b = max((rest[6] - rest[2]) / 4, 0.0)
        draft[k] = b
        fixed += [max(rest[2] - 2 * b, 0.0), max(rest[6] - 6 * b, 0.0)]
    runs.close()
    return draft, statistics.median(fixed)


def probe_profile(rig: EngineRig, prompts, num_steps: int, topk: int, max_new_tokens: int) -> dict:
    """Acceptance by depth and sibling rank from a full tree (every candidate verified), on the
    spine and off it (RankProbe)."""
    full = Shape.full(num_steps, topk)
    probe = RankProbe(rig.drafter(full))
    run_shape(rig, probe, prompts, max_new_tokens, "acceptance probe")
    # Every round the probe saw counts, the untimed warm-up included: its acceptance is as real.
    return {**probe.profile(), "reached_spine": probe.reached[1], "reached": probe.reached[0],
            "rounds": probe.reached[1][0], "probe_shape": [full.num_steps, full.topk, full.num_draft_tokens]}
