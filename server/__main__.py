"""The `ortserve` command line: serve, pull, convert, devices, bench.

Heavy modules (engine, ep, uvicorn, bench) are imported inside each subcommand. `serve` applies the
backend env flags (ep.flags.apply) before anything can load a backend library.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from server.settings import DEFAULT_MODEL, Settings, add_settings_arguments, load_settings

logger = logging.getLogger("ortserve")

# uvicorn's own graceful timeout is the streams' grace plus this slack: streams still running when the grace
# ends are cut and end well-formed (server.http.sse.event_source), and sse-starlette cancels the few whose
# clients stopped reading one second later, all before uvicorn cancels whatever is left.
_UVICORN_SHUTDOWN_SLACK_S = 2.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ortserve", description="OpenAI-compatible LLM server on ONNX Runtime.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="serve a model over the OpenAI API",
                           description="Serve a model. Every flag can also be set as ORTSERVE_<FLAG> "
                                       "(e.g. ORTSERVE_MAX_BATCH=16) or in a --config file.")
    serve.add_argument("--config", metavar="FILE", default=os.environ.get("ORTSERVE_CONFIG"),
                       help="a .json, .toml or .yaml file of settings (field names as keys; a `models` list of "
                            "per-model settings serves several) [env ORTSERVE_CONFIG]")
    add_settings_arguments(serve)
    serve.set_defaults(func=_serve)

    pull = sub.add_parser("pull", help="download and convert a known model into the cache")
    pull.add_argument("name", nargs="?", default=DEFAULT_MODEL,
                      help=f"model name (default {DEFAULT_MODEL}; all-minilm-l6-v2 is the embedding model)")
    pull.add_argument("--cache-dir", default=None,
                      help="cache folder (default ORTSERVE_CACHE_DIR or ~/.cache/ortserve)")
    pull.add_argument("--quiet", action="store_true", help="no progress bars")
    pull.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16"],
                      help="activation and KV dtype (auto: the device's, float16 on CUDA, MIGraphX/AMDGPU and WebGPU)")
    pull.add_argument("--provider", default=os.environ.get("ORTSERVE_PROVIDER", "auto"),
                      help="the device whose dtype auto takes (as serve's --provider)")
    pull.add_argument("--device", default=None, help="device selector (as serve's --device)")
    pull.add_argument("--ep-library", default=os.environ.get("ORTSERVE_EP_LIBRARY"),
                      help="plugin EP library (as serve's --ep-library)")
    pull.set_defaults(func=_pull)

    convert = sub.add_parser("convert", help="convert a GGUF file into an ONNX Runtime GenAI model folder")
    convert.add_argument("gguf", help="the .gguf file")
    convert.add_argument("out_dir", help="the model folder to write")
    convert.add_argument("--accuracy-level", type=int, default=4, choices=range(5),
                         help="MatMulNBits accuracy level: 4 = int8 activations (fast on CPU), 0 = exact")
    convert.add_argument("--dtype", default="float32", choices=["float32", "float16"],
                         help="activation and KV dtype (float16 for GPUs)")
    convert.add_argument("--kv-dtype", default=None, choices=["float32", "float16"],
                         help="KV cache dtype when not --dtype's (float16 halves the KV of a float32 model)")
    convert.add_argument("--exact-scales", action="store_true",
                         help="float16: keep K-quant linears in float32 with exact scales (slower on GPUs) instead "
                              "of rounding their scales to float16")
    convert.add_argument("--overwrite", action="store_true", help="replace out_dir if it exists")
    convert.add_argument("--quiet", action="store_true", help="no progress bar")
    convert.set_defaults(func=_convert)

    devices = sub.add_parser("devices", help="list execution providers, devices and backend flags")
    devices.add_argument("--provider", default="auto", help="provider to pick for (default auto)")
    devices.add_argument("--device", default=None, help="device selector to try")
    devices.add_argument("--ep-library", default=os.environ.get("ORTSERVE_EP_LIBRARY"),
                         help="plugin EP library to register (also AMDGPU_EP_PATH)")
    devices.add_argument("--int4-gemv", action=argparse.BooleanOptionalAction, default=None,
                         help="INT4 GEMV flag as `serve` would apply it")
    devices.add_argument("--json", action="store_true", help="print JSON")
    devices.set_defaults(func=_devices)

    sub.add_parser("bench", help="load-test a server (see `ortserve bench --help`)", add_help=False)
    return parser


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _looks_like_path(model: str) -> bool:
    return os.sep in model or model.endswith(".gguf") or Path(model).exists()


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings from parsed `serve` flags (set flags only), the environment and --config."""
    overrides = {name: value for name, value in vars(args).items() if name in Settings.model_fields}
    return load_settings(overrides, config_file=args.config)


def _serve(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
    except (ValidationError, ValueError, OSError) as exc:
        print(f"ortserve serve: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    _configure_logging(settings.log_level)
    from server.api_servers import refusal

    if (refused := refusal(settings)) is not None:  # before any load: a combination that cannot work
        print(f"ortserve serve: {refused}", file=sys.stderr)
        return 2
    # 0. One malloc arena for the whole process, before any thread starts, so memory can be given back.
    from server.http.memory import use_one_arena

    use_one_arena()

    # 1. Backend env flags, before any library that reads them can load (ep.device, the first session).
    from ep import flags
    from ep.names import EpError

    try:
        flags.apply(settings.provider, settings.int4_gemv)  # logs its own one-line report
        flags.apply_cuda_int4_gemm(settings.provider, settings.max_batch, settings.cuda_int4_gemm)
    except EpError as exc:  # e.g. an unknown --provider
        print(f"ortserve serve: {exc}", file=sys.stderr)
        return 2

    if settings.chat_template is not None:  # a bad --chat-template fails now, not after a long model load
        from engine.chat_template import chat_template_source
        from engine.types import ModelLoadError

        try:
            chat_template_source(settings.chat_template)
        except ModelLoadError as exc:
            print(f"ortserve serve: {exc}", file=sys.stderr)
            return 2

    # 2. The model folder (pull and convert a known name or a GGUF on first use), in the device's dtype.
    from engine.builder import BuildError, resolve_model

    try:
        dtype = model_dtype(settings)
        model_dir = resolve_model(settings.model, dtype=dtype.dtype)
    except (BuildError, OSError, EpError, ValueError) as exc:  # the user's to fix: no traceback
        print(f"ortserve serve: cannot resolve model {settings.model!r}: {exc}", file=sys.stderr)
        return 1
    served_name = settings.served_model_name or (None if _looks_like_path(settings.model) else settings.model)
    settings = settings.model_copy(update={"model": str(model_dir), "served_model_name": served_name})
    if settings.embedding_model:  # pulled (and converted) now too, so a bad name fails before listening
        try:
            embedding_dir = resolve_model(settings.embedding_model)
        except (BuildError, OSError) as exc:
            print(f"ortserve serve: cannot resolve embedding model {settings.embedding_model!r}: {exc}",
                  file=sys.stderr)
            return 1
        served = settings.served_embedding_model_name or (
            None if _looks_like_path(settings.embedding_model) else settings.embedding_model)
        settings = settings.model_copy(update={"embedding_model": str(embedding_dir),
                                               "served_embedding_model_name": served})

    if settings.draft_model:  # pulled (and converted) now too; the engine checks its vocabulary at load
        try:
            # NOTE(server): the draft takes the target's dtype (float16 on a GPU) and, from a GGUF or a name, its
            # --draft-quant copy (a folder is used as it is)
            draft_dir = resolve_model(settings.draft_model, dtype=dtype.dtype, requant=settings.draft_requant)
        except (BuildError, OSError) as exc:
            print(f"ortserve serve: cannot resolve draft model {settings.draft_model!r}: {exc}", file=sys.stderr)
            return 1
        settings = settings.model_copy(update={"draft_model": str(draft_dir)})

    if settings.api_server_count > 1:  # 3'. N API processes over one engine process (server.api_servers)
        from server.api_servers import serve_api_servers

        return serve_api_servers(settings, settings.shutdown_grace_s + _UVICORN_SHUTDOWN_SLACK_S)

    # 3. The app loads the engine in its lifespan (/health is 503 until then); 4. listen.
    import uvicorn

    from server.app import create_app
    from server.http.timeouts import with_header_timeout

    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        http=with_header_timeout(settings.header_timeout_s),
        timeout_graceful_shutdown=settings.shutdown_grace_s + _UVICORN_SHUTDOWN_SLACK_S,
    )
    server = uvicorn.Server(config)
    state = app.state.ortserve

    def stop_on_load_failure(_message: str) -> None:
        server.should_exit = True

    state.on_load_failed = stop_on_load_failure
    logger.info("serving %s on http://%s:%d/v1", model_dir, settings.host, settings.port)
    server.run()
    if state.status == "failed" or state.load_error:
        print(f"ortserve serve: the model in {model_dir} cannot be served: {state.load_error}", file=sys.stderr)
        return 1
    return 0


def model_dtype(settings: Any) -> Any:
    """The dtype the model is converted to and served in (``ep.profiles.DtypeChoice``), logged with its reason.

    ``settings``: anything with provider, device, ep_library and dtype (the serve Settings, pull's args).
    """
    from ep.model_dtype import choose_model_dtype  # after ep.flags.apply: a probe may load a backend (in a child)

    choice = choose_model_dtype(settings.provider, settings.device, settings.ep_library, settings.dtype)
    logger.info("%s", choice.describe())
    return choice


def _pull(args: argparse.Namespace) -> int:
    _configure_logging("info")
    from engine.builder import BuildError, pull_model
    from ep.names import EpError

    try:
        from ep import flags

        flags.apply(args.provider, None)
        dtype = model_dtype(args).dtype
        path = pull_model(args.name, cache_dir=args.cache_dir, progress=not args.quiet, dtype=dtype)
    except (BuildError, OSError, EpError, ValueError) as exc:
        print(f"ortserve pull: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _convert(args: argparse.Namespace) -> int:
    _configure_logging("info")
    from engine.builder import BuildError, convert_gguf

    try:
        path = convert_gguf(args.gguf, args.out_dir, accuracy_level=args.accuracy_level, dtype=args.dtype,
                            overwrite=args.overwrite, progress=not args.quiet, kv_dtype=args.kv_dtype,
                            exact_scales=args.exact_scales)
    except (BuildError, OSError) as exc:
        print(f"ortserve convert: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _devices(args: argparse.Namespace) -> int:
    from ep.device import describe, format_description  # applies ep.flags itself, before registering
    from ep.names import EpError

    try:
        info: dict[str, Any] = describe(args.provider, args.device, args.ep_library, args.int4_gemv)
    except EpError as exc:
        print(f"ortserve devices: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(info, indent=2) if args.json else format_description(info))
    return 0 if info.get("error") is None else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of `ortserve` and `python -m server`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        from bench import INSTALL_HINT, missing_requirements

        if missing := missing_requirements():
            print(f"ortserve bench needs {', '.join(missing)}: {INSTALL_HINT}", file=sys.stderr)
            return 2
        from bench.cli import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
