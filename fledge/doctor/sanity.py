"""Weight sanity for `fledge doctor`, read in fp32 from the files: non-finite or dead tensors,
norms never moved from their init, a draft layer still at its random init. Each catches a drafter
that loads and serves correct text while drafting nothing the target accepts."""

from __future__ import annotations

import math

import numpy as np

from fledge.doctor.checks import Check, fail, ok, warn
from fledge.drafter.weights import Stats, Weights, is_float


def check_weights(stats: dict[str, Stats]) -> Check:
    nonfin = [k for k, s in stats.items() if s.nonfinite]
    zero = [k for k, s in stats.items() if s.lo == 0.0 and s.hi == 0.0]
    const = [k for k, s in stats.items() if s.lo == s.hi and s.ndim >= 2 and k not in zero]
    problems = [f"{what}{keys}" for what, keys in (("NaN/inf in ", nonfin), ("all zeros: ", zero),
                                                    ("constant (dead): ", const)) if keys]
    if problems:
        return fail("weights", "; ".join(problems), "re-export from a healthy training checkpoint (check the loss curve)")
    return ok("weights", f"{len(stats)} float tensors finite and non-degenerate (fp32 scan)")


# Spacing of floats just above 1.0 (machine epsilon), by stored dtype.
_EPS_AT_ONE = {"bfloat16": 2.0 ** -7, "float16": 2.0 ** -10, "float32": 2.0 ** -23, "float64": 2.0 ** -52}


def check_norms(stats: dict[str, Stats], w: Weights) -> Check:
    """Norm gains start at 1.0 and move slowly (~0.002 after a short run). A dtype whose step
    near 1.0 is coarser than that (bf16: 2^-8 below, 2^-7 above) rounds them back to exactly
    1.0, so all-ones is only proof of "never trained" in a dtype fine enough to hold the move."""
    ones = [k for k, s in stats.items() if (k.endswith("norm.weight") or k.startswith("fc_norm."))
            and s.lo == s.hi == 1.0]
    if not ones:
        return ok("norms", "norm weights moved from their init")
    coarse = sorted({w.dtypes[k] for k in ones if _EPS_AT_ONE.get(w.dtypes[k], 0.0) > 1e-4})
    if coarse:
        eps = max(_EPS_AT_ONE[dt] for dt in coarse)
        return warn("norms", f"{ones} are exactly 1.0 in {'/'.join(coarse)}: never trained, or trained briefly - "
                    f"{coarse[0]} holds no value in ({1 - eps / 4:.4f}, {1 + eps / 2:.4f}) but 1.0, and a short run "
                    "moves norms by ~0.002, so the export rounds them back to their init",
                    "re-export with `fledge export --dtype float32` and rerun doctor: still all ones means never "
                    "trained (check that export read the trained checkpoint); if they moved, the bf16 copy lost only "
                    "a gain change a bf16 server rounds away too: harmless")
    return warn("norms", f"{ones} are exactly 1.0 in {w.dtypes[ones[0]]}: never trained (or exported from init)",
                "check that the export read the trained checkpoint")


# Of a drafter's linear weights beyond nn.Linear's init bound 1/sqrt(fan_in): 0 at init, 20-60%
# in trained drafters (the shipped SmolLM2 one: 23-59% per tensor); a few optimizer steps push out
# only the weights that started near the bound.
MOVED_FLOOR = 0.05


def check_trained(w: Weights) -> Check | None:
    """A drafter still at its random init drafts nothing the target accepts, yet passes every
    file check: its draft layer's weights sit inside nn.Linear's init bound. Read in fp32 chunks
    (bf16 rounds values at the bound by up to 2^-8, hence the 1% margin)."""
    names = [k for k in sorted(w.files) if (k.startswith(("midlayer.", "layers.")) or k == "fc.weight")
             and len(w.shapes[k]) == 2 and is_float(w.dtypes[k])]
    if not names:
        return None
    beyond = {}
    for k in names:
        bound, out = 1.01 / math.sqrt(w.shapes[k][1]), 0
        for rows in w.chunks(k):
            out += int(np.count_nonzero(np.abs(rows) > bound))
        beyond[k] = out / math.prod(w.shapes[k])
    most = max(beyond.values())
    if most < MOVED_FLOOR:
        # A WARN, not a FAIL: such a drafter loads and serves exactly, it only pays nothing, and a
        # smoke run of a few steps (the README's quick start) is expected to look like this.
        return warn("trained", f"draft layer at or near its random init: at most {100 * most:.1f}% of any weight lies beyond "
                    f"nn.Linear's init bound 1/sqrt(fan_in) (trained drafters: 20-60%), so it drafts noise the "
                    f"target rejects", "export the trained checkpoint (or train longer); `doctor --probe N` measures it")
    return ok("trained", f"draft weights moved from init: {100 * min(beyond.values()):.0f}-{100 * most:.0f}% beyond "
              "the init bound")
