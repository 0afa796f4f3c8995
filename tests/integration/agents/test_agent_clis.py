"""The real agent CLIs from npm (installed by `make test` under .cache/agent-clis, pinned in the Makefile) against
`ortserve serve --model gemma3-270m` with a 32k context: Claude Code on /v1/messages, Codex CLI on /v1/responses.

Each runs non-interactively in a scratch directory with its own home (no login, telemetry off, nothing leaves
the machine): Claude Code with the tools that would ask denied and at most two model turns, Codex in its
read-only sandbox. Their requests are what the issue measured (Claude Code: ~12k tokens of system prompt and
tools, thinking, context_management, max_tokens 32000; Codex: ~9k tokens of developer messages, a namespace
tool, web_search, include, reasoning, store false), and the server's access log shows them answered with 200.
A turn ends only when the model answers instead of calling a tool, and a 270M base model rarely does: so the
runs that must exit 0 bound the answer to a short JSON format (Claude Code's own CLAUDE_CODE_EXTRA_BODY with
tool_choice none; Codex's --output-schema with its tools off), which completes the turn.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from tests.integration.server.conftest import ROOT, ServeProcess, serve_process

CLIS = ROOT / ".cache" / "agent-clis" / "node_modules"
CLAUDE = CLIS / "@anthropic-ai" / "claude-code" / "cli-wrapper.cjs"  # finds the platform package's binary
CODEX = CLIS / ".bin" / "codex"
MODEL = "gemma3-270m"
KEY = "sk-local-test"
RUN_TIMEOUT_S = 1800  # a bound for a hung client only; nothing here is timed
MAX_ANSWER_TOKENS = 200
# NOTE: a first request of ~10k tokens takes minutes to prefill on two busy cores; the default 600 s is tight.
pytestmark = pytest.mark.timeout(2 * RUN_TIMEOUT_S)


@pytest.fixture(scope="module")
def gemma(gemma3_model: Path) -> Iterator[ServeProcess]:
    for cli in (CLAUDE, CODEX):
        assert cli.exists(), f"{cli} is missing: `make test` installs the agent CLIs (make agent-clis)"
    # NOTE: Gemma 3 270M's GGUF ships no chat template; the built-in gemma one is its turn format. Codex sends no
    # max_output_tokens: --default-max-tokens bounds its answers (a small model's call arguments can run on).
    with serve_process(gemma3_model, "--served-model-name", MODEL, "--chat-template", "gemma",
                       "--max-model-len", "32768", "--max-batch", "1", "--api-key", KEY, "--log-level", "info",
                       "--default-max-tokens", str(MAX_ANSWER_TOKENS), ready_timeout_s=600,
                       with_stdout=True) as server:
        yield server


# A short answer the model cannot ramble past: a 270M base model neither follows instructions nor stops by
# itself, and an agent CLI exits 0 only when its turn ends with an answer.
GREETING = {"type": "object", "properties": {"greeting": {"type": "string", "maxLength": 40}},
            "required": ["greeting"], "additionalProperties": False}


def _env(home: Path, **extra: str) -> dict[str, str]:
    keep = ("PATH", "LANG", "LC_ALL", "TERM", "TMPDIR", "SYSTEMROOT")
    return {**{k: os.environ[k] for k in keep if k in os.environ}, "HOME": str(home), "NO_COLOR": "1", **extra}


def _answered(server: ServeProcess, path: str) -> list[int]:
    """HTTP statuses of `path` in the server's access log."""
    return [int(s) for s in re.findall(rf'"POST {re.escape(path)}(?:\?\S*)? HTTP/1\.1" (\d{{3}})', server.stderr())]


def _dirs(tmp_path: Path, *names: str) -> list[Path]:
    folders = [tmp_path / name for name in names]
    for folder in folders:
        folder.mkdir()
    return folders


def test_claude_code_completes_a_turn(gemma: ServeProcess, tmp_path: Path) -> None:
    """Claude Code's whole request (its system prompt, its tools, thinking, context_management, metadata, a
    system message inside `messages`, max_tokens 32000, streamed); CLAUDE_CODE_EXTRA_BODY (Claude Code's own
    setting for gateways) adds tool_choice none and a short JSON answer format, so that the turn ends."""
    scratch, home = _dirs(tmp_path, "scratch", "home")
    extra = {"tool_choice": {"type": "none"}, "output_config": {"format": {"type": "json_schema", "schema": GREETING}}}
    env = _env(home, ANTHROPIC_BASE_URL=gemma.base, ANTHROPIC_API_KEY=KEY, CLAUDE_CODE_EXTRA_BODY=json.dumps(extra),
               ANTHROPIC_DEFAULT_HAIKU_MODEL=MODEL, ANTHROPIC_SMALL_FAST_MODEL=MODEL,
               DISABLE_TELEMETRY="1", DISABLE_ERROR_REPORTING="1", DISABLE_AUTOUPDATER="1",
               CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1")
    # dontAsk: any tool that would ask is denied; at most two model turns
    run = subprocess.run(["node", str(CLAUDE), "-p", "Say hello in one short sentence.", "--model", MODEL,
                          "--max-turns", "2", "--output-format", "json", "--permission-mode", "dontAsk"],
                         cwd=scratch, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                         timeout=RUN_TIMEOUT_S)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-2000:], gemma.stderr()[-2000:])
    result = json.loads(run.stdout)
    assert result["subtype"] == "success" and not result["is_error"] and result["stop_reason"] == "end_turn", result
    jsonschema.validate(json.loads(result["result"]), GREETING)  # the answer format reached the engine
    statuses = _answered(gemma, "/v1/messages")
    assert statuses and set(statuses) == {200}, (statuses, gemma.stderr()[-3000:])
    usage = result["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] > 3000  # its real system prompt


def _codex(server: ServeProcess, tmp_path: Path, *args: str,
           model: str = MODEL) -> tuple[list[str], subprocess.Popen, Path]:
    """`codex exec --json` on ``server`` in a scratch directory; returns (command, process, its stderr file)."""
    scratch, home, codex_home = _dirs(tmp_path, "scratch", "home", "codex")
    provider = f'{{name="ortserve", base_url="{server.base}/v1", wire_api="responses", env_key="ORTSERVE_API_KEY"}}'
    cmd = [str(CODEX), "exec", "--skip-git-repo-check", "--sandbox", "read-only", "--json",
           "-c", f"model={json.dumps(model)}", "-c", 'model_provider="ortserve"',
           "-c", f"model_providers.ortserve={provider}", "-c", "analytics.enabled=false",
           "-c", "check_for_update_on_startup=false", *args, "Say hello in one short sentence."]
    # NOTE: stderr to a file: a full pipe nobody reads would stall the CLI.
    proc = subprocess.Popen(cmd, cwd=scratch, env=_env(home, CODEX_HOME=str(codex_home), ORTSERVE_API_KEY=KEY),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=(tmp_path / "stderr").open("w"),
                            text=True)
    return cmd, proc, tmp_path / "stderr"


def test_codex_first_request_is_answered(gemma: ServeProcess, tmp_path: Path) -> None:
    """Codex's default request: developer messages, a namespace tool, web_search, function tools, include,
    reasoning, store false, prompt_cache_key, client_metadata. Codex reads the answer: its first output item
    (a call it runs, or a message), or, when the token bound cut the answer, its own "incomplete response"
    error; then the test ends the run (with its tools, a model this small keeps calling them, and `codex exec`
    has no turn limit)."""
    _, proc, stderr = _codex(gemma, tmp_path)
    first = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # Codex's --json events, one per line
            event = json.loads(line) if line.startswith("{") else {}
            if event.get("type") in ("turn.completed", "turn.failed") or (
                    event.get("type") == "item.completed" and event["item"]["type"] != "error"):
                first = event
                break
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(60)
    assert first is not None, stderr.read_text()[-2000:]
    if first["type"] == "turn.failed":  # the server's response.incomplete, as Codex reports it
        assert "reason: max_output_tokens" in first["error"]["message"], first
    statuses = _answered(gemma, "/v1/responses")
    assert statuses and set(statuses) == {200}, (statuses, gemma.stderr()[-3000:])
    assert re.search(r"skipping tools this server cannot run.*web_search", gemma.stderr())


def test_codex_completes_a_turn(gemma: ServeProcess, tmp_path: Path) -> None:
    """Codex with its tools turned off and --output-schema (its `text.format`): one request, a JSON answer,
    the turn completes and Codex exits 0."""
    schema = tmp_path / "greeting.json"
    schema.write_text(json.dumps(GREETING))
    _, proc, stderr = _codex(gemma, tmp_path, "--output-schema", str(schema), "--disable", "shell_tool",
                        "--disable", "goals", "--disable", "multi_agent", "--disable", "view_image",
                        "-c", 'web_search="disabled"', "-c", "tools.experimental_request_user_input={enabled=false}")
    out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert proc.returncode == 0, (out[-3000:], stderr.read_text()[-2000:])
    kinds = [e["type"] for e in events]
    assert "turn.completed" in kinds and "turn.failed" not in kinds, kinds
    [answer] = [e["item"]["text"] for e in events if e["type"] == "item.completed"
                and e["item"]["type"] == "agent_message"]
    jsonschema.validate(json.loads(answer), GREETING)
    usage = next(e["usage"] for e in events if e["type"] == "turn.completed")
    assert usage["input_tokens"] > 3000  # its real instructions and environment
    statuses = _answered(gemma, "/v1/responses")
    assert statuses and set(statuses) == {200}, (statuses, gemma.stderr()[-3000:])


def test_on_the_default_model_each_cli_says_its_prompt_is_too_long(default_model: Path, tmp_path: Path) -> None:
    """What a user of the default SmolLM2 served with a 2k context sees: each CLI's own message about the context,
    from the server's 400 in its API's shape (refused before anything runs, so this takes seconds)."""
    with serve_process(default_model, "--served-model-name", "smollm2", "--max-model-len", "2048",
                       "--log-level", "info",
                       with_stdout=True) as smol:
        claude_home, codex_home = _dirs(tmp_path, "claude", "codex-cli")
        env = _env(claude_home, ANTHROPIC_BASE_URL=smol.base, ANTHROPIC_API_KEY="unused", DISABLE_TELEMETRY="1",
                   DISABLE_ERROR_REPORTING="1", DISABLE_AUTOUPDATER="1", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1")
        claude = subprocess.run(["node", str(CLAUDE), "-p", "Say hello.", "--model", "smollm2", "--max-turns", "1",
                                 "--output-format", "json"], cwd=claude_home, env=env, stdin=subprocess.DEVNULL,
                                capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        result = json.loads(claude.stdout)
        assert result["api_error_status"] == 400 and result["result"].startswith("Prompt is too long"), result
        assert "(limit 2048)" in result["result"]
        _, proc, stderr = _codex(smol, codex_home, model="smollm2")
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
        assert "ran out of room in the model's context window" in out + stderr.read_text(), out[-2000:]
        assert set(_answered(smol, "/v1/messages")) == {400} and set(_answered(smol, "/v1/responses")) == {400}
