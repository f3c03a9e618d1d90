"""A decode step as two micro-batches (engine/overlap.py): the halves' split and the layers run
half by half give the whole step's hidden states and KV stores. The streams themselves run on the
GPU only (tests/engine/test_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from flashstack.engine.config import KernelOptions
from flashstack.engine.kernels.attention import AttentionMetadata, get_attention_backend
from flashstack.engine.models import LlamaForCausalLM
from flashstack.engine.models.llama import ModelArgs
from flashstack.engine.models.ops import TorchOps
from flashstack.engine.overlap import overlapped_hidden, split_decode

BLOCK = 4


def _model(qk_norm: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    args = ModelArgs(
        vocab_size=50,
        hidden_size=64,
        intermediate_size=96,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        qk_norm=qk_norm,
        qkv_bias=qk_norm,
        rope={"rope_theta": 1e4, "rope_type": "default"},
    )
    model = LlamaForCausalLM(args)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    return model.eval()


def _decode_meta(contexts: list[int]) -> AttentionMetadata:
    """One new token per sequence at position context - 1; sequence i owns blocks 4i .. 4i+3."""
    n = len(contexts)
    tables = torch.arange(n * 4, dtype=torch.int32).reshape(n, 4)
    slots = [
        int(tables[i, (c - 1) // BLOCK]) * BLOCK + (c - 1) % BLOCK for i, c in enumerate(contexts)
    ]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=tables,
        context_lens=torch.tensor(contexts, dtype=torch.int32),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        block_size=BLOCK,
        max_query_len=1,
        max_context_len=max(contexts),
        query_lens_host=[1] * n,
        context_lens_host=list(contexts),
    )


@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3"])
@pytest.mark.parametrize("at", [1, 3, 6])
@torch.inference_mode()
def test_the_halves_give_the_whole_steps_hidden_states_and_stores(qk_norm: bool, at: int) -> None:
    model = _model(qk_norm)
    args = model.args
    ops = TorchOps(get_attention_backend("reference", torch.device("cpu"), KernelOptions()))
    contexts = [5, 9, 2, 7, 3, 12, 1]
    ids = torch.tensor([3, 17, 41, 8, 0, 22, 49])
    positions = torch.tensor([c - 1 for c in contexts])
    meta = _decode_meta(contexts)
    torch.manual_seed(1)
    cache = torch.randn(len(contexts) * 4, 2, BLOCK, args.num_kv_heads, args.head_dim)
    whole_caches = [cache.clone() for _ in range(args.num_layers)]
    half_caches = [cache.clone() for _ in range(args.num_layers)]

    whole = model(ids, positions, meta, whole_caches, ops)
    halves = split_decode(ids, positions, meta, at)
    split = overlapped_hidden(model.model, halves, half_caches, ops, None)

    assert [h.input_ids.shape[0] for h in halves] == [at, len(contexts) - at]
    assert halves[1].meta.context_lens_host == contexts[at:]
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)
    for a, b in zip(half_caches, whole_caches):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert not torch.equal(whole_caches[0], cache)  # the step stored its new k/v


def test_a_step_splits_only_between_its_rows_and_only_when_it_decodes() -> None:
    ids, positions = torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long)
    meta = _decode_meta([2, 3, 4, 5])
    for at in (0, 4, 7):
        with pytest.raises(ValueError, match="cannot split"):
            split_decode(ids, positions, meta, at)
    prefill = AttentionMetadata.whole_prefill(4, BLOCK, torch.device("cpu"))
    with pytest.raises(ValueError, match="cannot split"):
        split_decode(ids, positions, prefill, 2)


def test_a_negative_row_count_is_refused() -> None:
    with pytest.raises(ValueError, match="decode_overlap_rows"):
        KernelOptions(decode_overlap_rows=-1)
