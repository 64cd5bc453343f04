"""A check's result (PASS / WARN / FAIL with one line of why and the fix), the report, and
the drafter facts the checks read.

Shared by the doctor's checkpoint checks and the launch-line lint; anything else that
produces checks (a live acceptance probe) appends to the same list before `report`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from fledge.conventions import rope_fields

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"
_SEVERITY = {PASS: 0, WARN: 1, FAIL: 2}


@dataclass
class Check:
    name: str
    status: str  # PASS / WARN / FAIL
    why: str
    fix: str = ""


def ok(name, why):
    return Check(name, PASS, why)


def warn(name, why, fix=""):
    return Check(name, WARN, why, fix)


def fail(name, why, fix=""):
    return Check(name, FAIL, why, fix)


def exit_code(results: list[Check]) -> int:
    return max((_SEVERITY[c.status] for c in results), default=0)


def report(results: list[Check], as_json: bool = False, out=print) -> int:
    """Print the results as a table (or JSON) and return the exit code."""
    code = exit_code(results)
    if as_json:
        out(json.dumps({"status": [PASS, WARN, FAIL][code], "exit_code": code,
                        "checks": [asdict(c) for c in results]}, indent=2))
        return code
    width = max((len(c.name) for c in results), default=5)
    out(f"{'CHECK':<{width}}  STATUS  WHY")
    for c in results:
        out(f"{c.name:<{width}}  {c.status:<6}  {c.why}")
        if c.fix and c.status != PASS:
            out(f"{'':<{width}}          fix: {c.fix}")
    counts = {s: sum(c.status == s for c in results) for s in (PASS, WARN, FAIL)}
    out(f"\n{counts[PASS]} pass, {counts[WARN]} warn, {counts[FAIL]} fail -> exit {code}")
    return code


# ------------------------------------------------------------------ what a drafter's config says
@dataclass
class DraftFacts:
    """The fields every check reads, wherever the layout keeps them."""

    layout: str  # "eagle3" (SGLang + vLLM), "speculators" (vLLM), or what was found
    hidden: int | None
    target_hidden: int | None
    vocab: int | None
    draft_vocab: int | None
    max_position: int | None
    num_layers: int | None
    rope: tuple
    aux_top: list | None  # top-level ids: canonical, what vLLM reads
    aux_nested: list | None  # eagle_config ids: what SGLang reads, in fledge.checkpoint's serving spelling
    use_aux: bool
    tied: bool
    dtype: str | None
    target_layers: int | None  # recorded by fledge export; engines keep no such field
    norm_before_residual: bool
    verifier: str | None = None  # speculators layout: the target `vllm serve <dir>` loads
    speculative_tokens: int | None = None  # speculators layout: the depth `vllm serve <dir>` drafts


def draft_facts(cfg: dict) -> DraftFacts:
    spec = cfg.get("speculators_model_type") is not None
    lc = (cfg.get("transformer_layer_config") or {}) if spec else cfg
    ec = cfg.get("eagle_config") or {}
    sc = (cfg.get("speculators_config") or {}) if spec else {}
    method = (sc.get("proposal_methods") or [{}])[0]
    hidden = lc.get("hidden_size")
    return DraftFacts(
        layout="speculators" if spec else ",".join(cfg.get("architectures") or ["(none)"]),
        hidden=hidden, target_hidden=cfg.get("target_hidden_size") or hidden,
        vocab=lc.get("vocab_size"), draft_vocab=cfg.get("draft_vocab_size"),
        max_position=lc.get("max_position_embeddings"), num_layers=lc.get("num_hidden_layers"),
        rope=rope_fields(lc), aux_top=cfg.get("eagle_aux_hidden_state_layer_ids"),
        aux_nested=None if spec else ec.get("eagle_aux_hidden_state_layer_ids"),
        use_aux=bool(ec.get("use_aux_hidden_state", True)), tied=bool(lc.get("tie_word_embeddings", False)),
        dtype=lc.get("dtype") or lc.get("torch_dtype") or cfg.get("torch_dtype"),
        target_layers=(cfg.get("fledge") or {}).get("target_num_hidden_layers"),
        norm_before_residual=bool(cfg.get("norm_before_residual", spec)),
        verifier=(sc.get("verifier") or {}).get("name_or_path"), speculative_tokens=method.get("speculative_tokens"))
