"""GGUF checkpoints: every supported tensor type dequantizes to gguf's own values in torch's
orientation; llama, qwen2 and qwen3 models written as GGUF run token-identical to transformers;
truncated, corrupt and unsupported files fail with an error naming the file and the problem."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter, quants

from flashstack.engine import LLM
from flashstack.engine.gguf import GGUFCheckpoint, GGUFError, permute_qk, unpermute_qk
from tests.engine.helpers import greedy, hf_greedy

# Bytes per 256-value K-quant block, and where its float16 scales sit (gguf-py's block layouts).
_K_BLOCKS = {QT.Q4_K: (144, (0, 2)), QT.Q5_K: (176, (0, 2)), QT.Q6_K: (210, (208,))}
_QUANTIZABLE = (QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1)
_COMMON = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
)
_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _k_quant_bytes(kind: QT, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random K-quant blocks with small finite scales (gguf-py cannot quantize to K types)."""
    size, scale_at = _K_BLOCKS[kind]
    blocks = np.random.default_rng(seed).integers(
        0, 256, (rows * cols // 256, size), dtype=np.uint8
    )
    for offset in scale_at:
        blocks[:, offset : offset + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    if kind != QT.Q6_K:  # dmin follows d
        blocks[:, 2:4] = np.frombuffer(np.float16(0.005).tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


def _stored(kind: QT, w: np.ndarray) -> np.ndarray:
    return (
        w.astype(np.float16)
        if kind == QT.F16
        else (w if kind == QT.F32 else quants.quantize(w, kind))
    )


def _hf_name_to_gguf(name: str) -> str:
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if name in fixed:
        return fixed[name]
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER[module]}.{kind}"


def write_gguf(path: Path, arch: str, hf_model, kind: QT = QT.F32) -> Path:
    """A transformers model as llama.cpp's converter writes it (Llama's Q/K rows permuted)."""
    cfg = hf_model.config
    w = GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    for name, t in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        t = t.float()
        if arch == "llama" and ".q_proj." in name:
            t = permute_qk(t, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            t = permute_qk(t, cfg.num_key_value_heads)
        a = t.numpy()
        q = kind if a.ndim == 2 else QT.F32  # llama.cpp keeps norms and biases in F32
        w.add_tensor(
            _hf_name_to_gguf(name), _stored(q, a), raw_dtype=None if q in (QT.F32, QT.F16) else q
        )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _hf_model(family: str):
    import transformers as tf

    torch.manual_seed({"llama": 0, "qwen2": 1, "qwen3": 2}[family])
    if family == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**_COMMON, tie_word_embeddings=False))
    elif family == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**_COMMON, tie_word_embeddings=False))
    else:  # head_dim != hidden / heads: the GGUF's key_length must be read
        model = tf.Qwen3ForCausalLM(
            tf.Qwen3Config(**_COMMON, tie_word_embeddings=True, head_dim=32)
        )
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.8, 1.2) if "norm" in name else p.normal_(0.0, 0.15)
    return model.eval()


def test_permutation_round_trip() -> None:
    w = torch.arange(6 * 8 * 3, dtype=torch.float32).reshape(6 * 8, 3)
    for heads in (1, 3, 6):
        p = permute_qk(w, heads)
        assert not torch.equal(p, w)
        assert torch.equal(unpermute_qk(p, heads), w)
    # HF keeps each head's two rotary halves apart; llama.cpp interleaves them: rows 0,4,1,5,...
    assert permute_qk(w[:8], 1)[:, 0].tolist() == [0, 12, 3, 15, 6, 18, 9, 21]


@pytest.mark.parametrize("kind", [*_QUANTIZABLE, *_K_BLOCKS], ids=lambda k: k.name)
def test_each_type_dequantizes_in_torch_orientation(tmp_path, kind: QT) -> None:
    rows, cols = 8, 512  # not square: a transposed load would not fit
    values = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    stored = _k_quant_bytes(kind, rows, cols, 1) if kind in _K_BLOCKS else _stored(kind, values)
    path = tmp_path / "t.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", stored, raw_dtype=None if kind in (QT.F32, QT.F16) else kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ((name, got),) = GGUFCheckpoint.open(path).weights()
    assert (
        name == "model.embed_tokens.weight"
        and got.shape == (rows, cols)
        and got.dtype == torch.float32
    )
    want = quants.dequantize(stored, kind).reshape(rows, cols)
    assert np.array_equal(got.numpy(), want)
    if kind in _QUANTIZABLE:  # and close to what was quantized
        tolerance = {QT.F32: 0, QT.F16: 2e-3, QT.BF16: 2e-2, QT.Q8_0: 3e-2}.get(kind, 0.5)
        assert np.abs(got.numpy() - values).max() <= tolerance


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def family_gguf(request, tmp_path_factory):
    model = _hf_model(request.param)
    path = write_gguf(
        tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf", request.param, model
    )
    return request.param, path, model


def test_families_run_token_identical_to_transformers(family_gguf) -> None:
    family, path, model = family_gguf
    llm = LLM(path, device="cpu", dtype="float32", show_progress=False, block_size=8)
    assert llm.tokenizer is None  # no tokenizer metadata in this file: token ids only
    prompts = [[3, 4, 5, 6, 7], [100 + i for i in range(21)], [9]]
    outs = llm.generate(prompts, greedy(12))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(model, prompt, 12), family


def test_tensor_parallel_shards_a_gguf(tmp_path) -> None:
    """Two CPU ranks (gloo) each dequantize the file and keep their slice: same tokens as one."""
    model = _hf_model("llama")
    path = write_gguf(tmp_path / "llama.gguf", "llama", model)
    llm = LLM(
        path,
        device="cpu",
        dtype="float32",
        show_progress=False,
        block_size=8,
        tensor_parallel_size=2,
    )
    try:
        prompts = [[3, 4, 5, 6, 7], [100 + i for i in range(21)]]
        outs = llm.generate(prompts, greedy(8))
        assert [o.token_ids for o in outs] == [hf_greedy(model, p, 8) for p in prompts]
        # q/k/v packed: rank 0's 2 query heads and its KV head's k and v, 16 wide each
        assert llm.engine.model.model.layers[0].self_attn.qkv_proj.weight.shape == (
            (2 + 1 + 1) * 16,
            64,
        )
    finally:
        llm.engine.shutdown()


def test_config_from_metadata(family_gguf) -> None:
    family, path, model = family_gguf
    cfg = GGUFCheckpoint.open(path).hf_config()
    assert cfg["model_type"] == family
    c = model.config
    assert cfg["head_dim"] == (
        getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    )
    assert cfg["num_key_value_heads"] == model.config.num_key_value_heads
    assert cfg["tie_word_embeddings"] == model.config.tie_word_embeddings
    assert cfg["rope_theta"] == model.config.rope_parameters["rope_theta"]


# ---- bad files ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_file(tmp_path_factory) -> Path:
    return write_gguf(
        tmp_path_factory.mktemp("good") / "m.gguf", "llama", _hf_model("llama"), QT.Q8_0
    )


@pytest.mark.parametrize("keep", [0.6, 0.01])
def test_truncated_file_is_refused(good_file, tmp_path, keep: float) -> None:
    data = good_file.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(GGUFError, match="truncated or corrupt") as e:
        LLM(bad, device="cpu", show_progress=False)
    assert str(bad) in str(e.value)


def test_corrupt_magic_is_refused(good_file, tmp_path) -> None:
    bad = tmp_path / "magic.gguf"
    bad.write_bytes(b"GGUX" + good_file.read_bytes()[4:])
    with pytest.raises(GGUFError, match="truncated or corrupt") as e:
        GGUFCheckpoint.open(bad)
    assert str(bad) in str(e.value)


def test_unsupported_quant_type_is_named(tmp_path) -> None:
    path = tmp_path / "q2.gguf"
    w = GGUFWriter(str(path), "llama")
    # 4 x 256 values in 84-byte Q2_K blocks
    w.add_tensor("token_embd.weight", np.zeros((4, 84), np.uint8), raw_dtype=QT.Q2_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(
        GGUFError, match=r"token_embd\.weight is stored as Q2_K.*supported types: F32"
    ) as e:
        LLM(path, device="cpu", show_progress=False)
    assert str(path) in str(e.value)


def test_unsupported_architecture_is_named(tmp_path) -> None:
    path = tmp_path / "gemma.gguf"
    w = GGUFWriter(str(path), "gemma2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(
        GGUFError, match="architecture 'gemma2' is not supported.*llama, qwen2, qwen3"
    ):
        GGUFCheckpoint.open(path)


def test_missing_file_is_named(tmp_path) -> None:
    with pytest.raises(GGUFError, match="no such GGUF file"):
        GGUFCheckpoint.open(tmp_path / "absent.gguf")
