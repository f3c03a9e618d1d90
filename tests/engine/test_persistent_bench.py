"""bench/engine_persistent.py's figures from a trace: the GPU runs it, so its arithmetic is held
here, on a timeline whose answers are known."""

from __future__ import annotations

import pytest
import torch

from bench.engine_persistent import DEFAULT_LAUNCHES, by_stage, launch_of


def test_launch_labels_read_as_plan_launch_arguments() -> None:
    from flashstack.engine.kernels.triton_decoder import plan_launch
    from flashstack.engine.models import ModelArgs

    assert launch_of("2/4/3/8192") == {
        "programs_per_sm": 2,
        "num_warps": 4,
        "stages": 3,
        "acc_elements": 8192,
    }
    assert launch_of("1/4/4/4096/c/s16") == {
        "programs_per_sm": 1,
        "num_warps": 4,
        "stages": 4,
        "acc_elements": 4096,
        "tagged": False,
        "splits": 16,
    }
    assert launch_of("1/4/4/4096/t")["tagged"] is True
    args = ModelArgs(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope={"rope_theta": 1e4, "rope_type": "default"},
    )
    for label in DEFAULT_LAUNCHES.split(","):
        launch = plan_launch(args, 132, **launch_of(label))
        assert launch.programs == 132 * launch.programs_per_sm
    assert plan_launch(args, 132, **launch_of("1/4/4/4096/s4")).splits == 4
    for bad in ("1/4/4", "1/4/4/4096/x", "1/4/4/4096/s"):
        with pytest.raises(ValueError):
            launch_of(bad)


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
