"""``cleave emulate``: a fleet of emulated volunteer devices in one process (emulator/devices.py),
and the forged results its byzantine devices return (emulator/forgeries.py)."""
