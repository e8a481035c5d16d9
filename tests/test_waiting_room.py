"""The admission waiting room (issue #27, slow-loris and stalled-uploader goodput): a call that finds every
``--max-concurrent-requests`` place taken waits for one, at most ``ADMISSION_WAIT_S``; a freed place goes to
the waiting call whose host, then connection, holds the fewest stalled uploads (``shares.wait_rank``), or is kept
``PARK_S`` for the next call of the connection that freed it when only worse-ranked callers wait.

Before the waiting room, a full server refused every call at once: a legitimate client lost its place to
whichever staller polled first after each of its calls, and paid a 50-300 ms pushback for each refusal (measured
with ``advantage-bench --sections adversarial``: 23-34 % goodput for a same-host neighbour of a slow-loris).
These tests drive :class:`~advantage_server.admission.RequestGate` directly, with a stand-in for the stalled-upload
counts, and one real server.
"""
from __future__ import annotations

import threading
import time
import types

import grpc
import numpy as np
import pytest

from advantage_client._proto.advantage.v1 import advantage_pb2_grpc as pb_grpc
from advantage_client.client import build_request
from advantage_server import admission
from advantage_server.admission import Caller, Draining, Overloaded, RequestGate


@pytest.fixture
def long_wait(monkeypatch):
    """``ADMISSION_WAIT_S`` of 20 s, so that a slow machine does not end a wait these tests hold on purpose."""
    monkeypatch.setattr(admission, "ADMISSION_WAIT_S", 20.0)


class _Stalled:
    """Stand-in for ``UploadWatch.stalled``: stalled uploads per host and per connection, set by the test."""

    def __init__(self):
        self.hosts: dict[str, int] = {}
        self.conns: dict[str, int] = {}

    def __call__(self):
        return dict(self.hosts), dict(self.conns)


def _gate(places: int = 1, waiting: int | None = None) -> tuple[RequestGate, _Stalled]:
    gate = RequestGate(places, places, max_waiting=waiting)
    stalled = _Stalled()
    gate.stalled = stalled
    return gate, stalled


class _Call(threading.Thread):
    """One limited call through ``gate``: admitted (``admitted`` set), holds its place until ``release`` is set;
    ``outcome`` is "ok", or the refusal's class name."""

    def __init__(self, gate: RequestGate, caller: Caller, make_room=lambda held=False: None):
        super().__init__(daemon=True)
        self.gate, self.caller, self.make_room = gate, caller, make_room
        self.admitted, self.release = threading.Event(), threading.Event()
        self.outcome: str | None = None
        self.start()

    def run(self) -> None:
        try:
            with self.gate.admit(True, make_room=self.make_room, caller=self.caller):
                self.admitted.set()
                assert self.release.wait(30)
            self.outcome = "ok"
        except (Overloaded, Draining) as exc:
            self.outcome = type(exc).__name__

    def finish(self) -> str | None:
        self.release.set()
        self.join(30)
        return self.outcome


def _wait_for(predicate, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def test_a_full_gate_makes_the_call_wait_and_hands_it_the_freed_place(long_wait):
    """Every place taken: the next call waits instead of being refused, and gets the place the moment the holder
    leaves (handed over, counted as taken: no other call can slip in between)."""
    gate, _ = _gate(places=1)
    holder = _Call(gate, Caller("ipv4:10.0.0.1:1", "10.0.0.1"))
    assert holder.admitted.wait(5)
    waiter = _Call(gate, Caller("ipv4:10.0.0.2:1", "10.0.0.2"))
    _wait_for(lambda: gate.waiting == 1)
    assert not waiter.admitted.is_set()
    t0 = time.monotonic()
    assert holder.finish() == "ok"
    assert waiter.admitted.wait(5)
    assert time.monotonic() - t0 < 1.0
    assert gate.full and gate.waited == 1 and gate.refusals == 0
    assert waiter.finish() == "ok"
    assert not gate.full and gate.in_flight == 0


def test_the_freed_place_goes_to_the_caller_with_the_fewest_stalled_uploads_not_the_first(long_wait):
    """Two calls wait: a staller's (its host holds 3 stalled uploads) came first, a prompt client's second. The
    freed place goes to the prompt client; the staller gets the next one."""
    gate, stalled = _gate(places=1, waiting=4)
    stalled.hosts = {"10.0.0.9": 3}
    stalled.conns = {"ipv4:10.0.0.9:7": 3}
    holder = _Call(gate, Caller("ipv4:10.0.0.3:1", "10.0.0.3"))
    assert holder.admitted.wait(5)
    staller = _Call(gate, Caller("ipv4:10.0.0.9:7", "10.0.0.9"))
    _wait_for(lambda: gate.waiting == 1)
    prompt = _Call(gate, Caller("ipv4:10.0.0.2:1", "10.0.0.2"))
    _wait_for(lambda: gate.waiting == 2)
    holder.finish()
    assert prompt.admitted.wait(5)
    assert not staller.admitted.is_set()
    prompt.finish()  # only the staller waits: kept PARK_S for the prompt client, then the staller's
    assert staller.admitted.wait(5)
    assert staller.finish() == "ok" and prompt.outcome == "ok"


def test_inside_a_host_the_connection_with_fewer_stalled_uploads_goes_first(long_wait):
    gate, stalled = _gate(places=1, waiting=4)
    stalled.hosts = {"10.0.0.1": 4}
    stalled.conns = {"ipv4:10.0.0.1:1": 4}
    holder = _Call(gate, Caller("ipv4:10.0.0.1:1", "10.0.0.1"))  # the staller's connection holds the place
    assert holder.admitted.wait(5)
    same_conn = _Call(gate, Caller("ipv4:10.0.0.1:1", "10.0.0.1"))
    _wait_for(lambda: gate.waiting == 1)
    neighbour = _Call(gate, Caller("ipv4:10.0.0.1:2", "10.0.0.1"))  # same host, a connection of its own
    _wait_for(lambda: gate.waiting == 2)
    holder.finish()
    assert neighbour.admitted.wait(5) and not same_conn.admitted.is_set()
    neighbour.finish()
    assert same_conn.admitted.wait(5)
    same_conn.finish()


def test_a_place_is_kept_for_the_connection_that_freed_it_when_only_stallers_wait(monkeypatch, long_wait):
    """Only a staller waits: the place a prompt client's call frees is kept ``PARK_S`` for that connection's next
    call, which takes it although the staller came first; a place nobody comes back for goes to the staller
    once ``PARK_S`` has passed."""
    monkeypatch.setattr(admission, "PARK_S", 0.3)
    gate, stalled = _gate(places=1)
    stalled.hosts, stalled.conns = {"10.0.0.9": 2}, {"ipv4:10.0.0.9:7": 2}
    loop = Caller("ipv4:10.0.0.2:1", "10.0.0.2")
    first = _Call(gate, loop)
    assert first.admitted.wait(5)
    staller = _Call(gate, Caller("ipv4:10.0.0.9:7", "10.0.0.9"))
    _wait_for(lambda: gate.waiting == 1)
    first.finish()
    assert gate.parked == 1 and not staller.admitted.is_set()
    second = _Call(gate, loop)  # the loop's next call, within PARK_S
    assert second.admitted.wait(5)
    assert gate.unparked == 1 and not staller.admitted.is_set()
    t0 = time.monotonic()
    second.finish()  # kept again; nobody comes back for it this time
    assert gate.parked == 2
    assert staller.admitted.wait(5)
    assert 0.25 <= time.monotonic() - t0 < 2.0  # after PARK_S, not at once
    assert staller.finish() == "ok"


def test_a_full_waiting_room_takes_a_better_ranked_newcomer_and_refuses_a_worse_one(long_wait):
    gate, stalled = _gate(places=1, waiting=1)
    stalled.hosts, stalled.conns = {"10.0.0.9": 2}, {"ipv4:10.0.0.9:7": 2}
    holder = _Call(gate, Caller("ipv4:10.0.0.3:1", "10.0.0.3"))
    assert holder.admitted.wait(5)
    staller = _Call(gate, Caller("ipv4:10.0.0.9:7", "10.0.0.9"))
    _wait_for(lambda: gate.waiting == 1)
    prompt = _Call(gate, Caller("ipv4:10.0.0.2:1", "10.0.0.2"))  # ranks first: the staller gives up its room
    staller.join(5)
    assert staller.outcome == "Overloaded" and gate.dropped == 1
    _wait_for(lambda: gate.waiting == 1)
    staller2 = _Call(gate, Caller("ipv4:10.0.0.9:7", "10.0.0.9"))  # ranks last in a full room: refused at once
    staller2.join(5)
    assert staller2.outcome == "Overloaded" and gate.waiting == 1
    holder.finish()
    assert prompt.admitted.wait(5)
    assert prompt.finish() == "ok"


def test_the_wait_is_bounded_by_admission_wait_and_the_deadline(monkeypatch):
    monkeypatch.setattr(admission, "ADMISSION_WAIT_S", 0.3)
    gate, _ = _gate(places=1)
    holder = _Call(gate, Caller("ipv4:10.0.0.3:1", "10.0.0.3"))
    assert holder.admitted.wait(5)
    t0 = time.monotonic()
    late = _Call(gate, Caller("ipv4:10.0.0.2:1", "10.0.0.2"))
    late.join(5)
    assert late.outcome == "Overloaded" and 0.25 <= time.monotonic() - t0 < 2.0
    # a call whose deadline leaves less than the margin is refused at once, not after the wait: the wait made long
    # here, so that a thread slow to run beside a busy loop (0.54 s, once in 10 runs against a bound of 0.2 s) does
    # not pass for a wait
    monkeypatch.setattr(admission, "ADMISSION_WAIT_S", 5.0)
    t0 = time.monotonic()
    hurried = _Call(gate, Caller("ipv4:10.0.0.2:2", "10.0.0.2", time_left=lambda: 0.01))  # less than the margin
    hurried.join(10)
    assert hurried.outcome == "Overloaded" and time.monotonic() - t0 < 2.5
    gone = _Call(gate, Caller("ipv4:10.0.0.2:3", "10.0.0.2", alive=lambda: False))  # the client left
    gone.join(5)
    assert gone.outcome == "Overloaded"
    assert gate.refusals == 3 and gate.waited == 0
    holder.finish()


def test_the_drain_ends_the_wait_with_unavailable(long_wait):
    gate, _ = _gate(places=1)
    holder = _Call(gate, Caller("ipv4:10.0.0.3:1", "10.0.0.3"))
    assert holder.admitted.wait(5)
    waiter = _Call(gate, Caller("ipv4:10.0.0.2:1", "10.0.0.2"))
    _wait_for(lambda: gate.waiting == 1)
    gate.start_draining()
    waiter.join(5)
    assert waiter.outcome == "Draining"
    assert holder.finish() == "ok"


def test_a_real_server_serves_the_call_that_waited(make_server, monkeypatch):
    """A real server with one place, held by a computing call: a second client's call waits in the room and is
    answered (equal to the same call on an idle server) once the first is released, instead of being refused."""
    import dataclasses

    from advantage_server.estimators.registry import REGISTRY
    srv = make_server(max_concurrent_requests=1, workers=1)
    grpo = build_request("grpo", None, prompt_ids=[0, 0, 1, 1], rewards=[1.0, 0.0, 0.5, 2.0],
                         mask=[[1.0]] * 4)
    with grpc.insecure_channel(srv.address) as a, grpc.insecure_channel(
            srv.address, options=[("grpc.use_local_subchannel_pool", 1)]) as b:
        expected = np.frombuffer(pb_grpc.AdvantageServiceStub(a).ComputeAdvantage(grpo, timeout=30)
                                 .advantages.data, np.float32)
        assert np.abs(expected).min() > 0.1  # a real, non-trivial answer
        unheld, release, entered = REGISTRY["grpo"], threading.Event(), threading.Event()

        def held(cfg, batch):
            entered.set()
            assert release.wait(60)
            return unheld.fn(cfg, batch)
        monkeypatch.setitem(REGISTRY, "grpo", dataclasses.replace(unheld, fn=held))
        first = pb_grpc.AdvantageServiceStub(a).ComputeAdvantage.future(grpo, timeout=30)
        assert entered.wait(30)
        second = pb_grpc.AdvantageServiceStub(b).ComputeAdvantage.future(grpo, timeout=30)
        _wait_for(lambda: srv.gate.waiting == 1)
        release.set()
        for f in (first, second):
            np.testing.assert_array_equal(np.frombuffer(f.result(timeout=30).advantages.data, np.float32), expected)
    assert srv.gate.waited == 1 and srv.gate.refusals == 0


def test_a_connection_holding_a_stalled_upload_fills_the_server_only_to_half(monkeypatch):
    """``STALLED_FILL``: with 4 places, a connection that holds a stalled upload gets 2 of them; its third call
    waits (``STALLED_WAIT_S``) although 2 places are free and is refused when the wait ends, while a prompt
    connection's calls take the free places at once. Before: a slow-loris refilled every place it was cut from
    within milliseconds, and each legitimate call had to cut one to get in."""
    monkeypatch.setattr(admission, "STALLED_WAIT_S", 0.3)
    gate, stalled = _gate(places=4, waiting=8)
    staller = Caller("ipv4:10.0.0.9:7", "10.0.0.9")
    stalled.hosts, stalled.conns = {"10.0.0.9": 1}, {staller.connection: 1}
    first = [_Call(gate, staller) for _ in range(2)]
    assert all(c.admitted.wait(5) for c in first)
    third = _Call(gate, staller)
    t0 = time.monotonic()
    _wait_for(lambda: gate.held_back == 1)
    prompt = [_Call(gate, Caller(f"ipv4:10.0.0.{i}:1", f"10.0.0.{i}")) for i in (2, 3)]
    assert all(c.admitted.wait(5) for c in prompt)  # the half kept free for prompt connections
    third.join(10)
    assert third.outcome == "Overloaded" and time.monotonic() - t0 >= 0.25
    assert gate.refusals == 1
    for c in first + prompt:
        assert c.finish() == "ok"


def test_only_a_stalled_upload_is_cut_for_another_caller_and_a_cut_connection_counts_as_stalling(monkeypatch):
    """``UploadWatch.evict_for`` cuts an upload only once it has received nothing for ``STALL_S``: a body on its
    way (a prompt client's, a fresh call) is never cut. The connection of an upload that was cut counts as
    stalling for ``CUT_MEMORY_S`` (``UploadWatch.stalled``), so a slow-loris whose calls are cut faster than
    they can stall still ranks behind prompt callers and fills only half the places."""
    from advantage_server import shares, uploads

    class Ctx:
        def __init__(self, peer):
            self._peer, self.cancelled = peer, False

        def peer(self):
            return self._peer

        def cancel(self):
            self.cancelled = True

    watch = uploads.UploadWatch(timeout=30.0, per_peer=8, per_connection=8)
    try:
        stalls = [Ctx("ipv4:10.0.0.9:7") for _ in range(3)]
        # fresh however long this thread is descheduled (beside a busy loop it once slept past STALL_S here): a
        # minute's threshold while they are entered and looked at, then the real one
        with monkeypatch.context() as fresh:
            fresh.setattr(uploads, "STALL_S", 60.0)
            held = [watch.watch(c) for c in stalls]
            for h in held:
                h.__enter__()
        newcomer = Ctx("ipv4:10.0.0.2:1")
        assert not watch.evict_for(newcomer)  # fresh: perhaps bodies on their way
        assert watch.stalled() == ({}, {})
        assert len(watch._watched) == 3
        for entry in watch._watched.values():
            entry.stall_after = shares.STALL_S
        monkeypatch.setattr(uploads, "STALLED_CACHE_S", 0.0)
        time.sleep(shares.STALL_S + 0.05)
        hosts, conns = watch.stalled()
        assert conns == {"ipv4:10.0.0.9:7": 3} and hosts == {"ipv4:10.0.0.9": 3}
        assert watch.evict_for(newcomer) and watch.evictions == 1
        assert sum(c.cancelled for c in stalls) == 1
        for h, c in zip(held, stalls):
            if c.cancelled:
                with pytest.raises(uploads.UploadCut):
                    h.__exit__(None, None, None)
            else:
                h.__exit__(None, None, None)
        # no upload left, but the cut connection still counts as stalling (CUT_MEMORY_S), and only it
        hosts, conns = watch.stalled()
        assert conns == {"ipv4:10.0.0.9:7": 1} and "ipv4:10.0.0.2:1" not in conns
        monkeypatch.setattr(shares, "CUT_MEMORY_S", 0.0)
        monkeypatch.setattr(uploads, "CUT_MEMORY_S", 0.0)
        time.sleep(0.01)
        assert watch.stalled() == ({}, {})
    finally:
        watch.stop()


def test_a_prompt_waiting_caller_cuts_a_holder_that_stalls_while_it_waits(long_wait):
    """A caller that came while every place was held by calls too fresh to count as stalled waits, and looks
    again every ``EVICT_RETRY_S``: once the holders have stalled, its ``make_room`` succeeds and it gets in
    (before: it tried once on arrival, then waited the whole ``ADMISSION_WAIT_S`` and was refused)."""
    gate, _ = _gate(places=1, waiting=4)
    holder = _Call(gate, Caller("ipv4:10.0.0.9:7", "10.0.0.9"))
    assert holder.admitted.wait(5)
    tries = []

    def make_room(held=False):  # the holder counts as stalled from the third look on: its place is lent to the caller
        tries.append(time.monotonic())
        if len(tries) >= 3:
            gate.lend()
    caller = _Call(gate, Caller("ipv4:10.0.0.2:1", "10.0.0.2"), make_room=make_room)
    assert caller.admitted.wait(5)
    assert len(tries) == 3 and tries[2] - tries[0] >= 2 * admission.EVICT_RETRY_S * 0.9
    assert caller.finish() == "ok"
    gate.repay()  # the cut holder's place comes back
    assert holder.finish() == "ok"
    assert gate.in_flight == 0


def test_a_caller_that_leaves_the_room_to_cut_keeps_its_arrival_rank(long_wait):
    """A prompt caller leaves the room every ``EVICT_RETRY_S`` to look for a stalled upload to cut
    (``make_room``) and comes back; it keeps the arrival time of its first entry, so a caller of equal rank that
    came after it is not served first (before: each return made it a newcomer, and the later caller took the
    freed place; in a full room it would have been the one dropped)."""
    gate, _ = _gate(places=1, waiting=4)
    holder = _Call(gate, Caller("ipv4:10.0.0.3:1", "10.0.0.3"))
    assert holder.admitted.wait(5)
    tries: list[float] = []
    first = _Call(gate, Caller("ipv4:10.0.0.2:1", "10.0.0.2"), make_room=lambda held=False: tries.append(time.monotonic()))
    _wait_for(lambda: gate.waiting == 1)
    later = _Call(gate, Caller("ipv4:10.0.0.4:1", "10.0.0.4"), make_room=None)  # waits without looking to cut
    _wait_for(lambda: gate.waiting == 2)
    seen = len(tries)
    _wait_for(lambda: len(tries) >= seen + 2)  # `first` has left and re-entered the room since `later` came
    holder.finish()
    assert first.admitted.wait(5)
    assert not later.admitted.is_set()
    assert first.finish() == "ok"
    assert later.admitted.wait(5) and later.finish() == "ok"


def test_a_held_back_caller_gets_a_free_place_once_its_connection_stops_stalling(monkeypatch):
    """A call held below ``STALLED_FILL`` while its connection stalls takes one of the free places within a poll
    (``WAITER_POLL_S``) of its connection's stalled upload ending, without waiting for another call to free one
    (before: it waited for a hand-off that never came while the places stayed free, and was refused after
    ``STALLED_WAIT_S``)."""
    monkeypatch.setattr(admission, "STALLED_WAIT_S", 20.0)
    gate, stalled = _gate(places=2, waiting=4)
    holder = _Call(gate, Caller("ipv4:10.0.0.3:1", "10.0.0.3"))  # one place of two taken: the staller's half
    assert holder.admitted.wait(5)
    staller = Caller("ipv4:10.0.0.9:7", "10.0.0.9")
    stalled.hosts, stalled.conns = {"10.0.0.9": 1}, {staller.connection: 1}
    held = _Call(gate, staller)
    _wait_for(lambda: gate.held_back == 1 and gate.waiting == 1)
    time.sleep(3 * admission.WAITER_POLL_S)
    assert not held.admitted.is_set()  # held back while its connection stalls
    t0 = time.monotonic()
    stalled.hosts, stalled.conns = {}, {}  # its stalled upload finished (or was cut long ago)
    assert held.admitted.wait(5)
    assert time.monotonic() - t0 < 1.0
    assert held.finish() == "ok" and holder.finish() == "ok"


def test_a_stream_arriving_fast_in_large_chunks_is_not_stalled_between_its_chunks(monkeypatch):
    """``shares.stall_after``: gRPC hands a stream chunk over only once all of it has arrived, so a 4 MiB chunk on a
    20 MiB/s link reads as no bytes for 0.2 s. Such an upload counts as stalled only after twice its last chunk's
    time without the next (at most ``STALL_MAX_S``); a trickle of small chunks, or silence, after ``STALL_S``.
    Before: every upload after ``STALL_S`` (0.1 s), so a client on a link slower than 40 MiB/s was ranked last,
    held to half the places and cuttable while its body was on its way."""
    from advantage_server import shares, uploads
    assert shares.stall_after(4 << 20, 0.2) == pytest.approx(0.4)          # 20 MiB/s: 2 x 0.2 s
    assert shares.stall_after(4 << 20, 0.02) == shares.STALL_S              # 200 MiB/s: never below STALL_S
    assert shares.stall_after(64 << 20, 3.0) == shares.STALL_MAX_S          # 21 MiB/s, 3 s a chunk: capped at 1 s
    assert shares.stall_after(64, 1.0) == shares.STALL_S                    # a trickle: no grace
    assert shares.stall_after(4 << 20, 2.0) == shares.STALL_S               # 2 MiB/s: slower than STALL_FAST_RATE
    assert shares.stall_after(0, 0.5) == shares.STALL_S

    clock = [100.0]
    monkeypatch.setattr(uploads, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))  # this module's clock

    class Ctx:
        def peer(self):
            return "ipv4:10.0.0.1:5"
    watch = uploads.UploadWatch(timeout=300.0)
    watch._thread = threading.Thread()  # no watch thread: this test moves the clock itself
    with watch.watch(Ctx()) as touch:
        clock[0] += 0.2
        touch(4 << 20)  # its first chunk, 0.2 s after admission
        clock[0] += 0.15
        assert watch.stalled()[1] == {}  # before: stalled from 0.1 s on
        clock[0] += 0.3  # 0.45 s after the chunk: past 2 x 0.2 s
        assert watch.stalled()[1] == {"ipv4:10.0.0.1:5": 1}
        touch(64)  # a small chunk: back to STALL_S
        clock[0] += 0.11
        assert watch.stalled()[1] == {"ipv4:10.0.0.1:5": 1}


def test_a_prompt_neighbour_of_a_staller_ranks_by_arrival_with_other_hosts():
    """A connection that holds no stalled upload is not charged for its host's stalled uploads (another
    connection's doing): it ranks with every other prompt connection by arrival, before every stalling one.
    Before, it ranked after every other host's prompt calls (pinned bench: the same-host neighbour of a
    slow-loris kept 84% of its goodput, another host 92%)."""
    from advantage_server.shares import wait_rank
    hosts, conns = {"10.0.0.1": 5, "10.0.0.3": 1}, {"10.0.0.1:1": 5, "10.0.0.3:1": 1}
    neighbour = wait_rank(hosts, conns, "10.0.0.1:2", "10.0.0.1", 1.0)
    other_host = wait_rank(hosts, conns, "10.0.0.2:1", "10.0.0.2", 2.0)
    staller = wait_rank(hosts, conns, "10.0.0.1:1", "10.0.0.1", 0.0)
    small_staller = wait_rank(hosts, conns, "10.0.0.3:1", "10.0.0.3", 0.5)
    assert sorted([staller, other_host, small_staller, neighbour]) == [neighbour, other_host, small_staller, staller]


def test_a_newcomer_that_reads_early_takes_the_full_rooms_place_of_the_longest_unsent_body(monkeypatch):
    """Issue #35 item 2, a slow-loris with a fresh connection per silent call that also fills the waiting room: a new
    connection of its host ranks with the silent ones (each answers for the host's stalls,
    :class:`~advantage_server.shares.InheritedStalls`) and comes after them, so the full room dropped it before its
    body could arrive and show it prompt (measured at C=4 beside 20 such connections: 1 new client of 20 served, 0
    beside 40). Now a newcomer that would read its body early takes the place of the waiter whose early read has gone
    longest without its body, among those ranked with or after it; a newcomer that cannot read early (a streamed
    upload) is refused at once as before, and so is a reader when no such waiter is reading. None of them cut
    anything before their body arrived (``make_room``)."""
    from advantage_server.shares import InheritedStalls

    monkeypatch.setattr(admission, "STALLED_WAIT_S", 20.0)
    gate = RequestGate(4, 4, max_waiting=2)  # stalled_cap 2: the host's connections are held below it
    holders = [_Call(gate, Caller(f"ipv4:10.0.0.3:{i}", "10.0.0.3")) for i in range(4)]
    assert all(h.admitted.wait(5) for h in holders)
    stalls = InheritedStalls({"ipv4:10.0.0.9:1": 1}, {"10.0.0.9": 1}, lambda c: False, lambda c: c.split(":")[1])
    gate.stalled = lambda: ({"10.0.0.9": 1}, stalls)
    started, cuts = [], []

    def reader(port: int, unsent: float | None) -> Caller:
        return Caller(f"ipv4:10.0.0.9:{port}", "10.0.0.9", read_early=lambda: started.append(port),
                      reading_for=lambda: unsent)
    make_room = lambda held=False: cuts.append(held)  # noqa: E731
    old = _Call(gate, reader(2, 3.0), make_room)  # its body awaited 3 s
    _wait_for(lambda: gate.waiting == 1)
    young = _Call(gate, reader(3, 0.2), make_room)
    _wait_for(lambda: gate.waiting == 2)
    assert started == [2, 3]  # each reads once it has its place in the room
    newcomer = _Call(gate, reader(4, None), make_room)  # ranks last: takes the place of the 3 s reader
    old.join(5)
    assert old.outcome == "Overloaded" and gate.dropped == 1 and gate.waiting == 2 and started == [2, 3, 4]
    streamed = _Call(gate, Caller("ipv4:10.0.0.9:5", "10.0.0.9"), make_room)  # cannot read early: refused at once
    streamed.join(5)
    assert streamed.outcome == "Overloaded" and gate.dropped == 1 and gate.waiting == 2
    assert cuts == [False]  # only the streamed call tried to take a place back; the readers wait for their bodies

    gate2 = RequestGate(4, 4, max_waiting=1)  # a full room whose waiter is not reading: the reader is refused
    holders += [_Call(gate2, Caller(f"ipv4:10.0.0.3:{i}", "10.0.0.3")) for i in range(4)]
    assert all(h.admitted.wait(5) for h in holders)
    gate2.stalled = lambda: ({"10.0.0.9": 1}, stalls)
    done_reading = _Call(gate2, reader(6, None))
    _wait_for(lambda: gate2.waiting == 1)
    late = _Call(gate2, reader(7, None))
    late.join(5)
    assert late.outcome == "Overloaded" and gate2.waiting == 1 and not done_reading.outcome

    # never the room of a reader ranked before the newcomer: here one of a host holding fewer stalled uploads
    gate3 = RequestGate(4, 4, max_waiting=1)
    holders += [_Call(gate3, Caller(f"ipv4:10.0.0.3:{i}", "10.0.0.3")) for i in range(4)]
    assert all(h.admitted.wait(5) for h in holders)
    two_hosts = InheritedStalls({"ipv4:10.0.0.9:1": 2, "ipv4:10.0.0.8:1": 1}, {"10.0.0.9": 2, "10.0.0.8": 1},
                                lambda c: False, lambda c: c.split(":")[1])
    gate3.stalled = lambda: ({"10.0.0.9": 2, "10.0.0.8": 1}, two_hosts)
    better = _Call(gate3, Caller("ipv4:10.0.0.8:2", "10.0.0.8", read_early=lambda: None, reading_for=lambda: 5.0))
    _wait_for(lambda: gate3.waiting == 1)
    worse = _Call(gate3, reader(8, None))  # host 10.0.0.9 holds more stalled uploads: ranks after, takes nothing
    worse.join(5)
    assert worse.outcome == "Overloaded" and gate3.dropped == 0 and not better.outcome
    for g in (gate, gate2, gate3):
        g.start_draining()
    for call in (young, newcomer, done_reading, better):
        call.join(5)
        assert call.outcome == "Draining"
    for h in holders:
        h.finish()


def test_an_early_body_gives_the_message_once_and_raises_what_its_read_raised():
    """:class:`advantage_server.uploads.EarlyBody`, the body a waiting call reads while it waits: not started, it reads
    from the request iterator as the call would; started, it reads in its own thread, calls ``on_arrival`` once the
    message is there, gives it once, and raises what the read raised (the call ended: ``StopIteration`` or gRPC's
    error) in the call's thread, without the read's traceback; :meth:`drop` lets a message go unread."""
    from advantage_server.uploads import EarlyBody

    arrived = []
    untouched = EarlyBody(iter([b"abc"]), lambda: arrived.append(1))
    assert next(untouched) == b"abc" and arrived == []  # never started: a plain read, no arrival

    gate = threading.Event()

    def slow():
        gate.wait(10)
        yield b"body"
    early = EarlyBody(slow(), lambda: arrived.append(2))
    early.start()
    early.start()  # once
    time.sleep(0.05)
    assert arrived == []  # nothing yet: its read waits for the message
    gate.set()
    assert next(early) == b"body" and arrived == [2]
    with pytest.raises(StopIteration):
        next(early)  # given once

    class Ended(Exception):
        pass

    def ended():
        raise Ended("the call ended")
        yield  # noqa: unreachable - a generator
    failed = EarlyBody(ended(), lambda: arrived.append(3))
    failed.start()
    with pytest.raises(Ended) as err:
        next(failed)
    assert arrived == [2]  # no arrival for a read that failed
    frames, tb = [], err.value.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert "__next__" in frames and "_read" not in frames and "ended" not in frames, frames  # the read's frames let go

    dropped = EarlyBody(iter([b"x" * 100]), lambda: None)
    dropped.start()
    dropped._thread.join(5)
    dropped.drop()
    with pytest.raises(StopIteration):
        next(dropped)


def _chunk(data: bytes, total: int = 0) -> bytes:
    from advantage_client._proto.advantage.v1 import advantage_pb2 as pb
    return pb.ComputeAdvantageChunk(total_size=total, data=data).SerializeToString()


def test_an_early_stream_is_proven_only_by_its_whole_stream_or_its_first_cap_bytes():
    """:class:`advantage_server.uploads.EarlyStream`, a waiting stream read early (issue #35 item 2): the proof is a
    stream half-closed after data adding up to the ``total_size`` its first chunk declared (more than 0), or, for a
    stream too large to wait for whole, its first ``cap`` bytes; ``on_proof`` runs once. A first chunk alone, a
    stream that ends short of its declared size, an empty one, one that ends in an error and one let go
    (:meth:`drop`) prove nothing. The chunks are given once, in order, whatever thread read them; not started, it
    reads as the call would."""
    from advantage_server.uploads import EarlyStream

    proofs = []
    untouched = EarlyStream(iter([_chunk(b"ab", 2)]), lambda: proofs.append("untouched"))
    assert next(untouched) == _chunk(b"ab", 2) and proofs == [] and not untouched.proven
    untouched.start()  # a stream the call has begun to read itself is never read early
    assert untouched._thread is None

    def stream(chunks, hold: threading.Event | None = None, end: BaseException | None = None):
        yield from chunks
        if hold is not None:
            hold.wait(10)
        if end is not None:
            raise end

    def read(early: EarlyStream, name: str) -> list[bytes]:
        early.start()
        early.start()  # once
        early._thread.join(5) if early._thread is not None else None
        return [name]

    whole = [_chunk(b"abc", 6), _chunk(b"def")]
    early = EarlyStream(stream(whole), lambda: proofs.append("whole"), cap=1 << 20)
    read(early, "whole")
    assert early.proven and early.whole and proofs == ["whole"] and early.reading_for() is None
    assert list(early) == whole  # given once, in order

    cases = {"short": [_chunk(b"abc", 6)],  # half-closed after 3 of 6 declared bytes
             "empty": [_chunk(b"", 0)],  # declares and sends nothing
             "over": [_chunk(b"abc", 2)]}  # more than it declared: malformed
    for name, chunks in cases.items():
        early = EarlyStream(stream(chunks), lambda name=name: proofs.append(name), cap=1 << 20)
        read(early, name)
        assert not early.proven and list(early) == chunks, name
    assert proofs == ["whole"]

    class Ended(Exception):
        pass
    failed = EarlyStream(stream(whole, end=Ended("the call ended")), lambda: proofs.append("failed"), cap=1 << 20)
    read(failed, "failed")
    assert not failed.proven and next(failed) == whole[0] and next(failed) == whole[1]
    with pytest.raises(Ended):
        next(failed)

    hold = threading.Event()  # a first chunk, then nothing: never proven while it waits, however long
    trickle = EarlyStream(stream([_chunk(b"x" * 16, 1 << 20)], hold), lambda: proofs.append("trickle"), cap=1 << 20)
    trickle.start()
    _wait_for(lambda: len(trickle._queue) == 1)
    assert not trickle.proven and trickle.reading_for() is not None
    trickle.drop()  # refused: the chunks read go, and the read ends without a proof
    hold.set()
    trickle._thread.join(5)
    assert not trickle.proven and proofs == ["whole"] and trickle._queued == 0

    big = [_chunk(b"y" * 600, 4000)] + [_chunk(b"z" * 600) for _ in range(5)]  # 3,600 of 4,000 declared, then held
    hold = threading.Event()
    large = EarlyStream(stream(big, hold), lambda: proofs.append("large"), cap=1000)
    large.start()
    _wait_for(lambda: large.proven)
    assert proofs == ["whole", "large"] and large._queued < 1000 + len(big[1])  # it stopped reading at the cap
    assert not large.whole  # proven for its rank, not whole: it fills no further than its host may
    assert next(large) == big[0]  # the handler reads now: the thread reads on, one chunk ahead at most
    hold.set()
    assert list(large) == big[1:] and proofs == ["whole", "large"]  # proven once


def test_an_early_streams_lag_credits_its_bytes_after_the_first_chunk_and_not_through_silence():
    """The full waiting room drops the early reader furthest behind (``reading_for``): for a stream, how far it is
    behind ``rate`` (the seconds since its read began less its bytes *after the first chunk* at ``rate``, never below
    0) plus the seconds since its last chunk. A slow-loris's one large first chunk earns nothing (measured: 64 KiB
    first chunks put its waiters ahead of a newcomer whose read had just begun, 8 of 10 new streams refused); a burst
    then silence falls behind as it stays silent (one 1 MiB burst kept a waiter ahead for a second: 1 of 10 new 16 MiB
    streams served); a stream whose chunks do not fit its declared size is read no further and is dropped first."""
    from advantage_server.uploads import EarlyStream

    hold = threading.Event()

    def stream(chunks):
        yield from chunks
        hold.wait(10)
    first_only = EarlyStream(stream([_chunk(b"x" * (64 << 10), 1 << 30)]), lambda: None, cap=1 << 30, rate=1 << 20)
    burst = EarlyStream(stream([_chunk(b"x" * 16, 1 << 30)] + [_chunk(b"x" * (512 << 10))] * 4), lambda: None,
                        cap=1 << 30, rate=1 << 20)
    junk = EarlyStream(stream([_chunk(b"x" * 1024, 1)] + [_chunk(b"y" * 1024)] * 8), lambda: None, cap=1 << 30)
    for e in (first_only, burst, junk):
        e.start()
    _wait_for(lambda: first_only._queued > 0 and burst._queued > 2 << 20 and junk._queued > 0)
    time.sleep(0.3)
    assert first_only.reading_for() >= 0.3  # its 64 KiB first chunk is not credited
    assert 0.25 <= burst.reading_for() < first_only.reading_for()  # 2 MiB of credit, but silent since
    assert junk.reading_for() == float("inf") and len(junk._queue) == 1  # read no further than its first chunk
    assert not junk.proven
    hold.set()


def test_a_waiting_call_whose_body_showed_itself_ranks_and_fills_as_a_prompt_callers():
    """A call that answers for its stalling host (:class:`~advantage_server.shares.InheritedStalls`) waits below
    ``stalled_cap`` and behind prompt callers; once its own body has shown itself while it waited
    (:attr:`Caller.proven`: a stream read early, its first 16 MiB) it ranks with prompt callers, by arrival, and tries
    to take a place back, but still fills no further than its host may (16 MiB and then silence let a slow-loris hold
    3-4 of 4 places: a fresh-eyes review); once it arrived whole (``Caller.whole``) it takes a place past
    ``stalled_cap``. For this call only: the next call of its connection answers for its host again."""
    from advantage_server.shares import InheritedStalls

    gate = RequestGate(4, 4, max_waiting=4)
    stalls = InheritedStalls({"ipv4:10.0.0.9:1": 1}, {"10.0.0.9": 1}, lambda c: False, lambda c: c.split(":")[1])
    gate.stalled = lambda: ({"10.0.0.9": 1}, stalls)
    held = [_Call(gate, Caller(f"ipv4:10.0.0.9:{i}", "10.0.0.9")) for i in (10, 11)]  # up to stalled_cap: 2
    assert all(h.admitted.wait(5) for h in held)
    shown, whole, cuts = threading.Event(), threading.Event(), []
    proven = _Call(gate, Caller("ipv4:10.0.0.9:20", "10.0.0.9", read_early=lambda: None, proven=shown.is_set,
                                whole=whole.is_set), make_room=lambda held=False: cuts.append(held))
    _wait_for(lambda: gate.waiting == 1)
    assert not proven.admitted.is_set()  # held below stalled_cap while it is unproven
    shown.set()  # its first 16 MiB came: it ranks first and tries to take a place back, but fills no further
    gate.poke("ipv4:10.0.0.9:20")
    _wait_for(lambda: cuts)
    assert cuts[0] is True and not proven.admitted.is_set()  # held below stalled_cap: make_room(held=True)
    whole.set()  # the whole stream came: it fills as a prompt caller's
    gate.poke("ipv4:10.0.0.9:20")
    assert proven.admitted.wait(5)  # a third place: past stalled_cap
    assert gate._cap(Caller("ipv4:10.0.0.9:20", "10.0.0.9")) == gate.stalled_cap  # its connection's next call
    hosts, conns = gate.stalled()
    ranked = gate._ranked([admission._Waiter(Caller("ipv4:10.0.0.9:30", "10.0.0.9"), gate._lock, 0.0),
                           admission._Waiter(Caller("ipv4:10.0.0.9:31", "10.0.0.9", proven=lambda: True),
                                             gate._lock, 1.0),
                           admission._Waiter(Caller("ipv4:10.0.0.7:1", "10.0.0.7"), gate._lock, 2.0)])
    assert [w.caller.connection for w in ranked] == ["ipv4:10.0.0.9:31", "ipv4:10.0.0.7:1", "ipv4:10.0.0.9:30"]
    for call in (*held, proven):
        assert call.finish() == "ok"


def test_a_host_counts_as_stalling_for_a_second_after_its_last_stalled_upload(monkeypatch):
    """A slow-loris whose calls trickle in step holds no upload silent for ``STALL_S`` just after each step; its fresh
    connections then ranked as prompt callers' and a new client of its host, last among equals, was refused at once
    (10 of 10 in a burst just after a step). :meth:`UploadWatch.recently_stalled` remembers a host for
    ``HOST_STALL_MEMORY_S`` after :meth:`UploadWatch.stalled` last counted a stalled upload of it, and
    :class:`~advantage_server.shares.InheritedStalls` treats such a host as stalling."""
    from advantage_server import shares, uploads
    from advantage_server.shares import InheritedStalls
    from advantage_server.uploads import UploadWatch

    clock = [100.0]
    monkeypatch.setattr(uploads.time, "monotonic", lambda: clock[0])
    watch = UploadWatch(timeout=30.0)
    ctx = types.SimpleNamespace(peer=lambda: "ipv4:10.0.0.9:1")
    with watch.watch(ctx) as touch:
        clock[0] += shares.STALL_S + 0.01
        assert watch.stalled()[0] == {"ipv4:10.0.0.9": 1}
        touch(16)  # a step: no longer stalled
        clock[0] += 0.01
        assert watch.stalled()[0] == {} and watch.recently_stalled() == {"ipv4:10.0.0.9"}
    clock[0] += shares.HOST_STALL_MEMORY_S - 0.02  # the last count of a stalled upload was 0.01 s before the step
    assert watch.recently_stalled() == {"ipv4:10.0.0.9"}
    clock[0] += 0.02
    assert watch.recently_stalled() == frozenset()

    host_of = lambda c: c.rsplit(":", 1)[0]  # noqa: E731
    recent = InheritedStalls({}, {}, lambda c: False, host_of, frozenset({"ipv4:10.0.0.9"}))
    assert recent.get("ipv4:10.0.0.9:2") == 1 and recent.get("ipv4:10.0.0.8:2") == 0
    assert InheritedStalls({}, {}, lambda c: True, host_of, frozenset({"ipv4:10.0.0.9"})).get("ipv4:10.0.0.9:2") == 0


def test_a_body_that_arrives_after_its_call_was_refused_gives_its_connection_no_record():
    """A waiting unary call reads its body early (:class:`advantage_server.uploads.EarlyBody`); once the call was
    refused (``drop``), a body arriving later proves nothing: before, it still gave its connection a record of its
    own (``on_arrival``), so a caller could send its bodies after the refusals and be judged by a clean record."""
    from advantage_server.uploads import EarlyBody

    arrived, hold = [], threading.Event()

    def late():
        hold.wait(10)
        yield b"body"
    early = EarlyBody(late(), lambda: arrived.append(1))
    early.start()
    early.drop()
    hold.set()
    early._thread.join(5)
    assert arrived == []
    early.start()  # refused: no second read either
    assert arrived == []
