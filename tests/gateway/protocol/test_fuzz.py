"""Both request schemas fuzzed (hypothesis): whatever arrives, the answer is never a 5xx, always in
the caller's error format, and always comes back (no hang)."""

from __future__ import annotations

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashstack.gateway.translate import fields
from tests.gateway.protocol import samples

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
FUZZ = settings(
    max_examples=50,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _block(types: list[str]) -> st.SearchStrategy:
    keys = st.sampled_from(
        [
            "text",
            "image_url",
            "source",
            "id",
            "name",
            "input",
            "tool_use_id",
            "content",
            "cache_control",
            "signature",
            "thinking",
            "data",
            "is_error",
            "citations",
        ]
    )
    return st.builds(
        lambda t, extra: {"type": t, **extra},
        st.sampled_from(types) | st.text(max_size=6),
        st.dictionaries(keys, JSON, max_size=3),
    )


def _content(types: list[str]) -> st.SearchStrategy:
    return st.text(max_size=20) | st.lists(_block(types), max_size=3) | JSON


def _body(
    roles: list[str], types: list[str], table: tuple[fields.Field, ...], required: dict
) -> st.SearchStrategy:
    message = st.builds(
        lambda role, content, extra: {"role": role, "content": content, **extra},
        st.sampled_from(roles) | st.text(max_size=5),
        _content(types),
        st.dictionaries(
            st.sampled_from(["name", "tool_calls", "tool_call_id", "refusal"]), JSON, max_size=2
        ),
    )
    optional = st.dictionaries(
        st.sampled_from([f.name for f in table if f.name not in ("model", "messages")]),
        JSON | st.sampled_from([f.sample for f in table if f.sample is not None]),
        max_size=5,
    )
    return st.builds(
        lambda model, messages, opt, req: {**req, **opt, "model": model, "messages": messages},
        st.sampled_from(["oai", "claude", "tiny", "nope"]),
        st.lists(message, max_size=4) | JSON,
        optional,
        st.fixed_dictionaries(required),
    )


RANDOM_OPENAI = _body(
    ["system", "developer", "user", "assistant", "tool"],
    ["text", "image_url", "refusal", "input_audio", "file"],
    fields.OPENAI_REQUEST,
    {},
)
RANDOM_ANTHROPIC = _body(
    ["user", "assistant"],
    ["text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking", "document"],
    fields.ANTHROPIC_REQUEST,
    {"max_tokens": st.integers(-1, 64) | JSON},
)


def _paths(node, at=()) -> list[tuple]:
    """Every place in a JSON value: dict keys and list indexes, depth first."""
    out = [at]
    items = (
        node.items()
        if isinstance(node, dict)
        else enumerate(node)
        if isinstance(node, list)
        else ()
    )
    for k, v in items:
        out += _paths(v, (*at, k))
    return out


def _mutate(body: dict, mutations: list) -> dict:
    for pick, op, value, key in mutations:
        path = _paths(body)[pick % len(_paths(body))]
        if not path:
            continue
        parent = body
        for k in path[:-1]:
            parent = parent[k]
        if op == "replace":
            parent[path[-1]] = value
        elif op == "delete":
            del parent[path[-1]]
        elif isinstance(parent[path[-1]], dict):
            parent[path[-1]][key] = value
    return body


MUTATIONS = st.lists(
    st.tuples(
        st.integers(0, 10**6),
        st.sampled_from(["replace", "delete", "add"]),
        JSON,
        st.text(max_size=6),
    ),
    min_size=0,
    max_size=2,
)


def _mutated(base: st.SearchStrategy) -> st.SearchStrategy:
    """A valid request (full, or minimal) on any model, with up to two random edits."""
    return st.builds(
        lambda b, model, m: _mutate({**b, "model": model}, m),
        base,
        st.sampled_from(["oai", "claude", "tiny"]),
        MUTATIONS,
    )


def _anthropic_full() -> dict:
    kwargs = samples.anthropic_request()
    return {**{k: v for k, v in kwargs.items() if k != "extra_body"}, **kwargs["extra_body"]}


MINIMAL_OPENAI = {"messages": [{"role": "user", "content": "hi"}]}
MINIMAL_ANTHROPIC = {"max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
# Mostly near-valid requests (they reach translation and the upstreams), some from scratch.
OPENAI = st.one_of(
    RANDOM_OPENAI,
    *[_mutated(st.builds(samples.openai_request) | st.builds(lambda: dict(MINIMAL_OPENAI)))] * 3,
)
ANTHROPIC = st.one_of(
    RANDOM_ANTHROPIC,
    *[_mutated(st.builds(_anthropic_full) | st.builds(lambda: dict(MINIMAL_ANTHROPIC)))] * 3,
)


def _check(r: httpx.Response, anthropic_format: bool) -> None:
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        body = r.json()
        if anthropic_format:
            assert body["type"] == "error" and body["error"]["message"]
        else:
            assert body["error"]["message"] and "type" in body["error"]


@FUZZ
@given(body=OPENAI)
def test_openai_schema_fuzzed(protocol_gateway, answered, body):
    r = httpx.post(protocol_gateway.url + "/v1/chat/completions", json=body, timeout=15)
    _check(r, anthropic_format=False)


@FUZZ
@given(body=ANTHROPIC)
def test_anthropic_schema_fuzzed(protocol_gateway, answered, body):
    r = httpx.post(protocol_gateway.url + "/v1/messages", json=body, timeout=15)
    _check(r, anthropic_format=True)


@FUZZ
@given(body=ANTHROPIC)
def test_count_tokens_fuzzed(protocol_gateway, answered, body):
    r = httpx.post(protocol_gateway.url + "/v1/messages/count_tokens", json=body, timeout=15)
    _check(r, anthropic_format=True)
