"""POST /v1/messages/count_tokens: Anthropic upstreams count, local models count with their
tokenizer, anything else says it cannot."""

from __future__ import annotations

import anthropic
import pytest

from flashstack.engine.tokenizer import Tokenizer
from tests.gateway.protocol import canned, samples


def _kwargs() -> dict:
    """A count_tokens call with the fields it takes (a newer one in extra_body)."""
    full = samples.anthropic_request()
    return {
        "messages": full["messages"],
        "system": full["system"],
        "tools": full["tools"],
        "tool_choice": full["tool_choice"],
        "thinking": full["thinking"],
        "extra_body": samples.FUTURE,
    }


def test_count_tokens_is_forwarded_to_anthropic_whole(clients, upstream):
    upstream["anthropic"].app.state.reply = canned.Reply(
        body={"input_tokens": 1234, "context_management": None}
    )
    direct = clients["direct"][1].messages.count_tokens(model="claude-upstream-1", **_kwargs())
    direct_body = upstream["anthropic"].requests[-1].body
    through = clients["gateway"][1].messages.count_tokens(model="claude", **_kwargs())
    sent = upstream["anthropic"].requests[-1]
    assert sent.path == "/v1/messages/count_tokens" and sent.body["model"] == "claude-upstream-1"
    assert {k: v for k, v in sent.body.items() if k != "model"} == {
        k: v for k, v in direct_body.items() if k != "model"
    }
    assert through.input_tokens == direct.input_tokens == 1234


def test_a_local_model_counts_with_its_own_tokenizer(clients, tiny_model):
    count = clients["gateway"][1].messages.count_tokens(
        model="tiny", system="Be brief.", messages=[{"role": "user", "content": "Hello there"}]
    )
    expected = Tokenizer(tiny_model).encode_chat(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    )
    assert count.input_tokens == len(expected)


def test_other_models_say_counting_is_not_available(clients):
    with pytest.raises(anthropic.BadRequestError) as e:
        clients["gateway"][1].messages.count_tokens(
            model="oai", messages=[{"role": "user", "content": "hi"}]
        )
    assert "counting is not available for model 'oai'" in str(e.value)
    with pytest.raises(anthropic.NotFoundError):
        clients["gateway"][1].messages.count_tokens(
            model="nope", messages=[{"role": "user", "content": "hi"}]
        )
