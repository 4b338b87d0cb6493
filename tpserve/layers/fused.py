"""A decoder step's small per-token pieces as single ops: RMSNorm (after the residual add),
NeoX rotary of the fused qkv projection's q/k heads, SiLU(gate) * up, and the sampler's
greedy pick with its log-probability.

On CPU each is one ``tpserve::`` op (``fused.c`` via ``cpu_ops.cpp``), bit-equal to the torch
expression below it (except the greedy pick's log-probability, ``logsumexp`` and
``softmax``: their own exp, ``logsumexp.c``, within float rounding of it); elsewhere (CUDA, where graphs and
compile already fuse) and in ``cpu_ops``' Python fallback, the torch expression itself runs.
The references here are also what the tests compare the ops against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32, cast back, then scaled: the Hugging Face Llama reference's rounding."""
    dtype = x.dtype
    x32 = x.float()
    ms = torch.ops.tpserve.mean_square(x32)
    return weight * (x32 * torch.rsqrt(ms + eps)).to(dtype)


def add_rms_norm_reference(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + delta
    return total, rms_norm_reference(total, weight, eps)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotary: dimension i pairs with i + D/2."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def qk_heads(qkv: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, q_heads, D] and k [N, kv_heads, D] (views where possible) of a fused qkv
    projection [N, (q_heads + 2 kv_heads) * D]."""
    n, q_size = qkv.shape[0], q_heads * head_dim
    q = qkv[:, :q_size].reshape(n, q_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_heads * head_dim].reshape(n, kv_heads, head_dim)
    return q, k


def rotary_qk_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_heads: int,
                        kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = qkv.shape[0]
    q, k = qk_heads(qkv, q_heads, kv_heads, head_dim)
    cos, sin = cos.reshape(n, 1, head_dim), sin.reshape(n, 1, head_dim)
    return rotate_half(q, cos, sin), rotate_half(k, cos, sin)


def silu_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def greedy_logprob_reference(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy rows: (argmax, its log-softmax value pushed finite) of fp32 logits [B, V]."""
    tokens = logits.argmax(dim=-1)
    chosen = logits.gather(1, tokens.unsqueeze(1)).squeeze(1) - logits.logsumexp(dim=-1)
    return tokens, finite_logprobs(chosen)


def logsumexp_reference(logits: torch.Tensor) -> torch.Tensor:
    return logits.logsumexp(dim=-1)


def softmax_reference(logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits, dim=-1)


def filter_sorted(sorted_probs: torch.Tensor, top_k: torch.Tensor | None,
                  top_p: torch.Tensor | None, min_p: torch.Tensor | None) -> torch.Tensor:
    """Top-k, top-p and min-p, in that order (SGLang's), on descending-sorted probabilities
    [B, V]; returns the unnormalised mass kept. Each filter is a [B, 1] column (None: no row
    uses it): top_k (0: none; past the vocabulary: all), top_p (1: none), min_p. Each filter
    renormalises before the next looks (as HF and vLLM do), so top-p's mass is measured
    among the top-k survivors. The sampler's ``target_probs`` and ``sample_rows``' reference
    both filter here."""
    vocab = sorted_probs.shape[-1]
    ranks = torch.arange(vocab, device=sorted_probs.device).unsqueeze(0)
    probs = sorted_probs
    if top_k is not None:
        probs = probs.masked_fill(ranks >= torch.where(top_k > 0, top_k.clamp(max=vocab), vocab),
                                  0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if top_p is not None:
        # top_p == 1 rows get +inf so cumsum rounding can never drop their tail.
        limit = torch.where(top_p < 1.0, top_p, float("inf"))
        mass_before = probs.cumsum(dim=-1) - probs
        # Keep the smallest prefix whose mass reaches top_p; rank 0 always has mass_before 0.
        probs = probs.masked_fill((mass_before >= limit) & (ranks > 0), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if min_p is not None:
        probs = probs.masked_fill(probs < min_p * probs[:, :1], 0.0)
    return probs


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Row i's token: the first whose cumulative probability exceeds ``uniforms[i]`` (in
    [0, 1)) times the row's total, i.e. a draw from ``probs`` [n, V] (rows need not sum to
    exactly 1; zero-probability tokens are never chosen).

    Why not ``torch.multinomial``: for one sample it draws V exponentials (its Gumbel-style
    fast path), ~650 us a row at a 32000-token vocabulary on one thread against ~35 us for
    a cumulative sum and a search, on every sampled decode step."""
    cum = probs.double().cumsum(dim=-1)
    target = uniforms.to(device=cum.device, dtype=cum.dtype).unsqueeze(1) * cum[:, -1:]
    picks = torch.searchsorted(cum, target, right=True).squeeze(1)
    return picks.clamp_(max=probs.shape[-1] - 1)


def sample_rows_reference(logits: torch.Tensor, inv_temps: torch.Tensor, top_k: torch.Tensor,
                          top_p: torch.Tensor, min_p: torch.Tensor, uniforms: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, log-probabilities) of one draw per row from softmax(logits * inv_temps),
    filtered by top_k / top_p / min_p (``filter_sorted``, in float64), with ``uniforms`` (the
    first token whose cumulative probability exceeds u); token -1 where a row's maximum or its
    inverse temperature is not finite (the caller samples it otherwise)."""
    top = logits.max(dim=-1).values
    ok = torch.isfinite(top) & torch.isfinite(inv_temps) & (inv_temps > 0)
    scaled = (logits - top[:, None]) * inv_temps[:, None]
    probs = torch.softmax(scaled.masked_fill(~ok[:, None], 0.0), dim=-1).double()
    ordered, order = probs.sort(dim=-1, descending=True, stable=True)
    kept = filter_sorted(ordered, top_k[:, None], top_p.double()[:, None],
                         min_p.double()[:, None])
    tokens = inverse_cdf(torch.zeros_like(probs).scatter_(1, order, kept), uniforms)
    chosen = logits.gather(1, tokens[:, None]).squeeze(1) - logits.logsumexp(dim=-1)
    lowest = torch.finfo(logits.dtype).min
    return (torch.where(ok, tokens, -1),
            torch.where(ok, finite_logprobs(chosen), torch.full_like(chosen, lowest)))


def rotary_rows_reference(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return cos[positions].unsqueeze(1).to(dtype), sin[positions].unsqueeze(1).to(dtype)


def finite_logprobs(logprobs: torch.Tensor) -> torch.Tensor:
    """Log-probabilities as JSON can carry them: logits pushed to +-inf by extreme penalties
    give NaN / -inf, which become the most negative float (and +inf, impossible, 0)."""
    lowest = torch.finfo(logprobs.dtype).min
    return torch.nan_to_num(logprobs, nan=lowest, posinf=0.0, neginf=lowest)


def _native(x: torch.Tensor) -> bool:
    return x.is_cpu


def _native_defined(logits: torch.Tensor) -> bool:
    """``_native``, with the ops defined first: for ops that run outside the layers that load
    them (``sample`` alone, as in tests/test_sampler.py, found no ``tpserve::`` ops)."""
    if not logits.is_cpu:
        return False
    from tpserve.layers import cpu_ops  # it imports this module: not at the top

    cpu_ops.load()  # cached after the first call
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _native(x):
        return torch.ops.tpserve.rms_norm(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)): the residual add and the next norm in one pass."""
    if _native(x):
        return torch.ops.tpserve.add_rms_norm(x, delta, weight, eps)
    return add_rms_norm_reference(x, delta, weight, eps)


def rotary_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_heads: int,
              kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated q [N, q_heads, D] and k [N, kv_heads, D] from qkv [N, (q + 2 kv) * D]."""
    if _native(qkv):
        return torch.ops.tpserve.rotary_qk(qkv, cos, sin, q_heads, kv_heads, head_dim)
    return rotary_qk_reference(qkv, cos, sin, q_heads, kv_heads, head_dim)


def rotary_rows(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``positions`` of the fp32 cos / sin tables as [N, 1, D] of ``dtype``: one native
    call for the four ATen ops of the reference (same bits). Compiled graphs keep the
    reference, which inductor fuses."""
    if (not torch.compiler.is_compiling() and _native_defined(cos) and positions.is_cpu
            and cos.dtype == torch.float32):
        return torch.ops.tpserve.rotary_rows(cos, sin, positions, dtype)
    return rotary_rows_reference(cos, sin, positions, dtype)


def embed_rotary(ids: torch.Tensor, table: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows ``ids`` of ``table``, then ``rotary_rows`` of ``positions`` in the table's dtype):
    a step's embedding and rotary rows in one native call, same bits as the references."""
    if (not torch.compiler.is_compiling() and _native_defined(table) and ids.is_cpu
            and positions.is_cpu and cos.dtype == torch.float32):
        return torch.ops.tpserve.embed_rotary(ids, table, cos, sin, positions)
    return (F.embedding(ids, table), *rotary_rows_reference(cos, sin, positions, table.dtype))


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """SiLU of the first half of the last dimension times the second half."""
    if _native(x):
        return torch.ops.tpserve.silu_mul(x)
    return silu_mul_reference(x)


def greedy_logprob(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B] long, log-probabilities [B]) of the greedy pick from fp32 logits [B, V]."""
    if _native_defined(logits):
        return torch.ops.tpserve.greedy_logprob(logits.contiguous())
    return greedy_logprob_reference(logits)


def logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """log-sum-exp of each row of fp32 logits [B, V]: on CPU the same sum as the greedy
    pick's (``greedy_logprob``), so a request reports the same log-probability whether its
    batch was all greedy or not."""
    if _native_defined(logits):
        return torch.ops.tpserve.logsumexp(logits.contiguous())
    return logsumexp_reference(logits)


def softmax(logits: torch.Tensor) -> torch.Tensor:
    """Softmax of each row of fp32 logits [B, V] (the sampler's distribution); on CPU
    through ``logsumexp.c``'s exp, masked (-inf) tokens exactly 0."""
    if _native_defined(logits):
        return torch.ops.tpserve.softmax(logits.contiguous())
    return softmax_reference(logits)


def sample_rows(logits: torch.Tensor, inv_temps: torch.Tensor, top_k: torch.Tensor,
                top_p: torch.Tensor, min_p: torch.Tensor, uniforms: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One draw per row of fp32 logits [B, V] at temperature 1 / ``inv_temps`` [B] fp32,
    filtered by ``top_k`` [B] int64 (0: none), ``top_p`` and ``min_p`` [B] float64 (1 and 0:
    none), with ``uniforms`` [B] float64; and its log-probability under the model's
    distribution (see ``sample_rows_reference``; token -1: a row to sample another way)."""
    if _native_defined(logits):
        return torch.ops.tpserve.sample_rows(logits.contiguous(), inv_temps, top_k, top_p, min_p,
                                             uniforms)
    return sample_rows_reference(logits, inv_temps, top_k, top_p, min_p, uniforms)


def move_slots_reference(pools: list[torch.Tensor], src: list[int], dst: list[int]) -> None:
    """KV entries copied slot-wise in every layer of each pool [layers, slots, ...], every
    source read before any destination is written (``src`` and ``dst`` may overlap)."""
    if not src:
        return
    device = pools[0].device
    s, d = (torch.tensor(m, dtype=torch.long).to(device, non_blocking=True) for m in (src, dst))
    for pool in pools:
        pool.index_copy_(1, d, pool.index_select(1, s))


def define_fallbacks(lib: torch.library.Library) -> None:
    """The same ops over ATen, for ``cpu_ops``' Python fallback (no C++ compiler)."""
    lib.define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")
    lib.define("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)")
    lib.define("rotary_qk(Tensor qkv, Tensor cos, Tensor sin, int q_heads, int kv_heads, "
               "int head_dim) -> (Tensor, Tensor)")
    lib.define("silu_mul(Tensor x) -> Tensor")
    lib.define("rotary_rows(Tensor cos_table, Tensor sin_table, Tensor positions, "
               "ScalarType dtype) -> (Tensor, Tensor)")
    lib.define("greedy_logprob(Tensor logits) -> (Tensor, Tensor)")
    lib.define("logsumexp(Tensor logits) -> Tensor")
    lib.define("softmax(Tensor logits) -> Tensor")
    lib.define("sample_rows(Tensor logits, Tensor inv_temps, Tensor top_k, Tensor top_p, "
               "Tensor min_p, Tensor uniforms) -> (Tensor, Tensor)")
    lib.define("move_slots(Tensor(a!)[] pools, int[] src, int[] dst) -> ()")
    for name, fn in (("rms_norm", rms_norm_reference), ("add_rms_norm", add_rms_norm_reference),
                     ("rotary_qk", rotary_qk_reference), ("silu_mul", silu_mul_reference),
                     ("rotary_rows", rotary_rows_reference),
                     ("greedy_logprob", greedy_logprob_reference),
                     ("logsumexp", logsumexp_reference), ("softmax", softmax_reference),
                     ("sample_rows", sample_rows_reference),
                     ("move_slots", move_slots_reference)):
        lib.impl(name, fn, "CompositeExplicitAutograd")


def register_fakes() -> None:
    """Shapes for torch.compile."""
    @torch.library.register_fake("tpserve::rms_norm")
    def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.empty_like(x)

    @torch.library.register_fake("tpserve::add_rms_norm")
    def _(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
          ) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty_like(x), torch.empty_like(x)

    @torch.library.register_fake("tpserve::rotary_qk")
    def _(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_heads: int, kv_heads: int,
          head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = qkv.shape[0]
        return qkv.new_empty(n, q_heads, head_dim), qkv.new_empty(n, kv_heads, head_dim)

    @torch.library.register_fake("tpserve::greedy_logprob")
    def _(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = logits.shape[0]
        return logits.new_empty(rows, dtype=torch.long), logits.new_empty(rows)

    @torch.library.register_fake("tpserve::logsumexp")
    def _(logits: torch.Tensor) -> torch.Tensor:
        return logits.new_empty(logits.shape[0])

    @torch.library.register_fake("tpserve::softmax")
    def _(logits: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(logits)

    @torch.library.register_fake("tpserve::sample_rows")
    def _(logits: torch.Tensor, inv_temps: torch.Tensor, top_k: torch.Tensor,
          top_p: torch.Tensor, min_p: torch.Tensor, uniforms: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = logits.shape[0]
        return logits.new_empty(rows, dtype=torch.long), logits.new_empty(rows)

    @torch.library.register_fake("tpserve::rotary_rows")
    def _(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
          ) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (positions.shape[0], 1, cos.shape[1])
        return cos.new_empty(shape, dtype=dtype), sin.new_empty(shape, dtype=dtype)

    @torch.library.register_fake("tpserve::silu_mul")
    def _(x: torch.Tensor) -> torch.Tensor:
        return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)

