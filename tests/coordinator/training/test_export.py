"""``cleave export``: a job's checkpoint out as a folder transformers loads, with the logits of the
model the trainer holds (a preset as a Llama, an ``hf:DIR`` model as its own class), and one-line
errors for what cannot be exported."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from cleave.cli.app import build  # noqa: E402
from cleave.coordinator.engine.books import Books  # noqa: E402
from cleave.coordinator.training import checkpoint  # noqa: E402
from cleave.coordinator.training.export import INFO, llama_config, preset_to_llama  # noqa: E402
from cleave.coordinator.training.loop import StepResult, TrainConfig, Trainer  # noqa: E402
from cleave.coordinator.training.model import ModelConfig, Transformer  # noqa: E402
from cleave.db.sqlite import SQLiteStore  # noqa: E402

REL = 1e-5  # max |logit difference| over max |logit|
CORPUS = b"def add(a, b):\n    return a + b\n\nclass Point:\n    x: float = 0.0\n" * 40
IDS = {"bos_token_id": 0, "eos_token_id": 0}


@dataclass
class Job:
    db: Path
    trainer: Trainer  # after its last step: the model the newest checkpoint holds
    losses: list[float]
    val_losses: list[float]  # held-out losses, as evaluated every --eval-every steps


def train_job(db: Path, cfg: TrainConfig, *, checkpoint_every: int = 2, corpus: bytes | None = CORPUS) -> Job:
    """A job trained in this process through the calls ``coordinator/job.py`` makes: its books
    in SQLite, a step recorded after each step, a checkpoint every ``checkpoint_every`` steps and
    at the last. ``corpus`` None: the job's ``--data``."""
    store = SQLiteStore(db)
    books = Books.create(store, f"{cfg.model} x {cfg.steps} steps", cfg.to_dict(), cfg.steps, 0.0)
    trainer = Trainer(cfg, corpus=corpus)
    losses: list[float] = []
    val_losses: list[float] = []

    def on_step(r: StepResult) -> None:
        books.record_step(r.step, r.loss, r.tokens, r.seconds, float(r.step), r.extra)
        losses.append(r.loss)
        val_losses.extend([r.extra["val_loss"]] if "val_loss" in r.extra else [])
        if r.step % checkpoint_every == 0 or r.step == cfg.steps:
            row = checkpoint.save(checkpoint.checkpoint_dir(db), books.job_id, r.step, trainer.state_dict(), 0.0)
            checkpoint.prune(books.checkpointed(row))

    trainer.run(on_step)
    books.finished(float(cfg.steps))
    store.close()
    trainer.model.eval()
    return Job(db, trainer, losses, val_losses)


def export(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(build(["export"]), ["export", *args], env={"NO_COLOR": "1", "COLUMNS": "300"})
    return result.exit_code, result.output


def assert_same_logits(mine: torch.Tensor, theirs: torch.Tensor) -> None:
    assert mine.shape == theirs.shape
    rel = float((mine - theirs).abs().max() / mine.abs().max())
    assert rel <= REL, f"logits differ by {rel:.2e} of their largest"


@pytest.fixture(scope="module")
def tiny_job(tmp_path_factory: pytest.TempPathFactory) -> Job:
    cfg = TrainConfig(steps=4, seq_len=32, batch_size=4, eval_every=3)
    return train_job(tmp_path_factory.mktemp("tiny") / "cleave.db", cfg)


def test_a_presets_export_loads_in_transformers_with_the_trainers_logits(tiny_job: Job, tmp_path: Path) -> None:
    out = tmp_path / "model"
    code, output = export("--db", str(tiny_job.db), "--out", str(out))
    assert code == 0, output
    assert "step 4/4" in output and "LlamaForCausalLM" in output
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_same_logits(tiny_job.trainer.model(ids)[0], model(ids).logits)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = "héllo, wörld 🙂\n"
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == list(text.encode())  # it reads bytes
    assert tokenizer.decode(list(text.encode())) == text
    info = json.loads((out / INFO).read_text())
    assert (info["job"], info["step"], info["tokens"], info["model"]) == (1, 4, "bytes", "tiny")
    assert info["loss"] == pytest.approx(tiny_job.losses[-1]) and info["tokens_seen"] == 4 * 4 * 32
    assert len(tiny_job.val_losses) >= 1 and info["val_loss"] == pytest.approx(tiny_job.val_losses[-1])
    assert "from_pretrained" in (out / "README.md").read_text()


def test_the_llama_mapping_keeps_every_dimension_and_weight() -> None:
    """Not only the tiny preset: other heads, widths, a vocabulary of a tokenizer's size, another
    rotary base and norm weights away from 1, each tensor in its place."""
    cfg = ModelConfig(vocab_size=300, d_model=48, n_layers=3, n_heads=2, d_ff=80, max_seq_len=64, rope_base=500.0)
    torch.manual_seed(3)
    mine = Transformer(cfg).eval()
    with torch.no_grad():
        for p in mine.parameters():
            p.add_(0.2 * torch.randn_like(p))
    theirs = transformers.LlamaForCausalLM(llama_config(cfg)).eval()
    theirs.load_state_dict(preset_to_llama(mine.state_dict(), cfg), strict=True)
    ids = torch.randint(0, cfg.vocab_size, (3, 64))
    with torch.no_grad():
        assert_same_logits(mine(ids)[0], theirs(ids).logits)


def _hf_folder(path: Path, arch: str) -> Path:
    if arch == "gpt2":  # a tied head, Conv1D layers, and a tokenizer of its own
        tokenizers = pytest.importorskip("tokenizers")
        bpe = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
        bpe.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
        trainer = tokenizers.trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>"])
        bpe.train_from_iterator([CORPUS.decode()], trainer)
        transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>").save_pretrained(path)
        config = transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=bpe.get_vocab_size(), n_positions=64, **IDS
        )
    else:  # grouped key/value heads, untied, bytes
        config = transformers.LlamaConfig(
            num_hidden_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            vocab_size=256,
            max_position_embeddings=64,
            **IDS,
        )
    config.save_pretrained(path)
    return path


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_an_hf_models_export_loads_with_the_trainers_logits(arch: str, tmp_path: Path) -> None:
    source = _hf_folder(tmp_path / arch, arch)
    job = train_job(tmp_path / "cleave.db", TrainConfig(model=f"hf:{source}", steps=2, seq_len=16, batch_size=2))
    out = tmp_path / "model"
    code, output = export("--db", str(job.db), "--out", str(out))
    assert code == 0, output
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(model) is type(job.trainer.model.inner)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_same_logits(job.trainer.model(ids)[0], model(ids).logits)
    info = json.loads((out / INFO).read_text())
    assert info["model"] == f"hf:{arch}"  # the folder's name, never the operator's path
    if arch == "gpt2":
        assert model.lm_head.weight is model.transformer.wte.weight  # tied again
        text = "def add(a, b): return a"
        want = transformers.AutoTokenizer.from_pretrained(source)(text)["input_ids"]
        assert transformers.AutoTokenizer.from_pretrained(out)(text)["input_ids"] == want
        assert info["tokens"] == "tokenizer"
    else:
        assert info["tokens"] == "bytes"


def test_a_preset_trained_on_shards_of_a_trained_tokenizer_exports_that_tokenizer(tmp_path: Path) -> None:
    """cleave data prepare's path: a byte-level BPE trained on the corpus, shards beside it; the
    preset takes their vocabulary, and the export their tokenizer, ending documents as they do."""
    pytest.importorskip("tokenizers")
    from cleave.coordinator.training import prepare
    from cleave.coordinator.training.loop import with_data_vocab

    text, shards = tmp_path / "text", tmp_path / "shards"
    text.mkdir(), shards.mkdir()
    (text / "code.txt").write_bytes(CORPUS)
    encoder = prepare.train_bpe(text, "text", 300, shards)
    prepare.prepare(text, shards, encoder)
    cfg = with_data_vocab(TrainConfig(steps=2, seq_len=16, batch_size=2, data=str(shards)))
    job = train_job(tmp_path / "cleave.db", cfg, corpus=None)
    out = tmp_path / "model"
    code, output = export("--db", str(job.db), "--out", str(out))
    assert code == 0, output
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.config.vocab_size == cfg.vocab_size == encoder.vocab_size
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert_same_logits(job.trainer.model(ids)[0], model(ids).logits)
    exported = transformers.AutoTokenizer.from_pretrained(out)
    assert exported("class Point:", add_special_tokens=False)["input_ids"] == encoder.encode("class Point:")
    eos = exported.convert_tokens_to_ids(prepare.END_OF_TEXT)
    assert exported.eos_token_id == model.config.eos_token_id == model.generation_config.eos_token_id == eos
    assert json.loads((out / INFO).read_text())["tokens"] == "tokenizer"
    # The tokenizer the job recorded at its start, never bytes: refused once moved or changed.
    shards.rename(tmp_path / "moved")
    code, output = export("--db", str(job.db), "--out", str(tmp_path / "m2"))
    assert code != 0 and "which is not there any more (moved?)" in output and len(output.strip().splitlines()) == 1
    (tmp_path / "moved").rename(shards)
    with open(shards / prepare.TOKENIZER_FILE, "a") as f:
        f.write(" ")
    code, output = export("--db", str(job.db), "--out", str(tmp_path / "m3"))
    assert code != 0 and "which has changed since" in output and not (tmp_path / "m3").exists()


def test_force_replaces_an_earlier_export_whole_and_step_picks_the_checkpoint(tiny_job: Job, tmp_path: Path) -> None:
    out = tmp_path / "model"
    assert export("--db", str(tiny_job.db), "--out", str(out))[0] == 0
    (out / "stale.txt").write_text("left by hand")
    code, output = export("--db", str(tiny_job.db), "--out", str(out), "--step", "2", "--force", "--json")
    assert code == 0, output
    assert json.loads(output)["step"] == 2 and json.loads((out / INFO).read_text())["step"] == 2
    assert not (out / "stale.txt").exists()  # replaced whole, not merged
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # nothing left beside it


def test_what_cannot_be_exported_is_one_line_and_a_nonzero_exit(tiny_job: Job, tmp_path: Path) -> None:
    db, out = str(tiny_job.db), str(tmp_path / "model")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    cases = [
        (("--db", str(tmp_path / "none.db"), "--out", out), 2, "no database at"),
        (("--db", db, "--out", out, "--job", "9"), 2, "holds no job 9"),
        (("--db", db, "--out", out, "--step", "3"), 2, "no checkpoint of step 3 (steps with one on disk: 2, 4)"),
        (("--db", db, "--out", str(tmp_path / "mine")), 2, "is not empty (--force replaces an earlier export"),
        (("--db", db, "--out", str(tmp_path / "mine"), "--force"), 2, "not a Cleave export"),
        (("--db", db, "--out", out, "--step", "0"), 2, "--step must be 1 or more"),
    ]
    for args, want_code, message in cases:
        code, output = export(*args)
        assert (code, output.count("\n")) == (want_code, 1) and message in output, (args, output)
    assert not (tmp_path / "model").exists()


def test_a_corrupt_checkpoint_is_refused_and_the_others_named(tmp_path: Path) -> None:
    job = train_job(tmp_path / "cleave.db", TrainConfig(steps=2, seq_len=16, batch_size=2), checkpoint_every=1)
    newest = sorted(checkpoint.checkpoint_dir(job.db).glob("*.pt"))[-1]
    raw = bytearray(newest.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    newest.write_bytes(bytes(raw))
    code, output = export("--db", str(job.db), "--out", str(tmp_path / "model"))
    assert code == 1 and output.count("\n") == 1, output
    assert "checkpoint of step 2 is corrupt (checksum mismatch); other steps with a checkpoint on disk: 1" in output
    assert export("--db", str(job.db), "--out", str(tmp_path / "model"), "--step", "1")[0] == 0


def test_a_model_of_ones_own_cannot_be_rebuilt_and_says_so(tmp_path: Path) -> None:
    db = tmp_path / "cleave.db"
    store = SQLiteStore(db)
    books = Books.create(store, "mine", {"model": "custom:mine", "steps": 1}, 1, 0.0)
    state = {"step": 1, "config": {"model": "custom:mine"}, "model": {"w": torch.zeros(2)}}
    books.checkpointed(checkpoint.save(checkpoint.checkpoint_dir(db), books.job_id, 1, state, 0.0))
    store.close()
    code, output = export("--db", str(db), "--out", str(tmp_path / "model"))
    assert code == 2 and "custom:mine, a model of your own: Cleave cannot rebuild it" in output, output
