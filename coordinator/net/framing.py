"""Large frames out without copying their payload.

websockets serialises every outgoing frame into one new bytes object (header and payload through
a ``BytesIO``: two copies of the payload) before the transport copies it into the kernel. For a
coordinator that sends 10-15 MB of operand blocks per tile, those copies were a third of the
event loop's CPU for sending (bench/bench_tax.py). ``unjoined_frames`` makes a server
connection queue a large frame's header and its payload apart: the transport hands the payload's
view straight to the socket. What the kernel does not take at once, asyncio 3.11 copies into its
buffer; 3.12 and later keep the view itself until it is written. A work frame's blocks are views
of the GEMM's operands or copies made for the wire, and a queued frame held those views before
this too: operands stay unchanged while their GEMM is live, and a frame for a GEMM that finished
meanwhile names a namespace the device is told to forget.

The frames on the wire are the very bytes websockets would write (an unmasked server frame
without extensions); websockets' own state machine still decides every frame, only its
serialisation changes. Connections with extensions (compression, which Cleave never negotiates),
small frames and any websockets whose protocol object lacks what this relies on keep the
library's own path.
"""

from __future__ import annotations

import struct
import types
from typing import Any

SMALL = 4096  # below this a joined frame costs less than two writes


def unjoined_frames(protocol: Any) -> bool:
    """Queue this server connection's large frames as header and payload (see the module doc).
    True if the connection now does; False leaves the library's path (an unknown version)."""
    try:
        from websockets.protocol import Side
    except ImportError:  # pragma: no cover - a websockets without the sans-I/O protocol
        return False
    if getattr(protocol, "side", None) is not Side.SERVER or not isinstance(getattr(protocol, "writes", None), list):
        return False
    library = type(protocol).send_frame

    def send_frame(self: Any, frame: Any) -> None:
        data = frame.data
        if self.extensions or len(data) < SMALL or frame.rsv1 or frame.rsv2 or frame.rsv3:
            library(self, frame)
            return
        frame.check()  # as the library's serialisation does (a control frame this large raises)
        n = len(data)
        first = (0x80 if frame.fin else 0) | int(frame.opcode)
        if n < 65536:
            head = struct.pack("!BBH", first, 126, n)
        else:
            head = struct.pack("!BBQ", first, 127, n)
        self.writes.append(head)
        self.writes.append(data)

    protocol.send_frame = types.MethodType(send_frame, protocol)
    return True
