"""A model too big for the memory is refused at start with the sizes named (issue 45): a real `ortserve serve` of a
small model asked for a KV cache larger than this machine's memory exits at once, before its session loads, with a
message that names the weights, the KV cache and the memory available, never an out-of-memory crash later."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

from engine.builder import SyntheticSpec, build_synthetic
from engine.context_length import available_host_memory_bytes

ROOT = Path(__file__).resolve().parents[3]


def test_a_kv_cache_larger_than_the_memory_is_refused_before_the_load(tmp_path: Path):
    # 2 layers x 2 KV heads x 16 x float32: 512 bytes a token a row; 256 rows of 1M tokens are 128 GiB
    folder = build_synthetic(tmp_path / "long", SyntheticSpec(max_length=1 << 20, vocab_size=512))
    assert 256 * (1 << 20) * 512 > available_host_memory_bytes()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "server", "serve", "--model", str(folder), "--provider", "cpu",
                           "--max-batch", "256", "--max-model-len", str(1 << 20), "--port", str(port)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    message = proc.stderr
    assert "cannot be served" in message and "KV cache 128.00 GiB" in message, message[-2000:]
    assert "host memory available (MemAvailable)" in message and "lower --max-model-len or --max-batch" in message
    assert "KV cache:" not in message  # (engine.kv_cache's line: nothing was allocated)
    assert time.monotonic() - started < 120
