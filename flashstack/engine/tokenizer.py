"""tokenizer.json via `tokenizers`; special tokens and chat template from tokenizer_config.json,
or all of it from a GGUF file's metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`)."""

from __future__ import annotations

import functools
import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from flashstack.engine.gguf import GGUFError, is_gguf, open_gguf

if TYPE_CHECKING:
    from flashstack.engine.gguf import GGUFCheckpoint

_SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")
# llama.cpp's token types (tokenizer.ggml.token_type)
_CONTROL, _USER_DEFINED = 3, 4


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
    """A model's tokenizer: encode/decode, special tokens, and the chat template. `path` is a model
    directory (tokenizer.json) or a GGUF file."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        if is_gguf(path):
            self._init_gguf(open_gguf(path))
        else:
            self._init_dir(path)

    def _init_dir(self, path: Path) -> None:
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(
                f"{tok_file} not found: the engine needs a fast tokenizer (tokenizer.json)"
            )
        self._tok = HFTokenizer.from_file(str(tok_file))
        cfg = _read_json(path / "tokenizer_config.json")
        self.special_tokens = {k: _token_str(cfg.get(k)) for k in _SPECIAL_NAMES}
        self.chat_template = self._load_template(path, cfg)
        self.eos_token_ids = self._eos_ids(path)

    def _init_gguf(self, ckpt: GGUFCheckpoint) -> None:
        self._tok = gguf_tokenizer(ckpt)
        tokens = ckpt.get("tokenizer.ggml.tokens")
        ids = {name: ckpt.get(f"tokenizer.ggml.{key}") for name, key in _GGUF_SPECIAL_IDS.items()}
        self.special_tokens = {name: None if i is None else tokens[i] for name, i in ids.items()}
        self.chat_template = ckpt.get("tokenizer.chat_template")
        # llama.cpp stops at the end-of-generation tokens: EOS, and end-of-turn / -message if set.
        eog = [ckpt.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        self.eos_token_ids = {i for i in eog if i is not None}

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


_GGUF_SPECIAL_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "pad_token": "padding_token_id",
    "unk_token": "unknown_token_id",
}
# Pre-tokenizer splits by `tokenizer.ggml.pre`, as transformers maps them; any other name keeps
# GPT-2's own split (the ByteLevel pre-tokenizer's regex), as transformers does.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GGUF_SPLITS = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"), _LLAMA3_SPLIT
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}


@functools.cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map, in which byte-level BPE vocabularies are spelled."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def gguf_tokenizer(ckpt: GGUFCheckpoint) -> HFTokenizer:
    """The byte-level BPE tokenizer a GGUF file describes, built as transformers builds it."""
    kind = ckpt.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(
            f"{ckpt.path}: tokenizer {kind!r} is not supported; the engine reads GGUF files with a "
            "GPT-2 byte-level BPE tokenizer (tokenizer.ggml.model = gpt2)"
        )
    tokens: list[str] = ckpt.get("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ")) for m in ckpt.get("tokenizer.ggml.merges") or []]
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    # A token written in plain text (not the byte alphabet) is respelled, as transformers does.
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(tokens)
    }
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.decoder = decoders.ByteLevel()
    split = _GGUF_SPLITS.get(ckpt.get("tokenizer.ggml.pre"))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    _add_gguf_tokens(tok, tokens, ckpt.get("tokenizer.ggml.token_type") or [], alphabet)
    _set_post_processor(tok, ckpt, tokens)
    return tok


def _add_gguf_tokens(
    tok: HFTokenizer, tokens: list[str], types: list[int], alphabet: set[str]
) -> None:
    # Control tokens stay whole and are skipped on decode; a "control" token outside the byte
    # alphabet is a llama.cpp mislabel that transformers skips too. User-defined tokens stay whole.
    control = [t for t, k in zip(tokens, types) if k == _CONTROL and set(t) <= alphabet]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    vocab = tok.get_vocab()
    user = [t for t, k in zip(tokens, types) if k == _USER_DEFINED and t in vocab]
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])


def _set_post_processor(tok: HFTokenizer, ckpt: GGUFCheckpoint, tokens: list[str]) -> None:
    """BOS / EOS around each encoded text where the file asks for them (`add_bos_token`)."""
    marks = []
    for flag, key in (("add_bos_token", "bos_token_id"), ("add_eos_token", "eos_token_id")):
        token_id = ckpt.get(f"tokenizer.ggml.{key}")
        if ckpt.get(f"tokenizer.ggml.{flag}") and token_id is not None:
            marks.append((flag, tokens[token_id], token_id))
    bos = [m for m in marks if m[0] == "add_bos_token"]
    eos = [m for m in marks if m[0] == "add_eos_token"]
    single = [m[1] for m in bos] + ["$A"] + [m[1] for m in eos]
    pair = single + [m[1] for m in bos] + ["$B:1"] + [m[1] for m in eos]
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(m[1], m[2]) for m in marks]
    )


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


def load_tokenizer(path: Path) -> Tokenizer | None:
    """The model's own tokenizer (a GGUF's vocabulary or tokenizer.json); None without one."""
    path = Path(path)
    has = open_gguf(path).has_tokenizer if is_gguf(path) else (path / "tokenizer.json").is_file()
    return Tokenizer(path) if has else None
