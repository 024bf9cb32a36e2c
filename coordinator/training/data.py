"""Training data: ``--data`` (and ``--val-data``) opened as a stream of token ids, its held-out
split, the training batches and the fixed evaluation batches.

``--data`` is one of (docs/cli.md, Training data):
- nothing: the Python standard library's own ``.py`` sources, read into memory and capped at
  ``DEFAULT_MAX_BYTES`` (every machine that runs Cleave has them, so the default needs no
  download; files in sorted order, so the same Python gives the same corpus);
- text: a file, or a folder read recursively in sorted order, files joined by a newline. For a
  byte-level model the bytes are the ids and are read from disk a window at a time, whatever the
  size. A model with a tokenizer (``hf:DIR``) tokenizes text in memory, up to
  ``IN_MEMORY_TEXT`` bytes; beyond that ``cleave data prepare`` makes shards once;
- JSONL (``.jsonl``): one JSON object per line, the text in ``--data-field``; read into memory
  up to ``IN_MEMORY_TEXT`` bytes of text (``cleave data prepare`` for more);
- token shards (``shards.py``): a folder with ``shards.json``, or ``.bin``/``.npy`` files; read
  from disk a window at a time (``tokens.py``).

Memory, whatever the corpus's size: a streamed corpus holds its segment table (~200 bytes a
file) and 32 open files; an in-memory one at most ``IN_MEMORY_TEXT`` bytes of text and its ids
(8 bytes each). A batch reads batch x (seq_len + 1) ids.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import math
import os
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cleave.coordinator.training import shards
from cleave.coordinator.training.tokens import DataError, Segment, TokenStream, View, in_memory

DEFAULT_MAX_BYTES = 8 << 20  # 8 MiB of the default corpus: plenty for the presets, read in well under a second
IN_MEMORY_TEXT = 8 << 20  # bytes of text tokenized or parsed in memory at most (JSONL, a tokenizer's text)
SNIFF_BYTES = 8192  # a file counts as text when its first 8 KiB are UTF-8 (the rest is never decoded)
JSONL = ".jsonl"
NEWLINE = 10  # the id between two files of a byte-level corpus
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3"}

Tokenize = Callable[[bytes], np.ndarray]  # text -> the model's ids; None where the bytes are the ids


class Kind(Enum):
    """What a ``--data`` path holds."""

    TEXT = "text"
    JSONL = "jsonl"
    SHARDS = "shards"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _files(root: Path, suffixes: tuple[str, ...] | None) -> list[Path]:
    files = []
    for folder, dirs, names in os.walk(root):
        # Prune in place: never descend into site-packages (hundreds of MB) or tests.
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
        files.extend(
            Path(folder, n)
            for n in sorted(names)
            if (suffixes is None or n.endswith(suffixes)) and not n.startswith(".") and n != shards.META
        )
    return files


def load_corpus(source: str | Path | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """Bytes of a text corpus in memory, capped at ``max_bytes``: ``source`` (a text file or
    folder) or the stdlib's ``.py`` files (the default corpus)."""
    if source is None:
        root, suffixes = stdlib_root(), (".py",)
    else:
        root, suffixes = Path(source).expanduser(), None
        if not root.exists():
            raise DataError(f"--data {source}: no such file or folder")
    files = [root] if root.is_file() else _files(root, suffixes)
    chunks: list[bytes] = []
    total = 0
    for path in files:
        try:
            raw = path.read_bytes()  # the stdlib's files are small; other text reaches here under a bound
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


def kind_of(path: Path) -> Kind:
    """Shards: a folder with ``shards.json``, a ``.bin``/``.npy`` file, or a folder of only
    those; JSONL: a ``.jsonl`` file or a folder of only those; anything else is text. A folder
    that mixes shards with other files and has no ``shards.json`` is refused (DataError)."""
    if path.is_file():
        if path.suffix in shards.SHARD_SUFFIXES:
            return Kind.SHARDS
        return Kind.JSONL if path.suffix == JSONL else Kind.TEXT
    if (path / shards.META).is_file():
        return Kind.SHARDS
    files = _files(path, None)
    suffixes = {p.suffix for p in files}
    if suffixes and suffixes <= set(shards.SHARD_SUFFIXES):
        return Kind.SHARDS
    if suffixes & set(shards.SHARD_SUFFIXES):  # a shard is never read as text
        ids = [p.relative_to(path).as_posix() for p in files if p.suffix in shards.SHARD_SUFFIXES]
        others = [p.relative_to(path).as_posix() for p in files if p.suffix not in shards.SHARD_SUFFIXES]
        raise DataError(
            f"{path} holds token shards ({_some(ids)}) and other files ({_some(others)}) but no {shards.META}: "
            "pass one shard file (nanoGPT's: --data DIR/train.bin --val-data DIR/val.bin) or a folder of only shards"
        )
    return Kind.JSONL if suffixes == {JSONL} else Kind.TEXT


def _some(names: list[str], most: int = 3) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _is_text(path: Path) -> bool:
    """Whether a file's first ``SNIFF_BYTES`` are UTF-8 (a character cut at the end allowed)."""
    try:
        with open(path, "rb") as f:
            head = f.read(SNIFF_BYTES)
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except (OSError, UnicodeDecodeError):
        return False
    return True


def _text_segments(root: Path, flag: str) -> list[Segment]:
    """A text file, or a folder's text files joined by a newline, as byte ids left on disk."""
    files = [root] if root.is_file() else _files(root, None)
    byte = np.dtype(np.uint8)
    newline = np.array([NEWLINE], dtype=np.uint8)
    segments: list[Segment] = []
    for path in files:
        if not _is_text(path):
            if root.is_file():
                raise DataError(f"{flag} {root}: not readable UTF-8 text")
            continue  # a folder may hold the odd binary or unreadable file
        size = path.stat().st_size
        if size == 0:
            continue
        if segments:
            segments.append(Segment.of(newline))
        segments.append(Segment(size, byte, path=path))
    return segments


def _jsonl_texts(root: Path, field: str, flag: str) -> Iterator[str]:
    """The ``field`` of every record of a JSONL file (or a folder's), one line at a time."""
    for path in [root] if root.is_file() else _files(root, (JSONL,)):
        try:
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except ValueError:
                        raise DataError(f"{flag} {path}, line {number}: not a JSON object") from None
                    text = record.get(field) if isinstance(record, dict) else None
                    if not isinstance(text, str):
                        raise DataError(f"{flag} {path}, line {number}: no text field {field!r} (--data-field)")
                    yield text
        except UnicodeDecodeError:
            raise DataError(f"{flag} {path}: not UTF-8") from None
        except OSError as exc:
            raise DataError(f"{flag} {path}: {exc.strerror or exc}") from None


def jsonl_bytes(root: Path, field: str, flag: str = "--data") -> bytes:
    """The texts of a JSONL corpus joined by a newline, in memory (at most ``IN_MEMORY_TEXT`` bytes)."""
    out, total, limit = [], 0, IN_MEMORY_TEXT
    for text in _jsonl_texts(root, field, flag):
        raw = text.encode("utf-8")
        total += len(raw) + 1
        if total > limit:
            raise DataError(
                f"{flag} {root} holds more than {limit >> 20} MiB of text, more than is parsed in memory: "
                f"make token shards once with `cleave data prepare {root} --out DIR` and pass --data DIR"
            )
        out.append(raw)
    return b"\n".join(out)


def _shard_segments(root: Path, dtype: str | None, flag: str) -> tuple[list[Segment], int | None]:
    """Shards and the vocabulary their ``shards.json`` states (None without one)."""
    if root.is_dir() and (root / shards.META).is_file():
        segments, meta = shards.from_meta(root)
        return segments, meta.vocab_size
    files = [root] if root.is_file() else _files(root, shards.SHARD_SUFFIXES)
    listed = _listed_dtype(root) if root.is_file() else None
    segments = []
    for path in files:
        if path.suffix == shards.NPY:
            segments.append(shards.npy_segment(path))
            continue
        bin_dtype = dtype or (listed[0] if listed else None)
        if bin_dtype is None:
            raise DataError(
                f"{flag} {path}: a .bin shard is raw ids; say their dtype with --data-dtype uint16|uint32 "
                f"(or keep the {shards.META} that `cleave data prepare` writes beside it)"
            )
        segments.append(shards.bin_segment(path, bin_dtype))
    return segments, (listed[1] if listed and dtype is None else None)


def _listed_dtype(path: Path) -> tuple[str, int] | None:
    """A single shard's dtype and vocabulary from the ``shards.json`` beside it, if it lists it."""
    meta_path = path.parent / shards.META
    if not meta_path.is_file():
        return None
    meta = shards.Meta.read(meta_path)
    if any(s.get("file") == path.name for s in meta.shards):
        return meta.dtype, meta.vocab_size
    return None


def stated_vocab(source: str) -> int | None:
    """The vocabulary the ``shards.json`` of token shards states (a folder of them, or the one
    beside a ``.bin``), None for anything else."""
    root = Path(source).expanduser()
    if root.is_dir() and (root / shards.META).is_file():
        return shards.Meta.read(root / shards.META).vocab_size
    if root.is_file() and root.suffix in shards.SHARD_SUFFIXES:
        listed = _listed_dtype(root)
        return listed[1] if listed else None
    return None


def open_tokens(
    source: str,
    *,
    vocab_size: int | None,
    tokenize: Tokenize | None,
    field: str = "text",
    dtype: str | None = None,
    flag: str = "--data",
) -> TokenStream:
    """``source`` as the model's token ids. ``vocab_size`` (None: unknown) bounds every id: a
    shard set whose ``shards.json`` states a larger vocabulary is refused here, and every
    window read is checked as it is read (a bad id stops the job at the window that holds it)."""
    root = Path(source).expanduser()
    if not root.exists():
        raise DataError(f"{flag} {source}: no such file or folder")
    kind = kind_of(root)
    if dtype is not None and kind is not Kind.SHARDS:
        raise DataError(f"--data-dtype is for .bin token shards; {flag} {source} holds {kind.value}")
    if kind is Kind.SHARDS:
        segments, stated = _shard_segments(root, dtype, flag)
        if stated is not None and vocab_size is not None and stated > vocab_size:
            raise DataError(
                f"{flag} {source}: shards of a vocabulary of {stated:,} do not fit the model's {vocab_size:,} "
                "(prepared with another tokenizer? a preset takes the shards' vocabulary from --data as given "
                "on the command line)"
            )
        if stated is None and vocab_size is not None:  # raw ids: refused now, not hours in
            top = _max_id(segments)
            if top >= vocab_size:
                raise DataError(
                    f"{flag} {source} holds token id {top:,}, beyond the model's vocabulary of {vocab_size:,} and "
                    f"with no {shards.META} to state one: pass --vocab-size (at least {top + 1:,}, the tokenizer's "
                    "size) for a preset"
                )
        stream = TokenStream(segments, vocab_size, str(root))
    elif kind is Kind.JSONL:
        stream = in_memory(_ids(jsonl_bytes(root, field, flag), tokenize), vocab_size, str(root))
    elif tokenize is None:
        stream = TokenStream(_text_segments(root, flag), vocab_size, str(root))
    else:
        stream = in_memory(_ids(_small_text(root, flag), tokenize), vocab_size, str(root))
    if len(stream) == 0:
        raise DataError(f"{flag} {source} holds no tokens")
    return stream


SCAN_IDS = 1 << 22  # ids read at once by _max_id: 16 MiB of uint32


def _max_id(segments: list[Segment]) -> int:
    """The largest id of shards on disk (a negative one is refused as it is read later), read
    ``SCAN_IDS`` at a time: one pass over the data in bounded memory (about 1 s a GB)."""
    top = -1
    for seg in segments:
        for lo in range(0, seg.length, SCAN_IDS):
            n = min(SCAN_IDS, seg.length - lo)
            if seg.path is None:
                part = seg.array[lo : lo + n] if seg.array is not None else np.zeros(0, dtype=np.int64)
            else:
                part = np.fromfile(seg.path, dtype=seg.dtype, count=n, offset=seg.offset + lo * seg.dtype.itemsize)
            if part.size:
                top = max(top, int(part.max()))
    return top


def _small_text(root: Path, flag: str) -> bytes:
    """Text a tokenizer will read in memory: refused beyond ``IN_MEMORY_TEXT`` bytes."""
    total = sum(s.length for s in _text_segments(root, flag))
    if total > IN_MEMORY_TEXT:
        raise DataError(
            f"{flag} {root} holds {total / 2**20:.0f} MiB of text, more than is tokenized in memory "
            f"({IN_MEMORY_TEXT >> 20} MiB): make token shards once with `cleave data prepare {root} --out DIR "
            "--model MODEL` and pass --data DIR"
        )
    return load_corpus(root, max_bytes=IN_MEMORY_TEXT + 1)


def _ids(text: bytes, tokenize: Tokenize | None) -> np.ndarray:
    if tokenize is None:
        return np.frombuffer(text, dtype=np.uint8)
    return np.asarray(tokenize(text))


@dataclass(frozen=True)
class Split:
    """The training part and the held-out part (None: nothing held out) of a job's data."""

    train: View
    held_out: View | None


def split(stream: TokenStream, val: TokenStream | None, fraction: float, seq_len: int) -> Split:
    """``--val-data`` as the held-out part, else the last ``fraction`` of ``stream`` (at least
    one window, ``seq_len + 1`` ids): training windows end before it, so none crosses into it."""
    window = seq_len + 1
    if val is not None:
        if len(val) < window:
            raise DataError(f"--val-data of {len(val)} tokens is shorter than --seq-len {seq_len} + 1")
        return Split(View.whole(stream), View.whole(val))
    if fraction <= 0:
        return Split(View.whole(stream), None)
    held = max(math.ceil(len(stream) * fraction), window)
    if len(stream) - held <= window:
        raise DataError(
            f"a corpus of {len(stream):,} tokens leaves {max(0, len(stream) - held):,} for training once "
            f"--val-fraction {fraction:g} (at least one window of {window}) is held out; pass a longer --data, "
            "--val-data, or --val-fraction 0"
        )
    cut = len(stream) - held
    return Split(View(stream, 0, cut), View(stream, cut, len(stream)))


FINGERPRINT_EDGE = 64 << 10  # bytes of each file's start and end a data fingerprint hashes


def fingerprint(data: Split) -> dict[str, Any]:
    """A cheap identity of a job's data, kept in each checkpoint so a resume on other data is
    refused: each segment's name (relative to ``--data``), size and a hash of its first and last
    ``FINGERPRINT_EDGE`` bytes (the files' order counts), and the held-out part's length. Reads
    128 KiB a file."""
    stream = data.train.stream
    root = Path(stream.name)
    segments = []
    for seg in stream.segments:
        digest = hashlib.sha256()
        size = seg.length * seg.dtype.itemsize
        if seg.path is None:
            raw = seg.array.tobytes() if seg.array is not None else b""
            digest.update(raw[:FINGERPRINT_EDGE] + raw[max(FINGERPRINT_EDGE, size - FINGERPRINT_EDGE) :])
            name = ""
        else:
            with open(seg.path, "rb") as f:
                f.seek(seg.offset)
                digest.update(f.read(min(size, FINGERPRINT_EDGE)))
                if size > FINGERPRINT_EDGE:
                    f.seek(seg.offset + max(FINGERPRINT_EDGE, size - FINGERPRINT_EDGE))
                    digest.update(f.read(FINGERPRINT_EDGE))
            name = seg.path.relative_to(root).as_posix() if seg.path.is_relative_to(root) else seg.path.name
        segments.append([name, size, digest.hexdigest()[:16]])
    return {"segments": segments, "held_out": len(data.held_out) if data.held_out is not None else 0}


def _as_view(data: bytes | torch.Tensor | np.ndarray | View) -> View:
    if isinstance(data, View):
        return data
    if isinstance(data, bytes | bytearray):
        ids = np.frombuffer(bytes(data), dtype=np.uint8)
    elif isinstance(data, torch.Tensor):
        ids = data.cpu().numpy()
    else:
        ids = np.asarray(data)
    return View.whole(in_memory(ids, None, "the corpus"))


def _windows(part: View, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = np.stack([part.read(int(s), seq_len + 1) for s in starts])  # (B, T + 1)
    return torch.from_numpy(np.ascontiguousarray(w[:, :-1])), torch.from_numpy(np.ascontiguousarray(w[:, 1:]))


class ByteBatches:
    """Random windows of the training part (token ids; bytes for a byte-level model): each
    step's starts drawn from the injected RNG, so a seed, and the RNG's state in a checkpoint,
    fix every batch."""

    def __init__(
        self, data: bytes | torch.Tensor | np.ndarray | View, seq_len: int, batch_size: int, rng: np.random.Generator
    ) -> None:
        self.part = _as_view(data)
        if len(self.part) <= seq_len + 1:
            raise DataError(f"corpus of {len(self.part)} tokens is shorter than --seq-len {seq_len} + 1")
        self.seq_len, self.batch_size, self.rng = seq_len, batch_size, rng

    def starts(self) -> np.ndarray:
        """The next batch's window starts (draws from the RNG)."""
        return self.rng.integers(0, len(self.part) - self.seq_len - 1, size=self.batch_size)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        return _windows(self.part, self.starts(), self.seq_len)  # (B, T) each, int64


class HeldOut:
    """``batches`` fixed batches of the held-out part: windows spread evenly over it, the same
    at every evaluation and drawn from no RNG. They are read (and their ids checked against the
    vocabulary) once, here: a bad id stops the job before its first step, not after an optimizer
    step at each evaluation. Held in memory: batches x batch_size x (seq_len + 1) int64 ids
    (4 x 64 x 1025 x 8 bytes = 2 MiB at --batch-size 64 --seq-len 1024)."""

    def __init__(self, part: View, seq_len: int, batch_size: int, batches: int) -> None:
        last = len(part) - seq_len - 1  # the last start whose window fits
        n = batch_size * batches
        self.part, self.seq_len, self.batch_size = part, seq_len, batch_size
        self.starts = np.linspace(0, last, n).round().astype(np.int64) if n > 1 else np.zeros(n, dtype=np.int64)
        self._x, self._y = _windows(part, self.starts, seq_len)  # (batches * B, T) each

    def __len__(self) -> int:
        return len(self.starts) // self.batch_size

    def batch(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = slice(k * self.batch_size, (k + 1) * self.batch_size)
        return self._x[rows], self._y[rows]
