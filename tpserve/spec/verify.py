"""Acceptance of a verified draft tree (rank 0 only: it owns the per-request generators).

Greedy: follow the child whose token equals the target argmax; the first miss (or a leaf)
gives the bonus token. Sampling: recursive rejection sampling for deterministic (top-k)
proposals: with p the target distribution at a node, try its children in order and accept
child c with probability p(c); on rejection set p(c) = 0 and renormalise; if every child is
rejected, draw the bonus from what remains. Each emitted token is then distributed exactly as
p, so the output matches plain sampling.

The host reads back only what acceptance needs, once for the whole batch: the tree, the
target argmax at every node, and for sampled requests each child's probability under its
parent, every node's total mass and one uniform per node; then one residual row per sampled
request for its bonus token, drawn on the generator's device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpserve.engine.request import Request
from tpserve.engine.sampler import (
    apply_min_tokens,
    apply_penalties,
    draw,
    target_probs,
)
from tpserve.layers.fused import greedy_logprob


@dataclass(frozen=True)
class Accepted:
    nodes: list[int]  # accepted path, starting with the root (node 0)
    tokens: list[int]  # tokens appended: accepted draft tokens then the bonus token
    # Leading accepted drafts that were each their parent's first child: what a chain
    # drafting only the top token per depth would have accepted on this text (children are
    # proposed best first). None: not known (the chain's is its own path).
    first_branch: int | None = None


def first_branch(path: list[int], kids: list[list[int]]) -> int:
    """How many of ``path``'s drafts (after the root) lie on the first-child branch;
    ``kids`` from ``children_of`` (each node's children in proposal order)."""
    count = 0
    for parent, child in zip(path, path[1:]):
        if kids[parent][0] != child:
            break
        count += 1
    return count


@dataclass(frozen=True)
class Walk:
    """A sampled request's accepted path before its bonus token is drawn."""

    path: list[int]
    rejected: list[int]  # tokens rejected at the path's last node (zero in its residual)
    first_branch: int  # ``Accepted.first_branch`` of the path


def children_of(parents: list[int]) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents):
        if parent >= 0:
            kids[parent].append(node)
    return kids


def greedy_path(tokens: list[int], parents: list[int], best: list[int]) -> Accepted:
    """``best`` [N]: the target argmax at each node."""
    kids = children_of(parents)
    node, path = 0, [0]
    while True:
        hit = next((c for c in kids[node] if tokens[c] == best[node]), None)
        if hit is None:
            return Accepted(path, [tokens[n] for n in path[1:]] + [best[node]],
                            first_branch(path, kids))
        node = hit
        path.append(node)


def accept_greedy(tokens: list[int], parents: list[int], logits: torch.Tensor) -> Accepted:
    """``logits`` [N, V] at each node; ties resolve to the lowest id like ``sample``."""
    return greedy_path(tokens, parents, logits.argmax(dim=-1).tolist())


def walk_sampled(tokens: list[int], parents: list[int], child_mass: list[float],
                 node_mass: list[float], uniforms: list[float]) -> Walk:
    """Rejection-sample a path: ``child_mass[c]`` = p_parent(c)(token c), ``node_mass[n]`` =
    the total of p_n, ``uniforms[c]`` the draw that decides child c (each is tried once)."""
    kids = children_of(parents)
    node, path = 0, [0]
    while True:
        remaining, rejected, hit = node_mass[node], [], None
        for child in kids[node]:
            token = tokens[child]
            fresh = token not in rejected  # a repeated token's residual mass is already 0
            mass = child_mass[child] / remaining if fresh and remaining > 0 else 0.0
            if uniforms[child] < mass:
                hit = child
                break
            if fresh:
                rejected.append(token)
                remaining -= child_mass[child]
        if hit is None:
            return Walk(path, rejected, first_branch(path, kids))
        node = hit
        path.append(node)


def accept_sampled(tokens: list[int], parents: list[int], probs: torch.Tensor,
                   generator: torch.Generator) -> Accepted:
    """``probs`` [N, V]: the target distribution at each node (``target_probs``)."""
    tree = torch.tensor([tokens, parents], device=probs.device)
    return _accept_sampled_rows(tree[0:1], tree[1:2], probs[None], [generator])[0]


def node_logits(reqs: list[Request], tree_tokens: torch.Tensor, parents: torch.Tensor,
                logits: torch.Tensor, eos: list[int]) -> torch.Tensor:
    """Apply penalties / min_new_tokens per node, as if the path to the node were generated.

    ``logits`` [B, N, V]. Rows whose request uses neither are returned untouched.
    """
    if not any(r.params.uses_penalties or r.params.min_new_tokens > len(r.output_ids)
               for r in reqs):
        return logits
    batch, n, vocab = logits.shape
    flat_params, prompts, outputs = [], [], []
    all_toks, all_pars = torch.stack([tree_tokens, parents.to(tree_tokens.device)]).tolist()
    for req, toks, pars in zip(reqs, all_toks, all_pars, strict=True):
        for i in range(n):
            path = []
            node = i
            while node > 0:
                path.append(toks[node])
                node = pars[node]
            flat_params.append(req.params)
            prompts.append(req.prompt_ids)
            outputs.append(req.output_ids + path[::-1])
    flat = apply_penalties(logits.reshape(batch * n, vocab), flat_params, prompts, outputs)
    flat = apply_min_tokens(flat, flat_params, [len(o) for o in outputs], eos)
    return flat.view(batch, n, vocab)


def accept_greedy_batch(tree_tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor
                        ) -> list[tuple[Accepted, list]]:
    """Greedy acceptance of a whole batch with each appended token's log-probability, for
    requests that ask for no top logprobs: one fused argmax + logsumexp over every node
    (``fused.greedy_logprob``, what plain greedy decoding reports) instead of a log-softmax
    per request. A greedy path's i-th token is its i-th node's argmax, so its logprob is
    that node's. ``logits`` [B, N, V] fp32, already penalised per node."""
    batch, nodes, vocab = logits.shape
    best, chosen = greedy_logprob(logits.reshape(batch * nodes, vocab))
    lps = chosen.view(batch, nodes).tolist()
    return [(acc, [(t, lps[b][n], None) for n, t in zip(acc.nodes, acc.tokens, strict=True)])
            for b, acc in enumerate(_greedy_paths(best.view(batch, nodes), tree_tokens,
                                                  parents))]


def greedy_paths(tree_tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor
                 ) -> list[Accepted]:
    """The paths ``accept_greedy_batch`` takes (the same fused argmax), without the
    log-probabilities: what a drafting follower needs to draft ahead."""
    batch, nodes, vocab = logits.shape
    best, _ = greedy_logprob(logits.reshape(batch * nodes, vocab))
    return _greedy_paths(best.view(batch, nodes), tree_tokens, parents)


def _greedy_paths(best: torch.Tensor, tree_tokens: torch.Tensor, parents: torch.Tensor
                  ) -> list[Accepted]:
    """Each request's greedy path from the target argmax ``best`` [B, N] at every node: one
    read-back of the argmax and the tree for the whole batch."""
    if best.is_cpu and tree_tokens.is_cpu and parents.is_cpu:  # nothing to read back
        host = [best.tolist(), tree_tokens.tolist(), parents.tolist()]
    else:
        host = torch.stack([best, tree_tokens.to(best.device), parents.to(best.device)]).tolist()
    return [greedy_path(toks, pars, top) for top, toks, pars in zip(*host, strict=True)]


def accept_batch(reqs: list[Request], tree_tokens: torch.Tensor, parents: torch.Tensor,
                 logits: torch.Tensor) -> list[Accepted]:
    """Accept per request; ``logits`` [B, N, V] already penalised per node."""
    sampled = [b for b, r in enumerate(reqs) if not r.params.greedy]
    results: list[Accepted | None] = [None] * len(reqs)
    if len(sampled) < len(reqs):
        paths = _greedy_paths(logits.argmax(dim=-1), tree_tokens, parents)
        for b, req in enumerate(reqs):
            if req.params.greedy:
                results[b] = paths[b]
    if sampled:
        tree = torch.stack([tree_tokens, parents]).to(logits.device)
        if len(sampled) < len(reqs):  # only the sampled requests' rows
            index = torch.tensor(sampled, device=logits.device)
            logits, tree = logits[index], tree[:, index]
        params = [reqs[b].params for b in sampled for _ in range(logits.shape[1])]
        probs = target_probs(logits.reshape(-1, logits.shape[-1]), params).view(logits.shape)
        done = _accept_sampled_rows(tree[0], tree[1], probs,
                                    [reqs[b].generator for b in sampled])
        for b, acc in zip(sampled, done, strict=True):
            results[b] = acc
    return [r for r in results if r is not None]


def _accept_sampled_rows(tokens: torch.Tensor, parents: torch.Tensor, probs: torch.Tensor,
                         generators: list[torch.Generator]) -> list[Accepted]:
    """Rejection sampling for S requests: ``tokens/parents`` [S, N], ``probs`` [S, N, V]."""
    batch, n, vocab = probs.shape
    flat = parents.clamp(min=0) * vocab + tokens  # a child's token in its parent's row
    child_mass = probs.reshape(batch, n * vocab).gather(1, flat).double()
    node_mass = probs.sum(dim=-1, dtype=torch.float64)
    uniforms = torch.stack([_on(torch.rand(n, generator=g, device=g.device, dtype=torch.float64),
                                probs.device) for g in generators])
    host = torch.stack([child_mass, node_mass, uniforms,
                        tokens.double(), parents.double()]).tolist()
    walks = [walk_sampled([int(t) for t in host[3][s]], [int(p) for p in host[4][s]],
                          host[0][s], host[1][s], host[2][s]) for s in range(batch)]
    bonus = _draw_bonus(probs, walks, generators)
    return [Accepted(w.path, [int(host[3][s][i]) for i in w.path[1:]] + [bonus[s]],
                     w.first_branch) for s, w in enumerate(walks)]


def _draw_bonus(probs: torch.Tensor, walks: list[Walk], generators: list[torch.Generator]
                ) -> list[int]:
    """Each request's bonus token from its last node's distribution less the rejected
    children, on the generator's device. A
    residual that rounding left empty falls back to the node's whole distribution."""
    batch = len(walks)
    rows = probs[torch.arange(batch, device=probs.device),
                 torch.tensor([w.path[-1] for w in walks], device=probs.device)].double()
    hit = [(s, t) for s, w in enumerate(walks) for t in w.rejected]
    residual = rows.clone()
    if hit:
        residual[torch.tensor(hit, device=probs.device).T.unbind()] = 0.0
    residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, rows)
    return draw(residual, generators, None).tolist()  # as plain sampling draws


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t if t.device == device else t.to(device)


def token_logprobs(req: Request, acc: Accepted, logits: torch.Tensor) -> list | None:
    """(token, logprob, top) per appended token, from the node that predicted it."""
    if req.params.logprobs < 0:
        return None
    rows = torch.log_softmax(logits[acc.nodes].float(), dim=-1)
    out = []
    for row, token in zip(rows, acc.tokens, strict=True):
        top = None
        if req.params.logprobs > 0:
            values, ids = row.topk(req.params.logprobs)
            top = list(zip(ids.tolist(), values.tolist(), strict=True))
        out.append((token, float(row[token]), top))
    return out
