"""Tests for sampling parameters, logit penalties, the sampled distribution and the draw."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from tpserve.engine.sampler import (
    apply_min_tokens,
    apply_penalties,
    make_generator,
    sample,
    target_probs,
)
from tpserve.engine.sampling_params import SamplingParams
from tpserve.layers.fused import inverse_cdf

# ---------------------------------------------------------------------------------------------
# Independent float64 reference for the sampled distribution.


def _reference_probs(logits: list[float], p: SamplingParams) -> list[float]:
    """softmax(logits / T), then top-k, top-p, min-p, renormalising after each filter."""
    if p.greedy:
        best = max(range(len(logits)), key=lambda i: (logits[i], -i))
        return [1.0 if i == best else 0.0 for i in range(len(logits))]
    peak = max(logits)
    weights = [math.exp((x - peak) / p.temperature) for x in logits]
    total = sum(weights)
    probs = {i: w / total for i, w in enumerate(weights)}
    order = sorted(probs, key=lambda i: -probs[i])
    if p.top_k > 0:
        order = order[: p.top_k]
    probs = _renorm({i: probs[i] for i in order})
    kept, mass = [], 0.0
    for i in order:  # smallest prefix whose mass reaches top_p, at least one token
        kept.append(i)
        mass += probs[i]
        if mass >= p.top_p:
            break
    probs = _renorm({i: probs[i] for i in kept})
    top = probs[kept[0]]
    probs = _renorm({i: q for i, q in probs.items() if q >= p.min_p * top})
    return [probs.get(i, 0.0) for i in range(len(logits))]


def _renorm(probs: dict[int, float]) -> dict[int, float]:
    total = sum(probs.values())
    return {i: q / total for i, q in probs.items()}


PARAM_GRID = [
    SamplingParams(),
    SamplingParams(temperature=0.0),
    SamplingParams(top_k=1),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=1.7, top_k=5),
    SamplingParams(temperature=0.8, top_p=0.7),
    SamplingParams(temperature=1.3, top_k=10, top_p=0.6),
    SamplingParams(min_p=0.2),
    SamplingParams(temperature=2.0, top_k=20, top_p=0.9, min_p=0.05),
    SamplingParams(top_p=0.01),
    # Flat distribution: top-k keeps little mass, so top-p must see renormalised survivors.
    SamplingParams(temperature=4.0, top_k=8, top_p=0.5),
]


def test_target_probs_matches_float64_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(PARAM_GRID), 64, generator=gen) * 3
    got = target_probs(logits, PARAM_GRID)
    assert got.dtype == torch.float32
    for row, p in enumerate(PARAM_GRID):
        want = torch.tensor(_reference_probs(logits[row].tolist(), p), dtype=torch.float64)
        torch.testing.assert_close(got[row].double(), want, atol=2e-6, rtol=1e-5, msg=str(p))
    # Same answer whether a row is computed alone or in a mixed batch.
    for row, p in enumerate(PARAM_GRID):
        torch.testing.assert_close(target_probs(logits[row : row + 1], [p])[0], got[row])


def test_greedy_is_argmax_with_lowest_index_ties() -> None:
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(1))
    logits[2, 7] = logits[2, 40] = logits[2].max() + 1.0  # tie: index 7 must win
    params = [SamplingParams(temperature=0.0)] * 5 + [SamplingParams(top_k=1)]
    res = sample(logits, params, [None] * 6)
    assert torch.equal(res.tokens, logits.argmax(dim=-1))
    assert res.tokens[2].item() == 7
    torch.testing.assert_close(
        res.logprobs, torch.log_softmax(logits, -1).gather(1, res.tokens[:, None]).squeeze(1)
    )
    assert res.top_logprobs is None


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1e-40),  # logits / T overflows float32: sampled as greedy
    SamplingParams(temperature=9e-6, top_p=0.5),
    SamplingParams(temperature=1.0, repetition_penalty=1e-300),  # seen logits -> +-inf
    SamplingParams(temperature=0.7, repetition_penalty=1e300, top_k=5),
])
def test_degenerate_parameters_draw_the_argmax_instead_of_failing(params: SamplingParams) -> None:
    # Found by the server's OpenAPI fuzz: torch.multinomial raised on a NaN row and the engine
    # loop, with every request in it, went down.
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4))
    logits[:, 3] += 10.0  # a clear argmax
    penalised = apply_penalties(logits, [params] * 3, [[3, 9, 11]] * 3, [[]] * 3)
    probs = target_probs(penalised, [params] * 3)
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))
    res = sample(penalised, [params] * 3, [None] * 3, make_generator(None, 7))
    assert (probs.gather(1, res.tokens[:, None]) > 0).all()  # drawn from the distribution
    assert torch.isfinite(res.logprobs).all()  # the HTTP layer must be able to encode them
    top = sample(penalised, [dataclasses.replace(params, logprobs=3)] * 3, [None] * 3,
                 make_generator(None, 7)).top_logprobs
    assert top is not None and all(math.isfinite(v) for row in top for _, v in row)
    if params.temperature < 1e-5 or torch.isnan(penalised).any() or penalised.isposinf().any():
        best = torch.nan_to_num(penalised, nan=float("-inf")).argmax(dim=-1)
        assert torch.equal(res.tokens, best)


def _frequencies(
    probs_row: torch.Tensor, params: SamplingParams, draws: int, seeded: bool
) -> torch.Tensor:
    logits = probs_row.log().expand(draws, -1).contiguous()
    if seeded:  # one generator per row exercises the per-request path
        gens = [make_generator(seed, 0) for seed in range(draws)]
        res = sample(logits, [params] * draws, gens)
    else:
        res = sample(logits, [params] * draws, [None] * draws, make_generator(None, 1234))
    return torch.bincount(res.tokens, minlength=probs_row.numel()).double() / draws


def _max_z(freq: torch.Tensor, probs: torch.Tensor, draws: int) -> float:
    """Largest deviation in standard errors; tokens with zero target mass must never occur."""
    probs = probs.double()
    assert float(freq[probs == 0].sum()) == 0.0, "drew a token outside the support"
    support = probs > 0
    se = (probs[support] * (1 - probs[support]) / draws).sqrt().clamp_min(1e-12)
    return float(((freq[support] - probs[support]).abs() / se).max())


@pytest.mark.parametrize("seeded", [False, True])
def test_sampling_frequencies_match_target_probs(seeded: bool) -> None:
    base = torch.softmax(torch.tensor([2.0, 1.6, 1.2, 1.0, 0.7, 0.3, 0.0, -0.5]), -1)
    params = SamplingParams(temperature=1.5, top_k=4, top_p=0.7)
    draws = 4000 if seeded else 40000
    target = target_probs(base.log()[None], [params])[0]
    freq = _frequencies(base, params, draws, seeded)
    assert _max_z(freq, target, draws) < 4.5
    # The same statistic rejects a plausible wrong answer (top-p skipped), so it has power.
    wrong = target_probs(base.log()[None], [SamplingParams(temperature=1.5, top_k=4)])[0]
    assert float((freq - wrong.double()).abs().max()) > 0.05


@pytest.mark.parametrize("seeded", [False, True])
def test_temperature_only_frequencies_match_target_probs(seeded: bool) -> None:
    """Rows with a temperature and no filter take the one-call native draw."""
    base = torch.softmax(torch.tensor([2.0, 1.6, 1.2, 1.0, 0.7, 0.3, 0.0, -0.5]), -1)
    params = SamplingParams(temperature=0.8)
    draws = 4000 if seeded else 40000
    target = target_probs(base.log()[None], [params])[0]
    freq = _frequencies(base, params, draws, seeded)
    assert _max_z(freq, target, draws) < 4.5
    wrong = target_probs(base.log()[None], [SamplingParams(temperature=1.0)])[0]
    assert float((freq - wrong.double()).abs().max()) > 0.03


def test_every_draw_is_the_inverse_cdf_of_one_uniform() -> None:
    """The native temperature draw and the general (filtered) path pick alike: the token where
    the row generator's next float64 uniform falls in target_probs' cumulative distribution;
    the log-probability is the model's own (untempered)."""
    logits = torch.randn(4, 5000, generator=torch.Generator().manual_seed(6)) * 3
    params = [SamplingParams(temperature=t) for t in (0.6, 1.0, 1.4, 2.0)]
    seeds = [11, 12, 13, 14]
    got = sample(logits, params, [make_generator(s, 0) for s in seeds])
    u = torch.tensor([torch.rand(1, dtype=torch.float64, generator=make_generator(s, 0)).item()
                      for s in seeds])
    assert torch.equal(got.tokens, inverse_cdf(target_probs(logits, params), u))
    torch.testing.assert_close(
        got.logprobs, torch.log_softmax(logits, -1).gather(1, got.tokens[:, None]).squeeze(1))
    filtered = [SamplingParams(temperature=p.temperature, top_p=0.9, top_k=200, min_p=0.01)
                for p in params]
    drawn = sample(logits, filtered, [make_generator(s, 0) for s in seeds])
    assert torch.equal(drawn.tokens, inverse_cdf(target_probs(logits, filtered), u))
    # Greedy rows beside sampled ones: as in an all-greedy batch, and the same draws.
    mixed = [filtered[0], SamplingParams(temperature=0.0), filtered[2], SamplingParams(top_k=1)]
    both = sample(logits, mixed, [make_generator(s, 0) for s in seeds])
    greedy = sample(logits, [SamplingParams(temperature=0.0)] * 4, [None] * 4)
    assert torch.equal(both.tokens[[1, 3]], greedy.tokens[[1, 3]])
    assert torch.equal(both.logprobs[[1, 3]], greedy.logprobs[[1, 3]])
    assert torch.equal(both.tokens[[0, 2]], drawn.tokens[[0, 2]])


def test_inverse_cdf_skips_tokens_without_mass() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0, 2.0]])
    u = torch.tensor([0.0, 0.999999], dtype=torch.float64)
    assert inverse_cdf(probs, u).tolist() == [1, 4]
    assert inverse_cdf(probs[:1], torch.tensor([0.5], dtype=torch.float64)).tolist() == [3]
    assert inverse_cdf(probs[:1], torch.tensor([0.4999], dtype=torch.float64)).tolist() == [1]


def test_same_seed_same_tokens_different_seed_differs() -> None:
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=1.0, top_p=0.95)]

    def run(seed: int) -> list[int]:
        gen = make_generator(seed, fallback_seed=0)
        return [int(sample(logits, params, [gen]).tokens[0]) for _ in range(30)]

    assert run(42) == run(42)
    assert run(42) != run(43)


def test_seeded_row_is_independent_of_batch_and_global_rng() -> None:
    logits = torch.randn(4, 500, generator=torch.Generator().manual_seed(4))
    p = SamplingParams(temperature=0.9, seed=7)
    alone = sample(logits[:1], [p], [make_generator(p.seed, 0)]).tokens[0]
    torch.manual_seed(999)
    state = torch.get_rng_state()
    batched = sample(
        logits,
        [p, SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(top_k=3)],
        [make_generator(p.seed, 0), None, None, make_generator(5, 0)],
        make_generator(None, 1),
    )
    assert batched.tokens[0] == alone
    assert torch.equal(torch.get_rng_state(), state), "sampling touched the global RNG"


def test_missing_generator_is_an_error() -> None:
    with pytest.raises(ValueError, match="no generator"):
        sample(torch.zeros(1, 4), [SamplingParams()], [None])


def test_make_generator_uses_fallback_seed() -> None:
    a = torch.rand(3, generator=make_generator(None, 11))
    b = torch.rand(3, generator=make_generator(11, 99))
    assert torch.equal(a, b)


def test_top_logprobs() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(5))
    params = [
        SamplingParams(logprobs=3),
        SamplingParams(temperature=0.0),
        SamplingParams(logprobs=5),
    ]
    res = sample(logits, params, [None] * 3, make_generator(None, 0))
    ref = torch.log_softmax(logits, -1)
    assert res.top_logprobs is not None
    assert [len(t) for t in res.top_logprobs] == [3, 0, 5]
    for row, tops in enumerate(res.top_logprobs):
        ids = [i for i, _ in tops]
        assert ids == ref[row].topk(len(ids)).indices.tolist()
        for i, lp in tops:
            assert lp == pytest.approx(float(ref[row, i]), abs=1e-6)
    torch.testing.assert_close(res.logprobs, ref.gather(1, res.tokens[:, None]).squeeze(1))


# ---------------------------------------------------------------------------------------------
# Penalties


def test_penalties_against_hand_computed_reference() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0]])
    original = logits.clone()
    params = [
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(),
    ]
    out = apply_penalties(logits, params, [torch.tensor([0, 1]), [0]], [[3, 3, 4], [3]])
    # Repetition over prompt+output {0,1,3,4}: 2->1, -1->-2, 3->1.5, -2->-4; 0.5 untouched.
    # Then output counts {3: 2, 4: 1}: 1.5 - 0.5*2 - 0.25 = 0.25; -4 - 0.5 - 0.25 = -4.75.
    torch.testing.assert_close(out[0], torch.tensor([1.0, -2.0, 0.5, 0.25, -4.75]))
    torch.testing.assert_close(out[1], original[1])
    assert torch.equal(logits, original), "input logits were modified"


def test_frequency_and_presence_ignore_prompt_tokens() -> None:
    logits = torch.zeros(1, 4)
    params = [SamplingParams(frequency_penalty=1.0, presence_penalty=-0.5)]
    out = apply_penalties(logits, params, [[0, 0, 1]], [[1, 2, 2]])
    torch.testing.assert_close(out[0], torch.tensor([0.0, -0.5, -1.5, 0.0]))


def test_logit_bias_is_added_after_the_penalties() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    params = [SamplingParams.from_dict({"presence_penalty": 1.0,
                                        "logit_bias": {"3": -2.5, "0": 100}})]
    assert params[0].logit_bias == ((0, 100.0), (3, -2.5)) and params[0].uses_penalties
    out = apply_penalties(logits, params, [[1]], [[3]])
    torch.testing.assert_close(out[0], torch.tensor([102.0, -1.0, 0.5, -0.5]))
    # -100 bans a token under greedy decoding, +100 forces one
    for bias, token in (({"3": -100}, 0), ({"1": 100}, 1)):
        biased = apply_penalties(logits, [SamplingParams.from_dict({"logit_bias": bias})],
                                 [[0]], [[]])
        assert sample(biased, [SamplingParams(temperature=0.0)],
                      [torch.Generator()]).tokens.tolist() == [token]


def test_logit_bias_parsing() -> None:
    assert SamplingParams.from_dict({"logit_bias": None}).logit_bias == ()
    assert SamplingParams.from_dict({"logit_bias": {5: 1, "2": -0.5}}).logit_bias == (
        (2, -0.5), (5, 1.0))
    with pytest.raises(ValueError, match="appears twice"):
        SamplingParams.from_dict({"logit_bias": {"7": 1.0, 7: 2.0}})
    with pytest.raises(ValueError, match="finite"):
        SamplingParams.from_dict({"logit_bias": {"7": 10**400}})
    with pytest.raises(ValueError, match="at most 1024"):
        SamplingParams.from_dict({"logit_bias": {str(i): 1.0 for i in range(1025)}})


def test_penalties_fast_path_returns_input() -> None:
    logits = torch.randn(2, 10)
    params = [SamplingParams(), SamplingParams(temperature=0.3)]
    assert apply_penalties(logits, params, [[1], [2]], [[3], [4]]) is logits


def test_min_new_tokens_bans_eos_and_stop_ids() -> None:
    logits = torch.zeros(2, 6)
    params = [
        SamplingParams(min_new_tokens=3, stop_token_ids=(4,)),
        SamplingParams(min_new_tokens=1),
    ]
    out = apply_min_tokens(logits, params, output_lens=[2, 1], eos_token_ids=[5])
    assert out[0].isinf().tolist() == [False, False, False, False, True, True]
    assert not out[1].isinf().any()
    assert not logits.isinf().any()
    assert apply_min_tokens(logits, params, output_lens=[3, 1], eos_token_ids=[5]) is logits


# ---------------------------------------------------------------------------------------------
# SamplingParams parsing and validation


def test_from_dict_accepts_sglang_shapes() -> None:
    p = SamplingParams.from_dict(
        {"temperature": 0, "stop": "###", "stop_token_ids": [1, 2], "max_new_tokens": 8}
    )
    assert p.stop == ("###",) and p.stop_token_ids == (1, 2) and p.temperature == 0.0
    assert p.greedy
    assert SamplingParams.from_dict({"stop": ["a", "b"]}).stop == ("a", "b")
    assert SamplingParams.from_dict({}) == SamplingParams()
    assert not SamplingParams().greedy


def test_from_dict_rejects_unknown_key() -> None:
    with pytest.raises(ValueError, match="unknown sampling parameter 'foo'"):
        SamplingParams.from_dict({"foo": 1})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("top_k", "5"),
        ("top_k", True),
        ("temperature", "hot"),
        ("stop", 3),
        ("stop", ["a", 1]),
        ("stop_token_ids", "1"),
        ("ignore_eos", 1),
        ("seed", 1.5),
        ("max_new_tokens", 2.0),
        ("logit_bias", [[1, 2.0]]),
        ("logit_bias", {"one": 2.0}),
        ("logit_bias", {"1.5": 2.0}),
        ("logit_bias", {"1": "2"}),
    ],
)
def test_from_dict_rejects_wrong_types(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"'{key}' must be"):
        SamplingParams.from_dict({key: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_new_tokens", -1),
        ("max_new_tokens", 10**9),
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", 0),
        ("top_k", -2),
        ("min_p", 1.5),
        ("min_p", -0.1),
        ("repetition_penalty", 0.0),
        ("frequency_penalty", 2.5),
        ("presence_penalty", -3.0),
        ("n", 0),
        ("n", 17),
        ("stop_token_ids", (100,)),
        ("stop_token_ids", (-1,)),
        ("min_new_tokens", -1),
        ("logprobs", -1),
        ("logprobs", 21),
        ("temperature", 101.0),
        ("temperature", math.inf),
        ("top_p", math.nan),
        ("repetition_penalty", math.inf),
        ("min_new_tokens", 4097),
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("stop", ("x",) * 65),
        ("stop", ("x" * 257,)),
        ("stop_token_ids", (1,) * 257),
        ("logit_bias", ((100, 1.0),)),
        ("logit_bias", ((-1, 1.0),)),
        ("logit_bias", ((3, 100.5),)),
        ("logit_bias", ((3, -101.0),)),
    ],
)
def test_validate_names_the_parameter(field: str, value: object) -> None:
    p = SamplingParams(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"'{field}'"):
        p.validate(vocab_size=100, max_new_tokens_limit=4096)


def test_validate_accepts_defaults_and_edges() -> None:
    SamplingParams().validate(vocab_size=100, max_new_tokens_limit=4096)
    SamplingParams(
        temperature=0.0,
        top_p=1.0,
        top_k=1,
        min_p=1.0,
        frequency_penalty=-2.0,
        presence_penalty=2.0,
        n=16,
        stop_token_ids=(0, 99),
        logprobs=20,
        max_new_tokens=4096,
    ).validate(vocab_size=100, max_new_tokens_limit=4096)


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("temperature", 10**400, "finite"),  # float() of this int overflows
        ("top_p", float("inf"), "finite"),
        ("stop", ["a"] * 100_000, "at most 64"),
        ("stop_token_ids", [1] * 100_000, "at most 256"),
        ("stop", {"x" * 10_000: 1}, "chars)"),  # the echoed value is cut short
    ],
)
def test_from_dict_refuses_extremes_with_a_short_message(key: str, value: object,
                                                          needle: str) -> None:
    with pytest.raises(ValueError, match=f"'{key}'") as info:
        SamplingParams.from_dict({key: value})
    assert needle in str(info.value) and len(str(info.value)) < 300


def test_top_k_beyond_the_vocabulary_samples_the_whole_vocabulary() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    whole = SamplingParams(temperature=0.9)
    vocab = dataclasses.replace(whole, top_k=50)
    assert torch.allclose(target_probs(logits, [vocab] * 3), target_probs(logits, [whole] * 3))
    for top_k in (51, 2**63, 10**400):
        huge = dataclasses.replace(whole, top_k=top_k)
        assert torch.equal(target_probs(logits, [huge] * 3), target_probs(logits, [vocab] * 3))
        a = sample(logits, [huge] * 3, [make_generator(7, 0)] * 3).tokens
        b = sample(logits, [vocab] * 3, [make_generator(7, 0)] * 3).tokens
        assert torch.equal(a, b)
    assert SamplingParams(top_k=10**400).clamped(50).top_k == 50


def test_more_top_logprobs_than_vocabulary() -> None:
    logits = torch.randn(1, 8, generator=torch.Generator().manual_seed(0))
    result = sample(logits, [SamplingParams(temperature=0, logprobs=20)], [None])
    assert result.top_logprobs is not None and len(result.top_logprobs[0]) == 8


def test_min_tokens_ignores_ids_outside_the_vocabulary() -> None:
    params = [SamplingParams(min_new_tokens=2, stop_token_ids=(3, 10**6))]
    out = apply_min_tokens(torch.zeros(1, 6), params, output_lens=[0], eos_token_ids=[99, 5])
    assert out[0].isinf().tolist() == [False, False, False, True, False, True]


EDGES = {
    "temperature": [0.0, 1e-5, 0.3, 100.0],
    "top_p": [1e-300, 0.5, 1.0],
    "top_k": [-1, 1, 3, 10**400],
    "min_p": [0.0, 0.5, 1.0],
    "repetition_penalty": [1e-300, 1.0, 100.0],
    "frequency_penalty": [-2.0, 0.0, 2.0],
    "presence_penalty": [-2.0, 2.0],
    "logprobs": [0, 20],
    "seed": [None, -(2**63), 2**63 - 17],
}


def test_no_valid_parameters_make_the_sampler_raise() -> None:
    """Random combinations of range edges (validated, then clamped as the server does)."""
    rng = torch.Generator().manual_seed(0)
    pick = random.Random(0)
    vocab = 12
    for _ in range(100):
        params = [SamplingParams(**{k: pick.choice(v) for k, v in EDGES.items()})
                  for _ in range(3)]
        for p in params:
            p.validate(vocab_size=vocab, max_new_tokens_limit=4096)
        params = [p.clamped(vocab) for p in params]
        logits = torch.randn(3, vocab, generator=rng) * pick.choice([1.0, 1e4, 1e30])
        logits = apply_penalties(logits, params, [[1, 2, 3]] * 3, [[3, 3, 4]] * 3)
        result = sample(logits, params, [make_generator(p.seed, 7) for p in params])
        assert ((result.tokens >= 0) & (result.tokens < vocab)).all()
        assert torch.isfinite(result.logprobs).all()
