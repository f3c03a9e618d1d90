"""What compression did to one request (headers, metrics), and the 400 when it cannot fit."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from flashstack.gateway.core import ErrorKind, GatewayError

# Why a request that needed compression was truncated instead (x-flashstack-compression-fallback).
Fallback = Literal["warming-up", "unavailable", "budget"]
# Why a cluster's summary is extractive although a model summarizer is configured
# (x-flashstack-summarizer-fallback); the request is still compressed.
SummarizerFallback = Literal["warming-up", "unavailable", "budget", "error"]


def context_length_exceeded(message: str, param: str = "messages") -> GatewayError:
    """The 400 a conversation gets when even its kept part does not fit the window."""
    return GatewayError(
        ErrorKind.INVALID_REQUEST, message, param=param, code="context_length_exceeded"
    )


@dataclass(slots=True)
class Outcome:
    """What compression did to one request; becomes response headers and metrics."""

    action: Literal["none", "compressed", "truncated"]
    tokens_before: int
    tokens_after: int
    messages_summarized: int = 0
    messages_dropped: int = 0
    fallback: Fallback | None = None  # truncated although the mode was auto, and why
    # How many summaries each summarizer wrote: extractive, llm:<model>, local:<model>.
    summarizers: dict[str, int] = field(default_factory=dict)
    # A model summary replaced by an extractive one, and why.
    summarizer_fallback: SummarizerFallback | None = None

    def stamp(self, response: Any) -> Any:
        """`response` with this outcome's headers added."""
        response.headers.update(self.headers())
        return response

    def headers(self) -> dict[str, str]:
        if self.action == "none":
            return {}
        out = {
            "x-flashstack-compression": self.action,
            "x-flashstack-tokens-before": str(self.tokens_before),
            "x-flashstack-tokens-after": str(self.tokens_after),
            "x-flashstack-messages-summarized": str(self.messages_summarized),
            "x-flashstack-messages-dropped": str(self.messages_dropped),
        }
        if self.fallback is not None:
            out["x-flashstack-compression-fallback"] = self.fallback
        if self.summarizers:
            out["x-flashstack-summarizer"] = ", ".join(
                f"{k}={n}" for k, n in self.summarizers.items()
            )
        if self.summarizer_fallback is not None:
            out["x-flashstack-summarizer-fallback"] = self.summarizer_fallback
        return out
