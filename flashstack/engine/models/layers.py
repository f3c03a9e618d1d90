"""Blocks shared by the decoder families: token embedding, RMSNorm, rotary embedding (incl. Llama 3
scaling)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


class Embedding(nn.Embedding):
    """nn.Embedding that skips its random init on the meta device (build_model: the checkpoint
    fills it), where torch's normal_ imports torch._dynamo, 1.6 s of every start-up."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, as Hugging Face does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """Rope settings from transformers 5 (`rope_parameters`) or 4.x (`rope_theta`, scaling)."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    params = {**scaling, **params}
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    return params


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def rope_inv_freq(head_dim: int, p: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies for the rope type in `p` (default, linear, llama3), on the host: under
    build_model's meta device, torch's decompositions of these ops would import torch._dynamo."""
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()
    inv_freq = 1.0 / (p["rope_theta"] ** (steps / head_dim))
    kind = p["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / p["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, p)
    raise NotImplementedError(
        f"rope_type {kind!r} is not supported yet (supported: default, linear, llama3)"
    )


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embedding; cos/sin are computed once per step for all layers.

    With `max_positions`, every position's cos/sin is computed once (per dtype and device) and a
    step gathers its rows: one launch where computing them takes seven, and in a batch-1 CUDA-graph
    decode step each launch costs about as much as its work. Same values either way."""

    def __init__(
        self, head_dim: int, params: dict[str, Any], max_positions: int | None = None
    ) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, params), persistent=False)
        self.max_positions = max_positions
        self._tables: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def _angles(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[n, 2, head_dim]: each position's cos and sin, computed in fp32 and rounded to dtype."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return torch.stack((emb.cos(), emb.sin()), dim=1).to(dtype)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [n, 1, head_dim] of `positions` (each below max_positions, when set)."""
        if self.max_positions is None:
            angles = self._angles(positions, dtype)
        else:
            key = (dtype, positions.device)
            if key not in self._tables:
                every = torch.arange(self.max_positions, device=positions.device)
                self._tables[key] = self._angles(every, dtype)
            angles = self._tables[key][positions]
        return angles[:, :1], angles[:, 1:]


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [n, Hq, D] and k [n, Hkv, D] by their positions' angles."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
