"""Who may connect, and how much an identity is trusted: the coordinator's gate.

Network-free, like the Core that owns it: hellos, nonces and ``now`` (monotonic) in, decisions
out. The store keeps identities (their stored keys, bans and revocations) and the hashes of the
join and operator tokens; each identity's ``Standing`` (coordinator/engine/conduct.py) keeps
what this process has seen of its recent behaviour (its last results, leases taken back, cool-offs).
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from dataclasses import dataclass

from cleave.coordinator.engine.balance import Balancer
from cleave.coordinator.engine.conduct import Standing
from cleave.coordinator.engine.limits import TokenBucket, TrustPolicy
from cleave.db.store import IdentityState, Store
from cleave.wire import auth
from cleave.wire.codes import CloseCode
from cleave.wire.errors import AuthError, ConfigError
from cleave.wire.messages import Challenge, Hello

# Settings keys (store.setting): each constant defined once.
JOIN_TOKEN, OPERATOR_TOKEN, COORDINATOR_ID = "join_token_sha256", "operator_token_sha256", "coordinator_id"

STRONG_TOKEN = 16  # characters; shorter tokens given on the command line get a warning


def new_token() -> str:
    """A fresh join or operator token: 16 random bytes, URL-safe (22 characters)."""
    return secrets.token_urlsafe(16)


@dataclass(frozen=True)
class Admission:
    """A device the gate lets in: its identity and the name it enrolled with."""

    identity: int
    name: str
    secret: bytes | None = None  # set when the device has just enrolled: send it its credential


class Gate:
    """Who may connect: the join and operator tokens (their hashes in the store), each
    connection's challenge, enrolments, credential proofs, bans, revocations and cool-offs."""

    def __init__(
        self,
        store: Store,
        trust: TrustPolicy,
        enrolments: TokenBucket,
        randbytes: auth.RandomBytes = secrets.token_bytes,
    ) -> None:
        self.store = store
        self.trust = trust
        self.randbytes = randbytes
        self._enrolments = enrolments
        self._standings: OrderedDict[int, Standing] = OrderedDict()
        coordinator = store.setting(COORDINATOR_ID)
        if coordinator is None:
            coordinator = randbytes(16).hex()
            store.set_setting(COORDINATOR_ID, coordinator)
        self.coordinator = coordinator
        self._join: bytes | None = None
        self._operator: bytes | None = None
        # A rank of a tier: the balancer that checks and spends redirect tickets (engine/balance.py).
        self.tickets: Balancer | None = None
        self.reload()

    # ------------------------------------------------------------------ tokens

    def set_tokens(self, *, join: str | None = None, operator: str | None = None) -> None:
        """Replace the join and/or operator token (only their hashes are stored)."""
        if join is not None:
            store_token(self.store, JOIN_TOKEN, join)
        if operator is not None:
            store_token(self.store, OPERATOR_TOKEN, operator)
        self.reload()

    def start_tokens(self, join: str | None, operator: str | None) -> tuple[str | None, str | None, tuple[str, ...]]:
        """The join and operator tokens of a coordinator's start: as given, else the stored ones
        (kept: only their hashes are stored, so they cannot be told), else new ones. Returns
        (join, operator, which were generated: "join" and/or "operator"). Raises ConfigError
        and stores nothing if the two would be equal."""
        generated = []
        if join is None and not self.has_join():
            join = new_token()
            generated.append("join")
        if operator is None and not self.has_operator():
            operator = new_token()
            generated.append("operator")
        if self.would_collide(join=join, operator=operator):
            raise ConfigError("the operator token must differ from the join token")
        self.set_tokens(join=join, operator=operator)
        return join, operator, tuple(generated)

    def reload(self) -> None:
        """Read the token hashes again (an operator may have rotated one)."""
        join, operator = self.store.setting(JOIN_TOKEN), self.store.setting(OPERATOR_TOKEN)
        self._join = bytes.fromhex(join) if join else None
        self._operator = bytes.fromhex(operator) if operator else None

    def has_join(self) -> bool:
        """Whether a join token is set."""
        return self._join is not None

    def has_operator(self) -> bool:
        """Whether an operator token is set."""
        return self._operator is not None

    def would_collide(self, *, join: str | None, operator: str | None) -> bool:
        """Would these tokens (None: keep the stored one) make the join and operator tokens equal?"""
        new_join = auth.token_hash(join) if join is not None else self._join
        new_operator = auth.token_hash(operator) if operator is not None else self._operator
        return new_join is not None and new_join == new_operator

    def is_operator(self, token: str) -> bool:
        """Whether ``token`` is the operator token (compared hash to hash, in constant time)."""
        return auth.token_matches(token, self._operator)

    # ------------------------------------------------------------------ devices

    def challenge(self) -> Challenge:
        """A connection's first frame: a fresh nonce and this coordinator's id."""
        return Challenge(self.randbytes(auth.NONCE_BYTES).hex(), self.coordinator)

    def admit(self, hello: Hello, nonce: str, now: float, record_now: float) -> Admission:
        """Check a device's hello against the nonce it was sent. Raises AuthError."""
        if hello.identity:
            return self._returning(hello, nonce)
        ticket = None
        if hello.ticket:  # another rank of the tier sent it here: its ticket stands for the token
            if self.tickets is None:
                raise AuthError(CloseCode.AUTH, "redirect ticket refused (this coordinator is not a rank of a tier)")
            ticket = self.tickets.check(hello.ticket, record_now)
        else:
            self.check_join(hello.token)
        self.take_enrolment(now)
        if ticket is not None:  # spent only once it enrols: a newcomer told to wait keeps it
            self.tickets.spend(ticket)  # type: ignore[union-attr]
        secret = self.randbytes(auth.SECRET_BYTES)
        name = hello.name or "device"
        identity = self.store.enrol(name, auth.stored_key(secret), record_now)
        return Admission(identity, name, secret)

    def take_enrolment(self, now: float) -> None:
        """One newcomer more (enrolled here, or sent to another rank): AuthError (1013) past the
        enrolment rate."""
        if not self._enrolments.take(now):
            raise AuthError(CloseCode.BUSY, "too many new devices at once; try again shortly")

    def check_join(self, token: str) -> None:
        """Raise AuthError unless ``token`` is the join token."""
        if not auth.token_matches(token, self._join):
            raise AuthError(CloseCode.AUTH, "wrong join token")

    def _returning(self, hello: Hello, nonce: str) -> Admission:
        row = self.store.identity(hello.identity)
        key = self.store.identity_key(hello.identity)
        try:
            answer, challenge = bytes.fromhex(hello.proof), bytes.fromhex(nonce)
        except ValueError:
            answer, challenge = b"", b""
        # One message for every failure, so a peer cannot tell a missing identity from a bad proof.
        if row is None or key is None or not auth.verify_proof(key, hello.identity, challenge, answer):
            raise AuthError(CloseCode.AUTH, "unknown identity or wrong credential")
        if row.state == IdentityState.REVOKED:
            raise AuthError(CloseCode.REVOKED, f"credential revoked by the operator{_why(row.reason)}")
        if row.state == IdentityState.BANNED:
            raise AuthError(CloseCode.BANNED, f"banned{_why(row.reason)}")
        return Admission(row.id, row.name)

    def standing(self, identity: int) -> Standing:
        """The identity's record, created from the store at first sight (least recent forgotten)."""
        found = self._standings.get(identity)
        if found is not None:
            self._standings.move_to_end(identity)
            return found
        found = Standing(self.store.identity_total(identity)[1])
        self._standings[identity] = found
        while len(self._standings) > self.trust.standings:
            self._standings.popitem(last=False)
        return found

    def check_cooloff(self, identity: int, now: float) -> None:
        """Raise AuthError while a cut identity waits out its cool-off."""
        wait = self.standing(identity).cooloff_until - now
        if wait > 0:
            raise AuthError(
                CloseCode.STALLING, f"cut for holding tiles past their deadlines; come back in {wait:.0f} s"
            )

    def ban(self, identity: int, reason: str, record_now: float) -> None:
        """Ban ``identity`` for good (stored: only an operator lifts it)."""
        self.store.set_identity_state(identity, IdentityState.BANNED, reason, record_now)

    def states(self, identities: list[int]) -> dict[int, str]:
        """The stored state of each identity (active, banned, revoked)."""
        return self.store.identity_states(identities) if identities else {}

    @staticmethod
    def active(state: str | None) -> bool:
        """Whether a stored state lets an identity connect."""
        return state == IdentityState.ACTIVE


def _why(reason: str) -> str:
    return f": {reason}" if reason else ""


def store_token(store: Store, which: str, token: str) -> None:
    """Keep ``token``'s hash as the join (``JOIN_TOKEN``) or operator (``OPERATOR_TOKEN``) token.
    A running coordinator on the same database picks it up within a second."""
    if which not in (JOIN_TOKEN, OPERATOR_TOKEN):
        raise ValueError(f"no such token: {which}")
    store.set_setting(which, auth.token_hash(token).hex())
