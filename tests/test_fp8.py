"""FP8 block-scaled weights: the quantiser, the banded matmul, resident bytes, refusals.

The FP8 copy of a tiny DeepSeek-V3 checkpoint (our own block quantiser, a non-square block
with partial edge blocks) holds <= 0.55x the bytes of the bf16 model; that it gives
transformers' logits and greedy tokens on the dequantised weights at TP 1, TP 2 and TP 2
with expert parallelism is checked with the other families in ``test_moe_vs_hf.py``.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.moe_checkpoints import FP8_BLOCK, make_fp8_checkpoints
from tpserve.errors import ConfigError
from tpserve.layers import fp8
from tpserve.layers.quant import Fp8BlockWeights, resident_weight_bytes
from tpserve.layers.tp import NoComm, TPContext
from tpserve.models.config import load_config
from tpserve.models.deepseek_v3 import DeepseekV3ForCausalLM
from tpserve.models.registry import build_model

BLOCK = FP8_BLOCK


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_fp8_checkpoints(tmp_path_factory.mktemp("fp8"))


def test_quantize_dequantize_against_float64() -> None:
    torch.manual_seed(0)
    w = torch.randn(37, 21) * 3
    q, scale = fp8.quantize(w, BLOCK)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 3)
    rows = torch.arange(37)[:, None] // BLOCK[0]
    cols = torch.arange(21)[None, :] // BLOCK[1]
    ref = q.double() * scale.double()[rows, cols]
    torch.testing.assert_close(fp8.dequantize(q, scale, BLOCK).double(), ref)
    assert ((ref - w.double()).abs() <= w.abs().double() * 2**-3 + 1e-6).all()  # e4m3: 3 bits


@pytest.mark.parametrize(("out_rows", "native", "gemm_rows"), [
    (576, True, 512),  # DeepSeek-V3's kv_a_proj_with_mqa: four blocks on the GEMM, 64 rows not
    (512, True, 512),
    (576, False, 0),
    (100, True, 0),  # less than one block: dequantised
])
def test_whole_blocks_take_the_block_gemm_and_the_rest_is_dequantised(
        monkeypatch: pytest.MonkeyPatch, out_rows: int, native: bool, gemm_rows: int) -> None:
    """The GPU path's split (``blockwise_or_dequantised``), run on CPU with the block-scaled
    GEMM replaced by its float64 definition: the same product either way, and only whole
    128-row blocks (with their scale rows) reach the GEMM."""
    torch.manual_seed(2)
    q, scale = fp8.quantize(torch.randn(out_rows, 256), (128, 128))
    x = torch.randn(3, 256)
    calls: list[tuple[int, int]] = []

    def gemm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        calls.append((q.shape[0], scale.shape[0]))
        return (x.double() @ fp8.dequantize(q, scale, (128, 128)).double().t()).to(x.dtype)

    monkeypatch.setattr(fp8, "_scaled_mm_blockwise", gemm)
    got = fp8.blockwise_or_dequantised(x, q, scale, (128, 128), native)
    ref = x.double() @ fp8.dequantize(q, scale, (128, 128)).double().t()
    assert got.shape == (3, out_rows)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    assert calls == ([(gemm_rows, gemm_rows // 128)] if gemm_rows else [])


@pytest.mark.parametrize("rows", [1, 5, 40])  # scaled-input path (<= 16 rows), bands
def test_cpu_matmul_paths(monkeypatch: pytest.MonkeyPatch, rows: int) -> None:
    torch.manual_seed(1)
    q, scale = fp8.quantize(torch.randn(70, 45), BLOCK)  # partial edge blocks both ways
    x = torch.randn(rows, 45)
    ref = x.double() @ fp8.dequantize(q, scale, BLOCK).double().t()
    monkeypatch.setattr(fp8, "SCRATCH_ELEMENTS", 16 * 45)  # 16-row bands, last one partial
    assert fp8.band_rows(45, BLOCK[0]) == 16
    got = fp8.fp8_linear(x, q, scale, BLOCK).double()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    bf16 = fp8.fp8_linear(x.bfloat16(), q, scale, BLOCK).double()
    assert (bf16 - ref).abs().max() <= 0.02 * ref.abs().max()


def test_resident_bytes_and_fp8_storage(ckpts: dict[str, Path]) -> None:
    cpu = torch.device("cpu")
    dense = build_model(ckpts["src"], TPContext.single(), torch.bfloat16, cpu, 64)
    quant = build_model(ckpts["fp8"], TPContext.single(), torch.bfloat16, cpu, 64)
    ratio = resident_weight_bytes(quant) / resident_weight_bytes(dense)
    print(f"resident bytes: fp8 {resident_weight_bytes(quant)}, bf16 "
          f"{resident_weight_bytes(dense)}, ratio {ratio:.3f}")
    assert ratio <= 0.55, ratio
    experts = quant.layers[1].mlp.experts
    assert experts.w13.dtype == torch.float8_e4m3fn and experts.w13.element_size() == 1
    assert quant.layers[0].self_attn.o_proj.weight.dtype == torch.float8_e4m3fn


def test_unaligned_shard_is_refused(ckpts: dict[str, Path]) -> None:
    cfg = load_config(ckpts["fp8"])
    fmt = Fp8BlockWeights((32, 32), frozenset({"model.layers.0.self_attn.q_b_proj"}))
    with pytest.raises(ConfigError, match="q_b_proj"):  # 4 heads x 24 rows / TP 4 = 24 rows
        DeepseekV3ForCausalLM(cfg, TPContext(1, 4, NoComm()), torch.float32,
                              torch.device("cpu"), 64, weights=fmt)


@pytest.mark.parametrize("rows", [1, 5, 16, 17])
def test_block_gemm_pads_rows_for_cublas(monkeypatch: pytest.MonkeyPatch, rows: int) -> None:
    """The glue around cuBLAS's block-scaled GEMM, on CPU with a stand-in that refuses what
    an H200 refused (rows not a multiple of 16) and computes from the scales it is given."""
    seen = []

    def scaled_mm(xq, wq_t, x_scale, _a, w_scale_t, _b, _sa, _sb, output_dtype):  # noqa: ANN001
        seen.append(xq.shape[0])
        assert xq.shape[0] % 16 == 0, "CUBLAS_STATUS_NOT_SUPPORTED"
        x = xq.float().view(xq.shape[0], -1, 128) * x_scale[..., None]
        w = fp8.dequantize(wq_t.t(), w_scale_t.t()[:, : wq_t.shape[0] // 128], (128, 128))
        return (x.view(xq.shape[0], -1) @ w.t()).to(output_dtype)

    monkeypatch.setattr(torch.nn.functional, "scaled_mm", scaled_mm, raising=False)
    monkeypatch.setattr(torch.nn.functional, "ScalingType", SimpleNamespace(
        BlockWise1x128=0, BlockWise128x128=1), raising=False)
    monkeypatch.setattr(torch.nn.functional, "SwizzleType", SimpleNamespace(NO_SWIZZLE=0),
                        raising=False)
    torch.manual_seed(0)
    q, scale = fp8.quantize(torch.randn(256, 384), (128, 128))
    x = torch.randn(rows, 384, dtype=torch.bfloat16)
    got = fp8._scaled_mm_blockwise(x, q, scale).float()
    ref = x.float() @ fp8.dequantize(q, scale, (128, 128)).t()
    assert seen == [-(-rows // 16) * 16] and got.shape == (rows, 256)
    assert ((got - ref).abs().max() / ref.abs().max()) < 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_block_gemm() -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    q, scale = fp8.quantize(torch.randn(512, 768, device=device), (128, 128))
    for rows in (24, 1, 3, 17):  # MoE experts get any row count (cuBLAS refused odd ones)
        x = torch.randn(rows, 768, device=device, dtype=torch.bfloat16)
        ref = x.float() @ fp8.dequantize(q, scale, (128, 128)).t()
        got = fp8.fp8_linear(x, q, scale, (128, 128)).float()
        assert got.shape == (rows, 512)
        assert ((got - ref).abs().max() / ref.abs().max()) < 0.05  # activations are FP8 too
    cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    if torch.cuda.get_device_capability()[0] == 9 and cuda >= (12, 9):
        assert fp8.native_blockwise_gemm(device), "Hopper with CUDA >= 12.9 should use scaled_mm"


def test_fp8_tensor_outside_fp8_layers_is_refused(ckpts: dict[str, Path],
                                                  tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copy(ckpts["fp8"] / "config.json", tmp_path)
    tensors = load_file(str(ckpts["fp8"] / "model.safetensors"))
    q, scale = fp8.quantize(tensors["lm_head.weight"], BLOCK)
    tensors.update({"lm_head.weight": q, "lm_head.weight_scale_inv": scale})
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="lm_head"):
        build_model(tmp_path, TPContext.single(), torch.float32, torch.device("cpu"), 64)
