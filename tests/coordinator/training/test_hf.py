"""Models of one's own: tiny GPT-2, Llama and OPT configs from ``transformers`` (random init from
the seed, built offline from a folder), offloaded whole, and trained through real clients with
the losses of ``cleave train --local``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from procs import Coordinator, join, local_losses  # noqa: E402
from torch import nn  # noqa: E402

from cleave.coordinator.training import hf  # noqa: E402
from cleave.coordinator.training.flops import gemm_share  # noqa: E402
from cleave.coordinator.training.linear import LocalEngine, TiledLinear, offload_linears  # noqa: E402
from cleave.coordinator.training.loop import TrainConfig, Trainer  # noqa: E402
from cleave.wire.errors import ConfigError  # noqa: E402

REL = 1e-4
STEPS = 3
IDS = {"bos_token_id": 0, "eos_token_id": 0}


def _configs() -> dict[str, object]:
    return {
        "gpt2": transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64, **IDS),
        "llama": transformers.LlamaConfig(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=176,
            vocab_size=256,
            max_position_embeddings=64,
            **IDS,
        ),
        "opt": transformers.OPTConfig(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            ffn_dim=256,
            vocab_size=256,
            max_position_embeddings=64,
            word_embed_proj_dim=64,
            pad_token_id=1,
            **IDS,
        ),
    }


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for name, config in _configs().items():
        path = tmp_path_factory.mktemp(name)
        config.save_pretrained(path)  # config.json only: a random init from --seed
        out[name] = path
    return out


@pytest.mark.drill
@pytest.mark.parametrize("arch", ["gpt2", "llama", "opt"])
def test_a_transformers_model_trains_through_clients_like_local_torch(
    arch: str, folders: dict[str, Path], tmp_path: Path
) -> None:
    model = f"hf:{folders[arch]}"
    options = ("--model", model, "--seq-len", "32", "--batch-size", "4")
    coord = Coordinator(tmp_path, *options, "--min-devices", "2", steps=STEPS)
    clients = [join(coord.url, f"{arch}-{i}") for i in range(2)]
    want = local_losses(STEPS, model=model, seq_len=32, batch_size=4)  # plain torch, while the clients start
    assert coord.wait() == 0, coord.output
    assert [c.wait() for c in clients] == [0, 0]
    got = coord.losses()
    assert len(got) == STEPS
    for step, (g, w) in enumerate(zip(got, want), start=1):
        assert abs(g - w) <= REL * abs(w), f"{arch} step {step}: {g} vs local {w}"
    share = re.search(r"([\d.]+)% of the model's GEMM FLOPs can go to devices", coord.output)
    assert share is not None and float(share.group(1)) > 85.0, coord.output
    assert coord.query("SELECT COUNT(*) FROM tiles WHERE state != 'verified'") == [(0,)]
    assert all(n > 0 for (n,) in coord.query("SELECT tiles_done FROM devices"))


def test_gpt2s_conv1d_and_tied_head_are_offloaded_with_autograds_gradients(folders: dict[str, Path]) -> None:
    torch.manual_seed(0)
    ref = hf.build(f"hf:{folders['gpt2']}")
    tiled = hf.build(f"hf:{folders['gpt2']}")
    tiled.load_state_dict(ref.state_dict())
    assert offload_linears(tiled, LocalEngine()) == 9  # 4 Conv1D a layer, and the head
    assert not any(type(m).__name__ in ("Conv1D", "Linear") for m in tiled.modules())
    head = tiled.inner.lm_head
    assert isinstance(head, TiledLinear) and head.weight is tiled.inner.transformer.wte.weight  # still tied
    ids = torch.randint(0, 256, (2, 16))
    ref.eval(), tiled.eval()  # no dropout: the two runs draw nothing
    ref(ids, ids)[1].backward()
    tiled(ids, ids)[1].backward()
    for (name, p), q in zip(tiled.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_the_gemm_share_is_counted_and_leaves_training_unchanged(folders: dict[str, Path]) -> None:
    cfg = TrainConfig(model=f"hf:{folders['llama']}", steps=2, seq_len=32, batch_size=2)
    plain = [r.loss for r in Trainer(cfg).run()]
    trainer = Trainer(cfg, LocalEngine())
    share = gemm_share(trainer.model, cfg.seq_len)
    assert 0.85 < share.share < 1.0
    assert all("self_attn" in name for name in share.left)  # attention's own products, named
    assert [r.loss for r in trainer.run()] == pytest.approx(plain, rel=1e-6)  # no draw used, no grad left


def test_nn_linear_subclasses_are_offloaded_unless_they_compute_something_else() -> None:
    class Plain(nn.Linear):  # e.g. nn.MultiheadAttention's NonDynamicallyQuantizableLinear
        pass

    class Router(nn.Linear):  # a forward of its own (a MoE router's top-k): not a plain GEMM
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
            return torch.topk(super().forward(x), 1, dim=-1)

    model = nn.Sequential(Plain(8, 4), nn.ReLU(), nn.Linear(4, 2), Router(2, 2))
    assert offload_linears(model, LocalEngine()) == 2
    assert isinstance(model[0], TiledLinear) and isinstance(model[3], Router)


def test_a_folder_never_runs_its_own_code_nor_loads_pickled_weights(tmp_path: Path) -> None:
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=256, **IDS).to_dict()
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    (tmp_path / "config.json").write_text(__import__("json").dumps(config))
    (tmp_path / "evil.py").write_text("raise SystemExit('the folder ran its own code')\n")
    cfg = TrainConfig(model=f"hf:{tmp_path}", steps=1, seq_len=16, batch_size=1)  # no prompt, no import
    assert isinstance(Trainer(cfg).model.inner, transformers.GPT2LMHeadModel)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ConfigError, match="pickles, which Cleave never loads"):
        TrainConfig(model=f"hf:{tmp_path}")


def test_unusable_folders_fail_with_one_clear_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no config.json"):
        TrainConfig(model=f"hf:{tmp_path}")
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, **IDS).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="vocabulary of 100 cannot hold byte ids"):
        TrainConfig(model=f"hf:{tmp_path}")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not readable JSON"):
        TrainConfig(model=f"hf:{tmp_path}")


def test_a_transformers_model_resumes_from_a_checkpoint_exactly(folders: dict[str, Path], tmp_path: Path) -> None:
    from cleave.coordinator.training import checkpoint

    cfg = TrainConfig(model=f"hf:{folders['gpt2']}", steps=4, seq_len=32, batch_size=2)
    straight = [r.loss for r in Trainer(cfg).run()]
    first = Trainer(cfg)
    losses = [first.train_step().loss for _ in range(2)]
    row = checkpoint.save(tmp_path, 1, 2, first.state_dict(), 0.0)
    again = Trainer(cfg)  # a restarted coordinator: a fresh model, then the checkpoint
    again.load_state_dict(checkpoint.load(row))
    losses += [r.loss for r in again.run()]
    assert losses == pytest.approx(straight, rel=1e-6)
    assert again.model.inner.lm_head.weight is again.model.inner.transformer.wte.weight  # still tied


def test_a_folder_with_a_tokenizer_trains_on_its_token_ids(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    text = "def add(a, b):\n    return a + b\n" * 200
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    bpe.train_from_iterator([text], tokenizers.trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>"]))
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>").save_pretrained(tmp_path)
    vocab = bpe.get_vocab_size()
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=vocab, n_positions=32, **IDS).save_pretrained(
        tmp_path
    )
    data = tmp_path / "code.txt"
    data.write_text(text)
    cfg = TrainConfig(model=f"hf:{tmp_path}", steps=2, seq_len=16, batch_size=2, data=str(data))  # vocab < 256: fine
    trainer = Trainer(cfg)
    ids = trainer.batches.part.stream.read(0, len(trainer.batches.part.stream))
    assert int(ids.max()) < vocab
    assert len(ids) < len(text) // 2  # tokens, not bytes
    assert all(r.loss == r.loss for r in trainer.run())
