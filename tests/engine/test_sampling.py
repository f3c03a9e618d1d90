"""Sampling: seeded reproducibility, filters, penalties, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from flashstack.engine import SamplingParams
from flashstack.engine.sampling import apply_penalties, filter_logits, sample
from tests.engine.helpers import check_engine

PROMPTS = ["def main():", "import sys\n", "class Foo:"]


def test_same_seed_same_tokens_regardless_of_batch(tiny_llm) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    alone = tiny_llm.generate(PROMPTS[0], params)[0].token_ids
    batched = tiny_llm.generate(PROMPTS, params)
    assert batched[0].token_ids == alone
    again = tiny_llm.generate(PROMPTS[0], params)[0].token_ids
    assert again == alone


def test_different_seeds_differ(tiny_llm) -> None:
    outs = [
        tiny_llm.generate(
            PROMPTS[0], SamplingParams(temperature=1.5, seed=s, max_tokens=16, ignore_eos=True)
        )[0].token_ids
        for s in (1, 2)
    ]
    assert outs[0] != outs[1]


def test_top_k_one_is_greedy(tiny_llm) -> None:
    greedy = tiny_llm.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    )
    topk1 = tiny_llm.generate(
        PROMPTS, SamplingParams(temperature=0.9, top_k=1, seed=3, max_tokens=8, ignore_eos=True)
    )
    assert [o.token_ids for o in greedy] == [o.token_ids for o in topk1]


def test_filters_mask_exactly() -> None:
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    kept = lambda p: torch.isfinite(filter_logits(logits.clone(), p)).nonzero().flatten().tolist()  # noqa: E731
    assert kept(SamplingParams(top_k=2)) == [0, 1]
    probs = logits.softmax(-1)
    assert kept(SamplingParams(top_p=float(probs[0]) + 1e-4)) == [
        0,
        1,
    ]  # first token alone is not enough
    assert kept(SamplingParams(top_p=float(probs[0]) - 1e-4)) == [0]
    assert kept(SamplingParams(min_p=math.exp(-1.5))) == [0, 1]  # keeps p >= min_p * p_max
    assert kept(SamplingParams(top_p=1e-6)) == [0]  # the top token always survives


def test_penalties_follow_vllm_semantics() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, 1.0])
    rep = apply_penalties(logits.clone(), SamplingParams(repetition_penalty=2.0), [0], [1])
    assert rep.tolist() == [1.0, -4.0, 1.0, 1.0]
    pf = apply_penalties(
        logits.clone(), SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [2], [3, 3]
    )
    assert pf.tolist() == [2.0, -2.0, 1.0, 1.0 - 0.5 - 0.5]  # prompt tokens are not penalised


def test_repetition_penalty_changes_greedy_output(tiny_llm) -> None:
    base = tiny_llm.generate(
        "x = x + x", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    )[0]
    pen = tiny_llm.generate(
        "x = x + x",
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=5.0),
    )[0]
    assert len(set(pen.token_ids)) >= len(set(base.token_ids))
    assert pen.token_ids != base.token_ids


def test_logprobs_top_n() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    res = sample(logits, [SamplingParams(temperature=0, logprobs=2)], lambda i: ([0], []), [None])
    lp = res.logprobs[0]
    assert res.token_ids == [3] and set(lp) == {3, 2}
    assert lp[3] == pytest.approx(float(logits.log_softmax(-1)[0, 3]))


def test_engine_returns_logprobs(tiny_llm) -> None:
    out = tiny_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, logprobs=3))[0]
    assert len(out.logprobs) == len(out.token_ids)
    for tid, lp in zip(out.token_ids, out.logprobs):
        assert max(lp, key=lp.get) == tid and 3 <= len(lp) <= 4 and all(v <= 0 for v in lp.values())


def test_bad_params_are_rejected() -> None:
    for bad in (
        dict(temperature=-1),
        dict(top_p=0),
        dict(max_tokens=0),
        dict(min_p=2),
        dict(top_k=-5),
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_sampling_keeps_invariants(tiny_llm) -> None:
    tiny_llm.step_hook = check_engine
    tiny_llm.generate(
        PROMPTS,
        [
            SamplingParams(temperature=0.7, top_k=20, min_p=0.01, seed=i, max_tokens=8)
            for i in range(3)
        ],
    )
    tiny_llm.step_hook = None


def test_batched_filtering_matches_the_per_row_filter() -> None:
    from flashstack.engine.sampling import _filtered_probs

    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    params = [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=0.5, min_p=0.1),
        SamplingParams(temperature=0.9, top_k=10, top_p=0.6, min_p=0.05),
        SamplingParams(temperature=1.0, top_k=1),
    ]
    batched = _filtered_probs(logits.clone(), params)
    for i, p in enumerate(params):
        torch.testing.assert_close(batched[i], filter_logits(logits[i].clone(), p).softmax(-1))


def test_unseeded_batch_samples_follow_the_distribution() -> None:
    # Two allowed tokens with probabilities 0.25 / 0.75 after top-k: frequencies must match.
    logits = torch.full((4000, 10), -10.0)
    logits[:, 3] = 0.0
    logits[:, 7] = float(torch.log(torch.tensor(3.0)))
    params = [SamplingParams(temperature=1.0, top_k=2)] * 4000
    ids = torch.tensor(sample(logits, params, lambda i: ([0], []), [None] * 4000).token_ids)
    assert set(ids.tolist()) <= {3, 7}
    assert abs((ids == 7).float().mean().item() - 0.75) < 0.04


def test_temperature_only_rows_skip_the_filters_but_match_them() -> None:
    from flashstack.engine.sampling import _filtered_probs

    torch.manual_seed(1)
    logits = torch.randn(3, 40) * 2
    params = [SamplingParams(temperature=t) for t in (0.6, 1.0, 1.7)]
    batched = _filtered_probs(logits.clone(), params)
    for i, p in enumerate(params):
        torch.testing.assert_close(batched[i], filter_logits(logits[i].clone(), p).softmax(-1))


def test_unfiltered_samples_follow_the_distribution() -> None:
    # Temperature only (the unfiltered draw): 0.2 / 0.3 / 0.5 over three tokens, none elsewhere.
    logits = torch.full((6000, 10), float("-inf"))
    for token, weight in ((1, 0.2), (4, 0.3), (8, 0.5)):
        logits[:, token] = float(torch.log(torch.tensor(weight)))
    params = [SamplingParams(temperature=1.0)] * 6000
    ids = torch.tensor(sample(logits, params, lambda i: ([0], []), [None] * 6000).token_ids)
    assert set(ids.tolist()) <= {1, 4, 8}, "a zero-probability token was drawn"
    for token, weight in ((1, 0.2), (4, 0.3), (8, 0.5)):
        assert abs((ids == token).float().mean().item() - weight) < 0.03


def test_rows_that_all_set_top_k_filter_exactly_without_a_full_sort() -> None:
    from flashstack.engine.sampling import _filtered_probs

    torch.manual_seed(2)
    logits = torch.randn(4, 300) * 2
    params = [
        SamplingParams(temperature=0.8, top_k=40),
        SamplingParams(temperature=1.0, top_k=5, top_p=0.7),
        SamplingParams(temperature=1.2, top_k=100, min_p=0.02),
        SamplingParams(temperature=0.5, top_k=1),
    ]
    batched = _filtered_probs(logits.clone(), params)
    for i, p in enumerate(params):
        torch.testing.assert_close(batched[i], filter_logits(logits[i].clone(), p).softmax(-1))
        assert int((batched[i] > 0).sum()) <= p.top_k


def test_graph_temperatures_only_where_a_temperature_is_all_a_row_needs() -> None:
    """A decode graph draws a batch itself only when every row is greedy or sampled at a
    temperature alone; any row with a filter, a penalty or a seed of its own sends the batch to
    the sampler after the replay."""
    from flashstack.engine.sampling import graph_temperatures

    vocab = 100
    plain = [SamplingParams(temperature=0.6), SamplingParams(temperature=0), SamplingParams()]
    assert graph_temperatures(plain, vocab) == [0.6, 0.0, 1.0]
    # top_k 1 is greedy, and a top-k of the whole vocabulary filters nothing
    edge = [SamplingParams(temperature=0.9, top_k=1), SamplingParams(top_k=vocab, seed=None)]
    assert graph_temperatures(edge, vocab) == [0.0, 1.0]
    assert graph_temperatures([SamplingParams(temperature=0, seed=3)], vocab) == [0.0]
    for needs_more in (
        SamplingParams(top_k=5),
        SamplingParams(top_p=0.9),
        SamplingParams(min_p=0.1),
        SamplingParams(seed=3),
        SamplingParams(temperature=0, repetition_penalty=1.2),
        SamplingParams(presence_penalty=0.5),
    ):
        assert graph_temperatures(plain + [needs_more], vocab) is None, needs_more
