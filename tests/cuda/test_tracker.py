"""Tracker: counts by kind and site, reports, and the leak-check fixture."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flashstack import cuda as fc
from flashstack.cuda import tracker
from tests.fakes.cuda_driver import FakeBackend

REPO = Path(__file__).resolve().parents[2]


def test_counts_by_kind_and_site(fake: FakeBackend) -> None:
    s = fc.Stream()
    bufs = [fc.DeviceBuffer(8, stream=s) for _ in range(3)]
    assert tracker.live() == {"stream": 1, "device_buffer": 3}
    sites = tracker.live_by_site()
    assert any(
        kind == "device_buffer" and "test_tracker.py" in site and n == 3
        for (kind, site), n in sites.items()
    )
    assert "3 x device_buffer" in tracker.report()
    for b in bufs:
        b.close()
    s.close()
    assert tracker.total() == 0 and tracker.report() == "no live CUDA resources"


def test_stack_capture_is_opt_in(fake: FakeBackend) -> None:
    tracker.capture_stacks(True)
    try:
        ev = fc.Event()
        assert "test_stack_capture_is_opt_in" in tracker.report()
    finally:
        tracker.capture_stacks(False)
    ev.close()


def test_leak_check_raises_for_a_leak_and_passes_clean(fake: FakeBackend) -> None:
    keep = []
    with pytest.raises(tracker.LeakError, match="event"):
        with tracker.leak_check():
            keep.append(fc.Event())
    keep[0].close()
    with tracker.leak_check():
        fc.Event()  # collected inside the check: not a leak


def test_fixture_fails_a_leaking_test(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(
        "from tests.fakes.cuda_leak_check import cuda_leak_check  # noqa\n"
    )
    (tmp_path / "test_leaky.py").write_text(
        textwrap.dedent("""
        from flashstack import cuda as fc
        from tests.fakes.cuda_driver import FakeBackend
        fc.set_backend(FakeBackend())
        KEEP = []
        def test_leaks(cuda_leak_check):
            KEEP.append(fc.Stream())
        def test_clean(cuda_leak_check):
            fc.Stream().close()
    """)
    )
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO), "PATH": ""},
        timeout=60,
    )
    # a fixture's teardown failure is reported as an error on the leaking test
    assert "ERROR test_leaky.py::test_leaks" in out.stdout, out.stdout + out.stderr
    assert "2 passed, 1 error" in out.stdout  # test_clean passed with the fixture
    assert "leaked CUDA resources" in out.stdout and "1 x stream" in out.stdout


def test_interpreter_exit_with_live_resources_is_clean() -> None:
    script = textwrap.dedent("""
        from flashstack import cuda as fc
        from tests.fakes.cuda_driver import FakeBackend
        class Loud(FakeBackend):
            def _destroy(self, h, op):
                print("DESTROYED", op, flush=True)
                super()._destroy(h, op)
        fc.set_backend(Loud())
        s = fc.Stream()
        LEAK = [fc.DeviceBuffer(8, stream=s), fc.PinnedPool().acquire(8), s]
        cycle = [fc.Event()]; cycle.append(cycle)
        print("EXITING", flush=True)
    """)
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(REPO), "PATH": ""},
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "EXITING"  # no driver call during interpreter teardown
    assert out.stderr == ""


def test_import_does_not_import_torch_or_driver() -> None:
    code = (
        "import sys, flashstack.cuda, flashstack.cuda.tracker; "
        "print('torch' in sys.modules, 'cuda.core' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(REPO), "PATH": ""},
        timeout=60,
    )
    assert out.stdout.strip() == "False False", out.stderr


def test_cuda_available_never_raises_without_driver() -> None:
    assert fc.cuda_available() in (True, False)
    gc.collect()
