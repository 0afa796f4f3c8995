"""The real agent CLIs from npm (installed by `make test` under .cache/agent-clis, pinned in the Makefile) against
`ortserve serve --model gemma3-270m` with a 32k context: Claude Code on /v1/messages, Codex CLI on /v1/responses.

Each runs non-interactively in a scratch directory with its own home (no login, telemetry off, nothing leaves
the machine), with tools denied (Claude Code) or in a read-only sandbox (Codex), and a bounded number of model
requests; it completes a turn and exits 0, and the server's access log shows its requests answered with 200.
Their first requests are what the issue measured: ~12k tokens of instructions and tools (Claude Code), ~10k
with a namespace tool, web_search and developer messages (Codex).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.server.conftest import ROOT, ServeProcess, serve_process

CLIS = ROOT / ".cache" / "agent-clis" / "node_modules"
CLAUDE = CLIS / "@anthropic-ai" / "claude-code" / "cli-wrapper.cjs"  # finds the platform package's binary
CODEX = CLIS / ".bin" / "codex"
MODEL = "gemma3-270m"
KEY = "sk-local-test"
RUN_TIMEOUT_S = 1800  # a bound for a hung client only; nothing here is timed


@pytest.fixture(scope="module")
def gemma(gemma3_model: Path) -> Iterator[ServeProcess]:
    for cli in (CLAUDE, CODEX):
        assert cli.exists(), f"{cli} is missing: `make test` installs the agent CLIs (make agent-clis)"
    # NOTE: Gemma 3 270M's GGUF ships no chat template; the built-in gemma one is its turn format.
    with serve_process(gemma3_model, "--served-model-name", MODEL, "--chat-template", "gemma",
                       "--max-model-len", "32768", "--max-batch", "1", "--api-key", KEY, "--log-level", "info",
                       ready_timeout_s=600) as server:
        yield server


def _env(home: Path, **extra: str) -> dict[str, str]:
    keep = ("PATH", "LANG", "LC_ALL", "TERM", "TMPDIR", "SYSTEMROOT")
    return {**{k: os.environ[k] for k in keep if k in os.environ}, "HOME": str(home), "NO_COLOR": "1", **extra}


def _answered(server: ServeProcess, path: str) -> list[int]:
    """HTTP statuses of `path` in the server's access log."""
    return [int(s) for s in re.findall(rf'"POST {re.escape(path)}(?:\?\S*)? HTTP/1\.1" (\d{{3}})', server.stderr())]


def test_claude_code_completes_a_turn(gemma: ServeProcess, tmp_path: Path) -> None:
    scratch, home = tmp_path / "scratch", tmp_path / "home"
    scratch.mkdir()
    home.mkdir()
    env = _env(home, ANTHROPIC_BASE_URL=gemma.base, ANTHROPIC_API_KEY=KEY,
               ANTHROPIC_DEFAULT_HAIKU_MODEL=MODEL, ANTHROPIC_SMALL_FAST_MODEL=MODEL,
               DISABLE_TELEMETRY="1", DISABLE_ERROR_REPORTING="1", DISABLE_AUTOUPDATER="1",
               CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", CLAUDE_CODE_MAX_OUTPUT_TOKENS="200")
    # --max-turns 1: one model turn; dontAsk denies every tool that would ask (it may still read the empty
    # scratch directory); Agent (a sub-agent) is taken away.
    run = subprocess.run(["node", str(CLAUDE), "-p", "Say hello in one short sentence.", "--model", MODEL,
                          "--max-turns", "1", "--output-format", "json", "--permission-mode", "dontAsk",
                          "--disallowedTools", "Agent"],
                         cwd=scratch, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                         timeout=RUN_TIMEOUT_S)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-2000:])
    result = json.loads(run.stdout)
    assert "api_error_status" not in result, result
    assert result["subtype"] in ("success", "error_max_turns") and result["num_turns"] >= 1, result
    statuses = _answered(gemma, "/v1/messages")
    assert statuses and set(statuses) == {200}, (statuses, gemma.stderr()[-3000:])
    assert result["usage"]["input_tokens"] + result["usage"]["cache_read_input_tokens"] > 8000  # its real prompt


def test_codex_completes_a_turn(gemma: ServeProcess, tmp_path: Path) -> None:
    scratch, home, codex_home = tmp_path / "scratch", tmp_path / "home", tmp_path / "codex"
    for folder in (scratch, home, codex_home):
        folder.mkdir()
    provider = (f'{{name="ortserve", base_url="{gemma.base}/v1", wire_api="responses", env_key="ORTSERVE_API_KEY"}}')
    run = subprocess.run([str(CODEX), "exec", "--skip-git-repo-check", "--sandbox", "read-only", "--json",
                          "-c", f"model={json.dumps(MODEL)}", "-c", 'model_provider="ortserve"',
                          "-c", f"model_providers.ortserve={provider}", "-c", "analytics.enabled=false",
                          "-c", "check_for_update_on_startup=false", "Say hello in one short sentence."],
                         cwd=scratch, env=_env(home, CODEX_HOME=str(codex_home), ORTSERVE_API_KEY=KEY),
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-2000:])
    kinds = [e["type"] for e in events]
    assert "turn.completed" in kinds and "turn.failed" not in kinds, kinds
    usage = next(e["usage"] for e in events if e["type"] == "turn.completed")
    assert usage["input_tokens"] > 6000  # its real prompt: instructions, tools, environment
    statuses = _answered(gemma, "/v1/responses")
    assert statuses and set(statuses) == {200}, (statuses, gemma.stderr()[-3000:])
