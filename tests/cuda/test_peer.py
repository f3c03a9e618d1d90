"""Peer access: enabled under the right context, idempotent, and copies refuse without it."""

from __future__ import annotations

import numpy as np
import pytest

from flashstack import cuda as fc
from flashstack.cuda import use_backend
from flashstack.cuda.peer import (
    PeerAccessError,
    can_access_peer,
    copy_peer,
    enable_peer_access,
    peer_access_enabled,
)
from tests.fakes.cuda_driver import FakeBackend


@pytest.fixture
def two() -> FakeBackend:
    backend = FakeBackend(devices=2)
    with use_backend(backend):
        yield backend


def test_enable_both_ways_under_each_device_context(two: FakeBackend) -> None:
    d0, d1 = fc.Device(0), fc.Device(1)
    assert can_access_peer(d0, d1) and not can_access_peer(d0, d0)
    enable_peer_access(d0, d1)
    enable_peer_access(d0, d1)  # idempotent: the driver is asked once per direction
    assert two.peers == {(0, 1), (1, 0)}
    assert two.ops("enable_peer_access") == ["enable_peer_access", "enable_peer_access"]
    assert not two.violations, two.violations
    assert two.ctx_get_current() is None, "the caller's (absent) context is restored"
    assert peer_access_enabled(d1, d0)


def test_copy_peer_moves_bytes_and_refuses_without_access(two: FakeBackend) -> None:
    d0, d1 = fc.Device(0), fc.Device(1)
    with fc.Stream(d0) as s0, fc.Stream(d1) as s1:
        with fc.DeviceBuffer(64, d0, s0) as src, fc.DeviceBuffer(64, d1, s1) as dst:
            two.host_view(src.ptr, 64)[:] = np.arange(64, dtype=np.uint8).tobytes()
            with pytest.raises(PeerAccessError, match="enable_peer_access"):
                copy_peer(dst, src, s0)
            enable_peer_access(d0, d1, both_ways=False)
            with pytest.raises(PeerAccessError):
                copy_peer(dst, src, s1)  # granted 0 -> 1 only: device 1's stream may not
            copy_peer(dst, src, s0)
            assert bytes(two.host_view(dst.ptr, 64)) == bytes(range(64))
            with pytest.raises(ValueError, match="two devices"):
                copy_peer(src, src, s0)


def test_no_peer_for_missing_device() -> None:
    with use_backend(FakeBackend(devices=1)):
        with pytest.raises(ValueError, match="does not exist"):
            enable_peer_access(fc.Device(0), fc.Device(1))


@pytest.mark.gpu
@pytest.mark.skipif(not fc.cuda_available() or fc.device_count() < 2, reason="needs 2 GPUs")
def test_real_peer_copy() -> None:
    d0, d1 = fc.Device(0), fc.Device(1)
    if not can_access_peer(d0, d1):
        pytest.skip("these GPUs have no P2P link")
    enable_peer_access(d0, d1)
    n = 1 << 20
    with fc.Stream(d0) as s, fc.Stream(d1) as s1:
        src, dst = fc.DeviceBuffer(n, d0, s), fc.DeviceBuffer(n, d1, s1)
        with fc.PinnedPool(d0) as pool, pool.acquire(n) as host, pool.acquire(n) as back:
            host.numpy(np.uint8)[:] = np.arange(n, dtype=np.uint64).astype(np.uint8)
            fc.copy_async(src, host, s)
            copy_peer(dst, src, s)
            fc.copy_async(back, dst, s)
            s.synchronize()
            assert np.array_equal(back.numpy(np.uint8), host.numpy(np.uint8))
        src.close()
        dst.close()
