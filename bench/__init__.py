"""Load-test harness (`ortserve bench`): OpenAI streaming clients, engine-direct driver, figures, JSON reports
and plots. One-off performance investigations live apart, in perf/.

Must not import server/; imports engine/ only in engine_driver.py (engine-direct mode).
"""

import importlib.util

# What only the harness needs, installed by the `bench` extra (pyproject.toml), never by `make serve`.
REQUIREMENTS = ("httpx", "openai", "matplotlib")
INSTALL_HINT = ("install the `bench` extra: pip install 'ortserve[bench]' (in a checkout: "
                ".venv/bin/pip install -e '.[bench]'; `make test` installs it too)")


def missing_requirements() -> list[str]:
    """The harness's modules that are not installed (without importing any of them)."""
    return [name for name in REQUIREMENTS if importlib.util.find_spec(name) is None]
