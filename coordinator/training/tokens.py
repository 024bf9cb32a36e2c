"""A corpus of token ids that is never all in memory: the concatenation of segments (token
shards, text files read as byte ids, separators), each read a window at a time.

Windows are read with positioned reads (``os.pread``) into a fresh array, not through a memory
map: a map's pages, once touched, count in the process's resident memory for as long as it is
mapped, so random windows over a 1 GB shard would grow the coordinator by up to the shard's
size; read pages stay in the kernel's page cache, which it may drop. What a stream holds,
whatever the corpus's size: one row per segment (its path, offset and length, ~200 bytes) and
at most ``MAX_OPEN`` open file descriptors.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cleave.wire.errors import ConfigError

MAX_OPEN = 32  # file descriptors a stream keeps open at most (least recently read closed first)


class DataError(ConfigError):
    """``--data`` (or ``--val-data``) that cannot be trained on, in one line."""


@dataclass(frozen=True)
class Segment:
    """``length`` token ids of ``dtype`` (little-endian) at byte ``offset`` of ``path``, or held
    in ``array`` (a separator, or a small corpus read into memory)."""

    length: int
    dtype: np.dtype
    path: Path | None = None
    offset: int = 0
    array: np.ndarray | None = None

    @staticmethod
    def of(array: np.ndarray) -> Segment:
        return Segment(len(array), array.dtype, array=array)


class TokenStream:
    """Token ids ``[0, len)`` over ``segments`` laid end to end; ``vocab_size`` (None: unknown)
    bounds every id read: a window holding a larger one raises DataError naming its file."""

    def __init__(self, segments: list[Segment], vocab_size: int | None, name: str) -> None:
        self.segments = [s for s in segments if s.length > 0]
        self.vocab_size = vocab_size
        self.name = name
        # starts[i]: the stream position of segment i's first id; starts[-1]: the stream's length
        self.starts = np.zeros(len(self.segments) + 1, dtype=np.int64)
        np.cumsum([s.length for s in self.segments], out=self.starts[1:])
        self._open: OrderedDict[Path, int] = OrderedDict()
        self._lock = threading.Lock()  # evaluation and training may read from different threads

    def __len__(self) -> int:
        return int(self.starts[-1])

    def read(self, start: int, n: int) -> np.ndarray:
        """Ids ``[start, start + n)`` as int64 (a copy of only those ids)."""
        if not 0 <= start <= start + n <= len(self):
            raise IndexError(f"window [{start}, {start + n}) outside a stream of {len(self)} ids")
        out = np.empty(n, dtype=np.int64)
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        done = 0
        while done < n:
            seg = self.segments[i]
            lo = start + done - int(self.starts[i])
            take = min(n - done, seg.length - lo)
            out[done : done + take] = self._segment(seg, lo, take)
            done += take
            i += 1
        if self.vocab_size is not None and n and (int(out.max()) >= self.vocab_size or int(out.min()) < 0):
            bad = int(out.max()) if int(out.max()) >= self.vocab_size else int(out.min())
            raise DataError(
                f"{self._where(start)} holds token id {bad}, outside the model's vocabulary of {self.vocab_size} "
                "(a shard prepared for another tokenizer?)"
            )
        return out

    def _where(self, position: int) -> str:
        i = int(np.searchsorted(self.starts, position, side="right")) - 1
        seg = self.segments[min(i, len(self.segments) - 1)]
        return f"{seg.path or self.name} (near token {position - int(self.starts[i]):,})"

    def _segment(self, seg: Segment, lo: int, n: int) -> np.ndarray:
        if seg.array is not None:
            return seg.array[lo : lo + n]
        assert seg.path is not None
        size = seg.dtype.itemsize
        with self._lock:
            fd = self._fd(seg.path)
            raw = os.pread(fd, n * size, seg.offset + lo * size)
        if len(raw) != n * size:
            raise DataError(f"{seg.path} is shorter than when it was opened (truncated while training?)")
        return np.frombuffer(raw, dtype=seg.dtype)

    def _fd(self, path: Path) -> int:
        fd = self._open.pop(path, None)
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as exc:
                raise DataError(f"cannot read {path}: {exc.strerror or exc}") from None
            if len(self._open) >= MAX_OPEN:
                os.close(self._open.popitem(last=False)[1])
        self._open[path] = fd  # most recently used last
        return fd

    def close(self) -> None:
        with self._lock:
            while self._open:
                os.close(self._open.popitem()[1])

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing left to close with
            pass


def in_memory(ids: np.ndarray, vocab_size: int | None, name: str) -> TokenStream:
    """A stream over ids already in memory (a small corpus); int64 ids are kept as uint32 where
    they fit, half the memory."""
    ids = np.asarray(ids)
    if ids.dtype.itemsize > 4 and ids.size and 0 <= int(ids.min()) and int(ids.max()) < 1 << 32:
        ids = ids.astype(np.uint32)
    return TokenStream([Segment.of(ids)], vocab_size, name)


@dataclass(frozen=True)
class View:
    """Positions ``[lo, hi)`` of a stream: the training part or the held-out part."""

    stream: TokenStream
    lo: int
    hi: int

    def __len__(self) -> int:
        return self.hi - self.lo

    def read(self, start: int, n: int) -> np.ndarray:
        if start + n > len(self):
            raise IndexError(f"window [{start}, {start + n}) past the end of a part of {len(self)} ids")
        return self.stream.read(self.lo + start, n)

    @staticmethod
    def whole(stream: TokenStream) -> View:
        return View(stream, 0, len(stream))
