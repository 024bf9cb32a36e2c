"""The models a job can train, by name: a built-in preset (``tiny``, ``small``, ``base``) or a
``transformers`` causal LM from a folder (``hf:DIR``, see ``hf.py``). Every model is called as
``model(ids, targets) -> (logits, loss)``."""

from __future__ import annotations

import torch
from torch import nn

from coordinator.training import hf
from coordinator.training.model import PRESETS, Transformer, preset


def describe(name: str) -> str:
    """One line for help texts and errors: what ``name`` is."""
    if hf.is_hf(name):
        s = hf.spec(name)
        return (f"{s.model_type} from {s.path} ({'its weights' if s.weights else 'random init'}, "
                f"{'its tokenizer' if s.tokenizer else 'byte ids'})")
    return f"the built-in {name} preset"


def max_seq_len(name: str) -> int:
    """The longest sequence the model takes (raises ValueError for an unknown or unusable name)."""
    if hf.is_hf(name):
        return hf.spec(name).max_seq_len
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}, or hf:DIR for a "
                         "transformers model in folder DIR")
    return preset(name).max_seq_len


def build(name: str) -> nn.Module:
    """A fresh model from torch's current seed (the caller seeds), or ``hf:DIR``'s weights."""
    return hf.build(name) if hf.is_hf(name) else Transformer(preset(name))


def tokens(name: str, text: bytes) -> torch.Tensor:
    """The corpus as the model's token ids: its tokenizer's, else one id per byte."""
    if hf.is_hf(name) and hf.spec(name).tokenizer:
        return hf.tokenize(name, text)
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)
