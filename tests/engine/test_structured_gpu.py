"""Constrained decoding on the GPU with CUDA graphs on: guided rows share graph-replayed decode
steps with free ones, and every guided output parses and validates against its schema."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from flashstack.engine import LLM, SamplingParams
from flashstack.engine.guided import GrammarCompiler, GuideSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# Bounded by construction (a short string, a small integer, a boolean): random weights finish it.
RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "n", "ok"],
    "additionalProperties": False,
}


def test_json_schema_under_cuda_graphs(tiny_model_dir) -> None:
    llm = LLM(tiny_model_dir, block_size=16, device="cuda", dtype="bfloat16", show_progress=False)
    graphs = llm.engine.runner.graphs
    assert graphs is not None, "CUDA graphs were not captured"
    replays = {"n": 0}
    run = graphs.run

    def counted(*a, **kw):
        replays["n"] += 1
        return run(*a, **kw)

    graphs.run = counted
    guide = GrammarCompiler(llm.tokenizer, llm.engine.model.args.vocab_size).compile(
        GuideSpec(json_schema=RECORD)
    )
    guided = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=160, guide=guide) for i in range(6)
    ]
    free = [SamplingParams(temperature=0.8, seed=9, max_tokens=40, ignore_eos=True)] * 2
    prompts = ["Give me a record:", "def f():", "JSON please", "x", "{", "record", "free", "text"]
    outs = llm.generate(prompts, guided + free)
    assert replays["n"] > 0, "no decode step replayed a graph"
    for out in outs[:6]:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), RECORD)
    assert all(len(o.token_ids) == 40 for o in outs[6:])
