"""`python -m bench`: the same entry point as `ortserve bench` (bench.cli.main)."""

import sys

from bench.cli import main

sys.exit(main())
