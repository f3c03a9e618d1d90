"""tokenizer.json via `tokenizers`; special tokens and chat template from tokenizer_config.json."""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


def _token_str(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens as strings or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers overrides jinja's tojson: no HTML escaping, unicode kept.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class Tokenizer:
    """A model directory's tokenizer: encode/decode, special tokens, and the chat template."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(
                f"{tok_file} not found: the engine needs a fast tokenizer (tokenizer.json)"
            )
        self._tok = HFTokenizer.from_file(str(tok_file))
        cfg = _read_json(path / "tokenizer_config.json")
        self.special_tokens = {
            k: _token_str(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        self.chat_template = self._load_template(path, cfg)
        self.eos_token_ids = self._eos_ids(path)

    @staticmethod
    def _load_template(path: Path, cfg: dict[str, Any]) -> str | None:
        jinja_file = path / "chat_template.jinja"  # transformers >= 4.50 saves the template here
        if jinja_file.is_file():
            return jinja_file.read_text()
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: use "default"
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default", next(iter(named.values()), None))
        return template

    def _eos_ids(self, path: Path) -> set[int]:
        ids: set[int] = set()
        for source in (
            _read_json(path / "generation_config.json"),
            _read_json(path / "config.json"),
        ):
            value = source.get("eos_token_id")
            if value is not None:
                ids.update(value if isinstance(value, list) else [value])
        eos = self.special_tokens.get("eos_token")
        if eos is not None and self._tok.token_to_id(eos) is not None:
            ids.add(self._tok.token_to_id(eos))
        return ids

    @property
    def vocab_size(self) -> int:
        """Vocabulary size including added tokens."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string, or None."""
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (special tokens per the tokenizer's post-processor)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`."""
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        return env.from_string(self.chat_template or "")

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render messages with the chat template and the variables transformers provides."""
        if not self.chat_template:
            raise ValueError(
                "this model has no chat template (tokenizer_config.json has no chat_template); "
                "use a completion prompt instead"
            )
        return self._compiled_template.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            **{k: v for k, v in self.special_tokens.items() if v is not None},
            **kwargs,
        )

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        """Chat prompt token ids; the template itself places BOS, as in transformers."""
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas without splitting multi-byte characters."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # A few prompt tokens give the decoder context (leading spaces, merges) for the first output
        # token.
        self.ids = list(prompt_ids[-5:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def step(self, new_ids: list[int]) -> str:
        """Append tokens; return the text they completed (held while a character is incomplete)."""
        self.ids.extend(new_ids)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full = decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""
