"""A decode graph's input fetch (kernels/triton_step_inputs.py) from a ring of host slots
(engine/input_ring.py): a staged step is taken once and in order, its token references resolved;
a slot whose header is not the next step leaves the inputs as they are."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from flashstack.engine.input_ring import InputRing  # noqa: E402
from flashstack.engine.kernels.triton_step_inputs import fetch_step_inputs  # noqa: E402


def _fetch(ring: InputRing, packed: torch.Tensor, tokens: torch.Tensor, n: int, ids: int) -> None:
    # `ids` rows: their int32 context lengths and one-block tables lie past these tests' values
    lens = torch.zeros(ids, dtype=torch.int32, device=packed.device)
    tables = torch.zeros(ids, 1, dtype=torch.int32, device=packed.device)
    fetch_step_inputs(ring.host, ring.state, packed, tokens, lens, tables, n)  # pinned: the bus


def test_a_staged_step_is_taken_once_with_its_token_references_resolved(device):
    ring = InputRing(64, device)
    packed = torch.full((64,), -7, dtype=torch.int64, device=device)
    tokens = torch.tensor([100, 101, 102, 103], dtype=torch.int64, device=device)
    # ids: rows 0 and 1 take the last graph's tokens 2 and 0; row 2 the host's 55; then positions
    ring.write([-3, -1, 55, 10, 11, 12])
    _fetch(ring, packed, tokens, 6, 3)
    assert packed[:6].tolist() == [102, 100, 55, 10, 11, 12]
    assert packed[6:].eq(-7).all()  # past the step's values: untouched
    assert ring.state.tolist() == [1, 0]
    # replayed again with nothing new staged: the same inputs, the state where it was
    _fetch(ring, packed, tokens, 6, 3)
    assert packed[:6].tolist() == [102, 100, 55, 10, 11, 12] and ring.state.tolist() == [1, 0]


def test_negative_values_past_the_ids_are_kept(device):
    """Only the first n_ids values are ids: a temperature's float32 bits may be negative."""
    ring = InputRing(8, device)
    packed = torch.zeros(8, dtype=torch.int64, device=device)
    tokens = torch.tensor([9], dtype=torch.int64, device=device)
    ring.write([-1, -5, -1082130432])
    _fetch(ring, packed, tokens, 3, 1)
    assert packed[:3].tolist() == [9, -5, -1082130432]


def test_steps_are_taken_in_order_round_the_ring(device):
    """More steps than slots, each replayed after it is staged, and one step staged behind another
    not yet taken: each replay takes the next one, never a newer one."""
    ring = InputRing(4, device, slots=3)
    packed = torch.zeros(4, dtype=torch.int64, device=device)
    tokens = torch.zeros(1, dtype=torch.int64, device=device)
    for step in range(1, 8):
        ring.write([step, step * 2])
        _fetch(ring, packed, tokens, 2, 0)
        assert packed[:2].tolist() == [step, step * 2]
    ring.write([20, 21])
    ring.write([30, 31])
    _fetch(ring, packed, tokens, 2, 0)
    assert packed[:2].tolist() == [20, 21]
    _fetch(ring, packed, tokens, 2, 0)
    assert packed[:2].tolist() == [30, 31]
    assert ring.state.tolist() == [ring.written, 0]


def test_a_step_of_several_programs_moves_the_state_on_once(device):
    """Past one program's 1,024 values every program copies its part and reads the same slot; the
    last to arrive moves the state on, once."""
    n = 2500
    ring = InputRing(n, device)
    packed = torch.zeros(n, dtype=torch.int64, device=device)
    tokens = torch.arange(10, dtype=torch.int64, device=device) + 1000
    values = list(range(n))
    values[:3] = [-1, -10, 7]
    ring.write(values)
    _fetch(ring, packed, tokens, n, 3)
    assert packed[:3].tolist() == [1000, 1009, 7]
    assert torch.equal(packed[3:].cpu(), torch.arange(3, n))
    assert ring.state.tolist() == [1, 0]


def test_a_slot_is_never_longer_than_the_ring_holds(device):
    ring = InputRing(4, device)
    with pytest.raises(AssertionError, match="hold 4"):
        ring.write([0] * 5)


def _graphs(fetch: bool):
    from flashstack.engine.cuda_graphs import DecodeGraphs
    from flashstack.engine.kernels.attention import get_attention_backend
    from flashstack.engine.models.ops import TorchOps

    cpu = torch.device("cpu")  # staging is host code; the fetch runs in the interpreter
    backend = TorchOps(get_attention_backend("reference", cpu))
    return DecodeGraphs(torch.nn.Identity(), [], backend, 16, 64, 16, cpu, fetch_inputs=fetch)


@pytest.mark.parametrize("source", ["last-tokens", "gathered", "picked", "picked-elsewhere"])
def test_a_fetched_step_is_the_step_a_copy_stages(source):
    """DecodeGraphs with a ring: the step the fetch kernel leaves in `packed` is, value for value,
    the one the stream copy stages, the leading ids the previous tokens'. Rows picked from the
    last graph's tokens are referenced where they lie; tokens from elsewhere (a gather of some
    rows, another step's sampler) are copied where the next graph reads them."""
    gathered = source != "last-tokens"
    if torch.cuda.is_available():
        pytest.skip("DecodeGraphs staged on the host here; test_gpu.py runs the graphs")
    plain, fetched = _graphs(False), _graphs(True)
    previous = torch.tensor([41, 42, 43], dtype=torch.int64)
    fetched.last_tokens[:3] = previous
    ids_from = previous[[1, 0]] if gathered else fetched.last_tokens[:2]
    picks = [1, 0] if source.startswith("picked") else None
    if source == "picked":  # the rows of the last graph's tokens, left where they are
        ids_from = fetched.last_tokens[:3]
    elif source == "picked-elsewhere":
        ids_from = previous.clone()
    rows = dict(
        positions=[3, 9, 20],
        slot_mapping=[3, 25, 52],
        block_tables=[[0], [1], [2, 3]],
        context_lens=[4, 10, 21],
        temperatures=[0.0, 0.7, 0.0],
        seed=5,
    )
    taken = previous[[1, 0]].tolist() if gathered else previous[:2].tolist()
    bs = plain.stage(taken + [7], **rows)
    ids = fetched._ids_from_last_tokens([0, 0, 7], ids_from, picks)
    if source == "picked":
        assert ids == [-2, -1, 7] and fetched.last_tokens[:3].tolist() == [41, 42, 43]
    else:
        assert ids == [-1, -2, 7]
    assert fetched.stage(ids, **rows) == bs
    ring = fetched.ring
    n = fetched.packed_size(bs)
    lens, tables = fetched.context_lens[:bs], fetched.block_tables[:bs]
    fetch_step_inputs(ring.host, ring.state, fetched.packed, fetched.last_tokens, lens, tables, n)
    assert torch.equal(fetched.packed[:n], plain.packed[:n])
    # the int32 inputs the attention kernels read, which the copy path converts in the graph
    views = plain._views(bs)
    assert torch.equal(lens, views.context_lens.to(torch.int32))
    assert torch.equal(tables, views.block_tables.to(torch.int32))
    assert tables[2, :2].tolist() == [2, 3] and lens.tolist() == [4, 10, 21, 1]  # bucket 4


@pytest.mark.parametrize("sampled", [False, True], ids=["argmax", "sampler"])
def test_the_sampler_writes_the_steps_tokens_into_its_host_row(device, sampled):
    """With a ring, the graph's sampler writes each token to the device and into row
    (step number % slots) of the ring's tokens, where the host reads them without a copy."""
    from flashstack.engine.kernels.triton_sampling import argmax_triton, sample_triton

    ring = InputRing(8, device, slots=3, rows=4)
    ring.state[0] = 5  # the step the graph took: row 5 % 3
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(0)).to(device)
    out = torch.zeros(4, dtype=torch.int64, device=device)
    host = (ring.tokens, ring.state)
    if sampled:
        temps = torch.tensor([0.0, 0.9, 0.0], device=device)
        tokens = sample_triton(logits, temps, 3, out=out[:3], host_ring=host)
    else:
        tokens = argmax_triton(logits, out[:3], host)
        assert tokens.tolist() == logits.argmax(-1).tolist()
    assert tokens.data_ptr() == out.data_ptr()
    assert ring.tokens[2, :3].tolist() == tokens.tolist()
    assert ring.tokens[0].eq(0).all() and ring.tokens[1].eq(0).all()


def test_a_step_no_graph_holds_stages_nothing():
    """A step whose context no graph's grid holds fails before its inputs reach the ring: staged
    and never replayed, they would be the next replay's."""
    if torch.cuda.is_available():
        pytest.skip("DecodeGraphs staged on the host here; test_gpu.py runs the graphs")
    graphs = _graphs(True)
    with pytest.raises(StopIteration):
        graphs.run([1], [100], [100], [[0]], [graphs.max_model_len + 1])
    assert graphs.ring.written == 0 and graphs.ring.host[:, 0].eq(0).all()
