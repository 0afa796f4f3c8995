"""One smolagents run in its own venv (.cache/agent-venvs/smolagents@VERSION): a ToolCallingAgent or a CodeAgent
on OpenAIServerModel pointed at a local server, with one tool, read_file, in the working folder. Prints the final
answer as one JSON line ``{"answer": ...}``.

Usage: python smolagents_run.py ToolCallingAgent|CodeAgent API_BASE MODEL KEY TASK
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from smolagents import CodeAgent, OpenAIServerModel, ToolCallingAgent, tool


@tool
def read_file(path: str) -> str:
    """Read a text file in the working folder.

    Args:
        path: the file's path, relative to the working folder.
    """
    return Path(path).read_text()


def main() -> None:
    kind, api_base, model_id, key, task = sys.argv[1:6]
    model = OpenAIServerModel(model_id=model_id, api_base=api_base, api_key=key)
    agent_class = {"ToolCallingAgent": ToolCallingAgent, "CodeAgent": CodeAgent}[kind]
    agent = agent_class(tools=[read_file], model=model, max_steps=4)
    answer = agent.run(task)
    print(json.dumps({"answer": str(answer)}))


if __name__ == "__main__":
    main()
