"""Cleave's command line. Importing it sets process-wide defaults that must precede torch."""

import os

# OpenMP threads that busy-wait after each parallel region steal whole cores from the other
# Cleave processes on the same machine (5x slower steps with a coordinator and two clients on
# two cores), and a volunteer client must never burn CPU while idle. The user can override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
