"""The real agent CLIs from npm (installed by `make test` under .cache/agent-clis, pinned in the Makefile) doing
real work against `ortserve serve --model qwen2.5-coder-1.5b` (Qwen2.5-Coder-1.5B-Instruct, Q4_K_M) on the CPU:
Claude Code on /v1/messages, Codex CLI on /v1/responses. Nothing bends the model's answer (no
CLAUDE_CODE_EXTRA_BODY, no output schema, no output-token bound): each CLI gets a scratch folder with hello.py
and the task "Read hello.py and tell me what it prints.", which takes one tool call and an answer.

A test passes when the server's log shows the agent's tool call parsed (``tool calls parsed``) and its result
sent back (``tool results received``), and the CLI exits 0 with the right number. Each run has its own home (no
login, telemetry off, nothing leaves the machine). The first prompt is 9-12k tokens; every request's line
``request ... finished (...): N prompt tokens, M cached, K generated`` shows the prefix reuse between the
agent's turns, and the test prints them.

NOTE: the first turn's prefill takes minutes on two CPU cores, longer than the CLIs' default stream watchdogs
(Claude Code: 5 min without response headers; Codex: 5 min without an event). The runs raise them, as a user of a
slow local server would (Claude Code's API_TIMEOUT_MS / CLAUDE_STREAM_*_TIMEOUT_MS, Codex's provider
stream_idle_timeout_ms). These tests are marked `agents` (`make test` runs them; `-m "not agents"` skips them).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.server.conftest import ROOT, ServeProcess, serve_process

CLIS = ROOT / ".cache" / "agent-clis" / "node_modules"
CLAUDE = CLIS / "@anthropic-ai" / "claude-code" / "cli-wrapper.cjs"  # finds the platform package's binary
CODEX = CLIS / ".bin" / "codex"
MODEL = "qwen2.5-coder-1.5b"
KEY = "sk-local-test"
# A bound on each CLI run, not a timing: a cold 12k-token prefill takes ~5 min on 2 cores, and a 1.5B model whose
# answer runs on would otherwise write up to Claude Code's max_tokens 32000 (hours on a CPU). A run past it is an
# expected failure of the model (see _answer_or_xfail); three runs past it still fit CI's 90 minutes.
RUN_TIMEOUT_S = 900
WATCHDOG_MS = 1_800_000  # the CLIs' stream watchdogs, raised to their maximum (Claude Code clamps to 30 min)
pytestmark = [pytest.mark.agents, pytest.mark.timeout(2 * RUN_TIMEOUT_S + 600)]

HELLO_PY = 'print("hello from ortserve, 7316")\n'
ANSWER = "7316"  # what hello.py prints: nothing in the prompt says it, the model has to read the file
TASK = "Read hello.py and tell me what it prints."

_FINISHED = re.compile(r"request (\S+) finished \((\w+)\): (\d+) prompt tokens, (\d+) cached, (\d+) generated")


@pytest.fixture(scope="module")
def qwen(qwen_model: Path) -> Iterator[ServeProcess]:
    for cli in (CLAUDE, CODEX):
        assert cli.exists(), f"{cli} is missing: `make test` installs the agent CLIs (make agent-clis)"
    # NOTE: the model's own context (32k) and nothing else; two slots, so that a CLI's side request (Claude
    # Code's small/fast model is the same model here) does not take the slot holding the conversation's prefix.
    # The CLIs send no sampling settings, so the model's own apply (its generation_config.json, which `ortserve
    # pull` writes: temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.1), but greedy
    # (--default-temperature 0), so that a run is reproducible; the repetition penalty stays (without it the greedy
    # model calls Read again on the result it was just given, or its answer runs on towards max_tokens 32000).
    with serve_process(qwen_model, "--served-model-name", MODEL, "--max-batch", "2", "--api-key", KEY,
                       "--default-temperature", "0", "--log-level", "info", ready_timeout_s=600,
                       with_stdout=True) as server:
        yield server


def _env(home: Path, **extra: str) -> dict[str, str]:
    keep = ("PATH", "LANG", "LC_ALL", "TERM", "TMPDIR", "SYSTEMROOT")
    return {**{k: os.environ[k] for k in keep if k in os.environ}, "HOME": str(home), "NO_COLOR": "1", **extra}


def _dirs(tmp_path: Path, *names: str) -> list[Path]:
    folders = [tmp_path / name for name in names]
    for folder in folders:
        folder.mkdir()
    return folders


def _scratch(tmp_path: Path) -> Path:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "hello.py").write_text(HELLO_PY)
    return scratch


def _answered(log: str, path: str) -> list[int]:
    """HTTP statuses of `path` in a piece of the server's access log."""
    return [int(s) for s in re.findall(rf'"POST {re.escape(path)}(?:\?\S*)? HTTP/1\.1" (\d{{3}})', log)]


def _turns(log: str) -> list[dict[str, int | str]]:
    """Every finished request in a piece of the server's log: prompt, cached and generated tokens."""
    return [{"id": m[1], "finish": m[2], "prompt": int(m[3]), "cached": int(m[4]), "generated": int(m[5])}
            for m in _FINISHED.finditer(log)]


def _report(name: str, log: str, wall_s: float) -> list[dict[str, int | str]]:
    turns = _turns(log)
    print(f"\n{name}: {wall_s:.0f} s, {len(turns)} requests")
    for t in turns:
        print(f"  {t['id']}: {t['prompt']} prompt tokens, {t['cached']} cached, {t['generated']} generated "
              f"({t['finish']})")
    return turns


def _check_server_side(log: str, path: str, argument: str, tools: tuple[str, ...] = ()) -> None:
    """A call (to one of ``tools``, if given) naming ``argument`` parsed from the model's own output, its result
    received in the next request, every request answered 200, and each later turn of the conversation computing
    only what the previous one did not hold (prefix reuse: a cached prefix of at least 90% of its prompt)."""
    calls = [c for _, c in re.findall(r"tool calls parsed \((\w+) format\): (.*)", log)]
    assert any(argument in c and (not tools or c.split(" ", 1)[0] in tools) for c in calls), (calls, log[-3000:])
    assert re.search(r"tool results received: \S+ \([1-9]\d* chars\)", log), log[-3000:]
    statuses = _answered(log, path)
    assert statuses and set(statuses) == {200}, (statuses, log[-3000:])
    turns = _turns(log)
    assert len(turns) >= 2 and all(t["cached"] >= 0.9 * t["prompt"] for t in turns[1:]), turns


def _run_cli(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
    """Run an agent CLI to its end; one still running after RUN_TIMEOUT_S is an expected failure of the model."""
    try:
        return subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False,
                              **kwargs)  # type: ignore[call-overload]
    except subprocess.TimeoutExpired:
        pytest.xfail(f"{Path(cmd[1] if cmd[0] == 'node' else cmd[0]).name} still ran after {RUN_TIMEOUT_S} s: "
                     "the model's answer ran on")


def _answer_or_xfail(answer: str, what: str) -> None:
    """The right number, or an expected failure that says what the model answered instead.

    NOTE(agents): everything around the answer is asserted above and holds; the 1.5B model itself does not reliably
    answer these CLIs' 5-12k-token default prompts (issue 34 part 5; greedy, repetition_penalty 1.1, the prompts
    checked against the model's own chat template and llama.cpp's conversions; docs/agents.md has the top
    logprobs). After Claude Code's Read its next call wins over an answer ("```" -0.89, then "Write" -0.50 against
    "Read" -1.29; "To" -2.40): Write on hello.py with the same text (denied in dontAsk); the turn after that is
    flat ("To" -1.40, "I" -1.41) and, by the folder's path, quotes the file's line or asks what to do next. After
    the output of Codex's command the first token is a four-way near tie ("```" -2.10, "``" -2.12, "The" -2.27,
    "<" -2.47), and the call greedy writes is write_stdin ("write" -0.23 against "exec" -1.71) with the output's
    "Chunk ID" as a session id, penalty or not; then it answers nothing.
    """
    if ANSWER not in answer:
        pytest.xfail(f"{what}: the model's answer lacks {ANSWER}: {answer[-300:]!r}")


def _claude(server: ServeProcess, tmp_path: Path, *args: str) -> tuple[dict, str]:
    """Claude Code -p TASK in a scratch folder with hello.py; returns (its JSON result, the server's log of it)."""
    scratch, (home,) = _scratch(tmp_path), _dirs(tmp_path, "home")
    env = _env(home, ANTHROPIC_BASE_URL=server.base, ANTHROPIC_API_KEY=KEY,
               ANTHROPIC_DEFAULT_HAIKU_MODEL=MODEL, ANTHROPIC_SMALL_FAST_MODEL=MODEL,
               DISABLE_TELEMETRY="1", DISABLE_ERROR_REPORTING="1", DISABLE_AUTOUPDATER="1",
               CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", API_TIMEOUT_MS=str(WATCHDOG_MS),
               CLAUDE_STREAM_IDLE_TIMEOUT_MS=str(WATCHDOG_MS), CLAUDE_STREAM_FIRST_BYTE_TIMEOUT_MS=str(WATCHDOG_MS))
    before, start = len(server.stderr()), time.monotonic()
    # dontAsk: a tool that would ask is denied (Read inside the working folder does not ask)
    run = _run_cli(["node", str(CLAUDE), "-p", TASK, "--model", MODEL, "--max-turns", "4",
                    "--output-format", "json", "--permission-mode", "dontAsk", *args], cwd=scratch, env=env)
    log = server.stderr()[before:]
    _report(f"claude code {' '.join(args)}", log, time.monotonic() - start)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-2000:], log[-3000:])
    result = json.loads(run.stdout)
    print(f"  answer: {result.get('result', '')[-400:]!r}")
    assert result["subtype"] == "success" and not result["is_error"], result
    _check_server_side(log, "/v1/messages", "hello.py", tools=("Read",))
    return result, log


def test_claude_code_reads_a_file(qwen: ServeProcess, tmp_path: Path) -> None:
    """Claude Code as a read-only agent (`--tools Read`: its ~2.3k-token prompt; thinking, context_management,
    max_tokens 32000, streamed): it calls Read on hello.py, gets the file back, answers with what it prints;
    exit 0. Seen (greedy, repetition_penalty 1.1): "**Why:** The `print` statement in the `hello.py` file outputs
    the string "hello from ortserve, 7316". ..."."""
    result, _ = _claude(qwen, tmp_path, "--tools", "Read")
    assert ANSWER in result["result"], result["result"]


def test_claude_code_with_its_default_tools(qwen: ServeProcess, tmp_path: Path) -> None:
    """Claude Code's whole default request (~12k tokens of system prompt and 12 tools): the call, the result, the
    exit and the prefix reuse across its turns hold. The 1.5B model's answer is a near tie (see _answer_or_xfail):
    after Read it calls Write (denied), then in the test's runs (3 of 3) sums up with the file's line ("To summarize
    the conversation so far, ... ```1\tprint("hello from ortserve, 7316")```"); from another folder the same turn
    said "To continue, please ask the user what they would like to do next." ("To" -1.40, "I" -1.41, then
    " continue" -1.43)."""
    result, _ = _claude(qwen, tmp_path)
    _answer_or_xfail(result["result"], "claude code, default tools")


def test_codex_reads_a_file(qwen: ServeProcess, tmp_path: Path) -> None:
    """Codex CLI (`codex exec`, read-only sandbox; its developer messages, exec_command, write_stdin, web_search
    (skipped), include, reasoning, store false), without the tools that lure the 1.5B model away (on the full set it
    calls view_image on hello.py): it runs a command on hello.py in its sandbox and sends the output back; exit 0.
    The model's last answer is not yet the right one (seen: empty, after a write_stdin call)."""
    scratch, (home, codex_home) = _scratch(tmp_path), _dirs(tmp_path, "home", "codex")
    provider = (f'{{name="ortserve", base_url="{qwen.base}/v1", wire_api="responses", env_key="ORTSERVE_API_KEY", '
                f'stream_idle_timeout_ms={WATCHDOG_MS}}}')
    cmd = [str(CODEX), "exec", "--skip-git-repo-check", "--sandbox", "read-only", "--json",
           "-c", f"model={json.dumps(MODEL)}", "-c", 'model_provider="ortserve"',
           "-c", f"model_providers.ortserve={provider}", "-c", "analytics.enabled=false",
           "-c", "check_for_update_on_startup=false", "--disable", "view_image", "--disable", "goals",
           "--disable", "multi_agent", TASK]
    before, start = len(qwen.stderr()), time.monotonic()
    run = _run_cli(cmd, cwd=scratch, env=_env(home, CODEX_HOME=str(codex_home), ORTSERVE_API_KEY=KEY))
    log = qwen.stderr()[before:]
    _report("codex", log, time.monotonic() - start)
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-2000:], log[-3000:])
    kinds = [e["type"] for e in events]
    assert "turn.completed" in kinds and "turn.failed" not in kinds, kinds
    _check_server_side(log, "/v1/responses", "hello.py", tools=("exec_command",))
    commands = [e["item"] for e in events if e["type"] == "item.completed"
                and e["item"]["type"] == "command_execution"]
    assert any("hello.py" in c["command"] for c in commands), commands  # it ran a command on the file
    if not any(ANSWER in c.get("aggregated_output", "") for c in commands):
        # NOTE: what the model chose, not what the server did, so it is the answer's xfail, not a failure. Its
        # own first choice is `cat` (-0.40; `python` -1.32), but the repetition penalty over the whole prompt
        # (the model's generation_config, applied as transformers and vLLM do) makes greedy write `python
        # <cwd>/hello.py`, which fails where a login shell has no `python` (Debian: only python3); it has also
        # written `python scratch/hello.py` from inside scratch/ (a near tie; the <cwd> Codex sends is right).
        pytest.xfail(f"codex: the model's command did not read the file: {[c['command'] for c in commands]}")
    answers = [e["item"]["text"] for e in events if e["type"] == "item.completed"
               and e["item"]["type"] == "agent_message"]
    print(f"  commands: {[c['command'] for c in commands]}; answer: {(answers[-1] if answers else '')[-400:]!r}")
    _answer_or_xfail(answers[-1] if answers else "", "codex")


def test_on_the_default_model_each_cli_says_its_prompt_is_too_long(default_model: Path, tmp_path: Path) -> None:
    """What a user of the default SmolLM2 served with a 2k context sees: each CLI's own message about the context,
    from the server's 400 in its API's shape (refused before anything runs, so this takes seconds)."""
    with serve_process(default_model, "--served-model-name", "smollm2", "--max-model-len", "2048",
                       "--log-level", "info",
                       with_stdout=True) as smol:
        claude_home, codex_home, codex_dir = _dirs(tmp_path, "claude", "codex-cli", "codex-home")
        env = _env(claude_home, ANTHROPIC_BASE_URL=smol.base, ANTHROPIC_API_KEY="unused", DISABLE_TELEMETRY="1",
                   DISABLE_ERROR_REPORTING="1", DISABLE_AUTOUPDATER="1", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1")
        claude = subprocess.run(["node", str(CLAUDE), "-p", "Say hello.", "--model", "smollm2", "--max-turns", "1",
                                 "--output-format", "json"], cwd=claude_home, env=env, stdin=subprocess.DEVNULL,
                                capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
        result = json.loads(claude.stdout)
        assert result["api_error_status"] == 400 and result["result"].startswith("Prompt is too long"), result
        assert "(limit 2048)" in result["result"]
        provider = f'{{name="ortserve", base_url="{smol.base}/v1", wire_api="responses", env_key="ORTSERVE_API_KEY"}}'
        codex = subprocess.run([str(CODEX), "exec", "--skip-git-repo-check", "--sandbox", "read-only", "--json",
                                "-c", 'model="smollm2"', "-c", 'model_provider="ortserve"',
                                "-c", f"model_providers.ortserve={provider}", "-c", "analytics.enabled=false",
                                "-c", "check_for_update_on_startup=false", "Say hello."],
                               cwd=codex_home, env=_env(codex_home, CODEX_HOME=str(codex_dir), ORTSERVE_API_KEY="x"),
                               stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
        assert "ran out of room in the model's context window" in codex.stdout + codex.stderr, codex.stdout[-2000:]
        assert set(_answered(smol.stderr(), "/v1/messages")) == {400}
        assert set(_answered(smol.stderr(), "/v1/responses")) == {400}
