"""bench/engine_persistent.py's figures from a trace: the GPU runs it, so its arithmetic is held
here, on a timeline whose answers are known."""

from __future__ import annotations

import pytest
import torch

from bench.engine_persistent import DEFAULT_LAUNCHES, by_stage, launch_of


def test_launch_labels_read_as_plan_launch_arguments() -> None:
    assert launch_of("2/4/3/8192") == (2, 4, 3, 8192, True)
    assert launch_of("1/4/4/4096/c") == (1, 4, 4, 4096, False)
    assert all(len(launch_of(label)) == 5 for label in DEFAULT_LAUNCHES.split(","))
    with pytest.raises(ValueError):
        launch_of("1/4/4")


def test_a_timeline_by_stage() -> None:
    """Two layers of one item a stage, each item 1 µs in its wait and 2 µs after it, the next
    stage's item starting as the one before ends: every hop 1 µs, every stage 3 µs a layer."""
    rows, t = [], 0
    for _ in range(2 * 5):
        rows.append([t, t + 1000, t + 3000, 0])
        t += 3000
    got = by_stage(torch.tensor(rows), (1, 1, 1, 1, 1), 2)
    assert got["span_us"] == 30.0
    for figure, want in (
        ("held_us_per_layer", 3.0),
        ("hop_us", 1.0),
        ("item_wait_us", 1.0),
        ("item_after_wait_us", 2.0),
        ("item_us", 3.0),
    ):
        assert set(got[figure].values()) == {want}, figure


def test_a_hop_is_the_first_wait_after_the_stage_before() -> None:
    """Two q/k/v items of one layer, the second's wait ending 0.5 µs after the first's: the
    attention item's hop counts from the later q/k/v end, and layer 0's q/k/v, which wait for
    nothing, have no hop."""
    ns = [
        [0, 100, 1000, 0],  # q/k/v
        [0, 600, 2000, 1],  # q/k/v, the stage's last end
        [500, 2700, 4000, 2],  # attention: its wait ends 0.7 µs after the stage before's end
        [3000, 4500, 5000, 0],  # o
        [3000, 5200, 6000, 1],  # gate/up
        [3000, 6300, 7000, 2],  # down
    ]
    got = by_stage(torch.tensor(ns), (2, 1, 1, 1, 1), 1)
    assert got["hop_us"]["attention"] == 0.7
    assert got["hop_us"]["o"] == 0.5 and got["hop_us"]["gate_up"] == 0.2
    assert got["hop_us"]["qkv"] is None and got["items_per_layer"]["qkv"] == 2
