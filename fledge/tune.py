"""`fledge tune`: predict speculative-decoding tok/s before deploying, and pick the flags.

The cost model, per verify round of one request at a given batch size:

    tok/s = E[accept length] / (num_steps * t_draft(topk) + t_verify(num_draft_tokens) + overhead)

against plain decoding at 1 / t_ar. Accept length is SGLang's (accepted drafts + 1 bonus per
verify step, fledge.conventions.accept_length), so speculation pays iff
E[accept length] > t_iter / t_ar — the break-even accept length this module reports.

The acceptance profile is the probability that, once the accepted path has reached a node at
depth d-1, its rank-r child (rank 0 = the drafter's top guess) is the one the target accepts, in
two tables by the node reached: `spine[d][r]` where every node on its path is a top guess (the
root included: the spine, which a chain drafts), `ranks[d][r]` elsewhere. Agreement is
correlated along the greedy path, so the spine accepts more than the tree's other nodes at the
same depth, and one table over both under-predicts chains. A chain only uses the spine's
rank 0: `spine[d][0]` is the per-depth conditional acceptance p_d. Approximations, stated once:
  * acceptance at (depth, rank) depends on the path that led there only through whether that
    path is the spine;
  * trees are built by the engine's EAGLE-2 rule (grow the topk best beams per depth, keep the
    num_draft_tokens-1 best candidates by cumulative score) with the profile's mean rank
    probabilities standing in for the drafter's scores — a calibrated drafter. The real tree
    is re-chosen every round from that round's scores, so it adapts where this fixed shape
    cannot; expect the model to be slightly pessimistic for wide trees;
  * the probe's rounds stand for every shape's. A round starts where the last one ended, so a
    shape that accepts less than the probe's full tree starts relatively more of its rounds in
    the stretches where the drafter agrees at length: predictions for shapes far from the
    probe's read slightly low.
Under the first two assumptions `expected_accept_length` is exact (tests check it against
Monte Carlo).

Where only an accept length is known (`--accept-length`, measured at `--accept-shape`), the
profile is one table for the spine and the rest: one p per depth for the top guess and
p((1-p)/2)^r for the rank-r sibling — a prior that lets trees be ranked at all, shaped after
the shipped SmolLM2 drafter's probe on an H200 (depth 1: 0.301, 0.107, 0.041, 0.027 by rank;
the prior gives 0.301, 0.105, 0.037, 0.013). `fledge bench --probe` measures the real one.
Acceptance is taken not to depend on the batch size.

Timings come from the user (--what-if), from fledge.hwmodel (--model: the configs and the
hardware, optionally calibrated from a live server), or from the engine (--target). A shape
"pays" only if its predicted gain exceeds `--margin` (default 5%): below that the difference is
inside what the timings and the model can resolve, and the verdict is to serve without
speculation.
"""

from __future__ import annotations

import itertools
import json
import random
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from fledge.util import FledgeError, atomic_write_json, save_figure


# --------------------------------------------------------------------------- inputs
@dataclass
class Timings:
    """Milliseconds per step of one batch. `verify_ms` maps tokens verified per request (the
    tree size n) to the target forward time; `draft_ms` maps topk to one draft step."""

    ar_ms: float
    verify_ms: dict[int, float]
    draft_ms: dict[int, float]
    overhead_ms: float = 0.0
    batch: int = 1

    def __post_init__(self):
        self.verify_ms = {int(k): float(v) for k, v in sorted(self.verify_ms.items())}
        self.draft_ms = {int(k): float(v) for k, v in sorted(self.draft_ms.items())}
        if not self.ar_ms > 0:
            raise FledgeError(f"--ar-ms {self.ar_ms}: must be > 0")
        if not self.verify_ms or min(self.verify_ms) < 1 or min(self.verify_ms.values()) <= 0:
            raise FledgeError(f"--verify-ms {self.verify_ms}: need n >= 1 tokens and times > 0")
        if not self.draft_ms or min(self.draft_ms.values()) < 0 or self.overhead_ms < 0:
            raise FledgeError("--draft-ms and --overhead-ms must be >= 0")

    def verify(self, n: int) -> float:
        return _interp(self.verify_ms, n)

    def draft(self, topk: int) -> float:
        return _interp(self.draft_ms, topk)


def _interp(table: dict[int, float], x: float) -> float:
    """Piecewise linear through the measured points; flat below the first (and everywhere for a
    single point), extended along the last segment beyond the last (forward time grows ~linearly
    once compute-bound)."""
    xs = sorted(table)
    if x <= xs[0] or len(xs) == 1:
        return table[xs[0]]
    a, b = xs[-2], xs[-1]
    for lo, hi in zip(xs, xs[1:]):
        if x <= hi:
            a, b = lo, hi
            break
    return table[a] + (table[b] - table[a]) * (x - a) / (b - a)


@dataclass
class Profile:
    """ranks[d-1][r]: P(rank-r child at depth d is accepted | the path reached a node at depth
    d-1 off the spine); spine[d-1][r] the same for a node on it (module doc). Without `spine`
    one table serves both. Depths past a table's last row repeat it; ranks past a row's end are
    never accepted."""

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
    def chain(cls, p: list[float]) -> "Profile":
        return cls([[float(x)] for x in p])

    @classmethod
    def geometric(cls, accept_length: float, num_steps: int) -> "Profile":
        """The constant p with 1 + p + p^2 + ... + p^num_steps = accept_length, chains only."""
        return cls.chain([cls.fit(accept_length, Shape(num_steps, 1, num_steps + 1)).spine[0][0]])

    @classmethod
    def sibling_prior(cls, p: float, width: int = 8) -> "Profile":
        return cls([[p * ((1 - p) / 2) ** r for r in range(width)]])

    @classmethod
    def fit(cls, accept_length: float, shape: "Shape") -> "Profile":
        """The sibling prior (module doc) whose expected accept length at `shape` is
        `accept_length`, by bisection on p (the expectation grows with p)."""
        top = min(shape.num_steps, shape.num_draft_tokens - 1) + 1
        if not 1 <= accept_length <= top:
            raise FledgeError(f"--accept-length {accept_length}: at steps {shape.num_steps} / topk {shape.topk} / "
                              f"{shape.num_draft_tokens} tokens it must be in [1, {top}] (set --accept-shape to where you measured it)")
        lo, hi = 0.0, 1.0
        for _ in range(50):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if expected_accept_length(cls.sibling_prior(mid), shape) < accept_length else (lo, mid)
        return cls.sibling_prior((lo + hi) / 2)

    def at(self, depth: int, rank: int, spine: bool) -> float:
        """P(the rank-r child at `depth` is accepted | its parent was reached), the parent on
        the spine or not."""
        table = self.spine if spine else self.ranks
        row = table[min(depth, len(table)) - 1]
        return row[rank] if rank < len(row) else 0.0

    @property
    def width(self) -> int:
        return max(len(r) for r in self.ranks + self.spine)

    def tables(self) -> dict[str, list[list[float]]]:
        return {"spine": self.spine, "ranks": self.ranks}


@dataclass(frozen=True)
class Shape:
    """SGLang's three knobs (same meaning as fledge.engine.drafters.SpecConfig, kept separate so
    the cost model runs without the engine)."""

    num_steps: int
    topk: int
    num_draft_tokens: int

    def __post_init__(self):
        cap = 1 + self.topk + (self.num_steps - 1) * self.topk ** 2
        chain_ok = self.topk > 1 or self.num_draft_tokens == self.num_steps + 1
        if self.num_steps < 1 or self.topk < 1 or not 2 <= self.num_draft_tokens <= cap or not chain_ok:
            raise FledgeError(f"speculative shape steps={self.num_steps} topk={self.topk} "
                              f"draft_tokens={self.num_draft_tokens} is impossible (2..{cap} nodes; chains: steps+1)")

    @property
    def label(self) -> str:
        return f"s{self.num_steps} k{self.topk} n{self.num_draft_tokens}"

    def sglang_flags(self) -> str:
        return (f"--speculative-algorithm EAGLE3 --speculative-num-steps {self.num_steps} "
                f"--speculative-eagle-topk {self.topk} --speculative-num-draft-tokens {self.num_draft_tokens}")

    def vllm_flags(self, drafter: str) -> str | None:
        """vLLM's EAGLE-3 drafts a chain only: no flag set reproduces a topk > 1 tree."""
        if self.topk != 1:
            return None
        cfg = {"method": "eagle3", "model": drafter, "num_speculative_tokens": self.num_steps}
        return f"--speculative-config '{json.dumps(cfg)}'"


# --------------------------------------------------------------------------- acceptance
def chain_accept_length(p: list[float]) -> float:
    """1 + sum_d prod_{j<=d} p_j: the chain's expected accept length (bonus included)."""
    total, reach = 1.0, 1.0
    for x in p:
        reach *= x
        total += reach
    return total


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
    return [Node(cands[c].depth, cands[c].rank, index[cands[c].parent] if cands[c].parent >= 0 else -1,
                 cands[c].prob, cands[c].spine) for c in keep]


def expected_accept_length(profile: Profile, shape: Shape) -> float:
    """Accepted nodes form one root path, so E[accept length] = 1 + sum of P(node accepted)."""
    return 1.0 + sum(n.prob for n in build_tree(profile, shape))


def simulate_accept_length(profile: Profile, shape: Shape, rounds: int, seed: int = 0) -> float:
    """Monte Carlo of the same model: at each reached node the target picks at most one child
    rank (probabilities from the spine's table while the walk is on it, the other after); the
    walk stops when that child is not in the tree."""
    tree, rng = build_tree(profile, shape), random.Random(seed)
    children: dict[tuple[int, int], int] = {(n.parent, n.rank): i for i, n in enumerate(tree)}
    total = 0
    for _ in range(rounds):
        node, depth, gained, spine = -1, 1, 1, True
        while True:
            u, acc, pick = rng.random(), 0.0, None
            for r in range(profile.width):
                acc += profile.at(depth, r, spine)
                if u < acc:
                    pick = r
                    break
            if pick is None or (node, pick) not in children:
                break
            node, depth, gained, spine = children[(node, pick)], depth + 1, gained + 1, spine and pick == 0
        total += gained
    return total / rounds


# --------------------------------------------------------------------------- predictions
@dataclass
class Prediction:
    shape: Shape
    accept_length: float  # SGLang definition, bonus included
    iter_ms: float
    tok_s: float  # per request
    speedup: float  # vs plain decoding at the same batch size
    break_even: float  # accept length at which this shape only matches plain decoding


def predict(profile: Profile, timings: Timings, shape: Shape) -> Prediction:
    L = expected_accept_length(profile, shape)
    t = shape.num_steps * timings.draft(shape.topk) + timings.verify(shape.num_draft_tokens) + timings.overhead_ms
    return Prediction(shape, L, t, 1e3 * L / t, L * timings.ar_ms / t, t / timings.ar_ms)


def grid(max_steps: int = 8, topks=(1, 2, 4, 8), draft_tokens=(4, 8, 16, 32, 64)) -> list[Shape]:
    """Chains of 1..max_steps, and trees of every (steps, topk > 1, draft tokens) that fits."""
    out = [Shape(s, 1, s + 1) for s in range(1, max_steps + 1)]
    for s in range(2, max_steps + 1):
        for k in topks:
            cap = 1 + k + (s - 1) * k * k
            out += [Shape(s, k, n) for n in draft_tokens if k > 1 and n <= cap and n > s + 1]
    return out


def rank_all(profile: Profile, timings: Timings, shapes: list[Shape]) -> list[Prediction]:
    """Predictions for every shape the profile can speak for, best tok/s first. Trees need
    rank > 0 probabilities: a chain-only profile is evaluated on chains only."""
    usable = [s for s in shapes if s.topk == 1 or profile.width > 1]
    return sorted((predict(profile, timings, s) for s in usable), key=lambda p: -p.tok_s)


# --------------------------------------------------------------------------- parsing
def parse_ms_table(text: str, arg: str) -> dict[int, float]:
    """"1:11.6,8:30" → {1: 11.6, 8: 30.0}; a bare "1.5" means the same time for every key."""
    try:
        if ":" not in text:
            return {1: float(text)}
        pairs = [item.split(":") for item in text.split(",") if item.strip()]
        table = {int(k): float(v) for k, v in pairs}
    except ValueError:
        raise FledgeError(f"{arg} {text!r}: expected N:MS pairs like '1:11.6,8:30'") from None
    if not table:
        raise FledgeError(f"{arg} {text!r}: no N:MS pairs")
    return table


def parse_profile(text: str) -> Profile:
    """Depths separated by commas, ranks within a depth by '/': "0.7/0.1,0.6/0.12,0.5"."""
    try:
        return Profile([[float(x) for x in depth.split("/")] for depth in text.split(",") if depth.strip()])
    except ValueError:
        raise FledgeError(f"--accept-profile {text!r}: expected numbers like '0.7/0.1,0.6/0.12,0.5'") from None


# --------------------------------------------------------------------------- verdict
@dataclass
class Verdict:
    pays: bool
    line: str
    change: str  # what would make the reference shape pay (or keep paying), one line


def verdict(preds: list[Prediction], timings: Timings, margin: float, ref: Prediction | None = None) -> Verdict:
    """One line: speculate with the best shape only if it beats plain decoding by more than
    `margin`; and for `ref` (default the best shape) the verify time or the accept length at
    which it would clear that bar."""
    best, ar_tok_s, need = preds[0], 1e3 / timings.ar_ms, 1 + margin
    gain = 100 * (best.speedup - 1)
    if best.speedup > need:
        line = (f"VERDICT: speculate with {best.shape.label}: {best.tok_s:.1f} tok/s per request against "
                f"{ar_tok_s:.1f} without ({gain:+.1f}%)")
    else:
        why = "every shape loses" if best.speedup <= 1 else f"the best gain, {gain:+.1f}% ({best.shape.label}), is inside the {100 * margin:.0f}% margin"
        line = f"VERDICT: serve without speculation — {why}; plain decoding {ar_tok_s:.1f} tok/s per request"
    ref = ref or best
    s = ref.shape
    rest = s.num_steps * timings.draft(s.topk) + timings.overhead_ms
    verify_now = timings.verify(s.num_draft_tokens)
    verify_max = ref.accept_length * timings.ar_ms / need - rest
    accept_min = need * ref.iter_ms / timings.ar_ms
    top = min(s.num_steps, s.num_draft_tokens - 1) + 1
    v = (f"verify <= {verify_max:.2f} ms (predicted {verify_now:.2f})" if verify_max > 0 else
         f"no verify time is enough (drafting and the rest of a round take {rest:.2f} ms)")
    a = f"accept length >= {accept_min:.2f} (now {ref.accept_length:.2f})" + (f", more than {s.label} can accept ({top})" if accept_min > top else "")
    return Verdict(best.speedup > need, line, f"{s.label} beats plain decoding by {100 * margin:.0f}% at: {v}, or {a}")


# --------------------------------------------------------------------------- concurrency
def sweep(profile: Profile, timings_at, shapes: list[Shape], levels, margin: float) -> list[dict]:
    """Best shape and speed-up at each concurrency; `timings_at(c)` gives the Timings of batch c."""
    rows = []
    for c in levels:
        t = timings_at(c)
        best = rank_all(profile, t, shapes)[0]
        rows.append({"concurrency": c, "ar_tok_s_per_request": 1e3 / t.ar_ms, "ar_tok_s_total": c * 1e3 / t.ar_ms,
                     "best": asdict(best.shape), "label": best.shape.label, "speedup": best.speedup,
                     "pays": best.speedup > 1 + margin})
    return rows


def stops_paying(rows: list[dict]) -> int | None:
    """The first concurrency at which speculation no longer pays (None: it pays at every level shown)."""
    return next((r["concurrency"] for r in rows if not r["pays"]), None)


def _runs(levels: list[int]) -> str:
    return ", ".join(str(c) for c in levels) if levels else "none"


# --------------------------------------------------------------------------- reporting
def report(preds: list[Prediction], timings: Timings, drafter: str, margin: float = 0.05, ref: Prediction | None = None,
           notes: tuple[str, ...] = (), conc: list[dict] | None = None, top: int = 12) -> tuple[str, dict]:
    """One screen: where the figures come from, the table, the verdict, flags only if it pays,
    the break-even accept length, what would have to change; and the same as a JSON-able dict."""
    ar = 1e3 / timings.ar_ms
    best = preds[0]
    v = verdict(preds, timings, margin, ref)
    lines = [*notes, f"plain decoding: {ar:.1f} tok/s per request ({timings.ar_ms:.2f} ms a step, batch {timings.batch}); "
             "accept length = SGLang's (accepted + bonus per verify step)",
             f"{'steps':>5} {'topk':>4} {'tokens':>6} {'accept':>7} {'iter ms':>8} {'tok/s':>8} {'speedup':>8} {'break-even':>10}"]
    for p in preds[:top]:
        s = p.shape
        lines.append(f"{s.num_steps:>5} {s.topk:>4} {s.num_draft_tokens:>6} {p.accept_length:>7.2f} {p.iter_ms:>8.2f} "
                     f"{p.tok_s:>8.1f} {p.speedup:>7.2f}x {p.break_even:>10.2f}")
    lines.append(v.line)
    if v.pays:
        vllm = best.shape.vllm_flags(drafter)
        chains = [p for p in preds if p.shape.topk == 1]
        lines.append(f"  SGLang: {best.shape.sglang_flags()}")
        if vllm:
            lines.append(f"  vLLM:   {vllm}")
        elif chains and chains[0].speedup > 1 + margin:
            lines.append(f"  vLLM:   drafts chains only; its best chain {chains[0].shape.label} ({chains[0].speedup:.2f}x): "
                         + chains[0].shape.vllm_flags(drafter))
        else:
            lines.append("  vLLM:   drafts chains only, and no chain pays: serve it without speculation")
    ref = ref or best
    lines.append(f"break-even accept length at {ref.shape.label}: {ref.break_even:.2f} (predicted {ref.accept_length:.2f})")
    lines.append(("to keep paying" if ref.speedup > 1 + margin else "to pay") + f": {v.change}")
    if conc:
        lines.append(f"{'concurrency':>11} {'plain tok/s':>11} {'best shape':>12} {'speedup':>8}")
        lines += [f"{r['concurrency']:>11} {r['ar_tok_s_total']:>11.1f} {r['label']:>12} {r['speedup']:>7.2f}x" for r in conc]
        stop = stops_paying(conc)
        lines.append(f"speculation pays at concurrency {_runs([r['concurrency'] for r in conc if r['pays']])}; "
                     + (f"it stops paying at {stop}" if stop else "at every level shown"))
    data = {"ar_tok_s": ar, "timings": asdict(timings), "margin": margin, "pays": v.pays, "verdict": v.line,
            "verdict_short": "WINS" if v.pays else "LOSES", "gain_percent": 100 * (best.speedup - 1), "change": v.change,
            "best": _pred_dict(best, drafter), "reference": _pred_dict(ref, drafter), "notes": list(notes),
            "predictions": [_pred_dict(p, drafter) for p in preds]}
    if conc:
        data.update(concurrency=conc, stops_paying_at=stops_paying(conc))
    return "\n".join(line for line in lines if line), data


def _pred_dict(p: Prediction, drafter: str) -> dict:
    return {**asdict(p.shape), "accept_length": p.accept_length, "iter_ms": p.iter_ms, "tok_s": p.tok_s,
            "speedup": p.speedup, "break_even_accept_length": p.break_even,
            "sglang": p.shape.sglang_flags(), "vllm": p.shape.vllm_flags(drafter)}


def plot(preds: list[Prediction], ar_tok_s: float, path, measured: dict | None = None, conc: list[dict] | None = None,
         top: int = 24) -> None:
    """Speed-up by shape (measured points on top when validating) and, given a sweep, the best
    speed-up by concurrency."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = preds[:top]
    fig, axes = plt.subplots(1, 2 if conc else 1, figsize=(max(6, 0.45 * len(shown)) + (5 if conc else 0), 4), squeeze=False)
    ax = axes[0][0]
    ax.bar(range(len(shown)), [p.speedup for p in shown], color="#4c78a8", label="predicted")
    if measured:
        xs = [i for i, p in enumerate(shown) if p.shape in measured]
        ax.scatter(xs, [measured[shown[i].shape] / ar_tok_s for i in xs], color="#e45756", zorder=3, label="measured")
    ax.axhline(1.0, color="black", linestyle="--", label=f"no speculation ({ar_tok_s:.0f} tok/s)")
    ax.set_xticks(range(len(shown)), [p.shape.label for p in shown], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("speed-up per request")
    ax.legend(fontsize=8)
    if conc:
        bx = axes[0][1]
        bx.plot([r["concurrency"] for r in conc], [r["speedup"] for r in conc], marker="o", color="#4c78a8")
        for r in conc:
            bx.annotate(r["label"], (r["concurrency"], r["speedup"]), fontsize=6, rotation=30)
        bx.axhline(1.0, color="black", linestyle="--")
        bx.set_xscale("log", base=2)
        bx.set_xlabel("concurrency")
        bx.set_ylabel("best speed-up")
    fig.tight_layout()
    save_figure(fig, path)


def write_outputs(text: str, data: dict, preds, timings: Timings, args, measured=None) -> None:
    print(text)
    if args.json:
        atomic_write_json(args.json, data)
    if args.png:
        plot(preds, 1e3 / timings.ar_ms, args.png, measured, data.get("concurrency"))


# --------------------------------------------------------------------------- inputs from the CLI
def profile_from_json(path) -> Profile:
    """A profile from `fledge bench --json` or `fledge tune --json` output: engine probe
    ({"profile": {"spine": ..., "ranks": ...}}), vLLM log ({"profile": [[p], ...]}), a bare
    {"ranks": ...} (and "spine"). A table alone serves the spine and the rest."""
    try:
        obj = json.loads(open(path).read())
        prof = obj if obj.get("ranks") else obj["profile"]
        return Profile(prof["ranks"], prof.get("spine")) if isinstance(prof, dict) else Profile(prof)
    except (OSError, ValueError, AttributeError, KeyError, TypeError) as e:
        raise FledgeError(f"{path}: no acceptance profile ('ranks' or 'profile') in it ({e})") from None


def acceptance(args) -> tuple[Profile, Shape | None, str]:
    """The acceptance profile the user gave, the shape an --accept-length was measured at (the
    reference for "what would have to change"), and a line saying what was assumed."""
    given = [a for a in (args.accept_profile, args.accept_length, args.profile_json) if a is not None]
    if len(given) != 1:
        raise FledgeError("give exactly one of --accept-length (with --accept-shape), --accept-profile, --profile-json")
    if args.profile_json:
        return profile_from_json(args.profile_json), None, f"acceptance: the profile in {args.profile_json}"
    if args.accept_profile:
        return parse_profile(args.accept_profile), None, "acceptance: the --accept-profile given"
    shape = parse_shape(args.accept_shape) if args.accept_shape else Shape(args.accept_steps, 1, args.accept_steps + 1)
    prof = Profile.fit(args.accept_length, shape)
    p = prof.spine[0][0]
    return prof, shape, (f"acceptance: accept length {args.accept_length:.2f} taken as measured at {shape.label} "
                         f"(--accept-shape); fitted top-guess acceptance {p:.3f} per depth, rank-r siblings p((1-p)/2)^r "
                         "(a prior: `fledge bench --probe` measures them)")


def parse_shape(text: str) -> Shape:
    try:
        return Shape(*(int(x) for x in text.split(",")))
    except (ValueError, TypeError):
        raise FledgeError(f"shape {text!r}: expected STEPS,TOPK,TOKENS like '3,4,16'") from None


def model_specs(args):
    from fledge import hwmodel

    return hwmodel.load_specs(args.model, args.drafter, args.dtype, args.quant, args.draft_vocab)


def machine(args):
    """Hardware from --profile (a `tune calibrate` output), then the CLI's table names and overrides."""
    from fledge import hwmodel

    base = {}
    if args.profile:
        try:
            base = json.loads(Path(args.profile).read_text())["hardware"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise FledgeError(f"--profile {args.profile}: not a `fledge tune calibrate` profile ({e})") from None
    gpu = args.gpu or base.get("gpu")
    if not gpu:
        raise FledgeError(f"--model needs --gpu NAME (one of {', '.join(hwmodel.GPUS)}) or --profile FROM_CALIBRATE")
    cli = {"hbm_gbs": args.hbm_gbs, "latency_us": args.allreduce_us, "bus_gbs": args.allreduce_gbs,
           "host_ms": args.host_ms, "bw_efficiency": args.bw_efficiency, "flops_efficiency": args.flops_efficiency}
    if args.tflops:
        cli["tflops"] = {k: args.tflops for k in ("bf16", "fp16", "fp8", "fp32")}
    over = {**base.get("overrides", {}), **{k: v for k, v in cli.items() if v is not None}}
    tp, link = args.tp or base.get("tp", 1), args.interconnect or base.get("interconnect", "nvlink")
    hw = hwmodel.hardware(gpu, tp, link, cuda_graphs=not args.no_cuda_graphs and base.get("cuda_graphs", True), **over)
    label = f"{tp} x {gpu}" + (f" over {link}" if tp > 1 else "") + (f", calibrated by {args.profile}" if args.profile else "")
    return hw, label


def model_timings(target, drafter, hw, batch: int, context: int) -> Timings:
    from fledge import hwmodel

    st = hwmodel.step_times(target, drafter, hw, batch, context)
    return Timings(st.ar_ms, st.verify_ms, st.draft_ms, st.overhead_ms, batch)


def _levels(text: str) -> list[int]:
    from fledge.calibrate import parse_levels

    return parse_levels(text, "--concurrency")


# --------------------------------------------------------------------------- modes
def _check_grid_args(args) -> None:
    if args.max_steps < 1:
        raise FledgeError(f"--max-steps {args.max_steps}: must be >= 1")
    if not 0 <= args.margin < 1:
        raise FledgeError(f"--margin {args.margin}: a fraction in [0, 1), e.g. 0.05")


def _ref(profile, timings, ref_shape):
    return predict(profile, timings, ref_shape) if ref_shape else None


def _what_if(args) -> int:
    _check_grid_args(args)
    for name in ("ar_ms", "verify_ms"):
        if getattr(args, name) is None:
            raise FledgeError(f"--what-if needs --{name.replace('_', '-')}")
    notes = ["timings: as given (--what-if)"]
    if args.draft_ms is not None:
        draft = parse_ms_table(args.draft_ms, "--draft-ms")
    elif args.model:
        predicted = model_timings(*model_specs(args), machine(args)[0], args.batch, args.context)
        draft = predicted.draft_ms
        notes.append("draft step predicted from the drafter's config (--model/--drafter, --gpu): "
                     + ", ".join(f"topk {k}: {v:.3f} ms" for k, v in draft.items()))
    else:
        raise FledgeError("--what-if needs --draft-ms (ms per draft step, by topk '1:0.4,4:0.5'), or --model CONFIG "
                          "--gpu NAME to predict it from the drafter's size (one decoder layer and its LM head)")
    timings = Timings(args.ar_ms, parse_ms_table(args.verify_ms, "--verify-ms"), draft, args.overhead_ms, args.batch)
    profile, ref_shape, note = acceptance(args)
    preds = rank_all(profile, timings, grid(args.max_steps))
    text, data = report(preds, timings, args.drafter or "<drafter dir>", args.margin, _ref(profile, timings, ref_shape),
                        (*notes, note))
    data["profile"] = profile.tables()
    write_outputs(text, data, preds, timings, args)
    return 0


def _hardware_model(args) -> int:
    _check_grid_args(args)
    target, drafter = model_specs(args)
    hw, label = machine(args)
    profile, ref_shape, note = acceptance(args)
    timings = model_timings(target, drafter, hw, args.batch, args.context)
    shapes = grid(args.max_steps)
    preds = rank_all(profile, timings, shapes)
    moe = f", MoE {target.active}/{target.experts} experts" if target.experts else ""
    src = (f"hardware model: {args.model} ({target.layers} layers{moe}, {target.quant} weights) on {label}, "
           f"batch {args.batch}, context {args.context}, CUDA graphs {'on' if hw.cuda_graphs else 'off'}")
    conc = sweep(profile, lambda c: model_timings(target, drafter, hw, c, args.context), shapes, _levels(args.concurrency),
                 args.margin)
    text, data = report(preds, timings, args.drafter or "<drafter dir>", args.margin, _ref(profile, timings, ref_shape),
                        (src, note), conc)
    from fledge import hwmodel

    data.update(profile=profile.tables(), hardware=asdict(hw),
                breakdown=hwmodel.step_times(target, drafter, hw, args.batch, args.context).breakdown)
    write_outputs(text, data, preds, timings, args)
    return 0


def run_tune(args) -> int:
    if args.action == "calibrate":
        from fledge.calibrate import cmd_calibrate

        return cmd_calibrate(args)
    if args.what_if:
        return _what_if(args)
    if args.model:
        return _hardware_model(args)
    if args.target and args.drafter:
        return measured_tune(args)
    raise FledgeError("tune needs --model CONFIG --gpu NAME (hardware model), --target T --drafter D (measure the engine), "
                      "--what-if with your own timings, or `tune calibrate --url URL`")


# --------------------------------------------------------------------------- the engine, measured
def measured_tune(args) -> int:
    """`fledge tune --target T --drafter D`: time the engine as `fledge generate` runs it, measure
    acceptance, predict every shape; with --validate, also run shapes for real and compare."""
    from fledge import bench

    _check_grid_args(args)
    rig = bench.load_rig(args.target, args.drafter, args.device, args.dtype)
    prompts = bench.load_prompts(args.prompts, args.num_prompts, rig.tokenizer)
    ar = bench.run_ar(rig, prompts, args.max_new_tokens)
    topks = sorted({1, *[k for k in (2, 4, 8) if k <= args.probe_topk]})
    context = max(len(p) for p in prompts) + args.max_new_tokens // 2
    shapes = grid(args.max_steps, tuple(topks))
    # Every width a shape verifies, timed rather than interpolated: the engine's matmul path
    # changes with the row count (reductions up to model.GEMV_ROWS, then the few-rows kernel),
    # so verify time is not smooth in n.
    sizes = sorted({s.num_draft_tokens for s in shapes})
    iters = 20 if rig.device.type == "cuda" else 3  # CPU forwards are slow and steady
    verify_ms = bench.measure_verify_ms(rig, sizes, context, iters)
    draft_ms, overhead = bench.measure_draft_ms(rig, prompts[:2], topks, min(64, args.max_new_tokens), context, iters)
    timings = Timings(ar["ar_ms"], verify_ms, draft_ms, overhead, batch=1)
    if args.profile_json:
        profile = profile_from_json(args.profile_json)
    else:
        probed = bench.probe_profile(rig, prompts, args.max_steps, args.probe_topk, args.max_new_tokens)
        profile = Profile(probed["ranks"], probed["spine"])
    preds = rank_all(profile, timings, shapes)
    note = f"timings: measured on fledge's engine ({bench.engine_path(rig)}), batch 1"
    text, data = report(preds, timings, args.drafter, args.margin, notes=(note,))
    data.update(profile=profile.tables(), ar_measured_tok_s=ar["tok_s"])
    measured = None
    if args.validate:
        picks = [parse_shape(x) for x in args.shapes.split(";")] if args.shapes else validation_shapes(preds)
        rows, measured = validate(rig, prompts, [predict(profile, timings, s) for s in picks], args.max_new_tokens,
                                  ar["tok_s"])
        text += "\n" + validation_table(rows)
        data["validation"] = rows
    write_outputs(text, data, preds, timings, args, measured)
    return 0


def validation_shapes(preds: list[Prediction], want: int = 8) -> list[Shape]:
    """The predicted best chain and tree, fixed reference shapes, then the next best of each
    kind in turn until `want` shapes (chains and trees both present when the grid has trees)."""
    chains = [p.shape for p in preds if p.shape.topk == 1]
    trees = [p.shape for p in preds if p.shape.topk > 1]
    fixed = [Shape(2, 1, 3), Shape(4, 1, 5), Shape(6, 1, 7), Shape(4, 2, 8), Shape(5, 4, 16), Shape(6, 4, 32)]
    picks = list(dict.fromkeys(chains[:1] + trees[:1] + [s for s in fixed if s in chains or s in trees]))
    for s in itertools.chain.from_iterable(itertools.zip_longest(chains, trees)):
        if len(picks) >= want:
            break
        if s is not None and s not in picks:
            picks.append(s)
    return picks


def _error_percent(predicted: float, measured: float) -> float:
    return 100 * (predicted - measured) / measured


def validate(rig, prompts, preds: list[Prediction], max_new_tokens: int, ar_tok_s: float) -> tuple[list[dict], dict]:
    """Run each predicted shape on the engine: measured against predicted tok/s, and its two
    factors apart — accept length (the profile) and round time (the timings)."""
    from fledge import bench

    rows, measured = [], {}
    for p in preds:
        stats, tok_s = bench.run_shape(rig, rig.drafter(p.shape), prompts, max_new_tokens, f"validate {p.shape.label}")
        measured[p.shape] = tok_s
        accept, round_ms = stats.accept_length(), stats.summary()["round_ms_per_step"]
        rows.append({**asdict(p.shape), "accept_predicted": p.accept_length, "accept_measured": accept,
                     "accept_error_percent": _error_percent(p.accept_length, accept),
                     "round_ms_predicted": p.iter_ms, "round_ms_measured": round_ms,
                     "round_error_percent": _error_percent(p.iter_ms, round_ms),
                     "tok_s_predicted": p.tok_s, "tok_s_measured": tok_s, "speedup_measured": tok_s / ar_tok_s,
                     "error_percent": _error_percent(p.tok_s, tok_s)})
    return rows, measured


def validation_table(rows: list[dict]) -> str:
    lines = [f"{'steps':>5} {'topk':>4} {'tokens':>6} {'accept pred':>11} {'meas':>6} {'error':>7} "
             f"{'round ms pred':>13} {'meas':>6} {'error':>7} {'tok/s pred':>10} {'meas':>8} {'error':>7}"]
    for r in rows:
        lines.append(f"{r['num_steps']:>5} {r['topk']:>4} {r['num_draft_tokens']:>6} {r['accept_predicted']:>11.2f} "
                     f"{r['accept_measured']:>6.2f} {r['accept_error_percent']:>+6.1f}% {r['round_ms_predicted']:>13.3f} "
                     f"{r['round_ms_measured']:>6.3f} {r['round_error_percent']:>+6.1f}% {r['tok_s_predicted']:>10.1f} "
                     f"{r['tok_s_measured']:>8.1f} {r['error_percent']:>+6.1f}%")

    def spread(key):
        errs = [abs(r[key]) for r in rows]
        return f"{statistics.mean(errs):.1f}%  max {max(errs):.1f}%"

    best_pred = max(rows, key=lambda r: r["tok_s_predicted"])
    best_meas = max(rows, key=lambda r: r["tok_s_measured"])
    same = best_pred is best_meas
    lines.append(f"tok/s mean |error| {spread('error_percent')} over {len(rows)} shapes; best shape "
                 + ("the same" if same else "differs") + f" (predicted s{best_pred['num_steps']} k{best_pred['topk']} "
                 f"n{best_pred['num_draft_tokens']}, measured s{best_meas['num_steps']} k{best_meas['topk']} n{best_meas['num_draft_tokens']})")
    lines.append(f"accept length mean |error| {spread('accept_error_percent')}; round time mean |error| "
                 f"{spread('round_error_percent')}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- CLI
