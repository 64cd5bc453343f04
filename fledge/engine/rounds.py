"""A speculative round: the target verifies the drafter's tree in one forward, the longest
accepted path and a bonus token are kept, the path's KV entries are compacted into place, and
the drafter observes the path and proposes the next tree.

A round is an object built over one target cache for one drafter, so that its static buffers
and CUDA graphs are captured once, before any prefill, and replayed round after round (with a
resident cache, request after request). Three kinds share that shape: `FusedRound` (greedy, the
whole round one graph replay), `QueuedRound` (fused rounds of a device drafter, queued ahead of
the host) and `PhasedRound` (separate timed steps, so the time splits into draft / verify /
other; also sampling). Each returns a `RoundResult` read from the round's one host copy
(accepted count, path tokens, bonus); everything else stays on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fledge.core.shape import Shape
from fledge.engine.attention import Prefix, kernel_available, kernel_takes, triton
from fledge.engine.graphs import PinnedCopies, capture_cuda_graph
from fledge.engine.model import KVCache
from fledge.engine.protocols import Drafter, DraftInput, EngineTarget
from fledge.engine.sampling import SamplingParams, logits_to_probs
from fledge.engine.stats import Clock, SpecStats
from fledge.engine.tree import Tree, path_to, verify_greedy, verify_sample


def verify_forward(target, cache, tree: Tree, cache_len: torch.Tensor, aux_ids):
    """The target over all tree nodes at once: node i sits at slot cache_len + i, rope position
    cache_len + depth, and sees the prefix plus its ancestors."""
    slots = cache_len[:, None] + torch.arange(tree.size, device=cache_len.device)
    return target(tree.tokens, cache_len[:, None] + tree.depth, slots, Prefix(cache_len, tree.anc), cache, aux_ids=aux_ids)


def static_call(fn, examples, use_graph: bool):
    """`fn` over static copies of its tensor inputs; with `use_graph`, captured once as a CUDA
    graph and replayed. Capture runs fn on the examples, so call this before the prefill: what
    it writes past the prefix is overwritten before any mask lets a query see it."""
    bufs = [e.clone() for e in examples]

    def body():
        return fn(*bufs)

    if use_graph:
        body = capture_cuda_graph(body)

    def call(*args):
        for b, a in zip(bufs, args):
            b.copy_(a)
        return body()

    return call


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _compact_kv(KV, START, PATH, s_lk, s_b, s_h, s_s, s_pb, n_kv, B, D, BLOCK_D: tl.constexpr, HD: tl.constexpr):
        """Program (layer and K or V, row b, kv head h): slots start + path[i] → start + i. Every
        row is loaded before any is stored (a path node may sit in a slot another moves into)."""
        pid = tl.program_id(0)
        h, b, lk = pid % n_kv, (pid // n_kv) % B, pid // (n_kv * B)
        i = tl.arange(0, BLOCK_D)
        live = (i < D)[:, None]
        start = tl.load(START + b)
        src = start + tl.load(PATH + b * s_pb + i, mask=i < D, other=0)
        base = KV + lk * s_lk + b * s_b + h * s_h
        d = tl.arange(0, HD)[None, :]
        rows = tl.load(base + src[:, None] * s_s + d, mask=live)
        tl.debug_barrier()
        tl.store(base + (start + i)[:, None] * s_s + d, rows, mask=live)


def compact(cache, cache_len: torch.Tensor, path: torch.Tensor, use_kernel: bool | None = None) -> None:
    """Move the accepted path's entries (tree slots cache_len + path) to the contiguous slots
    cache_len + 0..len-1. Padding entries land past the new length, where nothing looks. On
    CUDA the engine's own cache moves in one kernel for every layer (a round's graph otherwise
    ran six: the slot arithmetic and a gather and scatter each for K and V); `use_kernel` True
    also takes it under Triton's interpreter (its test), False never."""
    B, D = path.shape
    kv = cache.kv if isinstance(cache, KVCache) else None
    if use_kernel is None:
        use_kernel = path.device.type == "cuda"
    if (use_kernel and kv is not None and kernel_available(path.device) and kernel_takes(kv.shape[-1])
            and kv.stride(0) == 2 * kv.stride(1) and kv.stride(-1) == 1 and path.stride(1) == 1):
        nl, _, _, nkv, _, hd = kv.shape
        _compact_kv[(nl * 2 * B * nkv,)](kv, cache_len, path, kv.stride(1), kv.stride(2), kv.stride(3), kv.stride(4),
                                         path.stride(0), nkv, B, D, BLOCK_D=triton.next_power_of_2(D), HD=hd,
                                         num_warps=1)
        return
    src = cache_len[:, None] + path
    dst = cache_len[:, None] + torch.arange(D, device=path.device)
    if isinstance(cache, KVCache):
        for t in (cache.k, cache.v):
            nl, _, nkv, _, hd = t.shape
            shape = (nl, B, nkv, D, hd)
            t.scatter_(3, dst[None, :, None, :, None].expand(shape), t.gather(3, src[None, :, None, :, None].expand(shape)))
        return
    cache.move(src, dst)  # HFTarget's cache: its layers' tensors and the slots' positions


def path_of(tree: Tree, best, aux, length: int):
    """(path node indices [B, length], n = its nodes, its tokens, its aux states or None)."""
    path = path_to(best, tree, length)
    n = tree.depth.gather(1, best[:, None])[:, 0] + 1
    aux = None if aux is None else aux.gather(1, path[..., None].expand(-1, -1, aux.shape[-1]))
    return path, n, tree.tokens.gather(1, path), aux


# --------------------------------------------------------------------------- the fused round
@dataclass
class RoundState:
    """The static buffers one greedy round reads and writes, so that on CUDA the whole round —
    verify, accept, KV compaction and, for device drafters, observe and the next propose — is
    one graph replay, and the host learns the outcome from `result` in one copy. Allocated once
    with its round; a request sets only `cache_len` and `tree`."""

    cache_len: torch.Tensor  # [1] tokens in the target cache (the root's position)
    start: torch.Tensor  # [1] cache_len at the start of the last round
    tree: Tree  # the tree the next round verifies
    n: torch.Tensor  # [1] path nodes the last round put in the cache (accepted + 1)
    path_tokens: torch.Tensor  # [1, path_len]
    bonus: torch.Tensor  # [1]
    aux: torch.Tensor | None  # [1, path_len, 3H] the target's aux states on the path
    result: torch.Tensor  # [path_len + 2] = n, path tokens, bonus

    @classmethod
    def allocate(cls, spec: Shape, device, aux_width: int | None, aux_dtype) -> "RoundState":
        N, D = spec.num_draft_tokens, spec.path_len
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=device)  # noqa: E731
        tree = Tree(zeros(1, N), zeros(1, N), zeros(1, N), torch.eye(N, dtype=torch.bool, device=device)[None])
        aux = None if aux_width is None else torch.zeros(1, D, aux_width, dtype=aux_dtype, device=device)
        return cls(zeros(1), zeros(1), tree, zeros(1) + 1, zeros(1, D), zeros(1), aux, zeros(D + 2))

    def set_tree(self, tree: Tree) -> None:
        for dst, src in zip((self.tree.tokens, self.tree.parents, self.tree.depth, self.tree.anc),
                            (tree.tokens, tree.parents, tree.depth, tree.anc)):
            dst.copy_(src)


def finish_round(logits, aux, state: RoundState):
    """Acceptance (verify_greedy, path_of) of the tree in `state`, then the round's bookkeeping
    written into its buffers in place: start = the old cache_len, cache_len += n, the path's n,
    tokens, bonus and aux, and `result` (n, path tokens, bonus) for the host. Returns the path
    for `compact`. Compiled (CUDA), the acceptance's ~20 small eager kernels a round (argmax,
    compares, the path's scatter and gathers) and the ~10 copies, cat and add after it become a
    few: at batch 1 each small kernel in a round's graph costs ~2 us, the round ~1 ms."""
    best, bonus = verify_greedy(logits, state.tree)
    path, n, path_tokens, path_aux = path_of(state.tree, best, aux, state.path_tokens.shape[1])
    state.start.copy_(state.cache_len)
    state.cache_len.add_(n)
    state.n.copy_(n)
    state.path_tokens.copy_(path_tokens)
    state.bonus.copy_(bonus)
    if path_aux is not None:
        state.aux.copy_(path_aux)
    state.result.copy_(torch.cat([n, path_tokens[0], bonus]))
    return path


finish_round_compiled = torch.compile(finish_round, fullgraph=True, dynamic=False)


# --------------------------------------------------------------------------- round kinds
@dataclass
class Request:
    """What the rounds of one request need from it."""

    prompt: list[int]
    params: SamplingParams
    size: int  # cache slots the request may use (cache_size)
    gen: torch.Generator
    clock: Clock


@dataclass
class RoundResult:
    """A round as the host sees it: drafts accepted, the tokens it adds (those drafts, then the
    bonus), and when its work was done on the device. A fused round is one graph, timed whole:
    from the end of the round before it."""

    accepted: int
    tokens: list[int]
    end: object  # a Clock mark

    @classmethod
    def read(cls, host: list[int], end, **marks) -> "RoundResult":
        """From the round's one host copy [n, path tokens (root first), bonus], n = accepted + 1."""
        return cls(host[0] - 1, host[2:1 + host[0]] + [host[-1]], end, **marks)

    def record(self, stats: SpecStats, clock: Clock, prev):
        """Append this round's timings to `stats` (once the device has passed `end`); returns
        the mark the next round's time starts from."""
        stats.round_ms.append(clock.ms(prev, self.end))
        return self.end


@dataclass
class PhasedResult(RoundResult):
    """A phased round's marks between its steps: propose, verify and accept, compact, observe."""

    begin: object
    drafted: object
    verified: object
    compacted: object
    observed: object

    def record(self, stats: SpecStats, clock: Clock, prev):
        ms = clock.ms
        stats.draft_ms.append(ms(self.begin, self.drafted) + ms(self.compacted, self.observed))
        stats.verify_ms.append(ms(self.drafted, self.verified))
        stats.other_ms.append(ms(self.verified, self.compacted) + ms(self.observed, self.end))
        stats.round_ms.append(ms(self.begin, self.end))
        return self.end


class Round:
    """What every round kind shares: built over one target cache for one drafter (capturing its
    graphs before any prefill), then `start`ed per request and `run` once per round."""

    def __init__(self, drafter, use_graph: bool):
        self.drafter, self.use_graph = drafter, use_graph

    def note_buffers(self) -> None:
        """Note the drafter's device buffers the graphs just captured read (call once built)."""
        self.buffers = self.drafter.buffers() if self.drafter.device_only else ()

    def serves(self, drafter, use_graph: bool) -> bool:
        """Whether this round, built for an earlier request over the same cache, replays right
        for `drafter` now: the same drafter, still over the same buffers (its `start` keeps
        them while their shape holds, and rewrites them in place)."""
        now = drafter.buffers() if drafter.device_only else ()
        return (drafter is self.drafter and use_graph == self.use_graph and len(now) == len(self.buffers)
                and all(a is b for a, b in zip(now, self.buffers)))


class FusedRound(Round):
    """Greedy rounds over one RoundState, each one graph replay and one host sync on CUDA. A host
    drafter (n-gram, probes) proposes before each round and observes after it."""

    def __init__(self, target, cache, drafter, use_graph: bool):
        super().__init__(drafter, use_graph)
        param = next(target.parameters())
        aux_width = len(drafter.aux_ids) * target.dims()[0] if drafter.aux_ids is not None else None
        self.target, self.cache = target, cache
        self.state = RoundState.allocate(drafter.spec, param.device, aux_width, param.dtype)
        graph = use_graph and target.cuda_graph_ok
        self.finish = finish_round_compiled if graph else finish_round
        # Capture runs the round a few times (each from cache_len 0, so it stays inside the
        # cache): it comes before the prefill, which rewrites everything those runs touched.
        self.replay = capture_cuda_graph(self.body, reset=self.state.cache_len.zero_) if graph else self.body
        self.note_buffers()

    def body(self) -> torch.Tensor:
        """One greedy round over the state: verify, accept, compact, and for a device drafter
        observe and the next propose. Returns the host's result buffer."""
        st, drafter = self.state, self.drafter
        logits, aux = verify_forward(self.target, self.cache, st.tree, st.cache_len, drafter.aux_ids)
        path = self.finish(logits, aux, st)
        compact(self.cache, st.start, path)
        if drafter.device_only:
            drafter.observe(st.path_tokens, st.aux, st.n, st.bonus, st.start)
            st.set_tree(drafter.propose(DraftInput(st.bonus, st.cache_len, [])))
        return st.result

    def start(self, req: Request, root: torch.Tensor, cache_len: torch.Tensor) -> None:
        self.req, self.root = req, root
        self.state.cache_len.fill_(len(req.prompt))

    def run(self, out: list[int]) -> RoundResult:
        st = self.state
        st.set_tree(self.drafter.propose(DraftInput(self.root, st.cache_len, [self.req.prompt + out])))
        host = self.replay().tolist()  # the round's one host sync
        self.drafter.observe(st.path_tokens, st.aux, st.n, st.bonus, st.start)
        self.root = st.bonus
        return RoundResult.read(host, self.req.clock.now())


class QueuedRound(FusedRound):
    """Fused rounds of a device drafter (its observe and next propose inside the round), queued
    ahead of the host: each round's result is copied to pinned memory behind it (PinnedCopies),
    and read (one sync) when the host needs it; at most two rounds are queued unread. Device
    drafters need nothing from the host between rounds, so the host reads round i while round
    i+1 runs: on the H200 a round otherwise waited 0.015-0.33 ms for the host, by the host's
    load (docs/performance.md)."""

    def __init__(self, target, cache, drafter, use_graph: bool):
        super().__init__(target, cache, drafter, use_graph)
        self.results = PinnedCopies(self.state.result, 2)

    def start(self, req: Request, root: torch.Tensor, cache_len: torch.Tensor) -> None:
        super().start(req, root, cache_len)
        self.state.set_tree(self.drafter.propose(DraftInput(root, self.state.cache_len, [])))
        self.results.pending.clear()  # a round the last request queued past its end is not this one's
        self.marks = []  # clock marks of the queued rounds, oldest first

    def run(self, out: list[int]) -> RoundResult:
        # Keep the next round queued while the host reads this one, as long as the cache surely
        # holds it (each unread round adds at most path_len slots) and the rounds already queued
        # may leave tokens to write: a round queued past max_new_tokens is a whole round of
        # GPU time wasted per request (1.05 ms of an oracle request's 32.7 on the H200 in
        # bf16), where waiting for the host costs ~0.03 ms once. One queued past an eos is
        # wasted, and its time counted.
        spec, req = self.drafter.spec, self.req
        free = req.size - spec.num_draft_tokens - (len(req.prompt) + len(out) - 1)
        left = req.params.max_new_tokens - len(out)
        queued = len(self.results)
        while queued < 2 and (queued == 0 or (free >= queued * spec.path_len and left > queued * spec.path_len)):
            self.results.push(self.replay())
            self.marks.append(self.req.clock.now())
            queued += 1
        return RoundResult.read(self.results.pop().tolist(), self.marks.pop(0))  # the round's one host sync


class PhasedRound(Round):
    """Rounds as separate steps, each timed, so that SpecStats splits a round into draft /
    verify / other; also the sampling path. Verify and the EAGLE-3 drafter's propose and observe
    are each a graph on CUDA (over static buffers); acceptance stays eager, host drafters too."""

    def __init__(self, target, cache, drafter, use_graph: bool):
        super().__init__(drafter, use_graph)
        self.cache, spec, device = cache, drafter.spec, next(target.parameters()).device
        N, D = spec.num_draft_tokens, spec.path_len
        one = torch.zeros(1, dtype=torch.long, device=device)
        ids = torch.zeros(1, N, dtype=torch.long, device=device)
        anc = torch.eye(N, dtype=torch.bool, device=device)[None]

        def verify(tokens, parents, depth, anc, cache_len):
            return verify_forward(target, cache, Tree(tokens, parents, depth, anc), cache_len, drafter.aux_ids)

        self.verify_call = static_call(verify, [ids, ids, ids, anc, one], use_graph and target.cuda_graph_ok)
        self.propose_call = self.observe_call = None
        if drafter.device_only:
            self.propose_call = static_call(lambda root, cache_len: drafter.propose(DraftInput(root, cache_len, [])),
                                            [one, one], use_graph)
        if drafter.device_only and drafter.aux_ids is not None:  # EAGLE-3; the oracle observes nothing
            aux = torch.zeros(1, D, len(drafter.aux_ids) * target.dims()[0], dtype=drafter.kv.dtype, device=device)
            self.observe_call = static_call(drafter.observe, [ids[:, :D], aux, one + 1, one, one], use_graph)
        self.note_buffers()

    def start(self, req: Request, root: torch.Tensor, cache_len: torch.Tensor) -> None:
        self.req, self.root, self.cache_len = req, root, cache_len

    def run(self, out: list[int]) -> PhasedResult:
        req, clock, ctx = self.req, self.req.clock, self.req.prompt + out
        begin = clock.now()
        tree = self.propose(ctx)
        drafted = clock.now()
        logits, aux = self.verify_call(tree.tokens, tree.parents, tree.depth, tree.anc, self.cache_len)
        if req.params.temperature == 0:
            best, bonus = verify_greedy(logits, tree)
        else:
            best, bonus = verify_sample(logits_to_probs(logits, req.params), tree, req.gen)
        verified = clock.now()
        path, n, path_tokens, aux = path_of(tree, best, aux, self.drafter.spec.path_len)
        compact(self.cache, self.cache_len, path)
        compacted = clock.now()
        self.observe(path_tokens, aux, n, bonus)
        observed = clock.now()
        host = torch.cat([n, path_tokens[0], bonus]).tolist()  # the round's one host sync
        self.cache_len, self.root = self.cache_len + n, bonus
        return PhasedResult.read(host, clock.now(), begin=begin, drafted=drafted, verified=verified,
                                 compacted=compacted, observed=observed)

    def propose(self, ctx: list[int]) -> Tree:
        if self.propose_call is None:
            return self.drafter.propose(DraftInput(self.root, self.cache_len, [ctx]))
        return self.propose_call(self.root, self.cache_len)

    def observe(self, tokens, aux, n, bonus) -> None:
        if self.observe_call is None:
            self.drafter.observe(tokens, aux, n, bonus, self.cache_len)
        else:
            self.observe_call(tokens, aux.to(self.drafter.kv.dtype), n, bonus, self.cache_len)


def round_for(target: EngineTarget, cache, drafter: Drafter, resident, use_graph: bool, phased: bool) -> Round:
    """The round a request runs: phased (or sampled), else fused, queued for a device drafter.
    Built anew per request, or with a `resident` once and kept in it for the next requests of
    the same drafter (Round.serves): a round's graphs capture the resident's cache, the drafter's
    buffers and the round's own, all allocated once and rewritten in place, so the next request
    replays them as captured (a capture cost ~0.13 s a request)."""
    kind = PhasedRound if phased else QueuedRound if drafter.device_only else FusedRound
    if resident is None:
        return kind(target, cache, drafter, use_graph)
    kept = resident.rounds.get(kind)
    if kept is None or not kept.serves(drafter, use_graph):
        resident.rounds.pop(kind, None)  # its graphs go before the next is captured
        kept = resident.rounds[kind] = kind(target, cache, drafter, use_graph)
    return kept
