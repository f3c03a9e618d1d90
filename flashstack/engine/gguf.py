"""A GGUF file (llama.cpp's format) as an engine checkpoint: config, dequantized weights, metadata.

The container is read by engine/gguf_reader.py; PyPI's `gguf` (llama.cpp's own package) gives the
tensor types, and its `gguf.quants` dequantizes quantized tensors at load, except that the
decoder's Q8_0 and Q4_K projections may stay as stored (`weights(keep)`: Q8_0's int8 values and
float16 block scales, Q4_K's values and its headers' numbers unpacked, engine/quantization.py).
Tensor names are mapped to the Hugging Face names the models use, and llama.cpp's permutation of
Llama's Q and K rows (its RoPE pairs adjacent elements, HF's pairs the two halves of a head) is
undone, as transformers' GGUF loader does.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from flashstack.engine.gguf_reader import GGUFFile, GGUFTensor

if TYPE_CHECKING:  # torch is imported for the weights only: the gateway reads metadata without it
    import torch

# The architectures the engine's models cover, by GGUF `general.architecture`.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# The decoder layers' projections: the weights that EngineConfig.quantization stores quantized.
_PROJECTION = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")
# Tensor types dequantized at load (gguf.GGMLQuantizationType names).
QUANT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
# File types (general.file_type) whose weights are 16-bit floats already: served in that dtype.
_FILE_DTYPES = {1: "float16", 32: "bfloat16"}

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class GGUFError(ValueError):
    """A GGUF file the engine cannot load; the message names the file and what is wrong."""


def is_gguf(path: str | Path) -> bool:
    """True for a path that names a .gguf file (the engine's other checkpoints are directories)."""
    return str(path).lower().endswith(".gguf")


def hf_tensor_name(name: str) -> str | None:
    """The Hugging Face parameter name of a GGUF tensor, or None for one the models do not use."""
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    m = _LAYER_NAME.fullmatch(name)
    if m is None or m.group(2) not in _LAYER_TENSORS:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}.{m.group(3)}"


def permute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's conversion of a Q or K projection: each head's rows, halves interleaved."""
    rows = w.shape[0]
    return (
        w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The inverse of `permute_qk`: back to Hugging Face's rotate-half row order."""
    rows = w.shape[0]
    return (
        w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )


@dataclass(slots=True)
class GGUFCheckpoint:
    """An opened GGUF file: metadata values by key, and its tensors (memory-mapped)."""

    path: Path
    reader: GGUFFile
    architecture: str

    @classmethod
    def open(cls, path: str | Path) -> GGUFCheckpoint:
        """Open and check `path`: readable, a supported architecture, only supported tensor
        types."""
        path = Path(path)
        if not path.is_file():
            raise GGUFError(f"{path}: no such GGUF file")
        reader = _read(path)
        arch = _field(reader, "general.architecture", path)
        if arch not in ARCHITECTURES:
            raise GGUFError(
                f"{path}: architecture {arch!r} is not supported; the engine runs GGUF models of "
                f"architecture {', '.join(ARCHITECTURES)}"
            )
        ckpt = cls(path, reader, arch)
        ckpt._check_tensors()
        return ckpt

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value (int, float, bool, str or list), or `default` when the key is absent."""
        return _field(self.reader, key, self.path) if key in self.reader.fields else default

    def arch_get(self, key: str, default: Any = None) -> Any:
        """An architecture-scoped value: `llama.block_count` is arch_get("block_count")."""
        return self.get(f"{self.architecture}.{key}", default)

    def _require(self, key: str) -> Any:
        value = self.arch_get(key)
        if value is None:
            raise GGUFError(
                f"{self.path}: metadata lacks {self.architecture}.{key}; the file is incomplete"
            )
        return value

    def _check_tensors(self) -> None:
        names = {t.name for t in self.reader.tensors}
        for t in self.reader.tensors:
            if t.tensor_type.name not in QUANT_TYPES:
                raise GGUFError(
                    f"{self.path}: tensor {t.name} is stored as {t.tensor_type.name}, which the "
                    f"engine cannot dequantize; supported types: {', '.join(QUANT_TYPES)} "
                    "(re-quantize the model to one of these with llama.cpp's llama-quantize)"
                )
        if "rope_freqs.weight" in names:
            raise GGUFError(
                f"{self.path}: per-dimension RoPE frequency factors (rope_freqs, as in Llama 3.1 "
                "GGUFs) are not supported; load the model's Hugging Face safetensors directory "
                "instead"
            )
        if "token_embd.weight" not in names:
            raise GGUFError(f"{self.path}: no token_embd.weight tensor; the file is incomplete")

    @property
    def has_tokenizer(self) -> bool:
        """Whether the file carries a vocabulary (converters always write one; tests may not)."""
        return "tokenizer.ggml.tokens" in self.reader.fields

    @property
    def tensor_names(self) -> list[str]:
        """GGUF names of the tensors the model uses, in file order."""
        return [t.name for t in self.reader.tensors if hf_tensor_name(t.name) is not None]

    def hf_config(self) -> dict[str, Any]:
        """The model's config.json equivalent, built from the metadata."""
        heads = self._require("attention.head_count")
        hidden = self._require("embedding_length")
        names = {t.name for t in self.reader.tensors}
        cfg: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.arch_get("vocab_size") or self._embedding_rows(),
            "hidden_size": hidden,
            "intermediate_size": self._require("feed_forward_length"),
            "num_hidden_layers": self._require("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self._kv_heads(heads),
            "head_dim": self.arch_get("attention.key_length") or hidden // heads,
            "rms_norm_eps": self.arch_get("attention.layer_norm_rms_epsilon", 1e-6),
            "rope_theta": self.arch_get("rope.freq_base", 10000.0),
            "max_position_embeddings": self.arch_get("context_length", 2048),
            "tie_word_embeddings": "output.weight" not in names,
            "attention_bias": "blk.0.attn_q.bias" in names,
            "torch_dtype": _FILE_DTYPES.get(self.get("general.file_type"), "bfloat16"),
        }
        scaling = self._rope_scaling()
        if scaling:
            cfg["rope_scaling"] = scaling
        for key in ("bos_token_id", "eos_token_id"):
            value = self.get(f"tokenizer.ggml.{key}")
            if value is not None:
                cfg[key] = value
        return cfg

    def _embedding_rows(self) -> int:
        # The embedding's row count is the model's vocabulary (it may be padded past the tokens).
        embed = next(t for t in self.reader.tensors if t.name == "token_embd.weight")
        return int(embed.shape[-1])  # GGUF lists dimensions innermost first: (hidden, vocab)

    def _kv_heads(self, heads: int) -> int:
        kv = self.arch_get("attention.head_count_kv", heads)
        if isinstance(kv, list):  # some converters write one count per layer
            if len(set(kv)) != 1:
                raise GGUFError(
                    f"{self.path}: KV head counts differ by layer ({sorted(set(kv))}); not "
                    "supported"
                )
            kv = kv[0]
        return kv

    def _rope_scaling(self) -> dict[str, Any] | None:
        kind = self.arch_get("rope.scaling.type", "none")
        if kind == "none":
            return None
        if kind == "linear":
            return {"rope_type": "linear", "factor": self.arch_get("rope.scaling.factor", 1.0)}
        raise GGUFError(f"{self.path}: RoPE scaling {kind!r} is not supported (only linear)")

    def weights(
        self, keep: Callable[[str], str | None] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, float32 tensor) for each tensor the model uses, dequantized one at a time.
        `keep(name)`: the GGML type ("Q8_0" or "Q4_K") in which the model holds that decoder
        projection; one stored in that type comes as it is stored instead, as `<proj>.weight`
        (Q8_0's int8 values, Q4_K's packed values) and `<proj>.weight_scale` (Q8_0's float16 block
        scales, Q4_K's scales and mins unpacked into words: engine/quantization.py)."""
        import torch

        for t in self.reader.tensors:
            name = hf_tensor_name(t.name)
            if name is None:
                continue
            kept = keep(name) if keep is not None and _PROJECTION.search(name) else None
            if kept is not None and t.tensor_type.name == kept:
                q, scale = _STORED[kept](self.path, t)
                yield name, self._hf_rows(name, torch.from_numpy(q))
                yield name + "_scale", self._hf_rows(name, torch.from_numpy(scale))
                continue
            yield name, self._hf_rows(name, torch.from_numpy(_dequantize(self.path, t)))

    def _hf_rows(self, name: str, w: torch.Tensor) -> torch.Tensor:
        # llama.cpp's converter permutes only Llama's Q/K rows
        if self.architecture != "llama":
            return w
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            return unpermute_qk(w, self._require("attention.head_count"))
        if name.endswith(("k_proj.weight", "k_proj.bias")):
            return unpermute_qk(w, self._kv_heads(self._require("attention.head_count")))
        return w


def _read(path: Path) -> GGUFFile:
    try:
        return GGUFFile(path)
    except (ValueError, OSError) as e:  # GGUFFormatError and UnicodeDecodeError are ValueErrors
        raise GGUFError(
            f"{path}: not a readable GGUF file ({e}); it is truncated or corrupt, so fetch it again"
        ) from None


def _field(reader: GGUFFile, key: str, path: Path) -> Any:
    if key not in reader.fields:
        raise GGUFError(f"{path}: metadata lacks {key}; not a model file")
    return reader.fields[key]


def _q8_0_blocks(path: Path, t: GGUFTensor) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 matrix as stored: int8 values [out, in] and float16 scales [out, in / 32] (each
    34-byte block is its float16 scale, then its 32 int8 values)."""
    rows, cols = (int(n) for n in reversed(t.shape))
    blocks = np.asarray(t.data, dtype=np.uint8).reshape(-1, 34)
    if blocks.shape[0] != rows * cols // 32:
        raise GGUFError(f"{path}: tensor {t.name} holds the wrong number of Q8_0 blocks")
    scale = blocks[:, :2].copy().view(np.float16).reshape(rows, cols // 32)
    return blocks[:, 2:].copy().view(np.int8).reshape(rows, cols), scale


def _q4_k_blocks(path: Path, t: GGUFTensor) -> tuple[np.ndarray, np.ndarray]:
    """A Q4_K matrix in the engine's layout: the values as stored [out, in / 2] and the headers'
    numbers unpacked into int32 words [out, in / 64 + in / 256] (each 144-byte super-block is its
    16-byte header, d, dmin and 12 bytes of 6-bit scales and mins, then 128 bytes of values)."""
    import torch

    from flashstack.engine.quantization import unpack_q4_k_heads

    rows, cols = (int(n) for n in reversed(t.shape))
    blocks = np.asarray(t.data, dtype=np.uint8).reshape(-1, 144)
    if blocks.shape[0] != rows * cols // 256:
        raise GGUFError(f"{path}: tensor {t.name} holds the wrong number of Q4_K super-blocks")
    head = torch.from_numpy(blocks[:, :16].reshape(rows, cols // 16).copy())
    return blocks[:, 16:].reshape(rows, cols // 2).copy(), unpack_q4_k_heads(head).numpy()


# GGML types the engine can hold as stored -> their reader
_STORED = {"Q8_0": _q8_0_blocks, "Q4_K": _q4_k_blocks}


def _dequantize(path: Path, t: GGUFTensor) -> np.ndarray:
    """One tensor's values as float32, shaped as torch expects ([out, in] for a matrix)."""
    from gguf import quants

    shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dimensions innermost first
    try:
        values = np.ascontiguousarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        # F32 tensors come back as read-only views of the file's memory map; torch wants its own.
        return (values if values.flags.writeable else values.copy()).reshape(shape)
    except ValueError as e:
        raise GGUFError(
            f"{path}: tensor {t.name} cannot be read ({e}); the file is corrupt"
        ) from None


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, mtime_ns: int, size: int) -> GGUFCheckpoint:
    return GGUFCheckpoint.open(path)


def open_gguf(path: str | Path) -> GGUFCheckpoint:
    """GGUFCheckpoint.open, parsed once per process for an unchanged file (the engine reads the
    config, the tokenizer and the weights from it: one parse, one memory map)."""
    path = Path(path).resolve()
    try:
        st = path.stat()
    except OSError:
        raise GGUFError(f"{path}: no such GGUF file") from None
    return _open_cached(str(path), st.st_mtime_ns, st.st_size)
