"""Decode step on 2 GPUs vs 1 and greedy agreement: docs/benchmarks.md, "Tensor parallelism"."""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    bos_token_id=128000,
    eos_token_id=128001,
)
# Same code path at a size a CPU runs in seconds: `--shape tiny --device cpu` smoke-tests the bench.
TINY = {
    **LLAMA3_8B,
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
}
DEVICE = "cuda"


def _rand(*shape: int, std: float, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE, generator=gen, dtype=torch.bfloat16) * std


def _layer(i: int, c: dict[str, Any], gen: torch.Generator) -> dict[str, torch.Tensor]:
    h, f, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    shapes = dict(
        q_proj=(q, h),
        k_proj=(kv, h),
        v_proj=(kv, h),
        o_proj=(h, q),
        gate_proj=(f, h),
        up_proj=(f, h),
        down_proj=(h, f),
    )
    p = f"model.layers.{i}."
    out = {
        p
        + ("mlp." if n.endswith(("gate_proj", "up_proj", "down_proj")) else "self_attn.")
        + n
        + ".weight": _rand(*s, std=0.01, gen=gen)
        for n, s in shapes.items()
    }
    out[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16, device=DEVICE)
    out[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16, device=DEVICE)
    return {k: v.cpu() for k, v in out.items()}


def write_checkpoint(path: Path, layers: int, shape: dict[str, Any] = LLAMA3_8B) -> float:
    """Random Llama-3-8B-shaped weights as one safetensors file per layer; returns seconds."""
    t0 = time.perf_counter()
    c = {**shape, "num_hidden_layers": layers}
    (path / "config.json").write_text(json.dumps(c))
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    v, h = c["vocab_size"], c["hidden_size"]
    embed = _rand(v, h, std=1.0, gen=gen)
    perm = (torch.arange(v, device=DEVICE) * 7919 + 1) % v  # 7919 is prime, v is not its multiple
    head = {
        "model.embed_tokens.weight": embed.cpu(),
        "lm_head.weight": embed[perm].cpu(),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
    }
    del embed
    save_file(head, str(path / "model-head.safetensors"))
    for i in range(layers):
        save_file(_layer(i, c, gen), str(path / f"model-layer{i:02d}.safetensors"))
    return time.perf_counter() - t0


def _engine(path: Path, tp: int, eager: bool):
    from flashstack.engine import LLM

    return LLM(
        path,
        tensor_parallel_size=tp,
        enforce_eager=eager,
        device=DEVICE,
        dtype="bfloat16",
        block_size=256,
        max_num_seqs=32,
        num_kv_blocks=96,
        enable_prefix_caching=False,
        show_progress=False,
    )


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 1000, (n, length), generator=g).tolist()


def step_ms(llm: Any, batch: int, steps: int, warmup: int = 5) -> float:
    """Median wall time of one decode step with `batch` sequences (each step ends in a host
    read)."""
    from flashstack.engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + warmup + 4, ignore_eos=True)
    for p in _prompts(batch, 64, batch):
        engine.add_request(p, params)
    engine.step()  # the whole batch prefills in one step (64 * 32 tokens < the 8192 budget)
    for _ in range(warmup):
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) * 1e3)
    engine.abort_all()
    return statistics.median(times)


def profile_steps(llm: Any, steps: int = 10, top: int = 15) -> list[dict[str, Any]]:
    """Rank 0's GPU time per batch-1 decode step, by kernel (summed over the profiled steps)."""
    from torch.profiler import ProfilerActivity, profile

    from flashstack.engine import SamplingParams

    engine = llm.engine
    engine.add_request(
        _prompts(1, 64, 3)[0],
        SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True),
    )
    for _ in range(4):
        engine.step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    engine.abort_all()
    rows = sorted(
        (e for e in prof.key_averages() if e.device_time_total > 0),
        key=lambda e: -e.device_time_total,
    )
    out = [
        {
            "kernel": "ALL",
            "us_per_step": round(sum(e.device_time_total for e in rows) / steps, 1),
            "calls_per_step": sum(e.count for e in rows) / steps,
        }
    ]
    return out + [
        {
            "kernel": e.key[:80],
            "us_per_step": round(e.device_time_total / steps, 1),
            "calls_per_step": e.count / steps,
        }
        for e in rows[:top]
    ]


def host_timing(llm: Any, steps: int = 40) -> dict[str, float]:
    """Rank 0's host time per batch-1 decode step, by part (median µs): wall clocks wrapped around
    the engine's own methods. `sample` includes waiting for the GPU: the step's device time."""
    import flashstack.engine.model_runner as model_runner
    import flashstack.engine.tp.channel as channel
    from flashstack.engine import SamplingParams

    engine = llm.engine
    times: dict[str, list[float]] = {}
    undo: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str, part: str) -> None:
        inner = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                times.setdefault(part, []).append((time.perf_counter() - t) * 1e6)

        undo.append((owner, name, inner))
        setattr(owner, name, timed)

    wrap(engine.scheduler, "schedule", "schedule")
    wrap(engine.scheduler, "postprocess", "postprocess")
    wrap(engine.runner, "_graph_logits", "stage + launch (graph step)")
    wrap(model_runner, "sample", "sample (waits for the GPU; steps run one at a time)")
    wrap(model_runner.PendingStep, "wait", "wait for a queued step's tokens (async scheduling)")
    if engine.workers is not None:
        wrap(engine.workers.channel.mailbox, "post", "mailbox post")
        wrap(channel.dist, "broadcast", "broadcast call (NCCL on GPUs)")
    engine.add_request(
        _prompts(1, 64, 1)[0],
        SamplingParams(temperature=0.0, max_tokens=steps + 20, ignore_eos=True),
    )
    for _ in range(10):
        engine.step()
    times.clear()
    steps_us = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        steps_us.append((time.perf_counter() - t) * 1e6)
    engine.abort_all()
    for owner, name, inner in reversed(undo):
        setattr(owner, name, inner)
    out = {k: round(statistics.median(v), 1) for k, v in times.items()}
    out["step"] = round(statistics.median(steps_us), 1)
    return out


def run_engine(
    path: Path,
    tp: int,
    eager: bool,
    steps: int,
    agree_tokens: int,
    profile_b1: bool = False,
    host_b1: bool = False,
) -> dict[str, Any]:
    """Load, greedy-generate the agreement prompts, then time decode at batch 1 and 32."""
    from flashstack.engine import SamplingParams

    t0 = time.perf_counter()
    llm = _engine(path, tp, eager)
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=agree_tokens, ignore_eos=True)
    tokens = [o.token_ids for o in llm.generate(_prompts(32, 16, 7), params)]
    graphs = llm.engine.runner.graphs is not None
    result = {"tp": tp, "cuda_graphs": graphs, "load_s": round(load_s, 1), "tokens": tokens}
    for batch in (1, 32):
        result[f"step_ms_b{batch}"] = round(step_ms(llm, batch, steps), 3)
    if profile_b1 and DEVICE == "cuda":
        result["kernels_b1"] = profile_steps(llm)
    if host_b1:
        result["host_us_b1"] = host_timing(llm)
    llm.engine.shutdown()
    del llm
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return result


def peer_copy_gbps(nbytes: int = 1 << 30, reps: int = 10) -> float | None:
    """GPU 0 -> GPU 1 copy bandwidth through flashstack.cuda.peer (None without a P2P link)."""
    from flashstack import cuda as fc
    from flashstack.cuda.peer import can_access_peer, copy_peer, enable_peer_access

    d0, d1 = fc.Device(0), fc.Device(1)
    if not can_access_peer(d0, d1):
        return None
    enable_peer_access(d0, d1)
    with fc.Stream(d0) as s, fc.Stream(d1) as s1:
        src, dst = fc.DeviceBuffer(nbytes, d0, s), fc.DeviceBuffer(nbytes, d1, s1)
        copy_peer(dst, src, s)
        s.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            copy_peer(dst, src, s)
        s.synchronize()
        dt = time.perf_counter() - t0
        src.close()
        dst.close()
    return round(nbytes * reps / dt / 1e9, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--agree-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--shape", choices=["llama3-8b", "tiny"], default="llama3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--graphs-only", action="store_true", help="skip the eager runs")
    ap.add_argument(
        "--profile", action="store_true", help="kernel time per batch-1 step, by kernel"
    )
    ap.add_argument(
        "--host-timing", action="store_true", help="rank 0's host time per batch-1 step, by part"
    )
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    shape = LLAMA3_8B if args.shape == "llama3-8b" else TINY
    out: dict[str, Any] = {"model": f"{args.shape} shape, random bf16", "layers": args.layers}

    def emit() -> None:
        text = json.dumps(out)
        if args.out is not None:
            args.out.write_text(text)  # after every stage: a timeout still leaves what was measured
        print(text, flush=True)

    try:
        out["peer_copy_GBps"] = peer_copy_gbps() if DEVICE == "cuda" else None
    except Exception as exc:  # the bench's point is the engine; report and go on
        out["peer_copy_error"] = repr(exc)
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        out["write_s"] = round(write_checkpoint(Path(tmp), args.layers, shape), 1)
        emit()
        runs = {}
        n = args.tp
        # 1 GPU and N GPUs, each with decode graphs (the default) and eager.
        plan = [
            ("tp1", 1, False),
            ("tp1_eager", 1, True),
            (f"tp{n}", n, False),
            (f"tp{n}_eager", n, True),
        ]
        for name, tp, eager in plan:
            if eager and args.graphs_only:
                continue
            runs[name] = run_engine(
                Path(tmp), tp, eager, args.steps, args.agree_tokens, args.profile, args.host_timing
            )
            out[name] = {k: v for k, v in runs[name].items() if k != "tokens"}
            emit()
    for many, one in ((f"tp{n}", "tp1"), (f"tp{n}_eager", "tp1_eager"), (f"tp{n}", f"tp{n}_eager")):
        if many not in runs or one not in runs:
            continue
        a, b = runs[one]["tokens"], runs[many]["tokens"]
        same = sum(x == y for s, t in zip(a, b) for x, y in zip(s, t))
        out[f"greedy_agreement_{many}_vs_{one}"] = round(same / sum(len(s) for s in a), 4)
        out[f"exact_sequences_{many}_vs_{one}"] = sum(s == t for s, t in zip(a, b))
    for many, one in ((f"tp{n}", "tp1"), (f"tp{n}_eager", "tp1_eager")):
        if many not in runs or one not in runs:
            continue
        for batch in (1, 32):
            out[f"speedup_b{batch}_{many}_vs_{one}"] = round(
                runs[one][f"step_ms_b{batch}"] / runs[many][f"step_ms_b{batch}"], 3
            )
    emit()


if __name__ == "__main__":
    main()
