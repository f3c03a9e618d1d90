"""The inverse-CDF sampler draws from softmax(logits / T), row by row; temperature 0 is argmax."""

from __future__ import annotations

import pytest
import torch

ts = pytest.importorskip("flashstack.engine.kernels.triton_sampling")


def test_frequencies_match_softmax(device):
    torch.manual_seed(0)
    # 300 draws per temperature: under the interpreter each row is two programs
    vocab, rows = 8, 600
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf"), 1.5, -0.5], device=device)
    temps = torch.tensor([1.0, 0.5], device=device).repeat_interleave(rows // 2)
    logits = base.expand(rows, vocab).contiguous()
    ids = ts.sample_triton(logits, temps, seed=1234).cpu()
    for t, part in ((1.0, ids[: rows // 2]), (0.5, ids[rows // 2 :])):
        want = torch.softmax(base.cpu() / t, -1)
        got = torch.bincount(part, minlength=vocab).double() / part.numel()
        # ~4 standard errors of a frequency estimated from 300 draws: at T=0.5 the likeliest
        # token's 0.63 against T=1's 0.41 stays far outside it.
        assert torch.allclose(got, want.double(), atol=4 * (0.25 / part.numel()) ** 0.5), (
            t,
            got,
            want,
        )
    assert (ids != 5).all()  # a -inf logit is never drawn


def test_rows_across_chunks_and_seeds(device):
    # A vocabulary split over several programs per row; one clear winner per row at low temperature.
    torch.manual_seed(1)
    rows, vocab = 4, 9000
    logits = torch.randn(rows, vocab, device=device)
    winners = torch.tensor([3, 4500, 8999, 1024], device=device)
    logits[torch.arange(rows), winners] = 50.0
    temps = torch.full((rows,), 0.05, device=device)
    assert torch.equal(ts.sample_triton(logits, temps, seed=7), winners)
    hot = torch.full((rows,), 5.0, device=device)
    a = ts.sample_triton(logits, hot, seed=7)
    assert torch.equal(a, ts.sample_triton(logits, hot, seed=7))  # the seed fixes the draw
    draws = torch.stack([ts.sample_triton(logits, hot, seed=s) for s in range(8)])
    assert len(set(draws[:, 0].tolist())) > 1  # another seed, other noise


def test_frequencies_match_softmax_across_slices(device):
    # 40 entries in slices of 16: the draw first picks a slice by its mass, then scans it; a
    # slice of -inf only is never picked. The interpreter runs four programs a draw (~7 ms each):
    # 600 draws there, and the slices' masses checked as well as each entry's frequency.
    torch.manual_seed(3)
    vocab, rows = 40, 600 if device.type == "cpu" else 4000
    base = torch.randn(vocab, device=device)
    base[16:32] = float("-inf")
    logits = base.expand(rows, vocab).contiguous()
    ids = ts.sample_triton(logits, torch.full((rows,), 0.7, device=device), 99, chunk=16).cpu()
    want = torch.softmax(base.cpu() / 0.7, -1).double()
    got = torch.bincount(ids, minlength=vocab).double() / rows
    # ~4 standard errors of a frequency estimated from `rows` draws
    atol = 4 * (0.25 / rows) ** 0.5
    assert torch.allclose(got, want, atol=atol), (got, want)
    slices = [got[:16].sum() - want[:16].sum(), got[32:].sum() - want[32:].sum()]
    assert all(abs(d) < atol for d in slices), slices
    assert ((ids < 16) | (ids >= 32)).all()


def test_temperature_zero_rows_take_the_first_maximum(device):
    # greedy rows beside sampled ones in one call, ties across slices
    torch.manual_seed(4)
    logits = torch.randn(4, 100, device=device).to(torch.bfloat16)
    logits[0, [70, 20]] = 9.0
    logits[2, [5, 99]] = 9.0
    temps = torch.tensor([0.0, 1.0, 0.0, 0.8], device=device)
    ids = ts.sample_triton(logits, temps, 5, chunk=16)
    assert ids[0].item() == 20 and ids[2].item() == 5
    assert 0 <= ids[1].item() < 100 and 0 <= ids[3].item() < 100


def test_argmax_matches_torch_with_ties(device):
    # Rows split over several programs; ties inside a slice, across slices, -inf and a one-entry
    # row.
    torch.manual_seed(2)
    logits = torch.randn(5, 9000, device=device).to(torch.bfloat16)
    logits[1, [17, 4500, 8990]] = 9.0  # the first of three equal maxima, in different slices
    logits[2, [8000, 8001]] = 9.0
    logits[3, :] = float("-inf")
    logits[3, 6000] = -1.0
    logits[4, :] = 0.0  # all equal: index 0
    assert torch.equal(ts.argmax_triton(logits), logits.argmax(-1))
    assert ts.argmax_triton(logits)[1].item() == 17
    one = torch.tensor([[3.0]], device=device)
    assert ts.argmax_triton(one).tolist() == [0]


def test_graph_inputs_draw_as_the_host_values(device):
    """A decode graph's form: temperatures as float32 bit patterns in int64 and the seed a device
    tensor, read when the kernel runs; the same draws as the host's floats and integer seed, and a
    greedy row of the batch still its first maximum."""
    import numpy as np

    torch.manual_seed(4)
    rows, vocab = 6, 300
    logits = torch.randn(rows, vocab, device=device)
    temps = [0.6, 0.0, 1.0, 0.6, 2.0, 0.0]
    bits = np.asarray(temps, dtype=np.float32).view(np.int32).astype(np.int64)
    staged = torch.tensor(bits, device=device)
    for seed in (11, 2**31 - 2):
        want = ts.sample_triton(logits, torch.tensor(temps, device=device), seed, chunk=128)
        seed_on_device = torch.tensor([seed], dtype=torch.int64, device=device)
        got = ts.sample_triton(logits, staged, seed_on_device, chunk=128)
        assert torch.equal(got, want)
        assert got[1] == logits[1].argmax() and got[5] == logits[5].argmax()
