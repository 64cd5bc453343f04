"""DFlash training: blocks at random anchors of each sample, every mask slot trained at once.

For a sample x_0..x_{T-1} and an anchor a (a trained position: x_{a+1} is an answer token),
the block is x_a followed by K masks at positions a..a+K (K = --ttt-steps, the block
size less one); it attends to the target's aux states of x_0..x_{a-1} (the context a round
verified before x_a was sampled) and to itself, both ways. Mask slot j (1..K) at position
a+j is trained toward the target's distribution there (the one that produced x_{a+j}, read
at row a+j-1), wherever x_{a+j} is an answer token, with weight decay^(j-1): DFlash's
exponentially decaying position weights exp(-(j-1)/gamma) with decay = exp(-1/gamma), since
a wrong early slot voids every later one. `--blocks-per-sample` anchors are drawn per sample
and step (all of them for the eval, which replays the chain exactly as the engine would
verify on that text). All blocks of a batch run as one forward: block queries see context
keys below their own anchor and the keys of their own block.

Per position the loss is the objective summed over trained slots, divided by the micro-batch's
count of them (the EAGLE-3 run's global norm counts TTT rows, which a sampled block set has no
fixed number of).
"""

from __future__ import annotations

import torch
from torch import nn

from fledge.core.errors import FledgeError
from fledge.drafter.dflash import DFlashConfig, DFlashDraft, attend_over
from fledge.drafter.dflash_checkpoint import load_dflash
from fledge.train.ttt import draft_loss, draft_loss_compiled

EVAL_CHUNK = 256  # anchors per forward in the eval (all anchors of a row at once would not fit)
DFLASH_LAYERS = 2  # draft layers when --draft-layers is unset


def valid_anchors(loss_mask: torch.Tensor) -> torch.Tensor:
    """[B,T] bool: anchor a is trainable iff a >= 1 (some context) and x_{a+1} is trained."""
    ok = torch.zeros_like(loss_mask)
    ok[:, 1:-1] = loss_mask[:, 2:]
    return ok


def sample_anchors(loss_mask: torch.Tensor, n: int, generator=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to n anchors per row, drawn without replacement among the valid ones (ascending):
    (anchors [B,n'], present [B,n']) with n' = min(n, most valid in a row)."""
    ok = valid_anchors(loss_mask)
    keys = torch.rand(ok.shape, generator=generator, device=ok.device).masked_fill(~ok, 2.0)
    k = min(n, int(ok.sum(1).max()))
    pick = keys.topk(k, dim=1, largest=False).indices.sort(1).values
    return pick, ok.gather(1, pick)


class BlockTrain(nn.Module):
    """The draft plus its block loss, one module for DDP/FSDP2 (as train.ttt.TTT), with TTT's
    forward contract: (loss, stats [3, steps]) and, with `hit_map`, hits [steps, B, T] where
    hits[j-1, b, a-1] is slot j's top-1 hit in the block at anchor a (TTT's row a-1 drafts
    x_{a+1+j-1} likewise, so replay_counts walks either)."""

    def __init__(self, draft: DFlashDraft, steps: int, decay: float, blocks: int, compiled_loss: bool | None = None,
                 loss: str = "kl"):
        super().__init__()
        self.draft, self.steps, self.decay, self.blocks, self.compiled_loss, self.loss = (
            draft, steps, decay, blocks, compiled_loss, loss)

    def forward(self, ids, aux, probs, top, loss_mask, norm=None, hit_map: bool = False):
        if hit_map:
            return self.all_anchors(ids, aux, probs, top, loss_mask)
        anchors, present = sample_anchors(loss_mask, self.blocks)
        loss, stats, _ = self.blocks_loss(ids, aux, probs, top, loss_mask, anchors, present)
        return loss, stats

    @torch.no_grad()
    def all_anchors(self, ids, aux, probs, top, loss_mask):
        B, T = ids.shape
        ok = valid_anchors(loss_mask)
        order = torch.where(ok, torch.arange(T, device=ids.device), T).sort(1).values  # valid anchors first
        hits_at = torch.zeros(self.steps, B, T, dtype=torch.bool, device=ids.device)
        stats = torch.zeros(3, self.steps, device=ids.device)
        for c in range(0, int(ok.sum(1).max()), EVAL_CHUNK):
            anchors = order[:, c:c + EVAL_CHUNK]
            present = anchors < T
            _, s, hits = self.blocks_loss(ids, aux, probs, top, loss_mask, anchors.clamp(max=T - 1), present)
            stats += s
            for j, (b, a, h) in enumerate(hits):
                hits_at[j, b, a - 1] = h
        return torch.zeros((), device=ids.device), stats, hits_at

    def block_states(self, ids, aux, anchors) -> torch.Tensor:
        """The draft's final states [B,N,K+1,H] of the blocks at `anchors` [B,N] (slot 0 the anchor)."""
        B, T = ids.shape
        N, K, dev = anchors.shape[1], self.steps, ids.device
        d = self.draft
        ctx = d.context_kv(aux, torch.arange(T, device=dev).expand(B, T))
        pos = (anchors[..., None] + torch.arange(K + 1, device=dev)).reshape(B, N * (K + 1))
        blk = torch.full((B, N, K + 1), d.cfg.mask_token_id, device=dev)
        blk[..., 0] = ids.gather(1, anchors)
        owner = torch.arange(N, device=dev).repeat_interleave(K + 1)
        mask = torch.cat([(torch.arange(T, device=dev) < anchors.repeat_interleave(K + 1, 1)[..., None]),
                          (owner[:, None] == owner[None, :]).expand(B, -1, -1)], -1)[:, None]

        def attend(layer, q, k, v):
            ck, cv = ctx[layer]
            return attend_over(q, torch.cat([ck, k], 2), torch.cat([cv, v], 2), mask)

        return d.block(blk.reshape(B, -1), pos, attend).view(B, N, K + 1, -1)

    def blocks_loss(self, ids, aux, probs, top, loss_mask, anchors, present):
        """(loss, stats [3, steps], per slot j: (rows b, anchors a, hits)) of the blocks at
        `anchors` [B,N] (those not `present` are padding, trained nowhere)."""
        T, K, dev = ids.shape[1], self.steps, ids.device
        out = self.block_states(ids, aux, anchors)
        compiled = ids.is_cuda if self.compiled_loss is None else self.compiled_loss
        loss_of = draft_loss_compiled if compiled else draft_loss
        flat_probs, flat_top = probs.reshape(-1, probs.shape[-1]), top.reshape(-1)
        loss, stats, hits = 0.0, [], []
        for s in range(1, K + 1):
            at = anchors + s
            trained = present & (at < T) & loss_mask.gather(1, at.clamp(max=T - 1))
            b, n = trained.nonzero(as_tuple=True)
            a = anchors[b, n]
            ce, objective, hit = loss_of(self.draft.logits(out[b, n, s]), flat_probs, flat_top, b * T + a + s - 1, self.loss)
            loss = loss + self.decay ** (s - 1) * objective / max(b.numel(), 1)
            stats.append(torch.stack([ce.detach(), hit.sum().float(), torch.tensor(float(b.numel()), device=dev)]))
            hits.append((b, a, hit))
        return loss, torch.stack(stats, 1), hits


def default_mask_token(tokenizer, vocab_size: int) -> int:
    """The mask token when none is named: the highest-id token the tokenizer added that is
    none of its own special tokens (bos/eos/pad/unk/chat markers), so chat text never holds it
    (SmolLM2: 16, `<empty_output>`); else an embedding row past the tokenizer's last token."""
    special = set(tokenizer.all_special_ids)
    added = [i for i in tokenizer.added_tokens_decoder if i not in special and i < vocab_size]
    if added:
        return max(added)
    if len(tokenizer) < vocab_size:
        return vocab_size - 1
    raise FledgeError("no unused token to mark DFlash's mask slots: pass --mask-token-id")


def build_block_draft(cfg, target, draft_ids: torch.Tensor) -> DFlashDraft:
    """The DFlash drafter a run starts from: --init's, or a fresh one over `draft_ids`, its head
    the target's rows of them (random with --head fresh)."""
    model = target.model
    if cfg.init:
        draft = load_dflash(cfg.init, embed_from=model)
        if cfg.draft_layers and cfg.draft_layers != draft.cfg.num_hidden_layers:
            raise FledgeError(f"--init {cfg.init}: a DFlash drafter of {draft.cfg.num_hidden_layers} layers; "
                              f"--draft-layers {cfg.draft_layers} cannot reshape it")
        if cfg.ttt_steps > draft.cfg.block_size - 1:
            raise FledgeError(f"--init {cfg.init}: a block of {draft.cfg.block_size}; --ttt-steps {cfg.ttt_steps} "
                              "masks need a block of ttt-steps + 1")
        return draft
    tcfg = model.config.get_text_config()
    mask = cfg.mask_token_id if cfg.mask_token_id is not None else default_mask_token(target.tokenizer, tcfg.vocab_size)
    dcfg = DFlashConfig.from_target(tcfg, mask_token_id=mask, draft_vocab_size=draft_ids.numel(),
                                    aux_layer_ids=cfg.aux_layers, num_layers=cfg.draft_layers or DFLASH_LAYERS,
                                    block_size=cfg.ttt_steps + 1, intermediate_size=cfg.draft_intermediate_size)
    draft = DFlashDraft.from_target(dcfg, model, draft_ids)
    if cfg.head == "fresh":
        draft.lm_head.reset_parameters()
    return draft
