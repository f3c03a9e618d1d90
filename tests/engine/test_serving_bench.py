"""bench/engine_serving.py end to end on CPU: `engine serve` started, a burst and a capped
concurrency streamed, offline LLM.generate on the same workload, every figure filled in."""

from __future__ import annotations

import json
import math

import pytest
import torch

from bench.engine_serving import (
    Result,
    fresh_prompts,
    main,
    record_event,
    summarize,
    token_gaps,
    workload,
)


def test_serving_bench_smoke(tmp_path) -> None:
    out = tmp_path / "serving.json"
    result = main(
        [
            "--shape",
            "tiny",
            "--device",
            "cpu",
            "--num-prompts",
            "4",
            "--prompt-len",
            "8",
            "24",
            "--output-len",
            "3",
            "8",
            "--rates",
            "inf",
            "--concurrency",
            "2",
            "--max-model-len",
            "256",
            "--max-num-seqs",
            "8",
            "--compare-args",
            "chunked=--max-num-batched-tokens 16",
            "--json",
            str(out),
        ]
    )
    assert json.loads(out.read_text()) == result
    # The same tree served with an extra flag, side by side: prompts over 16 tokens are chunked.
    chunked = result["compare"]["chunked"]
    assert chunked["args"] == ["--max-num-batched-tokens", "16"]
    assert [r["completed"] for r in chunked["served"]] == [4, 4]
    assert chunked["served_over_offline"] > 0
    burst, capped = result["served"]
    # ignore_eos: both paths produce exactly the workload's output lengths
    assert burst["completed"] == 4 and burst["output_tokens"] == result["offline"]["output_tokens"]
    assert capped["max_concurrency"] == 2 and capped["completed"] == 4
    for key in ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "itl_ms_p99", "output_tok_per_s"):
        assert burst[key] > 0 and not math.isnan(burst[key]), key
    assert result["served_over_offline"] > 0


def test_client_processes_share_a_run(tmp_path) -> None:
    """Two client processes deal out a burst and a capped run between them: every request is
    answered, and the figures are of them all."""
    result = main(
        [
            *("--shape", "tiny", "--device", "cpu", "--num-prompts", "5"),
            *("--prompt-len", "8", "16", "--output-len", "3", "6", "--rates", "inf"),
            *("--concurrency", "2", "--max-model-len", "256", "--max-num-seqs", "8"),
            *("--client-processes", "2", "--skip-offline", "--json", str(tmp_path / "s.json")),
        ]
    )
    burst, capped = result["served"]
    assert burst["client_processes"] == capped["client_processes"] == 2
    assert burst["completed"] == 5 and capped["completed"] == 5 and capped["max_concurrency"] == 2
    assert burst["output_tokens"] == sum(workload(5, (8, 16), (3, 6), 2048).outputs)
    assert burst["ttft_ms_p50"] > 0 and burst["itl_ms_p50"] > 0


def test_arrivals_are_a_poisson_schedule_or_all_at_once() -> None:
    from bench.engine_serving import _arrivals

    assert _arrivals(3, math.inf, 0) == [0.0, 0.0, 0.0]
    at = _arrivals(2000, 50.0, 1)
    assert at[0] == 0.0 and all(b > a for a, b in zip(at, at[1:]))
    assert 35 < at[-1] < 45  # 2,000 arrivals at 50/s: about 40 s


def test_goodput_counts_only_requests_within_both_slos() -> None:
    fast = Result(ok=True, ttft=0.1, latency=0.5, itl=[0.1] * 4, output_tokens=5)  # tpot 0.1 s
    slow_start = Result(ok=True, ttft=2.0, latency=2.4, itl=[0.1] * 4, output_tokens=5)
    failed = Result(error="boom")
    s = summarize([fast, slow_start, failed], wall=2.0, slo_ttft=1.0, slo_tpot=0.2)
    assert s["completed"] == 2 and s["goodput_req_per_s"] == 0.5 and s["request_per_s"] == 1.0
    assert s["ttft_ms_p50"] == 100.0 and s["tpot_ms_p50"] == 100.0 and s["errors"] == ["boom"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_serving_bench_smoke_on_gpu(tmp_path) -> None:
    result = main(
        [
            "--shape",
            "tiny",
            "--device",
            "cuda",
            "--dtype",
            "bfloat16",
            "--num-prompts",
            "16",
            "--prompt-len",
            "16",
            "64",
            "--output-len",
            "8",
            "32",
            "--rates",
            "32",
            "inf",
            "--rate-seconds",
            "0.5",
            "--concurrency",
            "4",
            "--max-model-len",
            "512",
            "--gpu-memory-utilization",
            "0.3",
        ]
    )
    assert all(r["completed"] == r["requests"] for r in result["served"])
    assert result["served"][1]["output_tokens"] == result["offline"]["output_tokens"]
    assert result["served_over_offline"] > 0


def test_a_merged_event_counts_one_gap_per_token() -> None:
    r = Result()
    record_event(r, now=0.10, start=0.0, last=0.0, text=" w1 w2")  # first event: two tokens
    record_event(r, now=0.13, start=0.0, last=0.10, text=" w3 w4 w5")  # three, 30 ms later
    record_event(r, now=0.14, start=0.0, last=0.13, text=" w6")
    assert r.ttft == 0.10 and r.chunks == 3
    assert r.itl == pytest.approx([0.0, 0.01, 0.01, 0.01, 0.01])  # one per token after the first
    assert r.chunk_itl == pytest.approx([0.03, 0.01])  # vLLM's per-event ITL
    assert token_gaps(0.02, 4) == [0.005] * 4 and token_gaps(0.02, 0) == []


def test_fresh_prompts_share_no_prefix_with_the_first_run() -> None:
    work = workload(8, (20, 40), (3, 9), vocab=2048)
    fresh = fresh_prompts(work, vocab=2048, seed=1001)
    assert [len(p) for p in fresh.prompts] == [len(p) for p in work.prompts]
    assert fresh.outputs == work.outputs
    assert all(a[:16] != b[:16] for a, b in zip(work.prompts, fresh.prompts))  # no shared block
