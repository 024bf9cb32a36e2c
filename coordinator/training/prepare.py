"""``cleave data prepare``: text or JSONL tokenized once into token shards (``shards.py``).

The ids come from one of: the bytes themselves (a preset's vocabulary, 256), a model's
tokenizer (``hf:DIR``), a tokenizer file or folder (``--tokenizer``), or a byte-level BPE
trained here on the corpus (``--train-tokenizer``, the ``tokenizers`` library), saved beside
the shards as ``tokenizer.json``. Documents (files, JSONL records) are separated by the
tokenizer's end-of-text id (a newline for bytes, as ``--data`` joins text files).

Memory: one chunk of text (``CHUNK_BYTES``, cut at a line's end) and its ids at a time, plus the
tokenizer; training a BPE also holds the ``tokenizers`` trainer's word counts, which grow with
the corpus's distinct words, not its size.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cleave.coordinator.training import data as corpora
from cleave.coordinator.training import hf, models
from cleave.coordinator.training.shards import META, SHARD_SUFFIXES, Meta, ShardWriter, dtype_for
from cleave.coordinator.training.tokens import DataError

CHUNK_BYTES = 1 << 20  # text tokenized at a time
SHARD_TOKENS = 1 << 27  # ids a shard holds at most (256 MiB of uint16)
END_OF_TEXT = "<|endoftext|>"  # a trained tokenizer's one special token, between documents
TOKENIZER_FILE = "tokenizer.json"
MIN_TRAINED_VOCAB = 260  # the 256 byte symbols, the end-of-text token and a few merges
MAX_TRAINED_VOCAB = 1 << 20

Progress = Callable[[int, int], None]  # (bytes read, bytes in all)


@dataclass(frozen=True)
class Encoder:
    """Text to ids, the vocabulary they index, the id between documents and the name stored."""

    encode: Callable[[str], list[int]] | None  # None: the UTF-8 bytes are the ids
    vocab_size: int
    separator: list[int]
    name: str


BYTES = Encoder(None, hf.BYTE_VOCAB, [corpora.NEWLINE], "bytes")


def _chunks(path: Path) -> Iterator[bytes]:
    """A text file in chunks of about ``CHUNK_BYTES``, each cut after a newline where there is one."""
    with open(path, "rb") as f:
        rest = b""
        while block := f.read(CHUNK_BYTES):
            block = rest + block
            cut = block.rfind(b"\n") + 1
            if cut == 0 and len(block) < 4 * CHUNK_BYTES:  # a very long line: keep reading it
                rest = block
                continue
            cut = cut or _char_boundary(block)
            yield block[:cut]
            rest = block[cut:]
        if rest:
            yield rest


def _char_boundary(block: bytes) -> int:
    """The end of ``block`` moved back before a UTF-8 character it cuts (a chunk is decoded on
    its own, so a cut character would become U+FFFD); ``len(block)`` when no character is cut."""
    cut = len(block)
    back = 0
    while back < 3 and cut - back > 0 and block[cut - back - 1] & 0xC0 == 0x80:
        back += 1  # continuation bytes 10xxxxxx at the end
    lead = cut - back - 1
    if lead < 0 or block[lead] < 0xC0:
        return cut  # ASCII or stray continuation bytes: nothing to keep whole
    need = 2 if block[lead] < 0xE0 else 3 if block[lead] < 0xF0 else 4
    return lead if back + 1 < need else cut


def documents(source: Path, field: str) -> Iterator[tuple[Iterator[bytes], int]]:
    """Each document of ``source`` as its chunks of UTF-8 text, with the bytes it spans on disk."""
    kind = corpora.kind_of(source)
    if kind is corpora.Kind.SHARDS:
        raise DataError(f"{source} holds token shards already; prepare reads text or JSONL")
    if kind is corpora.Kind.JSONL:
        for path in [source] if source.is_file() else corpora._files(source, (corpora.JSONL,)):
            for text in corpora._jsonl_texts(path, field, "prepare"):
                raw = text.encode("utf-8")
                yield iter([raw]), len(raw) + 1
        return
    for seg in corpora._text_segments(source, "prepare"):
        if seg.path is not None:
            yield _chunks(seg.path), seg.length


def total_bytes(source: Path) -> int:
    if source.is_file():
        return source.stat().st_size
    return sum(p.stat().st_size for p in corpora._files(source, None))


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


TOKENIZER_KEY = "tokenizer"  # a checkpoint's record of a preset job's tokenizer (recorded_tokenizer)
# A tokenizer folder's files that decide its ids (hashed; its model weights, if any, are not).
TOKENIZER_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")


def data_tokenizer(data: str | None) -> Path | None:
    """Where the tokenizer of a preset job's token shards is: the file or folder their
    ``shards.json`` names (``tokenizer.json`` beside them, a ``--tokenizer`` path, an ``hf:DIR``);
    None for bytes (text, or shards of bytes). DataError if it names one that is gone."""
    if data is None:
        return None
    root = Path(data).expanduser()
    folder = root if root.is_dir() else root.parent
    if not (folder / META).is_file() or (root.is_file() and root.suffix not in SHARD_SUFFIXES):
        return None
    named = Meta.read(folder / META).tokenizer
    if named == BYTES.name:
        return None
    if named == TOKENIZER_FILE:  # trained by cleave data prepare, saved beside the shards
        where = folder if (folder / "tokenizer_config.json").is_file() else folder / named
    elif hf.is_hf(named):
        where = Path(named[len(hf.PREFIX) :]).expanduser()
    else:  # --tokenizer's file or folder, as given to cleave data prepare
        where = next((p for p in (Path(named).expanduser(), folder / named) if p.exists()), Path(named))
    if not where.exists():
        raise DataError(f"the shards in {folder} were tokenized with {named}, which is not there any more")
    return where


def _tokenizer_sha256(where: Path) -> str:
    digest = hashlib.sha256()
    for path in [where] if where.is_file() else [where / n for n in TOKENIZER_FILES if (where / n).is_file()]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())  # a tokenizer is a few MB at most
    return digest.hexdigest()


def tokenizer_record(data: str | None) -> dict[str, str | None]:
    """What a preset job on ``data`` reads its ids with, recorded at its start (in each
    checkpoint): the tokenizer's absolute path and hash; ``path`` None for bytes; ``missing``
    where the tokenizer its ``shards.json`` names was gone already."""
    try:
        where = data_tokenizer(data)
    except DataError as exc:
        return {"path": None, "sha256": None, "missing": str(exc)}
    if where is None:
        return {"path": None, "sha256": None}
    where = where.resolve()
    return {"path": str(where), "sha256": _tokenizer_sha256(where)}


def recorded_tokenizer(record: dict[str, Any], job: str) -> Path | None:
    """The tokenizer a ``tokenizer_record`` names, checked: DataError when it is gone or has
    changed since; None for bytes."""
    if record.get("missing"):
        raise DataError(f"{job}'s tokenizer was not there when it started: {record['missing']}")
    if record.get("path") is None:
        return None
    where = Path(str(record["path"]))
    if not where.exists():
        raise DataError(f"{job} was trained with the tokenizer {where}, which is not there any more (moved?)")
    if _tokenizer_sha256(where) != record.get("sha256"):
        raise DataError(f"{job} was trained with the tokenizer {where}, which has changed since (another sha256)")
    return where


def model_encoder(model: str) -> Encoder:
    """``--model``: a preset's bytes, or an ``hf:DIR``'s tokenizer (its bytes without one)."""
    if not hf.is_hf(model):
        models.max_seq_len(model)  # an unknown preset is refused by name
        return BYTES
    spec = hf.spec(model)
    if not spec.tokenizer:
        return Encoder(None, spec.vocab_size, [corpora.NEWLINE], "bytes")
    enc = folder_encoder(spec.path)
    return Encoder(enc.encode, spec.vocab_size, enc.separator, model)


def folder_encoder(where: Path) -> Encoder:
    """``--tokenizer``: a ``tokenizer.json`` (or a folder with one), read by ``tokenizers``; else a
    folder ``transformers``' AutoTokenizer reads."""
    file = where / TOKENIZER_FILE if where.is_dir() else where
    if file.is_file():
        import tokenizers

        try:
            tok = tokenizers.Tokenizer.from_file(str(file))
        except Exception as exc:  # the library raises its own Exception for a malformed file
            raise DataError(f"--tokenizer {where}: not a tokenizer file ({str(exc).splitlines()[0]})") from None
        return _from_tokenizers(tok, str(where))
    tf = hf._transformers()
    try:
        auto = tf.AutoTokenizer.from_pretrained(str(where), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError, ImportError) as exc:
        raise DataError(f"--tokenizer {where}: cannot load a tokenizer ({str(exc).splitlines()[0]})") from None
    eos = auto.eos_token_id

    def encode(text: str) -> list[int]:
        return list(auto(text, add_special_tokens=False)["input_ids"])

    return Encoder(encode, len(auto), [eos] if eos is not None else encode("\n"), str(where))


def _from_tokenizers(tok: Any, name: str) -> Encoder:
    eos = tok.token_to_id(END_OF_TEXT)

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    return Encoder(encode, tok.get_vocab_size(), [eos] if eos is not None else encode("\n"), name)


def train_bpe(source: Path, field: str, vocab_size: int, out: Path, progress: Progress | None = None) -> Encoder:
    """A byte-level BPE of ``vocab_size`` ids trained on ``source`` (one pass), saved to
    ``out/tokenizer.json`` (with a ``tokenizer_config.json`` so ``transformers`` loads the folder)."""
    if not MIN_TRAINED_VOCAB <= vocab_size <= MAX_TRAINED_VOCAB:
        raise DataError(f"--vocab-size must be between {MIN_TRAINED_VOCAB} and {MAX_TRAINED_VOCAB:,}, got {vocab_size}")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    total = total_bytes(source)

    def texts() -> Iterator[str]:
        done = 0
        for chunks, size in documents(source, field):
            for chunk in chunks:
                yield _decode(chunk)
            done += size
            if progress is not None:
                progress(min(done, total), total)

    tok.train_from_iterator(texts(), trainer=trainer)
    tok.save(str(out / TOKENIZER_FILE))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": END_OF_TEXT, "bos_token": END_OF_TEXT}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    enc = _from_tokenizers(tok, TOKENIZER_FILE)
    return enc


def prepare(
    source: Path,
    out: Path,
    encoder: Encoder,
    *,
    field: str = "text",
    shard_tokens: int = SHARD_TOKENS,
    progress: Progress | None = None,
) -> Meta:
    """Tokenize ``source`` into shards in ``out`` (which must exist) and write ``shards.json``."""
    dtype = dtype_for(encoder.vocab_size)
    writer = ShardWriter(out, dtype, shard_tokens)
    total, done = total_bytes(source), 0
    separator = np.array(encoder.separator, dtype=np.int64)
    try:
        first = True
        for chunks, size in documents(source, field):
            if not first:
                writer.write(separator)
            first = False
            for chunk in chunks:
                if encoder.encode is None:
                    writer.write(np.frombuffer(chunk, dtype=np.uint8))
                else:
                    ids = np.asarray(encoder.encode(_decode(chunk)), dtype=np.int64)
                    if ids.size and int(ids.max()) >= encoder.vocab_size:
                        raise DataError(
                            f"the tokenizer ({encoder.name}) makes id {int(ids.max())}, beyond the vocabulary of "
                            f"{encoder.vocab_size:,}"
                        )
                    writer.write(ids)
            done += size
            if progress is not None:
                progress(min(done, total), total)
    finally:
        writer.close()
    if writer.tokens == 0:
        raise DataError(f"{source} holds no text to tokenize")
    meta = Meta(
        dtype=dtype,
        vocab_size=encoder.vocab_size,
        tokens=writer.tokens,
        shards=writer.shards,
        tokenizer=encoder.name,
        source=str(source),
    )
    meta.write(out)
    return meta
