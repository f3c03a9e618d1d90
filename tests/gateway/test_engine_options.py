"""A local model's `engine` options: typed in the gateway's config, the engine's own names."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import fields

import pytest

from flashstack.gateway.config import ConfigError, EngineOptions, KernelSwitches, load_config


def test_options_are_the_engines_own(tmp_path):
    from flashstack.engine import config as engine_config

    engine = {f.name for f in fields(engine_config.EngineConfig)} - {"model", "hf_config"}
    kernels = {f.name for f in fields(engine_config.KernelOptions)}
    assert set(EngineOptions.model_fields) == engine
    assert set(KernelSwitches.model_fields) == kernels


def test_only_the_options_set_reach_the_engine(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "models:\n"
        "  - {name: m, provider: local, model: x.gguf,\n"
        "     engine: {block_size: 16, device: cpu, kernels: {pdl: false}}}\n"
    )
    options = load_config(path).models[0].engine.engine_kwargs()
    assert options == {"block_size": 16, "device": "cpu", "kernels": {"pdl": False}}


@pytest.mark.parametrize(
    ("engine", "named"),
    [
        ("{blok_size: 16}", "engine.blok_size"),
        ("{block_size: 0}", "engine.block_size"),
        ("{preemption_mode: sometimes}", "engine.preemption_mode"),
        ("{kernels: {pdll: false}}", "engine.kernels.pdll"),
        # The engine's own rules, which the options' types alone do not say.
        ("{quantization: fp8, tensor_parallel_size: 2}", "quantization='fp8' runs on one device"),
        ("{kv_cache_dtype: fp8, tensor_parallel_size: 2}", "kv_cache_dtype='fp8' runs on one"),
        ("{kernels: {tp_all_reduce_block: 96}}", "kernels.tp_all_reduce_block must be a power"),
        ("{kernels: {decode_qkv_rows: 0}}", "engine.kernels.decode_qkv_rows"),
    ],
)
def test_a_bad_option_is_a_config_error_naming_it(tmp_path, engine, named):
    path = tmp_path / "c.yaml"
    path.write_text(f"models:\n  - {{name: m, provider: local, model: x.gguf, engine: {engine}}}\n")
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config(path)


def test_loading_a_local_model_imports_no_torch(tmp_path):
    # The gateway checks the options with the engine's EngineConfig; torch loads only with the
    # engine itself.
    path = tmp_path / "c.yaml"
    path.write_text("models:\n  - {name: m, provider: local, model: x.gguf, engine: {seed: 1}}\n")
    code = (
        "import json, sys\n"
        "from flashstack.gateway.config import load_config\n"
        f"load_config({str(path)!r})\n"
        "print(json.dumps('torch' in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) is False
