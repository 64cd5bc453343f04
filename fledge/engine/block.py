"""The DFlash block drafter in the engine: one draft forward proposes a chain of
`spec.num_steps` tokens, verified as any chain is (`fledge.engine.protocols.Drafter`).

The drafter keeps, per draft layer, the keys and values of every verified context token
(projected from the target's aux states, `DFlashDraft.context_kv`) in a static cache at the
token's position. A round's block is the root (the last sampled token) and `num_steps` mask
tokens at positions cache_len .. cache_len + num_steps; they attend to the context rows below
cache_len and to each other (both ways), and mask slot i's argmax is the token proposed at
its position. Nothing reads the host context (`device_only`): propose and observe can run in
a round's CUDA graph.
"""

from __future__ import annotations

import torch

from fledge.core.errors import FledgeError
from fledge.core.shape import Shape
from fledge.drafter.dflash import DFlashDraft
from fledge.drafter.dflash_checkpoint import load_dflash
from fledge.engine.layers import compile_static, one_off_attention
from fledge.engine.protocols import DraftInput
from fledge.engine.tree import Tree, chain

# Context rows rounded up to this when compiled: one compiled shape serves most requests.
BLOCK_CACHE_QUANTUM = 1024


class BlockDrafter:
    device_only = True

    def __init__(self, draft: DFlashDraft, spec: Shape, target, compile: bool = False):
        hidden, vocab, layers = target.dims()
        cfg = draft.cfg
        if (cfg.target_hidden_size, cfg.vocab_size, cfg.target_num_layers) != (hidden, vocab, layers):
            raise FledgeError(f"DFlash drafter built for a target of hidden {cfg.target_hidden_size}, vocab "
                              f"{cfg.vocab_size}, {cfg.target_num_layers} layers; this one has {hidden}, {vocab}, {layers}")
        if spec.topk != 1 or not 1 <= spec.num_steps <= cfg.block_size - 1:
            raise FledgeError(f"a DFlash drafter proposes a chain of 1..{cfg.block_size - 1} tokens (its block of "
                              f"{cfg.block_size}, the root included): shape {spec.label} does not fit")
        self.draft, self.spec, self.compiled, self.kv = draft, spec, compile, None
        self.aux_ids = tuple(cfg.aux_layer_ids)
        self.to_target = draft.target_ids()
        self.vocab = frozenset(self.to_target.tolist())
        wrap = compile_static if compile else (lambda f: f)
        self._propose, self._observe_round = wrap(self._propose_block), wrap(self._observe)

    def start(self, batch: int, max_len: int) -> None:
        """A zeroed context cache for a new request (the same buffers when the shape repeats)."""
        cfg, w = self.draft.cfg, self.draft.fc.weight
        self.max_len = -(-max_len // BLOCK_CACHE_QUANTUM) * BLOCK_CACHE_QUANTUM if self.compiled else max_len
        shape = (cfg.num_hidden_layers, 2, batch, cfg.num_key_value_heads, self.max_len, cfg.head_dim)
        if self.kv is not None and tuple(self.kv.shape) == shape:
            self.kv.zero_()
            return
        self.kv = torch.zeros(shape, dtype=w.dtype, device=w.device)

    def buffers(self) -> tuple:
        return (self.kv,)

    def observe(self, tokens, aux, n, next_token, start):
        """Context rows start .. start+T-1 from the target's aux states of the tokens that entered
        its cache. Rows past n-1 are padding: written past the verified context, never attended
        before a later observe rewrites them."""
        if tokens.shape[1] == self.spec.path_len:
            self._observe_round(aux, start)
            return
        with one_off_attention():  # the prompt: a shape per request
            self._observe(aux, start)

    def _observe(self, aux, start):
        B, T = aux.shape[:2]
        pos = start[:, None] + torch.arange(T, device=aux.device)
        slots = pos.clamp(max=self.max_len - 1)
        for layer, (k, v) in enumerate(self.draft.context_kv(aux.to(self.kv.dtype), pos)):
            idx = slots[:, None, :, None].expand(B, k.shape[1], T, k.shape[-1])
            self.kv[layer, 0].scatter_(2, idx, k)
            self.kv[layer, 1].scatter_(2, idx, v)

    def propose(self, inp: DraftInput) -> Tree:
        return Tree(*self._propose(inp.root, inp.cache_len))

    def _propose_block(self, root, cache_len):
        B, K, dev = root.shape[0], self.spec.num_steps, root.device
        ids = torch.cat([root[:, None], torch.full((B, K), self.draft.cfg.mask_token_id, device=dev)], 1)
        pos = cache_len[:, None] + torch.arange(K + 1, device=dev)
        context = (torch.arange(self.max_len, device=dev) < cache_len[:, None])[:, None, None, :]
        mask = torch.cat([context.expand(B, 1, K + 1, self.max_len),
                          torch.ones(B, 1, K + 1, K + 1, dtype=torch.bool, device=dev)], -1)

        def attend(layer, q, k, v):
            keys = torch.cat([self.kv[layer, 0], k], 2)
            values = torch.cat([self.kv[layer, 1], v], 2)
            rep = q.shape[1] // keys.shape[1]
            s = (q.float() @ keys.repeat_interleave(rep, 1).float().transpose(-1, -2)) * q.shape[-1] ** -0.5
            p = s.masked_fill(~mask, float("-inf")).softmax(-1).to(v.dtype)
            return p @ values.repeat_interleave(rep, 1)

        out = self.draft.block(ids, pos, attend)[:, 1:]
        tokens = self.to_target[self.draft.logits(out).float().argmax(-1)]
        t = chain(root, tokens)
        return t.tokens, t.parents, t.depth, t.anc


def load_block_drafter(path: str, spec: Shape, hf_model, engine_target, device, dtype,
                       compile: bool = False) -> BlockDrafter:
    """The DFlash drafter of a checkpoint directory, embeddings from the target `hf_model`."""
    draft = load_dflash(path, embed_from=hf_model).eval().cast(device, dtype)
    return BlockDrafter(draft, spec, engine_target, compile)


def load_block_rig(target: str, drafter: str, device: str | None, dtype: str | None,
                   chat_template: str | None = None):
    """(EngineRig, DFlashDraft): the target as `load_rig` builds it (compiled layers and CUDA
    graphs on CUDA, eager on the CPU) and the DFlash drafter of `drafter` beside it. The rig's
    `draft` is the DFlash drafter: timing helpers read only its aux layer ids."""
    from fledge.core.devices import pick_device, pick_dtype
    from fledge.core.target import eos_ids, load_target
    from fledge.engine.hf import build_engine_target
    from fledge.engine.layers import GEMV_ROWS, LayerFns
    from fledge.engine.rig import EngineRig

    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    compile = dev.type == "cuda"
    t = load_target(target, dtype=dt, device=dev, chat_template=chat_template, chat=True)
    draft = load_dflash(drafter, embed_from=t.model).eval().cast(dev, dt)
    fns = LayerFns.compiled(gemv_rows=GEMV_ROWS, few_rows=16) if compile else LayerFns()
    rig = EngineRig(t.model, t.tokenizer, build_engine_target(t.model, dt, dev, fns=fns), draft,
                    eos_ids(t.tokenizer, t.model.generation_config), dev, compile)
    return rig, draft
