"""A trained model out of Cleave: a job's checkpoint written as a folder ``transformers`` loads.

``export_job(db, out)`` writes, from the job's checkpoint (its newest, or the one of ``step``)::

    model.safetensors, config.json,      AutoModelForCausalLM.from_pretrained(out)
    generation_config.json
    tokenizer.json, tokenizer_config.json  AutoTokenizer.from_pretrained(out)
    cleave.json                            where it came from: job, step, loss, tokens (INFO)
    README.md                              a model card

An ``hf:DIR`` model is written as its own transformers class, under its own parameter names
(``TiledLinear`` keeps the names of the layers it replaces, and a tied head is tied again). A
built-in preset is exactly a ``LlamaForCausalLM``: RMSNorm, rotary positions, a SwiGLU MLP, causal
attention without biases, an untied head. Its fused ``qkv`` and ``gate_up`` are split, and the q
and k rows of each head are reordered from rotating interleaved pairs (``model.apply_rope``) to
rotating halves (transformers' ``rotate_half``): q and k are permuted alike, so every q.k product,
and so every logit, is unchanged (to float rounding: 1e-6 relative, tests/coordinator/training/test_export.py).

Tokens: the job's tokenizer if it had one (the ``hf:DIR`` folder's, or the one its token shards
were made with: ``shards.json`` names it); else the model reads UTF-8 bytes, and a tokenizer that
maps byte b to id b is written, so that ``AutoTokenizer`` reads this folder too.

Memory: the checkpoint as loaded (the weights and AdamW's two moments: three times the weights)
plus the few tensors that the preset's mapping splits (copies of the q, k and MLP weights);
nothing else. The folder is written beside ``out`` and renamed into place: an export that fails
leaves nothing half-written.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cleave.coordinator.training import checkpoint, hf, models, prepare
from cleave.coordinator.training.model import ModelConfig, preset
from cleave.db.sqlite import SQLiteStore
from cleave.db.store import CheckpointRow, JobRow
from cleave.wire.errors import CheckpointError, ConfigError, StoreError
from cleave.wire.version import package_version

INFO = "cleave.json"  # what Cleave writes beside the model: FORMAT, job, step, tokens ...
FORMAT = 1
CARD = "README.md"


class Tokens(str, Enum):
    """What the exported model reads."""

    BYTES = "bytes"  # UTF-8 bytes, id = byte value
    TOKENIZER = "tokenizer"  # the job's own tokenizer


@dataclass(frozen=True)
class Exported:
    """What ``export_job`` wrote, as recorded in ``cleave.json``."""

    out: Path
    job: int
    step: int
    steps: int
    model: str  # the job's model, as shown to anyone (an hf:DIR folder's last part only)
    architecture: str  # the transformers class
    tokens: Tokens
    loss: float | None  # the training loss of the checkpoint's step, if recorded
    val_loss: float | None  # the held-out loss last evaluated at or before that step, if any
    tokens_seen: int
    seq_len: int  # the context it was trained on (the model may take longer ones: config.json)
    parameters: int

    def info(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "cleave_version": package_version(),
            **{k: v for k, v in dataclasses.asdict(self).items() if k != "out"},
            "tokens": self.tokens.value,
        }


# --- the preset as a Llama


def llama_config(cfg: ModelConfig) -> Any:
    """The ``transformers.LlamaConfig`` of a preset: the same dimensions, rotary base and norm eps,
    one key/value head per head, no biases, an untied head, and no special tokens (bytes)."""
    transformers = hf._transformers()
    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_heads,
        head_dim=cfg.d_model // cfg.n_heads,
        hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_base,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def _halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """q or k rows of each head reordered from interleaved pairs (0,1),(2,3).. to halves: rows
    0,2,4.. then 1,3,5.., so that transformers' rotate_half rotates the pairs model.py rotates."""
    out_dim, in_dim = w.shape
    head_dim = out_dim // n_heads
    order = torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))
    return w.view(n_heads, head_dim, in_dim)[:, order].reshape(out_dim, in_dim)


def preset_to_llama(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A preset ``Transformer``'s state dict under ``LlamaForCausalLM``'s names (pure)."""
    C = cfg.d_model
    out = {
        "model.embed_tokens.weight": state["embed.weight"],
        "model.norm.weight": state["norm.weight"],
        "lm_head.weight": state["head.weight"],
    }
    for i in range(cfg.n_layers):
        src, dst = f"blocks.{i}.", f"model.layers.{i}."
        q, k, v = state[src + "attn.qkv.weight"].split(C)  # (C, C) each
        gate, up = state[src + "mlp.gate_up.weight"].split(cfg.d_ff)  # (d_ff, C) each
        out |= {
            dst + "self_attn.q_proj.weight": _halves(q, cfg.n_heads),
            dst + "self_attn.k_proj.weight": _halves(k, cfg.n_heads),
            dst + "self_attn.v_proj.weight": v.clone(),
            dst + "self_attn.o_proj.weight": state[src + "attn.proj.weight"],
            dst + "mlp.gate_proj.weight": gate.clone(),
            dst + "mlp.up_proj.weight": up.clone(),
            dst + "mlp.down_proj.weight": state[src + "mlp.down.weight"],
            dst + "input_layernorm.weight": state[src + "attn_norm.weight"],
            dst + "post_attention_layernorm.weight": state[src + "mlp_norm.weight"],
        }
    return out


def _preset_model(name: str, state: dict[str, torch.Tensor]) -> nn.Module:
    if "embed.weight" not in state:
        raise CheckpointError(f"the checkpoint holds no {name} model (no embed.weight)")
    # The vocabulary is the checkpoint's: 256 bytes, or a tokenizer's size (cleave data prepare).
    cfg = dataclasses.replace(preset(name), vocab_size=int(state["embed.weight"].shape[0]))
    return _filled(hf._transformers().LlamaForCausalLM, llama_config(cfg), preset_to_llama(state, cfg), name)


def _filled(cls: Any, config: Any, state: dict[str, torch.Tensor], name: str) -> nn.Module:
    """A transformers model of ``config`` holding ``state``'s tensors: built without weights (no
    init to pay, no second copy), then given them; a tied head is tied again."""
    with torch.device("meta"):  # AutoModelForCausalLM builds from a config; a model class is called
        model = cls.from_config(config) if hasattr(cls, "from_config") else cls(config)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        raise CheckpointError(f"the checkpoint does not fit model {name}: {str(exc).splitlines()[0]}") from None
    model.tie_weights()
    return model


# --- tokens


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte, which byte-level tokenizers work on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(extra)}


def byte_tokenizer() -> Any:
    """A transformers tokenizer whose ids are the text's UTF-8 bytes, and whose decode is theirs
    (invalid UTF-8 becomes U+FFFD): what a model trained on bytes reads."""
    import tokenizers  # a dependency of transformers

    chars = _bytes_to_unicode()
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    return hf._transformers().PreTrainedTokenizerFast(tokenizer_object=bpe)


def _load_tokenizer(where: Path, job: JobRow) -> Any:
    transformers = hf._transformers()
    try:
        if where.is_dir():
            return transformers.AutoTokenizer.from_pretrained(
                str(where), local_files_only=True, trust_remote_code=False
            )
        tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(where))
    except Exception as exc:  # tokenizers' and transformers' own errors: a file they cannot parse
        raise ConfigError(f"job {job.id}'s tokenizer {where} does not load: {str(exc).splitlines()[0]}") from None
    if prepare.END_OF_TEXT in tok.get_vocab():  # a BPE cleave data prepare trained: documents end so
        tok.eos_token = prepare.END_OF_TEXT
    return tok


def _data_tokenizer(job: JobRow, state: dict[str, Any]) -> Path | None:
    """A preset job's tokenizer: the one its checkpoint recorded at the job's start (checked by
    its hash), so a moved data folder or a relative --data cannot turn it into bytes; a
    checkpoint from before the record: the one its data's ``shards.json`` names now."""
    if prepare.TOKENIZER_KEY in state:
        return prepare.recorded_tokenizer(state[prepare.TOKENIZER_KEY], f"job {job.id}")
    return prepare.data_tokenizer(job.config.get("data"))


def _tokenizer(job: JobRow, vocab: int, state: dict[str, Any]) -> tuple[Any, Tokens]:
    name = job.config["model"]
    if hf.is_hf(name) and hf.spec(name).tokenizer:
        tok = hf.tokenizer(name)
    elif not hf.is_hf(name) and (where := _data_tokenizer(job, state)) is not None:
        tok = _load_tokenizer(where, job)
    else:
        return byte_tokenizer(), Tokens.BYTES
    if len(tok) > vocab:
        raise ConfigError(f"job {job.id}'s tokenizer has {len(tok)} tokens, more than the model's vocabulary ({vocab})")
    return tok, Tokens.TOKENIZER


# --- the job and its checkpoint


def _job(store: SQLiteStore, db: Path, job_id: int | None) -> JobRow:
    if job_id is None:
        job = store.newest_job()
        if job is None:
            raise ConfigError(f"{db} holds no job")
        return job
    try:
        return store.job(job_id)
    except StoreError:
        raise ConfigError(f"{db} holds no job {job_id}") from None


def _checkpoint(store: SQLiteStore, job: JobRow, step: int | None) -> tuple[CheckpointRow, dict[str, Any]]:
    rows = store.checkpoints(job.id)  # newest first; a step computed again after a resume: its newest row
    if not rows:
        raise ConfigError(f"job {job.id} has no checkpoint (it stopped before its first, see --checkpoint-every)")
    on_disk = sorted({r.step for r in rows if Path(r.path).is_file()})
    if step is not None:
        rows = [r for r in rows if r.step == step]
        if not rows:
            held = ", ".join(map(str, on_disk)) or "none"
            raise ConfigError(f"job {job.id} has no checkpoint of step {step} (steps with one on disk: {held})")
    row = rows[0]
    try:
        state = checkpoint.load(row)
    except CheckpointError as exc:
        others = ", ".join(str(s) for s in on_disk if s != row.step) or "none"
        raise CheckpointError(f"{exc}; other steps with a checkpoint on disk: {others} (--step)") from None
    saved = (state.get("config") or {}).get("model")
    if saved != job.config.get("model"):
        raise CheckpointError(f"checkpoint {row.path} holds model {saved!r}, not job {job.id}'s")
    return row, state


def _model(job: JobRow, state: dict[str, torch.Tensor]) -> nn.Module:
    name = str(job.config.get("model"))
    if models.is_custom(name):
        raise ConfigError(
            f"job {job.id} trains {name}, a model of your own: Cleave cannot rebuild it; its weights are "
            "the checkpoint's 'model' (torch.load)"
        )
    if not hf.is_hf(name):
        return _preset_model(name, state)
    try:
        config = hf.config(name)
    except ConfigError as exc:
        raise ConfigError(f"job {job.id}'s model folder is needed to export it: {exc}") from None
    inner = {k.removeprefix("inner."): v for k, v in state.items()}  # HFCausalLM wraps the model as .inner
    return _filled(hf._transformers().AutoModelForCausalLM, config, inner, name)


def _check_out(out: Path, force: bool) -> None:
    if not out.exists():
        return
    if not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder")
    if any(out.iterdir()):
        if not force:
            raise ConfigError(f"--out {out} is not empty (--force replaces an earlier export there)")
        if not (out / INFO).is_file():
            raise ConfigError(f"--out {out} holds files that are not a Cleave export: --force replaces only an export")


def _card(e: Exported) -> str:
    reads = (
        "UTF-8 bytes: token id = byte value (the byte-level tokenizer in this folder does exactly that)"
        if e.tokens is Tokens.BYTES
        else "the tokenizer in this folder, the job's own"
    )
    loss = f"{e.loss:.4f}" if e.loss is not None else "not recorded"
    held_out = f"{e.val_loss:.4f}" if e.val_loss is not None else "not evaluated (--eval-every)"
    trained = f"job {e.job}, checkpoint of step {e.step:,} of {e.steps:,}: {e.tokens_seen:,} tokens"
    return f"""# {e.model}, trained with Cleave

| | |
|---|---|
| Model | {e.model} as `{e.architecture}` (transformers), {e.parameters:,} parameters |
| Training | {trained} seen, in sequences of {e.seq_len:,} |
| Training loss at that step | {loss} |
| Held-out loss, last evaluated | {held_out} |
| Tokens | {reads} |
| Written by | Cleave {package_version()} (`cleave export`) |

## Load it

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("PATH/TO/THIS/FOLDER")
tokenizer = AutoTokenizer.from_pretrained("PATH/TO/THIS/FOLDER")
ids = tokenizer("def ", return_tensors="pt", add_special_tokens=False).input_ids
print(tokenizer.decode(model.generate(ids, max_new_tokens=64, do_sample=True, top_k=50)[0]))
```

Or try it from the command line: `cleave sample PATH/TO/THIS/FOLDER --prompt "def "`.
`{INFO}` records the job, step and loss this folder came from.
"""


def export_job(
    db: Path, out: Path, *, job: int | None = None, step: int | None = None, force: bool = False
) -> Exported:
    """Write job ``job``'s (default: the newest job's) checkpoint of ``step`` (default: its newest)
    in ``db`` as a transformers folder ``out``. ``force`` replaces an earlier export there."""
    _check_out(out, force)
    if not db.is_file():
        raise ConfigError(f"no database at {db} (pass the coordinator's --db)")
    store = SQLiteStore(db)
    try:
        row_job = _job(store, db, job)
        row, state = _checkpoint(store, row_job, step)
        steps = [s for s in store.steps(row_job.id) if s.step <= row.step]
    finally:
        store.close()
    weights: dict[str, torch.Tensor] = state["model"]
    tokens_seen = int(state.get("tokens_seen", 0))
    recorded = {k: state[k] for k in (prepare.TOKENIZER_KEY,) if k in state}
    del state  # the optimizer's moments go now: only the weights are written
    model = _model(row_job, weights)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    tok, tokens = _tokenizer(row_job, vocab, recorded)
    if tokens is Tokens.TOKENIZER and not hf.is_hf(str(row_job.config["model"])):
        # A preset on shards: generation stops where the tokenizer ends a document.
        model.config.eos_token_id = model.generation_config.eos_token_id = tok.eos_token_id
    loss = next((s.loss for s in steps if s.step == row.step), None)
    val_loss = next((s.extra["val_loss"] for s in reversed(steps) if s.extra.get("val_loss") is not None), None)
    exported = Exported(
        out=out,
        job=row_job.id,
        step=row.step,
        steps=row_job.steps,
        model=models.public_name(str(row_job.config["model"])),
        architecture=type(model).__name__,
        tokens=tokens,
        loss=_finite(loss),
        val_loss=_finite(val_loss),
        tokens_seen=tokens_seen,
        seq_len=int(row_job.config.get("seq_len", 0)),
        parameters=sum(p.numel() for p in model.parameters()),
    )
    _write(out, model, tok, exported)
    return exported


def _finite(value: float | None) -> float | None:
    """A loss for JSON: None for none, NaN or infinite (a diverged step)."""
    return float(value) if value is not None and math.isfinite(value) else None


def _write(out: Path, model: nn.Module, tok: Any, exported: Exported) -> None:
    """Everything into a folder beside ``out``, then renamed into place (an earlier export there
    is moved aside first and deleted once the new one is in)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.export-new"
    old = out.parent / f".{out.name}.export-old"
    for leftover in (staging, old):  # a killed export's
        shutil.rmtree(leftover, ignore_errors=True)
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tok.save_pretrained(staging)
        (staging / INFO).write_text(json.dumps(exported.info(), indent=2, sort_keys=True) + "\n")
        (staging / CARD).write_text(_card(exported))
        if out.exists():
            os.replace(out, old)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
