"""Draft trees: selection (EAGLE-2), the tree attention mask, and acceptance.

A tree has a fixed node count N = num_draft_tokens. Node 0 is the root: the last verified
token, whose K/V is not yet in the target cache. Nodes are ordered so a parent comes before
its children, and siblings keep the order the drafter ranked them in. Every tensor has a
leading batch dim; all functions are free of host syncs and data-dependent shapes, so the
verify step can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Tree:
    tokens: torch.Tensor  # [B, N] target token ids; tokens[:, 0] is the root
    parents: torch.Tensor  # [B, N] node index of each node's parent (the root points at itself)
    depth: torch.Tensor  # [B, N] 0 for the root
    anc: torch.Tensor  # [B, N, N] bool: anc[b, i, j] = node j is node i or one of its ancestors

    @property
    def size(self) -> int:
        return self.tokens.shape[1]


def ancestors(parents: torch.Tensor) -> torch.Tensor:
    """Reflexive-transitive closure of the parent relation by repeated squaring
    (log2 N boolean matmuls instead of a walk per node)."""
    B, N = parents.shape
    reach = torch.eye(N, device=parents.device).repeat(B, 1, 1).scatter_(2, parents[..., None], 1.0)
    for _ in range(max(1, (N - 1).bit_length())):
        reach = (reach @ reach).clamp_(max=1.0)
    return reach > 0


def make_tree(root: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor) -> Tree:
    """Tree from a root [B] and N-1 non-root nodes whose `parents` index nodes (0 = root)."""
    B = root.shape[0]
    zero = torch.zeros(B, 1, dtype=torch.long, device=root.device)
    parents = torch.cat([zero, parents], dim=1)
    anc = ancestors(parents)
    return Tree(torch.cat([root[:, None], tokens], dim=1), parents, anc.sum(-1) - 1, anc)


def chain(root: torch.Tensor, tokens: torch.Tensor) -> Tree:
    """A chain root → tokens[:, 0] → tokens[:, 1] → ... (make_tree's result, built directly)."""
    B, n = tokens.shape
    idx = torch.arange(n + 1, device=root.device)
    anc = (idx[None, :] <= idx[:, None]).expand(B, n + 1, n + 1)
    return Tree(torch.cat([root[:, None], tokens], dim=1), (idx - 1).clamp(min=0).expand(B, -1), idx.expand(B, -1), anc)


# torch.topk on the GPU is a radix select of several passes, ~25 us a call on the H200 whatever
# the row's length (bf16: 27 us for one
# best of 68 candidates, 75 us for 4 of 16K logits): with several calls per draft step it was
# most of a step. These two compile to a few short kernels each. Both return torch.topk's
# (values, indices), largest first, ties to the lower index.
TOPK_CHUNK = 256  # a row longer than this is cut into chunks of it: see topk_by_max


def _row_chunks(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """[..., n] -> [..., ceil(n / chunk), chunk], the last chunk padded with -inf (which neither
    a max nor a logsumexp picks up)."""
    return F.pad(x, (0, -x.shape[-1] % chunk), value=float("-inf")).unflatten(-1, (-1, chunk))


def topk_by_max(x: torch.Tensor, k: int, chunk: int = TOPK_CHUNK):
    """For long rows (a vocab) and small k: k max-reductions, each masking the winners before it.
    A row longer than `chunk` first gives up the top k of each of its chunks, then the best k of
    those win: compiled without split reductions (see Eagle3Drafter), a whole vocab row is one
    program's serial loop, where chunks are short reductions side by side."""
    n = x.shape[-1]
    if n > chunk >= 2 * k:  # each pass then at least halves the row
        parts = _row_chunks(x, chunk)
        vals, idx = topk_by_max(parts, k, chunk)  # [..., n_chunks, k]
        idx = idx + torch.arange(parts.shape[-2], device=x.device)[:, None] * chunk
        vals, pick = topk_by_max(vals.flatten(-2), k, chunk)  # chunk-major: ties stay with the lower index
        return vals, idx.flatten(-2).gather(-1, pick)
    cols = torch.arange(n, device=x.device)
    vals, idx = [], []
    for _ in range(k):
        v, i = x.max(dim=-1)
        vals.append(v)
        idx.append(i)
        x = torch.where(cols == i[..., None], float("-inf"), x)
    return torch.stack(vals, -1), torch.stack(idx, -1)


def logsumexp_by_chunks(x: torch.Tensor, chunk: int = TOPK_CHUNK) -> torch.Tensor:
    """x.logsumexp(-1), over chunks of the row first (for the reason in topk_by_max)."""
    if x.shape[-1] <= chunk:
        return x.logsumexp(-1)
    return logsumexp_by_chunks(_row_chunks(x, chunk).logsumexp(-1), chunk)


def topk_by_rank(x: torch.Tensor, k: int):
    """For short rows (tree candidates): every element's rank from comparing all pairs."""
    idx = torch.arange(x.shape[-1], device=x.device)
    rank = ranks(x)
    indices = ((rank[..., None, :] == torch.arange(k, device=x.device)[:, None]) * idx).sum(-1)  # [..., k]
    return x.gather(-1, indices), indices


def ranks(x: torch.Tensor) -> torch.Tensor:
    """[..., n] long: how many elements of the row come before each in descending order (ties
    to the lower index)."""
    idx = torch.arange(x.shape[-1], device=x.device)
    a, b = x[..., None, :], x[..., :, None]  # a: the others, b: the element itself
    return ((a > b) | ((a == b) & (idx < idx[:, None]))).sum(-1)


def _best_in_order(key: torch.Tensor, k: int) -> torch.Tensor:
    """[B, k]: indices of the k largest keys of each row, in index order (topk + sort, by ranks)."""
    B, C = key.shape
    idx = torch.arange(C, device=key.device)
    chosen = ranks(key) < k
    before = (chosen[:, None, :] & (idx < idx[:, None])).sum(-1)  # chosen i goes after the chosen before it
    slot = torch.where(chosen, before, k)  # the others: a spare column, cut below
    return torch.zeros(B, k + 1, dtype=torch.long, device=key.device).scatter_(1, slot, idx.expand(B, C))[:, :k]


def select_tree(root, cand_tokens, cand_scores, cand_parents, depth, num_nodes: int, by_rank: bool = False) -> Tree:
    """EAGLE-2 / SGLang re-ranking: keep the `num_nodes - 1` candidates with the best
    cumulative log-probability.

    Candidates are ordered by depth; `cand_parents` indexes candidates (-1 = the root). A
    child's score is its parent's plus a log-prob <= 0, so the best set is closed under
    parents; ties are broken toward shallower nodes (the depth term) so that a log-prob of
    exactly 0 cannot drop a parent while keeping its child.
    """
    key = cand_scores.double() - 1e-9 * depth.double()
    B, C = cand_tokens.shape
    if by_rank:
        keep = _best_in_order(key, num_nodes - 1)
    else:
        keep = key.topk(num_nodes - 1, dim=1).indices.sort(dim=1).values  # depth order: parents first
    node_of = torch.zeros(B, C + 1, dtype=torch.long, device=root.device)  # slot C is the root
    node_of.scatter_(1, keep, torch.arange(1, num_nodes, device=root.device).expand(B, -1))
    par = cand_parents.gather(1, keep)
    par = torch.where(par < 0, C, par)
    return make_tree(root, cand_tokens.gather(1, keep), node_of.gather(1, par))


def node_probs(probs: torch.Tensor, tree: Tree) -> torch.Tensor:
    """[B, N]: the target's probability of each node's token at its parent (1 for the root)."""
    at_parent = probs.gather(1, tree.parents[..., None].expand(-1, -1, probs.shape[-1]))
    p = at_parent.gather(2, tree.tokens[..., None])[..., 0]
    return torch.where(tree.depth == 0, torch.ones_like(p), p)


def accepted_nodes(ok: torch.Tensor, tree: Tree) -> torch.Tensor:
    """[B, N] bool: a node is accepted iff it and all its ancestors passed (`ok`)."""
    return ~(tree.anc & ~ok[:, None, :]).any(-1)


def deepest(accepted: torch.Tensor, tree: Tree) -> torch.Tensor:
    """[B] index of the deepest accepted node (accepted nodes form one path)."""
    return torch.where(accepted, tree.depth + 1, 0).argmax(dim=1)


def verify_greedy(logits: torch.Tensor, tree: Tree):
    """Accept a node iff its token is the target's argmax at its parent. Returns
    (best [B], bonus [B]): the bonus is the argmax at the deepest accepted node."""
    argmax = logits.argmax(-1)
    ok = (tree.tokens == argmax.gather(1, tree.parents)) | (tree.depth == 0)
    best = deepest(accepted_nodes(ok, tree), tree)
    return best, argmax.gather(1, best[:, None])[:, 0]


def verify_sample(probs: torch.Tensor, tree: Tree, generator=None, residual: bool = True):
    """Lossless acceptance for deterministic drafts (SpecInfer / EAGLE recursive rejection,
    target-only form as in SGLang): at each accepted node one uniform coin u walks the
    children in order; child i is accepted iff u falls in [sum_{j<i} p(c_j), sum_{j<=i} p(c_j)),
    so child c is taken with exactly the target probability p(c). If none is taken the bonus
    is drawn from p with the tried children removed — the rejection correction — so every
    output token is distributed exactly as p. `residual=False` skips that correction; it
    exists only as the biased negative control the sampling test must catch.

    probs [B, N, V]: the target's processed distribution at every node. Returns (best, bonus).
    """
    B, N, V = probs.shape
    p = node_probs(probs, tree)
    # siblings that come before j: same parent, smaller index, not the root
    idx = torch.arange(N, device=p.device)
    earlier = (tree.parents[:, :, None] == tree.parents[:, None, :]) & (idx[None, :] < idx[:, None])[None]
    earlier &= (tree.depth > 0)[:, None, :]
    lo = (earlier.float() * p[:, None, :]).sum(-1)
    coins = torch.rand(B, N, generator=generator, device=p.device).gather(1, tree.parents)
    ok = ((lo <= coins) & (coins < lo + p)) | (tree.depth == 0)
    best = deepest(accepted_nodes(ok, tree), tree)
    at_best = probs.gather(1, best[:, None, None].expand(B, 1, V))[:, 0]
    if residual:
        tried = (tree.parents == best[:, None]) & (tree.depth > 0)
        removed = torch.zeros_like(at_best).scatter_add_(1, tree.tokens, tried.to(at_best.dtype))
        rest = at_best * (removed == 0)
        # fp rounding can leave nothing when the children held all the mass
        at_best = torch.where(rest.sum(-1, keepdim=True) > 0, rest, at_best)
    return best, torch.multinomial(at_best, 1, generator=generator)[:, 0]


def path_to(best: torch.Tensor, tree: Tree, length: int) -> torch.Tensor:
    """[B, length] node indices root → best, padded by repeating `best` (length >= depth+1)."""
    B, N = tree.tokens.shape
    on_path = tree.anc.gather(1, best[:, None, None].expand(B, 1, N))[:, 0]
    out = best[:, None].expand(B, length + 1).clone()  # column `length` soaks up off-path nodes
    slot = torch.where(on_path, tree.depth, length)
    out.scatter_(1, slot, torch.arange(N, device=best.device).expand(B, N))
    return out[:, :length]
