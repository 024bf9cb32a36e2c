"""What a device tells the coordinator about itself when it joins."""

from __future__ import annotations

import os
import platform
import socket

import psutil


def machine_name() -> str:
    return socket.gethostname().split(".")[0] or "device"


def describe_platform() -> str:
    return f"{platform.system()} {platform.release()} {platform.machine()}".strip()


def cores() -> int:
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def memory_bytes() -> int:
    return int(psutil.virtual_memory().total)
