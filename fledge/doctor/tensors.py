"""doctor's checks of the target's config and of the weight files against the drafter's config:
keys, the fc projection, shapes, vocab maps, dtype, embeddings. Torch-free, like fledge.doctor.doctor."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fledge.core.config import DraftConfig
from fledge.core.conventions import (
    rope_fields,
    target_ids_from_d2t,
)
from fledge.core.errors import FledgeError
from fledge.doctor.checks import Check, fail, ok, warn
from fledge.drafter.layout import (
    DraftFacts,
    canonical_name,
    checkpoint_keys,
    draft_config_from_json,
)
from fledge.drafter.weights import (
    Weights,
    is_float,
    model_config,
    open_checkpoint,
)


@dataclass
class TargetFacts:
    path: Path
    hidden: int
    vocab: int
    num_layers: int
    max_position: int | None
    rope: tuple


def target_facts(spec: str) -> tuple[TargetFacts | None, Check]:
    """The target's config read directly: a target that cannot load still has a config. A plain
    HF directory needs nothing of fledge.core.target (built-in names, GGUF conversion), nor torch."""
    try:
        p = Path(spec)
        if not p.is_dir():
            from fledge.core.target import resolve_target
            p = Path(resolve_target(spec))
        cfg = model_config(p)
        t = TargetFacts(p, int(cfg["hidden_size"]), int(cfg["vocab_size"]), int(cfg["num_hidden_layers"]),
                        cfg.get("max_position_embeddings"), rope_fields(cfg))
    except Exception as e:
        return None, warn("target", f"{spec}: cannot read its config ({type(e).__name__}: {e}); target checks skipped",
                           "pass an HF model directory (with config.json) or a name fledge.core.target knows")
    return t, ok("target", f"{p}: {t.num_layers} layers, hidden {t.hidden}, vocab {t.vocab}, context {t.max_position}")


def served_keys(fc_norm: bool = False, parallel: bool = False, layers: int = 1) -> dict[str, bool]:
    """Served tensor name -> required (the names do not depend on sizes, so a minimal config
    with a reduced draft vocab, which carries d2t, serves to list them). `parallel`: a P-EAGLE
    drafter's, with `mask_hidden`; `layers`: its num_hidden_layers."""
    tiny = DraftConfig(hidden_size=8, intermediate_size=8, num_attention_heads=1, num_key_value_heads=1, head_dim=8,
                       vocab_size=16, draft_vocab_size=8, target_hidden_size=8, target_num_layers=4,
                       aux_layer_ids=(1, 2, 3), max_position_embeddings=8, fc_norm=fc_norm,
                       ptd_token_id=0 if parallel else None, num_hidden_layers=layers)
    return {k: required for k, (_, required) in checkpoint_keys(tiny).items()}


def check_keys(f: DraftFacts, w: Weights) -> Check:
    names = set(w.files)
    if f.layout == "speculators":  # vLLM maps midlayer.* onto layers.0.*: both spellings load
        names = {canonical_name(n) for n in names}
    layers = f.num_layers if type(f.num_layers) is int and f.num_layers >= 1 else 1  # a bad count: check_config's
    spec = served_keys(f.fc_norm, f.ptd_token_id is not None, layers)
    unknown = sorted(names - set(spec))
    missing = [k for k, req in spec.items() if req and k not in names and k != "d2t"]  # check_d2t: a missing d2t
    why, fix = [], []
    if missing:
        why.append(f"missing {missing}: both engines keep those parameters at init (hidden_norm = ones) without a word")
        fix.append("re-export from the trained drafter")
    if unknown:
        hint = ""
        if any(k.startswith("layers.0.") for k in unknown):
            hint = " (layers.0.* in the eagle3 layout: SGLang expects midlayer.* and drops these)"
        elif any(k.startswith("model.") for k in unknown):
            hint = " (a model.* prefix: vLLM adds its own and fails)"
        why.append(f"unknown keys {unknown[:4]}{'...' if len(unknown) > 4 else ''}{hint}: vLLM refuses to load, "
                   "SGLang silently drops them")
        fix.append("rename to the served names or drop them (fledge export writes exactly the served set)")
    if why:
        return fail("keys", "; ".join(why), "; ".join(fix))
    return ok("keys", "every served weight present, no unknown keys")


def check_fc(f: DraftFacts, w: Weights, t: TargetFacts | None) -> Check | None:
    shape = w.shapes.get("fc.weight")
    if shape is None:
        return None
    th = t.hidden if t else f.target_hidden
    want = (f.hidden, 3 * th) if th and f.hidden else None
    src = "target" if t else "target_hidden_size"
    if want and tuple(shape) != want:
        return fail("fc", f"fc.weight {list(shape)}, expected [{want[0]}, {want[1]}] = [hidden, 3 x {src} hidden "
                     f"{th}]: the engine captures three {th}-wide states", "this drafter was trained for another target")
    if t and f.target_hidden != t.hidden:
        return fail("fc", f"target_hidden_size {f.target_hidden} != target hidden {t.hidden}",
                     f"set target_hidden_size to {t.hidden} only if fc really is {3 * t.hidden} wide")
    return ok("fc", f"fc.weight {list(shape)} = 3 x {th} -> {f.hidden}")


def check_shapes(cfg: dict, w: Weights, t: TargetFacts | None) -> Check | None:
    """Every tensor's shape against what config.json implies (fledge.drafter.checkpoint's reading of it)."""
    try:
        spec = checkpoint_keys(draft_config_from_json(cfg, t.num_layers if t else None))
    except FledgeError as e:  # a field of the wrong type or range: no shape follows from it
        return fail("shapes", str(e), "fix that field of config.json")
    except Exception:  # a config fledge cannot read: the config checks above say why
        return None
    bad = [f"{k} {list(w.shapes[n])} (config implies {list(spec[k][0])})" for n in w.files
           if (k := canonical_name(n)) in spec and tuple(w.shapes[n]) != spec[k][0]]
    if bad:
        return fail("shapes", "; ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else ""),
                     "config.json and the weights disagree: re-export, or fix the config fields")
    return ok("shapes", "every tensor has the shape config.json implies")


def check_vocab(f: DraftFacts, w: Weights, t: TargetFacts | None) -> Check:
    problems = []
    lm = w.shapes.get("lm_head.weight")
    if f.tied:
        problems.append("tie_word_embeddings is true: SGLang then uses embed_tokens (full vocab) as lm_head")
    if f.draft_vocab is None:
        problems.append("no draft_vocab_size: engines assume the full target vocab")
    elif lm is not None and lm[0] != f.draft_vocab:
        problems.append(f"lm_head has {lm[0]} rows, draft_vocab_size is {f.draft_vocab}")
    if f.vocab and f.draft_vocab and f.draft_vocab > f.vocab:
        problems.append(f"draft_vocab_size {f.draft_vocab} > vocab_size {f.vocab}")
    if t and f.vocab != t.vocab:
        problems.append(f"vocab_size {f.vocab} != target vocab {t.vocab}: d2t offsets and embeddings index the target vocab")
    emb = w.shapes.get("embed_tokens.weight")
    if emb is not None and f.vocab and emb[0] != f.vocab:
        problems.append(f"embed_tokens has {emb[0]} rows, vocab_size is {f.vocab}")
    if problems:
        return fail("vocab", "; ".join(problems), "fix config.json to match the weights (or re-export)")
    return ok("vocab", f"draft vocab {f.draft_vocab} of target vocab {f.vocab}")


def check_d2t(f: DraftFacts, w: Weights) -> Check:
    fix = "rebuild the vocab with `fledge vocab` and re-export"
    if "d2t" not in w.files:
        if f.draft_vocab and f.vocab and f.draft_vocab == f.vocab:
            return ok("d2t", "absent, and the draft vocab is the full vocab (zero offsets are right)")
        return fail("d2t", "missing: SGLang and vLLM then take draft id i for target id i, silently wrong", fix)
    if f.draft_vocab and f.draft_vocab == f.vocab:
        return warn("d2t", "a full-vocabulary drafter carrying d2t: vLLM registers no d2t then and refuses the key",
                     "drop d2t (the map is the identity); fledge export does")
    d2t = w.read("d2t")
    if d2t.dtype.kind not in "iu" or d2t.ndim != 1:
        return fail("d2t", f"d2t is {w.dtypes['d2t']} with shape {list(d2t.shape)}; engines need 1-D integer offsets",
                    fix)
    if f.draft_vocab and d2t.size != f.draft_vocab:
        return fail("d2t", f"d2t has {d2t.size} entries, draft_vocab_size is {f.draft_vocab}", fix)
    try:
        ids = target_ids_from_d2t(d2t, f.vocab or 2**62)
    except Exception as e:
        return fail("d2t", str(e), fix)
    return ok("d2t", f"{ids.size} draft ids -> distinct target ids in [{int(ids.min())}, {int(ids.max())}]")


def check_t2d(f: DraftFacts, w: Weights) -> Check | None:
    """Engines skip t2d, so a wrong one only misleads tools that read it: WARN, not FAIL."""
    if "t2d" not in w.files or "d2t" not in w.files:
        return None
    t2d, d2t = w.read("t2d"), w.read("d2t")
    try:
        ids = target_ids_from_d2t(d2t, t2d.size)
    except Exception:
        return warn("t2d", "cannot compare with an invalid d2t")
    mask = t2d.ravel() != 0
    if (f.vocab and t2d.size != f.vocab) or int(mask.sum()) != ids.size or not bool(mask[ids].all()):
        return warn("t2d", f"t2d ({int(mask.sum())} set of {t2d.size}) disagrees with d2t; engines use d2t",
                     "re-export so t2d is built from the same vocab")
    return ok("t2d", "consistent with d2t")


def check_dtype(f: DraftFacts, w: Weights) -> Check:
    floats = sorted({w.dtypes[k] for k in w.files if is_float(w.dtypes[k])})
    if len(floats) > 1:
        return warn("dtype", f"mixed weight dtypes {floats}", "export in one dtype (engines cast on load)")
    if f.dtype and floats and f.dtype.removeprefix("torch.") != floats[0]:
        return warn("dtype", f"config says {f.dtype}, weights are {floats[0]} (engines cast to the serving dtype)",
                     f"set torch_dtype to {floats[0]}")
    return ok("dtype", f"weights {floats[0] if floats else '-'}")


def check_embed(f: DraftFacts, w: Weights, t: TargetFacts | None) -> Check:
    if "embed_tokens.weight" not in w.files:
        return ok("embed", "absent: both engines use the target's embeddings")
    if t is None:
        return ok("embed", "present (compare with the target's using --target)")
    tw = open_checkpoint(t.path).weights
    keys = sorted((k for k in tw.files if k.endswith("embed_tokens.weight")), key=len) if tw else []
    if not keys:
        return warn("embed", "present; the target's embedding could not be read to compare")
    key = keys[0]
    if tuple(tw.shapes[key]) != tuple(w.shapes["embed_tokens.weight"]):
        return fail("embed", f"embed_tokens {list(w.shapes['embed_tokens.weight'])} != target {list(tw.shapes[key])}",
                     "drop embed_tokens from the export (engines share the target's)")
    diff = norm = 0.0
    for x, y in zip(w.chunks("embed_tokens.weight"), tw.chunks(key)):
        diff, norm = diff + float(np.square(x - y).sum(dtype=np.float64)), norm + float(np.square(y).sum(dtype=np.float64))
    rel = math.sqrt(diff / max(norm, 1e-30))
    if rel > 1e-2:  # beyond a bf16 round trip
        return warn("embed", f"embed_tokens differs from the target's (relative L2 {rel:.3g}): vLLM uses the "
                     "drafter's copy, SGLang the target's, so the engines disagree",
                     "drop embed_tokens from the export, or copy the target's")
    return ok("embed", f"present and equal to the target's (relative L2 {rel:.1e})")
