"""Text from an exported model (``cleave export``, or any transformers causal LM folder with
safetensors weights): greedy, or sampled at a temperature from the top k tokens, with a seeded
``torch.Generator`` so the same seed gives the same text; decoded as the tokens come.

Memory: the model's weights, its key/value cache (2 x layers x tokens x hidden floats), and the
tokens of the current output line for decoding.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cleave.coordinator.training import hf
from cleave.wire.errors import ConfigError

MAX_NEW_TOKENS = 100_000
REPLACEMENT = "\ufffd"  # what a decoder gives for bytes that are not (yet) a whole character


@dataclass(frozen=True)
class Sampling:
    """How each next token is picked: the most likely (``temperature`` 0) or drawn from the
    ``top_k`` most likely (0: all) at ``temperature``."""

    max_new_tokens: int = 200
    temperature: float = 0.8
    top_k: int = 50
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [
            (
                1 <= self.max_new_tokens <= MAX_NEW_TOKENS,
                f"--max-new-tokens must be between 1 and {MAX_NEW_TOKENS:,}, got {self.max_new_tokens}",
            ),
            (
                math.isfinite(self.temperature) and 0 <= self.temperature <= 100,
                f"--temperature must be between 0 and 100, got {self.temperature}",
            ),
            (self.top_k >= 0, f"--top-k must be 0 (every token) or more, got {self.top_k}"),
            (0 <= self.seed < 2**63, f"--seed must be a non-negative 64-bit integer, got {self.seed}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """The next token from the last position's ``logits`` (vocab,) (pure but for ``generator``)."""
    if sampling.greedy:
        return int(logits.argmax())
    scaled = logits.float() / sampling.temperature
    if 0 < sampling.top_k < scaled.numel():
        kth = torch.topk(scaled, sampling.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    return int(torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=generator))


@dataclass
class Loaded:
    """An exported folder, ready to generate from."""

    model: nn.Module  # a transformers causal LM, in eval mode
    tokenizer: Any  # a transformers tokenizer (the byte-level one for a folder that has none)
    max_len: int  # the longest context it takes: the one it was trained on, for a Cleave export
    stop: int | None  # the tokenizer's end-of-text id, where generation ends (None: it has none)


def load(folder: Path) -> Loaded:
    """The model and tokenizer of ``folder`` (ConfigError if it holds no usable model)."""
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{folder} holds no model (no config.json): pass a folder cleave export wrote")
    name = f"{hf.PREFIX}{folder}"
    spec = hf.spec(name)
    if not spec.weights:
        raise ConfigError(f"{folder} holds no weights (model.safetensors)")
    if spec.tokenizer:
        tokenizer = hf.tokenizer(name)
    else:  # a model that reads bytes (hf.spec checked its vocabulary holds them)
        from cleave.coordinator.training.export import byte_tokenizer

        tokenizer = byte_tokenizer()
    model = hf.build(name).inner.eval()
    return Loaded(model, tokenizer, trained_context(folder, spec.max_seq_len), getattr(tokenizer, "eos_token_id", None))


def trained_context(folder: Path, max_positions: int) -> int:
    """The context to generate in: a Cleave export's ``seq_len`` (its ``cleave.json``), where it
    is shorter than the positions the model takes (a preset's config allows 1024 however short
    its training sequences were, and positions past them were never trained); else those."""
    from cleave.coordinator.training.export import INFO

    try:
        seq_len = int(json.loads((folder / INFO).read_text()).get("seq_len") or 0)
    except (OSError, ValueError, AttributeError):  # no cleave.json (any transformers folder), or not ours
        return max_positions
    return min(max_positions, seq_len) if seq_len > 0 else max_positions


def encode(loaded: Loaded, prompt: str) -> list[int]:
    """The prompt's token ids, as training saw text: without special tokens."""
    ids = loaded.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ConfigError("--prompt must hold at least one token")
    return list(ids)


@torch.inference_mode()
def tokens(
    model: nn.Module, prompt: list[int], sampling: Sampling, max_len: int, stop: int | None = None
) -> Iterator[int]:
    """The new tokens after ``prompt``, one at a time, until ``sampling.max_new_tokens`` or the
    ``stop`` token (not given). The key/value cache carries the context while it fits in
    ``max_len``; beyond, each step reads the last ``max_len`` tokens afresh."""
    generator = torch.Generator().manual_seed(sampling.seed)
    # The cache's name, in the forward's arguments and its output: transformers 5 says cache.
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    ids = list(prompt)
    past: Any = None
    cached = 0  # how many of ids the cache holds
    for _ in range(sampling.max_new_tokens):
        if len(ids) > max_len:
            out = model(input_ids=torch.tensor([ids[-max_len:]]), use_cache=False)
        else:
            out = model(input_ids=torch.tensor([ids[cached:]]), use_cache=True, **{name: past})
            past, cached = getattr(out, name), len(ids)
        token = next_token(out.logits[0, -1], sampling, generator)
        if token == stop:
            return
        ids.append(token)
        yield token


def text(tokenizer: Any, ids: Iterable[int]) -> Iterator[str]:
    """The text of ``ids`` piece by piece as they come, each piece once its characters are whole
    (a byte-level model may give a character's bytes one at a time). The current line's tokens
    are decoded together, as a tokenizer that joins words with spaces needs."""
    line: list[int] = []
    shown = 0  # characters of the line's text already given
    for token in ids:
        line.append(token)
        decoded = tokenizer.decode(line)
        if decoded.endswith(REPLACEMENT):
            continue  # part of a character: wait for the rest
        yield decoded[shown:]
        if decoded.endswith("\n"):
            line, shown = [], 0
        else:
            shown = len(decoded)
    if line:
        yield tokenizer.decode(line)[shown:]
