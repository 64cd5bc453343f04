"""HF model -> engine: a transformers causal LM as the engine runs it. For the families with a
compact implementation, its config and weights become fledge.engine.model's Transformer
(`args_from_hf_config`, `engine_state_dict`, `transformer_from_hf`); any other causal LM runs
through transformers' own layers, with a KV cache, behind the same forward (`HFTarget`).
`build_engine_target` picks between them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from fledge.core.errors import FledgeError
from fledge.engine.attention import Prefix
from fledge.engine.layers import LayerFns
from fledge.engine.model import ModelArgs, Transformer

COMPACT_FAMILIES = ("llama", "qwen2", "qwen3")
# Rope types whose frequencies do not change with sequence length (dynamic/longrope do).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


# --------------------------------------------------------------------------- compact path
def args_from_hf_config(cfg) -> ModelArgs:
    """The compact engine's shapes and rope from a transformers config (its text part), or an
    error naming what the compact engine does not implement."""
    cfg = cfg.get_text_config()
    family = cfg.model_type
    if family not in COMPACT_FAMILIES:
        raise FledgeError(f"model_type {family!r} has no compact engine implementation ({', '.join(COMPACT_FAMILIES)})")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise FledgeError(f"hidden_act {cfg.hidden_act!r}: the compact engine implements SiLU MLPs only")
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()):
        raise FledgeError(f"{family}: sliding-window layers are not supported by the compact engine")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = cfg.rope_parameters
    rope_type = rope.get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise FledgeError(f"rope_type {rope_type!r}: the compact engine supports {', '.join(STATIC_ROPE_TYPES)}")
    if rope_type == "default":  # HF keeps this one on each model's rotary class; same formula
        inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        scale = 1.0
    else:
        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](cfg)
    bias = bool(getattr(cfg, "attention_bias", False))
    return ModelArgs(
        family=family, vocab_size=cfg.vocab_size, dim=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, n_layers=cfg.num_hidden_layers,
        n_heads=cfg.num_attention_heads, n_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
        head_dim=head_dim, norm_eps=cfg.rms_norm_eps,
        rope_inv_freq=tuple(inv_freq.float().tolist()), rope_scale=float(scale),
        qkv_bias=bias or family == "qwen2", o_bias=bias,
        mlp_bias=bool(getattr(cfg, "mlp_bias", False)), qk_norm=family == "qwen3",
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
    )


def engine_state_dict(hf_model, args: ModelArgs, dtype, device) -> dict[str, torch.Tensor]:
    """HF weight names → the compact Transformer's (q/k/v and gate/up concatenated)."""
    src = hf_model.state_dict()

    def get(*names):
        return torch.cat([src[n] for n in names]).to(device=device, dtype=dtype)

    sd = {"tok_embeddings.weight": get("model.embed_tokens.weight"), "norm.weight": get("model.norm.weight"),
          "inv_freq": torch.tensor(args.rope_inv_freq, dtype=torch.float32, device=device)}
    # Tied: one tensor behind both parameters (load_state_dict(assign=True) keeps it shared).
    sd["output.weight"] = sd["tok_embeddings.weight"] if args.tie_embeddings else \
        hf_model.get_output_embeddings().weight.detach().to(device=device, dtype=dtype)
    for i in range(args.n_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        sd[q + "attention.wqkv.weight"] = get(*(f"{attn}{x}_proj.weight" for x in "qkv"))
        sd[q + "attention.wo.weight"] = get(attn + "o_proj.weight")
        sd[q + "feed_forward.w13.weight"] = get(mlp + "gate_proj.weight", mlp + "up_proj.weight")
        sd[q + "feed_forward.w2.weight"] = get(mlp + "down_proj.weight")
        sd[q + "attention_norm.weight"] = get(p + "input_layernorm.weight")
        sd[q + "ffn_norm.weight"] = get(p + "post_attention_layernorm.weight")
        if args.qkv_bias:
            sd[q + "attention.wqkv.bias"] = get(*(f"{attn}{x}_proj.bias" for x in "qkv"))
        if args.o_bias:
            sd[q + "attention.wo.bias"] = get(attn + "o_proj.bias")
        if args.mlp_bias:
            sd[q + "feed_forward.w13.bias"] = get(mlp + "gate_proj.bias", mlp + "up_proj.bias")
            sd[q + "feed_forward.w2.bias"] = get(mlp + "down_proj.bias")
        if args.qk_norm:
            sd[q + "attention.q_norm.weight"] = get(attn + "q_norm.weight")
            sd[q + "attention.k_norm.weight"] = get(attn + "k_norm.weight")
    return sd


def transformer_from_hf(hf_model, dtype, device, compile: bool | str = False,
                        fns: LayerFns | None = None) -> Transformer:
    """The compact Transformer with `hf_model`'s weights, cast to dtype on device. `compile`:
    the layer functions through torch.compile (see LayerFns); a string is torch.compile's mode.
    `fns`, if given, are the layer functions (compile is then ignored)."""
    args = args_from_hf_config(hf_model.config)
    if fns is None:
        fns = LayerFns.compiled(compile if isinstance(compile, str) else None) if compile else LayerFns()
    with torch.device("meta"):
        model = Transformer(args, fns)
    model.load_state_dict(engine_state_dict(hf_model, args, dtype, device), strict=True, assign=True)
    return model.eval()


# --------------------------------------------------------------------------- generic HF path
@dataclass
class HFCache:
    """HFTarget's cache: per layer, the two tensors the model's attention hands its cache
    ([B, heads, slots, dim]; DeepSeek-V3 keeps its compressed latents there), allocated at the
    first write, and each slot's rope position (sliding-window masks are measured in them)."""

    keys: list  # per layer: [B, h, max_len, d] or None before the first write
    values: list
    positions: torch.Tensor  # [B, max_len] long
    used: int = 0  # slots [0, used) have been written in some row

    @property
    def max_len(self) -> int:
        return self.positions.shape[1]

    @classmethod
    def allocate(cls, layers: int, batch: int, max_len: int, device) -> HFCache:
        return cls([None] * layers, [None] * layers, torch.zeros(batch, max_len, dtype=torch.long, device=device))

    def write(self, layer: int, k, v, slots, n: int):
        """Layer `layer`'s new K and V [B, h, T, d] at the rows' `slots` [B, T]; what the layer
        attends over: the first n slots."""
        for store, new in ((self.keys, k), (self.values, v)):
            if store[layer] is None:
                store[layer] = new.new_zeros(new.shape[0], new.shape[1], self.max_len, new.shape[3])
            store[layer][torch.arange(new.shape[0], device=slots.device)[:, None], :, slots] = new.transpose(1, 2)
        return self.keys[layer][:, :, :n], self.values[layer][:, :, :n]

    def move(self, src, dst) -> None:
        """Slots src [B, D] → dst (rounds.compact: the accepted path into place)."""
        rows = torch.arange(src.shape[0], device=src.device)[:, None]
        for t in (*self.keys, *self.values):
            if t is not None:
                t[rows, :, dst] = t[rows, :, src]
        self.positions[rows, dst] = self.positions[rows, src]


class _SlotWrites(Cache):
    """The transformers Cache one HFTarget forward hands the model: every layer's new K and V
    go into the HFCache at each row's own slots (a tree's nodes, a padded batch's rows), and
    the layer attends over the cache's first n slots under fledge's mask."""

    def __init__(self, store: HFCache, slots, n: int):
        super().__init__(layers=[])
        self.store, self.slots, self.n = store, slots, n

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self.store.write(layer_idx, key_states, value_states, self.slots, self.n)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.n


class HFTarget(nn.Module):
    """Any HF causal LM behind the engine's forward, through transformers' own layers with a KV
    cache of fledge's slots (HFCache): a decode step computes only its new tokens, at HF's own
    cached speed, and it is exact (the reference path for families without a compact
    implementation: Gemma3, DeepSeek-V3/Kimi-K2, ...). Not CUDA-graph capturable."""

    # The capability flags every engine target declares (Transformer has the other values).
    compact = False  # no ModelArgs, no resident prefill
    cuda_graph_ok = False
    row_groups_ok = False
    prefix_kernel = False

    def dims(self) -> tuple[int, int, int]:
        """(hidden size, vocab size, layers)."""
        c = self.config
        return c.hidden_size, c.vocab_size, c.num_hidden_layers

    def __init__(self, hf_model):
        super().__init__()
        self.hf = hf_model.eval()
        self.config = hf_model.config.get_text_config()
        impl = self.config._attn_implementation
        if impl not in ("eager", "sdpa"):
            raise FledgeError(f"attn_implementation {impl!r}: HFTarget needs 'eager' or 'sdpa' (custom 4D masks)")
        kinds = set(getattr(self.config, "layer_types", None) or ()) - {"full_attention", "sliding_attention"}
        if kinds:
            raise FledgeError(f"{self.config.model_type}: layers of type {', '.join(sorted(kinds))} keep no "
                              f"K/V cache; fledge's engine runs attention-only models")

    def new_cache(self, batch: int, max_len: int) -> HFCache:
        return HFCache.allocate(self.config.num_hidden_layers, batch, max_len, self.hf.device)

    def _hf_mask(self, mask, q_pos, k_pos):
        """bool [B, 1, T, n] → what the model's layers take: eager adds a float mask, sdpa takes
        bool; sliding-window layers get their own mask (window measured in rope positions)."""

        def convert(m):
            if self.config._attn_implementation == "sdpa":
                return m
            return torch.zeros(m.shape, dtype=self.hf.dtype, device=m.device).masked_fill(~m, torch.finfo(self.hf.dtype).min)

        layer_types = set(getattr(self.config, "layer_types", None) or ())
        if "sliding_attention" not in layer_types:
            return convert(mask)
        near = (q_pos[:, :, None] - k_pos[:, None, :]) < self.config.sliding_window
        return {"full_attention": convert(mask), "sliding_attention": convert(mask & near[:, None])}

    def prefill(self, input_ids, cache: HFCache, aux_ids=None, logits_idx=None, rows=None):
        """A fresh batch at slots and positions 0..T-1, causal (as Transformer.prefill; whole
        batches only: `rows`, if given, must be all of the cache's)."""
        B, T = input_ids.shape
        if rows is not None and tuple(rows) != (0, cache.positions.shape[0]):
            raise FledgeError("HFTarget prefills whole batches (row_groups_ok is False)")
        pos = torch.arange(T, device=input_ids.device).expand(B, T)
        cols = torch.arange(cache.max_len, device=input_ids.device)
        mask = (cols <= torch.arange(T, device=input_ids.device)[:, None])[None, None].expand(B, 1, T, -1)
        return self(input_ids, pos, pos, mask, cache, aux_ids, logits_idx)

    def forward(self, input_ids, positions, slots, mask, cache: HFCache, aux_ids=None, logits_idx=None):
        B = input_ids.shape[0]
        rows = torch.arange(B, device=input_ids.device)[:, None]
        cache.positions[rows, slots] = positions
        cache.used = n = max(cache.used, int(slots.max()) + 1)
        mask = mask.dense(n) if isinstance(mask, Prefix) else mask[..., :n]
        if mask.shape[-1] < n:  # a decode step's span, the cache's first S slots: none past it
            mask = F.pad(mask, (0, n - mask.shape[-1]))
        # Only the rows' asked-for logits go through the head (a 262K vocabulary is most of a step).
        keep = None if logits_idx is None else logits_idx.flatten().unique()
        out = self.hf(input_ids=input_ids, position_ids=positions, past_key_values=_SlotWrites(cache, slots, n),
                      attention_mask=self._hf_mask(mask, positions, cache.positions[:, :n]), use_cache=True,
                      output_hidden_states=aux_ids is not None, logits_to_keep=0 if keep is None else keep)
        logits = out.logits.float()
        if keep is not None:
            at = torch.searchsorted(keep, logits_idx)
            logits = logits.gather(1, at[..., None].expand(-1, -1, logits.shape[-1]))
        aux = None if aux_ids is None else torch.cat([out.hidden_states[i] for i in aux_ids], dim=-1)
        return logits, aux


def build_engine_target(hf_model, dtype, device, compile: bool | str = False, fns: LayerFns | None = None):
    """The engine's view of a loaded HF model: the compact Transformer where fledge has one
    (`compile`, `fns`: see `transformer_from_hf`), else HFTarget (which moves `hf_model` itself
    to dtype/device), saying so in one line."""
    family = hf_model.config.get_text_config().model_type
    if family in COMPACT_FAMILIES:
        return transformer_from_hf(hf_model, dtype, device, compile, fns)
    print(f"fledge: {family} runs through transformers' own layers with a KV cache (fledge's compact engine, "
          f"faster and compilable, covers {', '.join(COMPACT_FAMILIES)})", file=sys.stderr)
    return HFTarget(hf_model.to(device=device, dtype=dtype))
