"""The doctor's live probe: what a drafter actually gets on held-out prompts, in minutes.

Static checks cannot see a drafter that loads fine and accepts nothing (trained on another
target, aux layers one off, a vocab map for another tokenizer). The probe runs it against its
target on fledge's engine, whose output is the target's own greedy text, and reports the accept
length (SGLang's, with the bonus token) and the vocab coverage bound: the share of the target's
generated tokens inside the draft vocab, which no drafting can exceed per token.

Below accept length 1.1 the drafter adds nothing (FAIL: look for a misconfiguration); below 2.0
speculation rarely beats plain decoding on a real deployment (WARN); coverage below 0.9 caps
acceptance (WARN).
"""

from __future__ import annotations

import torch

from fledge.core.conventions import accept_length
from fledge.doctor.checks import Check, fail, ok, warn

FAIL_BELOW, WARN_BELOW, COVERAGE_WARN = 1.1, 2.0, 0.9


def probe_checks(drafter, target: str, prompts: str = "mtbench", n: int = 8, max_new_tokens: int = 64,
                 num_steps: int = 5, device: str | None = None) -> list[Check]:
    from fledge.core.shape import Shape
    from fledge.engine.rig import load_rig
    from fledge.engine.sampling import SamplingParams
    from fledge.engine.spec import generate_spec
    from fledge.engine.stats import SpecStats
    from fledge.perf.bench import load_prompts

    try:
        rig = load_rig(target, str(drafter), device, None)
        ids = load_prompts(prompts, n, rig.tokenizer)
    except Exception as e:  # the doctor reports, never raises
        return [fail("probe", f"could not load target/drafter/prompts for the probe: {e}",
                     "fix the static FAILs first; check --target and --probe-prompts")]
    spec = rig.drafter(Shape(num_steps, 1, num_steps + 1))
    params = SamplingParams(max_new_tokens=max_new_tokens)
    runs, generated = [], []
    for p in ids:
        out, stats = generate_spec(rig.target, spec, p, params, rig.eos)
        runs.append(stats)
        generated += out
    m = SpecStats.merge(runs)
    return [accept_check(sum(m.accepted), m.steps, m.depth_acceptance(), len(ids), max_new_tokens, num_steps),
            coverage_check(generated, rig.draft.t2d)]


def accept_check(accepted: int, steps: int, by_depth, n_prompts: int, tokens: int, num_steps: int) -> Check:
    al = accept_length(accepted, steps)
    depth = " ".join(f"{p:.2f}" for p in by_depth)
    why = (f"accept length {al:.2f} (SGLang's, incl. bonus) on {n_prompts} prompts x {tokens} tokens, "
           f"chain {num_steps}; reached depth: {depth}")
    if al < FAIL_BELOW:
        return fail("probe.accept", why, "the drafter adds nothing: check it was trained for this target "
                    "(aux ids, vocab map, tokenizer) and compare features, not just acceptance")
    if al < WARN_BELOW:
        return warn("probe.accept", why, "likely slower than plain decoding; `fledge tune what-if` with your timings")
    return ok("probe.accept", why)


def coverage_check(tokens: list[int], t2d: torch.Tensor) -> Check:
    if not tokens:
        return warn("probe.coverage", "the target generated no tokens")
    inside = float(t2d.cpu()[torch.tensor(tokens)].float().mean())
    why = f"{inside:.3f} of {len(tokens)} generated target tokens are in the draft vocab (bounds per-token acceptance)"
    if inside < COVERAGE_WARN:
        return warn("probe.coverage", why, "rebuild the draft vocab from this target's own answers (`fledge vocab build`)")
    return ok("probe.coverage", why)
