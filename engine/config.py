"""EngineConfig: how one engine instance runs (device, batch and queue bounds, context, threads).

A frozen dataclass with validation next to each check; no onnxruntime import.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from engine.types import InvalidRequestError, StepInfo

# Speculative decoding: the default longest draft (measured, docs/perf/engine-features.md) and the bound.
DEFAULT_SPECULATIVE_TOKENS = 16
MAX_SPECULATIVE_TOKENS = 64
# Speculative decoding with a draft model (llama.cpp's --spec-draft-n-max / --spec-draft-p-min, vLLM's
# num_speculative_tokens): the longest draft (the length adapts per request below it) and the draft's confidence under
# which a row stops drafting (llama.cpp's default; measured on the 2-core CPU, docs/perf/speculative.md).
DEFAULT_DRAFT_MAX = 16
DEFAULT_DRAFT_P_MIN = 0.75
# New requests' whole prompts run together per step, beside the token budget (see EngineConfig.batched_prompt_tokens):
# 64 arrivals of ~40 tokens in one or two steps, each prompt run a few decode steps long (docs/perf/GPU.md).
DEFAULT_BATCHED_PROMPT_TOKENS = 2048


@dataclass(frozen=True)
class EngineConfig:
    """Settings for one ``AsyncEngine``.

    Attributes:
        provider: execution provider, "cpu" or a name ``ep/`` knows ("auto", "amdgpu", "webgpu", ...).
        device: device selector passed to ``ep.device.select_device`` (index, PCI bus id, "vendor:device").
        ep_library: path of a plugin EP library to register (AMDGPU).
        ep_options: provider options on top of genai_config's ``session_options.provider_options``.
        max_batch: KV slots = requests decoded together.
        max_queue: requests allowed to wait for a slot; one more raises EngineOverloadedError.
        max_model_len: tokens per request (prompt + output); None -> the model's trained context, reduced only
            to what ``kv_cache_memory_gib`` allows for ``max_batch`` rows (``engine.context_length``).
        kv_cache_memory_gib: the KV memory budget that bounds the default max_model_len; None -> half the host
            memory available at load (device memory is not asked of the EP).
        prefill_chunk: token budget per step (decode tokens + prefill chunks; new requests' whole prompts run
            together have ``batched_prompt_tokens`` beside it); None -> the device's (``ep.profiles``: 256, and 512
            on WebGPU, whose staged prompt runs cost about the same up to 512 tokens), at least max_batch + 1.
        intra_op_threads: ORT intra-op threads; None -> number of physical cores.
        allow_spinning: let ORT's intra-op threads spin between ops (lower latency, burns CPU).
        stop_spinning: stop the intra-op threads spinning as each run ends (ORT's ``session.force_spinning_stop``;
            spinning between the ops of a run stays). Two sessions that run in turn on the same cores, a draft
            model and its target, each have a thread pool; one left spinning after its run takes the cores from
            the other's (on 2 cores: a 1.5B's decode step 70 -> 100 ms after each 0.5B draft step, the 0.5B's
            26 -> 48 ms; docs/perf/speculative.md). None -> on where a draft model is loaded (both its sessions
            and the target's).
        kv_rows: how KV rows are bound, overriding what the device's memory allows (``engine.placement``):
            None -> the device's way; "opaque" -> the bucket path of opaque buffers (prefix views, a staging row,
            device row copies: on the CPU EP a stand-in for WebGPU); "pointer" -> rows bound by address (on the
            CPU EP, host memory bound by address + row offset exactly as CUDA/HIP device memory is: their
            stand-in).
        graph_capture: capture the whole-buffer decode step once and replay it (WebGPU's enableGraphCapture,
            the analog of the AMDGPU EP's HIP graphs): fixed [max_batch, 1] shapes, every input and output
            in a fixed device buffer. None -> on for WebGPU and CUDA when the graph allows it (else off, the
            reason logged); True -> required (a model or provider that can't is a ModelLoadError); False -> off.
        matmul_row_groups: captured decode steps run each MatMulNBits on groups of at most 3 rows, this
            many groups, then one run on the rest (``engine.graph_capture.split_matmul_rows``: WebGPU's
            small-M kernel is several times faster than its tiled one at 4-8 rows); 0 -> off, None -> the
            device's default.
        fixed_chunk_shapes: prompt chunks and draft checks in a row run as pieces of fixed lengths, each run
            once at load (``engine.row_chunks.chunk_pieces``: 141 tokens as 128 + 13); None -> on for the CUDA EP,
            whose first run of a length costs 50-85 ms, when its fused INT4 kernels are on (ORT_FPA_INTB_GEMM;
            with ORT's own kernels pieces of 14-16 tokens after a past gave tokens unlike the CPU EP's); row-view
            KV only.
        batched_prompts: new requests' prompts that fit one run go in together, all but each one's last token as
            one first-prompt run filled up to a common width (``engine.row_chunks.RowChunks.prompts``), the last
            tokens within the step's decode run; None -> on for the CUDA EP (runs of fixed widths, warmed at
            load), False -> one chunk run each.
        batched_prompt_tokens: with batched prompts, the most tokens of new requests' whole prompts one step runs
            together beside its token budget (``prefill_chunk``), so a burst of arrivals takes a few runs, not a step
            each (vLLM's max_num_batched_tokens); None -> ``DEFAULT_BATCHED_PROMPT_TOKENS``; 0 -> within the token
            budget.
        device_row_summary: captured decode steps also give each row's argmax and log-normalizer, computed on
            the device (``engine.graph_capture.add_row_summary``), so greedy rows and their log-probabilities
            skip the CPU's pass over the logits; None -> on for the CUDA EP, False -> off.
        one_row_session: with captured decode steps on the CUDA EP and its fused INT4 kernels on
            (ORT_FPA_INTB_GEMM), the one-row step runs on a session of its own made without them: their one-row
            GEMV is slower than ORT's own, their batched GEMM faster (docs/perf/GPU.md). It shares
            the weights' device copy (``share_weights``) but holds its own activations and CUDA graphs (3.3 GB on
            the 8B shape, docs/perf/sizes.md). None -> on where that applies, False -> off.
        share_weights: the decoder's sessions take one device copy of its large initializers instead of one each
            (``engine.shared_weights``, where the device uses them in place); None -> on where the engine opens
            the decoder more than once (captured decode steps on pointer rows: CUDA), False -> off.
        seed: seed of the rng used by requests that give no seed (None -> fresh entropy).
        chat_template: replaces the model's chat template: a built-in name (``engine.chat_template.
            BUILTIN_TEMPLATES``) or a Jinja file; None keeps the model's own.
        grammar_compile_timeout_s: a structured-output grammar (JSON schema, regex, Lark, GBNF) that has not
            compiled within this many seconds is refused (InvalidRequestError -> 400).
        grammar_cache_size: compiled grammars kept for reuse (least recently used dropped first).
        prefix_caching: keep finished requests' KV in their slots and reuse the longest matching prompt prefix
            (engine/prefix_cache.py); False -> every prompt is computed in full.
        speculative_tokens: the longest prompt-lookup draft checked per run (speculative decoding,
            engine/speculative.py); 0 -> off. Off by itself on whole-buffer devices (a draft check needs a
            row of its own).
        speculative_max_batch: drafts are checked only while at most this many requests decode: a check runs
            alone (GroupQueryAttention takes S > 1 new tokens with a past at batch 1 only), so beside other
            streams it costs a run of its own instead of one row of the shared decode run.
        draft_model: a model folder whose model drafts for this one (speculative decoding, ``engine.spec_decode``):
            the same vocabulary (checked at load: ``engine.spec_decode.vocab``), its own KV rows; None: no draft model.
        draft_max: the most tokens the draft model drafts per check (llama.cpp's --spec-draft-n-max).
        draft_min: a draft-model draft shorter than this is dropped (llama.cpp's --spec-draft-n-min).
        draft_p_min: a row stops drafting once the draft model gave its token less than this probability
            (llama.cpp's --spec-draft-p-min).
        max_prefills_per_step: the most requests whose prompt chunks share one step's token budget (0: as
            many as it holds; 1: one request's chunk per step, the others wait a step each; None: the runner's
            ``max_prefills_per_step``).
        min_prefix_reuse: the shortest cached prefix a prompt reuses (None: automatic,
            ``engine.core_process.min_prefix_reuse``: the runner's own where it has one (a chunk, where prompt chunks
            go through a staging row), ``engine.prefix_cache.MIN_REUSE_BATCHED_PROMPTS`` where new prompts run
            together, else 1).
        engine_process: run the engine core (session, KV cache, scheduler, samplers) in a process of its own
            (``engine.core_process``), so that it never waits for the interpreter lock held by the event loop;
            tokenizing, detokenizing and stop strings stay in the caller's process. None -> on where the model runs
            on a device, off on the host CPU (``engine.core_client.use_engine_process``).
        load_nice: how many Linux nice steps lower the CPU priority of loading runs than serving, in an engine
            process (``engine.load_priority``): a hub loads models beside other models' running streams. 0: the same.
        step_trace: a file the core appends a JSON line to per step and per garbage collection
            (``engine.step_trace``: when, how long, each phase, what it ran), to find where streams stall; None: off.
        fault_injector: TEST-ONLY hook, called on the core thread with a ``StepInfo`` just before each model
            run; an exception it raises fails exactly that run's requests (finish_reason ERROR), as a device
            error would, and the engine goes on. None (the default) costs nothing. With ``engine_process`` it runs
            in the engine process, so it must pickle (a module-level class or function: tests/pacing.py).
    """

    provider: str = "cpu"
    device: str | None = None
    ep_library: str | None = None
    ep_options: Mapping[str, str] = field(default_factory=dict)
    max_batch: int = 8
    max_queue: int = 64
    max_model_len: int | None = None
    kv_cache_memory_gib: float | None = None
    prefill_chunk: int | None = None
    intra_op_threads: int | None = None
    allow_spinning: bool = True
    stop_spinning: bool | None = None
    kv_rows: str | None = None
    graph_capture: bool | None = None
    matmul_row_groups: int | None = None
    fixed_chunk_shapes: bool | None = None
    device_row_summary: bool | None = None
    one_row_session: bool | None = None
    share_weights: bool | None = None
    batched_prompts: bool | None = None
    batched_prompt_tokens: int | None = None
    seed: int | None = None
    chat_template: str | None = None
    grammar_compile_timeout_s: float = 10.0
    grammar_cache_size: int = 64
    prefix_caching: bool = True
    speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS
    speculative_max_batch: int = 1
    draft_model: str | None = None
    draft_max: int = DEFAULT_DRAFT_MAX
    draft_min: int = 0
    draft_p_min: float = DEFAULT_DRAFT_P_MIN
    max_prefills_per_step: int | None = None
    min_prefix_reuse: int | None = None
    engine_process: bool | None = None
    load_nice: int = 0
    step_trace: str | None = None
    fault_injector: Callable[[StepInfo], None] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        _check(self.kv_rows in (None, "pointer", "opaque"), "kv_rows", "must be None, 'pointer' or 'opaque'",
               self.kv_rows)
        _check(1 <= self.max_batch <= 256, "max_batch", "must be in [1, 256]", self.max_batch)
        _check(0 <= self.max_queue, "max_queue", "must be >= 0", self.max_queue)
        _check(0 <= self.load_nice <= 19, "load_nice", "must be in [0, 19]", self.load_nice)
        _check(self.max_model_len is None or self.max_model_len >= 2, "max_model_len", "must be >= 2",
               self.max_model_len)
        _check(self.kv_cache_memory_gib is None or self.kv_cache_memory_gib > 0, "kv_cache_memory_gib", "must be > 0",
               self.kv_cache_memory_gib)
        _check(self.prefill_chunk is None or self.prefill_chunk >= self.max_batch + 1, "prefill_chunk",
               f"must be > max_batch ({self.max_batch}) so a prefill chunk fits beside a full decode batch",
               self.prefill_chunk)
        _check(self.grammar_compile_timeout_s > 0, "grammar_compile_timeout_s", "must be > 0",
               self.grammar_compile_timeout_s)
        _check(self.grammar_cache_size >= 1, "grammar_cache_size", "must be >= 1", self.grammar_cache_size)
        _check(self.intra_op_threads is None or self.intra_op_threads >= 1, "intra_op_threads",
               "must be >= 1", self.intra_op_threads)
        _check(0 <= self.speculative_tokens <= MAX_SPECULATIVE_TOKENS, "speculative_tokens",
               f"must be in [0, {MAX_SPECULATIVE_TOKENS}]", self.speculative_tokens)
        _check(self.max_prefills_per_step is None or self.max_prefills_per_step >= 0, "max_prefills_per_step",
               "must be >= 0 (0: as the budget holds)", self.max_prefills_per_step)
        _check(self.min_prefix_reuse is None or self.min_prefix_reuse >= 1, "min_prefix_reuse", "must be >= 1",
               self.min_prefix_reuse)
        _check(self.batched_prompt_tokens is None or self.batched_prompt_tokens >= 0, "batched_prompt_tokens",
               "must be >= 0", self.batched_prompt_tokens)
        _check(0 <= self.draft_max <= MAX_SPECULATIVE_TOKENS, "draft_max", f"must be in [0, {MAX_SPECULATIVE_TOKENS}]",
               self.draft_max)
        _check(0 <= self.draft_min <= self.draft_max, "draft_min", f"must be in [0, draft_max ({self.draft_max})]",
               self.draft_min)
        _check(0.0 <= self.draft_p_min <= 1.0, "draft_p_min", "must be in [0, 1]", self.draft_p_min)
        _check(self.speculative_max_batch >= 1, "speculative_max_batch", "must be >= 1", self.speculative_max_batch)


def _check(ok: bool, param: str, rule: str, value: object) -> None:
    if not ok:
        raise InvalidRequestError(f"{param} {rule}, got {value!r}", param=param, code="invalid_value")
