"""The benchmarks' host-part clock (bench/engine_host.Clock): it times while inside and puts every
method back on the way out, an instance's and a module's alike."""

from __future__ import annotations

import types

from bench.engine_host import Clock


class _Runner:
    def step(self) -> int:
        return 1


def test_wrapping_times_the_parts_and_restores_them() -> None:
    runner = _Runner()
    module = types.SimpleNamespace(sample=lambda: 2)
    original_sample = module.sample
    with Clock().wrapping([(runner, "step"), (module, "sample")]) as clock:
        assert runner.step() == 1 and module.sample() == 2
        runner.step = lambda: 3  # replaced inside (a bench's own hook): also put back
    assert set(clock.total) == {"step", "sample"} and all(v >= 0 for v in clock.total.values())
    assert "step" not in runner.__dict__ and runner.step() == 1
    assert module.sample is original_sample
