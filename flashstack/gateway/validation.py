"""Request checks: JSON nesting on arrival, response_format's schema, and the model's JSON
when it is done."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson

from flashstack.gateway.compress.options import request_options
from flashstack.gateway.core import (
    ChatRequest,
    ErrorKind,
    GatewayError,
    ResponseFormat,
    ToolCall,
    invalid_request,
)

# A model's output that breaks the requested format is not the caller's fault, but it is not a
# transient upstream failure either: 422 tells SDKs not to retry and the caller what happened.
OUTPUT_STATUS = 422


# orjson writes at most 254 levels and recursive validators (jsonschema, pydantic) use several
# frames per level: nesting is refused at parse time, well below either, instead of failing as a 500
# later.
PATH_SHOWN = 6  # path components named in the error; the rest is "…"


def check_depth(value: Any, limit: int, param: str | None = None) -> None:
    """400 naming the field when `value` (parsed JSON) nests more than `limit` arrays/objects deep.

    Iterative, so any depth orjson can parse is checked without recursion: level by level over the
    containers (~90 ms per million), and only a body that fails is walked again for
    the field's path.
    """
    level = [value] if type(value) is dict or type(value) is list else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            raise _too_deep(limit, param, _deep_path(value, limit))
        below: list[Any] = []
        keep = below.append
        for node in level:
            for child in node.values() if type(node) is dict else node:
                kind = type(child)
                if kind is dict or kind is list:
                    keep(child)
        level = below


def _deep_path(value: Any, limit: int) -> list[str]:
    """The keys from `value` down to its first container more than `limit` levels deep
    (depth first)."""
    path: list[str] = []
    stack: list[Iterator[tuple[Any, Any]]] = [_items(value)]
    while stack:
        for key, child in stack[-1]:
            if isinstance(child, dict | list):
                path.append(str(key))
                if len(stack) >= limit:
                    return path
                stack.append(_items(child))
                break
        else:
            stack.pop()
            if path:
                path.pop()
    return path


def check_tool_arguments(req: ChatRequest, limit: int) -> None:
    """The same limit inside tool-call `arguments`: JSON text that translation parses
    and re-encodes."""
    for i, m in enumerate(req.messages):
        for p in m.parts:
            # str.count runs in C: only arguments with enough brackets to be too deep are parsed.
            if isinstance(p, ToolCall) and p.arguments.count("{") + p.arguments.count("[") >= limit:
                try:
                    value = orjson.loads(p.arguments)
                except orjson.JSONDecodeError:
                    continue  # not JSON at all: the translation that needs it says so
                check_depth(value, limit, f"messages.{i}.tool_calls.{p.id}.arguments")


def _items(node: dict[str, Any] | list[Any]) -> Iterator[tuple[Any, Any]]:
    return iter(node.items()) if isinstance(node, dict) else enumerate(node)


def _too_deep(limit: int, param: str | None, path: list[str]) -> GatewayError:
    shown = [param] if param else []
    shown += path[:PATH_SHOWN] + (["…"] if len(path) > PATH_SHOWN else [])
    where = ".".join(shown)
    return invalid_request(
        f"JSON nested more than {limit} levels deep at {where} (server.max_json_depth); "
        "flatten that structure",
        ".".join(([param] if param else []) + path[:PATH_SHOWN]),
    )


def check_request(req: ChatRequest) -> None:
    """Reject a bad `compression` field, and a json_schema response_format whose schema is not a
    valid JSON Schema: 400s before any session is touched."""
    request_options(req)
    rf = req.response_format
    if rf is None or rf.type != "json_schema":
        return
    import jsonschema  # on first use: most gateways never see a json_schema response_format

    try:
        jsonschema.validators.validator_for(rf.schema).check_schema(rf.schema)
    except jsonschema.SchemaError as e:
        raise invalid_request(
            f"response_format.json_schema.schema is not a valid JSON Schema: {e.message}",
            "response_format.json_schema.schema",
        ) from None
    except RecursionError:  # jsonschema recurses a dozen frames per level: ~99 nested properties
        raise invalid_request(
            "response_format.json_schema.schema nests too deeply to be checked; flatten it (or "
            "lower server.max_json_depth, so that such schemas are refused on arrival)",
            "response_format.json_schema.schema",
        ) from None


def check_output(rf: ResponseFormat | None, text: str) -> None:
    """Raise a GatewayError the client sees when `text` breaks the requested format."""
    if rf is None or rf.type == "text":
        return
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        raise _violation(f"the model's output is not valid JSON: {text[:200]!r}") from None
    if rf.type == "json_object":
        if not isinstance(value, dict):
            raise _violation("the model's output is JSON but not an object")
        return
    import jsonschema

    validator = jsonschema.validators.validator_for(rf.schema)(rf.schema)
    try:
        error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    except RecursionError:
        raise _violation(
            "the model's output nests too deeply to be checked against the schema"
        ) from None
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        raise _violation(
            f"the model's output does not match the response_format schema at {where}: "
            f"{error.message}"
        )


def _violation(message: str) -> GatewayError:
    return GatewayError(
        ErrorKind.INVALID_REQUEST, message, status=OUTPUT_STATUS, code="response_format_violation"
    )
