"""Acceptance of a verified draft tree (rank 0 only: it owns the per-request generators).

Greedy: follow the child whose token equals the target argmax; the first miss (or a leaf)
gives the bonus token. Sampling: recursive rejection sampling for deterministic (top-k)
proposals: with p the target distribution at a node, try its children in order and accept
child c with probability p(c); on rejection set p(c) = 0 and renormalise; if every child is
rejected, draw the bonus from what remains. Each emitted token is then distributed exactly as
p, so the output matches plain sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpserve.engine.request import Request
from tpserve.engine.sampler import apply_min_tokens, apply_penalties, target_probs


@dataclass(frozen=True)
class Accepted:
    nodes: list[int]  # accepted path, starting with the root (node 0)
    tokens: list[int]  # tokens appended: accepted draft tokens then the bonus token


def children_of(parents: list[int]) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents):
        if parent >= 0:
            kids[parent].append(node)
    return kids


def accept_greedy(tokens: list[int], parents: list[int], logits: torch.Tensor) -> Accepted:
    """``logits`` [N, V] at each node; ties resolve to the lowest id like ``sample``."""
    best = logits.argmax(dim=-1).tolist()
    kids = children_of(parents)
    node, path = 0, [0]
    while True:
        hit = next((c for c in kids[node] if tokens[c] == best[node]), None)
        if hit is None:
            return Accepted(path, [tokens[n] for n in path[1:]] + [best[node]])
        node = hit
        path.append(node)


def accept_sampled(tokens: list[int], parents: list[int], probs: torch.Tensor,
                   generator: torch.Generator) -> Accepted:
    """``probs`` [N, V]: the target distribution at each node (``target_probs``)."""
    kids = children_of(parents)
    node, path = 0, [0]
    while True:
        residual = probs[node].double().clone()
        hit = None
        for child in kids[node]:
            token = tokens[child]
            mass = float(residual[token] / residual.sum())
            if float(torch.rand((), generator=generator, dtype=torch.float64)) < mass:
                hit = child
                break
            residual[token] = 0.0
        if hit is None:
            bonus = int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
            return Accepted(path, [tokens[n] for n in path[1:]] + [bonus])
        node = hit
        path.append(node)


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
    for b, req in enumerate(reqs):
        toks, pars = tree_tokens[b].tolist(), parents[b].tolist()
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


def accept_batch(reqs: list[Request], tree_tokens: torch.Tensor, parents: torch.Tensor,
                 logits: torch.Tensor) -> list[Accepted]:
    """Accept per request; ``logits`` [B, N, V] already penalised per node."""
    results = []
    sampled = [b for b, r in enumerate(reqs) if not r.params.greedy]
    probs = {}
    if sampled:
        rows = logits[sampled].reshape(-1, logits.shape[-1])
        params = [reqs[b].params for b in sampled for _ in range(logits.shape[1])]
        table = target_probs(rows, params).view(len(sampled), logits.shape[1], -1)
        probs = {b: table[i] for i, b in enumerate(sampled)}
    for b, req in enumerate(reqs):
        toks, pars = tree_tokens[b].tolist(), parents[b].tolist()
        if b in probs:
            results.append(accept_sampled(toks, pars, probs[b].cpu(), req.generator))
        else:
            results.append(accept_greedy(toks, pars, logits[b]))
    return results


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
