"""A rank's part of the vocabulary-parallel embedding: its rows for ids in its range, zeros
elsewhere."""

from __future__ import annotations

import pytest
import torch

te = pytest.importorskip("flashstack.engine.kernels.triton_embedding")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# one program per token; several, the last one partial
@pytest.mark.parametrize("hidden", [64, 1500])
def test_rows_in_range_zeros_elsewhere(device, dtype, hidden):
    torch.manual_seed(0)
    start, stop = 100, 160
    weight = torch.randn(stop - start, hidden, device=device).to(dtype)
    ids = torch.tensor([99, 100, 130, 159, 160, 0, 5000], device=device)
    mine = (ids >= start) & (ids < stop)
    want = torch.nn.functional.embedding(torch.where(mine, ids - start, 0), weight) * mine[
        :, None
    ].to(dtype)
    assert torch.equal(te.shard_embedding_triton(ids, weight, start, stop), want)
    # a staging buffer's old values
    out = torch.full((ids.numel(), hidden), 7.0, device=device, dtype=dtype)
    assert te.shard_embedding_triton(ids, weight, start, stop, out=out) is out
    assert torch.equal(out, want)
