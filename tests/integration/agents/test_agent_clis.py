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
import subprocess
from pathlib import Path

import pytest

from tests.integration.agents.agent_recipes import (ANSWER, Clock, Place, answer_or_xfail, check_server_side,
                                                    claude_code, codex, report, run_to_end, scratch_folder, statuses,
                                                    tool_calls)
from tests.integration.agents.conftest import KEY, MODEL, release_params
from tests.integration.server.conftest import ServeProcess, serve_process

# A bound on each CLI run, not a timing: a cold 12k-token prefill takes ~5 min on 2 cores, and a 1.5B model whose
# answer runs on would otherwise write up to Claude Code's max_tokens 32000 (hours on a CPU). A run past it is an
# expected failure of the model (see the NOTE on the answers below).
RUN_TIMEOUT_S = 900
pytestmark = [pytest.mark.agents, pytest.mark.timeout(2 * RUN_TIMEOUT_S + 600)]


def require(version: str | None) -> str:
    if version is None:
        pytest.fail("the agent CLIs are not installed: `make test` installs them (make agent-clis)")
    return version


def _run_cli(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run an agent CLI to its end; one still running after RUN_TIMEOUT_S is an expected failure of the model."""
    try:
        return run_to_end(cmd, cwd, env, RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.xfail(f"{Path(cmd[1] if cmd[0] == 'node' else cmd[0]).name} still ran after {RUN_TIMEOUT_S} s: "
                     "the model's answer ran on")


# NOTE(agents): the answers. Everything around the answer is asserted before answer_or_xfail and holds; the 1.5B model
# itself does not reliably answer these CLIs' 5-12k-token default prompts (issue 34 part 5; greedy, repetition_penalty
# 1.1, the prompts checked against the model's own chat template and llama.cpp's conversions; docs/agents.md has the top
# logprobs). After Claude Code's Read its next call wins over an answer ("```" -0.89, then "Write" -0.50 against "Read"
# -1.29; "To" -2.40): Write on hello.py with the same text (denied in dontAsk); the turn after that is flat ("To" -1.40,
# "I" -1.41) and, by the folder's path, quotes the file's line or asks what to do next. After the output of Codex's
# command the first token is a four-way near tie ("```" -2.10, "``" -2.12, "The" -2.27, "<" -2.47), and the call greedy
# writes is write_stdin ("write" -0.23 against "exec" -1.71) with the output's "Chunk ID" as a session id, penalty or
# not; then it answers nothing.


def _claude(server: ServeProcess, tmp_path: Path, version: str, *args: str,
            results: bool | str = True) -> tuple[dict, str]:
    """Claude Code -p TASK in a scratch folder with hello.py; returns (its JSON result, the server's log of it)."""
    scratch, home = scratch_folder(tmp_path)
    run = claude_code(require(version), Place(server.base, MODEL, KEY, scratch, home), *args)
    before, clock = len(server.stderr()), Clock(server.proc.pid)
    done = _run_cli(run.cmd, cwd=scratch, env=run.env)
    log = server.stderr()[before:]
    report(f"claude code {version} {' '.join(args)}", log, clock)
    if done.returncode != 0 and '"subtype":"error_max_turns"' in done.stdout:
        # NOTE(agents): the model's choice, not the server's: it went on calling tools to --max-turns (seen on
        # 5 Dec 2026 with the default tools: Read, then the Agent tool asked to summarise the changes to hello.py).
        # The server side must hold all the same; then it is the answer's expected failure.
        check_server_side(log, run.path, None, results=results)
        pytest.xfail(f"claude code {version}: the model called tools to --max-turns: {tool_calls(log)[-3:]}")
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:], log[-3000:])
    result = json.loads(done.stdout)
    print(f"  answer: {result.get('result', '')[-400:]!r}")
    assert result["subtype"] == "success" and not result["is_error"], result
    check_server_side(log, run.path, "hello.py", tools=("Read",), results=results)
    return result, log


@pytest.mark.parametrize("version", release_params("claude-code"))
def test_claude_code_reads_a_file(qwen: ServeProcess, tmp_path: Path, version: str | None) -> None:
    """Claude Code as a read-only agent (`--tools Read`: its ~2.3k-token prompt; thinking, context_management,
    max_tokens 32000, streamed): it calls Read on hello.py, gets the file back, answers with what it prints;
    exit 0. Seen (2.1.332, greedy, repetition_penalty 1.1): "**Why:** The `print` statement in the `hello.py` file
    outputs the string "hello from ortserve, 7316". ..." (the "**Why:**" mimics the format its prompt's memory section
    asks for)."""
    # NOTE(agents): the answer is the model's (see the NOTE on the answers): Claude Code's prompt carries the date, the
    # scratch folder's path (twice) and the kernel's version, so the same greedy request differs from day to day and
    # machine to machine. In CI on 5 Dec 2026 the same turn, after the same Read and its result, said "The user
    # requested to see the contents of `hello.py`, which contains two print statements. The output is presented in
    # cat -n format, ..." without the number; the server side (call parsed, result received, prefix reused) held.
    result, _ = _claude(qwen, tmp_path, version, "--tools", "Read")
    answer_or_xfail(result["result"], f"claude code {version} --tools Read")


@pytest.mark.parametrize("version", release_params("claude-code"))
def test_claude_code_with_its_default_tools(qwen: ServeProcess, tmp_path: Path, version: str | None) -> None:
    """Claude Code's whole default request (~12k tokens of system prompt and 12-24 tools; 2.1.197's TaskCreate and
    TaskUpdate carry a propertyNames the grammar cannot enforce, which was a 400 on its first request and is now
    left out of the grammar, logged): the call, the result, the exit and the prefix reuse across its turns hold.
    The 1.5B model's answer is a near tie (see the NOTE on the answers): after Read it calls Write (denied), then in the
    test's runs (3 of 3, 2.1.332) sums up with the file's line ("To summarize the conversation so far, ...
    ```1\tprint("hello from ortserve, 7316")```"); from another folder the same turn said "To continue, please ask
    the user what they would like to do next." ("To" -1.40, "I" -1.41, then " continue" -1.43)."""
    # NOTE(agents): 2.1.332 on 5 Dec 2026 (a second session): Read parsed three times, each time in a 50-token side
    # request that forks the conversation after its system prompt and tools, and no tool result came back in a later
    # request: the agent's choice once every request was answered and parsed; `--tools Read` still requires results
    result, log = _claude(qwen, tmp_path, version, results="xfail")
    assert "400" not in {str(s) for _, _, s in statuses(log)}
    answer_or_xfail(result["result"], f"claude code {version}, default tools")


@pytest.mark.parametrize("version", release_params("codex"))
def test_codex_reads_a_file(qwen: ServeProcess, tmp_path: Path, version: str | None) -> None:
    """Codex CLI (`codex exec`, read-only sandbox; its developer messages, exec_command, write_stdin, web_search
    (skipped), include, reasoning, store false), without the tools that lure the 1.5B model away (on the full set it
    calls view_image on hello.py): it runs a command on hello.py in its sandbox and sends the output back; exit 0.
    The model's last answer is not yet the right one (seen: empty, after a write_stdin call)."""
    scratch, home = scratch_folder(tmp_path)
    run = codex(require(version), Place(qwen.base, MODEL, KEY, scratch, home), "--disable", "view_image",
                "--disable", "goals", "--disable", "multi_agent")
    before, clock = len(qwen.stderr()), Clock(qwen.proc.pid)
    done = _run_cli(run.cmd, cwd=scratch, env=run.env)
    log = qwen.stderr()[before:]
    report(f"codex {version}", log, clock)
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-2000:], log[-3000:])
    kinds = [e["type"] for e in events]
    assert "turn.completed" in kinds and "turn.failed" not in kinds, kinds
    check_server_side(log, run.path, "hello.py", tools=("exec_command",))
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
    answer_or_xfail(answers[-1] if answers else "", f"codex {version}")


@pytest.mark.parametrize("cli", ["claude-code", "codex"])
def test_on_the_default_model_each_cli_says_its_prompt_is_too_long(default_model: Path, tmp_path: Path,
                                                                   cli: str) -> None:
    """What a user of the default SmolLM2 served with a 2k context sees: each CLI's own message about the context,
    from the server's 400 in its API's shape (refused before anything runs, so this takes seconds)."""
    version = require(release_params(cli)[0].values[0])
    with serve_process(default_model, "--served-model-name", "smollm2", "--max-model-len", "2048",
                       "--log-level", "info", with_stdout=True) as smol:
        scratch, home = scratch_folder(tmp_path)
        place = Place(smol.base, "smollm2", "unused", scratch, home)
        run = claude_code(version, place) if cli == "claude-code" else codex(version, place)
        done = run_to_end(run.cmd, scratch, run.env, RUN_TIMEOUT_S)
        if cli == "claude-code":
            result = json.loads(done.stdout)
            assert result["api_error_status"] == 400 and result["result"].startswith("Prompt is too long"), result
            assert "(limit 2048)" in result["result"]
        else:
            assert "ran out of room in the model's context window" in done.stdout + done.stderr, done.stdout[-2000:]
        assert {s for _, p, s in statuses(smol.stderr()) if p == run.path} == {400}
