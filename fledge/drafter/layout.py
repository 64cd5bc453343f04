"""The served checkpoint's layout, without torch: which tensors a drafter checkpoint holds
(names and shapes, from its DraftConfig), how each layout spells them, and what its
config.json says.

Layouts: `eagle3` (`LlamaForCausalLMEagle3`: fledge's own, SGLang's, SpecForge's; the layer
is `midlayer.*`, its llama fields at the top level) and `speculators` (vLLM's: the layer is
`layers.0.*`, its fields in `transformer_layer_config`). `fledge doctor` needs only this module
and numpy to check a checkpoint; `fledge.drafter.checkpoint` writes and loads with it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from fledge.core.config import DraftConfig
from fledge.core.conventions import (
    aux_ids_from_sglang,
    aux_ids_to_dflash,
    rope_fields,
    validate_aux_layer_ids,
)
from fledge.core.errors import FledgeError

EAGLE3_ARCH = "LlamaForCausalLMEagle3"
DFLASH_ARCH = "DFlashDraftModel"  # vLLM's name for a DFlash block drafter


# --------------------------------------------------------------------------- tensor names
def checkpoint_keys(cfg: DraftConfig) -> dict[str, tuple[tuple[int, ...], bool]]:
    """The served checkpoint's tensors for `cfg`: name → (shape, required). Nothing else may be in it.

    The names and shapes are those of `Eagle3Draft(cfg).state_dict()` (tests/test_checkpoint.py
    holds the two equal); they are listed here so that reading a checkpoint needs no torch.
    EAGLE-3.1's `fc_norm` adds `fc_norm.{0,1,2}.weight`, P-EAGLE's `mask_hidden` (vLLM refuses a
    parallel-drafting checkpoint without it), each layer after the first `layers.{i}.*` (the
    names vLLM gives them; the first stays `midlayer.*`, which vLLM reads as `layers.0.*`). Everything is required except
    `embed_tokens.weight` (engines share the target's embeddings) and `t2d` (engines skip it;
    fledge rebuilds it from `d2t`). `d2t` and
    `midlayer.hidden_norm.weight` are required because vLLM would silently load zeros / ones —
    except that a full-vocabulary drafter (draft_vocab_size == vocab_size) must NOT carry `d2t`:
    vLLM then registers no parameter for it and raises on the key (the map is the identity anyway).
    """
    h, inter, v, dv = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.draft_vocab_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    layer = {"input_layernorm.weight": (h,), "hidden_norm.weight": (h,), "post_attention_layernorm.weight": (h,),
             "self_attn.q_proj.weight": (q, 2 * h), "self_attn.k_proj.weight": (kv, 2 * h),
             "self_attn.v_proj.weight": (kv, 2 * h), "self_attn.o_proj.weight": (h, q),
             "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter)}
    deep = {k: (s[0], h) if k.startswith("self_attn.") and k != "self_attn.o_proj.weight" else s
            for k, s in layer.items() if k != "hidden_norm.weight"}  # layers after the first read H, not 2H
    deep = {f"layers.{i}.{k}": s for i in range(1, cfg.num_hidden_layers) for k, s in deep.items()}
    fc_norm = {f"fc_norm.{i}.weight": (cfg.target_hidden_size,) for i in range(3)} if cfg.fc_norm else {}
    mask = {"mask_hidden": (1, 3 * cfg.target_hidden_size)} if cfg.parallel else {}
    shapes = {"d2t": (dv,), "t2d": (v,), "embed_tokens.weight": (v, h), **fc_norm, **mask,
              "fc.weight": (h, 3 * cfg.target_hidden_size), **{f"midlayer.{k}": s for k, s in layer.items()},
              **deep, "norm.weight": (h,), "lm_head.weight": (dv, h)}
    if dv == v:
        del shapes["d2t"]
    optional = {"embed_tokens.weight", "t2d"}
    return {k: (s, k not in optional) for k, s in shapes.items()}


def layout_name(key: str, layout: str) -> str:
    """Our (eagle3) tensor name → its name in `layout`. vLLM accepts both spellings for both."""
    return "layers.0." + key[len("midlayer."):] if layout == "speculators" and key.startswith("midlayer.") else key


def canonical_name(key: str) -> str:
    return "midlayer." + key[len("layers.0."):] if key.startswith("layers.0.") else key


# --------------------------------------------------------------------------- config.json
def detect_layout(cj: dict) -> str | None:
    if cj.get("speculators_model_type") is not None:
        return "speculators"
    return "eagle3" if EAGLE3_ARCH in (cj.get("architectures") or []) else None


@dataclass
class DraftFacts:
    """What a drafter's config.json says, wherever its layout keeps it, read without judging:
    a field the file lacks is None, and the checks decide what that means."""

    layout: str  # "speculators", else the architectures named ("LlamaForCausalLMEagle3" is the eagle3 layout)
    layer: dict  # the draft layer's llama fields
    hidden: int | None
    target_hidden: int | None
    vocab: int | None
    draft_vocab: int | None
    max_position: int | None
    num_layers: int | None
    rope: tuple
    aux_top: list | None  # top-level ids: canonical, what vLLM reads
    aux_nested: list | None  # eagle_config ids: SGLang's spelling, what SGLang reads
    use_aux: bool
    tied: bool
    dtype: str | None
    target_layers: int | None  # recorded by fledge export; engines keep no such field
    norm_before_residual: bool  # vLLM defaults it to true in the speculators layout (false for its peagle type)
    fc_norm: bool  # EAGLE-3.1 (fledge.drafter.eagle3); both engines default these two to false
    norm_output: bool
    ptd_token_id: int | None  # P-EAGLE's mask token (`mask_token_of`)
    verifier: str | None  # speculators layout: the target `vllm serve <dir>` loads
    speculative_tokens: int | None  # the trained depth; in the speculators layout, what `vllm serve <dir>` drafts


# Where vLLM's parallel drafting looks for the mask token in an EAGLE-3 config, in its order
# (`_init_parallel_drafting_params` in v1/spec_decode/llm_base_proposer.py): drafters trained
# elsewhere spell it differently; fledge writes `ptd_token_id`.
MASK_TOKEN_FIELDS = ("mask_token_id", "dspark_noise_token_id", "pard_token", "ptd_token_id")


def mask_token_of(cj: dict) -> int | None:
    """The mask token of an eagle3-layout P-EAGLE config.json as vLLM reads it (None: a
    sequential drafter)."""
    return next((cj[k] for k in MASK_TOKEN_FIELDS if cj.get(k) is not None), None)


def draft_facts(cj: dict) -> DraftFacts:
    spec = detect_layout(cj) == "speculators"
    peagle = spec and cj.get("speculators_model_type") == "peagle"  # speculators' P-EAGLE type
    layer = (cj.get("transformer_layer_config") or {}) if spec else cj
    ec = cj.get("eagle_config") or {}
    sc = (cj.get("speculators_config") or {}) if spec else {}
    fledge = cj.get("fledge") or {}
    method = (sc.get("proposal_methods") or [{}])[0]
    hidden = layer.get("hidden_size")
    return DraftFacts(
        layout="speculators" if spec else ",".join(cj.get("architectures") or ["(none)"]), layer=layer,
        hidden=hidden, target_hidden=cj.get("target_hidden_size") or hidden,
        vocab=layer.get("vocab_size"), draft_vocab=cj.get("draft_vocab_size"),
        max_position=layer.get("max_position_embeddings"), num_layers=layer.get("num_hidden_layers"),
        rope=rope_fields(layer), aux_top=cj.get("eagle_aux_hidden_state_layer_ids"),
        aux_nested=None if spec else ec.get("eagle_aux_hidden_state_layer_ids"),
        use_aux=bool(ec.get("use_aux_hidden_state", True)), tied=bool(layer.get("tie_word_embeddings", False)),
        dtype=layer.get("dtype") or layer.get("torch_dtype") or cj.get("dtype") or cj.get("torch_dtype"),
        target_layers=fledge.get("target_num_hidden_layers"),
        norm_before_residual=bool(cj.get("norm_before_residual", spec and not peagle)),
        fc_norm=bool(cj.get("fc_norm", False)), norm_output=bool(cj.get("norm_output", False)),
        ptd_token_id=cj.get("mask_token_id") if peagle else mask_token_of(cj),
        verifier=(sc.get("verifier") or {}).get("name_or_path"),
        speculative_tokens=(method if spec else fledge).get("speculative_tokens"))


def aux_ids_of(top, nested, n: int) -> tuple[int, int, int]:
    """Canonical ids from a config's top-level list (canonical, what vLLM reads) and its
    eagle_config list (SGLang's spelling, what SGLang reads), which must name the same
    layers; SpecForge's default when neither is written."""
    if nested is None:  # SpecForge writes no ids and captures its default, "outputs of layers [1, N//2-1, N-4]"
        return validate_aux_layer_ids(top, n) if top else aux_ids_from_sglang([1, n // 2 - 1, n - 4], n)
    from_nested = aux_ids_from_sglang(nested, n)
    if top and tuple(validate_aux_layer_ids(top, n)) != from_nested:
        raise FledgeError(f"aux ids disagree: top-level {list(top)} (vLLM reads) vs eagle_config {list(nested)} "
                          "(SGLang reads)")
    return from_nested


def _target_layers(recorded, given: int | None) -> int:
    if given is not None and recorded is not None and int(recorded) != int(given):
        raise FledgeError(f"config.json records a {recorded}-layer target, but {given} layers were given")
    n = given if given is not None else recorded
    if n is None:
        raise FledgeError("the target's layer count is unknown (needed to place its aux layers): "
                          "pass --target-layers N or a target config")
    return int(n)


def draft_config_from_json(cj: dict, target_layers: int | None = None) -> DraftConfig:
    """DraftConfig from either layout's config.json (FledgeError on what fledge cannot serve)."""
    layout = detect_layout(cj)
    if layout is None:
        raise FledgeError("config.json is neither LlamaForCausalLMEagle3 nor a speculators eagle3 config")
    if layout == "speculators" and cj["speculators_model_type"] not in ("eagle3", "peagle"):
        raise FledgeError(f"speculators_model_type {cj['speculators_model_type']!r}: only eagle3 and peagle are "
                          "supported")
    f = draft_facts(cj)
    variants = (["norm_before_residual"] if f.norm_before_residual else []) + (
        ["norm_before_fc"] if cj.get("norm_before_fc") else [])
    if variants:
        raise FledgeError(f"{', '.join(variants)}: variant drafter layers fledge's Eagle3Draft does not implement")
    layer = f.layer
    if layer.get("model_type", "llama") != "llama":
        raise FledgeError(f"model_type {layer.get('model_type')!r}: fledge's drafter is a Llama layer")
    n = _target_layers(f.target_layers, target_layers)
    h, heads = layer["hidden_size"], layer["num_attention_heads"]
    theta, scaling = f.rope
    verifier = (cj.get("speculators_config" if layout == "speculators" else "fledge") or {}).get("verifier")
    extra = {"verifier": verifier or None, "speculative_tokens": f.speculative_tokens}
    return DraftConfig(
        hidden_size=h, intermediate_size=layer["intermediate_size"], num_attention_heads=heads,
        num_key_value_heads=layer.get("num_key_value_heads") or heads, head_dim=layer.get("head_dim") or h // heads,
        vocab_size=layer["vocab_size"], draft_vocab_size=cj.get("draft_vocab_size") or layer["vocab_size"],
        target_hidden_size=cj.get("target_hidden_size") or h, target_num_layers=n,
        aux_layer_ids=aux_ids_of(f.aux_top, f.aux_nested, n), max_position_embeddings=layer["max_position_embeddings"],
        rms_norm_eps=layer.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
        hidden_act=layer.get("hidden_act", "silu"),
        torch_dtype=f.dtype or "bfloat16", fc_norm=f.fc_norm, norm_output=f.norm_output, ptd_token_id=f.ptd_token_id,
        num_hidden_layers=layer.get("num_hidden_layers", 1),
        extra={k: v for k, v in extra.items() if v is not None},
    )


def dflash_view(cj: dict) -> dict | None:
    """A DFlash config.json as vLLM's `DFlashDraftModel` layout spells it (None if `cj` is no
    DFlash drafter): that layout as it is, or the speculators library's `dflash` type mapped the
    way vLLM's speculators reader maps it (the Qwen3 fields from `transformer_layer_config`,
    canonical `aux_hidden_state_layer_ids` to DFlash's `target_layer_ids`, the top-level
    `mask_token_id`, the verifier from `speculators_config`)."""
    if cj.get("speculators_model_type") != "dflash":
        return cj if DFLASH_ARCH in (cj.get("architectures") or []) else None
    ids, fl = cj.get("aux_hidden_state_layer_ids"), dict(cj.get("fledge") or {})
    ver = ((cj.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    if ver:
        fl.setdefault("verifier", {"name_or_path": ver})
    return {**(cj.get("transformer_layer_config") or {}), "architectures": [DFLASH_ARCH],
            "draft_vocab_size": cj.get("draft_vocab_size"), "target_hidden_size": cj.get("target_hidden_size"),
            "block_size": cj.get("block_size"), "fledge": fl,
            "dflash_config": {"mask_token_id": cj.get("mask_token_id"),
                              "target_layer_ids": None if ids is None else aux_ids_to_dflash(ids)}}


def is_dflash(path) -> bool:
    """Whether the checkpoint dir `path` holds a DFlash drafter, in either layout (by its
    config.json); torch-free, so doctor and tune tell the methods apart without loading torch."""
    p = Path(path) / "config.json"
    try:
        return dflash_view(json.loads(p.read_text())) is not None
    except (OSError, json.JSONDecodeError, AttributeError):
        return False


def is_parallel(path) -> bool:
    """Whether the checkpoint dir `path` holds a P-EAGLE drafter (a mask token in its config.json,
    `draft_facts`); torch-free, as `is_dflash`."""
    p = Path(path) / "config.json"
    try:
        return draft_facts(json.loads(p.read_text())).ptd_token_id is not None
    except (OSError, json.JSONDecodeError, AttributeError):
        return False
