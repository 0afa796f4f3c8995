"""The engine core in its own process (EngineConfig.engine_process): the same tokens as in-process, streaming, aborts,
n > 1, stop strings, structured output, stats, load errors, a killed engine process, shutdown, backend flags.

Real sessions on the tiny model. "Still running" holds by construction: tests.pacing.ProcessDecodeGate holds the
engine process's decode runs while shut.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
from pathlib import Path

import jsonschema
import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.types import EngineDeadError, FinishReason, InvalidRequestError, SamplingParams, StructuredOutput
from tests.conftest import DecodeGate
from tests.greedy_close import TINY_MAX_GAP_NATS, GreedyRun, assert_greedy_close
from tests.integration.engine.test_engine import (
    GREEDY, GREEDY_TOP, assert_close, collect, prompts, run, token_ids, wait_idle,
)
from tests.pacing import ProcessDecodeGate

# the session `engine` fixture's settings (tests/integration/engine/conftest.py), so the tokens can be compared
CONFIG = {"max_batch": 8, "max_queue": 16, "prefill_chunk": 16, "seed": 0}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def proc_gate() -> ProcessDecodeGate:
    return ProcessDecodeGate()


@pytest.fixture(scope="module")
def proc_engine(tiny_model: Path, proc_gate: ProcessDecodeGate):
    eng = AsyncEngine.from_model_dir(tiny_model, EngineConfig(**CONFIG, engine_process=True, fault_injector=proc_gate))
    yield eng
    proc_gate.open()
    eng.shutdown()


def test_in_process_by_default_on_the_cpu_and_the_runner_is_only_there(engine, proc_engine) -> None:
    assert not engine.engine_process and engine.engine_pid is None and engine.runner is not None
    assert proc_engine.engine_process and proc_engine.engine_pid not in (None, os.getpid())
    assert proc_engine.placement == engine.placement  # described by the engine process
    assert (proc_engine.max_model_len, proc_engine.vocab_size, proc_engine.kv_cache_bytes) == \
        (engine.max_model_len, engine.vocab_size, engine.kv_cache_bytes)
    with pytest.raises(AttributeError, match="engine process"):
        _ = proc_engine.runner


def test_greedy_and_seeded_tokens_equal_in_process(engine, proc_engine) -> None:
    ps = prompts(engine, 6, length=12, seed=3) + prompts(engine, 1, length=40, seed=4)  # the last one: 3 chunks
    params = [SamplingParams(max_tokens=20, **GREEDY_TOP)] * 6 + \
        [SamplingParams(max_tokens=12, seed=7, temperature=0.9)]

    async def batch(eng, tag):
        return await asyncio.gather(*[collect(eng, p, sp, f"{tag}{i}") for i, (p, sp) in enumerate(zip(ps, params))])

    inproc, proc = run(batch(engine, "i")), run(batch(proc_engine, "p"))
    # NOTE(tests): which requests share a decode run depends on timing, here and there: greedy ones equal up to
    # a near-tie; the seeded one exactly (seeded sampling across batches: docs/development.md)
    for i in range(6):
        assert_close(inproc[i], proc[i], f"greedy request {i}")
    assert token_ids(proc[6]) == token_ids(inproc[6])
    assert "".join(o.text for o in proc[6]) == "".join(o.text for o in inproc[6])
    assert all(outs[-1].finished and outs[-1].finish_reason is FinishReason.LENGTH for outs in proc)


def test_n_choices_equal_in_process(engine, proc_engine) -> None:
    p = prompts(engine, 1, seed=8)[0]
    params = SamplingParams(max_tokens=10, n=3, seed=11, temperature=1.0, ignore_eos=True)

    def by_choice(outs):
        return {i: [t for o in outs if o.index == i for t in o.token_ids] for i in range(3)}

    inproc, proc = run(collect(engine, p, params, "n-i")), run(collect(proc_engine, p, params, "n-p"))
    # NOTE(tests): exact: seeded sampling, and the same request alone on both sides
    assert by_choice(proc) == by_choice(inproc) and len(set(map(tuple, by_choice(proc).values()))) > 1
    assert [o.finished for o in proc].count(True) == 1 and proc[-1].num_generated_tokens == 30


def test_outputs_stream_while_the_request_runs(proc_engine, proc_gate) -> None:
    p = prompts(proc_engine, 1, seed=9)[0]

    async def main():
        proc_gate.shut(after=3)  # the prefill's token and three decodes, then it is held: still running
        try:
            gen = proc_engine.generate(p, SamplingParams(max_tokens=100, **GREEDY), "stream")
            got = []
            while sum(len(o.token_ids) for o in got) < 4:
                got.append(await gen.__anext__())
            assert proc_gate.wait_held() and not any(o.finished for o in got)
        finally:
            proc_gate.open()
        rest = [o async for o in gen]
        assert rest[-1].finished and sum(len(o.token_ids) for o in got + rest) == 100

    run(main())


def test_abort_mid_stream_frees_the_slot(proc_engine, proc_gate) -> None:
    p = prompts(proc_engine, 1, seed=10)[0]
    before = proc_engine.stats().generation_tokens_total

    async def main():
        got = []

        async def consume():
            async for out in proc_engine.generate(p, SamplingParams(max_tokens=200, **GREEDY), "cancel-me"):
                got.append(out)

        proc_gate.shut(after=2)
        try:
            task = asyncio.create_task(consume())
            while sum(len(o.token_ids) for o in got) < 3:
                await asyncio.sleep(0.001)
            assert proc_gate.wait_held()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            proc_gate.open()
        await wait_idle(proc_engine)

    run(main())
    assert proc_engine.stats().generation_tokens_total - before < 10  # aborted in the engine process at once


def test_a_stop_string_found_here_aborts_the_request_there(proc_engine, proc_gate) -> None:
    p = prompts(proc_engine, 1, seed=5)[0]
    text = "".join(o.text for o in run(collect(proc_engine, p, SamplingParams(max_tokens=12, **GREEDY), "full")))
    stop = text[len(text) // 2:len(text) // 2 + 3]
    before = proc_engine.stats().generation_tokens_total
    proc_gate.shut(after=12)  # the core is held after 13 tokens, until the stop string's abort has been sent

    async def main():
        outs = []
        try:
            async for out in proc_engine.generate(p, SamplingParams(max_tokens=200, stop=(stop,), **GREEDY), "stop"):
                outs.append(out)
        finally:
            proc_gate.open()
        await wait_idle(proc_engine)
        return outs

    outs = run(main())
    assert outs[-1].finish_reason is FinishReason.STOP and "".join(o.text for o in outs) == text[:text.find(stop)]
    assert proc_engine.stats().generation_tokens_total - before <= 14  # not 200: the core stopped it


def test_structured_output_equals_in_process_and_a_bad_schema_is_refused_first(engine, proc_engine) -> None:
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    prompt = engine.tokenizer.encode("Answer in JSON.")
    # NOTE(tests): 20 alternatives: the grammar masks tokens the raw top-k may be full of
    params = SamplingParams(max_tokens=60, temperature=0.0, structured=spec, logprobs=True, top_logprobs=20)
    inproc = run(collect(engine, prompt, params, "json-i"))
    proc = run(collect(proc_engine, prompt, params, "json-p"))
    # NOTE(tests): the engine process times its own draft checks, so its row counts may differ from in-process
    assert_greedy_close(GreedyRun.from_engine(inproc), GreedyRun.from_engine(proc), TINY_MAX_GAP_NATS,
                        "structured output in the engine process")
    jsonschema.validate(json.loads("".join(o.text for o in proc)), SCHEMA)
    assert proc[-1].finish_reason is FinishReason.STOP

    async def first(spec):
        agen = proc_engine.generate(prompt, SamplingParams(max_tokens=4, structured=spec), "bad")
        try:
            return await agen.__anext__()
        finally:
            await agen.aclose()

    bad = StructuredOutput("json_schema", '{"type": "array", "uniqueItems": true}', param="response_format")
    with pytest.raises(InvalidRequestError) as err:
        run(first(bad))
    assert err.value.param == "response_format" and "uniqueItems" in str(err.value)
    assert proc_engine.stats().num_running == 0 and proc_engine.is_running


def test_stats_follow_the_engine_process(proc_engine) -> None:
    before = proc_engine.stats()
    run(collect(proc_engine, prompts(proc_engine, 1, seed=12)[0], SamplingParams(max_tokens=9, **GREEDY), "st"))
    deadline = time.monotonic() + 5
    while proc_engine.stats().extra["steps_total"] == before.extra["steps_total"] and time.monotonic() < deadline:
        time.sleep(0.01)
    after = proc_engine.stats()
    assert after.generation_tokens_total - before.generation_tokens_total == 9
    assert after.prompt_tokens_total > before.prompt_tokens_total
    assert after.extra["steps_total"] > before.extra["steps_total"]
    assert after.extra["engine_thread_cpu_s"] > before.extra["engine_thread_cpu_s"]
    assert after.extra["engine_process_cpu_s"] >= after.extra["engine_thread_cpu_s"]
    assert after.extra["engine_phase_decode_run_s"] > before.extra["engine_phase_decode_run_s"]
    assert after.num_kv_tokens_cached > 0 and after.num_slots_free == after.num_slots_total


def test_backend_flags_set_by_the_parent_are_seen_by_the_engine_process(tiny_model, monkeypatch) -> None:
    from ep import flags

    monkeypatch.delenv(flags.CUDA_INT4_GEMM.name, raising=False)
    flags.apply_cuda_int4_gemm("cuda", 8, True)  # as `ortserve serve` does, before any backend loads
    assert os.environ[flags.CUDA_INT4_GEMM.name] == "1"
    eng = AsyncEngine.from_model_dir(tiny_model, EngineConfig(max_batch=2, engine_process=True))
    try:
        assert eng._core.facts.backend_flags[flags.CUDA_INT4_GEMM.name] == "1"  # test only: what the child saw
    finally:
        eng.shutdown()


def test_a_fault_injector_that_cannot_pickle_is_refused_clearly(tiny_model) -> None:
    with pytest.raises(TypeError, match="fault_injector must pickle"):
        AsyncEngine.from_model_dir(tiny_model, EngineConfig(max_batch=2, engine_process=True,
                                                            fault_injector=DecodeGate()))


@pytest.mark.parametrize("failure", ["no_device", "corrupt_onnx"])
def test_a_load_error_is_the_same_exception_as_in_process(tiny_model, tmp_path, failure) -> None:
    model, provider = tiny_model, "cpu"
    if failure == "no_device":
        provider = "webgpu"  # no WebGPU EP here: ep's DeviceNotFoundError (or EpLibraryError) from the child
    else:
        model = tmp_path / "model"
        shutil.copytree(tiny_model, model)
        (model / "model.onnx").write_bytes(b"not an onnx file")
    errors = []
    for engine_process in (False, True):
        with pytest.raises(Exception) as err:
            AsyncEngine.from_model_dir(model, EngineConfig(max_batch=2, provider=provider,
                                                           engine_process=engine_process))
        errors.append(err.value)
    assert type(errors[1]) is type(errors[0]) and str(errors[1]) == str(errors[0])


def test_a_killed_engine_process_fails_every_request_and_nothing_hangs(tiny_model) -> None:
    gate = ProcessDecodeGate()  # NOTE: never opened: its Event waits on the killed process (it cannot wake it)
    eng = AsyncEngine.from_model_dir(tiny_model, EngineConfig(max_batch=1, max_queue=4, prefill_chunk=64,
                                                              engine_process=True, fault_injector=gate))
    pid = eng.engine_pid

    async def one(rid):
        try:
            return await asyncio.wait_for(collect(eng, [5, 6, 7, 8], SamplingParams(max_tokens=50, **GREEDY), rid),
                                          timeout=30)
        except EngineDeadError as exc:
            return exc

    async def main():
        gate.shut(after=1)
        tasks = [asyncio.create_task(one(rid)) for rid in ("running", "waiting-1", "waiting-2")]
        while not gate.num_held:
            await asyncio.sleep(0.005)
        os.kill(pid, signal.SIGKILL)
        return await asyncio.gather(*tasks)  # a hang would be a TimeoutError here

    try:
        results = run(main())
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "SIGKILL" in str(results[0]) and not eng.is_running
        with pytest.raises(EngineDeadError):
            run(collect(eng, [5, 6], SamplingParams(max_tokens=2), "late"))
    finally:
        t0 = time.monotonic()
        eng.shutdown(5)
        assert time.monotonic() - t0 < 5
    assert eng._core.exitcode == -signal.SIGKILL  # test only: reaped, no zombie
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def test_shutdown_ends_streams_and_joins_the_engine_process(tiny_model) -> None:
    gate = ProcessDecodeGate()
    eng = AsyncEngine.from_model_dir(tiny_model, EngineConfig(max_batch=2, prefill_chunk=16, engine_process=True,
                                                              fault_injector=gate))
    pid = eng.engine_pid

    async def main():
        gate.shut()
        gen = eng.generate(list(range(5, 20)), SamplingParams(max_tokens=200, **GREEDY), "long")
        first = await gen.__anext__()
        assert not first.finished and gate.wait_held()
        shutdown = asyncio.get_running_loop().run_in_executor(None, eng.shutdown)
        while eng.is_running:
            await asyncio.sleep(0.001)
        gate.open()
        await shutdown
        rest = [o async for o in gen]
        assert rest and rest[-1].finished and rest[-1].finish_reason is FinishReason.ABORT
        with pytest.raises(EngineDeadError):
            await collect(eng, [5, 6], SamplingParams(), "after")

    run(main())
    assert eng._core.exitcode == 0  # test only: it ended by itself and was joined
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def test_a_process_that_exits_without_shutdown_stops_its_engine_process(tiny_model) -> None:
    # NOTE: multiprocessing's exit handler alone would SIGTERM the engine process (which ignores it) and join it
    # forever; engine.core_client's handler shuts it down first.
    import subprocess
    import sys

    from tests.integration.server.conftest import ROOT

    script = ("import sys; from engine.async_engine import AsyncEngine; from engine.config import EngineConfig\n"
              f"eng = AsyncEngine.from_model_dir({str(tiny_model)!r}, EngineConfig(max_batch=2, engine_process=True))\n"
              "print(eng.engine_pid, flush=True)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    pid = int(done.stdout.split()[-1])
    with pytest.raises(ProcessLookupError):  # ended (and reaped by its parent before that exited)
        os.kill(pid, 0)
