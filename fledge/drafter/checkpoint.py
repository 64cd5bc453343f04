"""`fledge export / import / init-draft`: drafter checkpoints that SGLang and vLLM load as-is.

Two layouts are written and read (`fledge.drafter.layout` names their tensors and reads their
config.json; `fledge.drafter.weights` finds and reads the files): `eagle3` (`LlamaForCausalLMEagle3`:
SGLang, vLLM, SpecForge, EAGLE) and vLLM's `speculators`, whose config names the target in
`speculators_config.verifier` so that `vllm serve <dir>` alone knows what to verify with.
SpecForge / AQ-MedAI drafters are eagle3 layouts that may lack `eagle_config`, `t2d`,
`target_hidden_size` or `head_dim`; they import too.

Everything is checked before it is trusted (`validate_checkpoint`): vLLM raises on unknown
keys while SGLang ignores them, and vLLM fills a missing `d2t` with zeros and a missing
`hidden_norm` with ones without a word — so fledge refuses all three. What no engine field
holds (the target's layer count, which the aux ids are checked against; the verifier; the
trained speculative depth) goes in a `fledge` block of config.json that engines ignore.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save as st_save

from fledge.core.catalog import BUILTINS, LAYOUTS
from fledge.core.config import DraftConfig
from fledge.core.conventions import (
    aux_ids_to_sglang,
    t2d_from_target_ids,
    target_ids_from_d2t,
)
from fledge.core.errors import FledgeError
from fledge.core.files import atomic_dir, write_file
from fledge.drafter.eagle3 import Eagle3Draft
from fledge.drafter.layout import (
    canonical_name,
    checkpoint_keys,
    detect_layout,
    draft_config_from_json,
    layout_name,
)
from fledge.drafter.weights import INDEX, Checkpoint, open_checkpoint

DEFAULT_SPECULATIVE_TOKENS = 3
# Tensors vLLM fills in without a word when a checkpoint lacks them.
SILENT_DEFAULTS = {"d2t": " (vLLM would silently use all-zero offsets)",
                   "midlayer.hidden_norm.weight": " (vLLM would silently use ones)"}


# --------------------------------------------------------------------------- config.json
def _llama_fields(cfg: DraftConfig, dtype: torch.dtype) -> dict:
    return {
        "model_type": "llama", "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "num_hidden_layers": cfg.num_hidden_layers, "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False, "torch_dtype": str(dtype).removeprefix("torch."),
    }


def config_json(cfg: DraftConfig, layout: str, dtype: torch.dtype, verifier: str | None = None) -> dict:
    """The config.json for `cfg` in `layout`. `norm_before_residual: false` is written because
    vLLM's speculators reader defaults it to true, which is not this drafter's layer. The aux
    ids are written twice: canonical at the top level, which vLLM reads first, and in SGLang's
    spelling in eagle_config, the only list SGLang reads, so both capture the same streams.
    EAGLE-3.1's `fc_norm` and `norm_output` go at the top level, where both engines (and vLLM's
    speculators reader) look, and only when set: both default to false. So does P-EAGLE's
    `ptd_token_id`, the mask token vLLM's `parallel_drafting` reads; in the speculators layout a
    P-EAGLE drafter is speculators' `peagle` type instead, its mask token `mask_token_id` (the
    field vLLM's speculators reader requires of it), and `vllm serve <dir>` drafts in parallel."""
    ver = dict(cfg.extra.get("verifier") or {})
    if verifier and verifier != ver.get("name_or_path"):
        ver = {"name_or_path": verifier, "architectures": []}
    k = int(cfg.extra.get("speculative_tokens", DEFAULT_SPECULATIVE_TOKENS))
    ids, n = list(cfg.aux_layer_ids), cfg.target_num_layers
    common = {"draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
              "norm_before_residual": False, "eagle_aux_hidden_state_layer_ids": ids,
              **{k: True for k, on in (("fc_norm", cfg.fc_norm), ("norm_output", cfg.norm_output)) if on}}
    if layout == "eagle3":
        return {"architectures": ["LlamaForCausalLMEagle3"], **_llama_fields(cfg, dtype), **common,
                **({"ptd_token_id": cfg.ptd_token_id} if cfg.parallel else {}),
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_ids_to_sglang(ids, n)),
                                 "use_aux_hidden_state": True},
                "fledge": {"target_num_hidden_layers": n, "verifier": ver or None, "speculative_tokens": k}}
    if not ver.get("name_or_path"):
        raise FledgeError("the speculators layout names the target model vLLM serves: pass --verifier NAME")
    if ver["name_or_path"] in BUILTINS:
        raise FledgeError(f"verifier {ver['name_or_path']!r} is a fledge built-in name, which vLLM cannot load: "
                          "pass --verifier with the target's HF directory or hub id")
    layer = _llama_fields(cfg, dtype)
    kind, arch = ("peagle", "PEagleSpeculator") if cfg.parallel else ("eagle3", "Eagle3Speculator")
    return {
        "architectures": [arch], "speculators_model_type": kind, "speculators_version": "0.3.0",
        **({"mask_token_id": cfg.ptd_token_id} if cfg.parallel else {}),
        "speculators_config": {
            "algorithm": kind, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": ver["name_or_path"], "architectures": ver.get("architectures", [])}},
        "transformer_layer_config": layer, **common, "norm_before_fc": False,
        "torch_dtype": layer["torch_dtype"], "fledge": {"target_num_hidden_layers": n},
    }


def verifier_of(target) -> dict:
    """How a drafter's config records the target it was made for (what `vllm serve <dir>` loads)."""
    archs = list(target.model.config.architectures or [])
    return {"name_or_path": str(target.path or target.name), "architectures": archs}


# --------------------------------------------------------------------------- reading
def _torch_tensors(ck: Checkpoint) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """A checkpoint's tensors under our names, and the file each came from."""
    tensors, origin = {}, {}
    for k, v in ck.weights.torch_tensors().items():
        name, f = canonical_name(k), ck.weights.files[k]
        if name in tensors:
            raise FledgeError(f"{f}: {k} appears twice ({origin[name].name} too)")
        tensors[name], origin[name] = v, f
    return tensors, origin


def _target_ids(tensors: dict, cfg: DraftConfig) -> torch.Tensor:
    """Target id of every draft id; a full-vocabulary drafter has no d2t and maps to itself."""
    if "d2t" not in tensors:
        return torch.arange(cfg.vocab_size)
    return torch.from_numpy(target_ids_from_d2t(tensors["d2t"], cfg.vocab_size))


def tensor_problems(tensors: dict, origin: dict, cfg: DraftConfig, where: Path) -> list[str]:
    """What an engine would load wrongly (or refuse) in `tensors` for `cfg`."""
    spec = checkpoint_keys(cfg)
    problems = [f"{where}: missing tensor {k}{SILENT_DEFAULTS.get(k, '')}"
                for k, (_, required) in spec.items() if required and k not in tensors]
    for k, t in tensors.items():
        f = origin[k]
        if k == "d2t" and k not in spec:
            problems.append(f"{f}: d2t in a full-vocabulary drafter (vLLM has no parameter for it and refuses it)")
        elif k not in spec:
            problems.append(f"{f}: unexpected tensor {k} (vLLM refuses unknown keys)")
        elif tuple(t.shape) != spec[k][0]:
            problems.append(f"{f}: {k} has shape {list(t.shape)} but config.json implies {list(spec[k][0])}")
        elif k == "d2t" and (t.dtype.is_floating_point or t.dtype == torch.bool):
            problems.append(f"{f}: d2t has dtype {t.dtype}; it holds integer offsets")
        elif k == "t2d" and t.dtype != torch.bool:
            problems.append(f"{f}: t2d has dtype {t.dtype}; it is a bool mask")
        elif t.dtype.is_floating_point and not bool(torch.isfinite(t).all()):
            problems.append(f"{f}: {k} contains NaN or inf")
    if problems:
        return problems
    try:
        ids = _target_ids(tensors, cfg)
    except FledgeError as e:
        return [f"{origin['d2t']}: {e}"]
    if "t2d" in tensors and not torch.equal(tensors["t2d"], t2d_from_target_ids(ids, cfg.vocab_size)):
        return [f"{origin['t2d']}: t2d does not mark the target ids d2t maps to"]
    return []


@dataclass
class ReadCheckpoint:
    """A checkpoint dir as read: its config, layout, and tensors under our names."""

    cfg: DraftConfig
    layout: str
    tensors: dict


def _inspect(path, target_layers: int | None = None) -> tuple[ReadCheckpoint | None, list[str]]:
    """Read and check a checkpoint dir: what was read (None if it could not be), and the problems."""
    ck = open_checkpoint(path)
    if ck.config is None:
        return None, ck.unreadable()[:1]
    try:
        cfg = draft_config_from_json(ck.config, target_layers)
    except (FledgeError, KeyError, TypeError, ValueError) as e:
        return None, [f"{ck.path / 'config.json'}: {e if isinstance(e, FledgeError) else f'missing or bad field {e}'}"]
    if ck.weights is None:
        return None, ck.unreadable()
    try:
        tensors, origin = _torch_tensors(ck)
    except FledgeError as e:
        return None, [str(e)]
    index = ck.path / INDEX
    where = index if index.exists() else ck.files[0] if len(ck.files) == 1 else ck.path  # names missing tensors
    return ReadCheckpoint(cfg, detect_layout(ck.config), tensors), tensor_problems(tensors, origin, cfg, where)


def validate_checkpoint(path, target_layers: int | None = None) -> list[str]:
    """Problems found in a drafter checkpoint dir (either layout), each one line naming the file;
    [] if SGLang and vLLM would both load it as fledge means it."""
    return _inspect(path, target_layers)[1]


def read_checkpoint(path, target_layers=None, embed_from=None) -> tuple[Eagle3Draft, ReadCheckpoint]:
    """The drafter in `path` and what was read (its layout, config and tensors), refused in one line
    if the checkpoint fails its checks."""
    if target_layers is None and embed_from is not None:
        target_layers = embed_from.config.get_text_config().num_hidden_layers
    r, problems = _inspect(path, target_layers)
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise FledgeError(problems[0] + more)
    draft = Eagle3Draft(r.cfg)
    draft.load_state_dict({k: v for k, v in r.tensors.items() if k != "t2d"}, strict=False)
    draft.set_vocab(_target_ids(r.tensors, r.cfg))  # also rebuilds t2d
    if "embed_tokens.weight" in r.tensors:
        return draft, r
    if embed_from is None:
        with torch.no_grad():  # NaN, not random: a drafter run without the target's embeddings must fail loudly
            draft.embed_tokens.weight.fill_(float("nan"))
    else:
        draft.take_embeddings(embed_from)
    return draft, r


def load_checkpoint(path, target_layers: int | None = None, embed_from=None) -> Eagle3Draft:
    """An Eagle3Draft from any supported layout (fp32 weights). A checkpoint without
    `embed_tokens` gets `embed_from`'s (an HF model; it also supplies the target's layer
    count), else NaN embeddings that make any forward visibly wrong.
    Raises FledgeError naming the first problem `validate_checkpoint` finds."""
    return read_checkpoint(path, target_layers, embed_from)[0]


# --------------------------------------------------------------------------- writing
def _shards(tensors: dict[str, torch.Tensor], shard_size_mb: float | None) -> list[dict]:
    if not shard_size_mb:
        return [tensors]
    limit, shards, size = shard_size_mb * 2**20, [{}], 0
    for k, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][k], size = t, size + nbytes
    return shards


def _write_weights(out: Path, tensors: dict, shard_size_mb) -> None:
    shards = _shards(tensors, shard_size_mb)
    if len(shards) == 1:
        write_file(out / "model.safetensors", st_save(shards[0], metadata={"format": "pt"}))
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        write_file(out / name, st_save(shard, metadata={"format": "pt"}))
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    write_file(out / INDEX,
               (json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n").encode())


def export_checkpoint(draft: Eagle3Draft, out_dir, layout="eagle3", dtype=torch.bfloat16, shard_size_mb=None,
                      with_embed=False, verifier: str | None = None, overwrite=False) -> Path:
    """Write `draft` as a servable checkpoint dir, atomically, and re-check it before it appears.
    Float tensors are cast to `dtype`; d2t stays int64 and t2d bool. `embed_tokens` is left out
    unless `with_embed` (engines share the target's). `verifier` names the target (required for
    the speculators layout unless the drafter already records one)."""
    if layout not in LAYOUTS:
        raise FledgeError(f"layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
    cfg = draft.cfg
    cj = config_json(cfg, layout, dtype, verifier)
    sd = draft.state_dict()
    if with_embed and bool(torch.isnan(sd["embed_tokens.weight"]).all()):
        raise FledgeError("the drafter has no embeddings (loaded without them): give the target or drop --with-embed")
    tensors, served = {}, checkpoint_keys(cfg)
    for k, t in sd.items():
        if k not in served or (k == "embed_tokens.weight" and not with_embed):
            continue
        t = t.detach().cpu()
        t = t.to(dtype) if t.is_floating_point() else t.to(torch.int64) if k == "d2t" else t
        tensors[layout_name(k, layout)] = t.contiguous()
    out_dir = Path(out_dir)
    with atomic_dir(out_dir, overwrite=overwrite) as tmp:
        write_file(tmp / "config.json", (json.dumps(cj, indent=2) + "\n").encode())
        _write_weights(tmp, tensors, shard_size_mb)
        problems = validate_checkpoint(tmp)
        if problems:
            first = problems[0].replace(str(tmp), str(out_dir))
            raise FledgeError(f"export to {out_dir} failed its own check: {first}")
    return out_dir


