"""The batch-1 decoder ops (norms, SiLU-and-mul and residual adds inside the GEMVs) against the
plain torch ops and the reference attention: same hidden states, same KV written."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

pytest.importorskip("triton")

from flashstack.engine.config import KernelOptions  # noqa: E402
from flashstack.engine.kernels.attention import (  # noqa: E402
    AttentionBackend,
    AttentionMetadata,
    get_attention_backend,
)
from flashstack.engine.models import LlamaForCausalLM, ModelArgs  # noqa: E402
from flashstack.engine.models.ops import Batch1Ops, TorchOps, TritonOps  # noqa: E402

BLOCK = 4


def _args(qk_norm: bool) -> ModelArgs:
    return ModelArgs(
        vocab_size=50,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        qk_norm=qk_norm,
        qkv_bias=qk_norm,
        rope={"rope_theta": 1e4, "rope_type": "default"},
    )


def _model(qk_norm: bool, device) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(_args(qk_norm)).to(device)
    with torch.no_grad():
        for p in model.parameters():  # norms and biases away from 1 and 0 too
            p.copy_(
                torch.randn_like(p) * 0.2
                + (1.0 if p.dim() == 1 and p.shape[0] in (16, 64) else 0.0)
            )
    return model.eval()


def _random_model(args: ModelArgs, device) -> LlamaForCausalLM:
    """A model of `args` whose weights are random and norms near 1."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(args).to(device)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    return model.eval()


def _meta(context: int, device) -> AttentionMetadata:
    """One sequence, one new token at position context - 1, blocks 0, 1, ... in order."""
    blocks = -(-context // BLOCK)
    return AttentionMetadata(
        slot_mapping=torch.tensor([context - 1], device=device),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=device)[None],
        context_lens=torch.tensor([context], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=device),
        block_size=BLOCK,
        max_query_len=1,
        max_context_len=context,
        query_lens_host=[1],
        context_lens_host=[context],
    )


def _triton_backend() -> AttentionBackend:
    from flashstack.engine.kernels.triton_attention import (
        decode_grid_bounds,
        paged_attention_triton,
        store_kvcache_triton,
    )

    return AttentionBackend(
        "triton", store_kvcache_triton, paged_attention_triton, decode_grid_bounds
    )


def _persistent_ops(**options) -> Batch1Ops:
    """The batch-1 ops with the persistent decoder on (and these other kernel options)."""
    kernels = dataclasses.replace(KernelOptions(), persistent_decoder=True, **options)
    return Batch1Ops(dataclasses.replace(_triton_backend(), kernels=kernels))


def _step_matches_torch_ops(model, ops, device, context, blocks, block=BLOCK, meta=None) -> None:
    """One decode step (the token at context - 1) through `ops` and through the plain torch ops,
    each over its copy of one random cache: the same hidden state and the same KV written.
    `meta()` makes the step's metadata (default: blocks 0, 1, ... in order)."""
    args = model.args
    caches = [
        torch.randn(blocks, 2, block, args.num_kv_heads, args.head_dim, device=device)
        for _ in range(args.num_layers)
    ]
    mine = [c.clone() for c in caches]
    meta = meta or (lambda: _meta(context, device))
    ids, pos = torch.tensor([11], device=device), torch.tensor([context - 1], device=device)
    want = model(ids, pos, meta(), caches, TorchOps(get_attention_backend("reference", device)))
    got = model(ids, pos, meta(), mine, ops)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for m, c in zip(mine, caches):
        torch.testing.assert_close(m, c, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("qk_norm", [False, True])  # Llama; Qwen3 (q/k-norm, and a q/k/v bias)
@torch.inference_mode()
def test_batch1_step_matches_torch_ops(device, qk_norm):
    model = _model(qk_norm, device)
    ops = TritonOps(_triton_backend()).for_tokens(1)
    assert isinstance(ops, Batch1Ops), (
        "a one-token step on the Triton backend takes the batch-1 ops"
    )
    _step_matches_torch_ops(model, ops, device, context=7, blocks=3)


@pytest.mark.parametrize("qk_norm", [False, True])
@torch.inference_mode()
def test_fused_mlp_steps_match_torch_ops(device, qk_norm, monkeypatch):
    """kernels.fused_mlp: each layer's MLP in one kernel, its float32 row taken in by the next
    layer's q/k/v and o GEMVs and by the final norm: step after step (the rows zeroed as each
    starts), the plain ops' hidden state and KV."""
    from flashstack.engine.kernels import triton_mlp

    kernels = dataclasses.replace(KernelOptions(), fused_mlp=True)
    ops = Batch1Ops(dataclasses.replace(_triton_backend(), kernels=kernels))
    calls, fused = [], triton_mlp.fused_mlp_triton

    def spy(*a, **kw):
        calls.append(a[-2])  # the row it adds into
        return fused(*a, **kw)

    monkeypatch.setattr(triton_mlp, "fused_mlp_triton", spy)
    model = _model(qk_norm, device)
    for context in (7, 8):
        _step_matches_torch_ops(model, ops, device, context=context, blocks=3)
    layers = model.args.num_layers
    assert len(calls) == 2 * layers and len({row.data_ptr() for row in calls}) == layers
    assert ops._pending is None


@torch.inference_mode()
def test_fused_mlp_says_which_mlps_it_leaves_to_the_gemvs(device, monkeypatch, caplog):
    """kernels.fused_mlp on a model whose MLPs carry biases: the GEMVs run them, the step is the
    plain ops', and the log says why, once."""
    from flashstack.engine.kernels import triton_mlp

    def never(*a, **kw):
        raise AssertionError("an MLP with biases went to the fused kernel")

    monkeypatch.setattr(triton_mlp, "fused_mlp_triton", never)
    kernels = dataclasses.replace(KernelOptions(), fused_mlp=True)
    ops = Batch1Ops(dataclasses.replace(_triton_backend(), kernels=kernels))
    model = _random_model(dataclasses.replace(_args(False), mlp_bias=True), device)
    with caplog.at_level("INFO", logger="flashstack.engine.models.ops"):
        _step_matches_torch_ops(model, ops, device, context=7, blocks=3)
    said = [r.getMessage() for r in caplog.records if "fused_mlp" in r.getMessage()]
    assert said == ["kernels.fused_mlp off for this model: MLP biases"]


def _persistent_cases() -> list:
    # The interpreter (~3.5 s a case) runs a half fraction of the eight: each pair of the three
    # switches meets in all four of its combinations. A GPU runs all eight.
    cases = []
    for tagged, programs_per_sm, qk_norm in itertools.product([True, False], [1, 3], [False, True]):
        half = not (tagged ^ (programs_per_sm == 1) ^ qk_norm)  # even parity
        gpu_only = pytest.mark.skipif(
            not torch.cuda.is_available(), reason="the fraction's other half: GPUs only"
        )
        marks = () if half else gpu_only
        ids = f"{'tagged' if tagged else 'counts'}-"
        ids += f"{'round-robin' if programs_per_sm == 1 else 'atomic-queue'}-{qk_norm}"
        cases.append(pytest.param(tagged, programs_per_sm, qk_norm, marks=marks, id=ids))
    return cases


@pytest.mark.parametrize("tagged,programs_per_sm,qk_norm", _persistent_cases())
@torch.inference_mode()
def test_persistent_decoder_matches_torch_ops(
    device, qk_norm, programs_per_sm, tagged, monkeypatch
):
    """Every layer in one persistent kernel (kernels.persistent_decoder): the hidden state and
    the KV written as the plain ops give them, over a context long enough for several splits,
    whether programs take items round-robin or from the atomic queue, and the residual stream
    is read in tagged words or after the counts."""
    from flashstack.engine.kernels import triton_decoder

    ops = _persistent_ops(
        persistent_decoder_programs_per_sm=programs_per_sm, persistent_decoder_tagged=tagged
    )
    runs, run = [], triton_decoder.PersistentDecoder.run

    def spy(decoder, *a, **kw):
        runs.append((decoder.launch, decoder.round_robin))
        out = run(decoder, *a, **kw)
        assert decoder.stalls() == 0, "a wait gave up"
        return out

    monkeypatch.setattr(triton_decoder.PersistentDecoder, "run", spy)
    _step_matches_torch_ops(_model(qk_norm, device), ops, device, context=300, blocks=80)
    ((launch, round_robin),) = runs
    # several programs an SM start from the atomic queue (the interpreter never leaves it)
    assert round_robin == (programs_per_sm == 1) and launch.splits > 1


@pytest.mark.parametrize("tagged", [True, False], ids=["tagged", "counts"])
@torch.inference_mode()
def test_persistent_decoder_readies_itself_for_the_next_step(device, tagged):
    """Step after step through one decoder: the last program out of each run zeroes the counts
    and the work queue for the next (no memset before each launch) and moves the epoch the
    residual stream's words are tagged with on by one, and every step matches the plain ops."""
    model = _model(True, device)
    args = model.args
    ops = _persistent_ops(persistent_decoder_programs_per_sm=3, persistent_decoder_tagged=tagged)
    plain = TorchOps(get_attention_backend("reference", device))
    caches = [
        torch.randn(80, 2, BLOCK, args.num_kv_heads, args.head_dim, device=device)
        for _ in range(args.num_layers)
    ]
    mine = [c.clone() for c in caches]
    for step, context in enumerate((200, 201, 202), start=1):
        ids = torch.tensor([7 + step], device=device)
        pos = torch.tensor([context - 1], device=device)
        want = model(ids, pos, _meta(context, device), caches, plain)
        got = model(ids, pos, _meta(context, device), mine, ops)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        (decoder,) = ops._decoders.values()
        *stages, queue, exits, epoch, stalls = decoder.counts.tolist()
        assert stages == [0] * (5 * args.num_layers) and (queue, exits) == (0, 0)
        assert (epoch, stalls) == (step, 0)


@torch.inference_mode()
def test_row_parallel_projections_carry_the_residual_into_the_all_reduce(device):
    """Under tensor parallelism o and down are row-parallel: each rank's GEMV writes a partial sum,
    the driver's with the residual, and the all-reduce gives the new residual. A one-rank gloo group
    runs that path for real (its all-reduce is the identity), against the plain model."""
    import torch.distributed as dist

    from flashstack.engine.models.parallel import RowParallelLinear
    from flashstack.engine.tp.group import TensorParallel

    plain = _model(False, device)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        tp = TensorParallel(0, 1, torch.device(device), dist.group.WORLD)
        shard = LlamaForCausalLM(_args(False), tp).to(device).eval()
        shard.load_state_dict(plain.state_dict())
        assert isinstance(shard.model.layers[0].mlp.down_proj, RowParallelLinear)
        args, context = plain.args, 6
        caches = [
            torch.randn(3, 2, BLOCK, args.num_kv_heads, args.head_dim, device=device)
            for _ in range(args.num_layers)
        ]
        shard_caches = [c.clone() for c in caches]
        ids, pos = torch.tensor([5], device=device), torch.tensor([context - 1], device=device)
        want = plain(
            ids,
            pos,
            _meta(context, device),
            caches,
            TorchOps(get_attention_backend("reference", device)),
        )
        got = shard(ids, pos, _meta(context, device), shard_caches, Batch1Ops(_triton_backend()))
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("hidden", "intermediate", "heads", "kv_heads", "head_dim"),
    [(576, 1536, 9, 3, 64), (1024, 3072, 16, 8, 128), (2048, 8192, 32, 8, 64)],
    ids=["smollm2-135m", "qwen3-0.6b", "llama3.2-1b"],
)
@pytest.mark.parametrize("programs_per_sm", [1, 2, 3])
def test_persistent_decoder_spreads_rows_over_every_program(
    hidden, intermediate, heads, kv_heads, head_dim, programs_per_sm
):
    """Each projection's rows go to the programs in as few rounds of items as MAX_ITEM_ROWS
    allows, evenly: no program has more than its share plus a row a round (rows in powers of two
    left Qwen3-0.6B's gate/up in 96 items of 64 rows on 132 programs)."""
    from flashstack.engine.kernels.triton_decoder import MAX_ITEM_ROWS, plan_launch

    args = dataclasses.replace(
        _args(False),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
    )
    launch = plan_launch(args, 132, programs_per_sm)
    programs = launch.programs
    outputs = ((heads + 2 * kv_heads) * head_dim, hidden, 2 * intermediate, hidden)
    for n, rows in zip(outputs, launch.rows):
        rounds = math.ceil(n / (MAX_ITEM_ROWS * programs))
        assert rows <= MAX_ITEM_ROWS and math.ceil(math.ceil(n / rows) / programs) == rounds
        assert rounds * rows <= math.ceil(n / programs) + rounds, (n, rows)


def test_persistent_decoder_says_what_it_cannot_run(device):
    """Models the persistent decoder leaves to the layer-by-layer ops, each with its reason."""
    from flashstack.engine.kernels.triton_decoder import unsupported

    model = _model(False, device)
    args, layers = model.args, model.model.layers
    caches = [torch.zeros(2, 2, BLOCK, args.num_kv_heads, args.head_dim) for _ in layers]
    assert unsupported(args, layers, caches) is None
    assert "sliding" in unsupported(dataclasses.replace(args, sliding_window=8), layers, caches)
    assert "fp8" in unsupported(args, layers, [c.to(torch.float8_e4m3fn) for c in caches])
    assert "fp8" in unsupported(dataclasses.replace(args, quantization="fp8"), layers, caches)
    odd = dataclasses.replace(args, head_dim=24)
    assert "head_dim" in unsupported(odd, layers, caches)
    layers[1].post_attention_layernorm.weight.data = torch.ones(args.hidden_size).double()
    assert "dtype" in unsupported(args, layers, caches)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "context"),
    [(4, 4, 16, 1), (4, 1, 32, 130), (6, 2, 16, 513)],
    ids=["mha-first-token", "mqa", "gqa3-past-the-splits"],
)
@torch.inference_mode()
def test_persistent_decoder_over_scattered_blocks(device, heads, kv_heads, head_dim, context):
    """Other head layouts, a first token (nothing cached yet) and a context longer than its
    splits hold at the fewest tokens each, over blocks in random order."""
    args = dataclasses.replace(
        _args(True), num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim
    )
    block, blocks = 16, 40
    order = torch.randperm(blocks)[: -(-context // block)].to(torch.int32).to(device)
    last = context - 1
    slot = int(order[last // block]) * block + last % block

    def meta() -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=torch.tensor([slot], device=device),
            block_tables=order[None],
            context_lens=torch.tensor([context], dtype=torch.int32, device=device),
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=device),
            block_size=block,
            max_query_len=1,
            max_context_len=context,
            query_lens_host=[1],
            context_lens_host=[context],
        )

    ops = _persistent_ops()
    model = _random_model(args, device)
    _step_matches_torch_ops(model, ops, device, context, blocks, block, meta)
    (decoder,) = ops._decoders.values()
    assert decoder is not None and decoder.stalls() == 0


@torch.inference_mode()
def test_a_persistent_decoder_that_disagrees_is_dropped(device, monkeypatch, caplog):
    """The decoder's first run is checked against the layers one by one: a wrong one (here, one
    whose output is made wrong) is logged and dropped, and the step gets the layers' answer."""
    import logging

    from flashstack.engine.kernels import triton_decoder

    run = triton_decoder.PersistentDecoder.run
    monkeypatch.setattr(
        triton_decoder.PersistentDecoder, "run", lambda *a, **kw: run(*a, **kw) + 1.0
    )
    ops = _persistent_ops()
    with caplog.at_level(logging.ERROR):
        _step_matches_torch_ops(_model(False, device), ops, device, context=7, blocks=3)
    assert list(ops._decoders.values()) == [None]
    assert "differs from the layer-by-layer ops" in caplog.text


@pytest.mark.parametrize("splits", [2, 16])
@torch.inference_mode()
def test_persistent_decoder_with_other_split_counts(device, splits, monkeypatch):
    """Fewer or more splits of each KV head's context than MAX_SPLITS (bench/engine_persistent.py
    sweeps them): the o rows merge every one the launch has."""
    import functools

    from flashstack.engine.kernels import triton_decoder

    monkeypatch.setattr(
        triton_decoder, "plan_launch", functools.partial(triton_decoder.plan_launch, splits=splits)
    )
    ops = _persistent_ops()
    _step_matches_torch_ops(_model(True, device), ops, device, context=300, blocks=80)
    (decoder,) = ops._decoders.values()
    assert decoder is not None and decoder.launch.splits == splits


@torch.inference_mode()
def test_persistent_decoder_streams_rows_of_several_chunks(device, monkeypatch):
    """Rows longer than a chunk (64 weights a chunk here): the norm's mean square over several
    chunks, the SiLU and merge prologues chunk by chunk, through the pipelined loop."""
    import functools

    from flashstack.engine.kernels import triton_decoder

    monkeypatch.setattr(
        triton_decoder,
        "plan_launch",
        functools.partial(triton_decoder.plan_launch, acc_elements=64),
    )
    args = dataclasses.replace(
        _args(True), hidden_size=128, intermediate_size=192, num_heads=4, head_dim=32
    )
    ops = _persistent_ops(persistent_decoder_programs_per_sm=3)
    _step_matches_torch_ops(_random_model(args, device), ops, device, context=150, blocks=40)
    (decoder,) = ops._decoders.values()
    assert decoder is not None and max(decoder.launch.chunks) == 64
