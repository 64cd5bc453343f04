"""Whether a drafter and the features it was (or will be) trained on agree: the same aux layers,
width and target, and a final state that is the target's post-norm one. Features captured from
a serving engine record that engine's conventions in meta.json (fledge.train.features)."""

from __future__ import annotations

import json
from pathlib import Path

from fledge.core.conventions import aux_ids_from_sglang, aux_ids_to_sglang
from fledge.core.errors import FledgeError
from fledge.doctor.checks import Check, fail, ok
from fledge.drafter.layout import aux_ids_of, draft_facts


def features_checks(drafter, features) -> list[Check]:
    """Checks named `features.*` for the drafter directory `drafter` against the feature
    directory `features` (its meta.json)."""
    try:
        cj = json.loads((Path(drafter) / "config.json").read_text())
        meta = json.loads((Path(features) / "meta.json").read_text())
    except (OSError, ValueError) as e:
        return [fail("features", f"cannot read the drafter's config.json or the features' meta.json ({e})")]
    if not isinstance(meta, dict) or not isinstance(cj, dict):
        return [fail("features", "config.json and meta.json must be JSON objects")]
    facts = draft_facts(cj)
    out = []
    n = facts.target_layers
    engine = meta.get("engine") or {}
    name = f"{engine.get('name', 'fledge')} {engine.get('version', '')}".strip()
    try:
        drafted = aux_ids_of(facts.aux_top, facts.aux_nested, n) if n else tuple(facts.aux_top or ())
        captured = tuple(meta.get("aux_layer_ids") or ())
        if engine.get("name") == "sglang" and n:  # recorded in both spellings: they must agree
            if tuple(aux_ids_to_sglang(captured, n)) != tuple(engine.get("layer_ids") or ()):
                raise FledgeError(f"meta.json's canonical aux ids {list(captured)} and SGLang's {engine.get('layer_ids')} "
                                  f"name different layers (SGLang's are canonical - 1: {list(aux_ids_from_sglang(engine['layer_ids'], n))})")
    except FledgeError as e:
        return [fail("features.aux_layers", str(e))]
    out.append(ok("features.aux_layers", f"drafter and features ({name}) read layers {list(drafted)}")
               if drafted == captured else
               fail("features.aux_layers", f"drafter reads layers {list(drafted)}, features ({name}) hold {list(captured)}",
                    "capture again with --aux-layers " + ",".join(map(str, drafted))))
    width = meta.get("hidden_size")
    out.append(ok("features.width", f"H={width}") if width == facts.target_hidden else
               fail("features.width", f"features of H={width}, the drafter's target has H={facts.target_hidden}"))
    post = meta.get("hidden", "post-norm") == "post-norm"
    out.append(ok("features.final_norm", f"stored post-norm (engine's final state: {engine.get('final_state', 'computed in process')})")
               if post else fail("features.final_norm", f"final state {meta.get('hidden')!r}: the target's head needs "
                                 "the post-norm state"))
    verifier = facts.verifier or ((cj.get("fledge") or {}).get("verifier") or {}).get("name_or_path")
    target = str(meta.get("target", ""))
    if verifier and target and Path(target).name != Path(verifier).name and target != verifier:
        out.append(fail("features.target", f"features of {target!r}, the drafter names {verifier!r} as its target"))
    else:
        out.append(ok("features.target", f"features of {target!r}"))
    return out
