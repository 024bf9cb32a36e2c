"""Issue 36's drill: a corpus in, a model out. Shards prepared with a trained BPE, a job trained
through a real client (tiles shipped) with the held-out loss evaluated, the model exported and
loaded by transformers with the coordinator's logits, then sampled."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import TIMEOUT
from procs import Coordinator, cleave_cmd, join, run_all

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from cleave.coordinator.training import checkpoint  # noqa: E402
from cleave.coordinator.training.loop import TrainConfig, Trainer  # noqa: E402
from cleave.db.sqlite import SQLiteStore  # noqa: E402

pytestmark = pytest.mark.drill

STEPS, EVERY = 4, 2
REL = 1e-5


def _corpus(path: Path) -> None:
    """JSONL of the standard library's own source: real text, no download."""
    root = Path(sys.modules["json"].__file__).parent
    texts = [p.read_text(encoding="utf-8") for p in sorted(root.glob("*.py"))]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")


def test_a_corpus_trains_through_a_client_and_comes_out_as_a_model_transformers_loads(tmp_path: Path) -> None:
    corpus, shards, out = tmp_path / "corpus.jsonl", tmp_path / "shards", tmp_path / "model"
    _corpus(corpus)
    (prepared,) = run_all(
        cleave_cmd("data", "prepare", str(corpus), "--out", str(shards), "--train-tokenizer", "--vocab-size", "320"),
        timeout=2 * TIMEOUT,
    )
    assert prepared.returncode == 0, prepared.stderr[-2000:]
    meta = json.loads((shards / "shards.json").read_text())
    assert meta["vocab_size"] <= 320 and (shards / "tokenizer.json").exists(), meta

    coord = Coordinator(
        tmp_path, "--data", str(shards), "--eval-every", str(EVERY), "--eval-batches", "1", "--min-devices", "1",
        steps=STEPS,
    )  # fmt: skip
    client = join(coord.url, "laptop")
    assert coord.wait(4 * TIMEOUT) == 0, coord.output
    assert client.wait() == 0, client.output
    (shipped,) = coord.query("SELECT COUNT(*) FROM leases WHERE outcome = 'verified'")[0]
    assert shipped > 0  # the GEMMs went to the client, not kept home

    rows = coord.rows()
    assert [r["step"] for r in rows if "val_loss" in r] == list(range(EVERY, STEPS + 1, EVERY)), rows
    store = SQLiteStore(coord.db)
    try:
        job = store.newest_job()
        assert job is not None
        state = checkpoint.load(store.checkpoints(job.id)[0])  # newest first
    finally:
        store.close()
    cfg = TrainConfig(**state["config"])
    assert cfg.vocab_size == meta["vocab_size"] and cfg.data == str(shards)
    # Exact: plain torch on the same options gives the coordinator's losses and held-out losses.
    plain = Trainer(cfg)
    reference = plain.run()
    for got, want in zip(rows, reference, strict=True):
        assert abs(got["loss"] - want.loss) <= REL * abs(want.loss), (got, want)
        if "val_loss" in got:
            assert abs(got["val_loss"] - want.extra["val_loss"]) <= REL * abs(want.extra["val_loss"])

    (exported,) = run_all(cleave_cmd("export", "--db", str(coord.db), "--out", str(out)), timeout=2 * TIMEOUT)
    assert exported.returncode == 0, exported.stderr[-2000:]
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tokenizer.encode("def dumps(obj, *, skipkeys=False):\n    return")])
    assert int(ids.max()) < meta["vocab_size"]
    coordinator_model = Trainer(cfg)
    coordinator_model.load_state_dict(state)  # the checkpoint: the coordinator's model at its last step
    coordinator_model.model.eval()
    with torch.no_grad():
        want = coordinator_model.model(ids)
        want = want[0] if isinstance(want, tuple) else want
        got = model(ids).logits
    assert (got - want).abs().max() <= REL * want.abs().max(), float((got - want).abs().max())

    (sampled,) = run_all(
        cleave_cmd("sample", str(out), "--prompt", "def ", "--max-new-tokens", "12", "--greedy"), timeout=TIMEOUT
    )
    assert sampled.returncode == 0, sampled.stderr[-2000:]
    assert sampled.stdout.startswith("def ") and len(sampled.stdout.strip()) > len("def"), sampled.stdout
