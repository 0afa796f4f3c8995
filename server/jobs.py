"""Jobs: the long-running work of one API process (background responses, batches) and its claims in the state store.

Holds only asyncio tasks: what a job has done lives in the store. Every few seconds it renews this process's leases
on the jobs it runs, takes over the jobs of processes that died (their lease ran out, or their pid is gone on this
host) and sweeps what the retention and size limits let go. No onnxruntime, no engine import.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from server.settings import Settings
from server.store import Store, worker_id

logger = logging.getLogger(__name__)

# NOTE(server): how often retention and the response bounds are applied (a sweep is one transaction)
SWEEP_EVERY_S = 60.0

Resume = Callable[[str], Awaitable[None]]


class Jobs:
    """One process's running jobs, by (kind, id); kinds are the store's ('responses', 'batches').

    Usage::

        jobs = Jobs(store, settings)
        jobs.start({"responses": resume_response, "batches": run_batch})  # once the engine is ready
        jobs.spawn("batches", batch_id, run_batch(batch_id))
        await jobs.stop()
    """

    def __init__(self, store: Store, settings: Settings) -> None:
        self.store = store
        self.settings = settings
        self.owner = worker_id()
        self.lease_s = settings.job_lease_s
        self._tasks: dict[tuple[str, str], asyncio.Task] = {}
        self._resumers: dict[str, Resume] = {}
        self._loop_task: asyncio.Task | None = None
        self._wake = asyncio.Event()

    def spawn(self, kind: str, job_id: str, work: Awaitable[None]) -> asyncio.Task:
        """Run ``work`` as this process's job (kind, job_id); its lease is renewed while it runs."""
        task = asyncio.ensure_future(work)
        key = (kind, job_id)
        self._tasks[key] = task

        def done(finished: asyncio.Task) -> None:
            if self._tasks.get(key) is finished:
                del self._tasks[key]
            if not finished.cancelled() and finished.exception() is not None:
                logger.error("%s %s failed", kind, job_id, exc_info=finished.exception())

        task.add_done_callback(done)
        return task

    def running(self, kind: str) -> list[str]:
        return [job_id for k, job_id in self._tasks if k == kind]

    def is_running(self, kind: str, job_id: str) -> bool:
        return (kind, job_id) in self._tasks

    def start(self, resumers: dict[str, Resume]) -> None:
        """Start renewing, taking over and sweeping (from the event loop, once jobs can run)."""
        self._resumers = dict(resumers)
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._run(), name="ortserve-jobs")

    def poke(self) -> None:
        """Look for work now (a batch was just created)."""
        self._wake.set()

    async def stop(self) -> None:
        """Stop looking for work and cancel this process's jobs (another process, or this one after a restart,
        takes them over: their rows in the store say where they were)."""
        tasks = [t for t in (self._loop_task, *self._tasks.values()) if t is not None]
        self._loop_task = None
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=10)

    async def _run(self) -> None:
        next_sweep = 0.0
        while True:
            try:
                await self._renew_and_claim()
                if time.monotonic() >= next_sweep:
                    next_sweep = time.monotonic() + SWEEP_EVERY_S
                    s = self.settings
                    removed = await self.store.sweep(time.time(), s.state_retention_s, s.response_store_size,
                                                     s.response_store_bytes)
                    if removed:
                        logger.info("state store: swept %d rows (retention, response bounds)", removed)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a database hiccup must not end the loop
                logger.exception("jobs: renewing or claiming failed; trying again")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self.lease_s / 3)
            self._wake.clear()

    async def _renew_and_claim(self) -> None:
        for kind, resume in self._resumers.items():
            await self.store.renew(kind, self.running(kind), self.owner, self.lease_s)
            for job_id in await self.store.claim(kind, self.owner, self.lease_s):
                if self.is_running(kind, job_id):
                    continue
                logger.info("jobs: taking over %s %s", kind, job_id)
                self.spawn(kind, job_id, resume(job_id))
