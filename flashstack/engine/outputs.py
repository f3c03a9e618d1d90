"""What the engine hands back (RequestOutput, per-step StreamDelta) and the text/stop logic."""

from __future__ import annotations

from dataclasses import dataclass

from flashstack.engine.sequence import Sequence
from flashstack.engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(slots=True, frozen=True)
class RequestTimes:
    """A request's timeline in `time.monotonic()` seconds; None for a stage it never reached."""

    arrival: float
    first_scheduled: float | None
    first_token: float | None
    finished: float | None

    @classmethod
    def of(cls, seq: Sequence) -> RequestTimes:
        """The timeline recorded on `seq` so far."""
        return cls(
            seq.arrival_time, seq.first_scheduled_time, seq.first_token_time, seq.finished_time
        )

    @property
    def queue_time(self) -> float | None:
        """Arrival to first scheduled step."""
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def time_to_first_token(self) -> float | None:
        """Arrival to first generated token."""
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e_latency(self) -> float | None:
        """Arrival to the end."""
        return None if self.finished is None else self.finished - self.arrival

    def time_per_output_token(self, num_output_tokens: int) -> float | None:
        """Mean gap between output tokens after the first (None with fewer than two)."""
        if self.first_token is None or self.finished is None or num_output_tokens < 2:
            return None
        return (self.finished - self.first_token) / (num_output_tokens - 1)


@dataclass(slots=True)
class RequestOutput:
    """A finished (or aborted) request: all generated token ids and text."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    logprobs: list[dict[int, float]] | None = None
    num_cached_tokens: int = 0
    times: RequestTimes | None = None

    @property
    def finished(self) -> bool:
        """True once a finish reason is set."""
        return self.finish_reason is not None


@dataclass(slots=True)
class StreamDelta:
    """One engine step's news for one request; the last delta has `finish_reason` set."""

    request_id: str
    token_ids: list[int]  # tokens generated this step (usually one)
    text: str  # text that became final this step (may be "" while a stop string could still match)
    finish_reason: str | None  # None until the request ends: "stop", "length" or "abort"
    prompt_tokens: int
    completion_tokens: int  # cumulative
    logprobs: list[dict[int, float]] | None = (
        None  # per new token: {token_id: logprob}, top-N included
    )
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    times: RequestTimes | None = None  # set on the last delta only

    @property
    def finished(self) -> bool:
        """True on the request's last delta."""
        return self.finish_reason is not None


class RequestState:
    """Detokenizes a sequence's output step by step and applies stop strings exactly."""

    def __init__(self, seq: Sequence, prompt: str | None, tokenizer: Tokenizer | None) -> None:
        self.seq = seq
        self.prompt = prompt
        self.stops: list[str] = list(seq.params.stop or [])
        self.detok = (
            IncrementalDetokenizer(tokenizer, seq.prompt_token_ids, seq.params.skip_special_tokens)
            if tokenizer is not None
            else None
        )
        self.text = ""
        self.num_emitted_chars = 0
        self.num_emitted_tokens = 0
        self.num_emitted_logprobs = 0
        self.num_detok_tokens = 0
        # Streamed text holds back this many chars: they might be the start of a stop string.
        self.holdback = max((len(s) for s in self.stops), default=1) - 1

    def update_text(self) -> str | None:
        """Detokenize new tokens; return the stop string that matched (text cut before it)."""
        if self.detok is None:
            return None
        new_ids = self.seq.token_ids[self.seq.num_prompt_tokens + self.num_detok_tokens :]
        self.num_detok_tokens += len(new_ids)
        prev_len = len(self.text)
        self.text += self.detok.step(new_ids)
        for stop in self.stops:
            idx = self.text.find(stop, max(0, prev_len - len(stop) + 1))
            if idx != -1:
                keep = idx + len(stop) if self.seq.params.include_stop_str_in_output else idx
                self.text = self.text[:keep]
                return stop
        return None

    def delta(self) -> StreamDelta:
        """Everything not yet emitted, minus text that a stop string could still claim."""
        seq = self.seq
        done = seq.finish_reason is not None
        end = (
            len(self.text)
            if done or not self.stops
            else max(self.num_emitted_chars, len(self.text) - self.holdback)
        )
        text = self.text[self.num_emitted_chars : end]
        self.num_emitted_chars = end
        # Slice only the new tokens: copying the whole output every step is quadratic per request.
        new_ids = seq.token_ids[seq.num_prompt_tokens + self.num_emitted_tokens :]
        num_output = seq.num_output_tokens
        self.num_emitted_tokens = num_output
        logprobs = None
        if seq.params.logprobs is not None:
            logprobs = seq.logprobs[self.num_emitted_logprobs :]
            self.num_emitted_logprobs = len(seq.logprobs)
        return StreamDelta(
            seq.request_id,
            new_ids,
            text,
            seq.finish_reason,
            seq.num_prompt_tokens,
            num_output,
            logprobs,
            seq.stop_reason,
            seq.num_cached_tokens,
            RequestTimes.of(seq) if done else None,
        )

    def output(self) -> RequestOutput:
        """The request's final result."""
        seq = self.seq
        return RequestOutput(
            seq.request_id,
            self.prompt,
            seq.prompt_token_ids,
            seq.output_token_ids,
            self.text,
            seq.finish_reason,
            seq.stop_reason,
            seq.logprobs if seq.params.logprobs is not None else None,
            seq.num_cached_tokens,
            RequestTimes.of(seq),
        )
