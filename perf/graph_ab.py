"""Decode-step time of several model folders (or builds of one GGUF), interleaved: which graph runs faster.

Each folder gets a bare ONNX Runtime loop (perf.ceiling.BareLoop: the engine's session options, KV buffer
and bindings); the loops take turns, BLOCK greedy steps each, for BLOCKS turns, and every step (run and argmax) is
timed alone.
Interleaving in short blocks puts the same machine load on every folder, and medians of single runs ignore the
stalls a shared machine adds, so differences of a few percent show. Positions cycle through [32, 600).

    .venv/bin/python -m perf.graph_ab .cache/gemma3-270m /tmp/gemma3-other-build [--blocks 40]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

START, END = 32, 600


class _Stepper:
    """One folder's greedy decode (a bare loop), a timed step at a time."""

    def __init__(self, folder: Path, threads: int, max_length: int) -> None:
        from perf.ceiling import BareLoop

        self.loop = BareLoop(folder, 1, threads, max_length)
        self.first = self.loop.prefill(list(range(100, 100 + START)))
        self.loop.begin(self.first, START)
        self.times: list[float] = []

    def steps(self, n: int) -> None:
        for _ in range(n):
            if self.loop.position >= END:  # start over from the prompt's KV (positions past it are rewritten)
                self.loop.begin(self.first, START)
            t0 = time.perf_counter()
            self.loop.step()
            self.times.append(time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", type=Path, nargs="+")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--block", type=int, default=8, help="steps per turn")
    args = parser.parse_args(argv)
    steppers = [_Stepper(f, args.threads, END + 8) for f in args.folders]
    for s in steppers:  # warm-up
        s.steps(args.block)
        s.times.clear()
    for _ in range(args.blocks):
        for s in steppers:
            s.steps(args.block)
    base = statistics.median(steppers[0].times)
    for folder, s in zip(args.folders, steppers):
        med = statistics.median(s.times)
        print(f"{folder}: median {1e3 * med:.2f} ms/step ({med / base:.3f}x the first), "
              f"p10 {1e3 * np.percentile(s.times, 10):.2f}, mean {1e3 * statistics.mean(s.times):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
