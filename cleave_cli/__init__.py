"""Cleave's command line. Importing it sets process-wide defaults that must precede torch."""

import os

# OpenMP threads that busy-wait after each parallel region steal whole cores from the other
# Cleave processes on the same machine (5x slower steps with a coordinator and two clients on
# two cores), and a volunteer client must never burn CPU while idle. The user can override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# The websocket library reads a whole upgrade request before Cleave sees the peer; these bound
# what an unauthenticated connection can make the coordinator hold (docs/security.md). They
# must be set before the library is imported.
from coordinator.engine.limits import HANDSHAKE_HEADERS, HANDSHAKE_LINE  # noqa: E402 - plain constants, no torch

os.environ.setdefault("WEBSOCKETS_MAX_NUM_HEADERS", str(HANDSHAKE_HEADERS))
os.environ.setdefault("WEBSOCKETS_MAX_LINE_LENGTH", str(HANDSHAKE_LINE))
