"""Run a command; print its wall time and peak RSS (the kernel's rusage of that process), as /usr/bin/time -v would
where the GPU image has no GNU time.

    python3 -m perf.gpu.timed -- python3 -m server convert MODEL.gguf OUT --dtype float16
"""

from __future__ import annotations

import os
import subprocess
import sys
import time


def main(argv: list[str] | None = None) -> int:
    cmd = list(sys.argv[1:] if argv is None else argv)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    _, status, usage = os.wait4(proc.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    print(f"timed: exit {code}, wall {time.perf_counter() - t0:.1f} s, peak RSS {usage.ru_maxrss / 2**20:.2f} GiB: "
          f"{' '.join(cmd)}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
