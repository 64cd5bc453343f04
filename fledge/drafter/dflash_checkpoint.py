"""DFlash checkpoints as vLLM's `DFlashDraftModel` loader reads them, unchanged.

config.json: a Qwen3 config (`model_type: qwen3`) naming the architecture `DFlashDraftModel`,
the draft's `block_size`, and `dflash_config: {mask_token_id, target_layer_ids}` (DFlash's
layer ids: `conventions.aux_ids_to_dflash`); `draft_vocab_size` and `target_hidden_size` at the
top level. The weights: `DFlashDraft.state_dict()` less `embed_tokens` (vLLM shares the
target's), `t2d` (vLLM skips it), and `d2t` when the draft vocabulary is the whole vocabulary
(vLLM then registers no parameter for it and refuses the key). What no vLLM field holds (the
target's layer count, the verifier) goes in a `fledge` block that vLLM ignores.

The `speculators` layout (the speculators library's `dflash` type, which vLLM reads too) holds
the same tensors; its config.json keeps the Qwen3 fields in `transformer_layer_config`, the
canonical aux ids in `aux_hidden_state_layer_ids`, `mask_token_id` and `block_size` at the top
level, and the target in `speculators_config.verifier` (`layout.dflash_view` reads both).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from safetensors.torch import save as st_save

from fledge.core.catalog import BUILTINS, DFLASH_LAYOUTS
from fledge.core.conventions import (
    aux_ids_from_dflash,
    aux_ids_to_dflash,
    rope_fields,
    target_ids_from_d2t,
)
from fledge.core.errors import FledgeError
from fledge.core.files import atomic_dir, write_file
from fledge.drafter.dflash import DFlashConfig, DFlashDraft
from fledge.drafter.layout import DFLASH_ARCH, dflash_view

WEIGHTS = "model.safetensors"


def config_json(cfg: DFlashConfig, dtype: torch.dtype, verifier: str | None = None, layout: str = "dflash") -> dict:
    """The config.json of `cfg` in `layout` (DFLASH_LAYOUTS; the module doc)."""
    if layout not in DFLASH_LAYOUTS:
        raise FledgeError(f"layout {layout!r}: a DFlash drafter is written as {' or '.join(DFLASH_LAYOUTS)}")
    ver = verifier or (cfg.extra.get("verifier") or {}).get("name_or_path")
    qwen3 = {"model_type": "qwen3", "hidden_size": cfg.hidden_size,
             "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
             "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
             "head_dim": cfg.head_dim, "hidden_act": "silu", "attention_bias": False, "rms_norm_eps": cfg.rms_norm_eps,
             "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
             "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
             "tie_word_embeddings": False, "torch_dtype": str(dtype).removeprefix("torch.")}
    sizes = {"draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
             "block_size": cfg.block_size}
    if layout == "dflash":
        return {"architectures": [DFLASH_ARCH], **qwen3, **sizes,
                "dflash_config": {"mask_token_id": cfg.mask_token_id,
                                  "target_layer_ids": aux_ids_to_dflash(cfg.aux_layer_ids)},
                "fledge": {"method": "dflash", "target_num_hidden_layers": cfg.target_num_layers,
                           "verifier": {"name_or_path": ver} if ver else None}}
    if not ver or ver in BUILTINS:
        raise FledgeError("the speculators layout names the target model vLLM serves: pass --verifier with the "
                          "target's HF directory or hub id")
    return {"architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash", "speculators_version": "0.3.0",
            "speculators_config": {
                "algorithm": "dflash", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.block_size - 1,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "verifier": {"name_or_path": ver, "architectures": []}},
            "transformer_layer_config": qwen3, **sizes, "aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
            "mask_token_id": cfg.mask_token_id, "torch_dtype": qwen3["torch_dtype"],
            # every layer attends over the whole block, as in the dflash layout
            "sliding_window_non_causal": True,
            "fledge": {"method": "dflash", "target_num_hidden_layers": cfg.target_num_layers}}


def config_from_json(cj: dict, where) -> DFlashConfig:
    """DFlashConfig of a DFlash config.json in either layout (FledgeError naming `where` on what
    fledge cannot serve)."""
    view = dflash_view(cj)
    if view is None:
        raise FledgeError(f"{where}: architectures {cj.get('architectures')}: not a {DFLASH_ARCH} "
                          "(nor a speculators dflash config)")
    cj = view
    dc, fl = cj.get("dflash_config") or {}, cj.get("fledge") or {}
    try:
        theta, scaling = rope_fields(cj)
        h, heads = cj["hidden_size"], cj["num_attention_heads"]
        return DFlashConfig(
            hidden_size=h, intermediate_size=cj["intermediate_size"], num_hidden_layers=cj["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=cj.get("num_key_value_heads") or heads,
            head_dim=cj.get("head_dim") or h // heads, vocab_size=cj["vocab_size"],
            draft_vocab_size=cj.get("draft_vocab_size") or cj["vocab_size"],
            target_hidden_size=cj.get("target_hidden_size") or h,
            target_num_layers=fl["target_num_hidden_layers"],
            aux_layer_ids=aux_ids_from_dflash(dc["target_layer_ids"]), block_size=cj["block_size"],
            mask_token_id=dc["mask_token_id"], max_position_embeddings=cj["max_position_embeddings"],
            rms_norm_eps=cj.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
            extra={"verifier": fl.get("verifier")} if fl.get("verifier") else {})
    except (KeyError, TypeError) as e:
        raise FledgeError(f"{where}: DFlash config lacks {e}") from None


def served_tensors(draft: DFlashDraft) -> dict[str, torch.Tensor]:
    """The state dict entries a served checkpoint holds (see the module doc)."""
    full = draft.cfg.draft_vocab_size == draft.cfg.vocab_size
    skip = {"embed_tokens.weight", "t2d"} | ({"d2t"} if full else set())
    return {k: v for k, v in draft.state_dict().items() if k not in skip}


def export_dflash(draft: DFlashDraft, out_dir, dtype=torch.bfloat16, verifier: str | None = None,
                  overwrite: bool = False, layout: str = "dflash") -> Path:
    """Write `draft` as a DFlash checkpoint dir in `layout`, atomically, re-read before it appears."""
    tensors = {k: (v.detach().cpu().to(dtype) if v.is_floating_point() else v.detach().cpu().to(torch.int64)).contiguous()
               for k, v in served_tensors(draft).items()}
    out_dir = Path(out_dir)
    with atomic_dir(out_dir, overwrite=overwrite) as tmp:
        cj = config_json(draft.cfg, dtype, verifier, layout)
        write_file(tmp / "config.json", (json.dumps(cj, indent=2) + "\n").encode())
        write_file(tmp / WEIGHTS, st_save(tensors, metadata={"format": "pt"}))
        load_dflash(tmp)  # refuses what it cannot read back
    return out_dir


def load_dflash(path, embed_from=None) -> DFlashDraft:
    """A DFlashDraft (fp32) from a checkpoint dir; its embeddings from the HF model
    `embed_from`, else NaN (a forward without the target's embeddings must fail loudly)."""
    path = Path(path)
    try:
        cj = json.loads((path / "config.json").read_text())
        tensors = load_file(path / WEIGHTS)
    except (OSError, json.JSONDecodeError, SafetensorError) as e:
        raise FledgeError(f"{path}: cannot read a DFlash checkpoint ({e})") from None
    cfg = config_from_json(cj, path / "config.json")
    draft = DFlashDraft(cfg)
    want = {k: v.shape for k, v in served_tensors(draft).items()}
    got = {k: v.shape for k, v in tensors.items()}
    for k in sorted(set(want) | set(got)):
        if k not in got:
            raise FledgeError(f"{path / WEIGHTS}: missing tensor {k}")
        if k not in want:
            raise FledgeError(f"{path / WEIGHTS}: unexpected tensor {k} (vLLM refuses unknown keys)")
        if got[k] != want[k]:
            raise FledgeError(f"{path / WEIGHTS}: {k} has shape {list(got[k])}, the config implies {list(want[k])}")
    draft.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}, strict=False)
    if "d2t" in tensors:
        draft.set_vocab(torch.from_numpy(target_ids_from_d2t(tensors["d2t"], cfg.vocab_size)))
    with torch.no_grad():
        if embed_from is None:
            draft.embed_tokens.weight.fill_(float("nan"))
        else:
            emb = embed_from.get_input_embeddings().weight
            if emb.shape != draft.embed_tokens.weight.shape:
                raise FledgeError(f"{path}: the target's embeddings {list(emb.shape)} do not fit the drafter")
            draft.embed_tokens.weight.copy_(emb.float())
    return draft
