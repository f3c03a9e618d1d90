"""Constrained decoding through xgrammar: a request's grammar (JSON, a JSON schema, a regex, a
choice of strings) becomes a per-step token mask applied to the logits before sampling.

The grammar is compiled once per request (`Guide`, shareable); each sequence walks it with its
own `GrammarMatcher`. The mask of every constrained row of a step is filled on the host into one
pinned bitmask (32 tokens per int32), copied to the logits' device in one asynchronous copy and
applied there by xgrammar's kernel: the sampler reads the step's tokens back anyway (a
constrained row cannot be sampled a step ahead: its next mask depends on the token just drawn),
so the mask adds no host sync of its own.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from flashstack.engine.tokenizer import Tokenizer


class GrammarError(ValueError):
    """A grammar the library cannot compile; the message names the problem."""


@dataclass(frozen=True, slots=True)
class GuideSpec:
    """What the output must match: exactly one of the fields is set."""

    json_schema: dict[str, Any] | None = None
    any_json: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None

    def describe(self) -> str:
        """The spec's kind, for error messages."""
        if self.json_schema is not None:
            return "json_schema"
        if self.any_json:
            return "json_object"
        return "guided_regex" if self.regex is not None else "guided_choice"


class Guide:
    """A compiled grammar; `matcher()` gives a fresh walker for one sequence."""

    def __init__(self, compiled: Any, spec: GuideSpec) -> None:
        self.compiled, self.spec = compiled, spec

    def matcher(self) -> Any:
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compiled)


def _choice_regex(choices: tuple[str, ...]) -> str:
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


class GrammarCompiler:
    """Compiles GuideSpecs against one tokenizer's vocabulary (cached by xgrammar)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        # xgrammar reads the vocabulary and its byte encoding from a transformers tokenizer; ours
        # is the same `tokenizers` object, wrapped.
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer._tok)
        self.info = xgr.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab_size, stop_token_ids=sorted(tokenizer.eos_token_ids)
        )
        self._compiler = xgr.GrammarCompiler(self.info)

    def compile(self, spec: GuideSpec) -> Guide:
        """The spec compiled; GrammarError naming what the library refused."""
        try:
            if spec.json_schema is not None:
                compiled = self._compiler.compile_json_schema(
                    json.dumps(spec.json_schema), any_whitespace=False
                )
            elif spec.any_json:
                compiled = self._compiler.compile_builtin_json_grammar()
            elif spec.regex is not None:
                compiled = self._compiler.compile_regex(spec.regex)
            else:
                if not spec.choice:
                    raise GrammarError("guided_choice needs at least one string")
                compiled = self._compiler.compile_regex(_choice_regex(spec.choice))
        except GrammarError:
            raise
        except (RuntimeError, ValueError, TypeError) as exc:
            # xgrammar's messages start with a C++ source location; keep the reason.
            reason = str(exc).strip().split("\n")[0]
            reason = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", reason)
            raise GrammarError(f"{spec.describe()} cannot be compiled: {reason}") from exc
        return Guide(compiled, spec)


class MaskBuffer:
    """A reusable pinned host bitmask; safe to refill each step because the sampler's read of the
    step's tokens waits for the copy out of it."""

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None

    def get(self, rows: int, vocab: int, pin: bool) -> torch.Tensor:
        words = (vocab + 31) // 32
        host = self._host
        if host is None or host.shape[0] < rows or host.shape[1] != words:
            with torch.inference_mode(False):  # a normal tensor: refilled in and out of it
                host = torch.empty((max(rows, 8), words), dtype=torch.int32, pin_memory=pin)
            self._host = host
        view = host[:rows]
        view.fill_(-1)  # all bits set: every token allowed
        return view


_BUFFER = MaskBuffer()


def apply_masks(logits: torch.Tensor, matchers: list[Any]) -> torch.Tensor:
    """A copy of `logits` [batch, vocab] with each constrained row's disallowed tokens at -inf;
    rows whose matcher is None are left as they are."""
    import xgrammar as xgr

    mask = _BUFFER.get(len(matchers), logits.shape[-1], logits.is_cuda)
    for i, m in enumerate(matchers):
        if m is not None:
            m.fill_next_token_bitmask(mask, i)
    out = logits.to(torch.float32, copy=True)  # the caller's logits stay the model's (logprobs)
    xgr.apply_token_bitmask_inplace(
        out, mask.to(logits.device, non_blocking=True), vocab_size=logits.shape[-1]
    )
    return out


def advance(matchers: list[Any], token_ids: list[int]) -> None:
    """Feed each constrained row its sampled token. A matcher that has already accepted its end
    (the grammar is complete; only the stop token remains) takes nothing more."""
    for m, t in zip(matchers, token_ids):
        if m is not None and not m.is_terminated():
            m.accept_token(t)
