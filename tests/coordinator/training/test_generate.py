"""``cleave sample``: text from an exported folder, greedy as a plain argmax decode of the trainer's
own model, sampled reproducibly from its seed, and decoded only in whole characters."""

from __future__ import annotations

from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from test_export import Job, export, train_job  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from cleave.cli.app import build  # noqa: E402
from cleave.coordinator.training import generate  # noqa: E402
from cleave.coordinator.training.export import byte_tokenizer  # noqa: E402
from cleave.coordinator.training.generate import Sampling, next_token  # noqa: E402
from cleave.coordinator.training.loop import TrainConfig  # noqa: E402
from cleave.wire.errors import ConfigError  # noqa: E402

PROMPT = "def add(a"


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Job, Path]:
    """A tiny preset trained a few steps, exported."""
    root = tmp_path_factory.mktemp("sample")
    cfg = TrainConfig(steps=6, seq_len=16, batch_size=8, lr=1e-2, warmup=2)
    job = train_job(root / "cleave.db", cfg, checkpoint_every=6)
    code, output = export("--db", str(job.db), "--out", str(root / "model"))
    assert code == 0, output
    return job, root / "model"


def sample(folder: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(build(["sample"]), ["sample", str(folder), *args], env={"NO_COLOR": "1"})
    return result.exit_code, result.output


def argmax_decode(job: Job, prompt: list[int], new: int, window: int) -> list[int]:
    """The reference: Cleave's own model, the last ``window`` tokens afresh for each token."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            ids.append(int(job.trainer.model(torch.tensor([ids[-window:]]))[0][0, -1].argmax()))
    return ids[len(prompt) :]


def test_greedy_sampling_equals_an_argmax_decode_of_the_trainers_model(exported: tuple[Job, Path]) -> None:
    """Over the context it was trained on (16 tokens, though its config takes 1024 positions)."""
    job, folder = exported
    assert generate.load(folder).max_len == 16
    want = PROMPT + byte_tokenizer().decode(argmax_decode(job, list(PROMPT.encode()), 40, 16)) + "\n"
    code, output = sample(folder, "--prompt", PROMPT, "--max-new-tokens", "40", "--greedy")
    assert code == 0 and output == want
    assert sample(folder, "--prompt", PROMPT, "--max-new-tokens", "40", "--temperature", "0")[1] == want


def test_a_folder_without_cleave_json_takes_its_configs_context(exported: tuple[Job, Path], tmp_path: Path) -> None:
    _, folder = exported
    assert generate.trained_context(folder, 1024) == 16  # cleave.json's seq_len
    assert generate.trained_context(tmp_path, 1024) == 1024  # any transformers folder: its config's
    (tmp_path / "cleave.json").write_text('{"seq_len": 4096}')
    assert generate.trained_context(tmp_path, 1024) == 1024  # never past the positions it takes


def test_past_the_longest_context_each_token_reads_the_last_window(exported: tuple[Job, Path]) -> None:
    job, folder = exported
    loaded, prompt = generate.load(folder), list(PROMPT.encode())
    got = list(generate.tokens(loaded.model, prompt, Sampling(max_new_tokens=30, temperature=0), max_len=16))
    assert got == argmax_decode(job, prompt, 30, 16)  # from the cache (9..16 tokens) to the window
    stop = got[3]
    until = list(generate.tokens(loaded.model, prompt, Sampling(30, temperature=0), max_len=16, stop=stop))
    assert until == got[: got.index(stop)]  # ends before the end-of-text token, which is not given


def test_a_seeded_sample_is_the_same_each_time_and_the_seed_matters(exported: tuple[Job, Path]) -> None:
    _, folder = exported
    args = ("--prompt", PROMPT, "--max-new-tokens", "30", "--temperature", "1.0", "--top-k", "0")
    first = sample(folder, *args, "--seed", "5")
    assert first[0] == 0 and first == sample(folder, *args, "--seed", "5")
    others = {sample(folder, *args, "--seed", str(seed))[1] for seed in (6, 7)}
    assert first[1] not in others  # 30 draws from ~256 bytes: a repeat would be a broken seed


def test_top_k_draws_only_the_k_most_likely_in_their_proportions() -> None:
    logits = torch.tensor([2.0, 0.5, 1.5, -1.0, 1.0, 0.0])
    sampling = Sampling(temperature=0.5, top_k=3)
    generator = torch.Generator().manual_seed(0)
    draws = [next_token(logits, sampling, generator) for _ in range(4000)]
    assert set(draws) <= {0, 2, 4}
    want = torch.softmax(logits[[0, 2, 4]] / 0.5, dim=0)
    got = torch.tensor([draws.count(i) for i in (0, 2, 4)]) / len(draws)
    assert torch.allclose(got, want, atol=0.03), (got, want)
    assert next_token(logits, Sampling(temperature=0.0), generator) == 0


def test_text_is_given_in_whole_characters_and_adds_up_to_the_decode() -> None:
    tokenizer = byte_tokenizer()
    whole = "héllo, wörld 🙂\nnext line\n".encode()  # characters of 2 and 4 bytes, one byte a token
    pieces = list(generate.text(tokenizer, iter(whole)))
    assert "".join(pieces) == whole.decode() and generate.REPLACEMENT not in "".join(pieces)
    assert "🙂" in pieces  # its four bytes given at once, as one piece
    broken = b"ok \xff\xfe then \xe2\x82 cut"  # bytes that never make a character
    assert "".join(generate.text(tokenizer, iter(broken))) == broken.decode("utf-8", errors="replace")


def test_bad_sampling_options_and_folders_are_one_line_errors(exported: tuple[Job, Path], tmp_path: Path) -> None:
    _, folder = exported
    for args, message in [
        (("--prompt", "x", "--temperature", "-1"), "--temperature must be between 0 and 100"),
        (("--prompt", "x", "--max-new-tokens", "0"), "--max-new-tokens must be between 1"),
        (("--prompt", "x", "--top-k", "-2"), "--top-k must be 0"),
        (("--prompt", ""), "--prompt must hold at least one token"),
    ]:
        code, output = sample(folder, *args)
        assert (code, output.count("\n")) == (2, 1) and message in output, (args, output)
    code, output = sample(tmp_path, "--prompt", "x")
    assert code == 2 and "holds no model (no config.json)" in output, output
    with pytest.raises(ConfigError, match="holds no weights"):
        (tmp_path / "config.json").write_text((folder / "config.json").read_text())
        generate.load(tmp_path)
