"""Decode-step time of several model folders (or builds of one GGUF), interleaved: which graph runs faster.

Each folder gets a bare ONNX Runtime loop (bench.perf.ceiling.BareLoop: the engine's session options, KV buffer
and bindings); the loops take turns, BLOCK greedy steps each, for BLOCKS turns, and every run is timed alone.
Interleaving in short blocks puts the same machine load on every folder, and medians of single runs ignore the
stalls a shared machine adds, so differences of a few percent show. Positions cycle through [32, 600).

    .venv/bin/python -m bench.perf.graph_ab .cache/gemma3-270m /tmp/gemma3-other-build [--blocks 40]
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
    """One folder's greedy decode, a step at a time, on preallocated inputs."""

    def __init__(self, folder: Path, threads: int, max_length: int) -> None:
        from bench.perf.ceiling import BareLoop

        self.loop = loop = BareLoop(folder, 1, threads, max_length)
        io = loop.io
        self.ids = np.zeros((1, 1), np.int64)
        self.pos = np.zeros((1, 1), np.int64)
        self.ones = np.ones(max_length, np.int64)
        self.logits = np.zeros((1, 1, io.vocab_size), np.float32)
        self.binding = b = loop.session.io_binding()
        b.bind_cpu_input(io.input_ids, self.ids)
        if io.position_ids:
            b.bind_cpu_input(io.position_ids, self.pos)
        b.bind_output(io.logits, "cpu", 0, np.float32, list(self.logits.shape), self.logits.ctypes.data)
        loop._bind_kv(b, 0, 1)
        self.prompt = list(range(100, 100 + START))
        self.ids[0, 0] = loop.prefill(self.prompt)[0]
        self.p = START
        self.times: list[float] = []

    def steps(self, n: int) -> None:
        for _ in range(n):
            if self.p >= END:  # start over from the prompt's KV (positions past it are rewritten)
                self.p = START
            self.pos[0, 0] = self.p
            self.binding.bind_cpu_input(self.loop.io.attention_mask, self.ones[:self.p + 1].reshape(1, self.p + 1))
            t0 = time.perf_counter()
            self.loop.session.run_with_iobinding(self.binding)
            self.times.append(time.perf_counter() - t0)
            self.ids[0, 0] = int(np.argmax(self.logits[0, 0]))
            self.p += 1


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
