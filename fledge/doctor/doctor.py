"""`fledge doctor`: know before you deploy. PASS / WARN / FAIL for an exported drafter.

Every check here exists because the failure it catches is *silent* in SGLang or vLLM: the
server starts, serves correct text, and acceptance quietly collapses (plain `EAGLE` on an
EAGLE-3 drafter, a missing `d2t` or `hidden_norm`, a context window shorter than the
target's). A broken checkpoint is reported, never raised. Files are read torch-free
(`fledge.drafter.weights`, `fledge.drafter.layout`): torch's start-up costs more than every check together,
so it loads only for `--probe` or a `--target` that fledge.core.target must resolve.
"""

from __future__ import annotations

from pathlib import Path

from fledge.core.catalog import BUILTINS
from fledge.core.conventions import (
    aux_ids_to_sglang,
    default_aux_layer_ids,
    diff_vocab,
    target_ids_from_d2t,
)
from fledge.core.errors import FledgeError
from fledge.doctor.block import dflash_checks, is_block_drafter
from fledge.doctor.checks import Check, fail, ok, report, warn
from fledge.doctor.lint import launch_checks, parse_launch
from fledge.doctor.sanity import check_norms, check_trained, check_weights
from fledge.doctor.tensors import (
    TargetFacts,
    check_d2t,
    check_dtype,
    check_embed,
    check_fc,
    check_keys,
    check_shapes,
    check_t2d,
    check_vocab,
    target_facts,
)
from fledge.drafter.layout import (
    EAGLE3_ARCH,
    DraftFacts,
    aux_ids_of,
    draft_facts,
)
from fledge.drafter.weights import (
    Checkpoint,
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
    if f.num_layers is not None and f.num_layers > 1 and f.layout == EAGLE3_ARCH:
        # SGLang's llama_eagle3 (read in its source) builds layers 1.. as `additional_layers.*`
        # that normalise with hidden_norm and restart the residual from the previous layer's MLP
        # output: it would drop vLLM-named `layers.{i}.*` weights and run those layers at init.
        return warn("architecture", f"num_hidden_layers={f.num_layers}: vLLM runs the layers after the first "
                     "(layers.1.* ...) as fledge trains them; SGLang names and computes them differently and would "
                     "drop these weights without a word", "serve it with vLLM, or train a one-layer drafter for SGLang")
    served = "SGLang and vLLM" if f.layout == EAGLE3_ARCH else "vLLM (speculators format; SGLang needs the eagle3 layout)"
    variant = [k for k, on in (("fc_norm", f.fc_norm), ("norm_output", f.norm_output)) if on]
    if variant:  # an engine from before EAGLE-3.1 drops fc_norm.* (SGLang; vLLM refuses them) and ignores norm_output
        served += (f", with EAGLE-3.1's {' and '.join(variant)} (vLLM reads both: fledge's tests serve it in vLLM 0.32): "
                   "an engine without EAGLE-3.1 support serves it wrong without a word")
    return ok("architecture", f"{f.layout}, loaded by {served}")


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
