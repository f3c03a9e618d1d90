"""The persistent decoder against the layer-by-layer batch-1 ops, alone: docs/benchmarks.md,
"Engine small-model profile" ("Persistent decoder").

Each model's shape with random bf16 weights (bench/_shapes.py), one sequence at `--context`
tokens: its decoder stack (embedding to final norm, no head) captured in a CUDA graph and
replayed back to back, through the batch-1 ops (six kernels a layer) and through the persistent
decoder in each launch of `--launches`. Floor: the layers' weights and the KV cache read once
over the copy bandwidth. Each launch's output is checked against the ops' and its stalled waits
(`PersistentDecoder.stalls`) reported: a launch that disagrees is a bug, not a figure.

`--trace`: one more run of each launch with every work item's start, the end of its wait and its
end on the GPU's clock, summed up by stage: how long each stage holds up a layer (from the end of
the stage before to its own last item's end); the hop, from the stage before's last item's end to
the first wait that sees it (the count's release and acquire: what a kernel boundary was); an
item's mean time in its wait and after it; and its mean time from its start (first weight chunk,
then its wait) and from the moment the stage before had finished.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._roofline import H200_COPY_BW  # noqa: E402
from bench._shapes import LLAMA3_2_1B, LLAMA3_8B, QWEN3_0_6B, SMOLLM2_135M  # noqa: E402
from bench.engine_gemv import graph_us  # noqa: E402

SHAPES = {
    "smollm2-135m": SMOLLM2_135M,
    "qwen3-0.6b": QWEN3_0_6B,
    "llama3.2-1b": LLAMA3_2_1B,
    "llama3-8b": LLAMA3_8B,
}
BLOCK = 256
# programs per SM/warps/pipeline stages/weights per chunk[/t: the residual stream in tagged words,
# not after counts][/sN: N splits of each KV head's context]
DEFAULT_LAUNCHES = (
    "1/4/4/4096,1/4/4/4096/t,1/4/4/4096/s4,1/4/4/4096/s16,1/8/4/8192,2/4/4/4096,3/4/4/4096,"
    "1/4/2/4096,1/4/6/4096,2/4/3/8192"
)


def build(shape: dict, context: int):
    """The model, its KV caches (random, bf16) and one decode step's metadata at `context`."""
    from flashstack.engine.kernels.attention import AttentionMetadata
    from flashstack.engine.models import model_class
    from flashstack.engine.models.layers import RotaryEmbedding, rope_inv_freq

    cls = model_class(shape)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = cls(cls.args_from_hf(shape)).to(torch.bfloat16).eval()
        for p in model.parameters():
            if p.dim() > 1:
                torch.nn.init.normal_(p, std=0.02)
    for m in model.modules():  # built on the CPU and rounded above; the loader's fp32 on the GPU
        if isinstance(m, RotaryEmbedding):
            m.inv_freq = rope_inv_freq(model.args.head_dim, model.args.rope).to("cuda")
    a = model.args
    blocks = -(-context // BLOCK)
    caches = [
        torch.randn(blocks, 2, BLOCK, a.num_kv_heads, a.head_dim, device="cuda").to(torch.bfloat16)
        for _ in range(a.num_layers)
    ]
    last = context - 1
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([last], device="cuda"),
        block_tables=torch.arange(blocks, dtype=torch.int32, device="cuda")[None],
        context_lens=torch.tensor([context], dtype=torch.int32, device="cuda"),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device="cuda"),
        block_size=BLOCK,
        max_query_len=1,
        max_context_len=context,
        query_lens_host=[1],
        context_lens_host=[context],
    )
    return model, caches, meta


def replay_us(fn, iters: int) -> tuple[float, torch.Tensor]:
    """fn captured in a CUDA graph (after a warm-up run), replayed back to back: µs per replay,
    and the graph's output."""
    out = {}

    def once(_: int) -> None:
        out["y"] = fn()

    return graph_us(once, iters=1, reps=iters), out["y"]


@torch.inference_mode()
def measure(
    name: str,
    context: int,
    launches: list[str],
    iters: int,
    trace: bool = False,
):
    from flashstack.cuda.torch_interop import device_for
    from flashstack.engine.config import KernelOptions
    from flashstack.engine.kernels.attention import get_attention_backend
    from flashstack.engine.kernels.triton_decoder import PersistentDecoder, plan_launch
    from flashstack.engine.models.ops import TritonOps

    model, caches, meta = build(SHAPES[name], context)
    a, body = model.args, model.model
    layer_bytes = sum(
        p.numel() * p.element_size() for n, p in body.named_parameters() if "layers." in n
    )
    kv = context * a.num_layers * 2 * a.num_kv_heads * a.head_dim * 2
    floor_us = (layer_bytes + kv) / H200_COPY_BW * 1e6
    ids = torch.tensor([11], device="cuda")
    pos = torch.tensor([context - 1], device="cuda")
    device = torch.device("cuda")
    kernels = KernelOptions().resolved(device)  # as the engine runs them on this GPU
    ops = TritonOps(get_attention_backend("triton", device, kernels)).for_tokens(1)
    ops_us, want = replay_us(lambda: body(ids, pos, meta, caches, ops), iters)
    row = {
        "context": context,
        "floor_us": round(floor_us, 1),
        "ops_us": round(ops_us, 1),
        "ops_fraction": round(floor_us / ops_us, 3),
    }
    sms = device_for(device).sm_count
    for label in launches:
        launch = plan_launch(a, sms, **launch_of(label))
        decoder = PersistentDecoder(a, body.layers, caches, launch)

        def step(decoder=decoder):
            return run_decoder(decoder, body, ids, pos, meta)

        try:
            us, got = replay_us(step, iters)
            row[label] = {
                "us": round(us, 1),
                "fraction": round(floor_us / us, 3),
                "vs_ops": round(ops_us / us, 3),
                "round_robin": decoder.round_robin,
                "stalls": decoder.stalls(),
                "max_abs_diff_vs_ops": round(float((got.float() - want.float()).abs().max()), 4),
            }
            if trace:
                row[label]["trace"] = timeline(decoder, body, ids, pos, meta)
        except Exception as exc:  # one launch that does not compile or fit: say so, go on
            row[label] = {"error": repr(exc)[-500:]}
        print(name, label, row[label], flush=True)
    return row


STAGE_NAMES = ("qkv", "attention", "o", "gate_up", "down")


def run_decoder(decoder, body, ids, pos, meta, trace=None) -> torch.Tensor:
    """One step of the decoder stack through `decoder`: embedding, its run, the final norm."""
    from flashstack.engine.kernels.triton_elementwise import rmsnorm_triton

    h, (cos, sin) = body.embed(ids, pos)
    x = decoder.run(
        h,
        cos,
        sin,
        meta.slot_mapping,
        meta.block_tables[0],
        meta.context_lens,
        decoder.args.rms_norm_eps,
        trace=trace,
    )
    return rmsnorm_triton(x, body.norm.weight, body.norm.eps)[0]


def timeline(decoder, body, ids, pos, meta) -> dict:
    """One traced run of `decoder` (eager, after its graph's runs), summed up by stage."""
    trace = torch.zeros(decoder.trace_items(), 4, dtype=torch.int64, device="cuda")
    run_decoder(decoder, body, ids, pos, meta, trace)
    torch.cuda.synchronize()
    return by_stage(trace.cpu(), decoder.stage_items(), decoder.num_layers)


def by_stage(trace: torch.Tensor, counts: tuple[int, ...], layers: int) -> dict:
    """Items' [start, wait's end, end, program] rows (ns, in work-list order) by stage: µs a stage
    holds up a layer (its last item's end after the stage before's), the hop (the stage before's
    last end to this stage's first wait's end; layer 0's q/k/v, which wait for nothing, left out),
    an item's mean µs waiting and after its wait, from its start, and from when its stage could
    start."""
    begin = int(trace[:, 0].min())
    per_layer = sum(counts)
    held: dict[str, list[float]] = {s: [] for s in STAGE_NAMES}
    hop: dict[str, list[float]] = {s: [] for s in STAGE_NAMES}
    wait_us: dict[str, list[float]] = {s: [] for s in STAGE_NAMES}
    work_us: dict[str, list[float]] = {s: [] for s in STAGE_NAMES}
    item_us: dict[str, list[float]] = {s: [] for s in STAGE_NAMES}
    ready_us: dict[str, list[float]] = {s: [] for s in STAGE_NAMES}
    ready = begin
    for layer in range(layers):
        first = layer * per_layer
        for stage, n in zip(STAGE_NAMES, counts):
            items = trace[first : first + n]
            start, waited, end = items[:, 0], items[:, 1], items[:, 2]
            last = int(end.max())
            held[stage].append((last - ready) / 1e3)
            if layer or stage != "qkv":
                hop[stage].append((int(waited.min()) - ready) / 1e3)
            wait_us[stage] += ((waited - start) / 1e3).tolist()
            work_us[stage] += ((end - waited) / 1e3).tolist()
            item_us[stage] += ((end - start) / 1e3).tolist()
            ready_us[stage] += ((end - start.clamp_min(ready)) / 1e3).tolist()
            ready, first = last, first + n

    def mean(xs: list[float]) -> float | None:  # None: no such figure (one layer's q/k/v hop)
        return round(sum(xs) / len(xs), 2) if xs else None

    return {
        "span_us": round((int(trace[:, 2].max()) - begin) / 1e3, 1),
        "items_per_layer": dict(zip(STAGE_NAMES, counts)),
        "held_us_per_layer": {s: mean(v) for s, v in held.items()},
        "hop_us": {s: mean(v) for s, v in hop.items()},
        "item_wait_us": {s: mean(v) for s, v in wait_us.items()},
        "item_after_wait_us": {s: mean(v) for s, v in work_us.items()},
        "item_us": {s: mean(v) for s, v in item_us.items()},
        "item_us_from_ready": {s: mean(v) for s, v in ready_us.items()},
    }


def launch_of(label: str) -> dict[str, int | bool]:
    """A launch's label, per_sm/warps/stages/acc[/c|/t][/sN], as plan_launch's keyword arguments
    (c: the residual stream after counts, the default; t: in tagged words; sN: N splits)."""
    per_sm, warps, stages, acc, *flags = label.split("/")
    out: dict[str, int | bool] = {
        "programs_per_sm": int(per_sm),
        "num_warps": int(warps),
        "stages": int(stages),
        "acc_elements": int(acc),
    }
    for flag in flags:
        if flag in ("c", "t"):
            out["tagged"] = flag == "t"
        elif flag.startswith("s") and flag[1:].isdigit():
            out["splits"] = int(flag[1:])
        else:
            raise ValueError(f"launch {label!r}: unknown part {flag!r} (c, t, or s and a number)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", default="smollm2-135m,qwen3-0.6b,llama3.2-1b")
    ap.add_argument("--context", type=int, default=640, help="prompt 512 + 128 new tokens")
    ap.add_argument(
        "--launches",
        default=DEFAULT_LAUNCHES,
        help="comma-separated programs-per-SM/warps/pipeline-stages/weights-per-chunk, /t for "
        "a residual stream in tagged words instead of after counts (/c, the default), /sN for N "
        "splits",
    )
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--trace", action="store_true", help="each launch's timeline by stage")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    launches = args.launches.split(",")
    for label in launches:  # a typo fails here, not after the first model's runs
        launch_of(label)
    result = {"gpu": torch.cuda.get_device_name(), "copy_bw_tb_s": H200_COPY_BW / 1e12}
    for name in args.models.split(","):
        result[name] = measure(name, args.context, launches, args.iters, args.trace)
        text = json.dumps(result, indent=1)
        if args.json:
            args.json.write_text(text)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
