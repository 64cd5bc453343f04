"""The conventions that engines disagree on, each decided once, here.

Every other module calls these functions instead of re-deriving an offset. If an engine
changes its mind (SGLang's aux-layer shift has moved between versions), this file is the
one place to change.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from fledge.core.errors import FledgeError

if TYPE_CHECKING:
    import numpy as np
    import torch


# --------------------------------------------------------------------------- aux layers
def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """fledge's canonical aux ids for a target with `num_layers` decoder layers.

    Canonical = vLLM / speculators convention: id L is HF `hidden_states[L]`, the residual
    stream *entering* decoder layer L (after L layers; 0 is the embeddings). Low, middle,
    high: (2, N//2, N-3), the same physical layers SGLang/SpecForge write as [1, N//2-1, N-4].
    """
    return validate_aux_layer_ids((2, num_layers // 2, num_layers - 3), num_layers)


def validate_aux_layer_ids(ids: Sequence[int], num_layers: int, count: int | None = 3) -> tuple[int, ...]:
    """Canonical ids must be `count` strictly increasing residual streams in [1, N-1]: three
    for EAGLE-3; `count` None takes any number of at least one (what a capture or a DFlash
    drafter reads).

    `hidden_states[N]` is excluded: HF returns it after the final norm, so it is not a
    residual stream; id 0 (the bare embedding) is excluded because the drafter already
    reads the embedding and no engine captures it.
    """
    ids = tuple(int(i) for i in ids)
    if count == 3 and num_layers < 4:
        raise FledgeError(f"target has {num_layers} layers; EAGLE-3 needs at least 4 for three aux layers")
    if count is not None and len(ids) != count:
        raise FledgeError(f"aux layer ids {list(ids)}: EAGLE-3 uses exactly three" if count == 3 else
                          f"aux layer ids {list(ids)}: {count} expected")
    if not ids:
        raise FledgeError("aux layer ids: none given")
    if list(ids) != sorted(set(ids)):
        raise FledgeError(f"aux layer ids {list(ids)} must be strictly increasing")
    if ids[0] < 1 or ids[-1] > num_layers - 1:
        raise FledgeError(f"aux layer ids {list(ids)} out of range [1, {num_layers - 1}] for a {num_layers}-layer target")
    return ids


def aux_ids_from_sglang(ids: Sequence[int], num_layers: int) -> tuple[int, int, int]:
    """SGLang/SpecForge/ModelOpt ids name the *output* of layer k, i.e. hidden_states[k+1]
    (SGLang's `set_eagle3_layers_to_capture` adds 1)."""
    return validate_aux_layer_ids([int(i) + 1 for i in ids], num_layers)


def aux_ids_to_sglang(ids: Sequence[int], num_layers: int) -> tuple[int, int, int]:
    """Inverse of `aux_ids_from_sglang`: canonical id L is the output of layer L-1."""
    ids = validate_aux_layer_ids(ids, num_layers)
    return tuple(i - 1 for i in ids)  # type: ignore[return-value]


def aux_ids_to_dflash(ids: Sequence[int]) -> list[int]:
    """DFlash's `dflash_config.target_layer_ids` name the *output* of layer k (vLLM adds 1 when
    it captures them, as SGLang does for EAGLE-3), and there may be any number of them."""
    return [int(i) - 1 for i in ids]


def aux_ids_from_dflash(ids: Sequence[int]) -> tuple[int, ...]:
    """Inverse of `aux_ids_to_dflash`: canonical ids of DFlash target_layer_ids."""
    return tuple(int(i) + 1 for i in ids)


# --------------------------------------------------------------------------- rope
# HF's Llama config and the engines assume this theta when a config names none.
ROPE_THETA_DEFAULT = 10000.0


def rope_fields(cfg: dict) -> tuple[float, dict | None]:
    """(theta, scaling or None) of a config dict. transformers 5 keeps both in
    `rope_parameters`, read first; older configs and the engines' files have `rope_theta` +
    `rope_scaling`. A scaling's legacy `type` key becomes `rope_type`; the default rope type
    has no scaling (None)."""
    rp = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = rp.pop("rope_theta", None) or cfg.get("rope_theta") or ROPE_THETA_DEFAULT
    if "type" in rp:
        rp.setdefault("rope_type", rp.pop("type"))
    return float(theta), (rp if rp.get("rope_type", "default") != "default" else None)


# --------------------------------------------------------------------------- draft vocab
# The d2t functions import torch (or numpy) when called: the aux-id rules above are read by
# `fledge.core.config`, which the CLI's parsers use without loading either.
def d2t_from_target_ids(target_ids: torch.Tensor, target_vocab: int) -> torch.Tensor:
    """Offsets such that target = i + d2t[i] (SpecForge/SGLang/vLLM: int64 offsets).

    `target_ids` are the draft vocab's target ids, which must be strictly ascending (the
    draft vocab is the top-N set *sorted*, so draft id order follows target id order).
    """
    import torch

    t = torch.as_tensor(target_ids, dtype=torch.int64).flatten()
    if t.numel() == 0:
        raise FledgeError("draft vocabulary is empty")
    if t.min() < 0 or t.max() >= target_vocab:
        raise FledgeError(f"draft vocab maps to target ids outside [0, {target_vocab})")
    if t.numel() > 1 and not bool((t[1:] > t[:-1]).all()):
        raise FledgeError("draft vocab target ids must be strictly ascending (one-to-one, sorted)")
    return t - torch.arange(t.numel(), dtype=torch.int64)


def target_ids_from_d2t(d2t, target_vocab: int) -> np.ndarray:
    """Draft id i → target id i + d2t[i]; refuses maps that are out of range or not one-to-one.

    numpy in and out (a CPU torch tensor converts as it is; wrap the result in
    `torch.from_numpy`): `fledge doctor` reads d2t without loading torch."""
    import numpy as np

    d2t = np.asarray(d2t).astype(np.int64, copy=False).ravel()
    t = d2t + np.arange(d2t.size, dtype=np.int64)
    if t.size and (t.min() < 0 or t.max() >= target_vocab):
        raise FledgeError(f"d2t maps draft ids to target ids outside [0, {target_vocab})")
    if np.unique(t).size != t.size:
        raise FledgeError("d2t maps two draft ids to one target id")
    return t


def t2d_from_target_ids(target_ids: torch.Tensor, target_vocab: int) -> torch.Tensor:
    """Bool mask over the target vocab: True where the token is in the draft vocab."""
    import torch

    mask = torch.zeros(target_vocab, dtype=torch.bool)
    mask[torch.as_tensor(target_ids, dtype=torch.int64)] = True
    return mask


def diff_vocab(a_target_ids, b_target_ids) -> dict:
    """How two draft vocabs (their target ids) differ: d2t entries that differ position by
    position (what the K2 vs K2.5 comparison counted) and the overlap of the target-id sets."""
    import numpy as np

    a, b = (np.asarray(x, dtype=np.int64).ravel() for x in (a_target_ids, b_target_ids))
    n = min(a.size, b.size)
    sa, sb = set(a.tolist()), set(b.tolist())
    both = len(sa & sb)
    return {"size_a": a.size, "size_b": b.size, "entries_differ": int((a[:n] != b[:n]).sum()) + abs(a.size - b.size),
            "overlap": both, "only_a": len(sa - sb), "only_b": len(sb - sa),
            "overlap_share_a": both / max(len(sa), 1), "jaccard": both / max(len(sa | sb), 1)}


# --------------------------------------------------------------------------- acceptance
def accept_length(accepted_draft_tokens: int, verify_steps: int) -> float:
    """SGLang's accept length: (accepted draft tokens + one bonus token) per verify step.

    1.0 means speculation produced nothing beyond plain decoding. SpecForge's simulated
    accept length omits the bonus: add 1 to compare with this.
    """
    if verify_steps <= 0:
        return float("nan")
    return (accepted_draft_tokens + verify_steps) / verify_steps


def accept_rate(accepted_draft_tokens: int, verify_steps: int, num_draft_tokens: int) -> float:
    """SGLang's accept rate: accepted / (verify steps × (num_draft_tokens − 1)).

    num_draft_tokens counts the tree's root (the last verified token), hence the − 1.
    """
    slots = verify_steps * (num_draft_tokens - 1)
    return accepted_draft_tokens / slots if slots > 0 else float("nan")


def chain_replay(leading: Sequence[int], answer: Sequence[bool]) -> list[int]:
    """Accepted draft tokens of each round a greedy chain would verify on one teacher-forced
    sequence: the engine's `SpecStats.accepted` for that text, without running it.

    Draft row t pairs the target's aux state at token t with token t+1 and drafts token t+2
    (TTT step j of row t drafts token t+2+j). `leading[t]`: how many of row t's drafts are right
    in a row, counting none past the answer. `answer[i]`: token i is trained (the loss mask).
    An answer segment's first token comes from the target's prefill, so its first round is row
    s-1; a round at row t gains leading[t] + 1 tokens (the bonus), so the next is row
    t + leading[t] + 1; a segment's rounds end once its next token is not an answer token.

    Why not SpecForge's 1 + sum_j prod_{i<=j} acc_j: that scores every row alike, where rounds
    skip the rows inside an accepted run, so it overstates a chain on easy stretches: 2.66
    against this replay's 2.58 and the engine's 2.59 on the engine's own answers to 16 held-out
    ShareGPT prompts (SmolLM2-135M and the drafter shipped then, a chain of 7, fp32 on a CPU:
    docs/performance.md)."""
    rounds, n, i = [], len(answer), 0
    while i < n:
        if not answer[i] or (i > 0 and answer[i - 1]):
            i += 1
            continue
        t = max(i - 1, 0)
        while t + 2 < n and answer[t + 2]:
            rounds.append(int(leading[t]))
            t += int(leading[t]) + 1
        i = t + 2
    return rounds
