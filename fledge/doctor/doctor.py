"""`fledge doctor`: know before you deploy. PASS / WARN / FAIL for an exported drafter.

Every check here exists because the failure it catches is *silent* in SGLang or vLLM: the
server starts, serves correct text, and acceptance quietly collapses (plain `EAGLE` on an
EAGLE-3 drafter, a missing `d2t` or `hidden_norm`, a context window shorter than the
target's). A broken checkpoint is reported, never raised. Files are read torch-free
(`fledge.drafter.weights`, `fledge.drafter.layout`): torch's start-up costs more than every check together,
so it loads only for `--probe` or a `--target` that fledge.core.target must resolve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fledge.core.catalog import BUILTINS
from fledge.core.config import DraftConfig
from fledge.core.conventions import (
    aux_ids_to_sglang,
    default_aux_layer_ids,
    diff_vocab,
    rope_fields,
    target_ids_from_d2t,
)
from fledge.core.errors import FledgeError
from fledge.doctor.block import dflash_checks, is_block_drafter
from fledge.doctor.checks import Check, fail, ok, report, warn
from fledge.doctor.lint import launch_checks, parse_launch
from fledge.doctor.sanity import check_norms, check_trained, check_weights
from fledge.drafter.layout import (
    EAGLE3_ARCH,
    DraftFacts,
    aux_ids_of,
    canonical_name,
    checkpoint_keys,
    draft_config_from_json,
    draft_facts,
)
from fledge.drafter.weights import (
    Checkpoint,
    Weights,
    is_float,
    model_config,
    open_checkpoint,
)


def files_check(ck: Checkpoint) -> Check:
    """What is missing or broken in the files, in one check."""
    fix = "re-export with `fledge export` (writes atomically), or copy the missing/truncated files again"
    if ck.fails:
        return fail("files", "; ".join(ck.fails + ck.warns), fix)
    if ck.warns:
        return warn("files", "; ".join(ck.warns), fix)
    return ok("files", f"config.json + {len(ck.weights.files)} tensors in {len(ck.files)} file(s)")


# ------------------------------------------------------------------ the target
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


# ------------------------------------------------------------------ static checks
def check_architecture(f: DraftFacts) -> Check:
    if f.layout not in (EAGLE3_ARCH, "speculators"):
        return fail("architecture", f"architectures={f.layout}: neither SGLang nor vLLM loads this as EAGLE-3",
                     f'export with `fledge export` (architectures ["{EAGLE3_ARCH}"])')
    if not f.use_aux:
        return fail("architecture", "eagle_config.use_aux_hidden_state is false: vLLM drops fc and feeds only the "
                     "last hidden state", "set eagle_config.use_aux_hidden_state to true")
    if f.norm_before_residual:
        return fail("architecture", "norm_before_residual is true (or absent in the speculators layout, where vLLM "
                     "defaults it to true): vLLM then takes the residual after hidden_norm, SGLang ignores the field",
                     "set norm_before_residual to false unless the drafter was trained that way")
    if f.num_layers not in (1, None):
        return warn("architecture", f"num_hidden_layers={f.num_layers}: SGLang and vLLM name extra draft layers "
                     "differently; fledge drafters have one", "set num_hidden_layers to 1 if the draft has one layer")
    served = "SGLang and vLLM" if f.layout == EAGLE3_ARCH else "vLLM (speculators format; SGLang needs the eagle3 layout)"
    variant = [k for k, on in (("fc_norm", f.fc_norm), ("norm_output", f.norm_output)) if on]
    if variant:  # an engine from before EAGLE-3.1 drops fc_norm.* (SGLang; vLLM refuses them) and ignores norm_output
        served += (f", with EAGLE-3.1's {' and '.join(variant)} (vLLM reads both: fledge's tests serve it in vLLM 0.32): "
                   "an engine without EAGLE-3.1 support serves it wrong without a word")
    return ok("architecture", f"{f.layout}, loaded by {served}")


def served_keys(fc_norm: bool = False) -> dict[str, bool]:
    """Served tensor name -> required (the names do not depend on sizes, so a minimal config
    with a reduced draft vocab, which carries d2t, serves to list them)."""
    tiny = DraftConfig(hidden_size=8, intermediate_size=8, num_attention_heads=1, num_key_value_heads=1, head_dim=8,
                       vocab_size=16, draft_vocab_size=8, target_hidden_size=8, target_num_layers=4,
                       aux_layer_ids=(1, 2, 3), max_position_embeddings=8, fc_norm=fc_norm)
    return {k: required for k, (_, required) in checkpoint_keys(tiny).items()}


def check_keys(f: DraftFacts, w: Weights) -> Check:
    names = set(w.files)
    if f.layout == "speculators":  # vLLM maps midlayer.* onto layers.0.*: both spellings load
        names = {canonical_name(n) for n in names}
    spec = served_keys(f.fc_norm)
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


def check_hidden(f: DraftFacts, t: TargetFacts) -> Check:
    if f.hidden != t.hidden:
        return fail("hidden", f"draft hidden_size {f.hidden} != target {t.hidden}: the engines feed it the target's "
                     "embeddings", "this drafter belongs to another target")
    return ok("hidden", f"hidden_size {f.hidden} matches the target")


def check_aux_ids(f: DraftFacts, t: TargetFacts | None) -> Check:
    fix = "write the canonical ids the drafter was trained on (fledge export writes both lists)"
    if f.aux_top is None and f.aux_nested is None:
        dflt = f" {list(default_aux_layer_ids(t.num_layers))}" if t and t.num_layers >= 4 else ""
        return warn("aux_ids", f"no eagle_aux_hidden_state_layer_ids: engines fall back to (2, N//2, N-3){dflt}, "
                     "right only if the drafter was trained on those", fix)
    if t and f.target_layers and int(f.target_layers) != t.num_layers:
        return fail("aux_ids", f"the drafter was built for a {f.target_layers}-layer target; this one has "
                     f"{t.num_layers}", "use the drafter's own target, or retarget it with `fledge adapt`")
    n = t.num_layers if t else f.target_layers
    given = f.aux_top if f.aux_top is not None else f.aux_nested
    try:
        # Unknown depth: check order only. SGLang's spelling (eagle_config alone) is canonical - 1.
        bound = int(n) if n else max(4, max(int(i) for i in given) + (1 if f.aux_top is not None else 2))
        ids = aux_ids_of(f.aux_top, f.aux_nested, bound)
    except Exception as e:  # FledgeError, or non-integers in the JSON
        return fail("aux_ids", f"{given}: {e}", fix)
    meaning = (f"{list(ids)} = HF hidden_states{list(ids)} (vLLM, canonical) = SGLang 'output of layer' "
               f"{list(aux_ids_to_sglang(ids, bound))}")
    if not n:
        return ok("aux_ids", meaning + "; range checked with --target")
    default = default_aux_layer_ids(bound)
    return ok("aux_ids", meaning + (f"; the default for {n} layers" if ids == default else
                                     f"; non-default for {n} layers (default {list(default)})"))


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


def check_verifier(f: DraftFacts, t: TargetFacts | None) -> Check | None:
    """`vllm serve <speculators dir>` loads speculators_config.verifier.name_or_path as the
    target, through the HF hub or from a local directory; a name only fledge knows fails there."""
    if f.layout != "speculators":
        return None
    v, example = f.verifier, t.path if t else "<HF id or model directory>"
    fix = f"re-export with `fledge export ... --layout speculators --verifier {example}`"
    if not isinstance(v, str) or not v:
        return fail("verifier", "no speculators_config.verifier.name_or_path: vLLM has no target to serve", fix)
    p = Path(v).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            return fail("verifier", f"{v} has no config.json: vLLM cannot load it as the target", fix)
        if t and p.resolve() != t.path.resolve():
            return warn("verifier", f"vLLM serves {v} as the target, but the drafter was checked against {t.path}",
                        fix)
        return ok("verifier", f"vLLM serves {v} (a directory here) as the target")
    if v.startswith(("/", ".", "~")):
        return warn("verifier", f"{v} is not on this machine: vLLM loads it only where that path exists", fix)
    if v.count("/") == 1 and all(v.split("/")):
        return ok("verifier", f"vLLM serves the HF hub model {v} as the target (not fetched here to check)")
    if v in BUILTINS:
        return fail("verifier", f"{v!r} is a fledge built-in name, not an HF id or path: vLLM cannot load it "
                    "(`fledge target " + v + "` prints the directory it stands for)", fix)
    return warn("verifier", f"{v!r} is neither a directory here nor an HF hub id (org/name): vLLM may not find it",
                fix)


def check_context(f: DraftFacts, t: TargetFacts | None) -> Check:
    if f.max_position is None:
        return fail("context", "no max_position_embeddings: engines fall back to a short default",
                     "set max_position_embeddings to the target's context in config.json")
    if t is None or t.max_position is None:
        return ok("context", f"max_position_embeddings {f.max_position} (compare with --target)")
    if f.max_position < t.max_position:
        return fail("context", f"max_position_embeddings {f.max_position} < target context {t.max_position}: SGLang "
                     "refuses the target's context length, vLLM caps the draft",
                     f"set max_position_embeddings to {t.max_position} in config.json (weights unchanged; RoPE "
                     "positions beyond the training length are extrapolated)")
    return ok("context", f"max_position_embeddings {f.max_position} covers the target's {t.max_position}")


def check_rope(f: DraftFacts, t: TargetFacts | None) -> Check:
    theta, scaling = f.rope
    if t is None:
        return ok("rope", f"theta {theta}, scaling {scaling} (compare with --target)")
    problems = [f"rope {name} {mine} != target {theirs}"
                for name, mine, theirs in zip(("theta", "scaling"), f.rope, t.rope) if mine != theirs]
    if problems:
        return warn("rope", "; ".join(problems) + ": fine only if the drafter was trained with these",
                     "copy the target's rope fields into config.json unless training used others")
    return ok("rope", f"theta {theta}, scaling {scaling}: same as the target")


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


def _guarded(name: str, fn, *args) -> Check | None:
    """Run one check; a config value of an unexpected type becomes that check's FAIL, never a crash."""
    try:
        return fn(*args)
    except Exception as e:
        return fail(name, f"could not check ({type(e).__name__}: {e})", "fix the field's type in config.json")


def static_checks(drafter, target: str | None = None) -> tuple[list[Check], DraftFacts | None]:
    """Every check that needs only files, and the drafter's config as they read it."""
    ck = open_checkpoint(drafter)
    results = [files_check(ck) if ck.path.is_dir() else
               fail("files", f"{ck.path}: not a directory", "point doctor at the exported drafter directory")]
    t = None
    if target:
        t, tcheck = target_facts(target)
        results.append(tcheck)
    f = _guarded("architecture", draft_facts, ck.config) if ck.config is not None else None
    if not isinstance(f, DraftFacts):
        return [r for r in results + [f] if r is not None], None
    runs = [("architecture", check_architecture, f), ("aux_ids", check_aux_ids, f, t),
            ("verifier", check_verifier, f, t), ("context", check_context, f, t), ("rope", check_rope, f, t)]
    runs += [("hidden", check_hidden, f, t)] if t else []
    w = ck.weights
    if w is not None:
        stats = w.scan()
        runs += [("keys", check_keys, f, w), ("fc", check_fc, f, w, t), ("shapes", check_shapes, ck.config, w, t),
                 ("vocab", check_vocab, f, w, t), ("d2t", check_d2t, f, w), ("t2d", check_t2d, f, w),
                 ("dtype", check_dtype, f, w), ("weights", check_weights, stats), ("norms", check_norms, stats, w),
                 ("trained", check_trained, w),
                 ("embed", check_embed, f, w, t)]
    results += [_guarded(name, fn, *args) for name, fn, *args in runs]
    return [r for r in results if r is not None], f


# ------------------------------------------------------------------ comparing two drafters
def against_check(drafter, other) -> Check:
    """How different two drafters' vocabularies are (K2 vs K2.5: 31,748 of 32,000 d2t differ)."""
    maps = []
    for p in (drafter, other):
        ck = open_checkpoint(p)
        if ck.weights is None or "d2t" not in ck.weights.files:
            return warn("against", f"{p}: no readable d2t to compare")
        vocab = draft_facts(ck.config).vocab if ck.config else None
        try:
            maps.append(target_ids_from_d2t(ck.weights.read("d2t"), vocab or 2**62))
        except Exception as e:
            return warn("against", f"{p}: invalid d2t ({e})")
    a, b = maps
    d = diff_vocab(a, b)
    why = (f"{d['entries_differ']:,} of {max(a.size, b.size):,} d2t entries differ; the target-id sets share "
           f"{d['overlap']:,} ({d['overlap'] / max(1, a.size):.1%} of this drafter's {a.size:,})")
    if d["entries_differ"]:
        return warn("against", why, "expected across target versions; retarget with `fledge adapt` rather than reuse")
    return ok("against", why)


def served_target(launch: str, drafter) -> str | None:
    """The launch line's model, where it is a local model directory other than the drafter: the
    target to check the drafter against when --target is not given."""
    lc = parse_launch(launch)
    if isinstance(lc, str) or not lc.model:
        return None
    p = Path(lc.model).expanduser()
    if not (p / "config.json").is_file() or p.resolve() == Path(drafter).resolve():
        return None
    return str(p)


def doctor(drafter, target: str | None = None, launch: str | None = None, against: str | None = None) -> list[Check]:
    """All checks for one drafter; never raises on a broken checkpoint or an odd launch line.
    Without `target`, a launch line serving a local directory names it."""
    if target is None and launch is not None:
        target = served_target(launch, drafter)
    if is_block_drafter(drafter):
        return dflash_checks(drafter, target, launch)
    results, facts = static_checks(drafter, target)
    if launch is not None:
        results += launch_checks(launch, drafter, facts, target)
    if against is not None:
        results.append(against_check(drafter, against))
    return results


def run_doctor(args) -> int:
    results = doctor(args.drafter, args.target, args.launch, args.against)
    if args.features:
        from fledge.doctor.features_check import features_checks
        results += features_checks(args.drafter, args.features)
    if args.probe:
        if not args.target:
            raise FledgeError("--probe needs --target: the probe runs the drafter against its target")
        from fledge.doctor.probe import probe_checks
        results += probe_checks(args.drafter, args.target, args.probe_prompts, args.probe, args.probe_tokens,
                                args.probe_steps, args.device)
    return report(results, args.json)
