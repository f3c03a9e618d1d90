"""The loaded model's own layout (q/k/v and gate/up packed, filled straight from the checkpoint) and
the typed kernel options that pick what runs on it."""

from __future__ import annotations

import pytest
import torch

from flashstack.engine.config import EngineConfig, KernelOptions
from flashstack.engine.loader import load_model


def test_loader_packs_qkv_and_gate_up_from_the_checkpoint(hf_checkpoints) -> None:
    path, hf = hf_checkpoints["qwen2"]  # q/k/v carry a bias too
    model = load_model(path, torch.float32, torch.device("cpu"))
    ours, theirs = model.model.layers[1], hf.model.layers[1]
    a, b = ours.self_attn, theirs.self_attn
    want = torch.cat([b.q_proj.weight, b.k_proj.weight, b.v_proj.weight])
    assert torch.equal(a.qkv_proj.weight, want)
    assert torch.equal(a.qkv_proj.bias, torch.cat([b.q_proj.bias, b.k_proj.bias, b.v_proj.bias]))
    assert torch.equal(
        ours.mlp.gate_up_proj.weight,
        torch.cat([theirs.mlp.gate_proj.weight, theirs.mlp.up_proj.weight]),
    )
    names = {n for n, _ in model.named_parameters()}
    parts = (".q_proj.", ".k_proj.", ".v_proj.", ".gate_proj.", ".up_proj.")
    assert not any(part in n for n in names for part in parts), "no unpacked copy is kept"


def test_kernel_options_are_typed_and_checked() -> None:
    config = EngineConfig(model="m", kernels={"pdl": False, "tp_all_reduce": "nccl"})
    assert config.kernels == KernelOptions(pdl=False, tp_all_reduce="nccl")
    with pytest.raises(ValueError, match="unknown kernels option.*'pld'"):
        EngineConfig(model="m", kernels={"pld": False})
    with pytest.raises(ValueError, match="tp_all_reduce must be one of"):
        KernelOptions(tp_all_reduce="pull")  # measured slower than the push and removed
    with pytest.raises(ValueError, match="power of two"):
        KernelOptions(tp_all_reduce_block=1000)
    with pytest.raises(ValueError, match="decode_qkv_rows must be at least 1"):
        KernelOptions(decode_qkv_rows=0)
    with pytest.raises(ValueError, match="decode_splits must be 0"):
        KernelOptions(decode_splits=-1)


def test_kernel_options_resolve_for_the_device() -> None:
    cpu = KernelOptions().resolved(torch.device("cpu"))
    assert not (cpu.triton_gemv or cpu.pdl or cpu.decode_qkv or cpu.decode_tma)
    assert cpu.tp_timeout_s == KernelOptions().tp_timeout_s
    assert "pdl=False" in cpu.describe()
