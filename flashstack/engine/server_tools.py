"""What the OpenAI server does with `tools`, `tool_choice`, `response_format` and vLLM's
`guided_*` fields: which grammar constrains the output, how the prompt shows the tools, and how
the output turns back into `tool_calls` (whole, or as streamed deltas)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from flashstack.engine.guided import GuideSpec
from flashstack.engine.tool_parsers import (
    CallDelta,
    ToolCallStream,
    _call_id,
    detect_parser,
    merge,
    parse,
    required_schema,
    template_renders_tools,
    with_tools_prompt,
)


class RequestError(ValueError):
    """Bad tools / response_format input; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _check_tools(tools: list[dict[str, Any]]) -> None:
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise RequestError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", "tools"
            )
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(f"tools[{i}].function.name must be a non-empty string", "tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise RequestError(
                f"tools[{i}].function.parameters must be a JSON schema object", "tools"
            )


@dataclass(slots=True)
class ToolPlan:
    """One chat request's tool handling. mode: none | auto | required | named."""

    mode: str
    tools: list[dict[str, Any]]
    style: str = "hermes"
    name: str | None = None

    def prompt(
        self, messages: list[dict[str, Any]], template: str | None
    ) -> tuple[list[dict[str, Any]], Any]:
        """(messages, tools for the template): a template that ignores tools gets them in a
        Hermes system prompt instead, so the model still sees them."""
        if self.mode == "none" or not self.tools:
            return messages, None
        if template_renders_tools(template):
            return messages, self.tools
        return with_tools_prompt(messages, self.tools), None

    def guide(self) -> GuideSpec | None:
        """required: a JSON array of calls; named: the function's arguments."""
        if self.mode == "required":
            return GuideSpec(json_schema=required_schema(self.tools))
        if self.mode == "named":
            fn = next(t["function"] for t in self.tools if t["function"]["name"] == self.name)
            return GuideSpec(json_schema=fn.get("parameters") or {"type": "object"})
        return None

    def stream(self) -> ToolDeltas | None:
        """The incremental parser for this request, or None when the output is plain content."""
        if self.mode in ("none",) or not self.tools:
            return None
        return ToolDeltas(self)

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """The assistant message for a whole output, and whether it holds tool calls."""
        if self.mode == "none" or not self.tools:
            return {"role": "assistant", "content": text}, False
        if self.mode == "named":
            calls = [
                {
                    "id": _call_id(),
                    "type": "function",
                    "function": {"name": self.name, "arguments": text},
                }
            ]
            return {"role": "assistant", "content": None, "tool_calls": calls}, True
        parsed = parse(text, "json_list" if self.mode == "required" else self.style)
        if not parsed.calls:
            return {"role": "assistant", "content": text}, False
        return {"role": "assistant", "content": parsed.content, "tool_calls": parsed.calls}, True


class ToolDeltas:
    """Streamed output → chat chunk deltas (`content` and/or `tool_calls` pieces)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.called = False
        self._named_started = False
        self._stream = (
            None
            if plan.mode == "named"
            else ToolCallStream("json_list" if plan.mode == "required" else plan.style)
        )

    def feed(self, text: str, final: bool) -> dict[str, Any]:
        """The chunk delta for `text` (empty dict when nothing is ready yet)."""
        if self._stream is None:
            pieces = []
            if not self._named_started:
                self._named_started = True
                pieces.append(CallDelta(0, _call_id(), self.plan.name, ""))
            if text:
                pieces.append(CallDelta(0, arguments=text))
            content = ""
        else:
            content, pieces = self._stream.feed(text)
            if final:
                c2, p2 = self._stream.finish()
                content, pieces = content + c2, pieces + p2
        if self.called and not content.strip():
            content = ""  # the whitespace between calls is no content
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if pieces:
            self.called = True
            delta["tool_calls"] = [_wire_piece(p) for p in pieces]
        return delta


def _wire_piece(p: CallDelta) -> dict[str, Any]:
    out: dict[str, Any] = {"index": p.index, "function": {"arguments": p.arguments}}
    if p.id is not None:
        out["id"], out["type"] = p.id, "function"
        out["function"]["name"] = p.name
    return out


def plan_tools(
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    template: str | None,
    parser: str | None = None,
) -> ToolPlan:
    """The request's ToolPlan; RequestError for tools or a tool_choice that do not fit."""
    tools = tools or []
    _check_tools(tools)
    style = parser or detect_parser(template)
    if tool_choice is None:
        return ToolPlan("auto" if tools else "none", tools, style)
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise RequestError(
                "tool_choice must be 'none', 'auto', 'required' or a named function, "
                f"got {tool_choice!r}",
                "tool_choice",
            )
        if tool_choice == "required" and not tools:
            raise RequestError(
                "tool_choice='required' needs at least one tool in `tools`", "tool_choice"
            )
        return ToolPlan(tool_choice, tools, style)
    name = (
        (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
    )
    if not isinstance(name, str):
        raise RequestError(
            "a named tool_choice is {'type': 'function', 'function': {'name': ...}}", "tool_choice"
        )
    if name not in {t["function"]["name"] for t in tools}:
        raise RequestError(f"tool_choice names {name!r}, which is not in `tools`", "tool_choice")
    return ToolPlan("named", tools, style, name)


def guide_spec(
    response_format: dict[str, Any] | None,
    guided_json: Any = None,
    guided_regex: str | None = None,
    guided_choice: list[str] | None = None,
) -> GuideSpec | None:
    """The grammar a request's response_format / guided_* fields ask for (at most one)."""
    specs: list[tuple[str, GuideSpec]] = []
    if response_format is not None:
        spec = _response_format(response_format)
        if spec is not None:
            specs.append(("response_format", spec))
    if guided_json is not None:
        schema = json.loads(guided_json) if isinstance(guided_json, str) else guided_json
        if not isinstance(schema, dict):
            raise RequestError("guided_json must be a JSON schema object", "guided_json")
        specs.append(("guided_json", GuideSpec(json_schema=schema)))
    if guided_regex is not None:
        specs.append(("guided_regex", GuideSpec(regex=guided_regex)))
    if guided_choice is not None:
        if not guided_choice or not all(isinstance(c, str) for c in guided_choice):
            raise RequestError("guided_choice must be a non-empty list of strings", "guided_choice")
        specs.append(("guided_choice", GuideSpec(choice=tuple(guided_choice))))
    if len(specs) > 1:
        raise RequestError(
            f"give one of response_format / guided_json / guided_regex / guided_choice, got "
            f"{[n for n, _ in specs]}",
            specs[1][0],
        )
    return specs[0][1] if specs else None


def _response_format(rf: dict[str, Any]) -> GuideSpec | None:
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GuideSpec(any_json=True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        schema = js.get("schema", js.get("schema_")) if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise RequestError(
                "response_format json_schema needs json_schema.schema, a JSON schema object",
                "response_format",
            )
        return GuideSpec(json_schema=schema)
    raise RequestError(
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        "response_format",
    )


__all__ = ["RequestError", "ToolPlan", "ToolDeltas", "plan_tools", "guide_spec", "merge"]
