"""Large server frames queued as header and payload: the same bytes as websockets' own, no copy."""

from __future__ import annotations

import pytest
from websockets.protocol import OPEN, Protocol, Side

from coordinator.net.framing import SMALL, unjoined_frames


def _sent(protocol: Protocol, *frames: tuple[bytes | memoryview, bool, bool]) -> bytes:
    for data, fin, first in frames:
        if first:
            protocol.send_binary(data, fin=fin)
        else:
            protocol.send_continuation(data, fin=fin)
    return b"".join(bytes(chunk) for chunk in protocol.data_to_send())


@pytest.mark.parametrize("size", [0, 125, 126, SMALL - 1, SMALL, 65535, 65536, 300_000])
def test_frames_are_the_bytes_websockets_would_write(size: int) -> None:
    payload = bytes(range(256)) * (size // 256 + 1)
    view = memoryview(payload)[:size]
    fragmented = [(view, False, True), (view[: size // 2], False, False), (b"", True, False)]
    ours = Protocol(Side.SERVER, state=OPEN)
    assert unjoined_frames(ours)
    theirs = Protocol(Side.SERVER, state=OPEN)
    assert _sent(ours, (view, True, True)) == _sent(theirs, (view, True, True))
    assert _sent(ours, *fragmented) == _sent(theirs, *fragmented)


def test_a_large_payload_is_queued_as_a_view_not_a_copy() -> None:
    ours = Protocol(Side.SERVER, state=OPEN)
    unjoined_frames(ours)
    payload = memoryview(bytearray(1 << 20))
    ours.send_binary(payload)
    head, body = ours.data_to_send()
    assert len(head) == 10 and body is payload  # the caller's view itself goes to the transport


def test_clients_and_small_frames_keep_the_librarys_path() -> None:
    assert not unjoined_frames(Protocol(Side.CLIENT, state=OPEN))  # client frames are masked
    ours = Protocol(Side.SERVER, state=OPEN)
    unjoined_frames(ours)
    ours.send_binary(b"x" * (SMALL - 1))
    (joined,) = ours.data_to_send()  # one write: header and payload together
    assert len(joined) == SMALL - 1 + 4
