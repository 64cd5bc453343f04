"""The engine's drafters: the oracle (the target's own continuation), n-gram lookup and EAGLE-3.
Each implements `fledge.engine.protocols.Drafter`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fledge.core.errors import FledgeError
from fledge.core.shape import Shape
from fledge.drafter.checkpoint import load_checkpoint
from fledge.drafter.eagle3 import Eagle3Draft
from fledge.engine.layers import compile_static, one_off_attention
from fledge.engine.protocols import DraftInput
from fledge.engine.tree import (
    Tree,
    chain,
    logsumexp_by_chunks,
    select_tree,
    topk_by_max,
    topk_by_rank,
)


def _pad_chain(tokens: list[int], n: int, fill: int) -> list[int]:
    return (tokens + [tokens[-1] if tokens else fill] * n)[:n]


def _oracle_tokens(seq, root, cache_len, num_steps: int):
    """The chain's tokens: the root, then seq[b] at positions cache_len + 1 .. + num_steps."""
    idx = (cache_len[:, None] + torch.arange(1, num_steps + 1, device=seq.device)).clamp(max=seq.shape[1] - 1)
    return torch.cat([root[:, None], seq.gather(1, idx)], dim=1)


# dynamic: each request's sequences have their own width; one compile serves them all (static,
# 80 MT-Bench requests ran into the recompile limit).
_oracle_tokens_compiled = torch.compile(_oracle_tokens, fullgraph=True, dynamic=True)


class OracleDrafter:
    """Proposes the target's own greedy continuation (from a prior AR run): the ceiling of the
    engine — every draft is accepted under greedy decoding, so accept length = num_steps + 1.
    It reads its sequences on the device by position (the root sits at cache_len), so its
    rounds fuse into one graph like EAGLE-3's; `set_sequences` gives it the next request's."""

    aux_ids = None
    device_only = True
    vocab = None

    def __init__(self, spec: Shape, sequences: list[list[int]], device=None):
        self.check(spec)
        self.spec, self.seq, self.shape = spec, None, None
        self.set_sequences(sequences)
        if device is not None:  # the sequences are the oracle's input, not its work: upload them before any clock
            self._upload(torch.device(device))

    @staticmethod
    def check(spec: Shape) -> None:
        if spec.topk != 1:
            raise FledgeError("--oracle drafts a chain: use --topk 1")

    def set_sequences(self, sequences: list[list[int]]) -> None:
        """The text to propose from now on (uploaded now if the last was)."""
        if not sequences or not all(sequences):
            raise FledgeError("--oracle: every sequence needs at least one token")
        self.sequences = sequences
        if self.seq is not None:
            self._upload(self.seq.device)

    def _upload(self, dev) -> None:
        """The sequences as one tensor, rows padded with their last token (read past its end, a
        row gives its last token). Where they fit the tensor already there, they are written
        into it: a round captured over it then reads them."""
        old, width = self.seq, max(map(len, self.sequences))
        fits = old is not None and old.device == dev and old.shape[0] == len(self.sequences) and old.shape[1] >= width
        width = old.shape[1] if fits else width
        rows = torch.tensor([s + s[-1:] * (width - len(s)) for s in self.sequences])
        if fits:
            old.copy_(rows)
        else:
            self.seq = rows.to(dev)

    def buffers(self) -> tuple:
        """The device tensors a captured round reads (see rounds.Round.serves)."""
        return (self.seq,)

    def start(self, batch: int, max_len: int) -> None:
        pass

    def observe(self, tokens, aux, n, next_token, start):
        pass

    def propose(self, inp: DraftInput) -> Tree:
        dev = inp.root.device
        if self.seq is None or self.seq.device != dev:
            self._upload(dev)
        if self.shape is None or self.shape[0].device != dev:  # a chain's parents, depth and mask never change
            t = chain(inp.root, inp.root[:, None].expand(-1, self.spec.num_steps))
            self.shape = (t.parents, t.depth, t.anc)
        # Compiled on CUDA, where it runs inside each fused round's graph: one kernel, not five.
        tokens = (_oracle_tokens_compiled if dev.type == "cuda" else _oracle_tokens)(self.seq, inp.root, inp.cache_len,
                                                                                    self.spec.num_steps)
        return Tree(tokens, *self.shape)


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens
    (n = max_n down to 1) and propose what followed it."""

    aux_ids = None
    device_only = False
    vocab = None

    def __init__(self, spec: Shape, max_n: int):
        if spec.topk != 1:
            raise FledgeError("--ngram drafts a chain: use --topk 1")
        if max_n < 1:
            raise FledgeError(f"--ngram {max_n}: must be >= 1")
        self.spec, self.max_n = spec, max_n

    def start(self, batch: int, max_len: int) -> None:
        pass

    def observe(self, tokens, aux, n, next_token, start):
        pass

    def lookup(self, ctx: list[int]) -> list[int]:
        for n in range(min(self.max_n, len(ctx) - 1), 0, -1):
            tail = ctx[-n:]
            for i in range(len(ctx) - n - 1, -1, -1):
                if ctx[i:i + n] == tail:
                    return ctx[i + n:i + n + self.spec.num_steps]
        return []

    def propose(self, inp: DraftInput) -> Tree:
        rows = [_pad_chain(self.lookup(ctx), self.spec.num_steps, ctx[-1]) for ctx in inp.context]
        return chain(inp.root, torch.tensor(rows, device=inp.root.device))


# The drafter's cache rows, rounded up: one compiled shape for most requests. Its attention
# reads every row, so the quantum is also what a draft step's attention costs.
DRAFT_CACHE_QUANTUM = 1024


class Eagle3Drafter:
    """EAGLE-3 drafting with its own static KV cache.

    Draft row p pairs the target's aux state at position p with token p+1 (the SGLang /
    SpecForge alignment), at rope position p. Rows [0, cache_len) always hold the verified
    context with the target's aux states; tree rows live in a scratch region after the context
    rows and are overwritten every round. Nothing reads the host context (`device_only`), so
    propose and observe can be CUDA graphs.

    `compile`: `propose` and the per-round `observe` go through torch.compile whole, tree
    bookkeeping included. A draft step is ~1/30 of a target step in bytes but, eager, ~80 small
    kernels: on the H200 at batch 1 a chain of 7 drafted in 1.93 ms against a 1.32 ms target
    step; compiled, a (5,4,16) tree drafts in 1.01 ms against 1.58 eager
    (bf16; docs/performance.md). The context rows are rounded up to
    DRAFT_CACHE_QUANTUM so that requests of different lengths share one compiled shape; the
    observe after the prefill (T = the prompt's length) stays eager for the same reason.
    """

    device_only = True

    def __init__(self, draft: Eagle3Draft, spec: Shape, target, compile: bool = False, fast_topk: bool = True):
        hidden, vocab, layers = target.dims()
        cfg = draft.cfg
        if cfg.target_hidden_size != hidden:
            raise FledgeError(f"drafter target_hidden_size {cfg.target_hidden_size} != target hidden size {hidden}")
        if cfg.vocab_size != vocab:
            raise FledgeError(f"drafter vocab_size {cfg.vocab_size} != target vocab size {vocab}")
        if cfg.target_num_layers != layers:
            raise FledgeError(f"drafter was built for a {cfg.target_num_layers}-layer target; this one has {layers}")
        # fast_topk: tree bookkeeping by max-reductions and ranks (tree.topk_by_max / topk_by_rank)
        # rather than torch.topk; the same trees (ties aside), fewer and shorter kernels. Compiled
        # whole with Inductor's split reductions, the max-reductions over a vocab for several
        # beams trip an assertion in torch 2.11's fusion pass (can_fuse: rnumel1 == 1; found on
        # the H200, reproduced on the CPU with torch 2.11 and Inductor's Triton scheduling), so
        # those are compiled unsplit and split by hand (tree.topk_by_max's chunks). On the H200 a
        # compiled (5, 4, 16) round took 1.90 ms this way against 2.28 with torch.topk
        # (bf16; docs/performance.md).
        self.draft, self.spec, self.compiled, self.fast_topk, self.kv = draft, spec, compile, fast_topk, None
        self.aux_ids = tuple(cfg.aux_layer_ids)
        self.to_target = draft.target_ids()
        self.vocab = frozenset(self.to_target.tolist())
        opts = {"split_reductions": False} if fast_topk else {}
        wrap = (lambda f: compile_static(f, options=opts)) if compile else (lambda f: f)
        self._propose, self._observe_round = wrap(self._propose_tree), wrap(self._observe)

    def start(self, batch: int, max_len: int) -> None:
        """Fresh static cache for a new request: max_len context rows (rounded up to
        DRAFT_CACHE_QUANTUM when compiled) + the tree scratch."""
        cfg, w = self.draft.cfg, self.draft.fc.weight
        self.max_len = -(-max_len // DRAFT_CACHE_QUANTUM) * DRAFT_CACHE_QUANTUM if self.compiled else max_len
        scratch = (self.spec.num_steps - 1) * self.spec.topk
        # per layer, K and V side by side
        shape = (cfg.num_hidden_layers, 2, batch, cfg.num_key_value_heads, self.max_len + scratch, cfg.head_dim)
        if self.kv is not None and tuple(self.kv.shape) == shape:
            # The same buffers again, zeroed: nothing is allocated per request, and a round kept
            # by a resident replays over them. (New buffers would cost no recompile either.)
            self.kv.zero_()
            self.last.zero_()
            return
        self.kv = torch.zeros(shape, dtype=w.dtype, device=w.device)
        self.last = torch.zeros(batch, cfg.hidden_size, dtype=w.dtype, device=w.device)

    def buffers(self) -> tuple:
        """The device tensors propose and observe read and write between calls: a round captured
        over them replays right while `start` keeps them (see rounds.Round.serves)."""
        return self.kv, self.last

    def _step(self, ids, hidden, positions, slots, mask, sdpa: bool = False):
        """One draft forward of T tokens per row, written at cache `slots` [B, T], attending
        under the bool `mask` [B, 1, T, S]. GQA without copying the cache: the G query heads of
        a kv head become G*T query rows of it (as the target's attn_in), the mask rows repeated.

        A round's steps write attention out (scores in fp32, a softmax, a product): with a mask,
        SDPA took cuDNN's flash kernel with 64-row query tiles for the 12 rows of a (5, 4, 16)
        step. The prompt's pass keeps SDPA (`sdpa`), whose memory does not grow with the
        prompt's length squared. On the H200 the written-out form and the chunked top-k
        (tree.topk_by_max) took a compiled (5, 4, 16) propose from 453 to 352 us and its observe
        from 82 to 67 (bf16, SmolLM2's shapes with random weights, the drafter shipped at
        fa24fc4, each half replayed as a CUDA graph; the whole round: docs/performance.md)."""
        cfg = self.draft.cfg
        m = mask.repeat(1, 1, cfg.num_attention_heads // cfg.num_key_value_heads, 1)  # once for every layer

        def attend(i, q, k, v):
            kv = self.kv[i]
            B, H, T, D = q.shape
            n_kv = k.shape[1]
            kv.scatter_(3, slots[None, :, None, :, None].expand(2, B, n_kv, T, D), torch.stack([k, v]))
            q = q.reshape(B, n_kv, H // n_kv * T, D)
            if sdpa:
                o = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=m)
            else:
                s = (q.float() @ kv[0].float().transpose(-1, -2) * D ** -0.5).masked_fill(~m, float("-inf"))
                o = s.softmax(-1).to(v.dtype) @ kv[1]
            return o.reshape(B, H, T, D)  # fp32 SDPA may return a strided layout

        return self.draft.step(ids, hidden, positions, attend)

    def observe(self, tokens, aux, n, next_token, start):
        """Re-feed verified tokens: rows start..start+n-1 get the target's fresh aux states
        (replacing whatever the draft guessed), paired with the following token. Rows past
        n-1 are padding: written beyond the verified context, never attended."""
        if tokens.shape[1] == self.spec.path_len:  # a round's path: one shape for the whole run
            self._observe_round(tokens, aux.to(self.kv.dtype), n, next_token, start)
            return
        with one_off_attention():  # the prompt: a shape per request
            self._observe(tokens, aux.to(self.kv.dtype), n, next_token, start, sdpa=True)

    def _observe(self, tokens, aux, n, next_token, start, sdpa: bool = False):
        B, T = tokens.shape
        ids = torch.cat([tokens[:, 1:], next_token[:, None]], dim=1)
        ids = ids.scatter(1, (n - 1)[:, None], next_token[:, None])
        pos = start[:, None] + torch.arange(T, device=ids.device)
        cols = torch.arange(self.kv.shape[4], device=ids.device)
        mask = (cols <= pos[:, :, None])[:, None]
        out = self._step(ids, aux, pos, pos, mask, sdpa)
        self.last.copy_(out.gather(1, (n - 1)[:, None, None].expand(B, 1, out.shape[-1]))[:, 0])

    def _top(self, out):
        """Top-k (log-prob, target id) of the draft's next-token distribution."""
        logits = self.draft.logits(out).float()
        if not self.fast_topk:
            logp, idx = F.log_softmax(logits, dim=-1).topk(self.spec.topk, dim=-1)
            return logp, self.to_target[idx]
        top, idx = topk_by_max(logits, self.spec.topk)
        return top - logsumexp_by_chunks(logits)[..., None], self.to_target[idx]

    def propose(self, inp: DraftInput) -> Tree:
        """EAGLE-2 dynamic tree: grow the topk best beams (by cumulative log-prob) one depth
        per draft forward, record every child as a candidate, keep the best N-1."""
        return Tree(*self._propose(inp.root, inp.cache_len))

    def _propose_tree(self, root, cache_len):
        K, dev = self.spec.topk, self.kv.device
        B = root.shape[0]
        score, tok = self._top(self.last)  # [B, K] depth-1 candidates, children of the root
        cands, scores = [tok], [score]
        parents = [torch.full((B, K), -1, device=dev)]
        depths = [torch.ones(B, K, dtype=torch.long, device=dev)]
        hidden = self.last[:, None].expand(B, K, -1)
        beam_cand = torch.arange(K, device=dev).expand(B, K)
        prefix = torch.arange(self.max_len, device=dev) < cache_len[:, None]  # [B, max_len]
        seen = torch.zeros(B, K, self.kv.shape[4] - self.max_len, dtype=torch.bool, device=dev)
        n_cand = K
        for i in range(1, self.spec.num_steps):
            slots = self.max_len + (i - 1) * K + torch.arange(K, device=dev).expand(B, K)
            seen = seen.scatter(2, (slots - self.max_len)[..., None], True)
            mask = torch.cat([prefix[:, None].expand(B, K, -1), seen], dim=2)[:, None]
            pos = (cache_len + i - 1)[:, None].expand(B, K)
            out = self._step(tok, hidden, pos, slots, mask)  # [B, K, H]
            logp, child = self._top(out)  # [B, K, K]
            child_score = (score[..., None] + logp).flatten(1)  # [B, K*K]
            cands.append(child.flatten(1))
            scores.append(child_score)
            parents.append(beam_cand[..., None].expand(B, K, K).flatten(1))
            depths.append(torch.full((B, K * K), i + 1, device=dev))
            score, pick = topk_by_rank(child_score, K) if self.fast_topk else child_score.topk(K, dim=1)
            beam = pick // K  # which beam each new beam grew from
            tok = child.flatten(1).gather(1, pick)
            hidden = out.gather(1, beam[..., None].expand(B, K, out.shape[-1]))
            seen = seen.gather(1, beam[..., None].expand_as(seen))
            beam_cand = n_cand + pick
            n_cand += K * K
        t = select_tree(root, torch.cat(cands, 1), torch.cat(scores, 1), torch.cat(parents, 1),
                        torch.cat(depths, 1), self.spec.num_draft_tokens, self.fast_topk)
        return t.tokens, t.parents, t.depth, t.anc


def load_drafter(path: str, spec: Shape, hf_model, engine_target, device, dtype,
                 compile: bool = False, fast_topk: bool = True) -> Eagle3Drafter:
    """The EAGLE-3 drafter of a checkpoint directory (either layout), its embeddings taken from
    the target `hf_model`, cast to the engine's device and dtype. `compile`, `fast_topk`: see
    Eagle3Drafter."""
    draft = load_checkpoint(path, embed_from=hf_model).eval().cast(device, dtype)
    return Eagle3Drafter(draft, spec, engine_target, compile, fast_topk)
