"""Tool calls out of a model's text, whole or as it streams: Hermes-style `<tool_call>{...}
</tool_call>` (Qwen, SmolLM2, Hermes), Llama-3's bare JSON (`{"name": ..., "parameters": ...}`,
several separated by `;`), and the JSON array that `tool_choice="required"` constrains the output
to. One incremental scanner serves both the streamed and the whole response, so the two always
agree: content is released as soon as it cannot be the start of a call, a call's name as soon as
it is closed, and its arguments character by character up to the end of their JSON value.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
# The head of a call whose name comes first: everything before the arguments' value.
_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)
PARSERS = ("hermes", "llama3_json")


@dataclass(slots=True)
class CallDelta:
    """A piece of tool call `index`: its name (first piece only) and/or more argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class Parsed:
    """A whole response: its content (None when there is none) and its tool calls."""

    content: str | None
    calls: list[dict[str, Any]] = field(default_factory=list)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _whole_call(obj: Any) -> tuple[str, str] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit the arguments already as a JSON string
        return obj["name"], args
    return obj["name"], json.dumps(args, ensure_ascii=False)


def _prefix_overlap(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolCallStream:
    """Feed the model's text as it comes; get content pieces and CallDeltas back.

    `style`: "hermes" (calls inside <tool_call> tags, content around them), "llama3_json" (the
    output is either content or calls from its first character on), "json_list" (the
    constrained output of tool_choice="required": a JSON array of {name, parameters}).
    """

    def __init__(self, style: str) -> None:
        if style not in (*PARSERS, "json_list"):
            raise ValueError(f"unknown tool call parser {style!r}; choose one of {PARSERS}")
        self.style = style
        self.text, self.pos = "", 0
        self.state = "content" if style == "hermes" else "start"
        self.index = -1
        self._depth, self._in_str, self._esc = 0, False, False

    # ---- public -------------------------------------------------------------------------------

    def feed(self, delta: str) -> tuple[str, list[CallDelta]]:
        """New content and call pieces after `delta` arrived."""
        self.text += delta
        return self._run(final=False)

    def finish(self) -> tuple[str, list[CallDelta]]:
        """What remains once the output has ended."""
        return self._run(final=True)

    # ---- the scanner --------------------------------------------------------------------------

    def _run(self, final: bool) -> tuple[str, list[CallDelta]]:
        content: list[str] = []
        calls: list[CallDelta] = []
        while True:
            step = getattr(self, f"_{self.state}")(final, content, calls)
            if not step:
                return "".join(content), calls

    def _start(self, final: bool, content: list[str], calls: list[CallDelta]) -> bool:
        # llama3_json / json_list: decide from the first characters whether calls follow.
        rest = self.text[self.pos :]
        stripped = rest.lstrip()
        if self.style == "llama3_json" and PYTHON_TAG.startswith(stripped[: len(PYTHON_TAG)]):
            if len(stripped) < len(PYTHON_TAG) and not final:
                return False
            if stripped.startswith(PYTHON_TAG):
                self.pos += len(rest) - len(stripped) + len(PYTHON_TAG)
                return True
        if not stripped:
            return False
        if self.style == "json_list":
            self.pos += len(rest) - len(stripped) + (1 if stripped[0] == "[" else 0)
            self.state = "between"
            return True
        self.state = "between" if stripped[0] == "{" else "plain"
        return True

    def _plain(self, final: bool, content: list[str], calls: list[CallDelta]) -> bool:
        content.append(self.text[self.pos :])
        self.pos = len(self.text)
        return False

    def _content(self, final: bool, content: list[str], calls: list[CallDelta]) -> bool:
        # hermes: content until a <tool_call> tag; a tail that may be the tag's start is held.
        i = self.text.find(HERMES_START, self.pos)
        if i >= 0:
            content.append(self.text[self.pos : i])
            self.pos, self.state = i + len(HERMES_START), "head"
            return True
        hold = 0 if final else _prefix_overlap(self.text[self.pos :], HERMES_START)
        content.append(self.text[self.pos : len(self.text) - hold])
        self.pos = len(self.text) - hold
        return False

    def _between(self, final: bool, content: list[str], calls: list[CallDelta]) -> bool:
        # bare JSON calls: skip separators to the next object.
        while self.pos < len(self.text) and self.text[self.pos] in " \t\r\n;,]":
            self.pos += 1
        if self.pos < len(self.text) and self.text[self.pos] == "{":
            self.state = "head"
            return True
        if self.pos < len(self.text) and self.style == "llama3_json":
            self.state = "plain"  # trailing text after the calls is content
            return True
        return False

    def _head(self, final: bool, content: list[str], calls: list[CallDelta]) -> bool:
        m = _HEAD.match(self.text, self.pos)
        if m and self.text[m.end() : m.end() + 1] == "{":
            self.index += 1
            name = json.loads(f'"{m.group(1)}"')
            calls.append(CallDelta(self.index, _call_id(), name, ""))
            self.pos, self.state = m.end(), "args"
            self._depth, self._in_str, self._esc = 0, False, False
            return True
        return self._whole(final, content, calls)

    def _whole(self, final: bool, content: list[str], calls: list[CallDelta]) -> bool:
        # The name does not come first (or the arguments are no object): wait for the whole call.
        body = self.text[self.pos :]
        end_tag = body.find(HERMES_END) if self.style == "hermes" else -1
        if self.style == "hermes" and end_tag < 0 and not final:
            return False
        candidate = body[:end_tag] if end_tag >= 0 else body
        try:
            obj, used = json.JSONDecoder().raw_decode(candidate.lstrip())
        except json.JSONDecodeError:
            if final or end_tag >= 0:  # never becomes a call: it was text after all
                content.append((HERMES_START if self.style == "hermes" else "") + body)
                self.pos, self.state = len(self.text), "plain"
            return False
        call = _whole_call(obj)
        if call is None:
            content.append(candidate)
        else:
            self.index += 1
            calls.append(CallDelta(self.index, _call_id(), call[0], call[1]))
        skipped = len(candidate) - len(candidate.lstrip())
        self.pos += (end_tag + len(HERMES_END)) if end_tag >= 0 else skipped + used
        self.state = "content" if self.style == "hermes" else "between"
        return True

    def _args(self, final: bool, content: list[str], calls: list[CallDelta]) -> bool:
        start, i = self.pos, self.pos
        done = False
        while i < len(self.text):
            c = self.text[i]
            i += 1
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == '"':
                    self._in_str = False
            elif c == '"':
                self._in_str = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    done = True
                    break
        if i > start:
            calls.append(CallDelta(self.index, arguments=self.text[start:i]))
        self.pos = i
        if done:
            self.state = "tail"
        return done

    def _tail(self, final: bool, content: list[str], calls: list[CallDelta]) -> bool:
        # After the arguments: the call object's `}` (and the closing tag for hermes).
        if self.style == "hermes":
            j = self.text.find(HERMES_END, self.pos)
            if j < 0:
                return False
            self.pos, self.state = j + len(HERMES_END), "content"
            return True
        rest = self.text[self.pos :]
        stripped = rest.lstrip()
        if not stripped:
            return False
        self.pos += len(rest) - len(stripped) + (1 if stripped[0] == "}" else 0)
        self.state = "between"
        return True


def merge(pieces: list[CallDelta]) -> list[dict[str, Any]]:
    """CallDeltas joined into OpenAI `tool_calls`."""
    calls: dict[int, dict[str, Any]] = {}
    for p in pieces:
        call = calls.setdefault(
            p.index, {"id": p.id, "type": "function", "function": {"name": p.name, "arguments": ""}}
        )
        call["function"]["arguments"] += p.arguments
    return [calls[i] for i in sorted(calls)]


def parse(text: str, style: str) -> Parsed:
    """A whole response's content and tool calls."""
    stream = ToolCallStream(style)
    c1, p1 = stream.feed(text)
    c2, p2 = stream.finish()
    content = (c1 + c2).strip()
    return Parsed(content or None, merge(p1 + p2))


def detect_parser(chat_template: str | None) -> str:
    """The parser a model's chat template implies: Llama-3's templates speak of `<|python_tag|>`
    / ipython; Hermes tags otherwise (Qwen, SmolLM2, Hermes, and our own tools prompt)."""
    t = chat_template or ""
    if HERMES_START in t:
        return "hermes"
    if PYTHON_TAG in t or "ipython" in t:
        return "llama3_json"
    return "hermes"


def template_renders_tools(chat_template: str | None) -> bool:
    """True when the chat template itself places `tools` in the prompt."""
    return bool(chat_template) and "tools" in chat_template


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """The Hermes function-calling system prompt, for a model whose template ignores `tools`."""
    sigs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You are a function calling AI model. You are provided with function signatures within "
        f"<tools></tools> XML tags.\n<tools>\n{sigs}\n</tools>\nFor each function call return a "
        "json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def with_tools_prompt(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Messages for a template that ignores tools: the tools prompt joins (or becomes) the system
    message, assistant tool calls become <tool_call> text and tool results are shown as such."""
    prompt = tools_system_prompt(tools)
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0].get('content') or ''}\n\n{prompt}".strip()
    else:
        out.insert(0, {"role": "system", "content": prompt})
    for m in out:
        for call in m.pop("tool_calls", None) or []:
            fn = call.get("function", {})
            args = fn.get("arguments", "{}")
            body = {
                "name": fn.get("name"),
                "arguments": json.loads(args) if isinstance(args, str) and args else args,
            }
            m["content"] = (
                f"{m.get('content') or ''}{HERMES_START}\n{json.dumps(body)}\n{HERMES_END}"
            )
        if m.get("role") == "tool":
            m["content"] = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
    return out


def required_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON schema of tool_choice="required": one or more calls of the given functions."""
    return {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [t["function"]["name"]]},
                        "parameters": t["function"].get("parameters") or {"type": "object"},
                    },
                    "required": ["name", "parameters"],
                }
                for t in tools
            ]
        },
    }
