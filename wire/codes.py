"""Codes a peer is given: websocket close codes, short reasons, and why a device gives tiles back.

Each is an enum, defined once here and read by both sides; nothing else spells their numbers or
strings.
"""

from __future__ import annotations

from enum import Enum, IntEnum


class Name(str, Enum):
    """A string enum whose ``str()`` and f-string are its value (as ``enum.StrEnum`` from 3.11)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class CloseCode(IntEnum):
    """Websocket close codes (4000-4999 are free for applications in RFC 6455)."""

    FINISHED = 1000  # normal closure once the job is over
    GOING_AWAY = 1001  # the peer is going away (a client that hears nothing from its coordinator)
    TOO_BIG = 1009  # a frame over the receiver's limit (the websocket library closes with it)
    INTERNAL = 1011  # the coordinator failed on a message (a bug): the peer is closed, never sent a traceback
    BUSY = 1013  # "try again later": the coordinator is at its connection cap
    PROTOCOL = 4000  # malformed frame, unknown or misplaced message, no hello in time
    AUTH = 4001  # wrong join or operator token, unknown identity or a bad proof
    REVOKED = 4002  # the operator revoked this identity's credential
    BANNED = 4003  # results failed verification
    SILENT = 4008  # no heartbeat within the timeout
    IN_USE = 4009  # this identity is already connected
    STALLING = 4010  # its leases kept expiring: cut, may come back after a cool-off
    SLOW_READER = 4011  # it stopped reading its frames
    IDLE = 4012  # an observer sent no request for a while (1000 to an observer means the job is over)
    REDIRECTED = 4013  # after a redirect: connect to the rank it names
    RATE_LIMITED = 4029  # it sent more requests than its allowance


class Code(Name):
    """Short reasons a peer is given: in ``Error`` messages and as the prefix of 4000 closes."""

    BAD_FRAME = "bad_frame"
    TRUNCATED = "truncated"
    BAD_VERSION = "bad_version"
    UNKNOWN_TYPE = "unknown_type"
    BAD_TENSOR = "bad_tensor"
    BAD_DTYPE = "bad_dtype"
    TEXT_FRAME = "text_frame"
    UNEXPECTED = "unexpected"
    NOT_LEASED = "not_leased"
    REJECTED = "rejected"


class ReleaseWhy(Name):
    """Why a device gives tiles back: it decides what the coordinator does next."""

    MISSING_BLOCK = "missing_block"  # send the blocks again with the tile
    COMPUTE_FAILED = "compute_failed"  # never give this device the tile again


class RelayFault(Name):
    """How a relay failed a device (``relay_report``)."""

    WRONG = "wrong"  # bytes that do not hash to the digest asked for
    STALLED = "stalled"  # no answer within the deadline
    UNREACHABLE = "unreachable"  # no connection, or it refused the device's ticket


class StandbyWhy(Name):
    """Why the coordinator sends a device to standby (``standby.reason``): it has no work for it."""

    IDLE = "idle"  # no GEMM is out: the job waits (between steps, a checkpoint, devices to join)
    UNPLANNED = "unplanned"  # GEMMs are out, but the plans of the live ones leave this device out


class EnergySource(Name):
    """Where an energy figure comes from (``energy.source``, the books' source mix)."""

    RAPL = "rapl"  # Linux powercap counters: the CPU package's energy, as the hardware counts it
    NVML = "nvml"  # NVIDIA's driver: the GPU board's energy (nvmlDeviceGetTotalEnergyConsumption)
    BATTERY = "battery"  # the battery's discharge, running on battery
    ESTIMATE = "estimate"  # a stated power model: CPU seconds x watts per busy core
    CAPPED = "capped"  # a claim above its device's ceiling: what is booked in its place, never as measured


class JobPhase(Name):
    """Where the job is: ``status.job.state`` in a ``StatusReply`` (``cleave status`` ends on FINISHED)."""

    STARTING = "starting"
    WAITING = "waiting for devices"
    TRAINING = "training"
    FINISHED = "finished"


class DeviceView(Name):
    """A device's state in a ``StatusReply``'s ``devices`` list: what a connected one is doing, or
    how its session ended."""

    WORKING = "working"  # connected, holding tiles
    IDLE = "idle"  # connected, holding none
    PAUSED = "paused"  # connected; its owner needs the machine
    STANDBY = "standby"  # connected, asleep: the coordinator has no work for it now (``standby``)
    OFFLINE = "offline"
    BANNED = "banned"
    REVOKED = "revoked"
