"""Identities and tokens: how a device proves who it is without ever sending its secret again.

Pure functions over bytes (hashlib and hmac, no I/O); the client imports this module too.

Enrolment: a device presents the project's join token once and receives an identity number and
a 32-byte random secret ``S``. The coordinator keeps only ``K = H(S)`` (``stored_key``).

Every later connection is a challenge-response in the manner of SCRAM (RFC 5802):

    coordinator -> device   nonce N (32 random bytes, fresh per connection)
    device                  M = "cleave-auth-v1|<identity>|" + N
                            proof = S xor HMAC(K, M)          (K = H(S), computed from S)
    coordinator             S' = proof xor HMAC(K, M); accept iff H(S') == K (constant time)

* The secret never travels after enrolment, and a recorded hello is useless on another
  connection: its proof is bound to that connection's nonce.
* The database holds ``K`` only: a copy of it does not let anyone connect as a device (that needs
  ``S``, a preimage of ``K``). Someone holding both a copy of the database and a recording of one
  connection can recover ``S``: the reason to serve ``wss://`` and guard the database.
* Tokens (the join token, the operator token) are kept as salted-by-purpose SHA-256 hashes and
  compared hash to hash with ``hmac.compare_digest``.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Callable

SECRET_BYTES = 32
NONCE_BYTES = 32
_IDENTITY = b"cleave-identity-v1|"
_AUTH = "cleave-auth-v1|{identity}|"
_TOKEN = b"cleave-token-v1|"

RandomBytes = Callable[[int], bytes]


def stored_key(secret: bytes) -> bytes:
    """What the coordinator keeps of a device's secret."""
    return hashlib.sha256(_IDENTITY + secret).digest()


def _signature(key: bytes, identity: int, nonce: bytes) -> bytes:
    return hmac.new(key, _AUTH.format(identity=identity).encode() + nonce, hashlib.sha256).digest()


def _xor(a: bytes, b: bytes) -> bytes:
    return bytes(x ^ y for x, y in zip(a, b, strict=True))


def proof(secret: bytes, identity: int, nonce: bytes) -> bytes:
    """The device's answer to a challenge."""
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"a secret has {SECRET_BYTES} bytes, not {len(secret)}")
    return _xor(secret, _signature(stored_key(secret), identity, nonce))


def verify_proof(key: bytes, identity: int, nonce: bytes, answer: bytes) -> bool:
    """True iff ``answer`` proves knowledge of the secret whose stored key is ``key``."""
    if len(answer) != SECRET_BYTES or len(key) != SECRET_BYTES:
        return False
    candidate = _xor(answer, _signature(key, identity, nonce))
    return hmac.compare_digest(stored_key(candidate), key)


def token_hash(token: str) -> bytes:
    """What the coordinator keeps of a token (tokens never reach the database or a log)."""
    return hashlib.sha256(_TOKEN + token.encode("utf-8", "surrogatepass")).digest()


def token_matches(token: str, stored: bytes | None) -> bool:
    """Constant-time comparison of a presented token with a stored hash (False when none is set)."""
    if stored is None or not token:
        return False
    return hmac.compare_digest(token_hash(token), stored)


_RANK = "cleave-rank-v1|{rank}|{world}|"


def rank_proof(secret: bytes, rank: int, world: int, job: bytes, nonces: bytes) -> bytes:
    """A coordinator rank's proof that it holds the tier's secret: an HMAC over its place in
    the tier, the job it was started with (a digest of its options) and every rank's fresh
    nonce, so it cannot be replayed in another tier, as another rank or for another job."""
    return hmac.new(secret, _RANK.format(rank=rank, world=world).encode() + job + nonces, hashlib.sha256).digest()


def rank_proof_ok(secret: bytes, rank: int, world: int, job: bytes, nonces: bytes, answer: bytes) -> bool:
    """Constant-time check of ``answer`` against the proof rank ``rank`` should have given."""
    return len(answer) == hashlib.sha256().digest_size and hmac.compare_digest(
        rank_proof(secret, rank, world, job, nonces), answer
    )


_TIER_SESSION = b"cleave-tier-session-v1|"
_TIER_STATUS = "cleave-tier-status-v1|{rank}|"
_TIER_LOST = "cleave-tier-lost-v1|{rank}|"


def tier_session_key(secret: bytes, job: bytes, nonces: bytes) -> bytes:
    """The key of one meeting of a tier's ranks: what seals their summaries and redirect tickets
    (so nothing sealed in an earlier run, under the same secret, passes in this one)."""
    return hmac.new(secret, _TIER_SESSION + job + nonces, hashlib.sha256).digest()


def tier_status_mac(key: bytes, rank: int, payload: bytes) -> bytes:
    """A rank's seal on the status it publishes to the others (through the rendezvous store,
    which anyone reaching its port can write): an HMAC under the meeting's key
    (``tier_session_key``) over its rank and the payload, so a stranger can neither forge a rank's
    figures nor pass one rank's as another's, nor replay one from another run."""
    return hmac.new(key, _TIER_STATUS.format(rank=rank).encode() + payload, hashlib.sha256).digest()


def tier_lost_mac(key: bytes, rank: int, news: bytes) -> bytes:
    """A rank's seal on its word that rank ``rank`` was lost (its own label: never mistaken for
    a summary)."""
    return hmac.new(key, _TIER_LOST.format(rank=rank).encode() + news, hashlib.sha256).digest()


def tier_lost_ok(key: bytes, rank: int, news: bytes, mac: bytes) -> bool:
    """Whether ``mac`` is a rank's seal on ``news`` of ``rank``'s loss."""
    return len(mac) == hashlib.sha256().digest_size and hmac.compare_digest(tier_lost_mac(key, rank, news), mac)


def tier_status_ok(key: bytes, rank: int, payload: bytes, mac: bytes) -> bool:
    """Constant-time check of a published status's seal."""
    return len(mac) == hashlib.sha256().digest_size and hmac.compare_digest(tier_status_mac(key, rank, payload), mac)


_TIER_NAMESPACE = b"cleave-tier-namespace-v1|"
_TIER_STORE = b"cleave-tier-store-v1|"
_TIER_VALUE = "cleave-tier-value-v1|{size}|{name}|"


def tier_namespace(secret: bytes) -> str:
    """Where a tier's keys live in the rendezvous store: 32 hex digits of an HMAC under the
    secret, so a stranger cannot name a key without listing the store. (Not of the job: a rank
    started with other options must still meet the others, to be refused by name.)"""
    return hmac.new(secret, _TIER_NAMESPACE, hashlib.sha256).hexdigest()[:32]


def tier_store_key(secret: bytes, nonce: bytes = b"") -> bytes:
    """The key that seals what the ranks write to the store before they meet (gloo's
    addresses): under the secret, over rank 0's fresh nonce for this run (the nonce itself is
    sealed under the key without one)."""
    return hmac.new(secret, _TIER_STORE + nonce, hashlib.sha256).digest()


def tier_value_mac(key: bytes, name: str, value: bytes) -> bytes:
    """A rank's seal on ``value`` stored under ``name``: bound to the key's name, so a sealed
    value moved to another key (another rank's heartbeat, another step's arrival) fails."""
    label = _TIER_VALUE.format(size=len(name), name=name).encode("utf-8", "surrogatepass")
    return hmac.new(key, label + value, hashlib.sha256).digest()


def tier_value_ok(key: bytes, name: str, value: bytes, mac: bytes) -> bool:
    """Constant-time check of a stored value's seal."""
    return len(mac) == hashlib.sha256().digest_size and hmac.compare_digest(tier_value_mac(key, name, value), mac)


_TICKET = b"cleave-redirect-v1|"
TICKET = struct.Struct("<IQ16s")  # the rank it is for, when it expires (Unix seconds), a nonce
TICKET_BYTES = TICKET.size + hashlib.sha256().digest_size  # 60: hex, the 120 digits of hello.ticket


def redirect_ticket(secret: bytes, rank: int, expires: int, nonce: bytes) -> bytes:
    """What a rank of a tier gives a newcomer it redirects: the right to enrol once at rank
    ``rank`` before ``expires``, sealed under ``secret`` (the meeting's key: only ranks of this
    run of the tier can make one)."""
    body = TICKET.pack(rank, expires, nonce)
    return body + hmac.new(secret, _TICKET + body, hashlib.sha256).digest()


def open_ticket(secret: bytes, rank: int, ticket: bytes, now: float) -> tuple[bytes, int]:
    """The nonce and expiry of a ticket good for rank ``rank`` at ``now`` (Unix seconds);
    ValueError with the reason when it is not (forged, for another rank, expired). The caller
    makes it single-use."""
    if len(ticket) != TICKET_BYTES:
        raise ValueError("not a ticket")
    body, seal = ticket[: TICKET.size], ticket[TICKET.size :]
    if not hmac.compare_digest(hmac.new(secret, _TICKET + body, hashlib.sha256).digest(), seal):
        raise ValueError("not sealed by a rank of this tier")
    to, expires, nonce = TICKET.unpack(body)
    if to != rank:
        raise ValueError(f"made for rank {to}")
    if now > expires:
        raise ValueError("expired")
    return nonce, expires
