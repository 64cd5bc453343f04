"""P-EAGLE in the engine: an EAGLE-3 drafter trained for parallel drafting proposes a chain of
`spec.num_steps` tokens in one draft forward, verified as any chain is.

The context rows are EAGLE-3's (`Eagle3Drafter.observe`): row p pairs the target's aux state at
p with token p+1, and the last verified row (the root's) gives the first draft. Drafts 2..k
come from k-1 mask slots run together: slot m reads the token `ptd_token_id` and the learnt
`mask_hidden` (fused by fc as aux states are) at position cache_len - 1 + m, attends to the
context rows and causally to the slots before it, and its argmax is the draft at depth m+1.
This is what vLLM runs under `parallel_drafting` for an EAGLE-3 drafter, and what training
unrolls (`fledge.train.ttt.unroll` with `parallel`).
"""

from __future__ import annotations

import torch

from fledge.core.errors import FledgeError
from fledge.core.shape import Shape
from fledge.drafter.eagle3 import Eagle3Draft
from fledge.engine.drafters import Eagle3Drafter
from fledge.engine.tree import chain


class ParallelDrafter(Eagle3Drafter):
    def __init__(self, draft: Eagle3Draft, spec: Shape, target, compile: bool = False):
        if not draft.cfg.parallel:
            raise FledgeError("parallel drafting needs a P-EAGLE drafter (ptd_token_id and mask_hidden): "
                              "this one drafts step by step")
        if spec.topk != 1 or spec.num_draft_tokens != spec.num_steps + 1:
            raise FledgeError(f"a P-EAGLE drafter proposes a chain (k,1,k+1): shape {spec.label} is not one")
        super().__init__(draft, spec, target, compile)

    def _propose_tree(self, root, cache_len):
        B, M, dev = root.shape[0], self.spec.num_steps - 1, self.kv.device
        first = self.draft.logits(self.last).float().argmax(-1)[:, None]  # [B, 1] draft ids
        if M == 0:
            t = chain(root, self.to_target[first])
            return t.tokens, t.parents, t.depth, t.anc
        ids, hidden = self.draft.mask_slots(B, M)
        pos = cache_len[:, None] + torch.arange(M, device=dev)
        slots = (self.max_len + torch.arange(M, device=dev)).expand(B, M)
        context = (torch.arange(self.max_len, device=dev) < cache_len[:, None])[:, None].expand(B, M, self.max_len)
        causal = torch.ones(M, M, dtype=torch.bool, device=dev).tril().expand(B, M, M)
        out = self._step(ids, hidden.to(self.kv.dtype), pos, slots, torch.cat([context, causal], 2)[:, None])
        rest = self.draft.logits(out).float().argmax(-1)
        t = chain(root, self.to_target[torch.cat([first, rest], 1)])
        return t.tokens, t.parents, t.depth, t.anc
