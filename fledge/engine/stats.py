"""What every speculative run reports: accept length (SGLang's definition, from
fledge.core.conventions), acceptance by depth, where the time goes, tok/s, a histogram."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from fledge.core.conventions import accept_length, accept_rate


class Clock:
    """Timestamps that cost no host sync: CUDA events on the GPU (read once, after the run's
    final sync), perf_counter on the CPU where kernels finish before the call returns."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def wait(self, mark) -> None:
        """Until the GPU has passed `mark` (ms needs both ends done)."""
        if self.cuda:
            mark.synchronize()

    def ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else 1e3 * (end - start)


@dataclass
class SpecStats:
    num_steps: int
    num_draft_tokens: int
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_ms: float = 0.0
    wall_ms: float = 0.0  # prefill + every iteration
    accepted: list[int] = field(default_factory=list)  # accepted draft tokens, per verify step
    draft_ms: list[float] = field(default_factory=list)  # propose + observe (draft model work)
    verify_ms: list[float] = field(default_factory=list)  # target forward + accept/reject
    other_ms: list[float] = field(default_factory=list)  # KV compaction, host sync, bookkeeping
    round_ms: list[float] = field(default_factory=list)  # whole rounds; fused rounds time only these
    # Rounds that ended short of the tree's depth at a token outside the drafter's vocabulary,
    # which no training of that drafter could have proposed (None: a drafter without a vocabulary).
    outside_vocab: int | None = None

    @property
    def steps(self) -> int:
        return len(self.accepted)

    def accept_length(self) -> float:
        return accept_length(sum(self.accepted), self.steps)

    def accept_rate(self) -> float:
        return accept_rate(sum(self.accepted), self.steps, self.num_draft_tokens)

    def depth_acceptance(self) -> list[float]:
        """Fraction of verify steps whose accepted path reached depth d, for d = 1..num_steps."""
        n = max(self.steps, 1)
        return [sum(a >= d for a in self.accepted) / n for d in range(1, self.num_steps + 1)]

    def histogram(self) -> list[int]:
        """Verify steps by tokens gained (accepted + bonus) = 1 .. num_steps + 1."""
        counts = [0] * (self.num_steps + 1)
        for a in self.accepted:
            counts[a] += 1
        return counts

    def tok_s(self) -> float:
        return 1e3 * self.generated_tokens / max(self.wall_ms, 1e-9)

    @staticmethod
    def merge(runs: list["SpecStats"]) -> "SpecStats":
        out = SpecStats(runs[0].num_steps, runs[0].num_draft_tokens)
        for r in runs:
            out.prompt_tokens += r.prompt_tokens
            out.generated_tokens += r.generated_tokens
            out.prefill_ms += r.prefill_ms
            out.wall_ms += r.wall_ms
            for name in ("accepted", "draft_ms", "verify_ms", "other_ms", "round_ms"):
                getattr(out, name).extend(getattr(r, name))
            if r.outside_vocab is not None:
                out.outside_vocab = (out.outside_vocab or 0) + r.outside_vocab
        return out

    def summary(self) -> dict:
        per = max(self.steps, 1)
        phased = bool(self.verify_ms)  # fused rounds (one graph each) cannot be split

        def mean(xs):
            return sum(xs) / per if phased else None

        return {
            "accept_length": self.accept_length(),  # SGLang: (accepted + bonus) per verify step
            "accept_rate": self.accept_rate(),
            "verify_steps": self.steps,
            "generated_tokens": self.generated_tokens,
            "tok_s": self.tok_s(),
            "round_ms_per_step": sum(self.round_ms) / per,
            "draft_ms_per_step": mean(self.draft_ms),
            "verify_ms_per_step": mean(self.verify_ms),
            "other_ms_per_step": mean(self.other_ms),
            "prefill_ms": self.prefill_ms,
            "depth_acceptance": self.depth_acceptance(),
            "histogram": self.histogram(),
            "ended_outside_vocab": None if self.outside_vocab is None else self.outside_vocab / per,
        }

    @staticmethod
    def _split(s: dict) -> str:
        if s["verify_ms_per_step"] is None:
            return f"round {s['round_ms_per_step']:.2f} ms (fused: one graph, not split)"
        return (f"draft {s['draft_ms_per_step']:.2f} ms  verify {s['verify_ms_per_step']:.2f} ms  "
                f"other {s['other_ms_per_step']:.2f} ms")

    def report(self) -> str:
        s = self.summary()
        hist = s["histogram"]
        width = max(max(hist), 1)
        lines = [
            f"accept length {s['accept_length']:.3f} (SGLang: accepted+bonus per verify step)  "
            f"accept rate {s['accept_rate']:.3f}  verify steps {s['verify_steps']}",
            f"{s['generated_tokens']} tokens  {s['tok_s']:.1f} tok/s  per step: {self._split(s)}  "
            f"(prefill {s['prefill_ms']:.1f} ms)",
            "reached depth: " + "  ".join(f"{d + 1}:{p:.2f}" for d, p in enumerate(s["depth_acceptance"])),
            "tokens per verify step:",
        ]
        lines += [f"  {k + 1:2d} {c:6d} {'#' * round(40 * c / width)}" for k, c in enumerate(hist)]
        if s["ended_outside_vocab"] is not None:
            lines.append(f"rounds ended at a token outside the draft vocabulary: {100 * s['ended_outside_vocab']:.1f}%")
        return "\n".join(lines)
