"""Memory: what a gateway that serves plain chat requests never loads (issue #9: RSS ≤ 150 MB)."""

from __future__ import annotations

import json
import subprocess
import sys

# Each is 3–40 MB of RSS, for a feature that the request below does not use.
HEAVY = ["numpy", "jsonschema", "cryptography", "tiktoken", "sklearn", "onnxruntime"]

SCRIPT = """
import asyncio, json, sys, tempfile
from flashstack.gateway.config import CompressionConfig, ModelConfig
from flashstack.gateway import app, compress
from flashstack.gateway.core import ChatRequest, Message, Text

# The window check every chat request passes through: a short prompt needs no tokenizer to fit.
cfg = ModelConfig(name="gpt", provider="openai", model="gpt-4o-mini", api_base="http://127.0.0.1:9/v1")
req = ChatRequest(model="gpt", messages=[Message("user", [Text("Say hello in twenty words.")])])
compressor = compress.Compressor(CompressionConfig(), tempfile.mkdtemp())
_, outcome = asyncio.run(compressor.maybe_compress(req, cfg))
assert outcome.action == "none", outcome
print(json.dumps([m for m in HEAVY if m in sys.modules]))
"""


def test_plain_chat_path_loads_no_heavy_modules():
    code = f"HEAVY = {HEAVY!r}\n" + SCRIPT
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
