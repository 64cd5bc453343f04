"""The served checkpoint's layout, without torch: which tensors a drafter checkpoint holds
(names and shapes, from its DraftConfig), how each layout spells them, and a config.json of
either layout read back as a DraftConfig.

Layouts: `eagle3` (`LlamaForCausalLMEagle3`: fledge's own, SGLang's, SpecForge's; the layer
is `midlayer.*`) and `speculators` (vLLM's, the layer is `layers.0.*`). `fledge doctor` needs
only this module and numpy to check a checkpoint; `fledge.checkpoint` writes and loads with it.
"""

from __future__ import annotations

from fledge.config import DraftConfig
from fledge.conventions import aux_ids_from_sglang, aux_ids_to_sglang, rope_fields, validate_aux_layer_ids
from fledge.util import FledgeError


# --------------------------------------------------------------------------- tensor names
def checkpoint_keys(cfg: DraftConfig) -> dict[str, tuple[tuple[int, ...], bool]]:
    """The served checkpoint's tensors for `cfg`: name → (shape, required). Nothing else may be in it.

    The names and shapes are those of `Eagle3Draft(cfg).state_dict()` (tests/test_checkpoint.py
    holds the two equal); they are listed here so that reading a checkpoint needs no torch.
    Everything is required except `embed_tokens.weight` (engines share the target's embeddings)
    and `t2d` (engines skip it; fledge rebuilds it from `d2t`). `d2t` and
    `midlayer.hidden_norm.weight` are required because vLLM would silently load zeros / ones —
    except that a full-vocabulary drafter (draft_vocab_size == vocab_size) must NOT carry `d2t`:
    vLLM then registers no parameter for it and raises on the key (the map is the identity anyway).
    The speculators layout names the layer `layers.0.` instead of `midlayer.` (`layout_name`).
    """
    h, inter, v, dv = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.draft_vocab_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    layer = {"input_layernorm.weight": (h,), "hidden_norm.weight": (h,), "post_attention_layernorm.weight": (h,),
             "self_attn.q_proj.weight": (q, 2 * h), "self_attn.k_proj.weight": (kv, 2 * h),
             "self_attn.v_proj.weight": (kv, 2 * h), "self_attn.o_proj.weight": (h, q),
             "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter)}
    shapes = {"d2t": (dv,), "t2d": (v,), "embed_tokens.weight": (v, h), "fc.weight": (h, 3 * cfg.target_hidden_size),
              **{f"midlayer.{k}": s for k, s in layer.items()}, "norm.weight": (h,), "lm_head.weight": (dv, h)}
    if dv == v:
        del shapes["d2t"]
    optional = {"embed_tokens.weight", "t2d"}
    return {k: (s, k not in optional) for k, s in shapes.items()}


def layout_name(key: str, layout: str) -> str:
    """Our (eagle3) tensor name → its name in `layout`. vLLM accepts both spellings for both."""
    return "layers.0." + key[len("midlayer."):] if layout == "speculators" and key.startswith("midlayer.") else key


def canonical_name(key: str) -> str:
    return "midlayer." + key[len("layers.0."):] if key.startswith("layers.0.") else key


def serving_aux_ids(ids, num_layers: int) -> list[int]:
    """The aux ids written in `eagle_config` for canonical `ids`: SGLang's convention.

    SGLang reads only `eagle_config.eagle_aux_hidden_state_layer_ids` and captures
    hidden_states[k+1] for id k (`set_eagle3_layers_to_capture` adds 1), i.e. "output of layer
    k". vLLM reads the top-level `eagle_aux_hidden_state_layer_ids` first (canonical, written
    as-is), so with both lists written, both engines feed the drafter the same residual streams.
    """
    return list(aux_ids_to_sglang(ids, num_layers))


def aux_ids_from_serving(ids, num_layers: int) -> tuple[int, int, int]:
    """Inverse of `serving_aux_ids`: canonical ids from an `eagle_config` list."""
    return aux_ids_from_sglang(ids, num_layers)


# --------------------------------------------------------------------------- config.json
def detect_layout(cj: dict) -> str | None:
    if cj.get("speculators_model_type") is not None:
        return "speculators"
    if "LlamaForCausalLMEagle3" in (cj.get("architectures") or []):
        return "eagle3"
    return None


def _target_layers(cj: dict, target_layers: int | None) -> int:
    recorded = (cj.get("fledge") or {}).get("target_num_hidden_layers")
    if target_layers is not None and recorded is not None and int(recorded) != int(target_layers):
        raise FledgeError(f"config.json records a {recorded}-layer target, but {target_layers} layers were given")
    n = target_layers if target_layers is not None else recorded
    if n is None:
        raise FledgeError("the target's layer count is unknown (needed to place its aux layers): "
                          "pass --target-layers N or a target config")
    return int(n)


def aux_ids_of(top, nested, n: int) -> tuple[int, int, int]:
    """Canonical ids from a config's top-level list (canonical, what vLLM reads) and its
    eagle_config list (the serving spelling, what SGLang reads), which must name the same
    layers; SpecForge's default when neither is written."""
    if nested is None:  # SpecForge writes no ids and captures its default, "outputs of layers [1, N//2-1, N-4]"
        return validate_aux_layer_ids(top, n) if top else aux_ids_from_sglang([1, n // 2 - 1, n - 4], n)
    from_nested = aux_ids_from_serving(nested, n)
    if top and tuple(validate_aux_layer_ids(top, n)) != from_nested:
        raise FledgeError(f"aux ids disagree: top-level {list(top)} (vLLM reads) vs eagle_config {list(nested)} "
                          "(SGLang reads)")
    return from_nested


def draft_config_from_json(cj: dict, target_layers: int | None = None) -> DraftConfig:
    """DraftConfig from either layout's config.json (FledgeError on what fledge cannot serve)."""
    layout = detect_layout(cj)
    if layout is None:
        raise FledgeError("config.json is neither LlamaForCausalLMEagle3 nor a speculators eagle3 config")
    if layout == "speculators":
        if cj.get("speculators_model_type") != "eagle3":
            raise FledgeError(f"speculators_model_type {cj.get('speculators_model_type')!r}: only eagle3 is supported")
        layer = dict(cj.get("transformer_layer_config") or {})
        sc = cj.get("speculators_config") or {}
        methods = sc.get("proposal_methods") or [{}]
        extra = {"verifier": sc.get("verifier") or None, "speculative_tokens": methods[0].get("speculative_tokens")}
        norm_before_residual = cj.get("norm_before_residual", True)  # vLLM's default for this layout
    else:
        layer, fb = cj, cj.get("fledge") or {}
        extra = {"verifier": fb.get("verifier"), "speculative_tokens": fb.get("speculative_tokens")}
        norm_before_residual = cj.get("norm_before_residual", False)
    flags = [f for f in ("norm_before_fc", "fc_norm", "norm_output") if cj.get(f)]
    if norm_before_residual or flags:
        on = ", ".join((["norm_before_residual"] if norm_before_residual else []) + flags)
        raise FledgeError(f"{on}: variant drafter layers fledge's Eagle3Draft does not implement")
    if layer.get("model_type", "llama") != "llama":
        raise FledgeError(f"model_type {layer.get('model_type')!r}: fledge's drafter is a Llama layer")
    if layer.get("num_hidden_layers", 1) != 1:
        raise FledgeError(f"num_hidden_layers {layer.get('num_hidden_layers')}: an EAGLE-3 drafter has one layer")
    n = _target_layers(cj, target_layers)
    nested = None if layout == "speculators" else (cj.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    aux = aux_ids_of(cj.get("eagle_aux_hidden_state_layer_ids"), nested, n)
    h, heads = layer["hidden_size"], layer["num_attention_heads"]
    theta, scaling = rope_fields(layer)
    return DraftConfig(
        hidden_size=h, intermediate_size=layer["intermediate_size"], num_attention_heads=heads,
        num_key_value_heads=layer.get("num_key_value_heads") or heads, head_dim=layer.get("head_dim") or h // heads,
        vocab_size=layer["vocab_size"], draft_vocab_size=cj.get("draft_vocab_size") or layer["vocab_size"],
        target_hidden_size=cj.get("target_hidden_size") or h, target_num_layers=n,
        aux_layer_ids=aux, max_position_embeddings=layer["max_position_embeddings"],
        rms_norm_eps=layer.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
        hidden_act=layer.get("hidden_act", "silu"),
        torch_dtype=cj.get("torch_dtype") or layer.get("torch_dtype") or cj.get("dtype") or "bfloat16",
        extra={k: v for k, v in extra.items() if v is not None},
    )
