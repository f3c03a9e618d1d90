"""A plan: which units stay verbatim and which clusters become summaries; applied to the request."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from flashstack.gateway.compress.clustering import Cluster
from flashstack.gateway.compress.outcome import Outcome
from flashstack.gateway.compress.units import Unit
from flashstack.gateway.core import ChatRequest, Text

SUMMARY_HEADER = (
    "Earlier parts of this conversation were compressed by the gateway to fit the model's context "
    "window. Summaries of the omitted messages, oldest first:"
)


@dataclass(slots=True)
class Plan:
    """Which units stay verbatim and which clusters become summaries, within `target` tokens."""

    target: int
    tokens_before: int
    fixed_tokens: int  # system prompt, tools, per-request overhead
    kept: list[Unit]  # verbatim, in order
    clusters: list[Cluster]  # summarized, most relevant first
    dropped: list[Unit] = field(default_factory=list)
    truncated: bool = False
    header_tokens: int = 0  # the summaries' heading in the system prompt

    def tokens_after(self) -> int:
        summaries = sum(c.tokens for c in self.clusters)
        header = self.header_tokens if self.clusters else 0
        return self.fixed_tokens + sum(u.tokens for u in self.kept) + summaries + header


def apply(req: ChatRequest, plan: Plan) -> ChatRequest:
    """The compressed request: kept messages in order, summaries appended to the system prompt."""
    messages = [m for u in plan.kept for m in req.messages[u.start : u.end]]
    system = list(req.system)
    if plan.clusters:
        oldest_first = sorted(plan.clusters, key=lambda c: c.units[0].start)
        system.append(Text("\n".join([SUMMARY_HEADER] + [f"- {c.summary}" for c in oldest_first])))
    return dataclasses.replace(req, messages=messages, system=system)


def outcome_of(plan: Plan) -> Outcome:
    """What the plan did, for headers and metrics."""
    summarized = sum(c.n_messages for c in plan.clusters)
    dropped = sum(u.end - u.start for u in plan.dropped)
    action: Literal["compressed", "truncated"] = "truncated" if plan.truncated else "compressed"
    sources: dict[str, int] = {}
    for c in plan.clusters:
        sources[c.source] = sources.get(c.source, 0) + 1
    return Outcome(
        action, plan.tokens_before, plan.tokens_after(), summarized, dropped, summarizers=sources
    )
