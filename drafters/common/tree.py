"""EAGLE-2 dynamic draft trees (docs/design/algorithms.md section 2): the tree, its mask and positions, the
`TreeProposer` / `TreeDrafterFamily` protocols, and expand + rerank. N nodes in topological order
(`token_ids`, `parents` -1 = the root x_n, `depths`, int64 [N]) after C context rows (target: C = n + 1,
EAGLE draft: C = n); node i sees the context, its ancestors and itself, at position C + depths[i] - 1:
    root x1 ── a(0) ── c(2)                token_ids = [a, b, c, d]
            │        └─ d(3)               parents   = [-1, -1, 0, 0]
            └─ b(1)                        depths    = [1, 1, 2, 2]
mask (rows = queries, columns = keys)     positions = [0, 1, 2, 2, 3, 3]
           x0 x1  a  b  c  d
      x0:   1  0  0  0  0  0
      x1:   1  1  0  0  0  0
      a :   1  1  1  0  0  0
      b :   1  1  0  1  0  0               (b does not see its sibling a)
      c :   1  1  1  0  1  0
      d :   1  1  1  0  0  1               (d does not see its sibling c)
so d's row equals the last row of a causal pass over [x0, x1, a, d]; HF takes it as `additive_mask`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from drafters.common.contract import DraftContext, DrafterFamily
from drafters.common.target import TargetSpec


def _check_parents(parents: Tensor, depths: Tensor) -> None:
    n = parents.numel()
    if depths.numel() != n:
        raise ValueError(f"tree: {n} parents but {depths.numel()} depths")
    for i in range(n):
        p, d = int(parents[i]), int(depths[i])
        if not -1 <= p < i:
            raise ValueError(f"tree: node {i} has parent {p}, expected -1 (root) or an earlier node 0..{i - 1}")
        if d != (1 if p < 0 else int(depths[p]) + 1):
            raise ValueError(f"tree: node {i} has depth {d}, expected its parent's depth + 1")


def tree_attention_mask(parents: Tensor, context_len: int) -> Tensor:
    """bool [C + N, C + N]: causal over the C context rows; node i (row C + i) sees all context
    rows, its ancestors and itself. parents: int64 [N] in topological order (-1 = root)."""
    n = parents.numel()
    total = context_len + n
    mask = torch.zeros(total, total, dtype=torch.bool)
    mask[:context_len, :context_len] = torch.ones(context_len, context_len, dtype=torch.bool).tril()
    mask[context_len:, :context_len] = True
    for i in range(n):
        row = context_len + i
        p = int(parents[i])
        if p >= 0:
            mask[row, context_len:] = mask[context_len + p, context_len:]  # the parent's ancestors + parent
        mask[row, row] = True
    return mask


def tree_position_ids(depths: Tensor, context_len: int) -> Tensor:
    """int64 [C + N]: context row t -> t, node i -> C + depths[i] - 1."""
    return torch.cat([torch.arange(context_len), context_len + depths.long() - 1])


def additive_mask(mask: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """bool [T, T] (True = attend) -> float [1, 1, T, T]: 0 where True, finfo(dtype).min where
    False (what HF adds to the attention scores; min rather than -inf keeps rows NaN-free)."""
    out = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask.to(torch.bool), torch.finfo(dtype).min)
    return out[None, None]


def tree_children(parents: Tensor) -> list[list[int]]:
    """children[0] = the root's children, children[1 + i] = node i's, each in node order."""
    out: list[list[int]] = [[] for _ in range(parents.numel() + 1)]
    for i, p in enumerate(parents.tolist()):
        out[int(p) + 1].append(i)
    return out


@dataclass
class DraftTree:
    """A reranked draft tree (module docstring): token_ids / parents / depths int64 [N];
    values float64 [N], the cumulative draft log-probability of each root-to-node path."""

    token_ids: Tensor
    parents: Tensor
    depths: Tensor
    values: Tensor

    def __post_init__(self) -> None:
        _check_parents(self.parents, self.depths)
        if not self.token_ids.numel() == self.values.numel() == self.parents.numel():
            raise ValueError("tree: token_ids, parents, depths and values must have one entry per node")

    @property
    def num_nodes(self) -> int:
        return self.token_ids.numel()

    def path(self, node: int) -> list[int]:
        """Node indices from the root's child down to `node`."""
        out = []
        while node >= 0:
            out.append(node)
            node = int(self.parents[node])
        return out[::-1]


# ----------------------------------------------------------------------------- drafter protocol


@dataclass
class TreeNodes:
    """Nodes a `TreeProposer` runs, closed under parents. token_ids / parents / depths int64 [N];
    parent_hidden [N, H_d], the draft's hidden state at each node's parent ([0, 0] when N = 0)."""

    token_ids: Tensor
    parents: Tensor
    depths: Tensor
    parent_hidden: Tensor

    @property
    def num_nodes(self) -> int:
        return self.token_ids.numel()

    @classmethod
    def root_only(cls) -> TreeNodes:
        empty = torch.zeros(0, dtype=torch.int64)
        return cls(empty, empty, empty, torch.zeros(0, 0))


@dataclass
class TreeExpansion:
    """log_probs float32 [N + 1, V] (TARGET vocab) and hidden [N + 1, H_d]: row 0 the root, row 1 + i
    node i (the distribution of its children; hidden is what a child receives as parent_hidden)."""

    log_probs: Tensor
    hidden: Tensor


class TreeProposer(Protocol):
    """What `build_draft_tree` needs from an EAGLE-style drafter: expand(ctx, nodes), one stateless forward
    over [context rows; nodes] under the tree mask, node i computing what chain drafting computes at the
    end of its path (top_k = 1 is the chain); N + 1 rows, log_probs over the TARGET vocab."""

    def expand(self, ctx: DraftContext, nodes: TreeNodes) -> TreeExpansion: ...


# ----------------------------------------------------------------------------- expand + rerank


@dataclass(frozen=True)
class TreeConfig:
    """EAGLE-2 tree shape (SafeAILab `top_k`, `depth`, `total_token`: 10, 7, 60 there): frontier nodes per
    depth and children per node, longest path, nodes kept by rerank (root excluded; SGLang's
    --speculative-num-draft-tokens = total_tokens + 1)."""

    top_k: int
    depth: int
    total_tokens: int

    def __post_init__(self) -> None:
        if self.top_k < 1 or self.depth < 1:
            raise ValueError(f"tree: need top_k >= 1 and depth >= 1, got top_k={self.top_k}, depth={self.depth}")
        if not 1 <= self.total_tokens <= self.pool_size:
            raise ValueError(f"tree: total_tokens={self.total_tokens}, expected 1..{self.pool_size} "
                             f"(top_k + (depth - 1) * top_k^2 for top_k={self.top_k}, depth={self.depth})")

    @property
    def pool_size(self) -> int:
        return self.top_k + (self.depth - 1) * self.top_k ** 2


@runtime_checkable
class TreeDrafterFamily(DrafterFamily, Protocol):
    """A family whose reference drafting is an EAGLE-2 tree (eagle2): decoded with
    `tree_speculative_generate`; `proposer` stays the chain engines without trees serve (vLLM 0.32)."""

    def tree_config(self, cfg: Any) -> TreeConfig:
        """The tree shape (top_k, depth, total_tokens) of a resolved config."""
        ...

    def tree_proposer(self, model: nn.Module, target_spec: TargetSpec) -> TreeProposer:
        """The `TreeProposer` (above) that expands the tree with `model`."""
        ...


@dataclass
class _Pool:
    tokens: list[int]
    parents: list[int]
    depths: list[int]
    values: list[float]
    parent_hidden: list[Tensor]

    def add(self, token: int, parent: int, depth: int, value: float, parent_hidden: Tensor) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(depth)
        self.values.append(value)
        self.parent_hidden.append(parent_hidden)
        return len(self.tokens) - 1


def _children(pool: _Pool, parent: int, depth: int, log_probs: Tensor, hidden: Tensor, top_k: int,
              base: float) -> list[int]:
    """Add the top_k children of `parent` (log_probs [V], its hidden [H_d]); -inf tokens are skipped."""
    vals, toks = torch.topk(log_probs.double().clamp_max(0.0), min(top_k, log_probs.numel()))
    return [pool.add(int(t), parent, depth, base + float(v), hidden) for v, t in zip(vals, toks)
            if float(v) > float("-inf")]


def _best(pool: _Pool, candidates: list[int], k: int) -> list[int]:
    """The k candidates of highest value; ties go to the shallower, then the earlier node."""
    return sorted(candidates, key=lambda i: (-pool.values[i], pool.depths[i], i))[:k]


def build_draft_tree(proposer: TreeProposer, ctx: DraftContext, cfg: TreeConfig) -> DraftTree:
    """EAGLE-2 dynamic tree (SafeAILab `topK_genrate`, SGLang `organize_draft_results`): value = sum of draft
    log-probs on the path; each depth expands the top_k frontier nodes, rerank keeps the total_tokens best.
    Values only fall along a path and ties favour the shallower node, so the kept nodes form a tree."""
    pool = _Pool([], [], [], [], [])
    root = proposer.expand(ctx, TreeNodes.root_only())
    frontier = _children(pool, -1, 1, root.log_probs[0], root.hidden[0], cfg.top_k, 0.0)
    expanded: list[int] = []
    for depth in range(2, cfg.depth + 1):
        if not frontier:
            break
        expanded += frontier
        index = {node: j for j, node in enumerate(expanded)}
        nodes = TreeNodes(torch.tensor([pool.tokens[i] for i in expanded]),
                          torch.tensor([index.get(pool.parents[i], -1) for i in expanded]),
                          torch.tensor([pool.depths[i] for i in expanded]),
                          torch.stack([pool.parent_hidden[i] for i in expanded]))
        out = proposer.expand(ctx, nodes)
        if tuple(out.log_probs.shape[:1]) != (len(expanded) + 1,):
            raise ValueError(f"expand: returned {out.log_probs.shape[0]} rows for {len(expanded)} nodes + root")
        candidates: list[int] = []
        for node in frontier:
            row = 1 + index[node]
            candidates += _children(pool, node, depth, out.log_probs[row], out.hidden[row], cfg.top_k,
                                    pool.values[node])
        frontier = _best(pool, candidates, cfg.top_k)
    keep = _best(pool, list(range(len(pool.tokens))), cfg.total_tokens)
    rank = {node: j for j, node in enumerate(keep)}
    return DraftTree(torch.tensor([pool.tokens[i] for i in keep], dtype=torch.int64),
                     torch.tensor([rank[pool.parents[i]] if pool.parents[i] >= 0 else -1 for i in keep],
                                  dtype=torch.int64),
                     torch.tensor([pool.depths[i] for i in keep], dtype=torch.int64),
                     torch.tensor([pool.values[i] for i in keep], dtype=torch.float64))
