"""Triton kernels run on the GPU where there is one, else in Triton's CPU interpreter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before triton.jit decorates anything: it decides interpreted vs compiled then.
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")


def _fix_interpreter_scalars() -> None:
    """Triton's interpreter keeps scalars as 1-element arrays and turns them into loop bounds with
    int(array), which NumPy >= 2.4 refuses; take the element instead."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_flashstack", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._flashstack = True
    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _fix_interpreter_scalars()


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
