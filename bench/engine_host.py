"""The engine's host time per decode step, by part: docs/benchmarks.md, "Host time per step"."""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

import flashstack.engine.model_runner as model_runner
from flashstack.engine import LLM, SamplingParams


def _tiny_checkpoint(max_len: int) -> str:
    import transformers as tf

    cfg = tf.LlamaConfig(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=max_len,
    )
    path = tempfile.mkdtemp(prefix="flashstack-host-")
    tf.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


class Clock:
    """Accumulates wall time per named part."""

    def __init__(self) -> None:
        self.total: dict[str, float] = collections.defaultdict(float)

    def wrap(self, owner: Any, name: str, part: str) -> None:
        inner: Callable[..., Any] = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.total[part] += time.perf_counter() - t

        setattr(owner, name, timed)

    @contextlib.contextmanager
    def wrapping(self, parts: list[tuple[Any, str]]) -> Iterator[Clock]:
        """Time each (owner, method name) under its own name while inside; the originals are put
        back on the way out."""
        saved = [(owner, name, owner.__dict__.get(name)) for owner, name in parts]
        for owner, name in parts:
            self.wrap(owner, name, name)
        try:
            yield self
        finally:
            for owner, name, original in saved:
                if original is None:  # it came from the class: drop the instance's wrapper
                    delattr(owner, name)
                else:
                    setattr(owner, name, original)


def burst(steps: int) -> dict[str, Any]:
    """The host work of a burst's prompt steps (nano-vllm's workload: 256 prompts of 100-1,024
    tokens, 8,192 a step) and which of the first `steps` steps were queued behind the one in
    flight (Scheduler.lookahead) or ran one at a time, where the device waits for that work."""
    from bench.engine_throughput import workload

    llm = LLM(
        _tiny_checkpoint(4096),
        device="cpu",
        block_size=256,
        max_num_seqs=256,
        max_model_len=4096,
        kv_cache_memory_gb=4,
        show_progress=False,
    )
    engine = llm.engine
    queued: list[bool] = []
    launch = engine.runner.launch

    def noting(batch, after=None):
        queued.append(after is not None)
        return launch(batch, after)

    engine.runner.launch = noting
    prompts, outputs = workload(256, 100, 1024)
    for prompt, n in zip(prompts, outputs):
        tokens = [t % 500 + 5 for t in prompt]  # the tiny vocabulary
        engine.add_request(tokens, SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True))
    clock = Clock()
    parts = [(engine.scheduler, "schedule"), (engine.scheduler, "lookahead")]
    parts += [(engine.scheduler, "postprocess"), (engine.runner, "prepare")]
    per_step = []
    with clock.wrapping(parts):
        for _ in range(steps):
            before = sum(clock.total.values())
            engine.step()
            per_step.append(sum(clock.total.values()) - before)
    engine.abort_all()
    prompt_steps = [ms * 1e3 for ms in per_step[:16]]
    return {
        "host_ms_per_prompt_step (schedule, lookahead, prepare, postprocess)": [
            round(ms, 2) for ms in prompt_steps
        ],
        "steps_run_one_at_a_time": [i for i, behind in enumerate(queued[:steps]) if not behind],
        "steps": steps,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--burst",
        type=int,
        metavar="STEPS",
        help="instead: the first STEPS steps of nano-vllm's workload, its burst of prompts",
    )
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=1000)
    ap.add_argument("--decode", type=int, default=400, help="decode steps before measuring")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--block-size", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(1)  # the model's time is not the point: keep it from competing
    if args.burst:
        print(json.dumps(burst(args.burst), indent=2))
        return
    max_len = args.prompt + args.decode + args.steps + 8
    llm = LLM(
        _tiny_checkpoint(max_len),
        device="cpu",
        max_num_seqs=args.batch,
        block_size=args.block_size,
        max_num_batched_tokens=args.batch * args.prompt,
        show_progress=False,
    )
    engine = llm.engine
    clock = Clock()
    clock.wrap(engine.scheduler, "schedule", "schedule")
    clock.wrap(engine.scheduler, "lookahead", "lookahead")
    clock.wrap(engine.scheduler, "postprocess", "postprocess")
    clock.wrap(engine.runner, "prepare", "prepare")
    clock.wrap(engine.runner, "launch", "launch")
    clock.wrap(engine.runner, "execute", "execute")
    clock.wrap(engine.runner.model, "forward", "model forward")
    clock.wrap(engine.runner.model, "compute_logits", "logits")
    clock.wrap(model_runner, "sample_on_device", "sample")
    clock.wrap(model_runner.PendingStep, "wait", "wait")
    clock.wrap(engine, "_apply", "apply")
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(
        temperature=0.6, max_tokens=args.decode + args.steps + 4, ignore_eos=True
    )
    for _ in range(args.batch):
        engine.add_request(torch.randint(5, 500, (args.prompt,), generator=gen).tolist(), params)
    for _ in range(args.decode):
        engine.step()
    clock.total.clear()
    t = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step = (time.perf_counter() - t) / args.steps * 1e3
    ms = collections.defaultdict(float, {k: v / args.steps * 1e3 for k, v in clock.total.items()})
    device_work = ms["model forward"] + ms["logits"] + ms["sample"]  # the GPU's, in a real run
    host = {
        "schedule + lookahead": ms["schedule"] + ms["lookahead"],
        "prepare inputs (eager path; graph steps stage theirs)": ms["prepare"],
        "launch / execute, rest (sampling parameters, generators, token copy)": ms["launch"]
        + ms["execute"]
        - ms["prepare"]
        - device_work,
        "read back tokens": ms["wait"],
        "postprocess": ms["postprocess"],
        "apply, rest (stop strings, stream deltas)": ms["apply"] - ms["postprocess"],
    }
    host["step loop, rest"] = step - device_work - sum(host.values())
    out = {
        "batch": args.batch,
        "context": args.prompt + args.decode,
        "block_size": args.block_size,
        "step_ms": step,
        "model_ms (forward, logits and sampling: the device's work in a real run)": device_work,
        "host_ms": {k: round(v, 3) for k, v in host.items()},
        "host_ms_total": round(sum(host.values()), 3),
    }
    print(
        json.dumps(
            {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}, indent=2
        )
    )
    engine.abort_all()


if __name__ == "__main__":
    main()
