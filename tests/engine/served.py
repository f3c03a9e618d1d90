"""`flashstack engine serve` as a child process (the session's shared SmolLM2 server, `smol` in
conftest.py, is one), and the names and key that shared server answers to."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

KEY = "sk-test-engine"
NAMES = ("smol", "alias")


class Served:
    """A `flashstack engine serve` child process and the URL it listens on."""

    def __init__(self, model: Path, *flags: str) -> None:
        cmd = [sys.executable, "-m", "flashstack.cli", "engine", "serve", "--model", str(model)]
        cmd += ["--port", "0", "--device", "cpu", "--block-size", "16", *flags]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
        self.log: list[str] = []
        try:  # the engine core starts in a process of its own: two interpreters import torch
            self.url = self._wait_for_port(time.monotonic() + 180)
        except BaseException:
            self.stop()
            raise
        threading.Thread(target=self._drain_log, daemon=True).start()

    def _wait_for_port(self, deadline: float) -> str:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            m = re.search(r"Uvicorn running on (http://\S+:\d+)", line)
            if m:
                return m.group(1)
            assert time.monotonic() < deadline, "server did not start in 180 s"
        raise AssertionError("server exited before listening:\n" + "".join(self.log))

    def _drain_log(self) -> None:  # keep the pipe from filling up
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
