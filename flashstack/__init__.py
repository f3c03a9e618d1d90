"""flashstack: a unified LLM gateway, a flash inference engine, and leak-proof CUDA resources."""

__version__ = "0.1.0"
