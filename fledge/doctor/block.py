"""`fledge doctor` for a DFlash drafter: its config and weights as vLLM's DFlash loader reads
them, the target they fit, and a launch line: vLLM's `method` and depth, or SGLang's algorithm,
block and head.

SGLang (its source read, not run: fledge's tests have no SGLang, which has no CPU build) reads the same config fields and
layer weights, but its DFlash worker shares the target's embeddings *and lm_head* with the draft
model and skips weights it has no parameter for: a drafter's own head and d2t are dropped
without a word, and it drafts through the target's whole head. Only a drafter whose head is the
target's (the whole vocabulary, `fledge train --head frozen`) drafts there as trained. Its block
is `--speculative-num-draft-tokens` tokens, the anchor and the masks."""

from __future__ import annotations

import json
from pathlib import Path

from fledge.core.errors import FledgeError
from fledge.doctor.checks import Check, fail, ok, warn
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
        lc = parse_launch(launch)
        if not isinstance(lc, str) and lc.engine == "sglang":
            out += sglang_checks(c, lc)
        else:
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
    if isinstance(lc, str):
        return fail("launch.algorithm", lc, example)
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


def sglang_checks(c, lc) -> list[Check]:
    """SGLang's DFlash line for a drafter of config `c` (module doc: what SGLang runs)."""
    example = (f"python -m sglang.launch_server --model-path TARGET --speculative-algorithm DFLASH "
               f"--speculative-draft-model-path DRAFTER --speculative-num-draft-tokens {c.block_size}")
    o = lc.options
    algo = (o.get("speculative-algorithm") or "").upper()
    if algo != "DFLASH":
        return [fail("launch.algorithm", f"--speculative-algorithm {algo or '(absent)'}: a DFlash drafter needs DFLASH",
                     example)]
    out = [ok("launch.algorithm", "--speculative-algorithm DFLASH")]
    raw = o.get("speculative-num-draft-tokens")
    n = int(raw) if raw is not None and raw.isdigit() else None
    if raw is None:  # what SGLang then picks was not read; the line should say it
        out.append(warn("launch.block", f"no --speculative-num-draft-tokens: SGLang's block is this many tokens, and "
                                        f"the drafter was trained on blocks of {c.block_size}",
                        f"--speculative-num-draft-tokens {c.block_size}"))
    elif n is None:
        out.append(fail("launch.block", f"--speculative-num-draft-tokens {raw}: not a token count", example))
    elif not 2 <= n <= c.block_size:
        out.append(fail("launch.block", f"--speculative-num-draft-tokens {n}: a block of {n} tokens; the drafter was "
                                        f"trained on blocks of {c.block_size} (2..{c.block_size} run)", example))
    elif n < c.block_size:
        out.append(warn("launch.block", f"--speculative-num-draft-tokens {n}: a block shorter than the {c.block_size} "
                                        "trained; its masks attend to each other, so it drafts slightly other tokens",
                        f"--speculative-num-draft-tokens {c.block_size}"))
    else:
        out.append(ok("launch.block", f"blocks of {n} tokens, as trained"))
    if c.draft_vocab_size != c.vocab_size:
        out.append(fail("launch.head", f"SGLang drafts through the target's lm_head and drops this drafter's "
                                       f"({c.draft_vocab_size:,} of {c.vocab_size:,} tokens) and its d2t without a "
                                       "word: it would draft other tokens than trained",
                        "serve it with vLLM, or train on the whole vocabulary with --head frozen for SGLang"))
    else:
        out.append(ok("launch.head", "a whole-vocabulary head: SGLang drafts through the target's, which is this "
                                     "drafter's if it was trained with --head frozen"))
    return out


def is_block_drafter(drafter) -> bool:
    return Path(drafter).is_dir() and is_dflash(drafter)
