"""`python -m tests.integration.server.paced_serve DELAY_S serve ...`: the `ortserve` CLI, unchanged, with a
test-only fault injector that sleeps DELAY_S before every decode step.

A stream of N tokens then lasts at least N * DELAY_S seconds whatever the machine's speed, so a test's premise
("the stream is still open when ...") holds by construction; a faster machine cannot shorten a sleep.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

import server.app
from server.__main__ import main
from tests.pacing import DecodePace


def paced(delay_s: float) -> None:
    """Every engine the app loads from now on sleeps `delay_s` before each decode step.

    NOTE: a module-level class (tests.pacing.DecodePace), not a closure: with --engine-process the injector is
    pickled into the engine process.
    """
    make_config = server.app.engine_config_from

    def config_with_pace(settings: Any, *args: Any, **kwargs: Any) -> Any:  # (the draft model's folder, if any)
        return replace(make_config(settings, *args, **kwargs), fault_injector=DecodePace(delay_s))

    server.app.engine_config_from = config_with_pace


if __name__ == "__main__":
    paced(float(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
