"""The volunteer's protocol state machine (client/session.py), driven with real wire messages and a
clock that is only the numbers passed in: no socket, no event loop, no waiting."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from cleave.client.credentials import Credential as StoredCredential
from cleave.client.session import (
    SILENCE_FACTOR,
    Credited,
    Ended,
    Enrolled,
    ErrorReceived,
    HangUp,
    Session,
    Sleeping,
    TileQueued,
    Welcomed,
    Woken,
)
from cleave.wire import auth
from cleave.wire.codes import CloseCode, Code, ReleaseWhy, StandbyWhy
from cleave.wire.errors import Banned, Refused
from cleave.wire.messages import (
    DEFAULT_HEARTBEAT,
    Block,
    Cancel,
    Challenge,
    Credential,
    Credit,
    Error,
    Finished,
    Heartbeat,
    Hello,
    Message,
    Pause,
    Release,
    Result,
    ResultBatch,
    Resume,
    Standby,
    Wake,
    Welcome,
    Work,
    WorkBatch,
    decode,
    encode,
)

NONCE = "5e" * auth.NONCE_BYTES
COORDINATOR = "4ad726207a9beb99"
SECRET = bytes(range(auth.SECRET_BYTES))
HELLO = Hello(name="laptop", platform="Linux", cores=4, device="cpu", gflops=12.5, slots=2, client_version="0.1.0")
A = torch.arange(12, dtype=torch.float32).reshape(4, 3)
B = torch.arange(15, dtype=torch.float32).reshape(3, 5)


def sent(session: Session) -> list[Message]:
    """What the session gave the runner to send, as the coordinator would decode it."""
    out = []
    for msg in session.messages_to_send():
        back = decode(encode(msg))
        if not isinstance(msg, Result):  # (tensors do not compare with ==)
            assert back == msg
        out.append(back)
    return out


def challenge(session: Session, now: float = 0.0) -> Hello:
    assert session.receive_frame(encode(Challenge(NONCE, COORDINATOR)), now) == []
    [hello] = sent(session)
    assert isinstance(hello, Hello)
    return hello


def welcome(heartbeat: float = DEFAULT_HEARTBEAT) -> bytes:
    return encode(Welcome(device_id=3, identity=7, job="tiny, 4 steps", slots=2, heartbeat=heartbeat))


def connected(now: float = 0.0, **kwargs: object) -> Session:
    """A session that enrolled and was welcomed at ``now``."""
    session = Session(HELLO, now=now, token="join-token", **kwargs)  # type: ignore[arg-type]
    challenge(session, now)
    session.receive_frame(welcome(), now)
    return session


def work(tile_id: int, *, blocks: bool = True, **kwargs: object) -> bytes:
    """Tile ``tile_id``: A @ B, carrying both blocks unless ``blocks`` is false."""
    carried = (Block("1.a", A), Block("1.b", B)) if blocks else ()
    return encode(Work(tile_id=tile_id, a="1.a", b="1.b", blocks=carried, **kwargs))  # type: ignore[arg-type]


def compute(session: Session, now: float) -> Result | None:
    """The runner's part: the next tile's product, answered at ``now``."""
    queued = session.pop()
    assert queued is not None
    tile = session.start(queued, now)
    return None if tile is None else session.computed(tile, tile.a @ tile.b, 0.25)


# --------------------------------------------------------------------------- the challenge


def test_a_stored_credential_answers_the_challenge_with_a_proof_and_no_token() -> None:
    asked: list[str] = []

    def lookup(coordinator: str) -> StoredCredential:
        asked.append(coordinator)
        return StoredCredential(7, SECRET)

    session = Session(HELLO, now=0.0, token="join-token", credential=lookup)
    hello = challenge(session)
    assert asked == [COORDINATOR] and session.coordinator == COORDINATOR and not session.enrolling
    assert hello.identity == 7 and hello.token == "" and hello.name == "laptop" and hello.gflops == 12.5
    assert auth.verify_proof(auth.stored_key(SECRET), 7, bytes.fromhex(NONCE), bytes.fromhex(hello.proof))


def test_without_a_credential_the_join_token_enrols_and_the_credential_is_handed_over() -> None:
    session = Session(HELLO, now=0.0, token="join-token")
    hello = challenge(session)
    assert session.enrolling and hello.token == "join-token" and hello.identity == 0 and hello.proof == ""
    events = session.receive_frame(encode(Credential(identity=9, secret=SECRET.hex())), 0.1)
    assert events == [Enrolled(COORDINATOR, 9, SECRET)]


def test_neither_a_credential_nor_a_token_is_refused_naming_the_credentials_file() -> None:
    session = Session(HELLO, now=0.0, credentials_file="/home/owner/.config/cleave/credentials.json")
    with pytest.raises(Refused, match="no credential for this coordinator under the name 'laptop' in /home/owner"):
        session.receive_frame(encode(Challenge(NONCE, COORDINATOR)), 0.0)
    assert sent(session) == []


def test_a_device_still_paused_from_before_says_so_in_its_hello() -> None:
    session = Session(HELLO, now=0.0, token="join-token", paused="on battery")
    assert challenge(session).paused == "on battery"


@pytest.mark.parametrize(
    "first, outcome",
    [
        (welcome(), "did not start with a challenge"),
        (Challenge("5e" * 8, COORDINATOR), "did not start with a challenge"),  # a short nonce (decoded anyway)
        (b"CLV\x04garbage", "first frame was not understood"),
    ],
    ids=["welcome", "short nonce", "garbage"],
)
def test_a_first_frame_that_is_not_a_challenge_ends_the_session(first: bytes | Challenge, outcome: str) -> None:
    session = Session(HELLO, now=0.0, token="join-token")
    events = session.receive(first, 0.0) if isinstance(first, Challenge) else session.receive_frame(first, 0.0)
    [ended] = events
    assert isinstance(ended, Ended) and outcome in ended.outcome and session.ended == ended.outcome
    assert sent(session) == []


# --------------------------------------------------------------------------- heartbeats


def test_the_welcome_sets_the_heartbeat_interval_and_heartbeats_keep_it() -> None:
    session = Session(HELLO, now=100.0, token="join-token")
    assert session.tick(200.0, 1.7e9) == [] and sent(session) == []  # nothing before the hello
    challenge(session, 100.0)
    assert session.next_beat == 100.0 + DEFAULT_HEARTBEAT
    [welcomed] = session.receive_frame(welcome(heartbeat=0.5), 100.2)
    assert welcomed == Welcomed(device_id=3, identity=7, job="tiny, 4 steps", heartbeat=0.5)
    assert session.interval == 0.5 and session.next_beat == pytest.approx(100.7)
    assert session.tick(100.6, 1.7e9) == [] and sent(session) == []  # not due yet
    assert session.tick(100.7, 1.7e9 + 0.5) == []
    assert sent(session) == [Heartbeat(sent_at=1.7e9 + 0.5)]  # stamped with the wall time passed in
    assert session.next_beat == pytest.approx(101.2)


@pytest.mark.parametrize("asked, kept", [(0.01, 0.1), (3600.0, 60.0)])
def test_a_heartbeat_interval_out_of_range_is_clamped(asked: float, kept: float) -> None:
    session = Session(HELLO, now=0.0, token="join-token")
    challenge(session)
    [welcomed] = session.receive_frame(welcome(heartbeat=asked), 0.0)
    assert isinstance(welcomed, Welcomed) and welcomed.heartbeat == kept == session.interval


def test_a_coordinator_silent_for_silence_factor_heartbeats_is_hung_up_on() -> None:
    session = connected(now=0.0)
    beats = 0
    for k in range(1, SILENCE_FACTOR + 1):  # heartbeats at 2, 4 ... 30 s: silent, but not yet too long
        assert session.tick(k * DEFAULT_HEARTBEAT, 0.0) == []
        beats += len(sent(session))
    assert beats == SILENCE_FACTOR
    [hangup] = session.tick((SILENCE_FACTOR + 1) * DEFAULT_HEARTBEAT, 0.0)
    assert hangup == HangUp(CloseCode.GOING_AWAY, "coordinator silent", (SILENCE_FACTOR + 1) * DEFAULT_HEARTBEAT)
    assert sent(session) == [] and session.tick(1e6, 0.0) == []  # once


def test_any_frame_from_the_coordinator_counts_as_hearing_from_it() -> None:
    session = connected(now=0.0)
    session.receive_frame(encode(Heartbeat(sent_at=1.0)), 20.0)
    session.receive_frame(b"not a frame", 40.0)  # even one that does not decode
    for t in range(2, 72, 2):  # 40 + 30 s of silence at most
        assert session.tick(float(t), 0.0) == []
    assert isinstance(session.tick(72.0, 0.0)[0], HangUp)


# --------------------------------------------------------------------------- blocks and tiles


def test_blocks_are_cached_reused_and_forgotten_by_namespace() -> None:
    session = connected()
    [queued] = session.receive_frame(work(1, blocks=True), 1.0)
    assert queued == TileQueued(1) and session.queued == 1 and session.held == {1}
    assert set(session.blocks) == {"1.a", "1.b"}
    result = compute(session, 1.0)
    assert result is not None and torch.equal(result.c, A @ B)
    session.receive_frame(work(2, blocks=False), 2.0)  # the cached blocks serve it
    result = compute(session, 2.0)
    assert result is not None and result.tile_id == 2 and torch.equal(result.c, A @ B)
    other = encode(Work(tile_id=3, a="2.x", b="1.b", blocks=(Block("2.x", A),), forget=(1,)))
    session.receive_frame(other, 3.0)
    assert set(session.blocks) == {"2.x"}  # namespace 1 forgotten, before its blocks are read
    assert compute(session, 3.0) is None
    assert sent(session) == [Release((3,), ReleaseWhy.MISSING_BLOCK)]


def test_blocks_are_placed_by_the_runner() -> None:
    placed: list[tuple[int, ...]] = []

    def place(t: torch.Tensor) -> torch.Tensor:
        placed.append(tuple(t.shape))
        return t.double()

    session = connected(place=place)
    session.receive_frame(work(1), 1.0)
    assert placed == [(4, 3), (3, 5)] and session.blocks["1.a"].dtype == torch.float64


def test_results_carry_the_product_its_seconds_and_the_wait_measured_on_the_clock_passed_in() -> None:
    session = connected()
    session.receive_frame(work(5), 10.0)
    queued = session.pop()
    assert queued is not None and queued.ready == 10.0 and session.pop() is None
    tile = session.start(queued, 12.5)
    assert tile is not None and tile.waited == 2.5 and tile.flops == 2.0 * 4 * 3 * 5
    result = session.computed(tile, tile.a @ tile.b, 0.25)
    assert result is not None and session.held == frozenset()
    back = decode(encode(result))
    assert isinstance(back, Result) and (back.tile_id, back.seconds, back.waited) == (5, 0.25, 2.5)
    assert torch.equal(back.c, A @ B)


def test_an_emulated_link_says_when_a_work_frame_is_usable() -> None:
    sizes: list[int] = []

    def arrival(nbytes: int) -> float:
        sizes.append(nbytes)
        return 11.0

    session = connected(arrival=arrival)
    frame = work(5)
    session.receive_frame(frame, 10.0)
    assert sizes == [len(frame)]
    queued = session.pop()
    assert queued is not None and queued.ready == 11.0
    tile = session.start(queued, 12.5)
    assert tile is not None and tile.waited == 1.5


def test_a_tile_naming_a_block_the_device_lacks_is_released_as_missing() -> None:
    session = connected()
    session.receive_frame(work(4, blocks=False), 1.0)
    assert compute(session, 1.0) is None
    assert sent(session) == [Release((4,), ReleaseWhy.MISSING_BLOCK)] and session.held == frozenset()


def test_a_failed_compute_releases_the_tile_with_the_error() -> None:
    session = connected()
    session.receive_frame(work(6), 1.0)
    queued = session.pop()
    assert queued is not None
    tile = session.start(queued, 1.0)
    assert tile is not None
    session.failed(tile.tile_id, "CUDA out of memory " + "x" * 300)
    [release] = sent(session)
    assert isinstance(release, Release) and release.tile_ids == (6,) and release.why is ReleaseWhy.COMPUTE_FAILED
    assert release.reason.startswith("CUDA out of memory") and len(release.reason) == 200
    assert session.held == frozenset()


# --------------------------------------------------------------------------- cancels


def test_a_cancelled_queued_tile_is_skipped_without_a_word() -> None:
    session = connected()
    session.receive_frame(work(1), 1.0)
    session.receive_frame(work(2, blocks=False), 1.0)
    assert session.receive_frame(encode(Cancel(tile_ids=(1,), reason="another copy was verified")), 1.5) == []
    assert compute(session, 2.0) is None and sent(session) == []
    result = compute(session, 2.0)
    assert result is not None and result.tile_id == 2 and session.held == frozenset()


def test_a_tile_cancelled_while_computing_drops_its_result() -> None:
    session = connected()
    session.receive_frame(work(1), 1.0)
    queued = session.pop()
    assert queued is not None
    tile = session.start(queued, 1.0)
    assert tile is not None
    session.receive_frame(encode(Cancel(tile_ids=(1,))), 1.5)
    assert session.computed(tile, tile.a @ tile.b, 0.25) is None and sent(session) == []


def test_a_cancel_for_a_tile_not_held_is_not_remembered() -> None:
    session = connected()
    session.receive_frame(encode(Cancel(tile_ids=(8,))), 1.0)  # already answered, say
    session.receive_frame(work(8), 2.0)  # the coordinator sends it again later
    result = compute(session, 2.0)
    assert result is not None and result.tile_id == 8


# --------------------------------------------------------------------------- the owner's policy


def test_a_pause_gives_every_tile_back_drops_results_and_a_resume_takes_work_again() -> None:
    session = connected()
    session.receive_frame(work(1), 1.0)
    session.receive_frame(work(2, blocks=False), 1.0)
    computing = session.start(session.pop(), 1.0)  # type: ignore[arg-type]
    assert computing is not None

    session.pause("on battery")
    assert sent(session) == [Pause("on battery")] and session.paused == "on battery"
    assert session.computed(computing, computing.a @ computing.b, 0.25) is None  # computed meanwhile: dropped
    assert compute(session, 2.0) is None  # queued: skipped
    session.receive_frame(work(3, blocks=False), 2.5)  # sent before the coordinator saw the pause
    assert compute(session, 2.5) is None and sent(session) == [] and session.held == frozenset()

    session.resume()
    assert sent(session) == [Resume()] and session.paused == ""
    session.receive_frame(work(4, blocks=False), 3.0)
    result = compute(session, 3.0)
    assert result is not None and result.tile_id == 4


# --------------------------------------------------------------------------- standby


def test_standby_drops_blocks_and_tiles_beats_at_the_keepalive_and_a_wake_is_answered_at_once() -> None:
    session = connected(now=0.0)
    session.receive_frame(work(1), 1.0)
    session.receive_frame(work(2, blocks=False), 1.0)
    computing = session.start(session.pop(), 1.0)  # type: ignore[arg-type]
    assert computing is not None and session.blocks
    [sleeping] = session.receive_frame(encode(Standby(keepalive=30.0, reason=StandbyWhy.UNPLANNED)), 2.0)
    assert sleeping == Sleeping(30.0, StandbyWhy.UNPLANNED) and session.keepalive == 30.0
    assert not session.blocks and session.queued == 0  # nothing held: the runner frees the memory
    assert session.computed(computing, computing.a @ computing.b, 0.25) is None  # nobody wants it
    assert session.held == frozenset() and sent(session) == []
    # One heartbeat every 30 s, not every 2 s; a coordinator that beats at that pace is not silent.
    for t in (4.0, 10.0, 31.0):
        assert session.tick(t, 0.0) == []
    assert sent(session) == []
    assert session.tick(32.0, 5.0) == [] and sent(session) == [Heartbeat(sent_at=5.0)]
    session.receive_frame(encode(Heartbeat(sent_at=1.0)), 60.0)
    assert session.tick(62.0, 0.0) == [] and sent(session) == [Heartbeat(sent_at=0.0)]
    # Woken: its answer is due at once, then the welcome's interval again.
    assert session.receive_frame(encode(Wake()), 70.0) == [Woken()]
    assert session.keepalive is None and session.next_beat == 70.0
    assert session.tick(70.0, 7.0) == [] and sent(session) == [Heartbeat(sent_at=7.0)]
    assert session.next_beat == 70.0 + DEFAULT_HEARTBEAT
    session.receive_frame(work(3), 70.5)  # work follows the wake
    result = compute(session, 71.0)
    assert result is not None and result.tile_id == 3


def test_a_sleeping_device_hangs_up_only_after_three_keepalives_of_silence() -> None:
    session = connected(now=0.0)
    session.receive_frame(encode(Standby(keepalive=60.0)), 0.0)
    for t in range(60, 181, 60):  # 3 keep-alives without a frame: still waiting
        assert session.tick(float(t), 0.0) == []
    [hangup] = session.tick(240.0, 0.0)
    assert isinstance(hangup, HangUp) and hangup.silent == 240.0


def test_a_wake_when_awake_is_answered_and_a_standby_before_the_welcome_is_ignored() -> None:
    session = Session(HELLO, now=0.0, token="join-token")
    challenge(session)
    assert session.receive_frame(encode(Standby(keepalive=5.0)), 0.5) == []  # not welcomed yet
    assert session.keepalive is None
    session.receive_frame(welcome(), 1.0)
    assert session.receive_frame(encode(Wake()), 1.5) == [Woken()] and session.next_beat == 1.5


def test_a_pause_without_a_reason_still_counts_as_paused() -> None:
    session = connected()
    session.pause("")
    assert sent(session) == [Pause("")] and session.paused


# --------------------------------------------------------------------------- credit, errors, the end


def test_credit_adds_up_across_reconnects() -> None:
    first = connected()
    [credited] = first.receive_frame(encode(Credit(session_gflop=1.5, total_gflop=20.0)), 1.0)
    assert credited == Credited(1.5, 20.0)
    second = connected(credit_before=credited.gflop)  # the coordinator counts per connection
    [credited] = second.receive_frame(encode(Credit(session_gflop=0.5, total_gflop=20.5)), 1.0)
    assert credited == Credited(2.0, 20.5)


@pytest.mark.parametrize("code, rejected", [(Code.REJECTED, True), (Code.NOT_LEASED, False)])
def test_errors_from_the_coordinator_are_reported_and_rejections_flagged(code: Code, rejected: bool) -> None:
    session = connected()
    [error] = session.receive_frame(encode(Error(code=code, message="tile 3: no")), 1.0)
    assert isinstance(error, ErrorReceived) and error.message == "tile 3: no" and error.rejected is rejected


def test_finished_ends_the_session_and_nothing_after_it_counts() -> None:
    session = connected()
    assert session.receive_frame(encode(Finished(reason="job complete")), 1.0) == [Ended("finished")]
    assert session.ended == "finished"
    assert session.receive_frame(work(1), 1.5) == [] and session.queued == 0
    assert session.tick(100.0, 0.0) == [] and sent(session) == []


def _enrolling(enrolling: bool) -> Session:
    credential = None if enrolling else StoredCredential(7, SECRET)
    session = Session(HELLO, now=0.0, token="join-token", credential=lambda coordinator: credential)
    challenge(session)
    return session


@pytest.mark.parametrize(
    "enrolling, code, raises, message",
    [
        (True, CloseCode.AUTH, Refused, "the coordinator refused the join token (wrong token)"),
        (False, CloseCode.AUTH, Refused, "refused this device's credential (wrong token); if its database"),
        (False, CloseCode.BANNED, Banned, "the coordinator banned this device: wrong token"),
        (False, CloseCode.REVOKED, Refused, "the coordinator refused this device: wrong token"),
    ],
    ids=["4001 enrolling", "4001 credential", "banned", "revoked"],
)
def test_closes_after_which_reconnecting_cannot_help_raise(
    enrolling: bool, code: CloseCode, raises: type[Exception], message: str
) -> None:
    with pytest.raises(raises) as info:
        _enrolling(enrolling).closed(int(code), "wrong token")
    assert message in str(info.value)
    assert info.value.exit_code == (3 if raises is Banned else 2)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "code, reason, outcome",
    [
        (CloseCode.SILENT, "no heartbeat", "connection closed (4008 no heartbeat)"),
        (CloseCode.BUSY, "at capacity", "connection closed (1013 at capacity)"),
        (1006, "", "connection closed (1006 )"),
        (None, "", "connection closed (None )"),
    ],
)
def test_other_closes_are_reconnected_after(code: int | None, reason: str, outcome: str) -> None:
    assert _enrolling(False).closed(code, reason) == outcome


def test_the_session_reads_no_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    def stopped() -> float:
        raise AssertionError("the session read the clock")

    for name in ("monotonic", "time", "perf_counter"):
        monkeypatch.setattr(time, name, stopped)
    session = connected(now=5.0)
    session.receive_frame(work(1), 6.0)
    session.pause("owner active")
    session.resume()
    session.tick(7.0, 1.0)
    session.receive_frame(work(2), 8.0)
    assert compute(session, 9.0) is None  # tile 1: paused meanwhile
    assert compute(session, 9.0) is not None
    assert session.closed(CloseCode.SILENT, "") == "connection closed (4008 )"


def test_a_work_batch_is_its_works_in_order_and_a_missing_block_releases_only_its_tile() -> None:
    """A batch's second tile reads a block its first brought; its third names a block nobody
    sent: that one is released as missing, the others computed and answered in one frame."""
    session = Session(replace(HELLO, batch=4), now=0.0, token="join-token", arrival=lambda nbytes: 4.0)
    challenge(session)
    session.receive_frame(welcome(), 0.0)
    batch = WorkBatch(
        (
            Work(tile_id=1, a="1.a", b="1.b", blocks=(Block("1.a", A), Block("1.b", B))),
            Work(tile_id=2, a="1.a", b="1.b"),
            Work(tile_id=3, a="1.a", b="9.lost"),
        )
    )
    session.receive_frame(encode(batch), 3.0)
    assert session.held == frozenset({1, 2, 3}) and session.queued == 3
    results = [compute(session, 5.0) for _ in range(3)]
    assert results[2] is None and sent(session) == [Release((3,), ReleaseWhy.MISSING_BLOCK)]
    assert session.held == frozenset()
    done = [r for r in results if r is not None]
    assert all(torch.equal(r.c, A @ B) and r.waited == 1.0 for r in done)  # usable when the frame was
    [frame] = session.frames_of(done)
    back = decode(encode(frame))
    assert isinstance(back, ResultBatch) and [r.tile_id for r in back.results] == [1, 2]


def test_results_go_in_frames_of_at_most_the_hellos_batch() -> None:
    session = Session(replace(HELLO, batch=2), now=0.0, token="join-token")
    challenge(session)
    session.receive_frame(welcome(), 0.0)
    assert session.batch == 2
    results = [Result(i, torch.ones(1, 1)) for i in range(5)]
    frames = session.frames_of(results)
    assert [type(f).__name__ for f in frames] == ["ResultBatch", "ResultBatch", "Result"]
    assert [r.tile_id for f in frames for r in (f.results if isinstance(f, ResultBatch) else (f,))] == list(range(5))
    plain = connected()  # hello.batch 1: one result a frame, whatever the slots
    assert [type(f).__name__ for f in plain.frames_of(results[:2])] == ["Result", "Result"]
