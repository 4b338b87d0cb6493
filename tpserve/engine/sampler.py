"""Batched token sampling: logit penalties, the sampled distribution, and the draw itself.

This module owns turning a [B, V] logits tensor into next tokens. It is pure torch, never touches
the global RNG (every draw uses an explicit `torch.Generator`), and exposes `target_probs`, the
exact distribution `sample` draws from, so speculative decoding can do rejection sampling
against the same distribution.

Filter order follows SGLang: temperature, then top-k, top-p, min-p. Each filter renormalises
before the next one looks at the probabilities (as HF and vLLM do), so top-p's cumulative mass
is measured within the top-k survivors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tpserve.engine.sampling_params import SamplingParams
from tpserve.layers import fused


@dataclass(frozen=True)
class SampleResult:
    """Chosen tokens and their log-probabilities under the (penalised) model distribution."""

    tokens: Tensor  # [B] long
    logprobs: Tensor  # [B] float32: log_softmax(logits)[token]
    top_logprobs: list[list[tuple[int, float]]] | None  # per row, best first; None if unasked


def make_generator(
    seed: int | None, fallback_seed: int, device: torch.device | str = "cpu"
) -> torch.Generator:
    """A generator seeded with the request's seed, or with `fallback_seed` when it has none."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else fallback_seed)
    return gen


def _as_long(ids: Tensor | Sequence[int], device: torch.device) -> Tensor:
    return torch.as_tensor(ids, dtype=torch.long, device=device).reshape(-1)


def apply_penalties(
    logits: Tensor,
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Tensor | Sequence[int]],
    output_ids: Sequence[Sequence[int]],
) -> Tensor:
    """Apply repetition, frequency and presence penalties, then the logit bias; returns a new
    tensor when any apply.

    Repetition (HF style) looks at prompt + output tokens: positive logits are divided by the
    penalty, negative ones multiplied. Frequency (penalty * count) and presence (penalty once)
    look at output tokens only, as in OpenAI/SGLang. Repetition is applied first, like vLLM.
    ``logit_bias`` is added last, to the penalised logits (what OpenAI describes: the bias
    goes onto the logits the model would sample from). The input tensor is never modified.
    """
    rows = [i for i, p in enumerate(params) if p.uses_penalties]
    if not rows:
        return logits  # common case: no copies, no work
    out = logits.clone()
    for i in rows:
        p = params[i]
        row = out[i]
        generated = _as_long(output_ids[i], out.device)
        if p.repetition_penalty != 1.0:
            seen = torch.cat([_as_long(prompt_ids[i], out.device), generated]).unique()
            vals = row[seen]
            row[seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
        if generated.numel() and (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0):
            ids, counts = generated.unique(return_counts=True)
            row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty
        if p.logit_bias:
            ids, biases = p.logit_bias_tensors
            row[ids.to(out.device)] += biases.to(device=out.device, dtype=row.dtype)
    return out


def apply_min_tokens(
    logits: Tensor,
    params: Sequence[SamplingParams],
    output_lens: Sequence[int],
    eos_token_ids: Sequence[int],
) -> Tensor:
    """Ban EOS and stop_token_ids for rows that have not yet produced min_new_tokens tokens.

    Returns a new tensor when any row is affected; the input is never modified.
    """
    rows = [i for i, p in enumerate(params) if output_lens[i] < p.min_new_tokens]
    if not rows:
        return logits
    out = logits.clone()
    vocab = out.shape[-1]
    for i in rows:
        # Ids outside the vocabulary cannot be sampled anyway; indexing with them would raise.
        banned = [t for t in (*eos_token_ids, *params[i].stop_token_ids) if 0 <= t < vocab]
        if banned:
            out[i, _as_long(banned, out.device)] = float("-inf")
    return out


def argmax_pick(params: SamplingParams, generated: int) -> bool:
    """Whether a row's token is the argmax of its raw logits, for a request that has
    ``generated`` tokens: greedy, no penalty or bias, no ``min_new_tokens`` still due (what
    speculative acceptance and the ranks' sharded greedy picks rely on)."""
    return params.greedy and not params.uses_penalties and params.min_new_tokens <= generated


def _column(values: list[float], like: Tensor) -> Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


def _filter_sorted(sorted_probs: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """``fused.filter_sorted`` with the columns of the filters some row of ``params`` uses."""
    def column(used: bool, values: list[float]) -> Tensor | None:
        return _column(values, sorted_probs) if used else None

    vocab = sorted_probs.shape[-1]
    return fused.filter_sorted(
        sorted_probs,
        # Clamped first: a top_k past float32's range would not convert.
        column(any(p.top_k > 0 for p in params), [min(p.top_k, vocab) for p in params]),
        column(any(p.top_p < 1.0 for p in params), [p.top_p for p in params]),
        column(any(p.min_p > 0.0 for p in params), [p.min_p for p in params]))


def _needs_filtering(params: Sequence[SamplingParams]) -> bool:
    return any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params)


def target_probs(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """The [B, V] float32 distribution `sample` draws from; greedy rows are one-hot at argmax."""
    logits = logits.float()
    greedy = [p.greedy for p in params]
    # Greedy rows get temperature 1 only to keep the arithmetic finite; they are replaced below.
    temps = _column([1.0 if p.greedy else p.temperature for p in params], logits)
    probs = fused.softmax(logits / temps)
    if _needs_filtering(params):
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
        kept = _filter_sorted(sorted_probs, params)
        kept = kept / kept.sum(dim=-1, keepdim=True)
        probs = torch.empty_like(probs).scatter_(1, order, kept)
    # Extreme penalties (repetition_penalty 1e-300, say) can still push logits to +-inf and a
    # row's softmax to NaN: such a row degenerates to its argmax rather than failing the step.
    broken = ~torch.isfinite(probs).all(dim=-1) | ~(probs.sum(dim=-1) > 0)
    rows = torch.tensor(greedy, device=logits.device) | broken
    if bool(rows.any()):
        best = torch.nan_to_num(logits, nan=float("-inf")).argmax(dim=-1, keepdim=True)
        one_hot = torch.zeros_like(probs).scatter_(1, best, 1.0)
        probs = torch.where(rows.unsqueeze(1), one_hot, probs)
    return probs


def draw_uniforms(generators: Sequence[torch.Generator | None],
                  fallback: torch.Generator | None, device: torch.device) -> Tensor:
    """One float64 uniform per row: seeded rows from their own generator (so their stream
    does not depend on batch composition), unseeded rows from one batched draw of
    ``fallback``."""
    out = torch.empty(len(generators), dtype=torch.float64)
    unseeded = [i for i, gen in enumerate(generators) if gen is None]
    if unseeded:
        if fallback is None:
            raise ValueError(
                f"row {unseeded[0]} has no generator and no fallback_generator was given; "
                "sampling never uses the global RNG"
            )
        drawn = torch.rand(len(unseeded), dtype=torch.float64, generator=fallback,
                           device=fallback.device)
        out[torch.tensor(unseeded)] = drawn.cpu()
    for i, gen in enumerate(generators):
        if gen is not None:  # a generator draws only on its own device
            out[i] = torch.rand(1, dtype=torch.float64, generator=gen, device=gen.device).item()
    return out.to(device)


def draw(
    probs: Tensor, generators: Sequence[torch.Generator | None], fallback: torch.Generator | None
) -> Tensor:
    """One draw per row of ``probs`` (``fused.inverse_cdf``) with one uniform each
    (``draw_uniforms``)."""
    return fused.inverse_cdf(probs, draw_uniforms(generators, fallback, probs.device))


def _top_logprobs(
    logprobs: Tensor, params: Sequence[SamplingParams]
) -> list[list[tuple[int, float]]]:
    k_max = min(max(p.logprobs for p in params), logprobs.shape[-1])
    values, indices = logprobs.topk(k_max, dim=-1)
    values_l, indices_l = values.tolist(), indices.tolist()
    return [
        list(zip(indices_l[i][: p.logprobs], values_l[i][: p.logprobs], strict=True))
        for i, p in enumerate(params)
    ]


def _native_draw(
    logits: Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    fallback: torch.Generator | None,
) -> SampleResult | None:
    """Sampled rows in one call (``fused.sample_rows``):
    each row's draw from its ``target_probs`` distribution by the inverse CDF of one uniform,
    and its log-probability as ``sample``'s general path makes it. None where a row needs
    that path (its maximum not finite: extreme penalties)."""
    def column(values: list, dtype: torch.dtype) -> Tensor:
        return torch.tensor(values, dtype=dtype).to(logits.device)

    vocab = logits.shape[-1]
    tokens, chosen = fused.sample_rows(
        logits, column([1.0 / p.temperature for p in params], torch.float32),
        column([min(p.top_k, vocab) if p.top_k > 0 else 0 for p in params], torch.int64),
        column([p.top_p for p in params], torch.float64),
        column([p.min_p for p in params], torch.float64),
        draw_uniforms(generators, fallback, logits.device))
    if bool((tokens < 0).any()):
        return None
    return SampleResult(tokens, chosen, None)


def sample(
    logits: Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    fallback_generator: torch.Generator | None = None,
) -> SampleResult:
    """Choose one token per row of (already penalised) logits.

    Greedy rows take argmax (ties resolve to the lowest index). Other rows draw from
    `target_probs` with their own generator, or `fallback_generator` when theirs is None, by
    the inverse CDF of one uniform each (on CPU in one native call).
    """
    if len(params) != logits.shape[0] or len(generators) != logits.shape[0]:
        raise ValueError("logits, params and generators must have the same batch size")
    logits = logits.float()
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    tokens, chosen = _pick(logits, params, sampled_rows, generators, fallback_generator)
    if any(p.logprobs > 0 for p in params):
        logprobs_all = fused.finite_logprobs(torch.log_softmax(logits, dim=-1))
        chosen = logprobs_all.gather(1, tokens.unsqueeze(1)).squeeze(1)
        return SampleResult(tokens, chosen, _top_logprobs(logprobs_all, params))
    if chosen is None:
        # logit - logsumexp avoids materialising a second [B, V] tensor.
        chosen = fused.finite_logprobs(
            logits.gather(1, tokens.unsqueeze(1)).squeeze(1) - fused.logsumexp(logits))
    return SampleResult(tokens, chosen, None)


def _pick(
    logits: Tensor,
    params: Sequence[SamplingParams],
    sampled_rows: list[int],
    generators: Sequence[torch.Generator | None],
    fallback: torch.Generator | None,
) -> tuple[Tensor, Tensor | None]:
    """Every row's token, and its log-probability where the way it was picked gives it:
    greedy rows by ``fused.greedy_logprob`` (the bits an all-greedy batch gives them), the
    others in one native call (``_native_draw``), or, where a row needs it, all through
    ``target_probs``."""
    if not sampled_rows:  # plain decode: one op on CPU
        return fused.greedy_logprob(logits)
    every = len(sampled_rows) == len(params)
    idx = torch.tensor(sampled_rows, device=logits.device)
    result = _native_draw(logits if every else logits[idx], [params[i] for i in sampled_rows],
                          [generators[i] for i in sampled_rows], fallback)
    if result is not None and every:
        return result.tokens, result.logprobs
    if result is not None:
        tokens, chosen = fused.greedy_logprob(logits)
        tokens[idx], chosen[idx] = result.tokens, result.logprobs
        return tokens, chosen
    tokens = logits.argmax(dim=-1)
    probs = target_probs(logits[idx], [params[i] for i in sampled_rows])
    tokens[idx] = draw(probs, [generators[i] for i in sampled_rows], fallback)
    return tokens, None
