"""`fledge tune`: predict speculative-decoding tok/s before deploying, and pick the flags.

The cost model, per verify round of one request at a given batch size:

    tok/s = E[accept length] / (num_steps * t_draft(topk) + t_verify(num_draft_tokens) + overhead)

against plain decoding at 1 / t_ar. Accept length is SGLang's (accepted drafts + 1 bonus per
verify step, fledge.conventions.accept_length), so speculation pays iff
E[accept length] > t_iter / t_ar — the break-even accept length this module reports.

The acceptance profile `ranks[d][r]` is the probability that, once the accepted path has
reached a node at depth d-1, its rank-r child (rank 0 = the drafter's top guess) is the one the
target accepts. A chain only uses rank 0: `ranks[d][0]` is the per-depth conditional
acceptance p_d. Approximations, stated once:
  * acceptance at (depth, rank) does not depend on which path led there;
  * trees are built by the engine's EAGLE-2 rule (grow the topk best beams per depth, keep the
    num_draft_tokens-1 best candidates by cumulative score) with the profile's mean rank
    probabilities standing in for the drafter's scores — a calibrated drafter. The real tree
    is re-chosen every round from that round's scores, so it adapts where this fixed shape
    cannot; expect the model to be slightly pessimistic for wide trees.
Under those assumptions `expected_accept_length` is exact (tests check it against Monte Carlo).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass

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
    """ranks[d-1][r]: P(rank-r child at depth d is accepted | the path reached depth d-1).
    Depths past the last row repeat it; ranks past a row's end are never accepted."""

    ranks: list[list[float]]

    def __post_init__(self):
        if not self.ranks or any(not row for row in self.ranks):
            raise FledgeError("acceptance profile is empty")
        for d, row in enumerate(self.ranks, 1):
            if any(not 0 <= p <= 1 for p in row) or sum(row) > 1 + 1e-6:
                raise FledgeError(f"acceptance profile depth {d}: {row} — each value in [0, 1], sum <= 1")

    @classmethod
    def chain(cls, p: list[float]) -> "Profile":
        return cls([[float(x)] for x in p])

    @classmethod
    def geometric(cls, accept_length: float, num_steps: int) -> "Profile":
        """The constant p with 1 + p + p^2 + ... + p^num_steps = accept_length (bisection)."""
        if not 1 <= accept_length <= num_steps + 1:
            raise FledgeError(f"--accept-length {accept_length}: must be in [1, num_steps + 1 = {num_steps + 1}]")
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if chain_accept_length([mid] * num_steps) < accept_length else (lo, mid)
        return cls.chain([(lo + hi) / 2])

    def at(self, depth: int, rank: int) -> float:
        row = self.ranks[min(depth, len(self.ranks)) - 1]
        return row[rank] if rank < len(row) else 0.0

    @property
    def width(self) -> int:
        return max(len(r) for r in self.ranks)


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


def build_tree(profile: Profile, shape: Shape) -> list[Node]:
    """The kept nodes of the engine's EAGLE-2 tree, parents before children (see module doc)."""
    K = shape.topk
    cands = [Node(1, r, -1, profile.at(1, r)) for r in range(K)]
    beams = list(range(K))
    for depth in range(2, shape.num_steps + 1):
        children = []
        for b in beams:
            for r in range(K):
                children.append(len(cands))
                cands.append(Node(depth, r, b, cands[b].prob * profile.at(depth, r)))
        beams = sorted(children, key=lambda i: -cands[i].prob)[:K]  # stable: earlier wins ties
    # Ties go to the shallower, earlier candidate, so a parent is never dropped before its child.
    keep = sorted(sorted(range(len(cands)), key=lambda i: (-cands[i].prob, cands[i].depth, i))[:shape.num_draft_tokens - 1])
    index = {c: i for i, c in enumerate(keep)}
    return [Node(cands[c].depth, cands[c].rank, index[cands[c].parent] if cands[c].parent >= 0 else -1,
                 cands[c].prob) for c in keep]


def expected_accept_length(profile: Profile, shape: Shape) -> float:
    """Accepted nodes form one root path, so E[accept length] = 1 + sum of P(node accepted)."""
    return 1.0 + sum(n.prob for n in build_tree(profile, shape))


def simulate_accept_length(profile: Profile, shape: Shape, rounds: int, seed: int = 0) -> float:
    """Monte Carlo of the same model: at each reached node the target picks at most one child
    rank (probabilities ranks[d]); the walk stops when that child is not in the tree."""
    tree, rng = build_tree(profile, shape), random.Random(seed)
    children: dict[tuple[int, int], int] = {(n.parent, n.rank): i for i, n in enumerate(tree)}
    total = 0
    for _ in range(rounds):
        node, depth, gained = -1, 1, 1
        while True:
            u, acc, pick = rng.random(), 0.0, None
            for r in range(profile.width):
                acc += profile.at(depth, r)
                if u < acc:
                    pick = r
                    break
            if pick is None or (node, pick) not in children:
                break
            node, depth, gained = children[(node, pick)], depth + 1, gained + 1
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


# --------------------------------------------------------------------------- reporting
def report(preds: list[Prediction], timings: Timings, drafter: str, top: int = 12) -> tuple[str, dict]:
    """The table, the verdict and the flags as text, and the same as a JSON-able dict."""
    ar = 1e3 / timings.ar_ms
    best = preds[0]
    lines = [f"plain decoding: {ar:.1f} tok/s per request (t_ar {timings.ar_ms:.2f} ms, batch {timings.batch}); "
             "accept length = SGLang's (accepted + bonus per verify step)",
             f"{'steps':>5} {'topk':>4} {'tokens':>6} {'accept':>7} {'iter ms':>8} {'tok/s':>8} {'speedup':>8} {'break-even':>10}"]
    for p in preds[:top]:
        s = p.shape
        lines.append(f"{s.num_steps:>5} {s.topk:>4} {s.num_draft_tokens:>6} {p.accept_length:>7.2f} {p.iter_ms:>8.2f} "
                     f"{p.tok_s:>8.1f} {p.speedup:>7.2f}x {p.break_even:>10.2f}")
    gain = 100 * (best.speedup - 1)
    verdict = "WINS" if best.speedup > 1 else "LOSES"
    lines.append(f"speculation {verdict}: best {best.tok_s:.1f} tok/s vs {ar:.1f} without ({gain:+.1f}%); "
                 f"that shape needs accept length > {best.break_even:.2f} to pay, the profile gives {best.accept_length:.2f}")
    vllm = best.shape.vllm_flags(drafter)
    lines.append(f"SGLang: {best.shape.sglang_flags()}")
    lines.append(f"vLLM:   {vllm}" if vllm else "vLLM:   drafts chains only; the best chain is "
                 + next(p.shape.vllm_flags(drafter) for p in preds if p.shape.topk == 1))
    data = {"ar_tok_s": ar, "timings": asdict(timings), "verdict": verdict, "gain_percent": gain,
            "best": _pred_dict(best, drafter), "predictions": [_pred_dict(p, drafter) for p in preds]}
    return "\n".join(lines), data


def _pred_dict(p: Prediction, drafter: str) -> dict:
    return {**asdict(p.shape), "accept_length": p.accept_length, "iter_ms": p.iter_ms, "tok_s": p.tok_s,
            "speedup": p.speedup, "break_even_accept_length": p.break_even,
            "sglang": p.shape.sglang_flags(), "vllm": p.shape.vllm_flags(drafter)}


def plot(preds: list[Prediction], ar_tok_s: float, path, measured: dict | None = None, top: int = 24) -> None:
    """Bar chart of predicted tok/s by shape (measured points on top when validating)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = preds[:top]
    labels = [f"s{p.shape.num_steps} k{p.shape.topk} n{p.shape.num_draft_tokens}" for p in shown]
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(shown)), 4))
    ax.bar(range(len(shown)), [p.tok_s for p in shown], color="#4c78a8", label="predicted")
    if measured:
        xs = [i for i, p in enumerate(shown) if p.shape in measured]
        ax.scatter(xs, [measured[shown[i].shape] for i in xs], color="#e45756", zorder=3, label="measured")
    ax.axhline(ar_tok_s, color="black", linestyle="--", label=f"no speculation {ar_tok_s:.0f}")
    ax.set_xticks(range(len(shown)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("tok/s per request")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def write_outputs(text: str, data: dict, preds, timings: Timings, args, measured=None) -> None:
    print(text)
    if args.json:
        atomic_write_json(args.json, data)
    if args.png:
        plot(preds, 1e3 / timings.ar_ms, args.png, measured)


# --------------------------------------------------------------------------- CLI
def profile_from_json(path) -> Profile:
    """A profile from `fledge bench --json` output: engine probe ({"profile": {"ranks": ...}}),
    vLLM log ({"profile": [[p], ...]}) or a bare {"ranks": ...}."""
    try:
        obj = json.loads(open(path).read())
        prof = obj.get("ranks") or obj.get("profile")
        return Profile(prof["ranks"] if isinstance(prof, dict) else prof)
    except (OSError, ValueError, AttributeError, KeyError, TypeError) as e:
        raise FledgeError(f"{path}: no acceptance profile ('ranks' or 'profile') in it ({e})") from None


def _what_if(args) -> int:
    for name in ("ar_ms", "verify_ms", "draft_ms"):
        if getattr(args, name) is None:
            raise FledgeError(f"--what-if needs --{name.replace('_', '-')}")
    if args.max_steps < 1:
        raise FledgeError(f"--max-steps {args.max_steps}: must be >= 1")
    timings = Timings(args.ar_ms, parse_ms_table(args.verify_ms, "--verify-ms"), parse_ms_table(args.draft_ms, "--draft-ms"),
                      args.overhead_ms, args.batch)
    given = [a for a in (args.accept_profile, args.accept_length, args.profile_json) if a is not None]
    if len(given) != 1:
        raise FledgeError("--what-if needs exactly one of --accept-profile, --accept-length, --profile-json")
    if args.profile_json:
        profile = profile_from_json(args.profile_json)
    elif args.accept_profile:
        profile = parse_profile(args.accept_profile)
    else:
        profile = Profile.geometric(args.accept_length, args.accept_steps)
    preds = rank_all(profile, timings, grid(args.max_steps))
    text, data = report(preds, timings, args.drafter or "<drafter dir>")
    data["profile"] = profile.ranks
    if args.accept_length is not None:  # say it for the shape the user actually runs, too
        mine = predict(profile, timings, Shape(args.accept_steps, 1, args.accept_steps + 1))
        text += (f"\nat your shape ({args.accept_steps}-step chain, accept {mine.accept_length:.2f}): {mine.tok_s:.1f} tok/s, "
                 f"{100 * (mine.speedup - 1):+.1f}% vs no speculation; break-even accept length {mine.break_even:.2f}")
    write_outputs(text, data, preds, timings, args)
    return 0


def _cmd_tune(args) -> int:
    if args.what_if:
        return _what_if(args)
    if not args.target or not args.drafter:
        raise FledgeError("measured mode needs --target and --drafter (or use --what-if with your own timings)")
    from fledge.bench import measured_tune  # the engine is only needed here

    return measured_tune(args)


def add_cli(sub) -> None:
    p = sub.add_parser("tune", help="predict spec-decoding tok/s per shape; say whether it beats no speculation")
    p.add_argument("--what-if", action="store_true", help="use the timings and acceptance given here (no GPU)")
    p.add_argument("--ar-ms", type=float, help="plain decoding: ms per step")
    p.add_argument("--verify-ms", help="target forward ms by tokens verified per request, e.g. '1:11.6,8:30,16:34'")
    p.add_argument("--draft-ms", help="ms per draft step, one number or by topk '1:1.2,4:1.6'")
    p.add_argument("--overhead-ms", type=float, default=0.0, help="per-iteration extra (sampling, KV moves, host)")
    p.add_argument("--accept-profile", help="per-depth acceptance, ranks by '/': '0.7/0.1,0.6/0.12,0.5'")
    p.add_argument("--accept-length", type=float, help="measured accept length (SGLang, bonus incl.): fits a geometric profile")
    p.add_argument("--accept-steps", type=int, default=3, help="num_steps the --accept-length was measured at")
    p.add_argument("--max-steps", type=int, default=8, help="deepest shape to consider (measured mode: probe depth)")
    p.add_argument("--batch", type=int, default=1, help="batch size the timings are for")
    p.add_argument("--target", help="measured mode: target (built-in name, GGUF, HF dir)")
    p.add_argument("--drafter", help="drafter checkpoint (measured mode; printed in vLLM flags)")
    p.add_argument("--device", help="measured mode: default cuda if available, else cpu")
    p.add_argument("--dtype", help="measured mode: default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--prompts", help="conversations JSONL for the acceptance probe (default: built-in prompts)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--probe-topk", type=int, default=4, help="topk of the full tree the rank probe drafts")
    p.add_argument("--profile-json", help="acceptance profile from `fledge bench --json` (engine --probe, or a vLLM --log)")
    p.add_argument("--validate", action="store_true", help="also run >= 6 shapes for real: predicted vs measured")
    p.add_argument("--json", help="write the predictions here")
    p.add_argument("--png", help="plot predicted tok/s by shape here")
    p.set_defaults(func=_cmd_tune)
