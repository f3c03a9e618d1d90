"""`make run`'s discovered OpenAI models: OpenAI itself serves the Responses API (requests pass
through whole); a server at OPENAI_BASE_URL is taken for a chat-completions one."""

from __future__ import annotations

from flashstack.gateway.routing import discovery


def test_only_openai_itself_is_taken_to_serve_responses(monkeypatch):
    # no network here
    monkeypatch.setattr(discovery, "_list_openai_models", lambda base, key, timeout: ["m1"])
    (own,) = discovery.discover_models({"OPENAI_API_KEY": "sk-1"})
    assert own.responses_api and own.api_base == discovery.OPENAI_API
    (other,) = discovery.discover_models({"OPENAI_BASE_URL": "http://127.0.0.1:9/v1"})
    assert not other.responses_api
