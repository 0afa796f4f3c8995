"""`python -m perf.engine_ipc`: what one step's outputs cost to cross the engine-process boundary.

1. The engine's own path (engine.core_wire over a spawn-context multiprocessing pipe): the child encodes N
   CoreOutputs, pickles and sends them (`core_process._Outbox`); the parent receives, unpickles and rebuilds them
   (`core_client.EngineCoreClient._read`). CPU per message on each side (thread time over 2000 messages) and the median
   round trip of a message and a 1-byte answer.
2. With `--transports` (needs pyzmq and msgspec, not dependencies of ortserve: install them into a scratch venv), the
   same rows as plain tuples through the pipe + pickle, pyzmq PUSH/PULL over ipc:// + pickle, and pyzmq + msgspec.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pickle
import sys
import tempfile
import time

STEPS = 2000
PINGS = 300


def _rows(n: int, step: int) -> list[tuple]:
    return [(f"cmpl-{i:032x}", (step % 49152,), None, None, None, i, 1234.5 + i, 0, 0, None, False) for i in range(n)]


# -- 1. the engine's path ----------------------------------------------------------------------------------------------


def _engine_child(conn, n: int, logprobs: bool) -> None:
    from engine.types import CoreOutput, CoreSnapshot
    from engine.core_wire import StepOutputs, dumps, encode_outputs
    from engine.types import TokenLogprob

    steps = [[CoreOutput(f"cmpl-{i:032x}", (s % 49152,), None, (TokenLogprob(s, -0.5),) if logprobs else None, seq=i,
                         first_scheduled_s=1234.5 + i) for i in range(n)] for s in range(STEPS)]
    snapshot = CoreSnapshot()
    conn.recv_bytes()
    cpu = time.thread_time()
    for s, outs in enumerate(steps):
        conn.send_bytes(dumps(StepOutputs(encode_outputs(outs), snapshot if s % 3 == 0 else None, None)))
    conn.send_bytes(pickle.dumps((time.thread_time() - cpu) / STEPS))
    for outs in steps[:PINGS]:
        conn.send_bytes(dumps(StepOutputs(encode_outputs(outs), None, None)))
        conn.recv_bytes()


def engine_path(n: int, logprobs: bool) -> dict:
    from engine.core_wire import decode_outputs, loads

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_engine_child, args=(child, n, logprobs))
    proc.start()
    child.close()
    parent.send_bytes(b"go")
    cpu = time.thread_time()
    for _ in range(STEPS):
        decode_outputs(loads(parent.recv_bytes()).rows)
    receive_us = 1e6 * (time.thread_time() - cpu) / STEPS
    send_us = 1e6 * pickle.loads(parent.recv_bytes())
    trips = []
    for _ in range(PINGS):
        t = time.perf_counter()
        decode_outputs(loads(parent.recv_bytes()).rows)
        parent.send_bytes(b"k")
        trips.append(time.perf_counter() - t)
    proc.join()
    trips.sort()
    return {"path": "engine (core_wire, pipe)", "outputs": n, "logprobs": logprobs, "child_us": round(send_us, 1),
            "parent_us": round(receive_us, 1), "round_trip_us": round(1e6 * trips[len(trips) // 2], 1)}


# -- 2. transports ---------------------------------------------------------------------------------------------------


def _endpoints(transport: str, role: str, address: str, conn):
    if transport == "pipe":
        return conn.send_bytes, conn.recv_bytes
    import zmq

    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    if role == "child":
        push.connect(address + "-up")
        pull.connect(address + "-down")
    else:
        push.bind(address + "-down")
        pull.bind(address + "-up")
    return (lambda b: push.send(b, copy=False)), pull.recv


def _codec(name: str):
    if name == "msgspec":
        import msgspec

        return msgspec.msgpack.Encoder().encode, msgspec.msgpack.Decoder().decode
    return (lambda o: pickle.dumps(o, 5)), pickle.loads


def _transport_child(kind: str, n: int, address: str, conn) -> None:
    transport, codec = kind.split("+")
    send, recv = _endpoints(transport, "child", address, conn)
    encode, _ = _codec(codec)
    steps = [_rows(n, s) for s in range(STEPS)]
    recv()
    cpu = time.thread_time()
    for rows in steps:
        send(encode(rows))
    send(encode((time.thread_time() - cpu) / STEPS))
    for rows in steps[:PINGS]:
        send(encode(rows))
        recv()


def transport(kind: str, n: int) -> dict:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe() if kind.startswith("pipe") else (None, None)
    address = f"ipc://{tempfile.gettempdir()}/ortserve-ipc-{os.getpid()}"
    send, recv = _endpoints(kind.split("+")[0], "parent", address, parent)
    _, decode = _codec(kind.split("+")[1])
    proc = ctx.Process(target=_transport_child, args=(kind, n, address, child))
    proc.start()
    time.sleep(0.5)  # zmq: let the child connect before the first message
    send(b"go")
    cpu = time.thread_time()
    for _ in range(STEPS):
        decode(recv())
    receive_us = 1e6 * (time.thread_time() - cpu) / STEPS
    send_us = 1e6 * decode(recv())
    trips = []
    for _ in range(PINGS):
        t = time.perf_counter()
        decode(recv())
        send(b"k")
        trips.append(time.perf_counter() - t)
    proc.join()
    trips.sort()
    return {"path": kind, "outputs": n, "child_us": round(send_us, 1), "parent_us": round(receive_us, 1),
            "round_trip_us": round(1e6 * trips[len(trips) // 2], 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--transports", action="store_true", help="also pipe vs pyzmq (+ msgspec) on plain rows")
    p.add_argument("--json", help="write every row here")
    args = p.parse_args(argv)
    rows = []
    for rnd in range(args.rounds):
        cases = [lambda n=n, lp=lp: engine_path(n, lp) for n, lp in ((1, False), (8, False), (64, False), (64, True))]
        if args.transports:
            cases += [lambda n=n, k=k: transport(k, n) for n in (8, 64)
                      for k in ("pipe+pickle", "zmq+pickle", "zmq+msgspec")]
        for case in cases:
            row = {"round": rnd, **case()}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load_avg_1m": os.getloadavg()[0], "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
