"""The acceptance model: the expected accept length of a speculative shape, from a drafter's
acceptance profile.

Accept length is SGLang's (accepted drafts + 1 bonus per verify step,
fledge.core.conventions.accept_length). The profile is the probability that, once the accepted path
has reached a node at depth d-1, its rank-r child (rank 0 = the drafter's top guess) is the one
the target accepts, in two tables: `spine[d][r]` where every node on the path is a top guess
(the root included: the spine, which a chain drafts), `ranks[d][r]` elsewhere. Agreement is
correlated along the greedy path, so the spine accepts more than the tree's other nodes at the
same depth, and one table over both under-predicts chains. A chain reads only `spine[d][0]`, the
per-depth conditional acceptance. Approximations, stated once:
  * acceptance at (depth, rank) depends on the path that led there only through whether that
    path is the spine;
  * trees are built by the engine's EAGLE-2 rule (grow the topk best beams per depth, keep the
    num_draft_tokens-1 best candidates by cumulative score) with the profile's mean rank
    probabilities standing in for the drafter's scores. The real tree is re-chosen every round
    from that round's scores, so expect the model to be slightly pessimistic for wide trees;
  * the probe's rounds stand for every shape's. A round starts where the last one ended, so a
    shape that accepts less than the probe's full tree starts more of its rounds where the
    drafter agrees at length: predictions for shapes far from the probe's read slightly low.
Under the first two, `expected_accept_length` is exact (tests check it against a Monte Carlo walk).

Where only an accept length is known, one table serves the spine and the rest: p per depth for
the top guess and p((1-p)/2)^r for the rank-r sibling, a prior that lets trees be ranked at all,
shaped after the shipped SmolLM2 drafter's probe on an H200 (depth 1: 0.301, 0.107, 0.041, 0.027
by rank; the prior gives 0.301, 0.105, 0.037, 0.013). `fledge bench --probe` measures the real
one. Acceptance is taken not to depend on the batch size.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, replace
from pathlib import Path

from fledge.core.errors import FledgeError
from fledge.core.shape import Shape, parse_shape


@dataclass
class Prediction:
    """A shape's predicted round: `fledge tune` ranks these."""

    shape: Shape
    accept_length: float  # SGLang definition, bonus included
    iter_ms: float
    tok_s: float  # per request
    speedup: float  # vs plain decoding at the same batch size
    break_even: float  # accept length at which this shape only matches plain decoding
    low: float | None = None  # the speed-up's range, where the timings carry one
    high: float | None = None

    def call(self, margin: float) -> str:
        """"pays", "loses" or "too close to call" (module doc); without a range, the point decides."""
        lo, hi = (self.low, self.high) if self.low is not None else (self.speedup, self.speedup)
        return "pays" if lo > 1 + margin else "loses" if hi < 1 else "too close to call"


@dataclass
class Profile:
    """The two tables of the module doc, indexed [depth - 1][rank]; without `spine` one table
    serves both. Depths past a table's last row repeat it; ranks past a row's end are never
    accepted."""

    ranks: list[list[float]]
    spine: list[list[float]] | None = None

    def __post_init__(self):
        self.spine = self.ranks if self.spine is None else self.spine
        for name, table in (("spine", self.spine), ("off-spine", self.ranks)):
            if not table or any(not row for row in table):
                raise FledgeError(f"acceptance profile ({name}) is empty")
            for d, row in enumerate(table, 1):
                if any(not 0 <= p <= 1 for p in row) or sum(row) > 1 + 1e-6:
                    raise FledgeError(f"acceptance profile ({name}) depth {d}: {row} — each value in [0, 1], sum <= 1")

    @classmethod
    def sibling_prior(cls, p: float) -> "Profile":
        return cls([[p * ((1 - p) / 2) ** r for r in range(8)]])

    @classmethod
    def fit(cls, accept_length: float, shape: Shape) -> "Profile":
        """The sibling prior (module doc) whose expected accept length at `shape` is
        `accept_length`, by bisection on p (the expectation grows with p)."""
        top = shape.path_len
        if not 1 <= accept_length <= top:
            raise FledgeError(f"--accept-length {accept_length}: at steps {shape.num_steps} / topk {shape.topk} / "
                              f"{shape.num_draft_tokens} tokens it must be in [1, {top}] "
                              "(set --accept-shape to where you measured it)")
        lo, hi = 0.0, 1.0
        for _ in range(50):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if expected_accept_length(cls.sibling_prior(mid), shape) < accept_length else (lo, mid)
        return cls.sibling_prior((lo + hi) / 2)

    def at(self, depth: int, rank: int, spine: bool) -> float:
        """P(the rank-r child at `depth` is accepted | its parent, on the spine or not, was reached)."""
        table = self.spine if spine else self.ranks
        row = table[min(depth, len(table)) - 1]
        return row[rank] if rank < len(row) else 0.0

    @property
    def width(self) -> int:
        return max(len(r) for r in self.ranks + self.spine)

    def tables(self) -> dict[str, list[list[float]]]:
        return {"spine": self.spine, "ranks": self.ranks}


def parse_profile(text: str) -> Profile:
    """Depths separated by commas, ranks within a depth by '/': "0.7/0.1,0.6/0.12,0.5"."""
    try:
        return Profile([[float(x) for x in depth.split("/")] for depth in text.split(",") if depth.strip()])
    except ValueError:
        raise FledgeError(f"--accept-profile {text!r}: expected numbers like '0.7/0.1,0.6/0.12,0.5'") from None


def profile_from_json(path) -> Profile:
    """A profile from `fledge bench --json` or `fledge tune --json` output: engine probe
    ({"profile": {"spine": ..., "ranks": ...}}), vLLM log ({"profile": [[p], ...]}), a bare
    {"ranks": ...} (and "spine"). A table alone serves the spine and the rest."""
    try:
        obj = json.loads(Path(path).read_text())
        prof = obj if obj.get("ranks") else obj["profile"]
        return Profile(prof["ranks"], prof.get("spine")) if isinstance(prof, dict) else Profile(prof)
    except (OSError, ValueError, AttributeError, KeyError, TypeError) as e:
        raise FledgeError(f"{path}: no acceptance profile ('ranks' or 'profile') in it ({e})") from None


def profile_from_args(args) -> tuple[Profile, Shape | None, str]:
    """The acceptance profile the user gave, the shape an --accept-length was measured at (the
    reference for "what would have to change"), and a line saying what was assumed."""
    given = [a for a in (args.accept_profile, args.accept_length, args.accept_json) if a is not None]
    if len(given) != 1:
        raise FledgeError("give exactly one of --accept-length (with --accept-shape), --accept-profile, --accept-json")
    if args.accept_json:
        return profile_from_json(args.accept_json), None, f"acceptance: the profile in {args.accept_json}"
    if args.accept_profile:
        return parse_profile(args.accept_profile), None, "acceptance: the --accept-profile given"
    steps = args.accept_steps
    shape = parse_shape(args.accept_shape, "--accept-shape") if args.accept_shape else Shape(steps, 1, steps + 1)
    prof = Profile.fit(args.accept_length, shape)
    return prof, shape, (f"acceptance: accept length {args.accept_length:.2f} taken as measured at {shape.label} "
                         f"(--accept-shape); fitted top-guess acceptance {prof.spine[0][0]:.3f} per depth, rank-r siblings "
                         "p((1-p)/2)^r (a prior: `fledge bench --probe` measures them)")


def chain_profile(reached: list[float]) -> list[list[float]]:
    """A chain's table from P(the accepted path reached depth i), i = 1..k: the conditional
    acceptance per depth, what serving logs and counters give."""
    return [[reached[0]]] + [[b / a if a > 0 else 0.0] for a, b in zip(reached, reached[1:])]


def chain_accept_length(p: list[float]) -> float:
    """1 + sum_d prod_{j<=d} p_j: the chain's expected accept length (bonus included)."""
    return 1.0 + sum(itertools.accumulate(p, lambda a, b: a * b))


@dataclass
class Node:
    depth: int
    rank: int
    parent: int  # index into the node list, -1 = the root
    prob: float  # P(this node is accepted) = product of rank probabilities along its path
    spine: bool  # every node on its path, itself included, is rank 0


def build_tree(profile: Profile, shape: Shape) -> list[Node]:
    """The kept nodes of the engine's EAGLE-2 tree, parents before children (see module doc)."""
    K = shape.topk
    cands = [Node(1, r, -1, profile.at(1, r, True), r == 0) for r in range(K)]
    beams = list(range(K))
    for depth in range(2, shape.num_steps + 1):
        children = []
        for b in beams:
            up = cands[b]
            for r in range(K):
                children.append(len(cands))
                cands.append(Node(depth, r, b, up.prob * profile.at(depth, r, up.spine), up.spine and r == 0))
        beams = sorted(children, key=lambda i: -cands[i].prob)[:K]  # stable: earlier wins ties
    # Ties go to the shallower, earlier candidate, so a parent is never dropped before its child.
    keep = sorted(sorted(range(len(cands)), key=lambda i: (-cands[i].prob, cands[i].depth, i))[:shape.num_draft_tokens - 1])
    index = {c: i for i, c in enumerate(keep)}
    return [replace(cands[c], parent=index.get(cands[c].parent, -1)) for c in keep]


def expected_accept_length(profile: Profile, shape: Shape) -> float:
    """Accepted nodes form one root path, so E[accept length] = 1 + sum of P(node accepted)."""
    return 1.0 + sum(n.prob for n in build_tree(profile, shape))
