"""One warm server for every agent test in this folder: `ortserve serve --model qwen2.5-coder-1.5b` on the CPU,
started once for the package (its prefix cache and compiled grammars then serve every agent that follows)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.agents.agent_recipes import releases
from tests.integration.server.conftest import ServeProcess, serve_process

MODEL = "qwen2.5-coder-1.5b"
KEY = "sk-local-test"


@pytest.fixture(scope="package")
def qwen(qwen_model: Path) -> Iterator[ServeProcess]:
    # NOTE: the model's own context (32k) and nothing else; two slots, so that an agent's side request (Claude
    # Code's small/fast model is the same model here) does not take the slot holding the conversation's prefix.
    # The agents send no sampling settings (or the model's defaults), so the model's own apply (its
    # generation_config.json, which `ortserve pull` writes: temperature 0.7, top_p 0.8, top_k 20,
    # repetition_penalty 1.1), but greedy (--default-temperature 0), so that a run is reproducible; the repetition
    # penalty stays (without it the greedy model calls Read again on the result it was just given).
    with serve_process(qwen_model, "--served-model-name", MODEL, "--max-batch", "2", "--api-key", KEY,
                       "--default-temperature", "0", "--log-level", "info", ready_timeout_s=600,
                       with_stdout=True) as server:
        try:
            yield server
        finally:
            if os.environ.get("AGENTS_SERVER_LOG"):  # the whole log of the package's server, kept for diagnosis
                Path(os.environ["AGENTS_SERVER_LOG"]).write_text(server.stderr())


def release_params(name: str, kind: str = "npm") -> list:
    """pytest params of an agent's releases: the newest always; the others only when AGENT_RELEASES=all (`make
    test-agents`), marked agents_extra. Missing manifests make one param that fails with the install hint."""
    try:
        versions = releases(name, kind)
    except FileNotFoundError:
        return [pytest.param(None, id="not-installed")]  # the test fails, saying how to install (require())
    if not versions:
        return [pytest.param(None, id="not-installed")]
    every = os.environ.get("AGENT_RELEASES") == "all"
    params = [pytest.param(versions[0], id=versions[0])]
    for version in versions[1:]:
        marks = [pytest.mark.agents_extra]
        if not every:
            marks.append(pytest.mark.skip(reason="an older release: `make test-agents` (AGENT_RELEASES=all) runs it"))
        params.append(pytest.param(version, id=version, marks=marks))
    return params
