"""Per-request timing records and the per-run figures computed from them (TTFT, ITL, TPOT, throughput).

Pure Python + numpy; no HTTP, no engine import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

# Error kinds a record can carry (None means the request finished normally).
ERROR_KINDS = (
    "http_429",  # the server refused: rate limited / overloaded
    "http_4xx",  # any other 4xx (bad request, auth, not found)
    "http_5xx",  # the server failed
    "dropped_stream",  # the stream ended or broke before a finish_reason
    "stream_error",  # the server sent an error event inside the stream
    "timeout",  # the request ran past --request-timeout
    "connection",  # could not connect / connection reset before the response
    "deadline",  # cut by the run's --duration hard cap
    "other",
)

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """What the client saw for one request; times are seconds, measured client-side.

    Attributes:
        index: the RequestSpec index.
        start_s: when it was sent, seconds from the run start.
        ttft_s: time to the first chunk with content, or None if none came.
        last_chunk_s: time to the latest chunk with content (from the send), or None.
        itl_s: gaps between consecutive content chunks (len = num_chunks - 1).
        e2e_s: send to the end of the stream (or the error), None if cut before starting.
        num_chunks: content chunks received (the stream's own token count).
        usage_prompt_tokens / usage_completion_tokens: the server's usage, None when not reported.
        num_prompt_tokens_target / max_tokens: what was asked.
        finish_reason: the last finish_reason seen.
        error_kind: one of ERROR_KINDS, or None.
        error: the exception class and message, for the report (never parsed).
    """

    index: int
    start_s: float
    num_prompt_tokens_target: int
    max_tokens: int
    ttft_s: float | None = None
    last_chunk_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    num_chunks: int = 0
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    finish_reason: str | None = None
    error_kind: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_kind is None

    @property
    def num_output_tokens(self) -> int:
        """Tokens received: the server's usage when it reported one, else the content chunks counted."""
        return self.usage_completion_tokens if self.usage_completion_tokens is not None else self.num_chunks

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (tokens - 1); None with < 2 tokens."""
        if self.ttft_s is None or self.e2e_s is None or self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)

    def add_content_chunk(self, elapsed_s: float) -> None:
        """Count one chunk with content that arrived ``elapsed_s`` after the send: the first sets TTFT,
        each later one adds an inter-token gap."""
        if self.last_chunk_s is None:
            self.ttft_s = elapsed_s
        else:
            self.itl_s.append(elapsed_s - self.last_chunk_s)
        self.last_chunk_s = elapsed_s
        self.num_chunks += 1

    def to_json(self) -> dict:
        """A JSON-ready dict, times in milliseconds rounded to microseconds."""
        d = asdict(self)
        for key in ("start_s", "ttft_s", "last_chunk_s", "e2e_s"):
            v = d.pop(key)
            d[key[:-2] + "_ms"] = None if v is None else round(v * 1e3, 3)
        d["itl_ms"] = [round(x * 1e3, 3) for x in d.pop("itl_s")]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "RequestRecord":
        d = dict(d)
        for key in ("start_ms", "ttft_ms", "last_chunk_ms", "e2e_ms"):
            v = d.pop(key, None)
            d[key[:-3] + "_s"] = None if v is None else v / 1e3
        d["itl_s"] = [x / 1e3 for x in d.pop("itl_ms")]
        return cls(**d)


@dataclass(frozen=True)
class Slo:
    """Service-level objective for goodput; None disables a bound."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        if self.ttft_ms is not None and (record.ttft_s is None or record.ttft_s * 1e3 > self.ttft_ms):
            return False
        tpot = record.tpot_s
        if self.tpot_ms is not None and tpot is not None and tpot * 1e3 > self.tpot_ms:
            return False
        return True


def distribution(values_s: Sequence[float]) -> dict[str, float | int | None]:
    """Mean, p50/p90/p99, min, max of a list of seconds, reported in milliseconds.

    Args:
        values_s: samples in seconds (any length, may be empty).

    Returns:
        {"n", "mean_ms", "p50_ms", "p90_ms", "p99_ms", "min_ms", "max_ms"}; the figures are None when n == 0.
        Percentiles use numpy's linear interpolation.
    """
    out: dict[str, float | int | None] = {"n": len(values_s)}
    if not values_s:
        out.update({k: None for k in ("mean_ms", *(f"p{p}_ms" for p in PERCENTILES), "min_ms", "max_ms")})
        return out
    a = np.asarray(values_s, dtype=np.float64) * 1e3
    out["mean_ms"] = float(a.mean())
    for p, v in zip(PERCENTILES, np.percentile(a, PERCENTILES)):
        out[f"p{p}_ms"] = float(v)
    out["min_ms"], out["max_ms"] = float(a.min()), float(a.max())
    return out


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: Slo = Slo()) -> dict:
    """The figures of one run.

    Args:
        records: every request of the run (errors included).
        duration_s: wall time of the measured part of the run, seconds (> 0).
        slo: bounds for goodput.

    Returns:
        A JSON-ready dict: counts, errors by kind, distributions of ttft/itl/tpot/e2e (ms), request and
        token throughputs (per second of duration_s), goodput, and the usage/stream token-count check.
    """
    ok = [r for r in records if r.ok]
    errors: dict[str, int] = {}
    for r in records:
        if r.error_kind is not None:
            errors[r.error_kind] = errors.get(r.error_kind, 0) + 1
    duration_s = max(duration_s, 1e-9)
    num_output_tokens = sum(r.num_output_tokens for r in records)
    num_prompt_tokens = sum(r.usage_prompt_tokens or 0 for r in ok)
    # Prompt processing speed as the client sees it: prompt tokens over time to first token.
    prefill = [r.usage_prompt_tokens / r.ttft_s for r in ok if r.usage_prompt_tokens and r.ttft_s]
    with_usage = [r for r in records if r.usage_completion_tokens is not None]
    mismatched = [r.index for r in with_usage if r.usage_completion_tokens != r.num_chunks]
    return {
        "num_requests": len(records),
        "num_ok": len(ok),
        "num_errors": len(records) - len(ok),
        "errors": errors,
        "duration_s": duration_s,
        "ttft": distribution([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl": distribution([x for r in ok for x in r.itl_s]),
        "tpot": distribution([t for r in ok if (t := r.tpot_s) is not None]),
        "e2e": distribution([r.e2e_s for r in ok if r.e2e_s is not None]),
        "request_throughput_per_s": len(ok) / duration_s,
        "output_tokens_per_s": num_output_tokens / duration_s,
        "prompt_tokens_per_s": num_prompt_tokens / duration_s,
        "num_output_tokens": num_output_tokens,
        "num_prompt_tokens": num_prompt_tokens,
        "mean_prompt_tokens": (num_prompt_tokens / len(ok)) if ok else None,
        "mean_output_tokens": (sum(r.num_output_tokens for r in ok) / len(ok)) if ok else None,
        "prefill_tokens_per_s_mean": float(np.mean(prefill)) if prefill else None,
        # Single-stream decode speed: 1 / mean TPOT of the successful requests.
        "decode_tokens_per_s_per_stream": (1e3 / m) if (m := _mean_tpot_ms(ok)) else None,
        "goodput": {
            "slo_ttft_ms": slo.ttft_ms,
            "slo_tpot_ms": slo.tpot_ms,
            "num_met": (n_met := sum(slo.met(r) for r in records)),
            "fraction": n_met / len(records) if records else None,
            "requests_per_s": n_met / duration_s,
        },
        "token_count_check": {
            "num_with_usage": len(with_usage),
            "num_mismatched": len(mismatched),
            "mismatched_indices": mismatched[:20],
        },
    }


def _mean_tpot_ms(records: Sequence[RequestRecord]) -> float | None:
    tpots = [t for r in records if (t := r.tpot_s) is not None]
    return float(np.mean(tpots)) * 1e3 if tpots else None
