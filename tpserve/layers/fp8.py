"""Block-scaled FP8 (e4m3) weights: quantise, dequantise, and multiply without a full copy.

The checkpoint format (DeepSeek-V3, Kimi-K2): ``W`` [out, in] stored as float8_e4m3fn plus
``weight_scale_inv`` [ceil(out / bo), ceil(in / bi)] float32, one scale per (bo x bi) block,
so that ``W_real[r, c] = W_fp8[r, c] * scale_inv[r // bo, c // bi]``.

CPU: ``fp8_linear`` never materialises the full-precision weight. A few rows (decode) scale
the input by each row block's scales and multiply by that block's exact FP8 values (a table
lookup); many rows (prefill) dequantise a band of output rows at a time (about
``SCRATCH_ELEMENTS`` values) and multiply it.
CUDA: a block-scaled FP8 GEMM (``torch.nn.functional.scaled_mm`` with 1x128 activation and
128x128 weight scales: Hopper, CUDA >= 12.9) when a start-up probe shows it works on the
device, else the layer's weight is dequantised for the call.
"""

from __future__ import annotations

import functools
import logging
import math

import torch
import torch.nn.functional as F

from tpserve.layers import cpu_ops
from tpserve.layers.linear import linear

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
# Values dequantised per band: 256 Ki fp32 = 1 MiB, about one core's L2, so the band is still
# in cache when the matmul reads it.
SCRATCH_ELEMENTS = 1 << 18

Block = tuple[int, int]


def _expand(scale: torch.Tensor, rows: int, cols: int, block: Block) -> torch.Tensor:
    """Per-element scale [rows, cols] from per-block scales (partial edge blocks included)."""
    return scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


@functools.cache
def _e4m3_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The 256 e4m3 values (every one exact in bf16 and float32), indexed by bit pattern."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8)
    return codes.to(torch.float32).to(dtype).to(device)


def e4m3_values(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q's values in ``dtype``. On CPU a table lookup: torch's own float8 conversion is
    scalar there (measured 34 ms per 1.8M weights, one thread; the lookup ~1 ms)."""
    if q.device.type != "cpu":
        return q.to(dtype)
    codes = q.view(torch.uint8).reshape(-1).to(torch.int32)
    return _e4m3_table(dtype, q.device).index_select(0, codes).view(q.shape)


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: Block,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [R, C] fp8 with scale [ceil(R / bo), ceil(C / bi)] -> [R, C] ``dtype`` (the float32
    product q * scale, rounded once to ``dtype``)."""
    rows, cols = q.shape
    bo, bi = block
    w = e4m3_values(q, torch.float32)
    if rows % bo == 0 and cols % bi == 0:
        w = (w.view(rows // bo, bo, cols // bi, bi) * scale[:, None, :, None]).view(rows, cols)
    else:
        w = w * _expand(scale, rows, cols, block)
    return w.to(dtype)


def quantize(w: torch.Tensor, block: Block) -> tuple[torch.Tensor, torch.Tensor]:
    """Our own block quantiser: scale = amax / 448 per block (what DeepSeek's format holds)."""
    rows, cols = w.shape
    bo, bi = block
    nr, nc = math.ceil(rows / bo), math.ceil(cols / bi)
    padded = w.new_zeros(nr * bo, nc * bi, dtype=torch.float32)
    padded[:rows, :cols] = w.float()
    amax = padded.view(nr, bo, nc, bi).abs().amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    q = (padded.view(nr, bo, nc, bi) / scale[:, None, :, None]).view(nr * bo, nc * bi)
    return q[:rows, :cols].to(FP8).contiguous(), scale


def band_rows(in_features: int, block_rows: int) -> int:
    """Output rows dequantised per band: a multiple of the block height near the scratch size."""
    return max(block_rows, SCRATCH_ELEMENTS // max(in_features, 1) // block_rows * block_rows)


def _scaled_input_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: Block
                         ) -> torch.Tensor:
    """Few rows: per block of output rows, scale the input columns by that row block's scales
    and multiply by the exact FP8 values; the weight band is only converted, never scaled."""
    out_features, in_features = q.shape
    col_scales = scale.repeat_interleave(block[1], 1)[:, :in_features]  # [out / bo, in]
    x32 = x.float()
    y = x.new_empty(x.shape[0], out_features)
    for rb, r0 in enumerate(range(0, out_features, block[0])):
        r1 = min(out_features, r0 + block[0])
        y[:, r0:r1] = linear((x32 * col_scales[rb]).to(x.dtype), e4m3_values(q[r0:r1], x.dtype))
    return y


def fp8_linear_cpu(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: Block
                   ) -> torch.Tensor:
    """Up to one block height of rows (decode, verify): ``_scaled_input_matmul``; more rows
    (prefill): dequantise bands of whole row blocks (~``SCRATCH_ELEMENTS``) and multiply."""
    cpu_ops.load()  # linear() may call tpserve::matmul (cached after the first call)
    out_features, in_features = q.shape
    x2 = x.reshape(-1, in_features)
    if x2.shape[0] <= block[0]:
        return _scaled_input_matmul(x2, q, scale, block).view(*x.shape[:-1], out_features)
    step = band_rows(in_features, block[0])
    y = x.new_empty(*x.shape[:-1], out_features)
    for r0 in range(0, out_features, step):
        r1 = min(out_features, r0 + step)
        band = dequantize(q[r0:r1], scale[r0 // block[0]: math.ceil(r1 / block[0])], block,
                          x.dtype)
        y[..., r0:r1] = F.linear(x, band)
    return y


def _quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> fp8 [M, K] and 1x128 group scales [M, K / 128] (column-major, as cuBLAS
    wants them)."""
    m, k = x.shape
    groups = x.float().view(m, k // 128, 128)
    scale = (groups.abs().amax(-1) / FP8_MAX).clamp(min=1e-12)
    xq = (groups / scale[..., None]).view(m, k).to(FP8)
    return xq, scale.t().contiguous().t()


# Rows of x padded to a multiple of this for cuBLAS's block-scaled GEMM: on an H200
# (torch 2.11 + CUDA 13.0) it ran with 16 rows and refused (CUBLAS_STATUS_NOT_SUPPORTED) the
# odd row counts a MoE expert gets; zero rows quantise to zero and are cut off after.
ROW_MULTIPLE = 16


def _scaled_mm_blockwise(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    from torch.nn.functional import ScalingType, SwizzleType

    rows = x.shape[0]
    x = F.pad(x, (0, 0, 0, -rows % ROW_MULTIPLE))
    xq, x_scale = _quantize_activations(x)
    k_blocks = scale.shape[1]
    padded = F.pad(scale, (0, -(-k_blocks // 4) * 4 - k_blocks))  # K blocks padded to 4
    y = F.scaled_mm(xq, q.t(), x_scale, ScalingType.BlockWise1x128, padded.t(),
                    ScalingType.BlockWise128x128, SwizzleType.NO_SWIZZLE,
                    SwizzleType.NO_SWIZZLE, output_dtype=x.dtype)
    return y[:rows]


@functools.cache
def native_blockwise_gemm(device: torch.device) -> bool:
    """Whether ``scaled_mm`` with 128x128 weight blocks runs, and agrees, on ``device``."""
    if device.type != "cuda" or not hasattr(F, "scaled_mm"):
        return False
    if torch.cuda.get_device_capability(device)[0] != 9:
        return False
    try:
        g = torch.Generator(device=device).manual_seed(0)
        w = torch.randn(256, 384, device=device, generator=g)
        q, s = quantize(w, (128, 128))
        ok = True
        for rows in (16, 5):  # a padded row count too: what MoE experts get
            x = torch.randn(rows, 384, device=device, generator=g).to(torch.bfloat16)
            got = _scaled_mm_blockwise(x, q, s).float()
            ref = x.float() @ dequantize(q, s, (128, 128)).t()
            ok &= bool(((got - ref).abs().max() / ref.abs().max()) < 0.05)
    except (RuntimeError, TypeError, ValueError) as exc:
        log.info("FP8 block GEMM unavailable on %s (%s): dequantising per layer", device, exc)
        return False
    log.info("FP8 block GEMM on %s: %s", device, "scaled_mm" if ok else "disagrees; dequantise")
    return ok


def fp8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: Block
               ) -> torch.Tensor:
    """y = x W^T for a block-scaled FP8 ``W`` (q [out, in], scale [out / bo, in / bi])."""
    if x.is_cpu:
        return fp8_linear_cpu(x, q, scale, block)
    shape = x.shape
    native = (block == (128, 128) and x.dtype == torch.bfloat16 and q.shape[1] % 128 == 0
              and native_blockwise_gemm(x.device))
    y = blockwise_or_dequantised(x.reshape(-1, shape[-1]), q, scale, block, native)
    return y.reshape(*shape[:-1], q.shape[0])


def blockwise_or_dequantised(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                             block: Block, native: bool) -> torch.Tensor:
    """x [M, K] -> [M, R]: the whole 128-row blocks of ``q`` through the block-scaled GEMM
    where ``native``, the rest dequantised (all of it otherwise). An output that is not a
    multiple of 128, such as DeepSeek-V3's 576-row ``kv_a_proj_with_mqa``, then dequantises
    64 rows per call, not all 576 (several float32 copies of the whole weight per layer)."""
    main = q.shape[0] // 128 * 128 if native else 0
    if main == q.shape[0]:
        return _scaled_mm_blockwise(x, q, scale)
    tail = F.linear(x, dequantize(q[main:], scale[main // block[0]:], block, x.dtype))
    if main == 0:
        return tail
    return torch.cat([_scaled_mm_blockwise(x, q[:main], scale[: main // 128]), tail], dim=-1)
