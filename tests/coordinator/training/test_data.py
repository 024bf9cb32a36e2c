"""Training data (coordinator/training/data.py, tokens.py, shards.py, prepare.py): every format
read as numpy reads the same files, errors in one line, the held-out split and its evaluation,
a resumed job's batches, and ``cleave data prepare``."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_training import TiledLocalEngine
from typer.testing import CliRunner

from cleave.cli.app import app
from cleave.coordinator.net.remote import RemoteEngine
from cleave.coordinator.net.server import Server
from cleave.coordinator.training import data as corpora
from cleave.coordinator.training import prepare as prep
from cleave.coordinator.training import shards
from cleave.coordinator.training.data import ByteBatches, HeldOut, load_corpus, open_tokens, split
from cleave.coordinator.training.loop import TrainConfig, Trainer, open_data, with_data_vocab
from cleave.coordinator.training.tokens import DataError, View
from cleave.wire.errors import ConfigError
from cleave.wire.messages import WireDtype
from tests.coordinator.engine.test_core import Fleet as CoreFleet
from tests.coordinator.engine.test_core import make_core

SMALL = {"model": "tiny", "batch_size": 4, "seq_len": 16}


def _read_all(stream: corpora.TokenStream, step: int = 997) -> np.ndarray:
    """The stream read back in windows of an awkward size (crossing every segment's edge)."""
    return np.concatenate([stream.read(s, min(step, len(stream) - s)) for s in range(0, len(stream), step)])


def _bins(tmp: Path, dtype: str, sizes: list[int], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = []
    for i, n in enumerate(sizes):
        ids = rng.integers(0, 1000, size=n).astype(dtype)
        ids.tofile(tmp / f"part-{i}.bin")
        arrays.append(ids)
    return arrays


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_shards_read_as_numpy_reads_the_same_files(tmp_path: Path, dtype: str) -> None:
    _bins(tmp_path, dtype, [1500, 7, 2300])
    want = np.concatenate([np.fromfile(tmp_path / f"part-{i}.bin", dtype=dtype) for i in range(3)])
    stream = open_tokens(str(tmp_path), vocab_size=1000, tokenize=None, dtype=dtype)
    assert len(stream) == len(want)
    assert np.array_equal(_read_all(stream), want)
    assert np.array_equal(stream.read(1495, 20), want[1495:1515])  # across two shard edges


def test_npy_shards_read_as_numpy_loads_them(tmp_path: Path) -> None:
    a, b = np.arange(50, 1050, dtype=np.int32), np.arange(3000, dtype=np.uint16)[::-1].copy()
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    stream = open_tokens(str(tmp_path), vocab_size=None, tokenize=None)
    want = np.concatenate([np.load(tmp_path / "a.npy", mmap_mode="r"), np.load(tmp_path / "b.npy", mmap_mode="r")])
    assert np.array_equal(_read_all(stream), want)


def test_a_text_folder_streams_the_bytes_it_would_have_read_into_memory(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("hello world\n" * 300)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("more text, é and ü " * 200)
    (tmp_path / "blob.dat").write_bytes(b"\xff\xfe\x00" * 10)  # not text: skipped (a .bin would be a shard)
    stream = open_tokens(str(tmp_path), vocab_size=256, tokenize=None)
    assert all(seg.array is None or seg.length == 1 for seg in stream.segments)  # files stay on disk
    assert _read_all(stream).astype(np.uint8).tobytes() == load_corpus(tmp_path)


def test_jsonl_reads_the_named_field_of_every_record(tmp_path: Path) -> None:
    records = [{"text": "first doc", "id": 1}, {"body": "x", "text": "second, ü"}, {"text": "third"}]
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    stream = open_tokens(str(path), vocab_size=256, tokenize=None)
    assert _read_all(stream).astype(np.uint8).tobytes() == "first doc\nsecond, ü\nthird".encode()
    with pytest.raises(DataError, match=r"docs.jsonl, line 1: no text field 'body' \(--data-field\)"):
        open_tokens(str(path), vocab_size=256, tokenize=None, field="body")


def _write_meta(folder: Path, dtype: str, vocab: int, files: list[tuple[str, int]]) -> None:
    shards.Meta(
        dtype, vocab, sum(n for _, n in files), [{"file": f, "tokens": n} for f, n in files], "bytes", "t"
    ).write(folder)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: (d / "x.bin").write_bytes(b"\x01\x00\x02"), "not a whole number of uint16 ids"),
        (lambda d: (d / "x.bin").write_bytes(b""), "holds no tokens"),
        (lambda d: np.save(d / "x.npy", np.ones(10, dtype=np.float32)), "float32 array"),
        (lambda d: np.save(d / "x.npy", np.ones((2, 5), dtype=np.int32)), r"shape \(2, 5\)"),
        (lambda d: _write_meta(d, "uint16", 70_000, []), "does not fit its dtype uint16"),
        (lambda d: _write_meta(d, "uint16", 50_000, []), "vocabulary of 50,000 do not fit the model's 256"),
        (
            lambda d: (np.zeros(4, np.uint16).tofile(d / "s.bin"), _write_meta(d, "uint16", 256, [("s.bin", 5)])),
            "says 5",
        ),
    ],
)
def test_a_bad_shard_is_refused_in_one_line(tmp_path: Path, make, message: str) -> None:
    make(tmp_path)
    with pytest.raises(DataError, match=message) as err:
        open_tokens(
            str(tmp_path), vocab_size=256, tokenize=None, dtype=None if (tmp_path / "x.npy").exists() else "uint16"
        )
    assert "\n" not in str(err.value)


def test_bin_without_a_dtype_and_ids_beyond_the_vocabulary_are_refused(tmp_path: Path) -> None:
    ids = np.arange(600, dtype=np.uint16)  # ids up to 599: beyond a byte model's 256 from position 256 on
    ids.tofile(tmp_path / "s.bin")
    with pytest.raises(DataError, match="--data-dtype uint16"):
        open_tokens(str(tmp_path / "s.bin"), vocab_size=256, tokenize=None)
    with pytest.raises(DataError, match=r"holds token id 599, .* pass --vocab-size \(at least 600"):
        open_tokens(str(tmp_path / "s.bin"), vocab_size=256, tokenize=None, dtype="uint16")  # raw: scanned at open
    assert len(open_tokens(str(tmp_path / "s.bin"), vocab_size=600, tokenize=None, dtype="uint16")) == 600
    _write_meta(tmp_path, "uint16", 256, [("s.bin", 600)])  # a shards.json that understates its ids
    stream = open_tokens(str(tmp_path), vocab_size=256, tokenize=None)
    assert np.array_equal(stream.read(0, 256), ids[:256])  # checked lazily: each window as it is read
    with pytest.raises(DataError, match=r"s.bin \(near token 250\) holds token id 265, outside .* 256"):
        stream.read(250, 16)
    with pytest.raises(DataError, match="--data-dtype is for .bin"):
        (tmp_path / "t.txt").write_text("text " * 20)
        open_tokens(str(tmp_path / "t.txt"), vocab_size=256, tokenize=None, dtype="uint16")


def test_big_text_for_a_tokenizer_points_at_cleave_data_prepare(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(corpora, "IN_MEMORY_TEXT", 1000)
    (tmp_path / "big.txt").write_text("word " * 400)
    with pytest.raises(DataError, match="cleave data prepare"):
        open_tokens(str(tmp_path / "big.txt"), vocab_size=300, tokenize=lambda b: np.zeros(1))
    (tmp_path / "big.jsonl").write_text(json.dumps({"text": "word " * 400}) + "\n")
    with pytest.raises(DataError, match="cleave data prepare"):
        open_tokens(str(tmp_path / "big.jsonl"), vocab_size=256, tokenize=None)


def test_held_out_windows_never_share_a_token_with_training_windows() -> None:
    stream = corpora.in_memory(np.arange(5000) % 256, 256, "t")
    parts = split(stream, None, 0.01, seq_len=16)
    assert parts.held_out is not None and len(parts.held_out) == 50 and parts.train.hi == parts.held_out.lo == 4950
    batches = ByteBatches(parts.train, 16, 64, np.random.default_rng(0))
    ends = max(int(s) + 17 for _ in range(200) for s in batches.starts())
    assert ends <= parts.train.hi  # the furthest training window ends before the held-out part
    held = HeldOut(parts.held_out, 16, 4, 3)
    assert held.starts.min() == 0 and held.starts.max() + 17 == len(parts.held_out)  # spread over all of it
    # A tiny fraction still holds out one whole window; --val-data leaves the corpus whole.
    assert len(split(stream, None, 1e-9, seq_len=16).held_out) == 17
    assert split(stream, stream, 0.01, seq_len=16).train == View.whole(stream)
    assert split(stream, None, 0.0, seq_len=16).held_out is None
    with pytest.raises(DataError, match="a corpus of 30 tokens leaves 13 for training"):
        split(corpora.in_memory(np.arange(30), 256, "t"), None, 0.5, seq_len=16)


def test_a_job_that_never_evaluates_holds_nothing_out_and_one_that_does_evaluates_its_last_step() -> None:
    corpus = b"abcdefgh" * 200
    never = open_data(TrainConfig(**SMALL, eval_every=0), corpus)
    assert never.held_out is None and len(never.train) == len(corpus)  # --val-fraction left at 0.01
    held = open_data(TrainConfig(**SMALL, eval_every=2), corpus)
    assert held.held_out is not None and len(held.train) == len(corpus) - 17  # 1% is less than one window
    results = Trainer(TrainConfig(**SMALL, steps=3, eval_every=2, eval_batches=1), corpus=corpus).run()
    assert [("val_loss" in r.extra) for r in results] == [False, True, True]  # every 2 steps and the last


def test_an_id_outside_the_vocabulary_in_the_held_out_part_stops_the_job_before_its_first_step(
    tmp_path: Path,
) -> None:
    ids = np.random.default_rng(0).integers(0, 1000, size=5000).astype(np.uint16)
    ids[-1] = 5000  # in the last held-out window only
    ids.tofile(tmp_path / "part-0.bin")
    cfg = TrainConfig(**SMALL, steps=4, data=str(tmp_path), data_dtype="uint16", vocab_size=1000, eval_every=2)
    with pytest.raises(DataError, match="holds token id 5,000, beyond the model's vocabulary of 1,000"):
        Trainer(cfg)  # read once, here: not after an optimizer step, at each resume's evaluation


def test_a_resumed_trainer_draws_exactly_the_windows_of_an_uninterrupted_one(tmp_path: Path) -> None:
    _bins(tmp_path, "uint16", [3000, 2000], seed=1)
    cfg = TrainConfig(**SMALL, steps=6, data=str(tmp_path), data_dtype="uint16", vocab_size=1000, eval_every=0)
    straight = Trainer(cfg)
    windows = [straight.batches.next() for _ in range(6)]  # what six steps draw, uninterrupted
    first = Trainer(cfg)
    for _ in range(3):
        first.train_step()
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)  # as a checkpoint file holds it
    buffer.seek(0)
    again = Trainer(cfg)
    again.load_state_dict(torch.load(buffer, weights_only=False))
    for x, y in windows[3:]:
        x2, y2 = again.batches.next()
        assert torch.equal(x, x2) and torch.equal(y, y2)


def test_a_checkpoint_of_another_corpus_is_refused(tmp_path: Path) -> None:
    cfg = TrainConfig(**SMALL, steps=2)
    state = Trainer(cfg, corpus=b"abcdefgh" * 100).state_dict()
    with pytest.raises(ConfigError, match="the corpus changed since the checkpoint: 783 training tokens then, 1,583"):
        Trainer(cfg, corpus=b"abcdefgh" * 200).load_state_dict(state)


def test_a_checkpoint_of_the_same_shards_in_another_order_or_content_is_refused(tmp_path: Path) -> None:
    _bins(tmp_path, "uint16", [3000, 3000])
    cfg = TrainConfig(**SMALL, steps=2, data=str(tmp_path), data_dtype="uint16", vocab_size=1000)
    trainer = Trainer(cfg)
    state = trainer.state_dict()
    trainer.load_state_dict(state)  # the same files: resumed
    assert corpora.fingerprint(open_data(cfg)) == state["data_fingerprint"]
    (tmp_path / "part-0.bin").rename(tmp_path / "part-2.bin")  # same sizes and ids, another order
    again = Trainer(cfg)
    with pytest.raises(ConfigError, match=r"^the corpus changed since the checkpoint \(its files"):
        again.load_state_dict(state)
    old = {k: v for k, v in state.items() if k != "data_fingerprint"}  # a checkpoint from before the fingerprint
    again.load_state_dict(old)  # today's check only: the same length, resumed
    (tmp_path / "part-2.bin").rename(tmp_path / "part-0.bin")
    with open(tmp_path / "part-1.bin", "r+b") as f:  # the same length, another last id
        f.seek(-2, 2)
        f.write(b"\x01\x00" if f.read(2) != b"\x01\x00" else b"\x02\x00")
    assert corpora.fingerprint(open_data(cfg)) != state["data_fingerprint"]


def test_a_shard_folder_with_other_files_and_no_shards_json_is_refused_never_read_as_text(tmp_path: Path) -> None:
    np.frombuffer(b"hello world " * 100, dtype=np.uint8).astype(np.uint16).tofile(tmp_path / "train.bin")
    (tmp_path / "readme.md").write_text("nanoGPT data\n")
    with pytest.raises(DataError, match=r"token shards \(train.bin\) and other files \(readme.md\).*--val-data"):
        open_tokens(str(tmp_path), vocab_size=256, tokenize=None, dtype="uint16")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"vocab_size": "300"}, "vocab_size is '300', not a int"),
        ({"shards": {"s.bin": 10}}, "shards is .*not a list"),
        ({"shards": [{"file": "../s.bin", "tokens": 10}]}, "file '../s.bin' is not a file name"),
        ({"shards": [{"file": "s.bin", "tokens": "10"}]}, "tokens '10' is not a count"),
        ({"shards": ["s.bin"]}, "shard 0's file None"),
        ({"extra": []}, "extra is"),
    ],
)
def test_a_malformed_shards_json_is_refused_in_one_line(tmp_path: Path, change: dict, message: str) -> None:
    np.zeros(10, dtype=np.uint16).tofile(tmp_path / "s.bin")
    _write_meta(tmp_path, "uint16", 256, [("s.bin", 10)])
    raw = json.loads((tmp_path / shards.META).read_text())
    (tmp_path / shards.META).write_text(json.dumps(raw | change))
    with pytest.raises(DataError, match=message) as err:
        open_tokens(str(tmp_path), vocab_size=256, tokenize=None)
    assert "\n" not in str(err.value)
    (tmp_path / shards.META).write_text("[1, 2]")
    with pytest.raises(DataError, match="not a JSON object"):
        open_tokens(str(tmp_path), vocab_size=256, tokenize=None)


def test_a_vocab_size_that_differs_from_the_shards_json_is_refused(tmp_path: Path) -> None:
    np.zeros(3000, dtype=np.uint16).tofile(tmp_path / "s.bin")
    _write_meta(tmp_path, "uint16", 300, [("s.bin", 3000)])
    with pytest.raises(ConfigError, match=r"^--vocab-size 512 differs from the vocabulary of 300"):
        with_data_vocab(TrainConfig(**SMALL, steps=1, data=str(tmp_path), vocab_size=512))
    assert with_data_vocab(TrainConfig(**SMALL, steps=1, data=str(tmp_path), vocab_size=300)).vocab_size == 300


def test_prepare_keeps_a_long_line_of_multibyte_characters_whole(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(prep, "CHUNK_BYTES", 7)  # a line far longer than 4 chunks, cut mid-character if careless
    text = "a" + "é€😀" * 40
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text(text)
    chunks = [c for doc, _ in prep.documents(src, "text") for c in doc]
    assert len(chunks) > 5 and all(c.decode("utf-8") for c in chunks)  # strict: no character cut
    assert b"".join(chunks).decode("utf-8") == text


def _reference_val_loss(model: torch.nn.Module, held: HeldOut) -> float:
    """Plain torch: the mean of each held-out batch's cross-entropy, no engine, no gradients."""
    model.eval()
    with torch.no_grad():
        losses = []
        for k in range(len(held)):
            x, y = held.batch(k)
            logits, _ = model(x, None)
            losses.append(F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)).item())
    return sum(losses) / len(losses)


class _InProcessServer:
    """Stands for the event loop and the server: the real ``Server.submit`` into a real Core,
    whose GEMMs honest in-process devices compute at once."""

    submit = Server.submit
    start = Server.start

    def __init__(self) -> None:
        self.core = make_core()
        self.fleet = CoreFleet(self.core)
        # (bf16 blocks multiplied in float32: torch's bf16 matmul on a CPU is slow)
        self.fleet.join("a", lambda a, b: (a.float() @ b.float()).to(a.dtype), slots=4)
        self._aborted, self._pending = None, set()

    def clock(self) -> float:
        return self.fleet.now

    def deliver(self, out: list) -> None:
        self.fleet.route(out)

    def call_soon_threadsafe(self, fn, *args) -> None:  # type: ignore[no-untyped-def]
        fn(*args)
        self.fleet.drain()


def test_an_evaluation_leaves_no_activations_on_devices_nor_their_copies_at_the_coordinator() -> None:
    """Training's forward keeps X on devices till its dW reads it; an evaluation has no dW, so
    its activations go with each GEMM (they once stayed till the next step: every batch's)."""
    server = _InProcessServer()
    engine = RemoteEngine(server=server, loop=server, wire=WireDtype.BF16)  # type: ignore[arg-type]
    cfg = TrainConfig(**SMALL, steps=2, eval_every=2, eval_batches=1, val_fraction=0.1)
    trainer = Trainer(cfg, engine, corpus=load_corpus(max_bytes=20_000))
    kept = []  # the sources a step leaves on devices (training's: its GEMMs kept home, swept next step)
    for _ in range(2):
        result = trainer.train_step()
        kept.append(sorted(s.storage.nbytes() for s in server.core.intake.sources._live.values()))
    assert "val_loss" in result.extra and kept[1] == kept[0]  # the same step plus an evaluation
    params = {id(p) for p in trainer.model.parameters()}
    assert all(id(base) in params for base, _ in engine._casts.values())  # the weights' copies only


def test_evaluation_through_the_engine_equals_plain_torch_and_leaves_training_as_it_was() -> None:
    corpus = load_corpus(max_bytes=60_000)
    evaluating = TrainConfig(**SMALL, steps=4, eval_every=2, eval_batches=3, micro_batches=2)
    engine = TiledLocalEngine()
    trainer = Trainer(evaluating, engine, corpus=corpus)
    results = trainer.run()
    assert [("val_loss" in r.extra) for r in results] == [False, True, False, True]
    assert engine.kinds[-1] == "fwd"  # the evaluation's GEMMs, last, went through the engine
    plain = Trainer(TrainConfig(**SMALL, steps=4, eval_every=2, eval_batches=3), corpus=corpus)
    plain.run()
    assert trainer.held_out is not None
    want = _reference_val_loss(plain.model, trainer.held_out)
    assert results[-1].extra["val_loss"] == pytest.approx(want, rel=1e-5)
    # The same training, step for step, as a job that evaluates only after its last step (the
    # same held-out part; one that never evaluates holds nothing out).
    once = TrainConfig(**SMALL, steps=4, eval_every=1000, eval_batches=3, micro_batches=2)
    never = Trainer(once, TiledLocalEngine(), corpus=corpus)
    assert [r.loss for r in never.run()] == [r.loss for r in results]
    assert never.batches.rng.bit_generator.state == trainer.batches.rng.bit_generator.state
    assert torch.equal(never.model.head.weight, trainer.model.head.weight)


def test_a_preset_on_bpe_shards_takes_their_vocabulary(tmp_path: Path) -> None:
    np.arange(0, 3000, dtype=np.uint16).__mod__(300).astype(np.uint16).tofile(tmp_path / "s.bin")
    _write_meta(tmp_path, "uint16", 300, [("s.bin", 3000)])
    cfg = TrainConfig(**SMALL, steps=1, data=str(tmp_path))
    with pytest.raises(DataError, match="vocabulary of 300 do not fit the model's 256"):
        open_data(cfg)
    sized = with_data_vocab(cfg)
    assert sized.vocab_size == 300 and sized.to_dict()["vocab_size"] == 300  # stored with the job
    trainer = Trainer(sized)
    assert trainer.model.head.weight.shape[0] == 300
    assert trainer.train_step().loss == pytest.approx(np.log(300), rel=0.05)
    with pytest.raises(ConfigError, match="^vocab_size must be 0 .* or 2 to 2\\^32 for a preset; got 300"):
        TrainConfig(model="custom:mine", vocab_size=300)


def test_prepare_with_a_preset_writes_the_bytes_the_folder_holds(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("def f():\n    return 1\n" * 50)
    (src / "b.txt").write_text("ünïcode text\n" * 30)
    out = tmp_path / "out"
    out.mkdir()
    meta = prep.prepare(src, out, prep.model_encoder("tiny"), shard_tokens=500)
    assert (meta.dtype, meta.vocab_size, meta.tokenizer) == ("uint16", 256, "bytes") and len(meta.shards) > 2
    ids = np.concatenate([np.fromfile(out / s["file"], dtype="<u2") for s in meta.shards])
    assert ids.astype(np.uint8).tobytes() == load_corpus(src)
    stream = open_tokens(str(out), vocab_size=256, tokenize=None)
    assert np.array_equal(_read_all(stream), ids)


def test_cleave_data_prepare_trains_a_bpe_whose_shards_decode_to_the_corpus(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    text = "def add(a, b):\n    return a + b  # ü\n" * 80
    (tmp_path / "code.txt").write_text(text)
    out = tmp_path / "shards"
    result = CliRunner().invoke(
        app,
        ["data", "prepare", str(tmp_path / "code.txt"), "--out", str(out), "--train-tokenizer", "--vocab-size", "280"],
    )
    assert result.exit_code == 0, result.output
    assert "train on them with --data" in result.output
    meta = shards.Meta.read(out / shards.META)
    tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    assert meta.vocab_size == tok.get_vocab_size() <= 280  # (fewer when the corpus runs out of merges)
    assert meta.dtype == "uint16" and meta.tokenizer == "tokenizer.json"
    ids = np.fromfile(out / meta.shards[0]["file"], dtype="<u2")
    assert len(ids) == meta.tokens < len(text.encode()) / 2  # merges learned
    assert tok.decode(ids.tolist()) == text
    again = CliRunner().invoke(app, ["data", "prepare", str(tmp_path / "code.txt"), "--out", str(out)])
    assert again.exit_code == 2 and "is not an empty folder" in again.output
