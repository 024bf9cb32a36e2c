"""Training text: the Python standard library's own sources by default, or any UTF-8 text.

Every machine that runs Cleave has the standard library, so the default needs no download.
Files are read in sorted order and capped, so the same Python gives the same corpus.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import numpy as np
import torch

from coordinator.wire.errors import ConfigError

DEFAULT_MAX_BYTES = 8 << 20  # 8 MiB: plenty for the presets, read in well under a second
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3"}


class DataError(ConfigError):
    """``--data`` that cannot be trained on."""


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _text_files(root: Path, suffixes: tuple[str, ...] | None) -> list[Path]:
    files = []
    for folder, dirs, names in os.walk(root):
        # Prune in place: never descend into site-packages (hundreds of MB) or tests.
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
        files.extend(Path(folder, n) for n in sorted(names) if suffixes is None or n.endswith(suffixes))
    return files


def load_corpus(source: str | Path | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """Bytes of the corpus: ``source`` (a text file or folder) or the stdlib's ``.py`` files."""
    if source is None:
        root, suffixes = stdlib_root(), (".py",)
    else:
        root, suffixes = Path(source).expanduser(), None
        if not root.exists():
            raise DataError(f"--data {source}: no such file or folder")
    files = [root] if root.is_file() else _text_files(root, suffixes)
    chunks: list[bytes] = []
    total = 0
    for path in files:
        try:
            raw = path.read_bytes()
            raw.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            if source is not None and root.is_file():
                raise DataError(f"--data {source}: not readable UTF-8 text") from None
            continue  # a folder may hold the odd binary or unreadable file
        chunks.append(raw)
        total += len(raw)
        if total >= max_bytes:
            break
    data = b"\n".join(chunks)[:max_bytes]
    if len(data) < 2:
        raise DataError(f"the corpus at {root} holds no usable text")
    return data


class ByteBatches:
    """Random windows of a corpus of bytes (or of token ids, for a model with a tokenizer); the
    RNG is injected so a seed fixes every batch."""

    def __init__(self, data: bytes | torch.Tensor, seq_len: int, batch_size: int, rng: np.random.Generator) -> None:
        unit = "tokens" if isinstance(data, torch.Tensor) and data.dtype != torch.uint8 else "bytes"
        if len(data) <= seq_len + 1:
            raise DataError(f"corpus of {len(data)} {unit} is shorter than --seq-len {seq_len} + 1")
        self.tokens = data if isinstance(data, torch.Tensor) else torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.seq_len, self.batch_size, self.rng = seq_len, batch_size, rng

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = self.rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.batch_size)
        x = torch.stack([self.tokens[s : s + self.seq_len] for s in starts]).long()
        y = torch.stack([self.tokens[s + 1 : s + 1 + self.seq_len] for s in starts]).long()
        return x, y  # (B, T) each
