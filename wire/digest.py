"""Content addresses of blocks: what a relay serves and a device checks (protocol 7).

A block's digest is BLAKE2b-256 over its wire dtype's name, its shape and its bytes as they travel
(little-endian, row-major), so two blocks with the same bytes but another shape or dtype differ.
A relay seals what it serves with its own key (``tag``: the digest asked for and the digest of
the bytes it sent): the coordinator, which knows that key, can tell a relay's word from a
device's, and a device cannot make one.

Pure functions over tensors and bytes; the client, the relay and the coordinator import them.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_TAG = b"cleave-relay-tag-v1|"
_TICKET = b"cleave-relay-ticket-v1|"


def _raw(t: torch.Tensor) -> memoryview:
    from cleave.wire.messages import _raw as raw  # the bytes exactly as encode sends them

    return raw(t)


def _head(t: torch.Tensor) -> bytes:
    from cleave.wire.messages import _tensor_desc

    desc = _tensor_desc(t)
    return f"{desc['dtype']}|{'x'.join(str(s) for s in desc['shape'])}|".encode()


def block_digest(t: torch.Tensor) -> str:
    """The content address of ``t``: 64 lowercase hex digits."""
    h = hashlib.blake2b(digest_size=32)
    h.update(_head(t))
    h.update(_raw(t))
    return h.hexdigest()


def relay_tag(key: bytes, digest: str, sent: str) -> str:
    """A relay's seal on serving, as block ``digest``, bytes whose own digest is ``sent`` (keyed
    BLAKE2b-256, hex). A device that got other bytes than it asked for reports both digests and
    this seal: only the relay's key makes it, so a valid seal on a mismatch proves the relay lied."""
    h = hashlib.blake2b(digest_size=32, key=key[:64])
    h.update(_TAG + digest.encode() + b"|" + sent.encode())
    return h.hexdigest()


def tag_ok(key: bytes, digest: str, sent: str, tag: str) -> bool:
    """Whether ``tag`` is the relay's seal on serving bytes of digest ``sent`` as ``digest``."""
    return hmac.compare_digest(relay_tag(key, digest, sent), tag)


def relay_ticket(key: bytes, relay: int, device: int) -> str:
    """What a device shows relay ``relay`` to be served: made by the coordinator with the relay's
    key (``auth.stored_key`` of its secret, which both hold), checked by the relay."""
    return hmac.new(key, _TICKET + f"{relay}|{device}".encode(), hashlib.sha256).hexdigest()


def ticket_ok(key: bytes, relay: int, device: int, ticket: str) -> bool:
    """Whether ``ticket`` is the coordinator's for ``device`` at ``relay`` (constant time)."""
    return hmac.compare_digest(relay_ticket(key, relay, device), ticket)
