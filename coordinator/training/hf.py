"""Causal language models from Hugging Face ``transformers``, by folder: ``--model hf:DIR``.

DIR holds a ``config.json`` (any causal LM ``AutoModelForCausalLM`` knows) and optionally
weights (``model.safetensors``, or shards with ``model.safetensors.index.json``: safetensors
only; pickled ``.bin``/``.pt`` weights are refused)  and a tokenizer
(``tokenizer.json`` or the files ``AutoTokenizer`` reads). Without weights the model starts
from a random init drawn from ``--seed``; without a tokenizer the text is fed as byte ids,
which needs a vocabulary of at least 256. Nothing is ever downloaded: every load is
``local_files_only``. ``transformers`` is an optional extra (``pip install 'cleave[hf]'``),
imported only when such a model is asked for; volunteers' clients never need it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cleave.wire.errors import ConfigError

PREFIX = "hf:"
BYTE_VOCAB = 256
WEIGHTS = ("model.safetensors", "model.safetensors.index.json")  # one file, or shards and their index
_PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")  # weights only a pickle loader reads: refused
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


class HFError(ConfigError):
    """A ``--model hf:DIR`` that cannot be used, with the reason in one line."""


def is_hf(name: str) -> bool:
    return name.startswith(PREFIX)


def _transformers() -> Any:
    os.environ["HF_HUB_OFFLINE"] = "1"  # never reach the network, whatever is asked
    try:
        import transformers
    except ImportError:
        raise HFError("--model hf:DIR needs the transformers package: pip install 'cleave[hf]'") from None
    transformers.logging.set_verbosity_error()  # its notes on configs go to our errors, not stderr
    transformers.utils.logging.disable_progress_bar()  # no bars for loading or saving a small folder
    return transformers


@dataclass(frozen=True)
class HFSpec:
    """What a job needs to know about the folder before it builds anything."""

    path: Path
    model_type: str
    vocab_size: int
    max_seq_len: int
    weights: bool  # model.safetensors (or its shards and their index) is there
    tokenizer: bool  # a tokenizer is there: --data is tokenized with it


def spec(name: str) -> HFSpec:
    path = Path(name[len(PREFIX) :]).expanduser()
    config_file = path / "config.json"
    if not config_file.is_file():
        raise HFError(f"--model {name}: no config.json in {path}")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise HFError(f"--model {name}: config.json is not readable JSON ({exc})") from None
    config = _config(path, name)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    seq = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 1 << 20
    has_tokenizer = any((path / f).is_file() for f in _TOKENIZER_FILES)
    weights = any((path / f).is_file() for f in WEIGHTS)
    pickles = sorted(p.name for pattern in _PICKLES for p in path.glob(pattern))
    if pickles and not weights:  # never start from a random init while weights sit beside it
        raise HFError(
            f"--model {name}: its weights ({', '.join(pickles[:3])}) are pickles, which Cleave never "
            "loads; convert them to model.safetensors (transformers: save_pretrained)"
        )
    if not has_tokenizer and vocab < BYTE_VOCAB:
        raise HFError(
            f"--model {name}: a vocabulary of {vocab} cannot hold byte ids (256) and there is no "
            "tokenizer in the folder"
        )
    return HFSpec(path, str(raw.get("model_type", "?")), vocab, int(seq), weights, has_tokenizer)


def _config(path: Path, name: str) -> Any:
    transformers = _transformers()
    try:
        # Never the folder's own Python (``auto_map``): transformers would otherwise ask on stdin.
        return transformers.AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError, ImportError) as exc:
        raise HFError(f"--model {name}: transformers cannot read its config ({str(exc).splitlines()[0]})") from None


def config(name: str) -> Any:
    """The transformers config of ``hf:DIR`` (HFError if the folder cannot be used)."""
    return _config(spec(name).path, name)


class HFCausalLM(nn.Module):
    """The job's view of a ``transformers`` causal LM: ``(logits, loss)`` from ids and targets,
    as the built-in ``Transformer``. The loss is computed here, on the already shifted targets
    of the batches, in float32: the same for local and distributed runs."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = self.inner(input_ids=idx, use_cache=False).logits
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def build(name: str) -> HFCausalLM:
    """The model of ``hf:DIR`` in float32: its weights if the folder has them, else a random
    init from torch's current seed (the trainer seeds it)."""
    s = spec(name)
    transformers = _transformers()
    try:
        if s.weights:
            inner = transformers.AutoModelForCausalLM.from_pretrained(
                str(s.path), local_files_only=True, use_safetensors=True, trust_remote_code=False, dtype=torch.float32
            )
        else:
            inner = transformers.AutoModelForCausalLM.from_config(
                _config(s.path, name), trust_remote_code=False, dtype=torch.float32
            )
    except (OSError, ValueError, KeyError, RuntimeError, ImportError) as exc:
        raise HFError(f"--model {name}: transformers cannot build it ({str(exc).splitlines()[0]})") from None
    return HFCausalLM(inner)


def tokenizer(name: str) -> Any:
    """The tokenizer of ``hf:DIR`` (``AutoTokenizer``; HFError if it cannot be loaded)."""
    transformers = _transformers()
    try:
        return transformers.AutoTokenizer.from_pretrained(
            str(spec(name).path), local_files_only=True, trust_remote_code=False
        )
    except (OSError, ValueError, KeyError, ImportError) as exc:
        raise HFError(f"--model {name}: transformers cannot load its tokenizer ({str(exc).splitlines()[0]})") from None


def tokenize(name: str, text: bytes) -> torch.Tensor:
    """Token ids of ``text`` with the folder's tokenizer (int64, one dimension)."""
    s = spec(name)
    tok = tokenizer(name)
    ids = tok(text.decode("utf-8", errors="replace"), add_special_tokens=False)["input_ids"]
    out = torch.tensor(ids, dtype=torch.int64)
    if out.numel() and int(out.max()) >= s.vocab_size:
        raise HFError(
            f"--model {name}: its tokenizer makes ids up to {int(out.max())}, beyond the model's "
            f"vocabulary of {s.vocab_size}"
        )
    return out
