"""Views of the job built from the engine's state and the books: the ``status`` document (what
``cleave status --json``, the web dashboard and ``StatusReply`` carry; its keys are a contract)
and the counts ``/metrics`` reports. They read the ``Core`` and the store and change nothing, so
they live outside the sans-I/O core; the server adds what only it knows (traffic, connections).
"""

from __future__ import annotations

from typing import Any

from cleave.coordinator.engine.core import Core
from cleave.db.store import CONNECTED, DeviceStatus, LeaderRow
from cleave.wire.codes import DeviceView

# The tile counts ``status`` reports (``Store.tile_counts`` has these and more).
STATUS_TILES = ("queued", "leased", "taken", "verified", "rejected", "requeued", "expired", "speculative", "cancelled",
                "lost", "revoked")  # fmt: skip


def label(name: str, identity: int | None) -> str:
    """How a device is named to people, the same in every view (terminal, web page, metrics):
    its name and its enrolled identity's number (names are free text; numbers are unique)."""
    return f"{name} #{identity}" if identity is not None else name


def _leader(r: LeaderRow) -> dict[str, Any]:
    per = r.gflop_per_j
    return {
        "identity": r.identity_id,
        "name": r.name,
        "label": label(r.name, r.identity_id),
        "gflop": round(r.gflop, 3),
        "tiles": r.tiles,
        "joules": round(r.joules, 3),
        "gflop_metered": round(r.gflop_metered, 3),  # of gflop, what energy reports covered
        "gflop_per_j": None if per is None else round(per, 4),
    }


def status(core: Core, now: float) -> dict[str, Any]:
    """The snapshot ``cleave status`` renders. Bounded: at most ``Limits.status_rows`` devices
    are listed, connected ones first; all are counted."""
    store, job_id = core.store, core.job_id
    counts = store.tile_counts(job_id)
    cap = core.limits.status_rows
    rows = store.devices(job_id, states=CONNECTED, limit=cap)
    if len(rows) < cap:
        gone = tuple(s for s in DeviceStatus if s not in CONNECTED)
        rows += store.devices(job_id, states=gone, limit=cap - len(rows))
    listed = []
    for row in rows:
        live = core.devices.get(row.id)
        if live is None:
            state = DeviceView.OFFLINE if row.state in CONNECTED else DeviceView(row.state)
        elif live.paused is not None:
            state = DeviceView.PAUSED
        elif core.standby.is_asleep(row.id):
            state = DeviceView.STANDBY
        else:
            state = DeviceView.WORKING if live.inflight else DeviceView.IDLE
        profile = core.fleet.profiles.get(row.id)
        metered = core.energy.devices.get(row.id) if live else None
        listed.append(
            {
                "id": row.id,
                "identity": row.identity_id,
                "name": row.name,
                "label": label(row.name, row.identity_id),
                "state": state.value,
                "device": row.device,
                "tiles_done": row.tiles_done,
                "tiles_rejected": row.tiles_rejected,
                "tiles_lost": row.tiles_lost,
                "tiles_revoked": row.tiles_revoked,
                "reliability": round(row.reliability, 4),
                # Its benchmark at join, then the rate measured from its verified tiles.
                "gflops": round(profile.measured_gflops(row.gflops) if live and profile else row.gflops, 2),
                "gflop_verified": round(row.gflop_verified, 3),
                "reason": row.reason,
                # Heard from: its live session's last frame (heartbeats too), else the row's stamp.
                "last_seen": round(core.wall(live.last_seen) if live else row.last_seen, 3),
                "inflight": len(live.inflight) if live else 0,
                "slots": live.slots if live else 0,
                "probation": live.standing.on_probation(core.trust) if live else None,
                "mb_down": round((live.bytes_down if live else 0) / 1e6, 2),
                "mb_up": round((live.bytes_up if live else 0) / 1e6, 2),
                "compute_s": round(live.compute_seconds, 4) if live else None,
                # Seconds from a wake to its answer (a running mean; None: never woken here).
                "wake_s": round(wake, 4) if (wake := core.standby.wake_s.get(row.id)) is not None else None,
                "profile": profile.as_json(core.dtype) if profile is not None else None,
                # Its energy reports as booked in this job (capped ones at their cap), and where
                # its last one came from (rapl, battery, estimate, +nvml; capped).
                "joules": round(row.joules, 3),
                "energy_flagged": row.energy_flagged,
                "energy_source": metered.source if metered is not None else None,
                "gflop_per_j": round(row.gflop_metered / row.joules, 4) if row.joules > 0 else None,
            }
        )
    p = core.progress
    ps = core.planner.ps
    worst = core.checks.worst_honest
    return {
        "job": {
            "name": core.job_name,
            "step": p.step,
            "steps": p.steps,
            "loss": p.loss,
            # The held-out loss of the last evaluation, and its step (None: none yet).
            "val_loss": p.val_loss,
            "val_step": p.val_step,
            "state": p.state.value,
            "tokens_per_s": round(p.tokens_per_s, 1),
            "elapsed_s": None if (elapsed := p.elapsed(now)) is None else round(elapsed, 1),
            "eta_s": None if (eta := p.eta(now)) is None else round(eta, 1),
            "gemm_share": p.gemm_share,
        },
        "devices": listed,
        "device_counts": {"connected": len(core.devices), **store.device_states(job_id)},
        **_standby(core),
        "tiles": {k: counts[k] for k in STATUS_TILES},
        # Why tiles were lost (a device's connection closed, it went silent, it was cut...):
        # the most common reasons, each with its count.
        "lost_reasons": store.lost_reasons(job_id) if counts["lost"] else {},
        "queue_depth": counts["queued"],
        "gemms_in_flight": len(core.gemms),
        "leaderboard": [_leader(r) for r in store.leaderboard(10)],
        # The same, ranked by verified GFLOP per booked joule (identities that reported energy).
        "leaderboard_efficiency": [_leader(r) for r in store.leaderboard(10, by="gflop_per_j")],
        "energy": core.energy.summary(core.checks.gflop_verified),
        "plan": {
            "planner": core.planner.planner.value,
            **core.prediction.as_json(),
            "ps": {
                "egress_mbps": round(ps.egress * 8 / 1e6, 1),
                "ingress_mbps": round(ps.ingress * 8 / 1e6, 1),
                "gflops": round(ps.flops_per_s(core.dtype) / 1e9, 2),
                "verify_gflops": round(ps.verify_flops / 1e9, 2),
            },
        },
        "verify": {
            "seconds": round(core.checks.seconds, 4),
            "worst_honest_ratio": round(max(worst.values(), default=0.0), 4),
            "worst_honest_by_kind": {k: round(v, 4) for k, v in sorted(worst.items())},
        },
        "time": core.wall(now),
    }


def books(core: Core) -> dict[str, Any]:
    """What ``/metrics`` reports of the job, read when scraped (O(1) but for the devices' states,
    one indexed GROUP BY); the server adds its traffic."""
    p = core.progress
    tiles = core.store.tile_counts(core.job_id)
    return {
        "job": {
            "state": p.state.value,
            "step": p.step,
            "steps": p.steps,
            "loss": p.loss,
            "val_loss": p.val_loss,
            "tokens_per_s": p.tokens_per_s,
            "gemm_share": p.gemm_share,
        },
        "tokens_trained": p.tokens,
        "tiles": tiles,
        "queue_depth": tiles["queued"],
        "verify": {"seconds": core.checks.seconds},
        "gemms_in_flight": len(core.gemms),
        "device_counts": {"connected": len(core.devices), **core.store.device_states(core.job_id)},
        **_standby(core),
        "energy": core.energy.summary(core.checks.gflop_verified),
    }


def _standby(core: Core) -> dict[str, Any]:
    """Devices asleep now (counted apart: each is also ``online`` in ``device_counts``), and the
    standby and wake messages sent so far (engine/standby.py)."""
    sleepers = core.standby
    return {"devices_standby": len(sleepers.asleep), "standby": {"sent": sleepers.sent, "woken": sleepers.woken}}


def relays(core: Core) -> list[dict[str, Any]]:
    """The connected relays: how many devices each serves, what it took from here and was named."""
    return [
        {
            "id": r.id,
            "name": r.name,
            "url": r.url,
            "devices": len(r.devices),
            "mb_from_coordinator": round(r.bytes_out / 1e6, 2),
            "mb_named": round(r.bytes_named / 1e6, 2),
        }
        for r in core.relays.relays.values()
    ]
