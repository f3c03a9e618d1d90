"""Peer access between GPUs of one host, and direct device-to-device copies on a stream.

With peer access enabled, a copy between two GPUs' buffers goes over NVLink / PCIe directly; without
it the driver silently stages through host memory, so `copy_peer` refuses rather than run slowly.
"""

from __future__ import annotations

import threading
import weakref

from flashstack.cuda.device import Device
from flashstack.cuda.memory import DeviceBuffer, copy_async
from flashstack.cuda.stream import Stream

_lock = threading.Lock()
# backend -> {(device, peer)}; weak, and on the object itself: a later backend may reuse a dead id()
_enabled: weakref.WeakKeyDictionary[object, set[tuple[int, int]]] = weakref.WeakKeyDictionary()


class PeerAccessError(RuntimeError):
    """Two devices cannot (or have not been set up to) reach each other's memory directly."""


def can_access_peer(device: Device, peer: Device) -> bool:
    """True when `device` can map `peer`'s memory (same host, P2P-capable link)."""
    if device.ordinal == peer.ordinal:
        return False
    return device.backend.can_access_peer(device.ordinal, peer.ordinal)


def enable_peer_access(device: Device, peer: Device, both_ways: bool = True) -> None:
    """Let `device` (and, by default, `peer`) read and write the other's memory; idempotent."""
    pairs = [(device, peer), (peer, device)] if both_ways else [(device, peer)]
    for a, b in pairs:
        if not can_access_peer(a, b):
            raise PeerAccessError(
                f"device {a.ordinal} cannot access device {b.ordinal} directly "
                "(different hosts, or no P2P link): copy through host memory instead"
            )
        with _lock:
            enabled = _enabled.setdefault(a.backend, set())
            if (a.ordinal, b.ordinal) in enabled:
                continue
            with b:  # the peer's primary context must exist before it can be mapped
                pass
            with a:  # access is granted to the current context
                a.backend.enable_peer_access(a.ordinal, b.ordinal)
            enabled.add((a.ordinal, b.ordinal))


def peer_access_enabled(device: Device, peer: Device) -> bool:
    """Whether `enable_peer_access(device, peer)` has run in this process."""
    with _lock:
        return (device.ordinal, peer.ordinal) in _enabled.get(device.backend, ())


def copy_peer(
    dst: DeviceBuffer, src: DeviceBuffer, stream: Stream, nbytes: int | None = None
) -> None:
    """Queue a direct copy from `src` on one GPU to `dst` on another, ordered on `stream`."""
    if dst.device.ordinal == src.device.ordinal:
        raise ValueError("copy_peer is for two devices; use copy_async on one device")
    here = stream.device.ordinal
    if here not in (dst.device.ordinal, src.device.ordinal):
        raise ValueError(f"the stream's device {here} must be the source's or the destination's")
    other = src.device if here == dst.device.ordinal else dst.device
    if not peer_access_enabled(stream.device, other):
        raise PeerAccessError(
            f"peer access from device {here} to device {other.ordinal} is not enabled: call "
            "enable_peer_access first (otherwise the driver stages the copy through host memory)"
        )
    copy_async(dst, src, stream, nbytes)  # unified addressing: the driver routes it peer to peer
