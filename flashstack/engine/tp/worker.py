"""Tensor-parallel ranks: rank 0's broadcast of each step, and the loop of ranks 1..N-1.

Rank 0 lives in the caller's process and keeps the scheduler and block manager; ranks 1..N-1 are
spawned processes that hold their own weight shard and KV cache. Every rank's cache has the same
number of blocks and is addressed through rank 0's block tables, so the tables are identical.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import signal
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from flashstack.cuda import device_count
from flashstack.engine.config import EngineConfig
from flashstack.engine.cuda_graphs import DecodeGraphs, graph_buckets
from flashstack.engine.kernels.attention import AttentionMetadata, get_attention_backend
from flashstack.engine.loader import load_model, read_hf_config, resolve_dtype
from flashstack.engine.model_runner import ModelRunner
from flashstack.engine.models import LlamaForCausalLM
from flashstack.engine.models.ops import select_ops
from flashstack.engine.step import (
    CaptureGraphs,
    GraphStep,
    ShareInputs,
    StepBroadcast,
    StepHook,
    StepInputs,
)
from flashstack.engine.tp.channel import OP_PROFILE, OP_START, StepChannel
from flashstack.engine.tp.group import (
    TensorParallel,
    disable_multicast,
    init_rank,
    leave_group,
    master_store,
    rank_device,
)
from flashstack.engine.tp.mailbox import Mailbox


@dataclass(slots=True)
class WorkerGroup:
    """Rank 0's handle on the spawned ranks; `close()` stops them and leaves the process group."""

    tp: TensorParallel
    procs: list[mp.process.BaseProcess]
    store: dist.TCPStore  # the other ranks rendezvous here; it lives as long as the group
    mailbox: Mailbox
    channel: StepChannel | None = None
    closed: bool = False

    def mirror_profile(self, num_tokens: int) -> None:
        """Have the other ranks run rank 0's activation-profiling forward alongside it."""
        assert self.channel is not None
        self.channel.send_control(OP_PROFILE, num_tokens)

    def start(self, num_blocks: int) -> int:
        """Give every rank rank 0's KV block count (equal shards on equal GPUs need no more)."""
        assert self.channel is not None
        self.channel.send_control(OP_START, num_blocks)
        return num_blocks

    def close(self) -> None:
        """Send exit, wait briefly, then kill stragglers; safe to call twice."""
        if self.closed:
            return
        self.closed = True
        if self.channel is not None and all(p.is_alive() for p in self.procs):
            try:
                self.channel.send_exit()
            except Exception:  # a dead rank: fall through to terminate
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        self.tp.fast = None
        leave_group()
        self.mailbox.close()


def launch(config: EngineConfig, device: torch.device) -> WorkerGroup:
    """Spawn ranks 1..N-1 and join the group as rank 0."""
    world = config.tensor_parallel_size
    disable_multicast()  # before spawning: children inherit the environment
    if device.type == "cuda" and device_count() < world:
        raise ValueError(
            f"tensor_parallel_size={world} needs {world} GPUs; this process sees {device_count()}"
        )
    store = master_store(world, config.kernels.tp_timeout_s)
    mailbox = Mailbox.create(world - 1, StepChannel.header_width(config.max_num_seqs))
    ctx = mp.get_context("spawn")  # fork after torch/CUDA init is unsafe
    procs = [
        ctx.Process(
            target=worker_main,
            args=(config, rank, store.port, str(device), str(mailbox.path)),
            name=f"flashstack-tp{rank}",
            daemon=True,
        )
        for rank in range(1, world)
    ]
    for p in procs:
        p.start()
    share_cpu_threads(device, world)
    tp = init_rank(0, world, store.port, rank_device(device, 0), store, config.kernels)
    # Every rank has mapped the mailbox: its file can go, so a crash leaves nothing in /dev/shm.
    store.wait([_attached_key(rank) for rank in range(1, world)])
    mailbox.unlink()
    channel = StepChannel(tp, config.block_size, mailbox)
    return WorkerGroup(tp, procs, store, mailbox, channel)


class GroupBroadcast(StepBroadcast):
    """Rank 0's side of a tensor-parallel group: each host-built step is broadcast to the other
    ranks; decode graphs are captured on every rank at once, and each replay announced."""

    # Eager steps reach the other ranks as host-built inputs, one at a time through `execute`;
    # only graph steps are queued ahead (their inputs go by a broadcast on the device, in order).
    queues_eager_steps = False

    def __init__(self, workers: WorkerGroup) -> None:
        assert workers.channel is not None
        self.workers, self.channel = workers, workers.channel

    def send(self, inputs: StepInputs) -> None:
        self.channel.send(inputs)

    def before_capture(self, runner: ModelRunner, max_model_len: int) -> ShareInputs | None:
        """Have every rank capture alongside (the graphs hold collectives)."""
        self.channel.send_capture(max_model_len)
        return enable_graph_collectives(runner, self.workers.tp, max_model_len)

    def replay_hook(self, share: ShareInputs | None) -> StepHook:
        """Announce each replay; its packed inputs follow by NCCL unless the graph fetches them."""
        return self.channel.announce_graph_step if share else self.channel.send_graph_step

    def close(self) -> None:
        """Stop the other ranks and leave the process group."""
        self.workers.close()


def share_cpu_threads(device: torch.device, world: int) -> None:
    """On CPU, give each rank its share of the cores: every rank's intra-op threads busy-wait, and
    N ranks each using every core starve one another (a 2-layer model's decode step over 2 ranks
    on 2 cores: 39–48 ms with the default threads, 6–11 ms with one thread each)."""
    if device.type == "cpu":
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))


def _attached_key(rank: int) -> str:
    return f"flashstack-tp-mailbox-attached-{rank}"


def enable_graph_collectives(
    runner: ModelRunner, tp: TensorParallel, max_model_len: int
) -> ShareInputs | None:
    """Collective, before every rank captures: set up the peer-memory collectives the decode graphs
    use. Returns the input broadcast that starts each graph, or None where the graphs' inputs
    travel by NCCL before each replay (no peer memory)."""
    step_inputs = DecodeGraphs.packed_capacity(
        max_model_len, runner.config.block_size, runner.config.max_num_seqs
    )
    tp.enable_fast_all_reduce(fast_all_reduce_numel(runner), runner.dtype, step_inputs)
    fast = tp.fast
    return fast.broadcast_step_inputs if fast is not None and fast.step_inbox is not None else None


def fast_all_reduce_numel(runner: ModelRunner) -> int:
    """Values in the largest decode step's all-reduce (the top graph bucket's hidden states), and at
    least one row of this rank's logits (the vocabulary-parallel head's gather)."""
    hidden_states = graph_buckets(runner.config.max_num_seqs)[-1] * runner.model.args.hidden_size
    return max(hidden_states, runner.model.lm_head.out_features)


def _watch_parent() -> None:
    # The header wait never times out (an idle server); leave if rank 0's process is gone.
    parent = mp.parent_process()
    while parent is None or parent.is_alive():
        time.sleep(1.0)
    os._exit(1)


def worker_main(
    config: EngineConfig, rank: int, port: int, base_device: str, mailbox_path: str
) -> None:
    """Rank `rank`'s whole life: join, load its shard, size the cache as rank 0 says, run steps."""
    threading.Thread(target=_watch_parent, daemon=True, name="tp-watch-parent").start()
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints where a stuck rank waits
    device = rank_device(torch.device(base_device), rank)
    share_cpu_threads(device, config.tensor_parallel_size)
    width = StepChannel.header_width(config.max_num_seqs)
    mailbox = Mailbox.attach(mailbox_path, config.tensor_parallel_size - 1, width)
    store = dist.TCPStore(
        "127.0.0.1",
        port,
        config.tensor_parallel_size,
        False,
        timeout=timedelta(seconds=config.kernels.tp_timeout_s),
    )
    store.set(_attached_key(rank), "1")  # rank 0 may now remove the mailbox's file
    tp = init_rank(rank, config.tensor_parallel_size, port, device, store, config.kernels)
    dtype = resolve_dtype(config.dtype, read_hf_config(config.model), device)
    model = load_model(Path(config.model), dtype, device, tp=tp)
    channel = StepChannel(tp, config.block_size, mailbox)
    while (msg := channel.recv_control())[0] == OP_PROFILE:
        profile_step(model, msg[1], config, device, dtype)
    if msg[0] != OP_START:  # rank 0 closed during start-up
        mailbox.close()
        return
    runner = ModelRunner(config, model, msg[1], device, dtype)
    run_steps(runner, channel)
    runner.release_graphs()
    leave_group()
    mailbox.close()


@torch.inference_mode()
def profile_step(
    model: LlamaForCausalLM, n: int, config: EngineConfig, device: torch.device, dtype: torch.dtype
) -> None:
    """Rank 0's profiling forward (LLMEngine._profile_activations) with the same shapes."""
    a, bs = model.args, config.block_size
    blocks = -(-n // bs)
    caches = [
        torch.zeros(blocks, 2, bs, a.num_kv_heads, a.head_dim, dtype=dtype, device=device)
        for _ in range(a.num_layers)
    ]
    meta = AttentionMetadata.whole_prefill(n, bs, device)
    backend = get_attention_backend(config.attention_backend, device, config.kernels)
    ids = torch.zeros(n, dtype=torch.int64, device=device)
    # as rank 0's: same kernels, same collectives
    ops = select_ops(device, backend, model.args.head_dim)
    hidden = model(ids, torch.arange(n, device=device), meta, caches, ops)
    model.compute_logits(hidden[-min(n, config.max_num_seqs) :], ops)


@torch.inference_mode()
def run_steps(runner: ModelRunner, channel: StepChannel) -> None:
    """Mirror rank 0's forward passes until it says exit; sampling happens on rank 0 only."""
    while (inputs := channel.recv()) is not None:
        if isinstance(inputs, CaptureGraphs):
            share = enable_graph_collectives(runner, channel.tp, inputs.max_model_len)
            runner.capture_graphs(inputs.max_model_len, share_inputs=share)
            continue
        if isinstance(inputs, GraphStep):
            assert runner.graphs is not None, "rank 0 replays graphs this rank never captured"
            if runner.graphs.share_inputs is None:  # else the graph's first kernel fetches them
                channel.recv_packed(runner.graphs.packed[: inputs.size])
            runner.graphs.replay_received(inputs.key)
            continue
        hidden = runner.model(
            inputs.input_ids, inputs.positions, inputs.meta, runner.kv_caches, runner.ops
        )
        if inputs.sample_rows.numel():
            # joins the logits gather
            runner.model.compute_logits(hidden[inputs.sample_rows], runner.ops)
