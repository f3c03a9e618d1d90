"""The gateway's config: a YAML file plus FLASHSTACK_* environment variables.

Values of the form ``env:NAME`` are read from the environment when the config is loaded, so
secrets stay out of the file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ProviderName = Literal["anthropic", "openai", "ollama", "local"]


class ConfigError(ValueError):
    """The configuration cannot be used; the message says which field and how to fix it."""


# ---- the in-process engine (provider: local) --------------------------------------------------


class KernelSwitches(BaseModel):
    """`engine.kernels`: the engine's kernel variants (flashstack.engine.config.KernelOptions);
    unset fields take the engine's defaults, the fastest measured."""

    model_config = ConfigDict(extra="forbid")

    triton_gemv: bool | None = None
    skinny_gemm: bool | None = None
    skinny_small_weights: bool | None = None
    fp8_activations: bool | None = None
    pdl: bool | None = None
    decode_qkv: bool | None = None
    decode_qkv_rows: int | None = Field(None, ge=1)
    decode_tma: bool | None = None
    attention_pdl: bool | None = None
    elementwise_pdl: bool | None = None
    pdl_on_launch_completion: bool | None = None
    decode_longest_first: bool | None = None
    decode_deep_tma: bool | None = None
    decode_wave_tma: bool | None = None
    decode_splits: int | None = Field(None, ge=0)
    decode_unmasked_v: bool | None = None
    decode_idle_exit: bool | None = None
    split_k_in_norm: bool | None = None
    gate_up_swiglu: bool | None = None
    argmax_in_graph: bool | None = None
    decode_fp8_qk: bool | None = None
    decode_fp8_pairs: bool | None = None
    decode_preload_rows: int | None = Field(None, ge=0)
    decode_heads_first: bool | None = None
    sample_in_graph: bool | None = None
    graph_fetches_inputs: bool | None = None
    persistent_decoder: bool | None = None
    persistent_decoder_programs_per_sm: int | None = Field(None, ge=1)
    persistent_decoder_warps: Literal[1, 2, 4, 8, 16] | None = None
    persistent_decoder_tagged: bool | None = None
    fused_mlp: bool | None = None
    fp8_silu_kernel: bool | None = None
    gemv_l2_prefetch_bytes: int | None = Field(None, ge=0)
    tp_all_reduce: Literal["push", "nccl"] | None = None
    tp_all_reduce_block: int | None = Field(None, ge=64)
    tp_all_reduce_warps: Literal[1, 2, 4, 8, 16] | None = None
    tp_timeout_s: float | None = Field(None, gt=0)


class EngineOptions(BaseModel):
    """`engine` of a `provider: local` model: the in-process engine's options
    (flashstack.engine.config.EngineConfig, less the model path); unset fields take its defaults."""

    model_config = ConfigDict(extra="forbid")

    block_size: int | None = Field(None, gt=0)
    max_num_seqs: int | None = Field(None, gt=0)
    max_num_batched_tokens: int | None = Field(None, gt=0)
    decode_step_prefill_tokens: int | None = Field(None, ge=0)  # 0: no cap beside decodes
    burst_prefill_steps: int | None = Field(None, ge=0)  # 0: decodes run in every step
    max_model_len: int | None = Field(None, gt=0)
    dtype: str | None = None  # auto, float16, bfloat16, float32
    device: str | None = None  # auto, cpu, cuda, cuda:N
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    scheduling_policy: Literal["fcfs", "priority"] | None = None
    num_kv_blocks: int | None = Field(None, gt=0)
    kv_cache_memory_gb: float | None = Field(None, gt=0)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    attention_backend: str | None = None
    enforce_eager: bool | None = None
    mixed_step_graph_tokens: int | None = Field(None, ge=0)  # 0: prefill steps run eagerly
    async_scheduling: bool | None = None
    burst_lookahead: bool | None = None
    show_progress: bool | None = None
    seed: int | None = None
    tensor_parallel_size: int | None = Field(None, ge=1)
    preemption_mode: Literal["auto", "swap", "recompute"] | None = None
    swap_space_gb: float | None = Field(None, ge=0)
    swap_bandwidth_gbps: float | None = Field(None, gt=0)
    recompute_tflops: float | None = Field(None, gt=0)
    quantization: Literal["fp8", "q8_0", "q4_k"] | None = (
        None  # linear weights (engine/quantization.py)
    )
    kv_cache_dtype: Literal["auto", "fp8"] | None = None  # fp8: the KV cache in float8_e4m3fn
    kernels: KernelSwitches | None = None

    def engine_kwargs(self) -> dict[str, Any]:
        """The options set, as EngineConfig's keyword arguments."""
        return self.model_dump(exclude_none=True)

    @model_validator(mode="after")
    def _engine_accepts(self) -> EngineOptions:
        """The engine's own rules (options together, such as fp8 with tensor parallelism) at load,
        not at the engine's start; flashstack.engine.config imports no torch."""
        from flashstack.engine.config import EngineConfig

        EngineConfig(model="", **self.engine_kwargs())  # its ValueError names the option
        return self


class ModelConfig(BaseModel):
    """One deployment of a model: what clients call it, and where it really runs."""

    model_config = ConfigDict(extra="forbid")

    name: str
    provider: ProviderName
    model: str
    api_base: str | None = None
    api_key: str | None = None
    description: str | None = None
    timeout: float = 600.0
    connect_timeout: float = 5.0
    supports_images: bool = True
    # provider openai only: the upstream serves POST /v1/responses itself (OpenAI does); a Responses
    # client's request goes to it whole instead of through chat completions.
    responses_api: bool = False
    context_window: int | None = None
    max_output_tokens: int | None = None
    # A model directory or GGUF file with this upstream model's own tokenizer and chat template (the
    # GGUF llama.cpp serves): the gateway counts with it where the upstream reports no usage.
    tokenizer: str | None = None
    # Sampling for requests that set none (the local engine; OpenAI's default of temperature 1 makes
    # a small model ramble, so the embedded SmolLM2 takes its model card's 0.2 / 0.9).
    default_temperature: float | None = Field(None, ge=0)
    default_top_p: float | None = Field(None, gt=0, le=1)
    weight: float = 1.0
    # Router (see RouterConfig): a stable deployment id, and where to go when this model fails.
    id: str | None = None  # default "<name>#<n>"; names the deployment in headers, metrics, Redis
    fallbacks: list[str] = Field(default_factory=list)
    context_window_fallbacks: list[str] = Field(default_factory=list)
    content_policy_fallbacks: list[str] = Field(default_factory=list)
    ttft_timeout: float | None = None  # overrides router.ttft_timeout for this deployment
    # Upstream mTLS (gateway/tls/): our client certificate, and the CA that signs the upstream's.
    tls_client_cert: Path | None = None  # PEM certificate (chain) presented to the upstream
    tls_client_key: Path | None = None  # its PEM private key
    # verify the upstream against this CA instead of the system store
    tls_ca_bundle: Path | None = None
    # provider local: the in-process engine's options (block_size, max_num_seqs,
    # dtype, device, ...).
    engine: EngineOptions = Field(default_factory=EngineOptions)

    @field_validator("api_base")
    @classmethod
    def _strip_slash(cls, v: str | None) -> str | None:
        return v.rstrip("/") if v else v

    def check_credentials(self) -> None:
        """A `user:password@` api_base is sent as basic auth: with an OpenAI api_key both would be
        the Authorization header. Raised without the URL, which holds the password."""
        if (
            self.provider == "openai"
            and self.api_key
            and self.api_base
            and "@" in urlsplit(self.api_base).netloc
        ):
            raise ConfigError(
                f"model {self.name!r}: api_base carries credentials (user:password@) and api_key "
                "is set too; both would be the Authorization header. Keep the key in api_key, or "
                "the proxy's credentials in api_base, not both"
            )


# ---- TLS (gateway/tls/) -------------------------------------------------------------------


class VaultConfig(BaseModel):
    """Issue the server certificate from a Vault / OpenBao PKI engine and renew it before expiry."""

    model_config = ConfigDict(extra="forbid")

    addr: str  # https://vault.example.com:8200
    # CA that signs Vault's own TLS certificate; None: the system store
    ca_bundle: Path | None = None
    namespace: str | None = None
    token_env: str = "VAULT_TOKEN"  # token auth: the variable that holds the token
    role_id_env: str = "VAULT_ROLE_ID"  # AppRole auth (used when the token variable is unset)
    secret_id_env: str = "VAULT_SECRET_ID"
    approle_mount: str = "approle"
    pki_mount: str = "pki"
    role: str  # issue from <pki_mount>/issue/<role>
    common_name: str
    alt_names: list[str] = Field(default_factory=list)
    ip_sans: list[str] = Field(default_factory=list)
    ttl: str = "24h"
    renew_at: float = Field(2 / 3, gt=0, lt=1)  # fraction of the lifetime after which to renew
    retry_min: float = Field(1.0, gt=0)  # backoff when Vault is unreachable: first wait, doubling…
    retry_max: float = Field(60.0, gt=0)  # …up to this
    timeout: float = Field(10.0, gt=0)  # seconds per Vault request


class TLSConfig(BaseModel):
    """Server TLS: a certificate from files (watched) or Vault, and optional client certificates."""

    model_config = ConfigDict(extra="forbid")

    cert_file: Path | None = None  # PEM certificate chain; reloaded when it changes
    key_file: Path | None = None
    vault: VaultConfig | None = None  # instead of cert_file/key_file
    client_ca_file: Path | None = None  # mTLS: clients must present a certificate signed by this CA
    client_auth: Literal["required", "optional"] = "required"  # with client_ca_file
    # allowed CN/SAN globs; []: any from the CA
    client_names: list[str] = Field(default_factory=list)
    min_version: Literal["TLSv1.2", "TLSv1.3"] = "TLSv1.2"
    watch_interval: float = Field(2.0, gt=0)  # seconds between checks of cert_file/key_file
    renew_at: float = Field(2 / 3, gt=0, lt=1)  # files: warn in readiness after this much lifetime

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None or self.vault is not None

    @model_validator(mode="after")
    def _check_source(self) -> "TLSConfig":
        if self.vault is not None and (self.cert_file or self.key_file):
            raise ValueError("server.tls: set either cert_file/key_file or vault, not both")
        if self.cert_file is not None and self.key_file is None:
            raise ValueError("server.tls.cert_file needs server.tls.key_file (the PEM private key)")
        if self.key_file is not None and self.cert_file is None:
            raise ValueError("server.tls.key_file needs server.tls.cert_file (the PEM certificate)")
        if (self.client_ca_file or self.client_names) and not self.enabled:
            raise ValueError(
                "server.tls.client_ca_file needs a server certificate: cert_file or vault"
            )
        if self.client_names and not self.client_ca_file:
            raise ValueError(
                "server.tls.client_names needs server.tls.client_ca_file to verify against"
            )
        return self


class ServerConfig(BaseModel):
    """Where the gateway listens, and the limits every connection and request is held to."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = 8400
    max_body_bytes: int = 32 * 1024 * 1024  # after Content-Encoding is decoded; larger → 413
    # Arrays/objects nested in a request body (and in tool-call arguments); deeper → 400. orjson
    # writes at most 254 levels, hence the cap.
    max_json_depth: int = Field(64, ge=8, le=200)
    # Connection limits (gateway/server_limits.py; docs/security.md, "Limits").
    max_header_bytes: int = Field(64 * 1024, ge=1024)  # request line + headers of one request → 431
    # seconds from connect (or a request's first byte) to its headers → 408
    header_timeout: float = Field(10.0, gt=0)
    # the body is checked once per window of this many seconds…
    body_timeout: float = Field(30.0, gt=0)
    # …and each window must bring this many bytes/s → 408
    body_min_rate: float = Field(1024.0, ge=0)
    # Above the 5 s that httpx (and so both SDKs) keeps an idle connection: a client never reuses a
    # connection the server has just closed.
    keep_alive_timeout: float = Field(15.0, gt=0)
    max_connections: int = Field(4096, ge=1)  # open client connections; past it requests get 503
    # With auth off (no auth.master_key) a browser page must not drive the gateway: requests whose
    # Host is not loopback, an IP address, `host` or one of these are refused (DNS rebinding), and
    # so are requests with an Origin other than their own Host's or one of allowed_origins. "*":
    # any.
    allowed_hosts: list[str] = Field(default_factory=list)  # "gateway.internal", "*.example.com"
    allowed_origins: list[str] = Field(default_factory=list)  # "https://app.example.com"
    # Anthropic-format streams: events buffered between the upstream reader and the client writer
    # (their pings come from a watcher). OpenAI-format streams are written as they are read.
    stream_queue_size: int = 64
    stream_ping_interval: float = 15.0  # Anthropic `ping` events while upstream is silent
    tls: TLSConfig = Field(default_factory=TLSConfig)  # off unless cert_file or vault is set


class UpstreamLimits(BaseModel):
    """What the gateway reads from an upstream at most; past a cap the attempt fails with a 502.

    Enforced while reading, so a hostile or broken upstream costs at most this much
    memory per request.
    """

    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(16 * 1024 * 1024, gt=0)  # a non-stream response (and a model list)
    # an error response: read this much, ignore the rest
    max_error_bytes: int = Field(64 * 1024, gt=0)
    # one stream line (SSE, NDJSON), one SSE event's data
    max_line_bytes: int = Field(1024 * 1024, gt=0)
    # upstream error text shown to clients, after redaction
    error_excerpt_chars: int = Field(512, ge=0)


class RouterConfig(BaseModel):
    """Retries, fallbacks, circuit breakers, health checks and load balancing across deployments."""

    model_config = ConfigDict(extra="forbid")

    num_retries: int = Field(2, ge=0)  # extra attempts inside one model group before its fallbacks
    # seconds before the first retry of a deployment; doubles
    retry_backoff: float = Field(0.1, ge=0)
    retry_backoff_max: float = Field(2.0, ge=0)
    # wait for a retry-after at most this long, else move on
    max_retry_after: float = Field(5.0, ge=0)
    max_fallbacks: int = Field(5, ge=0, le=5)  # fallback hops after the requested model
    default_fallbacks: list[str] = Field(default_factory=list)
    strategy: Literal["weighted_random", "least_in_flight", "lowest_latency"] = "weighted_random"
    # stream: seconds to the first token before failing over
    ttft_timeout: float = Field(30.0, gt=0)
    breaker_failures: int = Field(5, ge=1)  # consecutive failures that open a breaker
    breaker_failure_rate: float = Field(0.5, gt=0, le=1)  # ...or this failure rate over the window
    breaker_window: float = Field(30.0, gt=0)
    breaker_min_requests: int = Field(20, ge=1)  # the rate counts only with this many in the window
    breaker_cooldown: float = Field(30.0, gt=0)  # open → half-open after this (or the retry-after)
    breaker_max_cooldown: float = Field(300.0, gt=0)
    health_check_interval: float = Field(30.0, ge=0)  # seconds between active probes; 0: none
    health_check_timeout: float = Field(2.0, gt=0)
    redis_url: str | None = None  # shared breaker, cooldown and in-flight state across replicas
    redis_prefix: str = "flashstack:router:"
    # caps on what upstreams send
    upstream_limits: UpstreamLimits = Field(default_factory=UpstreamLimits)


# ---- vision (gateway/vision/) ---------------------------------------------------------------


class ImageTargetLimits(BaseModel):
    """What one upstream takes per image; larger images are resized and re-encoded, others pass."""

    model_config = ConfigDict(extra="forbid")

    max_long_edge: int | None = Field(None, gt=0)  # pixels; None: any size
    max_bytes: int | None = Field(None, gt=0)  # decoded bytes per image; None: the gateway's cap


def _default_target_limits() -> dict[str, ImageTargetLimits]:
    # Anthropic: 1568 px long edge is the size it resizes to itself (8000 is the hard maximum), 5 MB
    # per image. OpenAI takes 20 MB and scales server-side. Ollama and the engine
    # take what they get.
    return {
        "anthropic": ImageTargetLimits(max_long_edge=1568, max_bytes=5 * 1024 * 1024),
        "openai": ImageTargetLimits(max_bytes=20 * 1024 * 1024),
    }


class ImageURLConfig(BaseModel):
    """Fetching http(s) image URLs: off by default, because the gateway would fetch
    for the caller."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    # "cdn.example.com", "*.example.com"; [] = any
    allowed_hosts: list[str] = Field(default_factory=list)
    max_bytes: int = Field(10 * 1024 * 1024, gt=0)
    timeout: float = Field(5.0, gt=0)  # seconds for the whole fetch, redirects included
    max_redirects: int = Field(3, ge=0)
    # loopback, private, link-local: only for trusted networks
    allow_private_addresses: bool = False


class VisionConfig(BaseModel):
    """Limits on image payloads and how they are normalized for each upstream."""

    model_config = ConfigDict(extra="forbid")

    max_image_bytes: int = Field(20 * 1024 * 1024, gt=0)  # decoded bytes per image
    max_pixels: int = Field(64_000_000, gt=0)  # width × height from the header, before decoding
    max_images_per_request: int = Field(100, ge=0)
    urls: ImageURLConfig = Field(default_factory=ImageURLConfig)
    # by provider
    targets: dict[str, ImageTargetLimits] = Field(default_factory=_default_target_limits)
    model_targets: dict[str, ImageTargetLimits] = Field(default_factory=dict)  # by model name; wins
    # nvJPEG for batches of JPEGs to resize, when CUDA is present
    gpu: Literal["auto", "off"] = "auto"
    gpu_min_batch: int = Field(2, ge=1)  # fewer JPEGs to resize than this stay on the CPU
    offload_bytes: int = Field(256 * 1024, ge=0)  # base64 above this is checked in a worker thread
    max_concurrent: int = Field(4, ge=1)  # requests decoding images at once (bounds memory)


# ---- sessions, API keys and rate limits (gateway/sessions/, gateway/auth.py) ---------------


class StoreConfig(BaseModel):
    """Where sessions and API keys live: SQLite in state_dir by default, PostgreSQL for replicas."""

    model_config = ConfigDict(extra="forbid")

    database_url: str | None = None  # None: sqlite+aiosqlite:///<state_dir>/flashstack.db (WAL)
    db_schema: str | None = None  # PostgreSQL only: tables live in this schema (created if missing)
    pool_size: int = Field(10, ge=1)  # PostgreSQL connections per replica (SQLite: one writer)
    # per session message, also via X-Session-Id; larger → 413
    max_message_bytes: int = Field(1024 * 1024, gt=0)
    # The newest whole turns of a session's history that fit are sent upstream; older
    # ones stay stored.
    max_history_bytes: int = Field(8 * 1024 * 1024, gt=0)
    # per API key (not the master key); None: no cap
    max_sessions_per_key: int | None = Field(10_000, ge=1)
    lock_timeout: float = Field(120.0, gt=0)  # seconds a turn waits for its session before a 409
    lease_ttl: float = Field(30.0, gt=0)  # a crashed replica's session lock frees itself after this


class AuthConfig(BaseModel):
    """API keys and limits: off unless master_key is set."""

    model_config = ConfigDict(extra="forbid")

    master_key: str | None = None  # admin key (use env:NAME); None: no authentication at all
    redis_url: str | None = None  # shared rate limits across replicas; None: per process
    redis_prefix: str = "flashstack:limits:"
    # tpm: a request without max_tokens holds its prompt estimate + this many tokens
    # until it settles.
    reserve_output_tokens: int = Field(1024, ge=1)
    # mTLS: a verified client certificate whose CN or SAN matches a glob acts as that API key id
    # (when the request sends no key), e.g. {"svc-*.internal": "key_0123456789abcdef"}.
    client_cert_keys: dict[str, str] = Field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return bool(self.master_key)


# ---- spend, traces and the console (gateway/spend.py, gateway/telemetry.py, gateway/ui/) -----


class ModelPrice(BaseModel):
    """USD per million tokens of one model; cache prices default to the input price."""

    model_config = ConfigDict(extra="forbid")

    input: float = Field(ge=0)
    output: float = Field(ge=0)
    cache_write: float | None = Field(None, ge=0)  # Anthropic cache_creation_input_tokens
    cache_read: float | None = Field(None, ge=0)  # Anthropic cache_read / OpenAI cached_tokens


class SpendConfig(BaseModel):
    """What requests cost (prices beside the built-in table) and the request log
    they are kept in."""

    model_config = ConfigDict(extra="forbid")

    # By configured model name or upstream model id; wins over the built-in table. Local models
    # cost 0 unless set.
    prices: dict[str, ModelPrice] = Field(default_factory=dict)
    log_size: int = Field(1000, ge=0)  # the newest requests kept in memory for /ui (0: none)
    store_requests: bool = True  # a row per request (cost, tokens, route) in the sessions database
    flush_interval: float = Field(0.5, gt=0)  # seconds between batched writes of those rows
    # Rows older than this are deleted (hourly); at least 32 days: a monthly budget is
    # seeded from them.
    retention_days: int = Field(400, ge=32)


class TelemetryConfig(BaseModel):
    """OpenTelemetry traces over OTLP/HTTP; off unless enabled or
    OTEL_EXPORTER_OTLP_*ENDPOINT is set."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool | None = None  # None: on when OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT is set
    # e.g. http://collector:4318/v1/traces; None: the OTEL_* variables' choice
    endpoint: str | None = None
    # sent with every export (use env:NAME for tokens)
    headers: dict[str, str] = Field(default_factory=dict)
    service_name: str = "flashstack-gateway"
    sample_ratio: float = Field(1.0, ge=0, le=1)  # of traces the client did not already decide on


class UIConfig(BaseModel):
    """The operator's console at /ui: master key sign-in, a cookie session."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True  # needs auth.master_key; without it /ui says how to turn it on
    session_ttl: float = Field(12 * 3600, gt=0)  # seconds a sign-in lasts
    secure_cookie: bool | None = None  # None: Secure when the request came over https


# ---- context compression (gateway/compress/) ----------------------------------------------

CompressionMode = Literal["auto", "off", "truncate"]


class CompressionConfig(BaseModel):
    """When and how a conversation that outgrows its model's window is compressed."""

    model_config = ConfigDict(extra="forbid")

    mode: CompressionMode = "auto"  # a request's `compression` field overrides it
    # by model name; wins over mode
    model_modes: dict[str, CompressionMode] = Field(default_factory=dict)
    # compress when prompt + output reserve > this × window
    threshold: float = Field(0.85, gt=0, le=1)
    keep_last_turns: int = Field(4, ge=1)  # the newest messages, always kept verbatim
    # cosine distance; picked with bench/compress_eval.py
    dbscan_eps: float = Field(0.35, gt=0, lt=2)
    # extractive: offline, no model call; llm: a routed model; local: a GGUF on the
    # in-process engine
    summarizer: Literal["llm", "local", "extractive"] = "extractive"
    summarizer_model: str | None = None  # llm: a configured model name; None: the routed model
    # local: a GGUF file or model directory; None: the bundled SmolLM2
    summarizer_path: Path | None = None
    summary_sentences: int = Field(3, ge=1)
    summary_max_tokens: int = Field(64, ge=8)  # local: tokens one summary may generate (greedy)
    # local: cluster text it reads, most relevant units first
    summary_input_tokens: int = Field(512, ge=64)
    embed_threads: int = Field(2, ge=1)
    embed_cache_size: int = Field(50_000, ge=0)  # embeddings kept in memory (1.5 KiB each)
    cache_dir: Path | None = None  # the built ONNX models; None: <state_dir>/models
    # The embedding model loads in a background thread, at start-up with preload (readiness is 503
    # until it is loaded), else on the first request that needs it; until then such
    # requests are truncated.
    preload: bool = False
    # One request's budget; past any of them it is truncated instead
    # (x-flashstack-compression-fallback: budget). old messages ranked and clustered (a tool call
    # with its results is one)
    max_units: int = Field(2_000, ge=1)
    # word pieces the embedding model reads; cached texts are free
    max_embed_tokens: int = Field(65_536, ge=0)
    # wall clock from arrival, waiting for the model's thread included
    max_plan_seconds: float = Field(10.0, gt=0)


class Config(BaseSettings):
    """Everything flashstack reads at start-up."""

    model_config = SettingsConfigDict(env_prefix="FLASHSTACK_", env_nested_delimiter="__")

    server: ServerConfig = Field(default_factory=ServerConfig)
    models: list[ModelConfig] = Field(default_factory=list)
    router: RouterConfig = Field(default_factory=RouterConfig)
    vision: VisionConfig = Field(default_factory=VisionConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    compression: CompressionConfig = Field(default_factory=CompressionConfig)
    spend: SpendConfig = Field(default_factory=SpendConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    ui: UIConfig = Field(default_factory=UIConfig)
    state_dir: Path = Path(".flashstack")

    @model_validator(mode="after")
    def _check_models(self) -> "Config":
        for m in self.models:
            if m.provider in ("anthropic", "openai") and not m.api_base:
                m.api_base = {
                    "anthropic": "https://api.anthropic.com",
                    "openai": "https://api.openai.com/v1",
                }[m.provider]
            if m.provider == "ollama" and not m.api_base:
                m.api_base = "http://127.0.0.1:11434"
        return self

    def model_names(self) -> list[str]:
        return list(dict.fromkeys(m.name for m in self.models))


def resolve_env_refs(value: Any) -> Any:
    """Replace every ``env:NAME`` string with the variable's value (missing → ConfigError)."""
    if isinstance(value, dict):
        return {k: resolve_env_refs(v) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve_env_refs(v) for v in value]
    if isinstance(value, str) and value.startswith("env:"):
        name = value[4:]
        if name not in os.environ:
            raise ConfigError(
                f"config refers to env:{name}, but ${name} is not set; export it or edit the config"
            )
        return os.environ[name]
    return value


def load_config(path: str | Path | None = None, **overrides: Any) -> Config:
    """Load the YAML file at `path` (if any), resolve env: references, apply overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top level")
    data = resolve_env_refs(data)
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        config = Config(**data)
    except ValueError as e:
        raise ConfigError(f"invalid config: {e}") from e
    for m in config.models:
        m.check_credentials()
    return config
