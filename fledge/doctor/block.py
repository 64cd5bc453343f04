"""`fledge doctor` for a DFlash drafter: its config and weights as vLLM's DFlash loader reads
them, the target they fit, and a vLLM launch line's `method` and depth. (SGLang's DFlash reads
another layout; a DFlash drafter's launch line is checked for vLLM only.)"""

from __future__ import annotations

import json
from pathlib import Path

from fledge.core.errors import FledgeError
from fledge.doctor.checks import Check, fail, ok
from fledge.doctor.lint import parse_launch
from fledge.drafter.layout import is_dflash


def dflash_checks(drafter, target: str | None = None, launch: str | None = None) -> list[Check]:
    from fledge.drafter.dflash_checkpoint import load_dflash
    try:
        draft = load_dflash(drafter)
    except FledgeError as e:
        return [fail("dflash.checkpoint", str(e), "re-export it with `fledge train --method dflash`")]
    c = draft.cfg
    out = [ok("dflash.checkpoint", f"DFlashDraftModel: {c.num_hidden_layers} layers, block of {c.block_size}, mask "
                                   f"token {c.mask_token_id}, aux ids {list(c.aux_layer_ids)}, draft vocab "
                                   f"{c.draft_vocab_size}/{c.vocab_size}")]
    if target is not None:
        out.append(target_check(c, target))
    if launch is not None:
        cj = json.loads((Path(drafter) / "config.json").read_text())
        out.append(launch_check(c, launch, drafter if cj.get("speculators_model_type") == "dflash" else None))
    return out


def target_check(c, target: str) -> Check:
    from transformers import AutoConfig

    from fledge.core.target import resolve_target
    t = AutoConfig.from_pretrained(resolve_target(target)).get_text_config()
    have = (c.target_hidden_size, c.vocab_size, c.target_num_layers)
    want = (t.hidden_size, t.vocab_size, t.num_hidden_layers)
    if have != want:
        return fail("dflash.target", f"built for hidden/vocab/layers {have}; {target} has {want}",
                    "train a drafter for this target")
    return ok("dflash.target", f"fits {target}: hidden {want[0]}, vocab {want[1]}, {want[2]} layers")


def launch_check(c, launch: str, speculators_dir=None) -> Check:
    """The vLLM line serving a drafter of config `c`; `speculators_dir`: the drafter's directory
    when it is in the speculators layout, which `vllm serve DIR` serves alone."""
    lc = parse_launch(launch)
    example = '--speculative-config \'{"method": "dflash", "model": "DRAFTER", "num_speculative_tokens": K}\''
    if isinstance(lc, str) or lc.engine != "vllm":
        return fail("launch.algorithm", lc if isinstance(lc, str) else "a DFlash drafter is checked for vLLM",
                    example)
    try:
        sc = json.loads(lc.options.get("speculative-config") or "{}")
    except json.JSONDecodeError as e:
        return fail("launch.spec_config", f"--speculative-config is not JSON ({e.msg})", example)
    if speculators_dir is not None and lc.model and Path(lc.model).resolve() == Path(speculators_dir).resolve():
        # vLLM's speculators reader: the verifier is served, this directory drafts, method dflash
        # and the trained depth unless the line sets one
        sc = {"num_speculative_tokens": c.block_size - 1, **sc, "method": "dflash"}
    if sc.get("method") != "dflash":
        return fail("launch.algorithm", f"method {sc.get('method') or '(absent)'}: a DFlash drafter needs "
                                        '"method": "dflash"', example)
    k = sc.get("num_speculative_tokens")
    if not isinstance(k, int) or not 1 <= k <= c.block_size - 1:
        return fail("launch.depth", f"num_speculative_tokens {k}: the drafter was trained for 1..{c.block_size - 1} "
                                    f"(a block of {c.block_size})", example)
    return ok("launch.algorithm", f"method dflash, {k} tokens a block")


def is_block_drafter(drafter) -> bool:
    return Path(drafter).is_dir() and is_dflash(drafter)
