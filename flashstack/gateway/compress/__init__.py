"""Context-window compression: keep what the next answer needs, summarize or drop the rest.

When prompt + output reserve passes `threshold` × the model's window, messages are grouped into
units that must stay whole, a tool call with its results (units.py). The newest `keep_last_turns`
messages, pinned messages, the system prompt and tool schemas are kept; the other units are ranked
by embedding similarity (embed.py) to the latest user turn: the most relevant stay verbatim, the
rest are clustered with DBSCAN (clustering.py) and each cluster becomes one summary in the system
prompt (plan.py). Summaries are extractive (planner.py), or written by a routed model (`llm`) or by
a model on the in-process engine (`local`, local_summarizer.py) where those come in time and fit
(summaries.py). A conversation whose kept part alone does not fit gets a 400
`context_length_exceeded`. compressor.py holds the models and runs the planner off the event loop
within a budget (budget.py); a session lends its stored embeddings and summaries (memory.py).
"""

from flashstack.gateway.compress.compressor import Compressor
from flashstack.gateway.compress.memory import SessionMemory
from flashstack.gateway.compress.options import (
    MODES,
    Options,
    request_options,
    session_mode,
    shift_pinned,
)
from flashstack.gateway.compress.outcome import Outcome, context_length_exceeded
from flashstack.gateway.compress.plan import SUMMARY_HEADER

__all__ = [
    "MODES",
    "SUMMARY_HEADER",
    "Compressor",
    "Options",
    "Outcome",
    "SessionMemory",
    "context_length_exceeded",
    "request_options",
    "session_mode",
    "shift_pinned",
]
