"""EmbeddingEngine: pooled embeddings from a model folder's embedding graph (an encoder's model.onnx, or the
embedding.onnx the builder writes beside a decoder), with its own session, worker thread and bounded queue.

No KV cache and no decode steps: whole texts are batched (sorted by length, padded), run once, pooled and
normalized. The worker thread runs at a lower CPU priority than the chat engine's core thread (``nice``), so
a batch of texts never holds up a decode step for long. Never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine.tokenizer import HELD_TOKENIZERS, Tokenizer
from engine.types import EngineDeadError, EngineError, EngineOverloadedError, InvalidRequestError, ModelLoadError

log = logging.getLogger(__name__)

EMBEDDING_CONFIG = "embedding_config.json"
POOLING_MODES = ("mean", "cls", "last", "max", "none")
MIN_RUN_TOKENS = 512  # real tokens a run holds before it may end early to save padding (see _batches)
PAD_FRACTION = 0.75  # "none": one vector per token (llama.cpp's /embeddings)


@dataclass(frozen=True)
class EmbeddingFolder:
    """What embedding_config.json and the tokenizer say about a folder's embedding graph."""

    path: Path
    model_file: Path
    kind: str  # "encoder" (a sentence-transformers model) or "decoder" (a chat model's hidden states)
    tokenizer: Tokenizer
    dimension: int
    max_seq_length: int  # the window: longer inputs are refused (or truncated when asked)
    pooling: str
    normalize: bool
    add_special_tokens: bool
    vocab_size: int
    inputs: dict[str, str]  # role (input_ids, attention_mask, position_ids) -> graph input name
    hidden_output: str
    matryoshka_dimensions: tuple[int, ...] = ()  # dimensions the model was trained to be truncated to

    @property
    def model_name(self) -> str:
        return self.path.name


def has_embedding_graph(path: str | Path) -> bool:
    return (Path(path) / EMBEDDING_CONFIG).is_file()


def is_encoder_folder(path: str | Path) -> bool:
    """An embedding-only folder (no decoder): it serves /v1/embeddings and cannot chat."""
    path = Path(path)
    return has_embedding_graph(path) and not (path / "genai_config.json").is_file()


def read_embedding_folder(path: str | Path) -> EmbeddingFolder:
    """Parse embedding_config.json and the tokenizer.

    Raises:
        ModelLoadError: no embedding graph in the folder, or a field the engine cannot use.
    """
    path = Path(path).expanduser().resolve()
    cfg_path = path / EMBEDDING_CONFIG
    if not cfg_path.is_file():
        raise ModelLoadError(f"model folder {path} has no {EMBEDDING_CONFIG}: it has no pooled-embedding graph "
                             f"(folders built by ortserve's builder have one)")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        folder = EmbeddingFolder(
            path=path, model_file=path / cfg.get("filename", "model.onnx"), kind=str(cfg["kind"]),
            tokenizer=HELD_TOKENIZERS.load(path / "tokenizer.json"), dimension=int(cfg["dimension"]),
            max_seq_length=int(cfg["max_seq_length"]), pooling=str(cfg.get("pooling", "mean")),
            normalize=bool(cfg.get("normalize", True)), add_special_tokens=bool(cfg.get("add_special_tokens", True)),
            vocab_size=int(cfg["vocab_size"]), inputs=dict(cfg.get("inputs") or {}),
            hidden_output=str(cfg.get("hidden_output", "last_hidden_state")),
            matryoshka_dimensions=tuple(int(d) for d in cfg.get("matryoshka_dimensions") or ()))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {cfg_path}: {exc!r}") from exc
    if folder.kind not in ("encoder", "decoder"):
        raise ModelLoadError(f"{cfg_path}: kind must be 'encoder' or 'decoder', got {folder.kind!r}")
    if folder.pooling not in POOLING_MODES:
        raise ModelLoadError(f"{cfg_path}: pooling must be one of {POOLING_MODES}, got {folder.pooling!r}")
    if not folder.model_file.is_file():
        raise ModelLoadError(f"model folder {path} has no {folder.model_file.name} ({EMBEDDING_CONFIG} filename)")
    return folder


@dataclass(frozen=True)
class EmbeddingConfig:
    """How one EmbeddingEngine runs.

    Attributes:
        provider: "cpu" (the only provider tested for embeddings) or a name ``ep/`` knows.
        intra_op_threads: ORT intra-op threads; None -> the physical cores.
        max_queue: requests allowed to wait or run at once; one more raises EngineOverloadedError (429).
        max_batch_tokens: most padded tokens (rows x longest row) in one encoder run.
        max_batch_rows: most texts in one encoder run.
        pooling: overrides the folder's pooling (``POOLING_MODES``); None keeps it.
        nice: how much lower than the process the worker thread's CPU priority is (Linux nice steps; 0 keeps
            the same priority). Its ORT threads are created by that thread and inherit it.
        before_run: TEST-ONLY hook called on the worker thread with the number of texts just before each run
            (a gate that holds runs makes "the embedding work is still running" hold by construction); an
            exception it raises fails that run's requests. None (the default) costs nothing.
    """

    provider: str = "cpu"
    intra_op_threads: int | None = None
    max_queue: int = 64
    max_batch_tokens: int = 8192
    max_batch_rows: int = 64
    pooling: str | None = None
    nice: int = 10
    before_run: Callable[[int], None] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        _check(self.pooling is None or self.pooling in POOLING_MODES, "pooling", f"must be one of {POOLING_MODES}",
               self.pooling)
        _check(self.max_queue >= 1, "max_queue", "must be >= 1", self.max_queue)
        _check(self.max_batch_tokens >= 1, "max_batch_tokens", "must be >= 1", self.max_batch_tokens)
        _check(self.max_batch_rows >= 1, "max_batch_rows", "must be >= 1", self.max_batch_rows)
        _check(0 <= self.nice <= 19, "nice", "must be in [0, 19]", self.nice)


@dataclass(frozen=True)
class EmbeddingStats:
    """A snapshot for /metrics and the bench."""

    num_requests: int  # waiting or running
    inputs_total: int = 0
    tokens_total: int = 0  # real (unpadded) tokens run
    padded_tokens_total: int = 0  # rows x longest row, summed over runs
    runs_total: int = 0


def pool(hidden: np.ndarray, lengths: np.ndarray, mode: str) -> np.ndarray:
    """Pools right-padded hidden states.

    Args:
        hidden: float32 [B, S, H]; row b's real tokens are ``hidden[b, :lengths[b]]``.
        lengths: int [B], each >= 1.
        mode: "mean" (over real tokens), "cls" (the first), "last" (the last real one) or "max" (per feature).
    Returns:
        float32 [B, H].
    """
    b, s, _ = hidden.shape
    real = np.arange(s)[None, :] < lengths[:, None]  # [B, S]
    if mode == "mean":
        return (hidden * real[..., None]).sum(1) / lengths[:, None].astype(hidden.dtype)
    if mode == "cls":
        return hidden[:, 0]
    if mode == "last":
        return hidden[np.arange(b), lengths - 1]
    if mode == "max":
        return np.where(real[..., None], hidden, -np.inf).max(1)
    raise ValueError(f"pooling must be one of {POOLING_MODES[:-1]}, got {mode!r}")


def l2_normalize(v: np.ndarray) -> np.ndarray:
    """v / max(||v||, 1e-12) along the last axis (torch.nn.functional.normalize, as sentence-transformers)."""
    return v / np.maximum(np.linalg.norm(v, axis=-1, keepdims=True), 1e-12)


@dataclass
class _Job:
    token_ids: list[list[int]]
    future: concurrent.futures.Future
    results: list[np.ndarray | None] = field(default_factory=list)
    num_left: int = 0


class EmbeddingInputs:
    """What an embedding engine answers without its session: the model's facts, tokenizing and checking inputs.
    Shared by EmbeddingEngine and engine.embedding_process.EmbeddingProcessClient (whose session runs elsewhere);
    needs ``folder``, ``tokenizer`` and ``pooling``."""

    folder: EmbeddingFolder
    tokenizer: Tokenizer
    pooling: str

    # --- facts --------------------------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self.folder.model_name

    @property
    def kind(self) -> str:
        return self.folder.kind

    @property
    def dimension(self) -> int:
        return self.folder.dimension

    @property
    def max_seq_length(self) -> int:
        return self.folder.max_seq_length

    @property
    def vocab_size(self) -> int:
        return self.folder.vocab_size

    @property
    def normalize(self) -> bool:
        return self.folder.normalize

    # --- inputs -------------------------------------------------------------------------------------

    def tokenize(self, texts: Sequence[str], truncate_to: int | None = None) -> list[list[int]]:
        """Token ids of each text with the model's special tokens (e.g. [CLS] ... [SEP]); blocking.

        ``truncate_to``: keep at most this many tokens, specials included (the text's end is cut, as
        sentence-transformers truncates); None keeps every token (``check`` refuses the long ones).
        """
        hf = self.tokenizer.hf
        add = self.folder.add_special_tokens
        if truncate_to is None:
            return [e.ids for e in hf.encode_batch(list(texts), add_special_tokens=add)]
        num_special = hf.num_special_tokens_to_add(False) if add else 0
        out = []
        for enc in hf.encode_batch(list(texts), add_special_tokens=False):
            if len(enc.ids) + num_special > truncate_to:
                enc.truncate(max(0, truncate_to - num_special))
            out.append(hf.post_process(enc, None, add_special_tokens=add).ids if add else enc.ids)
        return out

    def check(self, token_ids: Sequence[Sequence[int]], *, truncate_to: int | None = None,
              params: Sequence[str] | None = None) -> list[list[int]]:
        """The inputs as the engine runs them: ids in the vocabulary, at most the window long (truncated
        to ``truncate_to`` when given).

        Args:
            params: the wire field of each input (e.g. "input[3]"), named in errors; default "input[i]".
        Raises:
            InvalidRequestError naming the input: an empty one, an id outside the vocabulary, or one longer than
            the window (both lengths) when no truncation was asked for.
        """
        out = []
        window = self.max_seq_length
        for i, ids in enumerate(token_ids):
            param = params[i] if params is not None else f"input[{i}]"
            ids = list(ids)
            if truncate_to is not None:
                ids = ids[:truncate_to]
            if not ids:
                raise InvalidRequestError(f"{param} has no tokens (an empty token list; an empty string still "
                                          f"gets the model's special tokens)", param=param, code="invalid_value")
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise InvalidRequestError(f"{param} holds the token id {bad}, outside the vocabulary "
                                          f"[0, {self.vocab_size})", param=param, code="invalid_value")
            if len(ids) > window:
                raise InvalidRequestError(
                    f"{param} is too large: it has {len(ids)} tokens, but the model's window is {window} tokens "
                    f"(its max_seq_length). Shorten it, or set truncate_prompt_tokens (-1 truncates to the "
                    f"window).", param=param, code="context_length_exceeded")
            out.append(ids)
        return out


class EmbeddingEngine(EmbeddingInputs):
    """Embeddings of token-id lists, batched across requests, on a worker thread of its own.

    Usage::

        engine = EmbeddingEngine.from_model_dir("path/to/all-minilm-l6-v2", EmbeddingConfig())
        ids = engine.tokenize(["a sentence", "another"])
        vectors = await engine.embed(ids)  # two float32 [384] vectors, L2-normalized
        engine.shutdown()
    """

    def __init__(self, folder: EmbeddingFolder, config: EmbeddingConfig) -> None:
        self.folder = folder
        self.config = config
        self.pooling = config.pooling or folder.pooling
        self.tokenizer = folder.tokenizer
        self._inbox: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._num_requests = 0
        self._stats = dict(inputs_total=0, tokens_total=0, padded_tokens_total=0, runs_total=0)
        self._session: Any = None
        self._feeds: dict[str, str] = {}
        self._dead: BaseException | None = None
        ready = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._main, args=(ready,), daemon=True,
                                        name=f"ortserve-embed-{folder.model_name}")
        self._thread.start()
        ready.result()  # raises the session's load error here
        log.info("embedding engine ready: %s (%s, dimension %d, window %d, pooling %s%s)", folder.model_name,
                 folder.kind, self.dimension, self.max_seq_length, self.pooling,
                 ", normalized" if self.normalize else "")

    @classmethod
    def from_model_dir(cls, path: str | Path, config: EmbeddingConfig | None = None) -> EmbeddingEngine:
        return cls(read_embedding_folder(path), config or EmbeddingConfig())

    # --- running ------------------------------------------------------------------------------------

    def submit(self, token_ids: Sequence[Sequence[int]]) -> concurrent.futures.Future:
        """Queue checked inputs; the future gives one float32 array per input: [D] pooled (and normalized when
        the model says so), or [n, D] per-token hidden states with pooling "none".

        Raises:
            EngineOverloadedError: ``max_queue`` requests are already waiting or running.
            EngineDeadError: the worker thread has stopped.
        """
        if self._dead is not None or not self._thread.is_alive():
            raise EngineDeadError(f"the embedding engine of {self.model_name} has stopped: {self._dead}")
        with self._lock:
            if self._num_requests >= self.config.max_queue:
                raise EngineOverloadedError(
                    f"The embedding queue of {self.model_name} is full ({self.config.max_queue} requests); retry "
                    f"later.", retry_after_s=1.0)
            self._num_requests += 1
        job = _Job([list(ids) for ids in token_ids], concurrent.futures.Future())
        job.results = [None] * len(job.token_ids)
        job.num_left = len(job.token_ids)
        job.future.add_done_callback(self._done)
        if job.num_left == 0:
            job.future.set_result([])
        else:
            self._inbox.put(job)
        return job.future

    async def embed(self, token_ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """``submit`` awaited on the event loop (a cancelled await drops the job's remaining batches)."""
        future = self.submit(token_ids)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.cancel()
            raise

    def embed_sync(self, token_ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        return self.submit(token_ids).result()

    def stats(self) -> EmbeddingStats:
        with self._lock:
            return EmbeddingStats(num_requests=self._num_requests, **self._stats)

    def shutdown(self) -> None:
        """Stop the worker thread (jobs still queued fail with EngineDeadError)."""
        if self._thread.is_alive():
            self._inbox.put(None)
            self._thread.join(60)

    def _done(self, _future: concurrent.futures.Future) -> None:
        with self._lock:
            self._num_requests -= 1

    # --- the worker thread --------------------------------------------------------------------------

    def _main(self, ready: concurrent.futures.Future) -> None:
        if self.config.nice and hasattr(os, "setpriority"):
            try:  # NOTE(engine): per thread on Linux (the id is the thread's); ORT's pool threads inherit it
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                               os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + self.config.nice)
            except OSError as exc:
                log.warning("cannot lower the embedding thread's priority: %s", exc)
        try:
            self._session, self._feeds = self._open_session()
        except BaseException as exc:  # noqa: BLE001 - handed to the constructor
            ready.set_exception(exc)
            return
        ready.set_result(None)
        try:
            while True:
                job = self._inbox.get()
                if job is None:
                    break
                jobs = [job]
                while True:  # every job already waiting joins this round's batches
                    try:
                        more = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    if more is None:
                        self._inbox.put(None)
                        break
                    jobs.append(more)
                self._run_round([j for j in jobs if j.future.set_running_or_notify_cancel()])
        except BaseException as exc:  # noqa: BLE001 - our bug: fail what is queued, then stop
            log.exception("the embedding engine of %s failed", self.model_name)
            self._dead = exc
        finally:
            self._dead = self._dead or EngineDeadError("shut down")
            while True:
                try:
                    job = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if job is not None and job.future.set_running_or_notify_cancel():
                    job.future.set_exception(EngineDeadError(f"the embedding engine of {self.model_name} stopped"))

    def _open_session(self) -> tuple[Any, dict[str, str]]:
        import onnxruntime as ort

        from engine.model_loader import physical_cores
        from ep.profiles import host_profile

        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.intra_op_num_threads = self.config.intra_op_threads or physical_cores()
        so.inter_op_num_threads = 1
        # NOTE(engine): no spinning: between runs the chat engine's threads should get the cores at once.
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.log_severity_level = 3
        path = str(self.folder.model_file)
        try:
            if host_profile(self.config.provider) is not None:  # the plain CPU session
                session = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
            else:
                from ep import device as ep_device
                from ep import providers as ep_providers

                selected = ep_device.select_device(self.config.provider, None, None)
                base = ep_providers.make_session_options(selected, {}, intra_op_threads=so.intra_op_num_threads)
                session = ep_providers.create_session(path, selected, base)
        except EngineError:
            raise
        except Exception as exc:  # onnxruntime raises Fail/InvalidGraph/NoSuchFile/RuntimeError
            raise ModelLoadError(f"ONNX Runtime cannot load {self.folder.model_file}: {exc}") from exc
        names = {i.name for i in session.get_inputs()}
        roles = {role: self.folder.inputs.get(role, role) for role in ("input_ids", "attention_mask",
                                                                       "position_ids", "token_type_ids")}
        feeds = {role: name for role, name in roles.items() if name in names}
        if unknown := sorted(names - set(feeds.values())):
            raise ModelLoadError(f"{self.folder.model_file} has inputs the embedding engine cannot feed: {unknown}")
        for role in ("input_ids", "attention_mask"):
            if role not in feeds:
                raise ModelLoadError(f"{self.folder.model_file} lacks the input {roles[role]!r}")
        if self.folder.hidden_output not in {o.name for o in session.get_outputs()}:
            raise ModelLoadError(f"{self.folder.model_file} lacks the output {self.folder.hidden_output!r}")
        return session, feeds

    def _batches(self, lengths: list[int]) -> list[list[int]]:
        """Item indices grouped into runs: longest first, each run within the row and padded-token budgets.

        NOTE(engine): a run is padded to its longest text, so a run that already holds MIN_RUN_TOKENS real tokens
        (enough rows for the matrix products to run at full speed) ends where the next text is shorter than
        PAD_FRACTION of its longest: padding stays under about a quarter of the work.
        """
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        batches: list[list[int]] = []
        real = 0
        for i in order:
            if batches:
                run, longest = batches[-1], lengths[batches[-1][0]]
                fits = len(run) < self.config.max_batch_rows and (len(run) + 1) * longest <= self.config.max_batch_tokens
                if fits and not (real >= MIN_RUN_TOKENS and lengths[i] < PAD_FRACTION * longest):
                    run.append(i)
                    real += lengths[i]
                    continue
            batches.append([i])
            real = lengths[i]
        return batches

    def _run_round(self, jobs: list[_Job]) -> None:
        items = [(job, k) for job in jobs for k in range(len(job.token_ids))]
        lengths = [len(job.token_ids[k]) for job, k in items]
        for batch in self._batches(lengths):
            rows = [items[i] for i in batch]
            rows = [(job, k) for job, k in rows if not job.future.done()]  # a failed job's other rows: skip
            if not rows:
                continue
            try:
                if self.config.before_run is not None:
                    self.config.before_run(len(rows))
                vectors = self._run([job.token_ids[k] for job, k in rows])
            except Exception as exc:  # noqa: BLE001 - ORT raises several pybind classes
                log.error("embedding run failed (%d texts): %s", len(rows), exc)
                for job, _ in rows:
                    if not job.future.done():
                        job.future.set_exception(EngineError(f"the embedding run failed: {exc}"))
                continue
            for (job, k), vector in zip(rows, vectors):
                job.results[k] = vector
                job.num_left -= 1
                if job.num_left == 0 and not job.future.done():
                    job.future.set_result(job.results)

    def _run(self, token_ids: list[list[int]]) -> list[np.ndarray]:
        """One run over right-padded rows: [B, S] ids -> [B, S, H] hidden states -> pooled vectors."""
        lengths = np.array([len(ids) for ids in token_ids], np.int64)
        b, s = len(token_ids), int(lengths.max())
        input_ids = np.zeros((b, s), np.int64)
        for r, ids in enumerate(token_ids):
            input_ids[r, : len(ids)] = ids
        mask = (np.arange(s)[None, :] < lengths[:, None]).astype(np.int64)  # [B, S]
        feeds = {self._feeds["input_ids"]: input_ids, self._feeds["attention_mask"]: mask}
        if "position_ids" in self._feeds:
            feeds[self._feeds["position_ids"]] = np.where(mask == 1, np.arange(s)[None, :], 0)
        if "token_type_ids" in self._feeds:
            feeds[self._feeds["token_type_ids"]] = np.zeros((b, s), np.int64)
        t0 = time.perf_counter()
        (hidden,) = self._session.run([self.folder.hidden_output], feeds)  # [B, S, H]
        hidden = np.asarray(hidden, np.float32)
        log.debug("embedding run: %d x %d tokens in %.1f ms", b, s, (time.perf_counter() - t0) * 1e3)
        with self._lock:
            self._stats["inputs_total"] += b
            self._stats["tokens_total"] += int(lengths.sum())
            self._stats["padded_tokens_total"] += b * s
            self._stats["runs_total"] += 1
        if self.pooling == "none":
            return [hidden[r, : lengths[r]].copy() for r in range(b)]
        vectors = pool(hidden, lengths, self.pooling)
        if self.normalize:
            vectors = l2_normalize(vectors)
        return list(vectors)


def _check(ok: bool, param: str, rule: str, value: object) -> None:
    if not ok:
        raise InvalidRequestError(f"{param} {rule}, got {value!r}", param=param)
