"""Speculative decoding: draft a tree, verify it in one target forward, keep the longest
accepted path and a bonus token.

Per round the host learns one small tensor (accepted count, path tokens, bonus) with a
single `.tolist()`; everything else stays on the device. Exactness: with greedy sampling the
output is token-for-token the engine's AR output; with temperature/top-p every token is
distributed as AR's (generate.logits_to_probs), via tree.verify_sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fledge.engine.attention import Prefix, kernel_available, kernel_takes, triton
from fledge.engine.drafters import DraftInput, OracleDrafter, SpecConfig, target_dims
from fledge.engine.generate import capture_cuda_graph, cut_at_eos, logits_to_probs, sample_token
from fledge.engine.model import KVCache
from fledge.engine.stats import Clock, SpecStats
from fledge.engine.tree import Tree, path_to, verify_greedy, verify_sample
from fledge.util import FledgeError


def cache_size(prompt_len: int, max_new_tokens: int, spec: SpecConfig, cache_len: int | None = None) -> int:
    """Slots needed: prompt + new tokens + one tree written past the end (rounded to 64, as AR)."""
    need = prompt_len + max_new_tokens + spec.num_draft_tokens
    size = cache_len or -(-need // 64) * 64
    if size < need:
        raise FledgeError(f"cache of {size} slots < prompt {prompt_len} + max_new_tokens {max_new_tokens} "
                          f"+ num_draft_tokens {spec.num_draft_tokens} = {need}")
    return size


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
    # HFTarget recomputes every slot from (token, position, mask row): move the first two,
    # and give each moved slot the causal row it would have had if decoded one at a time.
    for t in (cache.ids, cache.positions):
        t.scatter_(1, dst, t.gather(1, src))
    cols = torch.arange(cache.mask.shape[2], device=path.device)
    cache.mask.scatter_(1, dst[..., None].expand(B, D, cols.numel()), cols <= dst[..., None])


def keep_path(cache, tree: Tree, best: torch.Tensor, start: torch.Tensor, aux, length: int):
    """After verification: move the accepted path root → best into the cache (compact) and
    return (n = its nodes, accepted + 1; its tokens [B, length]; its aux states or None)."""
    path, n, tokens, aux = path_of(tree, best, aux, length)
    compact(cache, start, path)
    return n, tokens, aux


def path_of(tree: Tree, best, aux, length: int):
    """(path node indices [B, length], n = its nodes, its tokens, its aux states or None)."""
    path = path_to(best, tree, length)
    n = tree.depth.gather(1, best[:, None])[:, 0] + 1
    aux = None if aux is None else aux.gather(1, path[..., None].expand(-1, -1, aux.shape[-1]))
    return path, n, tree.tokens.gather(1, path), aux


def accept_greedy(logits, tokens, parents, depth, anc, aux, length: int):
    """verify_greedy and path_of in one function (finish_round's first half): compiled, ~20
    small eager kernels a round (argmax, compares, the path's scatter and gathers) become a few.
    Returns (bonus, path, n, path tokens, path aux or None)."""
    tree = Tree(tokens, parents, depth, anc)
    best, bonus = verify_greedy(logits, tree)
    return (bonus, *path_of(tree, best, aux, length))


def finish_round(logits, tokens, parents, depth, anc, aux, length: int, cache_len, start, n_out, path_tokens_out,
                 bonus_out, aux_out, result):
    """accept_greedy, then the round's bookkeeping written into RoundState's buffers in place:
    start = the old cache_len, cache_len += n, the path's n, tokens, bonus and aux, and `result`
    (n, path tokens, bonus) for the host. Returns the path for `compact`. Compiled (CUDA), the
    eager form's ~10 copies, cat and add after acceptance join its few kernels: at batch 1 each
    small kernel in a round's graph costs ~2 us, the round ~1 ms."""
    bonus, path, n, path_tokens, path_aux = accept_greedy(logits, tokens, parents, depth, anc, aux, length)
    start.copy_(cache_len)
    cache_len.add_(n)
    n_out.copy_(n)
    path_tokens_out.copy_(path_tokens)
    bonus_out.copy_(bonus)
    if path_aux is not None:
        aux_out.copy_(path_aux)
    result.copy_(torch.cat([n, path_tokens[0], bonus]))
    return path


finish_round_compiled = torch.compile(finish_round, fullgraph=True, dynamic=False)


@dataclass
class RoundState:
    """The static buffers one greedy round reads and writes, so that on CUDA the whole round —
    verify, accept, KV compaction and, for device drafters, observe and the next propose — is
    one graph replay, and the host learns the outcome from `result` in one copy."""

    cache_len: torch.Tensor  # [1] tokens in the target cache (the root's position)
    start: torch.Tensor  # [1] cache_len at the start of the last round
    tree: Tree  # the tree the next round verifies
    n: torch.Tensor  # [1] path nodes the last round put in the cache (accepted + 1)
    path_tokens: torch.Tensor  # [1, path_len]
    bonus: torch.Tensor  # [1]
    aux: torch.Tensor | None  # [1, path_len, 3H] the target's aux states on the path
    result: torch.Tensor  # [path_len + 2] = n, path tokens, bonus

    @classmethod
    def allocate(cls, spec: SpecConfig, device, aux_width: int | None, aux_dtype) -> "RoundState":
        N, D = spec.num_draft_tokens, spec.path_len
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=device)  # noqa: E731
        tree = Tree(zeros(1, N), zeros(1, N), zeros(1, N), torch.eye(N, dtype=torch.bool, device=device)[None])
        aux = None if aux_width is None else torch.zeros(1, D, aux_width, dtype=aux_dtype, device=device)
        return cls(zeros(1), zeros(1), tree, zeros(1) + 1, zeros(1, D), zeros(1), aux, zeros(D + 2))

    def set_tree(self, tree: Tree) -> None:
        for dst, src in zip((self.tree.tokens, self.tree.parents, self.tree.depth, self.tree.anc),
                            (tree.tokens, tree.parents, tree.depth, tree.anc)):
            dst.copy_(src)


def fused_round(target, cache, drafter, state: RoundState, use_graph: bool):
    """One greedy round over `state`, as a graph replay when `use_graph`. Capture runs the round
    a few times (each from cache_len 0, so it stays inside the cache), so it is built before the
    prefill, which rewrites everything those runs touched; the caller then sets `state`."""
    D = drafter.spec.path_len
    finish = finish_round_compiled if use_graph else finish_round

    def body():
        st, tree = state, state.tree
        logits, aux = verify_forward(target, cache, tree, st.cache_len, drafter.aux_ids)
        path = finish(logits, tree.tokens, tree.parents, tree.depth, tree.anc, aux, D, st.cache_len, st.start, st.n,
                      st.path_tokens, st.bonus, st.aux, st.result)
        compact(cache, st.start, path)
        if drafter.device_only:
            drafter.observe(st.path_tokens, st.aux, st.n, st.bonus, st.start)
            st.set_tree(drafter.propose(DraftInput(st.bonus, st.cache_len, [])))
        return st.result

    return capture_cuda_graph(body, reset=state.cache_len.zero_) if use_graph else body


class Ahead:
    """Fused rounds queued ahead of the host: each round's result [path_len + 2] is copied to a
    pinned host buffer behind the round on the stream, and read (one sync) when the host needs it.
    Two buffers: at most two rounds are queued unread."""

    def __init__(self, run_round, width: int, device):
        cuda = device.type == "cuda"
        self.run_round, self.cuda = run_round, cuda
        self.bufs = [torch.empty(width, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        self.pending, self.count = [], 0  # (buffer, event) of queued rounds, oldest first

    def queued(self) -> int:
        return len(self.pending)

    def enqueue(self) -> None:
        buf = self.bufs[self.count % 2]
        buf.copy_(self.run_round(), non_blocking=self.cuda)
        event = torch.cuda.Event() if self.cuda else None
        if event is not None:
            event.record()
        self.pending.append((buf, event))
        self.count += 1

    def read(self) -> list[int]:
        buf, event = self.pending.pop(0)
        if event is not None:
            event.synchronize()
        return buf.tolist()


@torch.no_grad()
def generate_spec(target, drafter, prompt: list[int], params, eos_ids, cache_len: int | None = None,
                  use_cuda_graph: bool = True, phased: bool = False, resident=None):
    """One prompt (batch 1). Returns (new tokens, ending at the first eos (included) or at
    max_new_tokens — the same cut as generate_ar; SpecStats).

    Greedy rounds are fused (`fused_round`: one graph replay and one host sync per round on
    CUDA); with a device drafter the next round is queued before the host reads the last one
    (`Ahead`; none is queued past max_new_tokens, but one queued past an eos is wasted, and its
    time counted); host drafters
    (n-gram, probes) propose before it and observe after it. `phased`, and
    sampling, run the round as separate steps instead — verify and the EAGLE-3 drafter's
    propose/observe each a graph on CUDA, acceptance eager — timing each: SpecStats then
    splits the round into draft / verify / other. `resident`: an engine.resident.Resident of
    `target`, whose cache and captured prefill (with the drafter's aux ids) the request uses."""
    if not prompt:
        raise FledgeError("generate_spec: the prompt is empty")
    spec: SpecConfig = drafter.spec
    device = next(target.parameters()).device
    size = cache_size(len(prompt), params.max_new_tokens, spec, cache_len)
    if resident is not None:  # the same check against the resident cache; the drafter's rows stay per request
        cache_size(len(prompt), params.max_new_tokens, spec, resident.max_len)
    cache = resident.cache if resident is not None else target.new_cache(1, size)
    drafter.start(1, size)
    graphs = use_cuda_graph and device.type == "cuda"
    fused = params.temperature == 0 and not phased
    if fused:
        aux_width = 3 * target_dims(target)[0] if drafter.aux_ids is not None else None
        state = RoundState.allocate(spec, device, aux_width, next(target.parameters()).dtype)
        run_round = fused_round(target, cache, drafter, state, graphs and target.cuda_graph_ok)
    else:
        verify, propose, observe = _round_functions(target, cache, drafter, device, use_cuda_graph)
    # Device drafters need nothing from the host between rounds: the host reads round i while
    # round i+1 runs. On the H200 a round otherwise waited 0.015-0.33 ms for the host, by the
    # host's load (bench/profile_round.py's "round_gap" at commit d466fab).
    ahead = Ahead(run_round, spec.path_len + 2, device) if fused and drafter.device_only else None
    gen = torch.Generator(device=device).manual_seed(params.seed)
    clock, stats = Clock(device), SpecStats(spec.num_steps, spec.num_draft_tokens, prompt_tokens=len(prompt))
    eos = set(eos_ids)

    t0 = clock.now()
    ids = torch.tensor([prompt], device=device)
    L = len(prompt)
    cache_len_t = torch.tensor([L], device=device)
    if resident is not None:
        logits, aux = resident.prefill(ids, drafter.aux_ids)
    else:
        logits, aux = target.prefill(ids, cache, aux_ids=drafter.aux_ids, logits_idx=(cache_len_t - 1)[:, None])
    root = sample_token(logits[:, 0], params, gen)
    drafter.observe(ids, aux, cache_len_t, root, torch.zeros_like(cache_len_t))
    out = [root.item()]
    if fused:
        state.cache_len.fill_(L)
        if drafter.device_only:
            state.set_tree(drafter.propose(DraftInput(root, state.cache_len, [])))
    t_prefill = clock.now()
    marks, done = [], out[0] in eos
    while len(out) < params.max_new_tokens and not done:
        if ahead is not None:
            # Keep the next round queued while the host reads this one, as long as the cache
            # surely holds it (each unread round adds at most path_len slots) and the rounds
            # already queued may leave tokens to write: a round queued past max_new_tokens is
            # a whole round of device time wasted per request (1.05 ms of an oracle request's
            # 32.7 on the H200 in bf16), where waiting for the host costs ~0.03 ms once.
            free = size - spec.num_draft_tokens - (L + len(out) - 1)
            left = params.max_new_tokens - len(out)
            while ahead.queued() < 2 and (ahead.queued() == 0 or (free >= ahead.queued() * spec.path_len
                                                                  and left > ahead.queued() * spec.path_len)):
                ahead.enqueue()
                marks.append(clock.now())
            host = ahead.read()  # the round's one host sync
        elif fused:
            state.set_tree(drafter.propose(DraftInput(root, state.cache_len, [prompt + out])))
            host = run_round().tolist()  # the round's one host sync
            drafter.observe(state.path_tokens, state.aux, state.n, state.bonus, state.start)
            root = state.bonus
            marks.append(clock.now())
        else:
            host, cache_len_t, root, mark = _phased_round(target, cache, drafter, verify, propose, observe, root,
                                                          cache_len_t, prompt + out, params, gen, clock)
            marks.append(mark)
        accepted = host[0] - 1
        new = host[2:2 + accepted] + [host[-1]]
        out += new
        done = any(t in eos for t in new)
        stats.accepted.append(accepted)
    t_end = clock.now()  # after any round queued past the end: its time counts
    clock.wait(t_end)

    marks = marks[:len(stats.accepted)]
    out = cut_at_eos(out[:params.max_new_tokens], eos)
    stats.generated_tokens = len(out)
    stats.prefill_ms = clock.ms(t0, t_prefill)
    stats.wall_ms = clock.ms(t0, t_end)
    prev = t_prefill
    for m in marks:
        if fused:
            stats.round_ms.append(clock.ms(prev, m))
            prev = m
        else:
            a, b, c, d, e, f = m
            stats.draft_ms.append(clock.ms(a, b) + clock.ms(d, e))
            stats.verify_ms.append(clock.ms(b, c))
            stats.other_ms.append(clock.ms(c, d) + clock.ms(e, f))
            stats.round_ms.append(clock.ms(a, f))
    return out, stats


def oracle_text(target, spec: SpecConfig, prompt: list[int], reference: list[int], params, eos_ids,
                max_passes: int = 8, **generate_kw) -> tuple[list[int], int]:
    """The greedy text this engine's own verify computes for `prompt` with a chain of `spec`:
    what an oracle drafter must propose so that every draft is accepted (the engine's ceiling).

    AR's text is not it in bf16: a verify over many rows may round a near-tie apart from a
    one-row step, and where the rounds fall moves the rows a position is computed in. So the
    reference is refined: each pass proposes the last pass's output. Up to a pass's first
    rejection its rounds are the last pass's, so each pass moves that point later; the text is
    final once a pass returns what it was fed. Returns (text, passes run); after `max_passes`
    the last output stands (an oracle fed it then accepts less than everything, and says so).
    In fp32 the first pass already returns AR's text."""
    device = next(target.parameters()).device
    for n in range(1, max_passes + 1):
        out, _ = generate_spec(target, OracleDrafter(spec, [prompt + reference], device), prompt, params, eos_ids,
                               **generate_kw)
        if out == reference:
            return out, n
        reference = out
    return reference, max_passes


def _phased_round(target, cache, drafter, verify, propose, observe, root, cache_len_t, context, params, gen, clock):
    """One round as separate steps, each timed: returns (host result, new cache_len, next root, marks)."""
    spec: SpecConfig = drafter.spec
    t_a = clock.now()
    tree = propose(root, cache_len_t, [context])
    t_b = clock.now()
    logits, aux = verify(tree, cache_len_t)
    if params.temperature == 0:
        best, bonus = verify_greedy(logits, tree)
    else:
        best, bonus = verify_sample(logits_to_probs(logits, params), tree, gen)
    t_c = clock.now()
    n, path_tokens, aux = keep_path(cache, tree, best, cache_len_t, aux, spec.path_len)
    t_d = clock.now()
    observe(path_tokens, aux, n, bonus, cache_len_t)
    t_e = clock.now()
    host = torch.cat([n, path_tokens[0], bonus]).tolist()  # the round's one host sync
    return host, cache_len_t + n, bonus, (t_a, t_b, t_c, t_d, t_e, clock.now())


def _round_functions(target, cache, drafter, device, use_cuda_graph: bool):
    """(verify, propose, observe) for the decode rounds, over static buffers so that on CUDA
    each is one graph replay. Host-side drafters (n-gram, oracle) stay eager."""
    spec: SpecConfig = drafter.spec
    N, D = spec.num_draft_tokens, spec.path_len
    graphs = use_cuda_graph and device.type == "cuda"
    one = torch.zeros(1, dtype=torch.long, device=device)
    ids = torch.zeros(1, N, dtype=torch.long, device=device)
    anc = torch.eye(N, dtype=torch.bool, device=device)[None]

    def verify_fn(tokens, parents, depth, anc, cache_len):
        return verify_forward(target, cache, Tree(tokens, parents, depth, anc), cache_len, drafter.aux_ids)

    run_verify = static_call(verify_fn, [ids, ids, ids, anc, one], graphs and target.cuda_graph_ok)

    def verify(tree, cache_len):
        return run_verify(tree.tokens, tree.parents, tree.depth, tree.anc, cache_len)

    if not drafter.device_only:
        return verify, (lambda root, cache_len, ctx: drafter.propose(DraftInput(root, cache_len, ctx))), drafter.observe
    run_propose = static_call(lambda root, cache_len: drafter.propose(DraftInput(root, cache_len, [])), [one, one], graphs)
    if drafter.aux_ids is None:  # the oracle: nothing to observe
        return verify, (lambda root, cache_len, ctx: run_propose(root, cache_len)), drafter.observe
    hidden = 3 * drafter.draft.cfg.target_hidden_size
    aux = torch.zeros(1, D, hidden, dtype=drafter.kv.dtype, device=device)
    run_observe = static_call(drafter.observe, [ids[:, :D], aux, one + 1, one, one], graphs)

    def observe(tokens, aux, n, next_token, start):
        run_observe(tokens, aux.to(drafter.kv.dtype), n, next_token, start)

    return verify, (lambda root, cache_len, ctx: run_propose(root, cache_len)), observe
