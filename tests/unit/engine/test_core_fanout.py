"""engine.core_fanout: an engine process shared by several API processes sends each client only its own requests'
outputs (``seq % n``), every client the snapshots, and feeds every client's adds to the one core (real pipes)."""

from __future__ import annotations

import multiprocessing
import threading
from dataclasses import dataclass, field

from engine.core_fanout import FanOutbox, serve_client
from engine.core_wire import AbortRequests, AddRequest, Ready, Shutdown, SnapshotUpdate, StepOutputs, decode_outputs, \
    dumps, loads
from engine.types import CoreOutput, CoreSnapshot, FinishReason, SamplingParams


@dataclass
class _Core:
    snapshot: CoreSnapshot = field(default_factory=lambda: CoreSnapshot(num_running=3, steps_total=7))


def _pipes(n: int) -> tuple[list, list]:
    pairs = [multiprocessing.Pipe() for _ in range(n)]
    return [engine_end for engine_end, _ in pairs], [client_end for _, client_end in pairs]


def _drain(conn) -> list:
    messages = []
    while conn.poll(0.2):
        messages.append(loads(conn.recv_bytes()))
    return messages


def test_each_client_gets_only_its_requests_outputs_and_every_client_the_snapshot() -> None:
    control, parent = multiprocessing.Pipe()
    engine_ends, clients = _pipes(3)
    outbox = FanOutbox(control, engine_ends, snapshot_interval_s=3600.0)
    outbox.core = _Core()
    outbox._sent_s = float("inf")  # no snapshot is due by time: only a finished request brings one
    outbox([CoreOutput("a", (1,), seq=3), CoreOutput("b", (2,), seq=4), CoreOutput("c", (3,), seq=6)])
    got = [_drain(c) for c in clients]
    assert [[o.request_id for m in msgs for o in decode_outputs(m.rows)] for msgs in got] == [["a", "c"], ["b"], []]
    assert all(m.snapshot is None for msgs in got for m in msgs)

    outbox([CoreOutput("b", (5,), FinishReason.STOP, seq=4)])  # a finish: the snapshot goes to all three
    got = [_drain(c) for c in clients]
    assert [type(m) for msgs in got for m in msgs] == [SnapshotUpdate, StepOutputs, SnapshotUpdate]
    assert all(m.snapshot.steps_total == 7 for msgs in got for m in msgs)
    assert decode_outputs(got[1][0].rows)[0].finish_reason is FinishReason.STOP
    assert _drain(parent) == []  # outputs never go to the parent


def test_ready_goes_to_the_parent_and_every_client_and_a_gone_client_is_dropped() -> None:
    control, parent = multiprocessing.Pipe()
    engine_ends, clients = _pipes(2)
    outbox = FanOutbox(control, engine_ends, snapshot_interval_s=0.0)
    outbox.send(Ready(None))
    assert [type(m) for m in _drain(parent) + _drain(clients[0]) + _drain(clients[1])] == [Ready] * 3
    clients[0].close()  # API process 0 has gone: the others still get theirs
    outbox([CoreOutput("x", (1,), seq=2), CoreOutput("y", (1,), seq=1)])
    outbox([CoreOutput("x", (2,), seq=2), CoreOutput("y", (2,), seq=1)])
    assert outbox.clients[0] is None
    assert [o.token_ids for m in _drain(clients[1]) for o in decode_outputs(m.rows)] == [(1,), (2,)]


class _Feed:
    def __init__(self) -> None:
        self.messages: list = []

    def put(self, message) -> None:
        self.messages.append(message)


def test_a_clients_reader_feeds_its_messages_in_order_and_detaches_on_shutdown() -> None:
    control, _parent = multiprocessing.Pipe()
    engine_ends, clients = _pipes(2)
    outbox = FanOutbox(control, engine_ends, snapshot_interval_s=0.0)
    feed = _Feed()
    reader = threading.Thread(target=serve_client, args=(engine_ends[1], 1, feed, outbox))
    reader.start()
    add = AddRequest("r", [1, 2], SamplingParams(max_tokens=2), seq=3, arrival_s=0.0)
    for message in (add, AbortRequests(["r"]), Shutdown()):
        clients[1].send_bytes(dumps(message))
    reader.join(10)
    assert not reader.is_alive()
    assert [type(m) for m in feed.messages] == [AddRequest, AbortRequests]
    assert outbox.clients == [engine_ends[0], None]
    assert clients[1].poll(1) and _eof(clients[1])  # the engine closed its end: the client's reader sees EOF


def _eof(conn) -> bool:
    try:
        conn.recv_bytes()
    except EOFError:
        return True
    return False
