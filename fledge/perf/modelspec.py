"""A model's shape as the hardware model reads it (`ModelSpec`): from an HF config, a model
directory or a built-in name, for a target and its EAGLE-3 drafter. Torch-free."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from fledge.core.catalog import BUILTINS
from fledge.core.devices import short_dtype
from fledge.core.errors import FledgeError

BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int4": 4.5 / 8}


@dataclass(frozen=True)
class ModelSpec:
    """What the cost of a forward depends on, read from an HF config (dense, MoE, MLA) or an
    EAGLE-3 drafter config (`draft`)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int  # the LM head's rows (a drafter's draft vocabulary)
    experts: int = 0
    active: int = 0
    moe_intermediate: int = 0
    shared_experts: int = 0
    dense_layers: int = 0  # leading layers with a dense MLP in an MoE model
    mla: tuple | None = None  # (q_lora_rank or 0, kv_lora_rank, qk_nope, qk_rope, v_head)
    draft: bool = False
    dtype: str = "bf16"
    quant: str = "bf16"

    def attn_params(self) -> float:
        """Attention weights of one layer (a drafter's: the mean over its layers, since only the
        first reads [embedding ; hidden], 2H wide)."""
        h, n = self.hidden, self.heads
        if self.mla:
            q_lora, kv_lora, nope, rope, v = self.mla
            q = h * q_lora + q_lora * n * (nope + rope) if q_lora else h * n * (nope + rope)
            return q + h * (kv_lora + rope) + kv_lora * n * (nope + v) + n * v * h
        d_in = h * (1 + 1 / self.layers) if self.draft else h
        return d_in * (n + 2 * self.kv_heads) * self.head_dim + n * self.head_dim * h

    def kv_bytes_per_token(self, tp: int) -> float:
        """KV bytes per cached token per layer on one GPU."""
        if self.mla:
            return (self.mla[1] + self.mla[3]) * BYTES[self.dtype]
        return 2 * self.kv_heads * self.head_dim * BYTES[self.dtype] / min(tp, self.kv_heads)

    def attn_flops_per_token(self, context: int) -> float:
        if self.mla:  # weight-absorbed decoding attends over the latent
            qk, v = self.mla[1] + self.mla[3], self.mla[1]
        else:
            qk = v = self.head_dim
        return 2 * context * self.heads * (qk + v)

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.experts else 0

    def expert_params(self) -> float:
        return 3 * self.hidden * self.moe_intermediate


def distinct_experts(experts: int, active: int, rows: int) -> float:
    """Expected distinct experts `rows` tokens touch per layer under uniform routing."""
    return experts * (1 - (1 - active / experts) ** rows)


def _need(cfg: dict, where: str, name: str):
    if cfg.get(name) is None:
        raise FledgeError(f"{where}: no {name}; pass an HF config.json with the model's fields")
    return cfg[name]


def spec_from_config(cfg: dict, where: str, dtype: str = "bf16", quant: str | None = None,
                     draft_vocab: int | None = None) -> ModelSpec:
    """A ModelSpec from a config dict (multimodal configs: their text_config)."""
    cfg = cfg.get("text_config") or cfg
    draft = "LlamaForCausalLMEagle3" in (cfg.get("architectures") or []) or "draft_vocab_size" in cfg
    hidden, heads = int(_need(cfg, where, "hidden_size")), int(_need(cfg, where, "num_attention_heads"))
    experts = int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    mla = None
    if cfg.get("kv_lora_rank"):
        mla = (int(cfg.get("q_lora_rank") or 0), int(cfg["kv_lora_rank"]), int(_need(cfg, where, "qk_nope_head_dim")),
               int(_need(cfg, where, "qk_rope_head_dim")), int(_need(cfg, where, "v_head_dim")))
    q = quant or _config_quant(cfg) or dtype
    if dtype not in BYTES or q not in BYTES:
        raise FledgeError(f"--dtype {dtype} / --quant {q}: pass one of {', '.join(BYTES)}")
    return ModelSpec(
        layers=int(_need(cfg, where, "num_hidden_layers")), hidden=hidden, heads=heads,
        kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate=int(_need(cfg, where, "intermediate_size")),
        vocab=int(draft_vocab or cfg.get("draft_vocab_size") or _need(cfg, where, "vocab_size")),
        experts=experts, active=int(_need(cfg, where, "num_experts_per_tok")) if experts else 0,
        moe_intermediate=int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size")) if experts else 0,
        shared_experts=int(cfg.get("n_shared_experts") or 0), dense_layers=int(cfg.get("first_k_dense_replace") or 0),
        mla=mla, draft=draft, dtype=dtype, quant=q)


def _config_quant(cfg: dict) -> str | None:
    q = cfg.get("quantization_config") or {}
    bits = {w.get("weights", {}).get("num_bits") for w in (q.get("config_groups") or {}).values()}
    if 4 in bits or q.get("bits") == 4 or q.get("quant_method") in ("awq", "gptq"):
        return "int4"
    if q.get("quant_method") == "fp8" or 8 in bits:
        return "fp8"
    return None


def load_config(spec: str) -> tuple[dict, str]:
    """A config dict from a config.json, a model directory, or a built-in target name."""
    path = Path(spec).expanduser()
    if not path.exists():
        if spec not in BUILTINS:
            raise FledgeError(f"--model {spec!r}: not a config.json, a model directory, or a built-in ({', '.join(BUILTINS)})")
        from fledge.core.target import (
            resolve_target,  # loads torch, and converts a built-in once
        )

        path = resolve_target(spec)
    if path.is_dir():
        path = path / "config.json"
    try:
        return json.loads(path.read_text()), str(path)
    except (OSError, ValueError) as e:
        raise FledgeError(f"{path}: cannot read a JSON config ({e})") from None


def default_drafter(target: ModelSpec, draft_vocab: int = 32000) -> ModelSpec:
    """The EAGLE-3 layer fledge (and SpecForge) build for a target: attention geometry and MLP
    width of one dense target layer (MoE targets: the dense MLP width)."""
    head_dim = target.mla[4] if target.mla else target.head_dim
    return ModelSpec(1, target.hidden, target.heads, target.kv_heads, head_dim, target.intermediate,
                     min(draft_vocab, target.vocab), draft=True, dtype=target.dtype, quant=target.dtype)


def load_specs(model: str, drafter: str | None, dtype: str | None, quant: str | None, draft_vocab: int | None):
    """Target and drafter specs from a target config (file, directory, built-in name) and a
    drafter directory or config.json (None: `default_drafter`). `dtype` takes torch names too."""
    dtype = short_dtype(dtype or "bf16")
    cfg, where = load_config(model)
    target = spec_from_config(cfg, where, dtype, quant)
    if drafter and (Path(drafter).is_dir() or drafter.endswith(".json")):
        dcfg, dwhere = load_config(drafter)
        return target, spec_from_config(dcfg, dwhere, target.dtype, target.dtype, draft_vocab)
    if drafter:  # a hub id is fine for the printed flags; a mistyped path should not pass unnoticed
        print(f"fledge: --drafter {drafter}: no local directory or config.json; the hardware model assumes "
              f"the default drafter (one target-shaped layer)", file=sys.stderr)
    return target, default_drafter(target, draft_vocab or 32000)
