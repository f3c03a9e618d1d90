"""The engine on flashstack.cuda: capability-dependent kernel choices read the device through the
layer, and a step's host <-> device staging goes through its pinned pool."""

from __future__ import annotations

import pytest
import torch

from flashstack import cuda as fc
from flashstack.engine.config import KernelOptions
from flashstack.engine.staging import to_device, to_device_parts, to_host
from tests.engine.helpers import greedy
from tests.fakes.cuda_driver import FakeBackend

on_gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and fc.cuda_available()),
    reason="needs a CUDA device usable through flashstack.cuda",
)


@pytest.mark.parametrize(("cc", "hopper"), [((8, 0), False), ((9, 0), True)])
def test_hopper_kernel_options_follow_the_layers_compute_capability(cc, hopper) -> None:
    with fc.use_backend(FakeBackend(cc=cc)):
        options = KernelOptions().resolved(torch.device("cuda", 0))
    assert options.pdl == options.decode_tma == hopper
    assert options.triton_gemv and options.decode_qkv  # not capability-dependent


def test_staging_on_the_cpu_is_plain_tensors() -> None:
    assert to_device([3, 4], torch.int64, torch.device("cpu")).tolist() == [3, 4]
    out = torch.zeros(4, dtype=torch.int32)
    assert to_device([7, 8], torch.int32, torch.device("cpu"), out=out).tolist() == [7, 8]
    assert out.tolist() == [7, 8, 0, 0]
    assert to_device([[1, 2], [3, 4]], torch.int32, torch.device("cpu")).tolist() == [
        [1, 2],
        [3, 4],
    ]
    assert to_host(torch.arange(3)) is None


PARTS = [
    ([5, -6, 7], torch.int64),
    ([[1, 2], [3, 4]], torch.int32),
    ([], torch.int64),
    ([9], torch.int32),
    ([2**40], torch.int64),  # after a 4-byte part: its view starts aligned all the same
]


def _check_parts(device: torch.device) -> None:
    out = to_device_parts(PARTS, device)
    assert [t.dtype for t in out] == [dtype for _, dtype in PARTS]
    assert [t.device.type for t in out] == [device.type] * len(PARTS)
    assert [t.tolist() for t in out] == [values for values, _ in PARTS]
    assert out[1].shape == (2, 2) and out[2].shape == (0,)


def test_parts_travel_in_one_buffer_on_the_cpu() -> None:
    _check_parts(torch.device("cpu"))


@pytest.mark.gpu
@on_gpu
def test_parts_travel_in_one_copy_on_the_gpu() -> None:
    from flashstack.cuda.torch_interop import staging

    shared = staging(torch.device("cuda"))
    copies = shared.copies
    _check_parts(torch.device("cuda"))
    assert shared.copies - copies == 1


@pytest.mark.gpu
@on_gpu
def test_capability_and_sm_count_through_the_layer_agree_with_torch() -> None:
    from flashstack.cuda.torch_interop import device_for

    dev = device_for(torch.device("cuda"))
    assert dev is fc.shared_device(torch.cuda.current_device())
    assert dev.compute_capability == torch.cuda.get_device_capability(0)
    assert dev.sm_count == torch.cuda.get_device_properties(0).multi_processor_count
    options = KernelOptions().resolved(torch.device("cuda"))
    assert options.pdl == options.decode_tma == (dev.compute_capability >= (9, 0))


@pytest.mark.gpu
@on_gpu
def test_staging_copies_land_and_reuse_pool_blocks() -> None:
    from flashstack.cuda.torch_interop import HostStaging

    staging = HostStaging(fc.shared_device(0))
    for i in range(50):
        assert staging.to_device(list(range(i, i + 100)), torch.int64).tolist() == list(
            range(i, i + 100)
        )
    assert staging.copies == 50 and staging.pool.stats["misses"] <= 2  # one or two blocks in turn
    out = torch.zeros(8, dtype=torch.int32, device="cuda")
    staging.to_device([5, 6, 7], torch.int32, out=out)
    assert out.tolist() == [5, 6, 7, 0, 0, 0, 0, 0]
    assert staging.to_device([[1, 2], [3, 4]], torch.int32).tolist() == [[1, 2], [3, 4]]  # tables
    assert staging.to_device([], torch.int64).shape == (0,)
    first, second = (staging.to_host(torch.arange(i, i + 10, device="cuda")) for i in (0, 10))
    assert second.wait() == list(range(10, 20)) and first.wait() == list(range(10))


@pytest.mark.gpu
@on_gpu
def test_staging_never_rewrites_a_block_a_queued_copy_still_reads() -> None:
    from flashstack.cuda.torch_interop import HostStaging

    staging = HostStaging(fc.shared_device(0))
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU work ahead of both copies
    first = staging.to_device([1] * 1000, torch.int64)
    second = staging.to_device([2] * 1000, torch.int64)  # first's block is still being read
    assert staging.pool.stats == {"hits": 0, "misses": 2, "bytes_held": 2 * 8192}
    assert first.tolist() == [1] * 1000 and second.tolist() == [2] * 1000


@pytest.mark.gpu
@on_gpu
def test_engine_steps_stage_through_the_pinned_pool(tiny_model_dir) -> None:
    from flashstack.cuda.torch_interop import staging
    from flashstack.engine import LLM

    llm = LLM(tiny_model_dir, block_size=16, device="cuda", dtype="float32", show_progress=False)
    assert llm.engine.runner.graphs is not None
    shared = staging(torch.device("cuda"))
    copies, blocks = shared.copies, shared.pool.stats["misses"]
    out = llm.generate(["def main():", "import os"], greedy(24))
    assert all(len(o.token_ids) == 24 for o in out)
    # every step's inputs and sampled tokens: many copies, a handful of blocks in rotation
    assert shared.copies - copies >= 2 * 24
    assert shared.pool.stats["misses"] - blocks <= 16
