"""Training-time test: the draft unrolled over its own outputs, and the per-step loss.

Alignment (x = token ids, aux_t = the target's 3 aux states after reading x_0..x_t):
  step 0, row t: the draft reads aux_t and embed(x_{t+1}) at position t and predicts x_{t+2};
          its target is the target's distribution at position t+1 (the one that produced x_{t+2}).
  step j, row t: it reads its own step j-1 output at row t and embed(x_{t+1+j}) at position t+j,
          predicts x_{t+2+j} against the target's distribution at position t+1+j.
  Row t is trained at step j iff loss_mask[t+2+j] (the predicted token is an assistant token).
Keys at step j are [step-0 keys | step-1 keys | ... | step-j keys]: causal over step 0 (the
context the target verified) and only the same row in later steps (the row's own earlier
drafts). That is exactly what a draft sees at inference with a KV cache after context row t
(tests/test_train.py checks the two against each other).

P-EAGLE (a drafter with `ptd_token_id`): steps j >= 1 read a mask slot instead of (their own
step j-1 output, embed(x_{t+1+j})): the token ptd_token_id and the learnt `mask_hidden`, fused
by fc. Positions, keys, mask and targets stay as above, so step j is the mask slot the engine
(`fledge.engine.parallel`) and vLLM's parallel drafting run at depth j+1; no step depends on
the one before it, only the attention to its earlier keys ties them.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fledge.core.conventions import accept_length, chain_replay
from fledge.drafter.eagle3 import Eagle3Draft


# --------------------------------------------------------------------------- the TTT forward
def shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, t + n] at column t, zero past the end."""
    return torch.cat([x[:, n:], x.new_zeros(x.shape[0], min(n, x.shape[1]), *x.shape[2:])], 1)


def ttt_mask(t: int, step: int, device) -> torch.Tensor:
    """[1,1,t,(step+1)t] bool: causal over step-0 keys, own row (the diagonal) in later steps."""
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    eye = torch.eye(t, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * step, 1)[None, None]


def cod_rows(t: int, steps: int, ratio: float, floor: float, device) -> list[torch.Tensor]:
    """COD sampling (P-EAGLE's reference trainers): the draft rows step j trains, ascending,
    ceil(t * max(ratio**j, floor)) of them, each step's a subset of the step before's (a row
    dropped at one depth has no deeper drafts). Step 0 keeps every row. Drawn from torch's RNG,
    which a resumed run restores."""
    order = torch.randperm(t).to(device)
    return [order[:math.ceil(t * max(ratio ** j, floor))].sort().values for j in range(steps)]


def cod_mask(t: int, rows: list[torch.Tensor], step: int) -> torch.Tensor:
    """ttt_mask for the rows COD keeps: query row r of step `step` sees step-0 keys up to r and,
    at each later step, the key of row r itself (kept there too: the rows are nested)."""
    q = rows[step][:, None]
    causal = torch.arange(t, device=q.device)[None] <= q
    return torch.cat([causal] + [rows[i][None] == q for i in range(1, step + 1)], 1)[None, None]


def unroll(draft: Eagle3Draft, ids, aux, steps: int, rows: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Per-step draft outputs (`Eagle3Draft.step`'s) of the training-time test; see module doc.
    Each layer keeps its own keys across steps, under the same mask. Step j's output is [B,T,H],
    or with `rows` (cod_rows) [B,len(rows[j]),H] for those rows only: what the full unroll
    computes at them, since a kept row's earlier steps are kept too."""
    b, t = ids.shape
    n = draft.cfg.num_hidden_layers
    hidden, keys, values, outs = aux, [[] for _ in range(n)], [[] for _ in range(n)], []
    masks = draft.mask_slots(b, t) if draft.cfg.parallel else None
    for j in range(steps):
        pos = (torch.arange(t, device=ids.device) + j).expand(b, t)
        step_ids, step_hidden = masks if j and masks is not None else (shift(ids, 1 + j), hidden)
        mask = ttt_mask(t, j, ids.device)
        if rows is not None:
            r = rows[j]
            pos, step_ids, mask = pos[:, r], step_ids[:, r], cod_mask(t, rows, j)
            # aux states and mask slots cover every row; the previous output only rows[j-1]
            full = j == 0 or masks is not None
            step_hidden = step_hidden[:, r] if full else step_hidden[:, torch.searchsorted(rows[j - 1], r)]

        def attend(i, q, k, v, mask=mask):
            keys[i].append(k)
            values[i].append(v)
            return draft.sdpa(q, torch.cat(keys[i], 2), torch.cat(values[i], 2), mask)

        hidden = draft.step(step_ids, step_hidden, pos, attend)
        outs.append(hidden)
    return outs


def draft_loss(logits, probs, top, rows, kind: str = "kl"):
    """(summed soft cross-entropy, summed training objective, top-1 hit of each row [n]) of draft
    logits [n, Vd] against the target at flat positions `rows` of probs [N, Vd] (the target's
    distribution over the draft vocab) and top [N] (the target's argmax as a draft id, -1
    outside the draft vocab: a miss). The soft CE is what every kind reports, so runs with
    different objectives compare on one figure. The objective, by `kind` (one of LOSSES):
      kl      the soft CE: forward KL to the target up to its entropy (the EAGLE-3 recipe).
      greedy  the soft CE plus the hard CE of the target's argmax. Greedy verification accepts a
              draft iff it is the argmax, and a tree ranks nodes by the draft's probabilities:
              the soft CE alone fits q to p, which under-ranks the argmax wherever p is flat.
      lk      per row, lam * soft CE + (1 - lam) * (1 - alpha), alpha = sum(min(p, q)) the
              acceptance rate of sampled verification and lam = 1 - alpha held constant: KL's
              strong gradients where the draft is far from p, the acceptance rate itself where it
              is close (total variation's gradient vanishes far away; an LK-style hybrid). Per
              row, not per batch, so any split across ranks and micro-batches gives the same
              gradient."""
    logp = logits.float().log_softmax(-1)
    p, t = probs[rows], top[rows]
    ce = -(p * logp).sum(-1)
    if kind == "kl":
        objective = ce
    elif kind == "greedy":
        objective = ce - torch.where(t >= 0, logp.gather(-1, t.clamp_min(0)[:, None])[:, 0], 0.0)
    else:
        alpha = torch.minimum(p, logp.exp()).sum(-1)
        lam = 1 - alpha.detach()
        objective = lam * ce + (1 - lam) * (1 - alpha)
    return ce.sum(), objective.sum(), logp.argmax(-1) == t


# On CUDA the loss is compiled: eager, each TTT step wrote the gathered fp32 target rows, the
# fp32 logits and their log-softmax, each as wide as the draft vocab, and read them back for the
# product and again in the backward: two thirds of a step's kernel time went to such elementwise
# and indexing kernels (127 of 196 ms on an H200: SmolLM2-135M, batch 64 x 512 tokens, 7 TTT
# steps, a 16,384-token draft vocab; bench/results/profile_train_h200.json). Compiled, the
# gather and the product fold into the reductions. Row counts vary by batch and step: dynamic
# shapes.
draft_loss_compiled = torch.compile(draft_loss, dynamic=True)


class TTT(nn.Module):
    """The draft plus its unrolled loss, as one module so DDP/FSDP2 hooks see one forward.
    `loss`: the objective (draft_loss's kind); `compiled_loss`: draft_loss through
    torch.compile; None = on CUDA."""

    def __init__(self, draft: Eagle3Draft, steps: int, decay: float, compiled_loss: bool | None = None,
                 loss: str = "kl", cod: tuple[float, float] | None = None):
        super().__init__()
        self.draft, self.steps, self.decay, self.compiled_loss, self.loss = draft, steps, decay, compiled_loss, loss
        self.cod = cod

    def forward(self, ids, aux, probs, top, loss_mask, norm, hit_map: bool = False):
        """Returns (loss, stats [3, steps] = summed soft CE, top-1 hits, trained rows).
        `norm[j]` divides step j's summed objective (global trained rows / world size).
        `hit_map` (the eval): also return hits [steps, B, T], step j's hit at draft row t (False
        where untrained). Without it (a training step), `cod` = (ratio, floor) trains step j only
        at the rows cod_rows draws, its objective scaled by T / rows kept, so that the loss is the
        full one in expectation; stats then count the kept rows. The eval runs every row."""
        loss, stats = 0.0, []
        hits_at = torch.zeros(self.steps, *ids.shape, dtype=torch.bool, device=ids.device) if hit_map else None
        compiled = ids.is_cuda if self.compiled_loss is None else self.compiled_loss
        loss_of = draft_loss_compiled if compiled else draft_loss
        T = ids.shape[1]
        rows = cod_rows(T, self.steps, *self.cod, ids.device) if self.cod and not hit_map else None
        flat_probs, flat_top = probs.reshape(-1, probs.shape[-1]), top.reshape(-1)
        for j, out in enumerate(unroll(self.draft, ids, aux, self.steps, rows)):
            trained = shift(loss_mask, 2 + j)
            if rows is None:
                b, t = trained.nonzero(as_tuple=True)
                at, scale = t, 1.0
            else:
                b, at = trained[:, rows[j]].nonzero(as_tuple=True)
                t, scale = rows[j][at], T / rows[j].numel()
            ce, objective, hits = loss_of(self.draft.logits(out[b, at]), flat_probs, flat_top, b * T + t + 1 + j,
                                          self.loss)
            loss = loss + self.decay ** j * scale * objective / norm[j]
            stats.append(torch.stack([ce.detach(), hits.sum().float(), torch.tensor(float(b.numel()), device=ce.device)]))
            if hit_map:
                hits_at[j, b, t] = hits
        return (loss, torch.stack(stats, 1)) + ((hits_at,) if hit_map else ())


def summarize(stats: torch.Tensor, replay: torch.Tensor | None = None) -> dict:
    """Per-step loss/accuracy and the simulated accept length (SpecForge's, bonus excluded; and
    SGLang's, bonus included, via conventions.accept_length). `replay` [2] = (accepted drafts,
    rounds) of a chain replayed over held-out text (replay_counts): `replay_accept_len`, the
    figure to compare with the engine's chain of `steps` on such text."""
    ce, hits, n = stats.double().clamp_min(0).unbind(0)
    acc = (hits / n.clamp_min(1)).tolist()
    accepted = sum(math.prod(acc[:j + 1]) for j in range(len(acc)))  # P(first j+1 drafts all right)
    out = {"loss": (ce / n.clamp_min(1)).tolist(), "acc": acc, "accept_len_no_bonus": accepted,
           "accept_len": accept_length(accepted, 1)}
    if replay is not None:
        out["replay_accept_len"] = accept_length(int(replay[0]), int(replay[1]))
    return out


def replay_counts(hits: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """(accepted drafts, rounds) [2] of the greedy chain conventions.chain_replay walks over each
    row of a batch, from TTT's hit map [steps, B, T]."""
    leading = hits.long().cumprod(0).sum(0).tolist()  # right drafts in a row, per draft row
    rounds = [r for lead, m in zip(leading, loss_mask.tolist()) for r in chain_replay(lead, m)]
    return torch.tensor([sum(rounds), len(rounds)], dtype=torch.float64)
