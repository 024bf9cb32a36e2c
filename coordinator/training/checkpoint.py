"""Parameter-server checkpoints: written whole or not at all, checked before they are trusted.

A checkpoint holds everything that decides the next step: weights, AdamW state, the torch RNG,
the data sampler's RNG (its position in the corpus), the step and tokens seen. It is written to
a temporary file, flushed to disk, renamed into place (atomic on POSIX and Windows), and only
then recorded in SQLite with its size and SHA-256. On resume the newest recorded checkpoint
whose file still matches is used; a truncated or corrupt one is reported and skipped.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cleave.db.store import CheckpointRow
from cleave.wire.errors import CheckpointError

KEEP = 3  # newest checkpoint files kept per job; older files are deleted


def checkpoint_dir(db_path: str | Path) -> Path:
    """``runs/cleave.db`` keeps its checkpoints in ``runs/cleave.db-checkpoints/``."""
    return Path(f"{db_path}-checkpoints")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def save(folder: Path, job_id: int, step: int, state: dict[str, Any], now: float) -> CheckpointRow:
    folder = folder.resolve()  # rows must name the file whatever directory a restart runs in
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"job{job_id}-step{step:07d}.pt"
    tmp = folder / f".{final.name}.tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    if hasattr(os, "O_DIRECTORY"):  # make the rename itself durable
        fd = os.open(folder, os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return CheckpointRow(job_id, step, str(final), _sha256(final), final.stat().st_size, now)


def load(row: CheckpointRow) -> dict[str, Any]:
    """The checkpoint's state, or CheckpointError saying why it cannot be trusted."""
    path = Path(row.path)
    if not path.exists():
        raise CheckpointError(f"checkpoint of step {row.step} is missing ({path})")
    size = path.stat().st_size
    if size != row.bytes:
        raise CheckpointError(f"checkpoint of step {row.step} is truncated ({size} of {row.bytes} bytes)")
    if _sha256(path) != row.sha256:
        raise CheckpointError(f"checkpoint of step {row.step} is corrupt (checksum mismatch)")
    try:
        # weights_only: tensors, dicts, numbers and strings only -- never arbitrary objects.
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a file that hashes right but does not load is still unusable
        raise CheckpointError(f"checkpoint of step {row.step} does not load: {exc}") from None
    if not isinstance(state, dict) or state.get("step") != row.step:
        raise CheckpointError(f"checkpoint of step {row.step} holds unexpected contents")
    return state


@dataclass(frozen=True)
class Resume:
    step: int  # 0: start from scratch
    state: dict[str, Any] | None
    skipped: tuple[str, ...]  # why newer checkpoints were not used


def newest_good(rows: list[CheckpointRow]) -> Resume:
    """Walk checkpoints newest first and take the first one that loads."""
    skipped = []
    for row in rows:
        try:
            return Resume(row.step, load(row), tuple(skipped))
        except CheckpointError as exc:
            skipped.append(str(exc))
    return Resume(0, None, tuple(skipped))


def prune(rows: list[CheckpointRow], keep: int = KEEP, remove: Callable[[Path], None] = Path.unlink) -> None:
    """Delete the files of all but the ``keep`` newest checkpoints (rows stay, as history).
    A step computed again after a resume reuses its file name: never delete a file a kept row
    names."""
    kept = {row.path for row in rows[:keep]}
    for row in rows[keep:]:
        path = Path(row.path)
        if row.path not in kept and path.exists():
            remove(path)
