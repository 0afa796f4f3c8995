"""Server settings: one pydantic-settings model feeds the CLI flags, ORTSERVE_* env vars and a config file.

Owns only configuration values and their bounds; must not import onnxruntime, engine or ep.
"""

from __future__ import annotations

import argparse
import json
import tomllib
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

DEFAULT_MODEL = "smollm2-135m-instruct"
ENV_PREFIX = "ORTSERVE_"


class ModelSpec(BaseModel):
    """One model of the hub (an item of a --config file's ``models`` list, or a repeated --model).

    Fields left unset take the server's own settings (--max-model-len, --max-batch, --provider, --idle-unload-s).
    """

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="A known name (pulled on first use), a .gguf file or a model folder.")
    name: str | None = Field(None, description="The name clients use (default: the known name, or the folder's).")
    aliases: list[str] = Field(default_factory=list, description="More names that route to this model.")
    kind: Literal["chat", "embedding"] | None = Field(
        None, description="chat (a decoder) or embedding (an encoder); default: read from the model folder.")
    max_model_len: int | None = Field(None, ge=16, le=1_048_576)
    max_batch: int | None = Field(None, ge=1, le=256)
    provider: str | None = None
    chat_template: str | None = None
    ttl_s: float | None = Field(None, ge=0.0, description="Seconds idle before unloading (LM Studio's ttl); "
                                "default --idle-unload-s.")
    pinned: bool = Field(False, description="Loaded at start-up and never unloaded.")



class StateStoreSettings(BaseSettings):
    """The state store's settings (server/store): a base of ``Settings``, whose flags, env vars and config keys they
    are like every other field's."""

    state_url: str | None = Field(
        None, description="Where stored responses, conversations, files and batches live: sqlite:///PATH (or a "
        "file path), or postgresql://USER:PASSWORD@HOST/DB for several processes or replicas sharing them "
        "(pip install 'ortserve[postgres]'). Default: the SQLite file state/ortserve.db in the cache folder.",
    )
    state_retention_s: float = Field(
        30 * 86_400.0, ge=0.0, le=10 * 365 * 86_400.0, description="Seconds stored responses, conversations, files "
        "and finished batches are kept (0: until deleted).",
    )
    response_store_size: int = Field(
        10_000, ge=0, le=100_000_000,
        description="Finished responses kept for GET /v1/responses/{id} and previous_response_id (the oldest go "
        "first; 0 keeps none beyond the next sweep).",
    )
    response_store_bytes: int = Field(
        1024**3, ge=0, le=1024**5,
        description="Bytes (as JSON) the stored responses may hold together; the oldest go first.",
    )
    file_max_bytes: int = Field(
        512 * 1024**2, ge=1024, le=64 * 1024**3,
        description="Largest file POST /v1/files takes, in bytes (413 above).",
    )
    batch_max_lines: int = Field(
        50_000, ge=1, le=10_000_000, description="Most requests in one batch's input file (a batch with more fails).",
    )
    batch_concurrency: int | None = Field(
        None, ge=1, le=4096, description="Lines of a batch in the engine at once, at a lower priority than "
        "interactive requests, which take their rows first (default: --max-batch).",
    )
    job_lease_s: float = Field(
        15.0, ge=1.0, le=3600.0, description="Seconds a process's claim on a background response or a batch lasts "
        "without renewal: a process that died loses its work to another after this (on the same host at once).",
    )


class Settings(StateStoreSettings):
    """Everything `ortserve serve` can be told. CLI > environment > config file > defaults."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True)

    # --- model -------------------------------------------------------------------------------------
    model: str = Field(
        DEFAULT_MODEL,
        description="Model to serve: a known name (pulled and converted on first use), a .gguf file, "
        "or an ONNX Runtime GenAI model folder.",
    )
    served_model_name: str | None = Field(
        None, description="Name clients use in the `model` field (default: the model's own name)."
    )
    dtype: Literal["auto", "float32", "float16"] = Field(
        "auto", description="Activation and KV dtype a GGUF or known model is converted to and served in: auto takes "
        "the device's (float16 on CUDA, MIGraphX/AMDGPU and WebGPU, float32 on the CPU). Each file and dtype has its "
        "own cached folder; a model folder of another dtype is converted again from its source, or refused.",
    )
    max_model_len: int | None = Field(
        None, ge=16, le=1_048_576, description="Context length in tokens (default: the model's trained context, "
        "reduced only to what --kv-cache-memory-gib allows for --max-batch rows; the start-up log says which).",
    )
    kv_cache_memory_gib: float | None = Field(
        None, gt=0, le=65_536, description="KV-cache memory budget in GiB that bounds the default context "
        "(default: half the host memory available at start-up).",
    )
    chat_template: str | None = Field(
        None, description="Chat template for /v1/chat/completions, replacing the model's own: a Jinja file or a "
        "built-in name (chatml, gemma, llama3, phi3). A model without one answers chat requests with a 400.",
    )
    tool_call_parser: str | None = Field(
        None, description="Tool-call format of the model's output, instead of the one its chat template shows: "
        "hermes, qwen3_coder, llama3_json, mistral, phi4_mini, deepseek_r1 or generic (vLLM's flag name).",
    )

    models: list[ModelSpec] = Field(
        default_factory=list, description="More models served beside --model (the model hub): --model repeated, or a "
        "--config file's `models` list of {model, name, aliases, kind, max_model_len, max_batch, provider, ttl_s, "
        "pinned}. Each loads on its first request, in an engine process of its own.",
    )
    models_dir: str | None = Field(
        None, description="A folder of models to serve beside --model (each .gguf file and model folder in it).",
    )
    idle_unload_s: float = Field(
        300.0, ge=0.0, le=31_536_000.0, description="Seconds a hub model may stay idle before it is unloaded "
        "(Ollama's keep_alive default; 0: right after each request); a request's keep_alive/ttl overrides it. "
        "The single --model of a one-model server never unloads.",
    )
    memory_budget: str | None = Field(
        None, description="Memory the loaded hub models may use together (bytes, or 8G, 512M): weights plus KV as "
        "estimated from each folder. The least recently used idle model is unloaded to make room. Default: the "
        "selected device's memory on a GPU (as ONNX Runtime or its driver reports it), the machine's RAM on the "
        "CPU, less 10%% (2 GiB at most).",
    )
    load_timeout_s: float = Field(
        120.0, gt=0.0, le=86_400.0, description="Seconds a request waits for its model to load; longer is a 503 "
        "with Retry-After (the load goes on).",
    )

    # --- embeddings --------------------------------------------------------------------------------
    embedding_model: str | None = Field(
        None, description="Embedding model served beside --model on /v1/embeddings (requests pick it by `model`): "
        "a known name (all-minilm-l6-v2), a sentence-transformers folder or a converted model folder.",
    )
    rerank_model: str | None = Field(
        None, description="The model /v1/rerank, /rerank, /v2/rerank and /v1/score use when a request names none: "
        "an embedding model's name (cosine of the embeddings) or the chat model's (the probability of 'yes' to "
        "'Does the document answer the query?'). Default: the embedding model if one is served, else the chat model.",
    )
    served_embedding_model_name: str | None = Field(
        None, description="Name clients use for --embedding-model (default: the name it was given by)."
    )
    embeddings: bool = Field(
        False, description="The chat model also serves /v1/embeddings: pooled, normalized hidden states of its "
        "last layer (llama.cpp's --embeddings).",
    )
    pooling: Literal["mean", "cls", "last", "max", "none"] | None = Field(
        None, description="Pooling of the chat model's --embeddings (default: the model's own, 'last' for chat "
        "models); 'none' answers llama.cpp's /embeddings per token. --embedding-model keeps the pooling it was "
        "trained with.",
    )
    embedding_max_queue: int = Field(
        64, ge=1, le=100_000, description="Most embedding requests waiting or running per embedding model; "
        "more get 429.",
    )
    embedding_batch_tokens: int = Field(
        8192, ge=16, le=1_048_576, description="Most padded tokens (texts x longest text) in one embedding run.",
    )
    load_nice: int = Field(
        5, ge=0, le=19, description="How much lower a hub model's CPU priority is while its engine process loads it "
        "(Linux nice steps; 0: the same), so a load yields the cores to other models' running streams. A one-model "
        "server loads at normal priority.",
    )
    embedding_nice: int = Field(
        10, ge=0, le=19, description="How much lower the embedding threads' CPU priority is than the chat "
        "engine's (Linux nice steps; 0: the same), so embedding work yields the cores to running chat streams.",
    )

    # --- network -----------------------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="Address to listen on (127.0.0.1 keeps the server local).")
    port: int = Field(8000, ge=1, le=65535, description="TCP port to listen on.")
    api_key: SecretStr | None = Field(
        None, description="If set, every request except /health (and /metrics) needs `Authorization: Bearer KEY`."
    )
    metrics_require_key: bool = Field(False, description="Also require the API key for /metrics.")
    ui: bool = Field(
        True, description="Serve the built-in chat page at / and /ui/ (--no-ui turns it off; the API is unchanged)."
    )
    cors_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Origins allowed by CORS, comma-separated; empty turns CORS off."
    )
    max_body_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, le=1024**3, description="Largest accepted request body in bytes (413 above)."
    )
    header_timeout_s: float = Field(
        10.0, gt=0.0, le=3600.0,
        description="Seconds a client has to send a request's headers, from its first byte (or from connecting); "
        "a slower one gets 408 and is disconnected.",
    )
    body_timeout_s: float = Field(
        30.0, gt=0.0, le=3600.0,
        description="Seconds a client may pause while sending a request body (e.g. one shorter than its "
        "Content-Length); a longer pause gets 408.",
    )

    # --- device ------------------------------------------------------------------------------------
    provider: str = Field(
        "auto",
        description="Execution provider: auto, amdgpu, migraphx, webgpu, openvino, cuda or cpu "
        "(case-insensitive; a trailing 'ExecutionProvider' is ignored).",
    )
    device: str | None = Field(
        None, description="Device selector: an index, a PCI bus id or vendor:device (default: the first match)."
    )
    ep_library: str | None = Field(
        None, description="Path of a plugin EP library to register, e.g. the AMDGPU EP (also AMDGPU_EP_PATH)."
    )
    ep_option: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Provider option KEY=VALUE, repeatable (env: comma-separated)."
    )
    int4_gemv: bool | None = Field(
        None, description="INT4 GEMV kernels for decode (default: on for AMD GPUs; --no-int4-gemv turns them off)."
    )
    cuda_int4_gemm: bool | None = Field(
        None, description="The CUDA EP's fused INT4 GEMM/GEMV for MatMulNBits, ORT_FPA_INTB_GEMM (default: on when "
        "--max-batch > 1, where batched decode steps gain most, unless the environment sets it; "
        "--no-cuda-int4-gemm turns it off)."
    )
    intra_op_threads: int | None = Field(
        None, ge=1, le=1024, description="ONNX Runtime intra-op threads (default: the physical cores)."
    )
    graph_capture: bool | None = Field(
        None, description="Capture the decode steps as device graphs (WebGPU, CUDA; default: on where the graph "
        "allows it, with a logged fallback; --no-graph-capture turns it off, --graph-capture requires it)."
    )
    batched_prompts: bool | None = Field(
        None, description="New requests' prompts go in together: one right-padded run for all but their last "
        "tokens, which join the step's decode run (default: on with the CUDA EP, where a run costs its kernel "
        "launches; --no-batched-prompts runs each prompt's chunks on their own)."
    )
    batched_prompt_tokens: int | None = Field(
        None, ge=0, le=1_048_576, description="With batched prompts, the most tokens of new requests' whole prompts "
        "one engine step runs together beside its token budget, so many arrivals at once take a few runs (default: "
        "2048; 0: within the token budget)."
    )
    device_row_summary: bool | None = Field(
        None, description="Captured decode steps also compute each row's argmax and log-normalizer on the device "
        "(default: on with the CUDA EP; greedy tokens and their logprobs then skip a pass over the logits on the "
        "CPU; --no-device-row-summary turns it off)."
    )
    one_row_session: bool | None = Field(
        None, description="With the CUDA EP's fused INT4 kernels on and captured decode steps, a one-row step runs "
        "on a session of its own made without them, whose one-row GEMV is faster (default: on where that applies; "
        "it shares the weights' device copy but holds its own activations and graphs, 3.3 GB on an 8B; "
        "--no-one-row-session keeps one decode session)."
    )
    gil_switch_interval_ms: float | None = Field(
        None, gt=0, le=100, description="Python's thread switch interval (sys.setswitchinterval) once the model is "
        "loaded (default: 0.5 ms when the model runs on a device, so the engine thread gets the interpreter back "
        "promptly after each device step while the event loop streams; Python's own 5 ms on the CPU)."
    )

    # --- scheduling --------------------------------------------------------------------------------
    max_batch: int = Field(8, ge=1, le=256, description="Most requests decoded together (KV slots).")
    max_queue: int = Field(64, ge=0, le=100_000, description="Most requests waiting for a slot; more get 429.")
    prefill_chunk: int | None = Field(
        None, ge=16, le=1_048_576,
        description="Token budget per engine step, > max_batch (default: the engine's, 256).",
    )
    max_prefills_per_step: int | None = Field(
        None, ge=0, le=256, description="Most requests whose prompt chunks share one engine step's token budget "
        "(0: as many as it holds; 1: one request per step, the others wait a step each; default: 1 where each "
        "chunk is a run of its own through a staging row (WebGPU), else 0).",
    )
    default_max_tokens: int | None = Field(
        None, ge=1, description="max_tokens when a request gives none (default: the rest of the context)."
    )
    default_temperature: float | None = Field(
        None, ge=0.0, le=2.0, description="Sampling temperature when a request gives none (default: the model's "
        "generation_config.json, else 1, the APIs' own; 0 is greedy). Agent CLIs send none: a small model follows "
        "their long prompts better greedy.",
    )
    generation_config: Literal["auto", "none"] = Field(
        "auto", description="Sampling defaults of requests that leave them unset (vLLM's flag): auto takes the "
        "model folder's generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty: what its "
        "creator recommends); none takes the APIs' own (temperature 1, nothing truncated, no penalty).",
    )
    grammar_compile_timeout_s: float = Field(
        10.0, gt=0.0, le=3600.0,
        description="Seconds a structured-output schema or grammar may take to compile; longer is a 400.",
    )

    prefix_caching: bool = Field(
        True, description="Keep finished requests' KV and reuse the longest matching prompt prefix "
        "(--no-prefix-caching turns it off)."
    )
    speculative_tokens: int | None = Field(
        None, ge=0, le=64,
        description="Longest prompt-lookup draft checked per decode run (speculative decoding; default: the "
        "engine's, 16; 0 turns it off).",
    )

    draft_model: str | None = Field(
        None, description="A smaller model of the same vocabulary that drafts tokens the served model checks "
        "(speculative decoding: llama.cpp's -md, LM Studio's draft model): a known name, a .gguf file or a model "
        "folder; pulled and converted like --model. Output is unchanged (greedy: token for token; sampled: the same "
        "distribution). The start refuses a model whose vocabulary differs, naming the first difference.",
    )
    draft_max: int = Field(
        16, ge=0, le=64, description="Most tokens one draft of the draft model holds (llama.cpp's "
        "--spec-draft-n-max, vLLM's num_speculative_tokens); each request's length adapts below it.",
    )
    draft_min: int = Field(
        0, ge=0, le=64, description="A draft of the draft model shorter than this is not checked (llama.cpp's "
        "--spec-draft-n-min).",
    )
    draft_p_min: float = Field(
        0.75, ge=0.0, le=1.0, description="A row stops drafting once the draft model gave its token less than this "
        "probability (llama.cpp's --spec-draft-p-min, and its default).",
    )
    draft_quant: Literal["q4_0", "none"] = Field(
        "q4_0", description="How a draft model from a .gguf file or a known name is converted: q4_0 requantizes "
        "its weights stored in more than 4 bits (Q5_0, Q8_0, Q6_K: 8-bit in ONNX) to llama.cpp's Q4_0, so that a "
        "draft step reads about half the bytes (the target checks every draft token, so its output is unchanged); "
        "none converts it exactly. A model folder is used as it is (vLLM's speculative-config quantization).",
    )
    per_request_spec_decode_metrics: Literal["none", "summary", "detailed"] = Field(
        "none", description="Each chat or completions response (the last chunk with usage, when streamed) and "
        "each Responses or Messages response carries its own draft checks in `metrics.speculative_decoding`, as "
        "vLLM's flag of this name does: summary (checks, tokens drafted and accepted, mean acceptance length, "
        "acceptance rate, histogram); detailed adds each check's drafted and accepted counts. none: responses "
        "are unchanged.",
    )

    @property
    def draft_requant(self) -> str | None:
        """--draft-quant as the builder's ``requant`` (None: exact)."""
        return None if self.draft_quant == "none" else self.draft_quant

    step_trace: str | None = Field(
        None, description="Append a JSON line per engine step and per garbage collection to this file (when, how "
        "long, each phase, what it ran), and one per late wake-up of the server's event loop (to line up with a bench's token gaps: "
        "docs/perf/README.md); default: off."
    )

    sse_ping_s: float = Field(
        15.0, ge=0.0, le=3600.0, description="Seconds between SSE keep-alive comments on a stream (0 disables)."
    )

    # --- process -----------------------------------------------------------------------------------
    engine_process: bool | None = Field(
        None, description="Run the engine core (session, KV cache, scheduler, samplers) in a process of its own, so "
        "it never waits for the interpreter lock while the server streams (default: on when the model runs on a "
        "device, off on the CPU; --no-engine-process keeps it in the server's process)."
    )
    api_server_count: int = Field(
        1, ge=1, le=64, description="API processes (HTTP, validation, chat template, tokenizing) in front of one "
        "engine process, sharing the listening socket (vLLM's flag); more than 1 spreads request admission over "
        "several processes. Needs one chat model in an engine process (no hub, no embeddings).",
    )
    shutdown_grace_s: float = Field(
        10.0, ge=0.0, le=3600.0, description="On SIGTERM, seconds running requests get to finish before abort."
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field("info", description="Log level.")

    @field_validator("cors_origins", "ep_option", mode="before")
    @classmethod
    def _split_list(cls, value: Any) -> Any:
        """Env vars give one string: accept a JSON list or comma-separated items."""
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [item.strip() for item in text.split(",") if item.strip()]
        return value

    @field_validator("ep_option")
    @classmethod
    def _check_ep_option(cls, value: list[str]) -> list[str]:
        for item in value:
            key, sep, _ = item.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"ep_option items must look like KEY=VALUE, got {item!r}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _repeated_model(cls, data: Any) -> Any:
        """--model repeated (a list): the first is the default model, the others join ``models``."""
        if isinstance(data, dict) and isinstance(data.get("model"), list):
            data = dict(data)
            first, *more = data["model"]
            data["model"] = first
            if more:
                data["models"] = [*(data.get("models") or []), *more]
        return data

    @field_validator("models", mode="before")
    @classmethod
    def _model_strings(cls, value: Any) -> Any:
        """A bare string (--models NAME, ORTSERVE_MODELS=a,b) is a model with every setting defaulted."""
        if isinstance(value, str):
            value = [item.strip() for item in value.split(",") if item.strip()]
        if isinstance(value, list):
            return [{"model": item} if isinstance(item, str) else item for item in value]
        return value

    @field_validator("tool_call_parser")
    @classmethod
    def _check_tool_call_parser(cls, value: str | None) -> str | None:
        from server.tools.formats import FORMATS  # noqa: PLC0415 - settings load before anything else

        if value is not None and value not in FORMATS:
            raise ValueError(f"tool_call_parser must be one of {sorted(FORMATS)}, got {value!r}")
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_log_level(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    def ep_options(self) -> dict[str, str]:
        """`ep_option` as a dict (later items win)."""
        return {k.strip(): v.strip() for k, _, v in (item.partition("=") for item in self.ep_option)}

    def api_key_value(self) -> str | None:
        return self.api_key.get_secret_value() if self.api_key is not None else None


# --- config file ------------------------------------------------------------------------------------


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a settings file (.json, .toml or .yaml; keys are the field names, e.g. `max_batch`).

    A YAML or JSON file that holds a list is the hub's ``models`` list alone.

    Args:
        path: the file; its suffix picks the format.

    Returns:
        The raw values, validated later by `Settings`.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".toml":
        data = tomllib.loads(text)
    elif path.suffix.lower() in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text) or {}
    else:
        data = json.loads(text)
    if isinstance(data, list):
        data = {"models": data}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a table/object of settings, got {type(data).__name__}")
    return data


class _FileSource(PydanticBaseSettingsSource):
    """Lowest-priority source (above defaults): the values of a config file."""

    def __init__(self, settings_cls: type[BaseSettings], values: dict[str, Any]) -> None:
        super().__init__(settings_cls)
        self._values = values

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self._values.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self._values)


def load_settings(overrides: dict[str, Any] | None = None, config_file: str | Path | None = None) -> Settings:
    """Build `Settings` from CLI overrides, the environment and an optional config file.

    Args:
        overrides: values given on the command line (highest priority).
        config_file: a .json/.toml file (lowest priority above the defaults).

    Returns:
        The validated settings; raises pydantic.ValidationError naming the bad field.
    """
    overrides = dict(overrides or {})
    if config_file is None:
        return Settings(**overrides)
    file_values = read_config_file(config_file)

    class _WithFile(Settings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return init_settings, env_settings, _FileSource(settings_cls, file_values)

    merged = _WithFile(**overrides)
    # NOTE(server): re-validate as the plain class so callers see `Settings`, not the local subclass.
    return Settings.model_validate(merged.model_dump())


# --- argparse flags generated from the fields (as llama-cpp-python's cli.py does) --------------------


def _unwrap(annotation: Any) -> tuple[Any, bool]:
    """(inner type, optional?) of `X | None` / `Optional[X]` / `Annotated[X, ...]`."""
    if typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _unwrap(args[0])[0], True
    return annotation, False


# The peers' names of a few flags, accepted beside ours (llama.cpp's llama-server, vLLM).
FLAG_ALIASES: dict[str, tuple[str, ...]] = {
    "draft_model": ("-md", "--model-draft", "--spec-draft-model"),
    "draft_max": ("--spec-draft-n-max", "--num-speculative-tokens"),
    "draft_min": ("--spec-draft-n-min",),
    "draft_p_min": ("--spec-draft-p-min",),
}


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def add_settings_arguments(parser: argparse.ArgumentParser, settings_cls: type[BaseSettings] = Settings) -> None:
    """Add one flag per settings field; unset flags stay absent so env and config file still apply.

    Booleans get `--x/--no-x`; list fields are repeatable; everything else is parsed by pydantic.
    """
    for name, field in settings_cls.model_fields.items():
        inner, _ = _unwrap(field.annotation)
        help_text = field.description or ""
        env_name = f"{ENV_PREFIX}{name.upper()}"
        default = field.default if field.default_factory is None else field.default_factory()
        if isinstance(default, SecretStr):
            default = "***"
        help_text = f"{help_text} [env {env_name}; default {default!r}]"
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text}
        flags = (flag_name(name), *FLAG_ALIASES.get(name, ()))
        if inner is bool:
            parser.add_argument(flag_name(name), action=argparse.BooleanOptionalAction, **kwargs)
        elif name == "model":  # NOTE(server): repeated --model serves several (the first is the default model)
            parser.add_argument(flag_name(name), action="append", metavar="VALUE", **kwargs)
        elif typing.get_origin(inner) is list:
            parser.add_argument(flag_name(name), action="append", metavar="VALUE", **kwargs)
        elif typing.get_origin(inner) is Literal:
            parser.add_argument(flag_name(name), choices=list(typing.get_args(inner)), **kwargs)
        else:
            metavar = {int: "N", float: "SECONDS" if name.endswith("_s") else "X"}.get(inner, "VALUE")
            parser.add_argument(*flags, metavar=metavar, **kwargs)
