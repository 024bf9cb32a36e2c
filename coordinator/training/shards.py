"""Token shards on disk: what ``cleave data prepare`` writes and ``--data`` reads.

Layout (nanoGPT's): a ``.bin`` shard is the raw token ids, little-endian, one after another, no
header; its dtype (``uint16`` when the vocabulary fits, else ``uint32``) comes from the
``shards.json`` beside it or from ``--data-dtype``. A ``.npy`` shard is a one-dimensional
integer array (numpy's format: the dtype is in its header). ``shards.json`` (``Meta``) lists
the shards in order with their vocabulary, dtype, token counts, tokenizer and source.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.lib import format as npformat

from cleave.coordinator.training.tokens import DataError, Segment

META = "shards.json"
FORMAT = "cleave-shards"
VERSION = 1
BIN, NPY = ".bin", ".npy"
SHARD_SUFFIXES = (BIN, NPY)
BIN_DTYPES = ("uint16", "uint32")  # a .bin shard's dtypes: --data-dtype's choices
_NPY_KINDS = "ui"  # a .npy shard holds unsigned or signed integers (negative ids are refused as read)
_NPY_HEADERS = {(1, 0): npformat.read_array_header_1_0, (2, 0): npformat.read_array_header_2_0}


def dtype_for(vocab_size: int) -> str:
    """The narrowest shard dtype that holds every id of a vocabulary."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


@dataclass(frozen=True)
class Meta:
    """``shards.json``: what a folder of shards holds."""

    dtype: str
    vocab_size: int
    tokens: int
    shards: list[dict[str, Any]]  # {"file": name beside shards.json, "tokens": count}, in order
    tokenizer: str  # "bytes", "tokenizer.json" (beside the shards) or the hf:DIR it came from
    source: str
    format: str = FORMAT
    version: int = VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def write(self, folder: Path) -> Path:
        path = folder / META
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")
        return path

    @staticmethod
    def read(path: Path) -> Meta:
        try:
            raw = json.loads(path.read_text())
            meta = Meta(**raw) if isinstance(raw, dict) else None
        except (OSError, ValueError, TypeError) as exc:
            raise DataError(f"{path} is not a readable {META} ({exc})") from None
        if meta is None:
            raise DataError(f"{path} is not a readable {META} (not a JSON object)")
        _check_fields(path, meta)
        if meta.format != FORMAT or meta.version != VERSION:
            raise DataError(f"{path}: format {meta.format!r} version {meta.version}, not {FORMAT!r} {VERSION}")
        if meta.dtype not in BIN_DTYPES:
            raise DataError(f"{path}: dtype {meta.dtype!r} is not one of {', '.join(BIN_DTYPES)}")
        if not 2 <= meta.vocab_size <= np.iinfo(meta.dtype).max + 1:
            raise DataError(f"{path}: a vocabulary of {meta.vocab_size} does not fit its dtype {meta.dtype}")
        return meta


_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "dtype": str,
    "vocab_size": int,
    "tokens": int,
    "shards": list,
    "tokenizer": str,
    "source": str,
    "format": str,
    "version": int,
    "extra": dict,
}


def _check_fields(path: Path, meta: Meta) -> None:
    """Each field of the type it is written with, and each shard a plain file name beside it and
    a count: a hand-edited or foreign file is refused in one line, never a traceback."""
    for name, kind in _FIELD_TYPES.items():
        value = getattr(meta, name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise DataError(f"{path}: {name} is {value!r}, not a {getattr(kind, '__name__', kind)}")
    for n, shard in enumerate(meta.shards):
        file = shard.get("file") if isinstance(shard, dict) else None
        count = shard.get("tokens") if isinstance(shard, dict) else None
        if not isinstance(file, str) or not file or file in (".", "..") or "/" in file or "\\" in file:
            raise DataError(f"{path}: shard {n}'s file {file!r} is not a file name beside {META}")
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise DataError(f"{path}: shard {n}'s tokens {count!r} is not a count")


def bin_segment(path: Path, dtype: str) -> Segment:
    """A raw ``.bin`` shard of ``dtype`` ids (checked: its size is a whole number of them)."""
    if dtype not in BIN_DTYPES:
        raise DataError(f"{path}: dtype {dtype!r} is not one of {', '.join(BIN_DTYPES)}")
    dt = np.dtype(dtype).newbyteorder("<")
    size = _size(path)
    if size % dt.itemsize:
        raise DataError(
            f"{path} is {size:,} bytes, not a whole number of {dtype} ids ({dt.itemsize} bytes each): "
            "truncated, or another dtype?"
        )
    return Segment(size // dt.itemsize, dt, path=path)


def npy_segment(path: Path) -> Segment:
    """A ``.npy`` shard: its header read (a few hundred bytes), its ids left on disk."""
    try:
        with open(path, "rb") as f:
            version = npformat.read_magic(f)
            if version not in _NPY_HEADERS:
                raise ValueError(f"format version {version}")
            shape, fortran, dt = _NPY_HEADERS[version](f)
            offset = f.tell()
    except (OSError, ValueError) as exc:
        raise DataError(f"{path} is not a readable .npy file ({exc})") from None
    if fortran and len(shape) > 1:
        raise DataError(f"{path} holds a Fortran-ordered array: a shard is one dimension of integer ids")
    if len(shape) != 1 or dt.kind not in _NPY_KINDS or dt.hasobject:
        raise DataError(f"{path} holds a {dt} array of shape {shape}: a shard is one dimension of integer ids")
    n = int(shape[0])
    if _size(path) < offset + n * dt.itemsize:
        raise DataError(f"{path} is shorter than its header says ({n:,} {dt} ids): truncated?")
    return Segment(n, dt, path=path, offset=offset)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or exc}") from None


def from_meta(folder: Path) -> tuple[list[Segment], Meta]:
    """The shards ``shards.json`` in ``folder`` lists, checked against it."""
    meta = Meta.read(folder / META)
    segments = []
    for shard in meta.shards:
        path = folder / str(shard.get("file", ""))
        seg = npy_segment(path) if path.suffix == NPY else bin_segment(path, meta.dtype)
        if seg.length != shard.get("tokens"):
            raise DataError(f"{path} holds {seg.length:,} tokens, {folder / META} says {shard.get('tokens')}")
        if seg.dtype.itemsize > np.dtype(meta.dtype).itemsize:
            raise DataError(f"{path} is {seg.dtype}, wider than {folder / META}'s {meta.dtype}")
        segments.append(seg)
    return segments, meta


class ShardWriter:
    """Writes ids to ``prefix-00000.bin``, ``prefix-00001.bin``, ... of ``shard_tokens`` ids
    each; memory: none beyond the arrays it is handed."""

    def __init__(self, folder: Path, dtype: str, shard_tokens: int, prefix: str = "shard") -> None:
        self.folder, self.dtype, self.shard_tokens, self.prefix = folder, np.dtype(dtype), shard_tokens, prefix
        self.shards: list[dict[str, Any]] = []
        self._file: Any = None
        self.tokens = 0

    def write(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) > np.iinfo(self.dtype).max):
            raise DataError(f"token id {int(ids.max())} does not fit the shards' dtype {self.dtype}")
        ids = ids.astype(self.dtype.newbyteorder("<"), copy=False)
        while ids.size:
            if self._file is None:
                name = f"{self.prefix}-{len(self.shards):05d}{BIN}"
                self._file = open(self.folder / name, "wb")  # noqa: SIM115 (closed when full or at close)
                self.shards.append({"file": name, "tokens": 0})
            room = self.shard_tokens - self.shards[-1]["tokens"]
            part, ids = ids[:room], ids[room:]
            self._file.write(part.tobytes())
            self.shards[-1]["tokens"] += int(part.size)
            self.tokens += int(part.size)
            if self.shards[-1]["tokens"] == self.shard_tokens:
                self._file.close()
                self._file = None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
