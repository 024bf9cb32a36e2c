"""The models a job can train, by name: a built-in preset (``tiny``, ``small``, ``base``), a
``transformers`` causal LM from a folder (``hf:DIR``, see ``hf.py``), or ``custom:LABEL``, a
model built by a factory given through the Python API (docs/api.md). Every model is called as
``model(ids, targets) -> (logits, loss)``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from cleave.coordinator.training import hf
from cleave.coordinator.training.model import PRESETS, Transformer, preset
from cleave.wire.errors import ConfigError

CUSTOM = "custom:"  # a model given as a factory (docs/api.md); the rest of the name labels it


def is_custom(name: str) -> bool:
    return name.startswith(CUSTOM)


def public_name(name: str) -> str:
    """The name shown to anyone (the dashboard's job name): an ``hf:DIR`` folder's last part
    only, never the operator's path."""
    if hf.is_hf(name):
        return f"{hf.PREFIX}{Path(name[len(hf.PREFIX) :]).expanduser().name}"
    return name


def describe(name: str) -> str:
    """One line for help texts and errors: what ``name`` is."""
    if is_custom(name):
        return f"{name[len(CUSTOM) :]!r}, a model of your own"
    if hf.is_hf(name):
        s = hf.spec(name)
        return (
            f"{s.model_type} from {s.path} ({'its weights' if s.weights else 'random init'}, "
            f"{'its tokenizer' if s.tokenizer else 'byte ids'})"
        )
    return f"the built-in {name} preset"


def max_seq_len(name: str) -> int:
    """The longest sequence the model takes (raises ValueError for an unknown or unusable name)."""
    if hf.is_hf(name):
        return hf.spec(name).max_seq_len
    if is_custom(name):
        if not name[len(CUSTOM) :].strip() or not name.isprintable() or len(name) > len(CUSTOM) + 192:
            raise ConfigError("a custom model is named custom:LABEL, LABEL 1 to 192 printable characters")
        return 1 << 20  # the model checks its own lengths
    if name not in PRESETS:
        raise ConfigError(
            f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}, or hf:DIR for a "
            "transformers model in folder DIR"
        )
    return preset(name).max_seq_len


def is_preset(name: str) -> bool:
    return name in PRESETS


def build(name: str, vocab_size: int = 0) -> nn.Module:
    """A fresh model from torch's current seed (the caller seeds), or ``hf:DIR``'s weights.
    ``vocab_size``: a preset's embedding and output rows (0: its own, 256 byte ids), as token
    shards of a trained tokenizer state it (``TrainConfig.vocab_size``)."""
    if is_custom(name):
        raise ConfigError(f"model {name!r} is built by the model_factory passed with it (docs/api.md)")
    if hf.is_hf(name):
        return hf.build(name)
    cfg = preset(name)
    return Transformer(dataclasses.replace(cfg, vocab_size=vocab_size) if vocab_size else cfg)


def vocab_size(name: str, override: int = 0) -> int | None:
    """The ids the model takes (None: a ``custom:`` model's own business)."""
    if is_custom(name):
        return None
    if hf.is_hf(name):
        return hf.spec(name).vocab_size
    return override or preset(name).vocab_size


def tokenizer(name: str) -> Callable[[bytes], np.ndarray] | None:
    """Text to the model's ids: its tokenizer's (``hf:DIR`` with one), else None (one id a byte)."""
    if hf.is_hf(name) and hf.spec(name).tokenizer:
        return lambda text: hf.tokenize(name, text).numpy()
    return None


def tokens(name: str, text: bytes) -> torch.Tensor:
    """The corpus as the model's token ids: its tokenizer's, else one id per byte."""
    if hf.is_hf(name) and hf.spec(name).tokenizer:
        return hf.tokenize(name, text)
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)
