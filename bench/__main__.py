"""`python -m bench`: the same entry point as `ortserve bench` (bench.cli.main)."""

import sys

from bench import INSTALL_HINT, missing_requirements

if missing := missing_requirements():
    sys.exit(f"python -m bench needs {', '.join(missing)}: {INSTALL_HINT}")

from bench.cli import main  # noqa: E402 (after the check: it imports the clients)

sys.exit(main())
