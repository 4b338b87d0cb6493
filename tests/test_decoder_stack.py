"""The native layer stack (``fused_decoder`` / ``decoder_stack.cpp``) against the Python layers.

Same model, same step, same starting KV cache: the stack's final-normed hidden states, the
auxiliary (EAGLE-3) inputs and the written caches must equal the Python layers' bit for bit,
for decode batches, multi-token steps, speculative tree masks, a sliding window, q/k/v and
output biases, 32/16-bit dtypes, and the two-call-per-layer tensor-parallel form (with a
recording reducer: same reductions, in the same order, of the same values).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.attention_cases import make_case
from tpserve.engine.forward_batch import ForwardBatch
from tpserve.layers import cpu_ops
from tpserve.layers.attention import cpu_native
from tpserve.layers.tp import NoComm, TPContext
from tpserve.models.config import parse_config
from tpserve.models.llama import LlamaForCausalLM

CPU = torch.device("cpu")
HEAD_DIM = 32  # the native attention's head_dim step on AVX-512 (16 takes the narrow op there)
LAYERS = 3
VOCAB = 96


def _native_or_skip() -> None:
    if cpu_ops.load().impl != "c++":
        pytest.skip(f"C++ ops not built here: {cpu_ops.load().reason}")
    native = cpu_native.load()
    if native.reason:
        pytest.skip(f"native CPU attention unavailable: {native.reason}")


class RecordingComm(NoComm):
    """A reducer that returns its input (a one-rank 'sum') and keeps a copy of each call."""

    def __init__(self) -> None:
        self.calls: list[torch.Tensor] = []

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self.calls.append(tensor.clone())
        return tensor


def _model(arch: str, dtype: torch.dtype, tp: TPContext, window: int | None = None,
           bias: bool = False, head_dim: int = HEAD_DIM) -> LlamaForCausalLM:
    raw = {"architectures": [arch], "hidden_size": 128, "head_dim": head_dim,
           "intermediate_size": 96, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": VOCAB, "attention_bias": bias,
           "mlp_bias": bias, "sliding_window": window, "rms_norm_eps": 1e-5}
    model = LlamaForCausalLM(parse_config(raw), tp, dtype, CPU, 512)
    gen = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen) * 0.3
        p.data.copy_(1 + noise if "norm" in name else noise)
    model.set_attention_backend("cpu")
    model.finish_loading()
    return model


def _step(mask: str | None, q_lens: list[int], cached: list[int], dtype: torch.dtype,
          window: int | None, tp_size: int, head_dim: int = HEAD_DIM):
    kv_heads = 2 // tp_size if tp_size <= 2 else 1
    case = make_case(7, q_lens, cached, (4 // tp_size, kv_heads), head_dim, dtype,
                     page_size=8, window=window, mask=mask)
    meta = case.metadata()
    rows = int(np.sum(q_lens))
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (rows,), generator=gen)
    starts = np.asarray(case.kv_lens) - np.asarray(q_lens)
    positions = torch.from_numpy(np.concatenate(
        [s + np.arange(q) for s, q in zip(starts, q_lens, strict=True)]).astype(np.int64))
    uniform = q_lens[0] if len(set(q_lens)) == 1 else 0
    kv = [(case.k_cache * (i + 1), case.v_cache * (i + 1)) for i in range(LAYERS)]
    return ForwardBatch(ids, positions, meta, uniform), kv


def _run(model: LlamaForCausalLM, fb: ForwardBatch, kv, aux: tuple[int, ...], fused: bool):
    caches = [(k.clone(), v.clone()) for k, v in kv]
    stack = model.stack
    if not fused:
        model.stack = None
    try:
        with torch.inference_mode():
            hidden, aux_out = model(fb, caches, aux)
    finally:
        model.stack = stack
    return hidden, aux_out, caches


def _assert_same(fused, python) -> None:
    h1, a1, c1 = fused
    h2, a2, c2 = python
    assert torch.equal(h1, h2)
    assert len(a1) == len(a2) and all(torch.equal(x, y) for x, y in zip(a1, a2, strict=True))
    for (k1, v1), (k2, v2) in zip(c1, c2, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


CASES = [
    # (name, q_lens, cached, mask, window)
    ("decode", [1, 1, 1], [5, 17, 0], None, None),
    ("one", [1], [40], None, None),
    ("mixed", [4, 1, 3], [9, 30, 0], None, None),
    ("tree", [5, 5], [11, 3], "tree", None),
    ("window", [2, 1], [37, 20], None, 7),
]


@pytest.mark.parametrize("head_dim", [HEAD_DIM, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("name,q_lens,cached,mask,window", CASES)
def test_stack_equals_python_layers(name: str, q_lens: list[int], cached: list[int],
                                    mask: str | None, window: int | None,
                                    dtype: torch.dtype, head_dim: int) -> None:
    """head_dim 16 runs tpserve::paged_attention_narrow on AVX-512 machines (the demo's)."""
    _native_or_skip()
    arch = "MistralForCausalLM" if window else "LlamaForCausalLM"
    model = _model(arch, dtype, TPContext.single(), window, head_dim=head_dim)
    assert model.stack is not None, model.stack_reason
    assert model.stack.narrow == (cpu_native.load().lanes == 16 and head_dim == 16)
    fb, kv = _step(mask, q_lens, cached, dtype, window, 1, head_dim)
    _assert_same(_run(model, fb, kv, (), True), _run(model, fb, kv, (), False))


@pytest.mark.parametrize("aux", [(0, 2, 3), (1,), (3,), (2, 1), (1, LAYERS), (0, 0)])
def test_stack_returns_the_aux_inputs(aux: tuple[int, ...]) -> None:
    _native_or_skip()
    model = _model("LlamaForCausalLM", torch.bfloat16, TPContext.single())
    fb, kv = _step("tree", [4, 4], [6, 13], torch.bfloat16, None, 1)
    fused = _run(model, fb, kv, aux, True)
    assert len(fused[1]) == len(set(aux))
    _assert_same(fused, _run(model, fb, kv, aux, False))


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "LlamaForCausalLM"])
def test_stack_with_biases(arch: str) -> None:
    """Qwen2's q/k/v bias; Llama's attention_bias + mlp_bias give o and down biases too."""
    _native_or_skip()
    model = _model(arch, torch.bfloat16, TPContext.single(), bias=True)
    assert model.layers[0].self_attn.qkv_proj.bias is not None
    fb, kv = _step(None, [1, 2], [8, 3], torch.bfloat16, None, 1)
    _assert_same(_run(model, fb, kv, (), True), _run(model, fb, kv, (), False))


@pytest.mark.parametrize("bias", [False, True])
def test_tensor_parallel_form_reduces_like_the_python_layers(bias: bool) -> None:
    """Rank 0 of 2: two native calls a layer around this rank's reductions; row biases are
    added once, after each reduction, as RowParallelLinear does."""
    _native_or_skip()
    comms = [RecordingComm(), RecordingComm()]
    outs = []
    for comm, fused in zip(comms, (True, False), strict=True):
        model = _model("LlamaForCausalLM", torch.bfloat16, TPContext(0, 2, comm), bias=bias)
        fb, kv = _step(None, [1, 3], [12, 2], torch.bfloat16, None, 2)
        outs.append(_run(model, fb, kv, (1, 3, LAYERS), fused))
    _assert_same(*outs)
    # two per layer (o and down) and the vocab-parallel embedding's one
    assert len(comms[0].calls) == len(comms[1].calls) == 2 * LAYERS + 1
    assert all(torch.equal(a, b) for a, b in zip(comms[0].calls, comms[1].calls, strict=True))


def test_stack_applies_only_where_it_can() -> None:
    _native_or_skip()
    model = _model("LlamaForCausalLM", torch.bfloat16, TPContext.single())
    model.set_attention_backend("torch")
    assert model.stack is None and "attention" in model.stack_reason
    qwen3 = _model("Qwen3ForCausalLM", torch.bfloat16, TPContext.single())
    assert qwen3.stack is None and "norm" in qwen3.stack_reason
    model = _model("LlamaForCausalLM", torch.bfloat16, TPContext.single())
    assert model.stack.fits(torch.zeros(1, dtype=torch.long))


def test_a_decode_forward_goes_through_the_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    """With default settings a decode-shaped forward takes the native stack (the engine-level
    checks: test_model_vs_hf's native-stack test and the server's ``layer_stack`` info)."""
    _native_or_skip()
    from tpserve.layers import fused_decoder

    model = _model("LlamaForCausalLM", torch.bfloat16, TPContext.single())
    calls = []
    real = fused_decoder.DecoderStack.run

    def counting(self, *args):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(self, *args)

    monkeypatch.setattr(fused_decoder.DecoderStack, "run", counting)
    fb, kv = _step(None, [1], [20], torch.bfloat16, None, 1)
    _run(model, fb, kv, (), True)
    assert calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("name,q_lens,cached,mask,window", CASES[:3])
def test_native_head_equals_norm_then_logits(name: str, q_lens: list[int], cached: list[int],
                                             mask: str | None, window: int | None,
                                             dtype: torch.dtype) -> None:
    """forward_logits (stack + tpserve::decoder_head) gives forward's hidden and logits' logits,
    bit for bit, and writes the same KV."""
    _native_or_skip()
    model = _model("LlamaForCausalLM", dtype, TPContext.single())
    fb, kv = _step(mask, q_lens, cached, dtype, window, 1)
    one = [(k.clone(), v.clone()) for k, v in kv]
    two = [(k.clone(), v.clone()) for k, v in kv]
    with torch.inference_mode():
        fused = model.forward_logits(fb, one)
        hidden, _ = model(fb, two)
        logits = model.logits(hidden)
    assert fused is not None
    assert fused[0].dtype == torch.float32 and fused[0].shape == (sum(q_lens), VOCAB)
    assert torch.equal(fused[0], logits) and torch.equal(fused[1], hidden)
    for (k1, v1), (k2, v2) in zip(one, two, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_native_head_only_for_one_rank_and_the_plain_head() -> None:
    """None (the caller runs forward and logits) at TP > 1, for a head that is not the plain
    one, and for steps the stack does not take."""
    _native_or_skip()
    fb, kv = _step(None, [1], [20], torch.bfloat16, None, 1)
    model = _model("LlamaForCausalLM", torch.bfloat16, TPContext.single())
    assert model.forward_logits(fb, kv) is not None

    class Scaled(LlamaForCausalLM):
        def logits(self, hidden: torch.Tensor) -> torch.Tensor:
            return 2 * super().logits(hidden)

    scaled = Scaled(model.cfg, TPContext.single(), torch.bfloat16, CPU, 512)
    assert scaled.forward_logits(fb, kv) is None
    model.stack = None
    assert model.forward_logits(fb, kv) is None
    tp2 = _model("LlamaForCausalLM", torch.bfloat16, TPContext(0, 2, RecordingComm()))
    assert tp2.forward_logits(*_step(None, [1], [20], torch.bfloat16, None, 2)) is None


@pytest.mark.parametrize("hidden", [64, 128])  # head_dim 16 (narrow op on AVX-512) and 32
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mask", [None, "draft"])
def test_draft_blocks_equal_the_python_midlayer(tmp_path, hidden: int, dtype: torch.dtype,
                                                mask: str | None) -> None:
    """The EAGLE-3 draft's midlayer as native calls: same output bits and KV writes as its
    Python layer, for a draft extend (causal) and a beam step (draft mask)."""
    _native_or_skip()
    from tests.checkpoints import make_checkpoint
    from tests.eagle_checkpoints import make_draft
    from tpserve.models.eagle3 import build_eagle3, load_eagle3_config

    target = make_checkpoint(tmp_path / "t", "llama", hidden=hidden, layers=4, vocab=VOCAB)
    draft_dir = make_draft(tmp_path / "d", target)
    cfg = load_eagle3_config(draft_dir)
    draft = build_eagle3(draft_dir, cfg, TPContext.single(), dtype, CPU, 256)
    assert draft.blocks is not None, draft.blocks_reason
    head_dim = draft.self_attn.head_dim
    q_lens, cached = ([3, 1], [9, 4]) if mask is None else ([2, 2], [6, 11])
    case = make_case(11, q_lens, cached, (draft.self_attn.heads, draft.self_attn.kv_heads),
                     head_dim, dtype, page_size=8, mask=mask, draft_step=1 if mask else 0)
    rows = sum(q_lens)
    gen = torch.Generator().manual_seed(4)
    embeds = torch.randn(rows, hidden, generator=gen).to(dtype)
    feats = torch.randn(rows, hidden, generator=gen).to(dtype)
    starts = np.asarray(case.kv_lens) - np.asarray(q_lens)
    positions = torch.from_numpy(np.concatenate(
        [s + np.arange(q) for s, q in zip(starts, q_lens, strict=True)]).astype(np.int64))
    fb = ForwardBatch(torch.zeros(rows, dtype=torch.long), positions, case.metadata(), 0)
    outs = []
    for native in (True, False):
        cache = case.caches()
        blocks = draft.blocks
        draft.blocks = blocks if native else None
        try:
            with torch.inference_mode():
                outs.append((draft(embeds, feats, fb, cache), cache))
        finally:
            draft.blocks = blocks
    (o1, (k1, v1)), (o2, (k2, v2)) = outs
    assert torch.equal(o1, o2) and torch.equal(k1, k2) and torch.equal(v1, v2)
