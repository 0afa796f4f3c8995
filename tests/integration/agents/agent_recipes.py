"""How each coding agent is pointed at a local OpenAI- or Anthropic-compatible server, as its own documentation sets
it up: one recipe per agent (command, environment, config files in the run's own home), shared by the agent tests
and by capture_tools.py (which records the tool schemas each release sends, tests/data/agent_tools/).

The releases come from the Makefile (AGENT_CLIS_NEWEST and AGENT_PIPS for `make test`, AGENT_CLIS_OLDER besides for
`make test-agents`), which writes what it installed to manifests beside the installs:
.cache/agent-clis/manifest.txt (npm, one prefix per release) and .cache/agent-venvs/manifest.txt (pip, one venv per
release). Nothing here downloads anything; each run has its own HOME (no login, telemetry off).
"""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
CLI_DIR = ROOT / ".cache" / "agent-clis"
VENV_DIR = ROOT / ".cache" / "agent-venvs"
TASK = "Read hello.py and tell me what it prints."
HELLO_PY = 'print("hello from ortserve, 7316")\n'
ANSWER = "7316"  # what hello.py prints: nothing in the prompt says it, the model has to read the file
# The CLIs' stream watchdogs raised to their maximum: a cold 10k-token prefill takes minutes on two cores.
WATCHDOG_MS = 1_800_000


@dataclass(frozen=True)
class Run:
    """One agent run: the command, its environment (added to a clean one), and the API path it talks to."""

    cmd: list[str]
    env: dict[str, str]
    path: str


@dataclass(frozen=True)
class Place:
    """Where a run happens: the server's base URL (no /v1), the served model's name and key, the scratch folder
    (hello.py in it, the working directory), a fresh home, and the model's context window in tokens (what the
    server's /v1/models/{id} says as max_model_len; each agent is told it its own way)."""

    base: str
    model: str
    key: str
    scratch: Path
    home: Path
    context: int = 32768


def manifest(kind: str = "npm") -> list[str]:
    """NAME@VERSION of every release the Makefile installs (`make agent-clis`), in its order."""
    path = (CLI_DIR if kind == "npm" else VENV_DIR) / "manifest.txt"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: `make test` installs the agents (make agent-clis)")
    return [line.strip() for line in path.read_text().splitlines() if line.strip()]


def releases(name: str, kind: str = "npm") -> list[str]:
    """The versions of one agent the Makefile installs, newest first (by version number)."""
    found = [entry.split("@", 1)[1] for entry in manifest(kind) if entry.split("@", 1)[0] == name]
    return sorted(found, key=lambda v: tuple(int(p) if p.isdigit() else 0 for p in v.split(".")), reverse=True)


def npm_prefix(name: str, version: str) -> Path:
    return CLI_DIR / f"{name}@{version}" / "node_modules"


def venv_bin(name: str, version: str) -> Path:
    return VENV_DIR / f"{name}@{version}" / "bin"


def clean_env(home: Path, **extra: str) -> dict[str, str]:
    keep = ("PATH", "LANG", "LC_ALL", "TERM", "TMPDIR", "SYSTEMROOT")
    return {**{k: os.environ[k] for k in keep if k in os.environ}, "HOME": str(home), "NO_COLOR": "1",
            "XDG_CONFIG_HOME": str(home / ".config"), "XDG_DATA_HOME": str(home / ".local" / "share"),
            "XDG_CACHE_HOME": str(home / ".cache"), "XDG_STATE_HOME": str(home / ".local" / "state"), **extra}


def claude_code(version: str, place: Place, *args: str) -> Run:
    """Claude Code -p: ANTHROPIC_BASE_URL, the served model for both its main and small/fast model, dontAsk."""
    cli = npm_prefix("claude-code", version) / "@anthropic-ai" / "claude-code" / "cli-wrapper.cjs"
    env = clean_env(place.home, ANTHROPIC_BASE_URL=place.base, ANTHROPIC_API_KEY=place.key,
                    ANTHROPIC_DEFAULT_HAIKU_MODEL=place.model, ANTHROPIC_SMALL_FAST_MODEL=place.model,
                    DISABLE_TELEMETRY="1", DISABLE_ERROR_REPORTING="1", DISABLE_AUTOUPDATER="1",
                    CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", API_TIMEOUT_MS=str(WATCHDOG_MS),
                    CLAUDE_STREAM_IDLE_TIMEOUT_MS=str(WATCHDOG_MS),
                    CLAUDE_STREAM_FIRST_BYTE_TIMEOUT_MS=str(WATCHDOG_MS),
                    CLAUDE_CODE_MAX_CONTEXT_TOKENS=str(place.context))  # else it assumes 1M for an unknown model
    cmd = ["node", str(cli), "-p", TASK, "--model", place.model, "--max-turns", "4", "--output-format", "json",
           "--permission-mode", "dontAsk", *args]
    return Run(cmd, env, "/v1/messages")


def codex(version: str, place: Place, *args: str) -> Run:
    """codex exec with a model provider whose base_url is the server's /v1 (wire_api responses), read-only."""
    codex_home = place.home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    provider = (f'{{name="ortserve", base_url="{place.base}/v1", wire_api="responses", env_key="ORTSERVE_API_KEY", '
                f'stream_idle_timeout_ms={WATCHDOG_MS}}}')
    cmd = [str(npm_prefix("codex", version) / ".bin" / "codex"), "exec", "--skip-git-repo-check",
           "--sandbox", "read-only", "--json", "-c", f"model={json.dumps(place.model)}",
           "-c", 'model_provider="ortserve"', "-c", f"model_providers.ortserve={provider}",
           "-c", "analytics.enabled=false", "-c", "check_for_update_on_startup=false", *args, TASK]
    return Run(cmd, clean_env(place.home, CODEX_HOME=str(codex_home), ORTSERVE_API_KEY=place.key),
               "/v1/responses")


def opencode(version: str, place: Place) -> Run:
    """opencode run, with an OpenAI-compatible provider (@ai-sdk/openai-compatible) in opencode.json (its
    documented local-model set-up), the served model as the default, its permissions left as they are."""
    config = {"$schema": "https://opencode.ai/config.json", "autoupdate": False, "share": "disabled",
              "model": f"ortserve/{place.model}", "small_model": f"ortserve/{place.model}",
              "provider": {"ortserve": {"npm": "@ai-sdk/openai-compatible", "name": "ortserve",
                                        "options": {"baseURL": f"{place.base}/v1", "apiKey": place.key},
                                        "models": {place.model: {"name": place.model, "tool_call": True,
                                                                 "limit": {"context": place.context,
                                                                           "output": 4096}}}}}}
    folder = place.home / ".config" / "opencode"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "opencode.json").write_text(json.dumps(config, indent=2))
    binary = npm_prefix("opencode", version) / "opencode-linux-x64" / "bin" / "opencode"
    env = clean_env(place.home, OPENCODE_DISABLE_AUTOUPDATE="1", OPENCODE_DISABLE_LSP_DOWNLOAD="1",
                    OPENCODE_DISABLE_DEFAULT_PLUGINS="1", OPENCODE_DISABLE_MODELS_FETCH="1")
    return Run([str(binary), "run", "--print-logs", TASK], env, "/v1/chat/completions")


def qwen_code(version: str, place: Place) -> Run:
    """qwen -p through OPENAI_BASE_URL / OPENAI_API_KEY / OPENAI_MODEL (its documented OpenAI-compatible set-up),
    the auth type chosen in settings.json so that it asks nothing."""
    folder = place.home / ".qwen"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "settings.json").write_text(json.dumps({
        "security": {"auth": {"selectedType": "openai"}}, "privacy": {"usageStatisticsEnabled": False},
        "general": {"disableAutoUpdate": True}, "telemetry": {"enabled": False}}))
    cli = npm_prefix("qwen-code", version) / "@qwen-code" / "qwen-code" / "cli.js"
    env = clean_env(place.home, OPENAI_BASE_URL=f"{place.base}/v1", OPENAI_API_KEY=place.key,
                    OPENAI_MODEL=place.model)
    return Run(["node", str(cli), "-p", TASK, "--model", place.model], env, "/v1/chat/completions")


def continue_cli(version: str, place: Place) -> Run:
    """cn -p with a config.yaml whose one model is provider openai at the server's /v1 (its local-model set-up)."""
    config = place.home / "continue.yaml"
    config.write_text(
        "name: ortserve\nversion: 0.0.1\nschema: v1\nmodels:\n"
        f"  - name: {place.model}\n    provider: openai\n    model: {place.model}\n"
        f"    apiBase: {place.base}/v1\n    apiKey: {place.key}\n"
        "    roles: [chat, edit, apply]\n    capabilities: [tool_use]\n"
        f"    defaultCompletionOptions:\n      contextLength: {place.context}\n")
    cli = npm_prefix("continue-cli", version) / "@continuedev" / "cli" / "dist" / "cn.js"
    env = clean_env(place.home, CONTINUE_CLI_DISABLE_TELEMETRY="1", CONTINUE_TELEMETRY_ENABLED="0")
    return Run(["node", str(cli), "-p", TASK, "--config", str(config)], env, "/v1/chat/completions")


def aider(version: str, place: Place) -> Run:
    """aider through --openai-api-base (model openai/<name>), hello.py added to the chat, one message, no git."""
    cmd = [str(venv_bin("aider", version) / "aider"), "--openai-api-base", f"{place.base}/v1",
           "--openai-api-key", place.key, "--model", f"openai/{place.model}", "--no-git", "--yes-always",
           "--no-check-update", "--no-show-model-warnings", "--no-analytics", "--no-pretty", "--no-stream",
           "--map-tokens", "0", "--message", TASK, "hello.py"]
    return Run(cmd, clean_env(place.home, AIDER_ANALYTICS="false", LITELLM_LOCAL_MODEL_COST_MAP="True"),
               "/v1/chat/completions")


def mini_swe_agent(version: str, place: Place) -> Run:
    """mini (mini-swe-agent) with a litellm model openai/<name> at the server's /v1, exiting when done."""
    cmd = [str(venv_bin("mini-swe-agent", version) / "mini"), "--model", f"openai/{place.model}", "--task", TASK,
           "--yolo", "--exit-immediately", "--cost-limit", "0"]
    env = clean_env(place.home, OPENAI_API_BASE=f"{place.base}/v1", OPENAI_BASE_URL=f"{place.base}/v1",
                    OPENAI_API_KEY=place.key, MSWEA_CONFIGURED="true", MSWEA_COST_TRACKING="ignore_errors",
                    MSWEA_SILENT_STARTUP="1", LITELLM_LOCAL_MODEL_COST_MAP="True")
    return Run(cmd, env, "/v1/chat/completions")


def smolagents(version: str, place: Place, kind: str = "ToolCallingAgent") -> Run:
    """A smolagents ToolCallingAgent or CodeAgent on OpenAIServerModel(api_base=<server>/v1), with one tool
    read_file(path) (smolagents ships no file tool), run in the scratch folder (smolagents_run.py)."""
    script = Path(__file__).with_name("smolagents_run.py")
    cmd = [str(venv_bin("smolagents", version) / "python"), str(script), kind, f"{place.base}/v1", place.model,
           place.key, TASK]
    return Run(cmd, clean_env(place.home), "/v1/chat/completions")


RECIPES: dict[str, Callable[..., Run]] = {
    "claude-code": claude_code, "codex": codex, "opencode": opencode, "qwen-code": qwen_code,
    "continue-cli": continue_cli, "aider": aider, "mini-swe-agent": mini_swe_agent, "smolagents": smolagents,
}
PIP_AGENTS = ("aider", "mini-swe-agent", "smolagents")


def scratch_folder(root: Path) -> tuple[Path, Path]:
    """(scratch with hello.py, an empty home) under ``root``."""
    scratch, home = root / "scratch", root / "home"
    scratch.mkdir(parents=True)
    home.mkdir(parents=True)
    (scratch / "hello.py").write_text(HELLO_PY)
    return scratch, home


if __name__ == "__main__":  # print what is installed
    print(manifest("npm"), manifest("pip"), file=sys.stderr)


# --- what the server's log says about a run ------------------------------------------------------------------

_FINISHED = re.compile(r"request (\S+) finished \((\w+)\): (\d+) prompt tokens, (\d+) cached, (\d+) generated")
_ACCESS = re.compile(r'"(GET|POST|HEAD|PUT|DELETE) (/\S*?)(?:\?\S*)? HTTP/1\.1" (\d{3})')


def statuses(log: str) -> list[tuple[str, str, int]]:
    """(method, path, status) of every request in a piece of the server's access log."""
    return [(m[1], m[2], int(m[3])) for m in _ACCESS.finditer(log)]


def turns(log: str) -> list[dict[str, int | str]]:
    """Every finished request in a piece of the server's log: prompt, cached and generated tokens."""
    return [{"id": m[1], "finish": m[2], "prompt": int(m[3]), "cached": int(m[4]), "generated": int(m[5])}
            for m in _FINISHED.finditer(log)]


def tool_calls(log: str) -> list[str]:
    """Each call the server parsed from the model's output: ``NAME ARGUMENTS``."""
    return [c for _, c in re.findall(r"tool calls parsed \((\w+) format\): (.*)", log)]


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a running process has used so far (Linux: /proc/PID/stat, fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    """CPU seconds of this process's children reaped so far (an agent run's whole tree, once it has ended)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Clock:
    """What one agent run costs: wall seconds, the server's CPU seconds and the agent's own (its process tree).
    Reported (the machine is shared, so CPU seconds say more than wall time), never asserted."""

    server_pid: int
    start_s: float = field(default_factory=time.monotonic)
    server_cpu0_s: float = 0.0
    agent_cpu0_s: float = field(default_factory=children_cpu_s)

    def __post_init__(self) -> None:
        self.server_cpu0_s = process_cpu_s(self.server_pid)

    def read(self) -> str:
        server_s = process_cpu_s(self.server_pid) - self.server_cpu0_s
        return (f"{time.monotonic() - self.start_s:.0f} s wall, server {server_s:.0f} CPU s, "
                f"agent {children_cpu_s() - self.agent_cpu0_s:.0f} CPU s")


def report(name: str, log: str, clock: Clock) -> list[dict[str, int | str]]:
    found = turns(log)
    print(f"\nagent run: {name}: {clock.read()}, {len(found)} requests")
    for t in found:
        print(f"  {t['id']}: {t['prompt']} prompt tokens, {t['cached']} cached, {t['generated']} generated "
              f"({t['finish']})")
    return found


def check_server_side(log: str, path: str, argument: str | None = "hello.py", tools: tuple[str, ...] = (),
                      calls: bool = True, results: bool | str = True) -> None:
    """Every request answered 2xx, the API ``path`` used; with ``calls``, a call (to one of ``tools``, if given)
    naming ``argument`` parsed from the model's own output and (with ``results``) its result received in a later
    request as a tool message (smolagents sends its observations as user text instead); each later turn of the
    conversation computing only what the previous one did not hold (a cached prefix of at least 90% of its
    prompt)."""
    answered = statuses(log)
    assert any(p == path for _, p, _ in answered), (path, answered, log[-3000:])
    assert answered and all(200 <= s < 300 for _, _, s in answered), (answered, log[-3000:])
    talk = conversation(log)  # NOTE: checked before a missing call can make the run an expected failure
    assert continued(talk), turns(log)
    if calls:
        parsed = tool_calls(log)
        if not parsed:  # the model's choice, not the server's: quote what it wrote instead
            pytest.xfail("the model answered without a tool call (its text is printed above)")
        assert any((argument is None or argument in c) and (not tools or c.split(" ", 1)[0] in tools)
                   for c in parsed), (parsed, log[-3000:])
        got = re.search(r"tool results received: \S+ \([1-9]\d* chars\)", log)
        if results == "xfail" and not got:  # the agent's choice: it sent no result back for the parsed call
            pytest.xfail(f"the agent sent no tool result for the model's calls {parsed[-3:]}: turns {turns(log)}")
        assert not results or got, log[-3000:]
    assert len(talk) >= 2, turns(log)  # a later turn to check


def answer_or_xfail(answer: str, what: str) -> None:
    """The right number, or an expected failure that quotes what the model answered instead (everything around the
    answer is asserted before it: the answer is the model's, not the server's)."""
    if ANSWER not in answer:
        pytest.xfail(f"{what}: the model's answer lacks {ANSWER}: {answer[-300:]!r}")


def reused(before: dict[str, int | str], after: dict[str, int | str]) -> bool:
    """A later turn reuses the conversation's prefix: at least 90% of its prompt came from the cache, or (a short
    prompt to which the agent adds a long message: mini-swe-agent's 120-token format reminder on 855 tokens) all of
    the previous turn's prompt but the chat template's last few tokens."""
    cached, prompt = int(after["cached"]), int(after["prompt"])
    return cached >= 0.9 * prompt or cached >= int(before["prompt"]) - 16


# A fork of the conversation (the agent's side request on the same system prompt and tools, other text after them)
# reuses at least this share of its prompt. Seen (Claude Code 2.1.332, default tools, 5 Dec 2026): turns of
# 11576 -> 12952 tokens, then a 50-token request of 12044 tokens reusing 9335 (the ~9.3k-token system prompt and tools
# they share) whose own next turn reused all of it, and so on three times.
FORK_SHARE = 0.75


def continued(talk: list[dict[str, int | str]]) -> bool:
    """Every later turn continues an earlier one (``reused``), or forks the conversation after its shared system
    prompt and tools (at least FORK_SHARE of its prompt from the cache); at least one turn continues another."""
    follows = [any(reused(before, after) for before in talk[:i]) for i, after in enumerate(talk) if i]
    forks = [int(t["cached"]) >= FORK_SHARE * int(t["prompt"]) for t in talk[1:]]
    return any(follows) and all(f or k for f, k in zip(follows, forks))


def conversation(log: str) -> list[dict[str, int | str]]:
    """The turns of the agent's conversation: requests whose prompt is at least half the longest one's (an
    agent's side requests, such as a title for the session, are short prompts of their own)."""
    found = turns(log)
    longest = max((int(t["prompt"]) for t in found), default=0)
    return [t for t in found if int(t["prompt"]) >= longest / 2]


def run_to_end(cmd: list[str], cwd: Path, env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    """Run an agent to its end in a session of its own; past ``timeout_s`` the whole process group is killed (a
    CLI's wrapper starts the native binary as a child, which would otherwise go on talking to the server) and
    subprocess.TimeoutExpired raised."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout_s, out, err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
