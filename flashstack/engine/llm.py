"""Public engine API: `LLMEngine` (step by step), `LLM` (offline batch), `AsyncLLM` (streaming)."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from flashstack.engine.block_manager import BlockManager
from flashstack.engine.config import EngineConfig
from flashstack.engine.cuda_graphs import graph_buckets
from flashstack.engine.gguf import is_gguf
from flashstack.engine.kernels.attention import AttentionMetadata, get_attention_backend
from flashstack.engine.kv_cache import (
    calibrate_kv_scales,
    calibration_ids,
    resolve_kv_dtype,
    set_kv_scales,
)
from flashstack.engine.loader import (
    checkpoint_tensor_count,
    load_model,
    read_hf_config,
    resolve_device,
    resolve_dtype,
)
from flashstack.engine.mixed_graphs import buffer_bytes
from flashstack.engine.model_runner import (
    ModelRunner,
    PendingStep,
    kv_bytes_per_block,
    mixed_graph_tokens,
)
from flashstack.engine.models.ops import select_ops
from flashstack.engine.outputs import RequestOutput, RequestState, StreamDelta
from flashstack.engine.quantization import FP8
from flashstack.engine.sampling import SamplingParams
from flashstack.engine.scheduler import ScheduledBatch, Scheduler
from flashstack.engine.sequence import Sequence
from flashstack.engine.swap import PreemptionCost, num_host_blocks
from flashstack.engine.tokenizer import Tokenizer, load_tokenizer
from flashstack.engine.tp.worker import GroupBroadcast, launch

Prompt = str | list[int]
log = logging.getLogger("flashstack.engine")
_GiB = 1 << 30


@contextmanager
def _progress(enabled: bool) -> Iterator[Progress]:
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True, disable=not enabled) as p:
        yield p


class LLMEngine:
    """The synchronous engine core: add requests, call `step()`, read `StreamDelta`s."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        path = Path(config.model)
        config.hf_config = hf = read_hf_config(path)
        self.device = resolve_device(config.device)
        config.kernels = config.kernels.resolved(self.device)
        log.info("kernels on %s: %s", self.device, config.kernels.describe())
        # Tensor parallel: ranks 1..N-1 start loading their shards while this rank loads its own.
        self.workers = launch(config, self.device) if config.tensor_parallel_size > 1 else None
        self.dtype = resolve_dtype(config.dtype, hf, self.device)
        self.tokenizer = load_tokenizer(path)
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.dtype, self.device)
        with _progress(config.show_progress) as progress:
            self.model = self._load(path, progress)
            if self.kv_dtype == FP8:
                ids = calibration_ids(self.tokenizer, self.model.args.vocab_size)
                set_kv_scales(self.model, calibrate_kv_scales(self.model, ids, self.dtype))
            num_blocks = self._size_kv_cache(progress)
        if self.workers is not None:  # every rank's cache gets rank 0's block count
            num_blocks = self.workers.start(num_blocks)
        self._set_max_model_len(num_blocks)
        per_block = kv_bytes_per_block(self.model.args, config.block_size, self.kv_dtype)
        num_host = num_host_blocks(config, per_block)  # 0: swap off (recompute mode, or TP)
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching, num_host
        )
        eos = set(self.tokenizer.eos_token_ids) if self.tokenizer else set()
        if not eos and hf.get("eos_token_id") is not None:
            eos = set(
                hf["eos_token_id"] if isinstance(hf["eos_token_id"], list) else [hf["eos_token_id"]]
            )
        cost = None
        if num_host:
            args = self.model.args
            cost = PreemptionCost.for_model(config, self.model, args, per_block, self.device)
        self.scheduler = Scheduler(config, self.block_manager, eos, cost)
        peers = GroupBroadcast(self.workers) if self.workers is not None else None
        self.runner = ModelRunner(config, self.model, num_blocks, self.device, self.dtype, peers)
        if num_host:
            self.runner.enable_swap(num_host)
        if self._use_graphs():
            self._capture_graphs()
        self.requests: dict[str, RequestState] = {}
        self._aborted: list[StreamDelta] = []
        self._in_flight: PendingStep | None = None  # a decode step queued ahead (async_scheduling)

    def _load(self, path: Path, progress: Progress):
        verb = "dequantizing" if is_gguf(path) else "loading"
        task = progress.add_task(f"{verb} {path.name}", total=checkpoint_tensor_count(path))
        tp = self.workers.tp if self.workers is not None else None
        return load_model(
            path,
            self.dtype,
            self.device,
            lambda: progress.advance(task),
            tp,
            self.config.quantization,
        )

    def _size_kv_cache(self, progress: Progress) -> int:
        cfg = self.config
        task = progress.add_task("sizing KV cache", total=1)
        per_block = kv_bytes_per_block(self.model.args, cfg.block_size, self.kv_dtype)
        max_len = self._declared_max_len()
        # No point reserving more than every sequence at full length could use.
        enough = cfg.max_num_seqs * -(-max_len // cfg.block_size)
        if cfg.num_kv_blocks is not None:
            num_blocks = cfg.num_kv_blocks
        elif self.device.type == "cuda":
            num_blocks = min(self._cuda_kv_budget() // per_block, enough)
        else:
            num_blocks = min(int((cfg.kv_cache_memory_gb or 1.0) * _GiB) // per_block, enough)
        if num_blocks < 1:
            raise ValueError(
                "no room for a single KV block: lower block_size, raise gpu_memory_utilization / "
                "kv_cache_memory_gb, or free memory held by other processes"
            )
        progress.advance(task)
        return int(num_blocks)

    def _use_graphs(self) -> bool:
        return (
            self.device.type == "cuda"
            and not self.config.enforce_eager
            and self.runner.backend.name == "triton"
        )

    def _capture_graphs(self) -> None:
        with _progress(self.config.show_progress) as progress:
            buckets = graph_buckets(self.config.max_num_seqs)
            task = progress.add_task("capturing CUDA graphs", total=len(buckets))
            self.runner.capture_graphs(self.config.max_model_len, lambda: progress.advance(task))

    def _cuda_kv_budget(self) -> int:
        # What is left of gpu_memory_utilization once the weights, the measured peak of the largest
        # step's activations and the graphs' pool are accounted for.
        gc.collect()  # caches of engines already dropped still count as used until collected
        torch.cuda.empty_cache()
        activations = self._profile_activations()
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        graph_pool = (
            0
            if self.config.enforce_eager
            else 512 * (1 << 20) + self._mixed_graph_pool(activations)
        )
        return int(total * self.config.gpu_memory_utilization - used - activations - graph_pool)

    def _mixed_graph_pool(self, activations: int) -> int:
        # The mixed-step graphs' activations scale with their largest bucket's tokens; their
        # static buffers come on top.
        tokens = mixed_graph_tokens(self.config)
        if not tokens:
            return 0
        return activations * tokens // self._profiled_tokens() + buffer_bytes(
            self.model.args, tokens, self.dtype
        )

    def _profiled_tokens(self) -> int:
        # The largest step: what _profile_activations runs.
        return min(self.config.max_num_batched_tokens, self._declared_max_len())

    @torch.inference_mode()
    def _profile_activations(self) -> int:
        """Peak activation bytes of the largest step, measured by running it
        once on dummy tokens."""
        cfg, a = self.config, self.model.args
        n = self._profiled_tokens()
        if self.workers is not None:  # the other ranks run the same forward: its collectives match
            self.workers.mirror_profile(n)
        blocks = -(-n // cfg.block_size)
        caches = [
            torch.zeros(
                blocks,
                2,
                cfg.block_size,
                a.num_kv_heads,
                a.head_dim,
                dtype=self.kv_dtype,
                device=self.device,
            )
            for _ in range(a.num_layers)
        ]
        dev = self.device
        meta = AttentionMetadata.whole_prefill(n, cfg.block_size, dev)
        backend = get_attention_backend(cfg.attention_backend, dev, cfg.kernels)
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        ids = torch.zeros(n, dtype=torch.int64, device=dev)
        ops = select_ops(dev, backend, self.model.args.head_dim)
        hidden = self.model(ids, torch.arange(n, device=dev), meta, caches, ops)
        self.model.compute_logits(hidden[-min(n, cfg.max_num_seqs) :], ops)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
        del caches, hidden
        torch.cuda.empty_cache()
        return int(peak)

    def _declared_max_len(self) -> int:
        # Never past the checkpoint's positions: the rotary table stops there (models/layers.py).
        hf_len = self.model.args.max_positions
        return min(self.config.max_model_len or hf_len, hf_len)

    def _set_max_model_len(self, num_blocks: int) -> None:
        # A sequence must fit in the whole cache, or recompute preemption could never make room for
        # it.
        self.config.max_model_len = min(
            self._declared_max_len(), num_blocks * self.config.block_size
        )

    # ---- requests -------------------------------------------------------------------------------

    def make_sequence(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> RequestState:
        """Tokenize and validate a request without queueing it (safe to call from any thread)."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "this model directory has no tokenizer.json; pass token ids instead of text"
                )
            token_ids, text = self.tokenizer.encode(prompt), prompt
        else:
            token_ids, text = list(prompt), None
        self._validate(token_ids)
        seq = Sequence(token_ids, params, request_id or uuid.uuid4().hex, priority)
        return RequestState(seq, text, self.tokenizer)

    def _validate(self, token_ids: list[int]) -> None:
        cfg = self.config
        if not token_ids:
            raise ValueError("the prompt is empty")
        if len(token_ids) >= cfg.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; this engine fits {cfg.max_model_len} "
                "tokens per sequence (prompt + output)"
            )
        if not cfg.enable_chunked_prefill and len(token_ids) > cfg.max_num_batched_tokens:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens > max_num_batched_tokens="
                f"{cfg.max_num_batched_tokens}; enable chunked prefill or raise the budget"
            )
        vocab = self.model.args.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")

    def add_state(self, state: RequestState) -> str:
        """Queue a request made by `make_sequence`."""
        rid = state.seq.request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already live")
        self.requests[rid] = state
        self.scheduler.add(state.seq)
        return rid

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> str:
        """Queue a prompt (text or token ids); returns its request id."""
        return self.add_state(self.make_sequence(prompt, params, request_id, priority))

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its blocks now; its final delta comes with the next `step()`."""
        state = self.requests.pop(request_id, None)
        if state is None or self.scheduler.abort(request_id) is None:
            return False
        state.seq.finished_time = time.monotonic()
        self._aborted.append(state.delta())
        return True

    def has_unfinished_requests(self) -> bool:
        """True while any request waits or runs."""
        return self.scheduler.has_unfinished()

    def has_pending_output(self) -> bool:
        """True when the next `step()` has something to report (live requests, abort notices)."""
        return self.scheduler.has_unfinished() or bool(self._aborted)

    def abort_all(self) -> None:
        """Abort every live request, dropping their final deltas (used after an engine failure)."""
        for rid in list(self.requests):
            self.abort_request(rid)
        self._aborted.clear()
        self._in_flight = None

    def step(self) -> list[StreamDelta]:
        """Schedule, run the model once, sample; returns a delta for every request that changed.

        With `async_scheduling`, a step's successor is queued on the device before the host reads
        the step's tokens (Scheduler.lookahead: everyone decodes, and waiting prompts are
        admitted), so the device computes step N+1 while the host does step N's bookkeeping; a
        call then returns step N's deltas and leaves N+1 in flight for the next call.
        """
        deltas, self._aborted = self._aborted, []
        pending, self._in_flight = self._in_flight, None
        if pending is None:
            batch = self.scheduler.schedule()
            if not batch:
                return deltas
            _mark_scheduled(batch)
            if self.config.async_scheduling:
                pending = self.runner.launch(batch)
            if pending is None:
                self._apply(batch, self.runner.execute(batch), deltas)
                return deltas
        ahead = self.scheduler.lookahead(pending.batch)
        if ahead is not None:
            _mark_scheduled(ahead)
            # None when the runner cannot queue it (a tensor-parallel eager step, an admission
            # whose sampling needs the host): its sequences keep their slots, and the next
            # schedule() runs them.
            self._in_flight = self.runner.launch(ahead, after=pending)
        self._apply(pending.batch, pending.wait(), deltas)
        if self._in_flight is not None and all(s.is_finished for s in self._in_flight.batch.seqs):
            self._in_flight = None  # every sequence in it ended meanwhile: nothing to read back
        return deltas

    def _apply(
        self, batch: ScheduledBatch, sampled: list[int | None], deltas: list[StreamDelta]
    ) -> None:
        """Step bookkeeping: computed counts, new tokens, stops, stream deltas."""
        if any(s.is_finished for s in batch.seqs):
            # A lookahead step also ran the sequences that the step before it ended (or that were
            # aborted since): their rows are dropped.
            keep = [i for i, s in enumerate(batch.seqs) if not s.is_finished]
            batch = ScheduledBatch(
                [batch.seqs[i] for i in keep], [batch.num_new_tokens[i] for i in keep]
            )
            sampled = [sampled[i] for i in keep]
        self.scheduler.postprocess(batch, sampled)
        now = time.monotonic()
        for seq, token_id in zip(batch.seqs, sampled):
            if token_id is None:
                continue
            if seq.first_token_time is None:
                seq.first_token_time = now
            state = self.requests[seq.request_id]
            stop = state.update_text()
            if stop is not None:
                seq.stop_reason = stop
                if seq.is_finished:  # finished on length in the same step: the stop string wins
                    seq.finish_reason = "stop"
                else:
                    self.scheduler.finish(seq, "stop")
            if seq.is_finished:
                seq.finished_time = now
            deltas.append(state.delta())
            if seq.is_finished:
                self.requests.pop(seq.request_id, None)

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks, if any (also done when the engine is collected)."""
        if self.workers is not None:
            self.runner.release_graphs()  # graphs holding NCCL work block the group's teardown
            self.workers.close()

    def output(self, request_id: str) -> RequestOutput | None:
        """Current output of a live request."""
        state = self.requests.get(request_id)
        return state.output() if state else None


@dataclass(slots=True, frozen=True)
class EngineInfo:
    """What a server needs to know of its engine once loaded."""

    model: str
    max_model_len: int
    vocab_size: int

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineInfo:
        """`engine`'s model path, sequence length and vocabulary size."""
        return cls(engine.config.model, engine.config.max_model_len, engine.model.args.vocab_size)


@dataclass(slots=True, frozen=True)
class EngineStats:
    """The engine's queue and cache counters, as /metrics reports them."""

    running: int
    waiting: int  # waiting or swapped out
    used_blocks: int
    num_blocks: int
    block_size: int
    prefix_queries: int  # full blocks looked up in the prefix cache
    prefix_hits: int
    preemptions: int

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineStats:
        """`engine`'s counters now (len() of lists another thread mutates is
        atomic under the GIL)."""
        sched, blocks = engine.scheduler, engine.block_manager
        return cls(
            len(sched.running),
            len(sched.waiting) + len(sched.swapped),
            blocks.num_used_blocks,
            blocks.num_blocks,
            blocks.block_size,
            blocks.num_prefix_queries,
            blocks.num_prefix_hits,
            sched.num_preemptions,
        )


def _mark_scheduled(batch: ScheduledBatch) -> None:
    now = time.monotonic()
    for seq in batch.seqs:
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = now


def model_name(model: str | Path) -> str:
    """What a model path is served as: its directory's name, or a GGUF file's name less .gguf."""
    path = Path(model)
    return path.stem if is_gguf(path) else path.name


def _engine_config(model: str | Path, kwargs: dict[str, Any]) -> EngineConfig:
    return EngineConfig(model=str(model), **kwargs)


class LLM:
    """Offline batch generation, vLLM style: `LLM(path).generate(prompts, SamplingParams(...))`."""

    def __init__(
        self,
        model: str | Path,
        block_size: int = 256,
        max_num_seqs: int = 256,
        dtype: str = "auto",
        device: str = "auto",
        **kwargs: Any,
    ) -> None:
        self.engine = LLMEngine(
            _engine_config(
                model,
                dict(
                    block_size=block_size,
                    max_num_seqs=max_num_seqs,
                    dtype=dtype,
                    device=device,
                    **kwargs,
                ),
            )
        )
        # Tests and tools may set this to inspect the engine after every step.
        self.step_hook: Callable[[LLMEngine], None] | None = None

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer (None when the directory has no tokenizer.json)."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params_list = (
            params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        )
        states = [
            self.engine.make_sequence(p, sp, priority=(priority[i] if priority else 0))
            for i, (p, sp) in enumerate(zip(prompts, params_list))
        ]
        for state in states:
            self.engine.add_state(state)
        while self.engine.has_unfinished_requests():
            self.engine.step()
            if self.step_hook is not None:
                self.step_hook(self.engine)
        return [state.output() for state in states]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        params: SamplingParams | None = None,
        **template_kwargs: Any,
    ) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate."""
        if self.tokenizer is None:
            raise ValueError("this model directory has no tokenizer.json, so it cannot chat")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode_chat(c, **template_kwargs) for c in convs]  # type: ignore[arg-type]
        return self.generate(prompts, params)


class AsyncLLM:
    """Streaming front end for servers: one engine loop in a worker thread, one queue per request.

    ``async for delta in engine.stream(prompt, params)`` yields a `StreamDelta` per engine step that
    produced something for the request; the last one has ``finish_reason`` set. Leaving the loop
    early (client gone, task cancelled) aborts the request and frees its KV blocks.
    Bad requests (empty or too long prompt, bad token ids) raise ValueError before anything streams.
    Text held back for a possible stop string arrives in a later delta, so concatenated
    ``delta.text`` always equals the final text.
    """

    def __init__(self, model: str | Path | LLMEngine, **kwargs: Any) -> None:
        self.engine = (
            model if isinstance(model, LLMEngine) else LLMEngine(_engine_config(model, kwargs))
        )
        self._queues: dict[str, asyncio.Queue[StreamDelta | BaseException]] = {}
        self._pending: list[tuple[str, Any]] = []
        self._pending_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flashstack-engine")
        self._loop_task: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Event | None = None

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer, for chat templates and counting."""
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        """The model directory's name (a GGUF file's name without .gguf)."""
        return model_name(self.engine.config.model)

    @property
    def info(self) -> EngineInfo:
        """The loaded model's path, sequence length and vocabulary size."""
        return EngineInfo.of(self.engine)

    def stats(self) -> EngineStats:
        """The engine's queue and cache counters now."""
        return EngineStats.of(self.engine)

    async def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[StreamDelta]:
        """Yield per-step deltas for one request until it ends; ValueError on a bad request."""
        state = self.engine.make_sequence(prompt, params, request_id, priority)
        rid = state.seq.request_id
        if rid in self._queues:
            raise ValueError(f"request id {rid!r} is already live")
        queue: asyncio.Queue[StreamDelta | BaseException] = asyncio.Queue()
        self._queues[rid] = queue
        self._submit("add", state)
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(rid, None)
            if not finished:
                self._submit("abort", rid)

    async def stream_chat(
        self,
        messages: list[dict[str, Any]],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        **template_kwargs: Any,
    ) -> AsyncIterator[StreamDelta]:
        """`stream` for a conversation: applies the model's chat template first."""
        if self.tokenizer is None:
            raise ValueError("this model directory has no tokenizer.json, so it cannot chat")
        prompt = self.tokenizer.encode_chat(messages, **template_kwargs)
        async for delta in self.stream(prompt, params, request_id, priority):
            yield delta

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> RequestOutput:
        """Run one request to the end and return its full output."""
        ids: list[int] = []
        text: list[str] = []
        logprobs: list[dict[int, float]] = []
        last: StreamDelta | None = None
        async for delta in self.stream(prompt, params, request_id, priority):
            ids += delta.token_ids
            text.append(delta.text)
            logprobs += delta.logprobs or []
            last = delta
        assert last is not None
        return RequestOutput(
            last.request_id,
            prompt if isinstance(prompt, str) else None,
            [] if isinstance(prompt, str) else list(prompt),
            ids,
            "".join(text),
            last.finish_reason,
            last.stop_reason,
            logprobs or None,
        )

    async def abort(self, request_id: str) -> None:
        """Abort a live request; its stream ends with finish_reason 'abort'."""
        self._submit("abort", request_id)

    def _submit(self, kind: str, arg: Any) -> None:
        with self._pending_lock:
            self._pending.append((kind, arg))
        self._ensure_loop()
        assert self._wakeup is not None
        self._wakeup.set()

    def _ensure_loop(self) -> None:
        task = self._loop_task
        # A new event loop (e.g. a second asyncio.run) needs its own engine-loop task.
        if task is None or task.done() or task.get_loop() is not asyncio.get_running_loop():
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    def _step(self) -> list[StreamDelta]:
        # Runs in the worker thread: the only place the engine is touched once the loop is up.
        with self._pending_lock:
            pending, self._pending = self._pending, []
        for kind, arg in pending:
            if kind == "add":
                self.engine.add_state(arg)
            else:
                self.engine.abort_request(arg)
        return self.engine.step() if self.engine.has_pending_output() else []

    def _abort_all(self) -> None:
        with self._pending_lock:
            self._pending.clear()
        self.engine.abort_all()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wakeup is not None
        while True:
            if not self.engine.has_unfinished_requests() and not self._pending:
                await self._wakeup.wait()
            self._wakeup.clear()
            try:
                deltas = await loop.run_in_executor(self._executor, self._step)
            except Exception as exc:  # an engine failure ends every live stream with the error
                for queue in self._queues.values():
                    queue.put_nowait(exc)
                await loop.run_in_executor(self._executor, self._abort_all)
                continue
            for delta in deltas:
                queue = self._queues.get(delta.request_id)
                if queue is not None:
                    queue.put_nowait(delta)

    async def close(self) -> None:
        """Stop the engine loop and its worker thread."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True)
