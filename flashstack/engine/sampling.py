"""Sampling parameters (vLLM's names and defaults) and the batched sampler."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from flashstack.engine.staging import to_device


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop; names and defaults follow vLLM."""

    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token; 0 = only the sampled token
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Constrained decoding (flashstack.engine.guided.Guide): the output follows its grammar.
    guide: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature < 1e-5 or self.top_k == 1


@dataclass(slots=True)
class SampleResult:
    """Sampled tokens for a batch, and logprobs where requested."""

    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]
) -> torch.Tensor:
    """Repetition (prompt+output, HF style), presence and frequency (output only) penalties."""
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(
            sorted(set(prompt_ids) | set(output_ids)), device=logits.device, dtype=torch.long
        )
        if seen.numel():
            vals = logits[seen]
            logits[seen] = torch.where(
                vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty
            )
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        ids = torch.tensor(output_ids, device=logits.device, dtype=torch.long)
        counts = torch.zeros_like(logits).scatter_add_(
            0, ids, torch.ones_like(ids, dtype=logits.dtype)
        )
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(
            logits.dtype
        )
    return logits


def _has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return to_device(values, like.dtype, like.device)[:, None]


def _temperature_only(p: SamplingParams, vocab: int) -> bool:
    return (p.top_k <= 0 or p.top_k >= vocab) and p.top_p >= 1.0 and p.min_p <= 0.0


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Batched `filter_logits` then softmax: temperature, top-k, top-p, min-p, each per row."""
    logits = logits / _column([p.temperature for p in params], logits)
    vocab = logits.shape[-1]
    if all(_temperature_only(p, vocab) for p in params):
        # No sort and no scatter (at batch 256 and a 152K vocabulary, a sort of 39M values every
        # step).
        return logits.softmax(-1)
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    width = max(ks)
    top_p = any(p.top_p < 1.0 for p in params)
    min_p = any(p.min_p > 0.0 for p in params)
    if width < vocab:
        # Every row keeps at most `width` tokens: its top `width` are all the filters can look at
        # (top-p and min-p only drop more), so a top-k replaces the sort of the whole vocabulary.
        sorted_logits, order = torch.topk(logits, width, dim=-1)
    else:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    rank = torch.arange(width, device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(rank >= _column(ks, logits), float("-inf"))
    if top_p:
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p; the first token always stays.
        drop = (probs.cumsum(-1) - probs) >= _column([p.top_p for p in params], logits)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    if min_p:
        probs = sorted_logits.softmax(-1)
        floor = _column([p.min_p for p in params], logits) * probs[:, :1]
        sorted_logits = sorted_logits.masked_fill(probs < floor, float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return filtered.softmax(-1)


def _fused_applies(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> bool:
    # Greedy rows and temperature alone, on CUDA, and no seeded row (a seeded row draws from its
    # own generator so that its tokens never depend on the batch): the fused sampler
    # (kernels/triton_sampling.py), greedy rows at temperature 0.
    vocab = logits.shape[-1]
    return (
        logits.is_cuda
        and all(g is None for g in generators)
        and all(p.greedy or _temperature_only(p, vocab) for p in params)
    )


def _kernel_temperatures(params: list[SamplingParams]) -> list[float]:
    # the fused sampler takes a greedy row at temperature 0
    return [0.0 if p.greedy else p.temperature for p in params]


def draw_seed() -> int:
    """A step's seed for the fused sampler, from torch's global generator: torch.manual_seed
    fixes the draws too."""
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


def graph_temperatures(params: list[SamplingParams], vocab: int) -> list[float] | None:
    """Each row's temperature (0: greedy) where a decode graph's own sampler can draw the whole
    batch (engine/cuda_graphs.py, KernelOptions.sample_in_graph), or None where a row needs more:
    top-k, top-p or min-p, penalties, or a seed of its own."""
    if all(
        not _has_penalties(p) and (p.greedy or (p.seed is None and _temperature_only(p, vocab)))
        for p in params
    ):
        return _kernel_temperatures(params)
    return None


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One draw per row; seeded rows use their own generator so their tokens never depend on the
    batch."""
    free = [i for i, g in enumerate(generators) if g is None]
    if len(free) == len(generators):
        return _exponential_race(probs)
    out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    if free:
        rows = to_device(free, torch.long, probs.device)
        out[rows] = _exponential_race(probs[rows])
    for i, g in enumerate(generators):
        if g is not None:
            out[i] = torch.multinomial(probs[i], 1, generator=g)[0]
    return out


def _exponential_race(probs: torch.Tensor) -> torch.Tensor:
    """Row-wise draws: argmax of p / E with E ~ Exp(1) picks index i with probability p_i (the
    Gumbel-max trick in another form). One elementwise pass and an argmax, where multinomial scans
    a cumulative sum per row."""
    # Clamped: a zero draw would turn p = 0 into 0/0 = NaN, and argmax would pick it.
    noise = torch.empty_like(probs).exponential_().clamp_min_(1e-20)
    return (probs / noise).argmax(-1)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masking (masked entries become -inf)."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p; the first token always stays.
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if params.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


def top_logprobs(raw_logits: torch.Tensor, token_id: int, n: int) -> dict[int, float]:
    """Logprobs of the model's raw distribution: the sampled token plus the top n."""
    logp = raw_logits.float().log_softmax(-1)
    out = {token_id: logp[token_id].item()}
    if n > 0:
        vals, ids = torch.topk(logp, min(n, logp.numel()))
        for v, i in zip(vals.tolist(), ids.tolist()):
            out.setdefault(i, v)
    return out


def needs_host(p: SamplingParams) -> bool:
    """True when sampling a row needs the host between steps: its penalties read the token
    history, its logprobs read the step's logits back. Such rows cannot be sampled a step ahead."""
    # A guided row's next mask depends on the token just drawn.
    return _has_penalties(p) or p.logprobs is not None or p.guide is not None


def sample_on_device(
    logits: torch.Tensor,
    params: list[SamplingParams],
    history: Callable[[int], tuple[list[int], list[int]]],
    generators: list[torch.Generator | None],
) -> torch.Tensor:
    """The sampled token of every row of `logits` [batch, vocab], as a device tensor [batch]:
    nothing is read back, so the next step can be queued behind it. `history` as in `sample`."""
    penalized = [i for i, p in enumerate(params) if _has_penalties(p)]
    if penalized:
        logits = logits.to(torch.float32, copy=True)  # the caller's logits stay the model's
        for i in penalized:
            logits[i] = apply_penalties(logits[i], params[i], *history(i))
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if sampled_rows and _fused_applies(logits, params, generators):
        from flashstack.engine.kernels.triton_sampling import sample_triton

        temps = to_device(_kernel_temperatures(params), torch.float32, logits.device)
        return sample_triton(logits, temps, draw_seed())
    if len(sampled_rows) == len(params):  # no greedy row: no argmax pass, no row gathers
        return _draw(_filtered_probs(logits.float(), params), generators)
    chosen = _argmax(logits)
    if sampled_rows:
        rows = to_device(sampled_rows, torch.long, logits.device)
        probs = _filtered_probs(logits[rows].float(), [params[i] for i in sampled_rows])
        chosen[rows] = _draw(probs, [generators[i] for i in sampled_rows])
    return chosen


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum (int64, on the logits' device): the Triton kernel on CUDA (a few
    programs per row, where torch's argmax gives a row to one), torch elsewhere."""
    if logits.is_cuda:
        from flashstack.engine.kernels.triton_sampling import argmax_triton

        return argmax_triton(logits)
    return logits.argmax(-1)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    history: Callable[[int], tuple[list[int], list[int]]],
    generators: list[torch.Generator | None],
    matchers: list[Any] | None = None,
) -> SampleResult:
    """Pick one token per row of `logits` [batch, vocab] under each row's own parameters.

    `history(i)` gives row i's (prompt, output) token ids; it is called only for rows with
    penalties, since copying every sequence's tokens each step costs milliseconds at batch 256.
    Every row is handled in one batched pass (penalties aside) and the host reads the tokens once:
    a per-row loop with a host read per row costs a device sync per sequence per step.
    `matchers[i]` (flashstack.engine.guided), where not None, masks row i to its grammar and
    takes the token drawn.
    """
    guided = matchers is not None and any(m is not None for m in matchers)
    if guided:
        from flashstack.engine.guided import advance, apply_masks

        masked = apply_masks(logits, matchers)
    token_ids = sample_on_device(masked if guided else logits, params, history, generators).tolist()
    if guided:
        advance(matchers, token_ids)
    logprobs = [  # of the model's own logits: penalties work on a copy
        top_logprobs(logits[i], token_ids[i], p.logprobs) if p.logprobs is not None else None
        for i, p in enumerate(params)
    ]
    return SampleResult(token_ids, logprobs)
