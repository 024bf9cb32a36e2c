"""The forgers moved into the package (``emulator/forgeries.py``, which ``cleave emulate``'s
byzantine devices use); this module re-exports them for the tests and tests/doubles.py."""

from cleave.emulator.forgeries import *  # noqa: F401,F403
from cleave.emulator.forgeries import __all__  # noqa: F401
