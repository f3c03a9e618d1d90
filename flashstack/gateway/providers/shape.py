"""Shape checks of upstream success bodies, before a translator reads them.

The translators read leniently (a missing field becomes its default), so without these an upstream
`{}` would pass as a successful empty completion. Each check names the first field that is wrong;
the caller gets a 502 that counts against the upstream.
"""

from __future__ import annotations

from typing import Any

from flashstack.gateway.providers.upstream import Upstream

_STR_OR_NONE = (str, type(None))


def openai_completion(body: Any, up: Upstream) -> dict[str, Any]:
    """A ChatCompletion: choices[0].message with string (or null) content and
    well-formed tool calls."""
    what = "a chat completion"
    obj = _object(body, up, what)
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices:
        raise up.shape_error(what, "no choices")
    choice = _object(choices[0], up, what, "choices[0]")
    msg = _object(choice.get("message"), up, what, "choices[0].message")
    _typed(msg.get("content"), _STR_OR_NONE, up, what, "message.content")
    _typed(choice.get("finish_reason"), _STR_OR_NONE, up, what, "finish_reason")
    calls = msg.get("tool_calls")
    _typed(calls, (list, type(None)), up, what, "message.tool_calls")
    for i, call in enumerate(calls or []):
        fn = _object(
            _object(call, up, what, f"tool_calls[{i}]").get("function"),
            up,
            what,
            f"tool_calls[{i}].function",
        )
        _typed(fn.get("name"), str, up, what, f"tool_calls[{i}].function.name")
        _typed(fn.get("arguments"), _STR_OR_NONE, up, what, f"tool_calls[{i}].function.arguments")
    _usage(obj, up, what)
    return obj


def anthropic_message(body: Any, up: Upstream) -> dict[str, Any]:
    """A Messages API message: a content list of typed blocks."""
    what = "a message"
    obj = _object(body, up, what)
    content = obj.get("content")
    if not isinstance(content, list):
        raise up.shape_error(what, "content is not a list")
    for i, block in enumerate(content):
        b = _object(block, up, what, f"content[{i}]")
        kind = b.get("type")
        _typed(kind, str, up, what, f"content[{i}].type")
        if kind == "text":
            _typed(b.get("text"), str, up, what, f"content[{i}].text")
        elif kind == "tool_use":
            _typed(b.get("id"), str, up, what, f"content[{i}].id")
            _typed(b.get("name"), str, up, what, f"content[{i}].name")
            _typed(b.get("input"), (dict, type(None)), up, what, f"content[{i}].input")
        elif kind == "thinking":
            _typed(b.get("thinking"), str, up, what, f"content[{i}].thinking")
    _typed(obj.get("stop_reason"), _STR_OR_NONE, up, what, "stop_reason")
    _usage(obj, up, what)
    return obj


def ollama_reply(body: Any, up: Upstream, what: str = "a reply") -> dict[str, Any]:
    """An /api/chat reply or stream line: an object whose message (when present) is an object."""
    obj = _object(body, up, what)
    msg = obj.get("message")
    if msg is None and not obj.get("done"):
        raise up.shape_error(what, "no message")
    if msg is not None:
        m = _object(msg, up, what, "message")
        _typed(m.get("content"), _STR_OR_NONE, up, what, "message.content")
        _typed(m.get("thinking"), _STR_OR_NONE, up, what, "message.thinking")
        _typed(m.get("tool_calls"), (list, type(None)), up, what, "message.tool_calls")
    return obj


def model_ids(body: Any, up: Upstream, list_key: str, id_key: str) -> list[str]:
    """The ids in a model list (`{"data": [{"id": …}]}` and its relatives)."""
    what = "a model list"
    items = _object(body, up, what).get(list_key)
    if not isinstance(items, list):
        raise up.shape_error(what, f"{list_key} is not a list")
    ids = [_object(m, up, what, list_key).get(id_key) for m in items]
    if not all(isinstance(i, str) for i in ids):
        raise up.shape_error(what, f"an entry's {id_key} is not a string")
    return ids


def _object(value: Any, up: Upstream, what: str, where: str = "the body") -> dict[str, Any]:
    if not isinstance(value, dict):
        raise up.shape_error(what, f"{where} is {_kind(value)}, not an object")
    return value


def _typed(value: Any, types: type | tuple[type, ...], up: Upstream, what: str, where: str) -> None:
    if not isinstance(value, types):
        raise up.shape_error(what, f"{where} is {_kind(value)}")


def _usage(obj: dict[str, Any], up: Upstream, what: str) -> None:
    usage = obj.get("usage")
    if usage is not None:
        for k, v in _object(usage, up, what, "usage").items():
            if k.endswith("tokens") and not isinstance(v, int | type(None)):
                raise up.shape_error(what, f"usage.{k} is {_kind(v)}")


def _kind(value: Any) -> str:
    return "missing" if value is None else f"a {type(value).__name__}"
