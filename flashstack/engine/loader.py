"""Load a checkpoint: a local Hugging Face directory (config.json plus (sharded) *.safetensors,
memory-mapped) or a GGUF file (engine/gguf.py, dequantized at load). Quantized weights
(engine/quantization.py) come from an fp8 checkpoint, or a GGUF file's Q8_0 or Q4_K tensors, as
they are, or are quantized as they are copied in."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from flashstack.cuda import cuda_available
from flashstack.engine.gguf import is_gguf, open_gguf
from flashstack.engine.models import LlamaForCausalLM, model_class
from flashstack.engine.models.layers import RotaryEmbedding, rope_inv_freq
from flashstack.engine.models.linear import Linear, Source, checkpoint_sources, to_compute_dtype
from flashstack.engine.quantization import (
    FP8,
    Q4K_BLOCK,
    quantize_blocks,
    quantize_q4_k,
    quantize_rows,
    resolve_quantization,
)

if TYPE_CHECKING:
    from flashstack.engine.tp.group import TensorParallel

log = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """Parse config.json of a local model directory (a GGUF file: the same, from its metadata)."""
    if is_gguf(path):
        return open_gguf(path).hf_config()
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(
            f"{config_file} not found: pass a local Hugging Face model directory"
        )
    return json.loads(config_file.read_text())


def resolve_device(device: str) -> torch.device:
    """'auto' means CUDA when a device is usable through flashstack.cuda (which the engine's CUDA
    path stands on) and torch is a CUDA build, else CPU."""
    if device == "auto":
        return torch.device("cuda" if cuda_available() and torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(
    dtype: str | torch.dtype, hf: dict[str, Any], device: torch.device
) -> torch.dtype:
    """'auto': the checkpoint's dtype on GPU, float32 on CPU (half matmuls are slow there)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)} or 'auto'")
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    return _DTYPES.get(str(hf.get("dtype") or hf.get("torch_dtype") or "bfloat16"), torch.bfloat16)


def safetensors_files(path: str | Path) -> list[Path]:
    """The checkpoint's weight files, from the shard index when there is one."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors in {path}; convert the checkpoint to safetensors first"
        )
    return files


def checkpoint_tensor_count(path: str | Path) -> int:
    """How many tensors loading `path` copies (the progress bar's total)."""
    if is_gguf(path):
        return len(open_gguf(path).tensor_names)
    return count_tensors(safetensors_files(path))


def count_tensors(files: list[Path]) -> int:
    """Number of tensors across the files (reads only headers)."""
    total = 0
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            total += len(list(sf.keys()))
    return total


def build_model(
    hf: dict[str, Any],
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallel | None = None,
    quantization: str | None = None,
) -> LlamaForCausalLM:
    """Allocate an uninitialised model (weights come from the checkpoint); `tp`: this rank's
    shard; `quantization`: "fp8", "q8_0" or "q4_k" projection weights (engine/quantization.py)."""
    if quantization and tp is not None:
        raise ValueError(
            f"{quantization} weights run on one device: load this checkpoint with "
            "tensor_parallel_size=1"
        )
    cls = model_class(hf)
    args = replace(cls.args_from_hf(hf), quantization=quantization)
    with torch.device("meta"):
        model = to_compute_dtype(cls(args, tp), dtype)
    model.to_empty(device=device)
    _report_fallbacks(model, quantization)
    if model.args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for module in model.modules():
        if isinstance(
            module, RotaryEmbedding
        ):  # buffers are not in the checkpoint; recompute in fp32
            module.inv_freq = rope_inv_freq(model.args.head_dim, model.args.rope).to(device)
    return model.eval()


def _report_fallbacks(model: LlamaForCausalLM, quantization: str | None) -> None:
    # q4_k projections whose rows are not whole super-blocks hold q8_0: said once, at load.
    other = sorted(
        {
            f"{type(m).__name__} {m.in_features} -> {m.out_features}: {m.quantization}"
            for m in model.modules()
            if isinstance(m, Linear) and m.quantization not in (None, quantization)
        }
    )
    if other:
        log.warning(
            "quantization=%r: projections whose inputs are not whole %d-weight super-blocks "
            "hold another scheme: %s",
            quantization,
            Q4K_BLOCK,
            "; ".join(other),
        )


def _safetensors_part(sf: Any, key: str, source: Source | None) -> torch.Tensor:
    # A tensor-parallel shard reads only its slice from the mmap (models/linear.py).
    if source is None:
        return sf.get_tensor(key)
    return sf.get_slice(key)[(slice(None),) * source.dim + (slice(source.start, source.stop),)]


def _narrow(w: torch.Tensor, source: Source | None) -> torch.Tensor:
    return w if source is None else w.narrow(source.dim, source.start, source.stop - source.start)


# A quantized weight's storage dtype -> its EngineConfig.quantization, and how a float one is
# quantized into it as it is copied
_QUANTIZED = {FP8: "fp8", torch.int8: "q8_0", torch.uint8: "q4_k"}
_QUANTIZE = {FP8: quantize_rows, torch.int8: quantize_blocks, torch.uint8: quantize_q4_k}
# ... and the GGML type a GGUF file stores it in, where the engine can keep that as stored
_GGML_TYPES = {torch.int8: "Q8_0", torch.uint8: "Q4_K"}


def _scale_rows(scale: torch.Tensor, source: Source | None, target: torch.Tensor) -> torch.Tensor:
    # A checkpoint's weight_scale: one per output channel ([N, 1]) or one for the tensor ([1], []),
    # spread over the rows it covers.
    scale = scale.reshape(-1).float()
    rows = target.shape[0] if source is None else source.stop - source.start
    if scale.numel() == 1:
        return scale.expand(rows)
    return scale if source is None else scale[source.start : source.stop]


class _Filler:
    """Copies checkpoint tensors, or the slices this rank needs, into their places in the model's
    parameters (a packed q/k/v or gate/up weight takes several) and tracks which are still unset."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.sources = checkpoint_sources(model)
        packed = {param for targets in self.sources.values() for param, _ in targets}
        # Every parameter is filled by its own checkpoint tensor unless it names its sources.
        for name in self.params:
            if name not in packed:
                self.sources.setdefault(name, []).append((name, None))
        owned = set(dict(model.named_parameters()))
        self.missing = {
            key for key, targets in self.sources.items() if any(p in owned for p, _ in targets)
        }

    def wants(self, key: str) -> bool:
        return key in self.sources

    def ggml_type(self, key: str) -> str | None:
        """The GGML type ("Q8_0", "Q4_K") in which the model holds checkpoint tensor `key`, if it
        can take that type as a file stores it."""
        targets = self.sources.get(key)
        return _GGML_TYPES.get(self.params[targets[0][0]].dtype) if targets else None

    def copy(self, key: str, read: Callable[[Source | None], torch.Tensor]) -> None:
        """Fill every place checkpoint tensor `key` goes; `read(source)` gives its slice (None:
        all)."""
        for param, source in self.sources[key]:
            target = self.params[param]
            if param.endswith(".weight_scale") and target.dim() == 2:  # Q8_0's, Q4_K's: by row
                self._place(target, source, read(source))
                continue
            if param.endswith(".weight_scale"):
                self._place(target, source, _scale_rows(read(None), source, target))
                continue
            part = read(source)
            if part.dtype in _QUANTIZED and target.dtype != part.dtype:
                scheme = _QUANTIZED[part.dtype]
                raise ValueError(
                    f"{key} is stored in {scheme}, but the engine keeps {param} in "
                    f"{target.dtype} (load it with quantization={scheme!r}; only the decoder "
                    "layers' projections take quantized weights)"
                )
            if target.dtype in _QUANTIZED and part.dtype != target.dtype:  # quantized as copied
                part, scale = _QUANTIZE[target.dtype](part.to(target.device))
                self._place(self.params[param + "_scale"], source, scale)
                self.missing.discard(key + "_scale")
            self._place(target, source, part)
        self.missing.discard(key)

    @staticmethod
    def _place(target: torch.Tensor, source: Source | None, part: torch.Tensor) -> None:
        if source is None:
            target.copy_(part)
            return
        # the last vocabulary part is padded so every rank's logits gather evenly
        if source.pads:
            target.zero_()
        target.narrow(source.dim, source.offset, part.shape[source.dim]).copy_(part)

    def check(self, source: str | Path) -> None:
        if self.model.args.tie_word_embeddings:
            self.missing.discard("lm_head.weight")
        if self.missing:
            raise ValueError(
                f"{source} lacks {len(self.missing)} tensors, e.g. {sorted(self.missing)[:5]}"
            )


def load_weights(
    model: LlamaForCausalLM, files: list[Path], on_tensor: Callable[[], None] | None = None
) -> None:
    """Copy every checkpoint tensor into the model; raise if a parameter stays unset."""
    fill = _Filler(model)
    with torch.no_grad():
        for f in files:
            with safe_open(str(f), framework="pt") as sf:  # mmap: only touched pages are read
                for key in sf.keys():
                    if fill.wants(key):
                        fill.copy(
                            key, lambda source, sf=sf, key=key: _safetensors_part(sf, key, source)
                        )
                    if on_tensor is not None:
                        on_tensor()
    fill.check(files[0].parent if files else "the checkpoint")


def load_gguf_weights(
    model: LlamaForCausalLM, path: str | Path, on_tensor: Callable[[], None] | None = None
) -> None:
    """Dequantize a GGUF file's tensors into the model (a shard copies only its slice); a
    projection the model holds in Q8_0 or Q4_K takes the file's tensor as stored where the file
    stores it in that type."""
    fill = _Filler(model)
    with torch.no_grad():
        for key, w in open_gguf(path).weights(keep=fill.ggml_type):
            if fill.wants(key):
                fill.copy(key, lambda source, w=w: _narrow(w, source))
            if on_tensor is not None:
                on_tensor()
    fill.check(path)


def load_model(
    path: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    on_tensor: Callable[[], None] | None = None,
    tp: TensorParallel | None = None,
    quantization: str | None = None,
) -> LlamaForCausalLM:
    """config.json + safetensors, or a GGUF file -> a ready model in eval mode (`tp`: only this
    rank's shard; `quantization`: "fp8", "q8_0" or "q4_k" to quantize the projections' weights at
    load, which an fp8 checkpoint implies; a GGUF file's Q8_0 or Q4_K projections stay as stored
    under "q8_0" or "q4_k")."""
    hf = read_hf_config(path)
    model = build_model(hf, dtype, device, tp, resolve_quantization(quantization, hf))
    if is_gguf(path):
        load_gguf_weights(model, path, on_tensor)
    else:
        load_weights(model, safetensors_files(path), on_tensor)
    return model
