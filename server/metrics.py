"""Prometheus metrics of one app (a per-app CollectorRegistry) and the per-request latency tracker.

Gauges are read from EngineStats at scrape time; latencies are measured here, at the HTTP edge. Every series carries
vLLM's ``model_name`` label (a one-model server has one value; a hub one per model): dashboards and alerts that
want the server's total sum it away (``sum without (model_name)``). No onnxruntime import.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.types import EngineStats, FinishReason, RequestOutput

MODEL = "model_name"  # vLLM's label: the served model name

# Buckets in seconds: sub-millisecond decode steps up to minute-long requests on a CPU.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)

# `status` label values of ortserve_requests_total: the finish reasons plus 'rejected' (4xx/429
# before the engine ran the request).
REJECTED = "rejected"

# The endpoint label of the readout series: requests that read logits instead of generating.
READOUT_ENDPOINTS = ("decisions", "systemone", "rerank", "score")

# NOTE(server): the KV "block" the gateway hashes prompts by (the vllm:cache_config_info labels). Prefix reuse here
# is per token (a slot keeps any prefix), so every block size is exact; this is vLLM's default.
CACHE_BLOCK_SIZE = 16


class ServerMetrics:
    """All metric objects of one app; a fresh registry so two apps in one process never clash.

    Args:
        default_model: the served name a request counts under before it is routed to a model (a body refused
            before its ``model`` was read); the app's default chat model.
    """

    def __init__(self, default_model: str = "") -> None:
        self.registry = CollectorRegistry()
        self.default_model = default_model
        r, m = self.registry, [MODEL]
        self.requests_running = Gauge("ortserve_requests_running", "Requests in the running batch.", m, registry=r)
        self.requests_waiting = Gauge("ortserve_requests_waiting", "Requests waiting for a KV slot.", m, registry=r)
        self.kv_slots_free = Gauge("ortserve_kv_slots_free", "Free KV cache slots.", m, registry=r)
        self.kv_slots_total = Gauge("ortserve_kv_slots_total", "KV cache slots in all (max_batch).", m, registry=r)
        self.time_to_first_token = Histogram(
            "ortserve_time_to_first_token_seconds", "Request arrival to first generated text, seconds.", m,
            buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "ortserve_inter_token_latency_seconds", "Time between generated tokens of a request, seconds.", m,
            buckets=_ITL_BUCKETS, registry=r)
        self.e2e_request_latency = Histogram(
            "ortserve_e2e_request_latency_seconds", "Request arrival to its last output, seconds.", m,
            buckets=_LATENCY_BUCKETS, registry=r)
        self.request_queue_time = Histogram(
            "ortserve_request_queue_time_seconds",
            "Engine submission until the engine first scheduled the request (waiting for a slot), seconds.", m,
            buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("ortserve_prompt_tokens", "Prompt tokens of finished requests.", m,
                                     registry=r)
        self.generation_tokens = Counter("ortserve_generation_tokens", "Generated tokens.", m, registry=r)
        self.requests = Counter("ortserve_requests", "Requests by outcome.", [MODEL, "status"], registry=r)
        # Engine totals by EngineStats.extra key (_render_model advances them)
        self._engine_counters = {
            "prefix_cache_queries_total": Counter(
                "ortserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", m, registry=r),
            "prefix_cache_hits_total": Counter(
                "ortserve_prefix_cache_hits", "Prompt tokens whose KV the prefix cache supplied.", m, registry=r),
            "spec_drafts_total": Counter(
                "ortserve_spec_decode_drafts", "Speculative draft checks (prompt lookup or the draft model).", m,
                registry=r),
            "spec_draft_tokens_total": Counter(
                "ortserve_spec_decode_draft_tokens", "Tokens proposed by speculative drafts (prompt lookup or the "
                "draft model).", m, registry=r),
            "spec_accepted_tokens_total": Counter(
                "ortserve_spec_decode_accepted_tokens", "Draft tokens the model accepted.", m, registry=r),
            "steps_total": Counter("ortserve_engine_steps", "Engine steps (schedule, runs, outputs).", m,
                                   registry=r),
            "batch_runs_stopped_total": Counter(
                "ortserve_batch_runs_stopped", "Model runs of batch rows only (priority > 0) that an interactive "
                "request's arrival stopped midway (run again later).", m, registry=r),
            "batch_runs_skipped_total": Counter(
                "ortserve_batch_runs_skipped", "Model runs of batch rows only that an interactive request waiting "
                "kept from starting.", m, registry=r),
            "engine_thread_cpu_s": Counter(
                "ortserve_engine_thread_cpu_seconds", "CPU seconds of the engine thread (beside its phases' wall "
                "seconds: the rest waited on the device or the interpreter).", m, registry=r),
            "engine_process_cpu_s": Counter(
                "ortserve_engine_process_cpu_seconds", "CPU seconds of the engine process, all its threads "
                "(--engine-process; 0 when the engine runs in the server's process).", m, registry=r),
        }
        self._engine_seen: dict[tuple[str, str], float] = {}  # (model, key) -> last total
        # one child per model and "engine_phase_<name>_s" key of EngineStats.extra, the first time a scrape sees it
        self.engine_phase = Counter(
            "ortserve_engine_step_phase_seconds", "Wall seconds the engine thread spent per step phase (schedule, "
            "decode_run, decode_sample, decode_update, verify, prefill).", [MODEL, "phase"], registry=r)
        self.kv_used_tokens = Gauge(
            "ortserve_kv_cache_used_tokens", "Tokens whose KV running requests hold.", m, registry=r)
        self.kv_cached_tokens = Gauge(
            "ortserve_kv_cache_cached_tokens",
            "Tokens whose KV free slots keep for prefix reuse (evicted on demand, not counted as used).", m,
            registry=r)
        self.kv_capacity_tokens = Gauge(
            "ortserve_kv_cache_capacity_tokens", "KV positions in all slots: slots x max_model_len.", m, registry=r)
        # vLLM's names, for the Gateway API Inference Extension's endpoint picker (llm-d's default engine
        # mapping) and vLLM dashboards; same values as the ortserve_* series, with vLLM's model_name label.
        self.vllm_running = Gauge("vllm:num_requests_running", "Requests in the running batch.", ["model_name"],
                                  registry=r)
        self.vllm_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for a KV slot.", ["model_name"],
                                  registry=r)
        self.vllm_kv_usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage, 0 to 1 (1 = full): tokens running requests hold over slots x max_model_len.",
            ["model_name"], registry=r)
        self._vllm_counters = {
            "prefix_cache_queries_total": Counter(
                "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", ["model_name"],
                registry=r),
            "prefix_cache_hits_total": Counter(
                "vllm:prefix_cache_hits", "Prompt tokens whose KV the prefix cache supplied.", ["model_name"],
                registry=r),
            "spec_drafts_total": Counter(
                "vllm:spec_decode_num_drafts", "Speculative draft checks.", ["model_name"], registry=r),
            "spec_draft_tokens_total": Counter(
                "vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", ["model_name"], registry=r),
            "spec_accepted_tokens_total": Counter(
                "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", ["model_name"], registry=r),
        }
        self.vllm_spec_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Draft checks whose token at this position (0: the first "
            "draft token) was accepted.", ["model_name", "position"], registry=r)
        self.vllm_cache_config = Gauge(
            "vllm:cache_config_info", "KV cache configuration (labels; the value is always 1).",
            ["block_size", "num_gpu_blocks", "enable_prefix_caching", "num_slots", "max_model_len"], registry=r)

        # vLLM's names for the request series (the same observations as the ortserve_* ones)
        self.vllm_ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token, seconds.",
                                   ["model_name"], buckets=_LATENCY_BUCKETS, registry=r)
        self.vllm_itl = Histogram("vllm:inter_token_latency_seconds", "Time between generated tokens, seconds.",
                                  ["model_name"], buckets=_ITL_BUCKETS, registry=r)
        self.vllm_e2e = Histogram("vllm:e2e_request_latency_seconds", "Request arrival to its last output, seconds.",
                                  ["model_name"], buckets=_LATENCY_BUCKETS, registry=r)
        self.vllm_success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                    ["model_name", "finished_reason"], registry=r)
        self.vllm_prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.",
                                          ["model_name"], registry=r)
        self.vllm_generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", ["model_name"],
                                              registry=r)
        self.model_loaded = Gauge("ortserve_model_loaded", "1 while the model is loaded (the model hub).",
                                  ["model_name"], registry=r)
        self.model_load_seconds = Gauge("ortserve_model_load_seconds", "Seconds its last load took.",
                                        ["model_name"], registry=r)

        # Embeddings (/v1/embeddings, /embedding): their own series, beside generation's.
        self.embedding_requests = Counter("ortserve_embedding_requests", "Embedding requests by outcome.",
                                          [MODEL, "status"], registry=r)
        self.embedding_inputs = Counter("ortserve_embedding_inputs", "Inputs (texts or token lists) embedded.", m,
                                        registry=r)
        self.embedding_tokens = Counter("ortserve_embedding_tokens", "Tokens of the inputs embedded.", m,
                                        registry=r)
        self.embedding_latency = Histogram(
            "ortserve_embedding_request_latency_seconds", "Embedding request arrival to its answer, seconds.", m,
            buckets=_LATENCY_BUCKETS, registry=r)
        self.embedding_requests_running = Gauge(
            "ortserve_embedding_requests_running", "Embedding requests waiting or running.", m, registry=r)

        # Requests that read logits instead of generating (/v1/decisions, /v1/systemone, rerank, /v1/score), by
        # endpoint: decisions, systemone, rerank, score.
        self.readout_requests = Counter("ortserve_readout_requests", "Decision, rerank and score requests by outcome.",
                                        [MODEL, "endpoint", "status"], registry=r)
        self.readout_items = Counter(
            "ortserve_readout_items", "Questions answered (or refused) and documents scored.",
            [MODEL, "endpoint", "outcome"], registry=r)
        self.readout_latency = Histogram(
            "ortserve_readout_request_latency_seconds", "Decision, rerank and score request arrival to its answer.",
            [MODEL, "endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self._zeros: set[tuple[str, str]] = set()  # (kind, model) whose outcome series are exported
        if default_model:
            self.export_zeros(default_model)

    def readout_done(self, endpoint: str, arrival_s: float, items: dict[str, int], model_name: str) -> None:
        """Record a successful readout request (``items``: outcome -> count, e.g. answered / refused)."""
        self.readout_requests.labels(model_name, endpoint, "ok").inc()
        for outcome, count in items.items():
            self.readout_items.labels(model_name, endpoint, outcome).inc(count)
        self.readout_latency.labels(model_name, endpoint).observe(time.perf_counter() - arrival_s)

    def export_zeros(self, model_name: str, kind: str = "chat") -> None:
        """Export every outcome series of a model at zero (once), so dashboards see each series from the start."""
        if (kind, model_name) in self._zeros:
            return
        self._zeros.add((kind, model_name))
        # rerank and score: both kinds (cosine of an encoder, P(yes) of a decoder); decisions: chat models
        endpoints = ("rerank", "score") if kind == "embedding" else READOUT_ENDPOINTS
        for endpoint in endpoints:
            for status in ("ok", REJECTED, "error"):
                self.readout_requests.labels(model_name, endpoint, status)
        if kind == "embedding":
            for status in ("ok", REJECTED, "error"):
                self.embedding_requests.labels(model_name, status)
            for series in (self.embedding_inputs, self.embedding_tokens, self.embedding_latency):
                series.labels(model_name)
            return
        for status in [*(str(reason) for reason in FinishReason), REJECTED]:
            self.requests.labels(model_name, status)
        for series in (self.time_to_first_token, self.inter_token_latency, self.e2e_request_latency,
                       self.request_queue_time, self.prompt_tokens, self.generation_tokens):
            series.labels(model_name)

    def render(self, stats: EngineStats | dict[str, EngineStats] | None, model_name: str = "",
               prefix_caching: bool = True, num_embedding_requests: int | dict[str, int] = 0) -> bytes:
        """The text exposition format, with the gauges refreshed from the engines' snapshots.

        Args:
            stats: each loaded chat model's snapshot by served name (or one engine's, named ``model_name``; None
                while loading). Each model's gauges carry its name (model_name).
            model_name: the served model name of a single ``stats`` (default: ``default_model``).
            prefix_caching: whether the engine keeps prefixes (a vllm:cache_config_info label).
            num_embedding_requests: embedding requests waiting or running, by embedding model (a number: the
                default model's).
        """
        if not isinstance(num_embedding_requests, dict):
            num_embedding_requests = {model_name or self.default_model: num_embedding_requests}
        for name, num in num_embedding_requests.items():
            self.export_zeros(name, "embedding")
            self.embedding_requests_running.labels(name).set(num)
        by_model = stats if isinstance(stats, dict) else \
            ({model_name or self.default_model: stats} if stats is not None else {})
        for name, one in by_model.items():
            self._render_model(name, one, prefix_caching, single=len(by_model) == 1)
        return generate_latest(self.registry)

    def forget_model(self, model_name: str) -> None:
        """An unloaded model: its gauges go (a model that is not loaded has no running requests nor KV), and its
        engine's totals start again from zero when it is loaded again; its counters and histograms stay."""
        for key in [k for k in self._engine_seen if k[0] == model_name]:
            del self._engine_seen[key]
        for gauge in (self.vllm_running, self.vllm_waiting, self.vllm_kv_usage, self.requests_running,
                      self.requests_waiting, self.kv_slots_free, self.kv_slots_total, self.kv_used_tokens,
                      self.kv_cached_tokens, self.kv_capacity_tokens, self.embedding_requests_running):
            try:
                gauge.remove(model_name)
            except KeyError:
                pass

    def _render_model(self, model_name: str, stats: EngineStats, prefix_caching: bool, single: bool) -> None:
        self.export_zeros(model_name)
        self.requests_running.labels(model_name).set(stats.num_running)
        self.requests_waiting.labels(model_name).set(stats.num_waiting)
        self.kv_slots_free.labels(model_name).set(stats.num_slots_free)
        self.kv_slots_total.labels(model_name).set(stats.num_slots_total)
        self.kv_used_tokens.labels(model_name).set(stats.num_kv_tokens_used)
        self.kv_cached_tokens.labels(model_name).set(stats.num_kv_tokens_cached)
        self.kv_capacity_tokens.labels(model_name).set(stats.num_kv_tokens_total)
        self.vllm_running.labels(model_name).set(stats.num_running)
        self.vllm_waiting.labels(model_name).set(stats.num_waiting)
        total = stats.num_kv_tokens_total
        self.vllm_kv_usage.labels(model_name).set(min(1.0, stats.num_kv_tokens_used / total) if total else 0.0)
        for counter in self._vllm_counters.values():
            counter.labels(model_name)  # NOTE(server): export zeros before the first lookup
        # Engine totals (EngineStats.extra key -> this model's counter), advanced by their growth at each scrape;
        # created here, so each is exported at zero from the model's first scrape.
        children = {key: counter.labels(model_name) for key, counter in self._engine_counters.items()}
        for key in stats.extra:
            if key.startswith("engine_phase_"):
                phase = key.removeprefix("engine_phase_").removesuffix("_s")
                children[key] = self.engine_phase.labels(model_name, phase)
            elif key.startswith("spec_accepted_pos_"):
                children[key] = self.vllm_spec_per_pos.labels(model_name, key.removeprefix("spec_accepted_pos_"))
        for key, child in children.items():
            value = stats.extra.get(key, 0.0)
            seen = self._engine_seen.get((model_name, key), 0.0)
            if value > seen:
                child.inc(value - seen)
                if key in self._vllm_counters:
                    self._vllm_counters[key].labels(model_name).inc(value - seen)
                self._engine_seen[(model_name, key)] = value
        if total and single:
            self.vllm_cache_config.clear()  # NOTE(server): one series, whatever the labels were before
            self.vllm_cache_config.labels(
                block_size=str(CACHE_BLOCK_SIZE), num_gpu_blocks=str(total // CACHE_BLOCK_SIZE),
                enable_prefix_caching=str(prefix_caching), num_slots=str(stats.num_slots_total),
                max_model_len=str(total // max(1, stats.num_slots_total))).set(1)

    def tracker(self, arrival_s: float | None = None) -> RequestTracker:
        return RequestTracker(self, time.perf_counter() if arrival_s is None else arrival_s)


class RequestTracker:
    """Times one request: feed it every engine output, then `finish()` exactly once."""

    def __init__(self, metrics: ServerMetrics, arrival_s: float) -> None:
        self._m = metrics
        self.arrival_s = arrival_s  # perf_counter seconds
        self._submitted_s: float | None = None
        self._submitted_monotonic_s: float | None = None  # the clock of RequestOutput.first_scheduled_s
        self._last_token_s: float | None = None
        self._num_generated = 0
        self._num_prompt = 0
        self._done = False
        self._itl: tuple[str, Any, Any] | None = None  # (model name, its two inter-token histograms)
        # the served model (every series' model_name): the default until the request is routed (start_tracking)
        self.model_name = metrics.default_model

    def submitted(self) -> None:
        """The request was handed to the engine (after templating and tokenizing)."""
        self._submitted_s = time.perf_counter()
        self._submitted_monotonic_s = time.monotonic()

    def on_output(self, out: RequestOutput) -> None:
        now = time.perf_counter()
        self._num_prompt = out.num_prompt_tokens
        new_tokens = out.num_generated_tokens - self._num_generated
        if new_tokens <= 0:
            return
        m, name = self._m, self.model_name
        if self._last_token_s is None:
            m.time_to_first_token.labels(name).observe(now - self.arrival_s)
            m.vllm_ttft.labels(name).observe(now - self.arrival_s)
            if out.first_scheduled_s is not None and self._submitted_monotonic_s is not None:
                # NOTE(server): the engine's own timestamp, so prefill time is not counted as queue time.
                m.request_queue_time.labels(name).observe(
                    max(0.0, out.first_scheduled_s - self._submitted_monotonic_s))
            elif self._submitted_s is not None:  # an engine that does not report it: up to the first output
                m.request_queue_time.labels(name).observe(now - self._submitted_s)
            new_tokens -= 1  # the first token has no inter-token gap
        if new_tokens > 0 and self._last_token_s is not None:
            # NOTE(server): one output may carry several tokens (held-back text); spread the gap evenly.
            gap = (now - self._last_token_s) / new_tokens
            # NOTE(server): the labelled histograms are looked up once per request, not once per token
            if self._itl is None or self._itl[0] != name:
                self._itl = (name, m.inter_token_latency.labels(name), m.vllm_itl.labels(name))
            _, ours, vllms = self._itl
            for _ in range(new_tokens):
                ours.observe(gap)
                vllms.observe(gap)
        self._last_token_s = now
        self._num_generated = out.num_generated_tokens

    def finish(self, status: str) -> None:
        """Record the outcome once ('stop', 'length', 'abort', 'error' or 'rejected')."""
        if self._done:
            return
        self._done = True
        m, name = self._m, self.model_name
        m.export_zeros(name)
        m.requests.labels(name, status).inc()
        if status == REJECTED:
            return
        e2e_s = time.perf_counter() - self.arrival_s
        m.e2e_request_latency.labels(name).observe(e2e_s)
        m.prompt_tokens.labels(name).inc(self._num_prompt)
        m.generation_tokens.labels(name).inc(self._num_generated)
        m.vllm_success.labels(name, status).inc()
        m.vllm_e2e.labels(name).observe(e2e_s)
        m.vllm_prompt_tokens.labels(name).inc(self._num_prompt)
        m.vllm_generation_tokens.labels(name).inc(self._num_generated)
