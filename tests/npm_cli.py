"""Real command-line clients from the npm registry, installed once per version into ~/.cache."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CACHE = Path.home() / ".cache" / "flashstack"


def npm_binary(package: str, version: str, binary: str, cache_name: str) -> Path:
    """The installed `binary` of `package@version`; a failed test (not a skip) if npm cannot install
    it."""
    prefix = CACHE / cache_name / version
    path = prefix / "node_modules" / ".bin" / binary
    if path.exists():
        return path
    if shutil.which("npm") is None:
        pytest.fail(f"npm is not installed: {package} cannot be installed (apt-get install npm)")
    prefix.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [
            "npm",
            "install",
            "--no-audit",
            "--no-fund",
            "--prefix",
            str(prefix),
            f"{package}@{version}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0 or not path.exists():
        pytest.fail(f"npm could not install {package}@{version}: {done.stderr[-300:]}")
    return path
