"""Who may connect, and how much an identity is trusted: the coordinator's gate.

Network-free, like the Core that owns it: hellos, nonces and ``now`` (monotonic) in, decisions
out. The store keeps identities (their stored keys, bans and revocations) and the hashes of the
join and operator tokens; ``Standing`` keeps what this process has seen of each identity's
recent behaviour (its last results, leases taken back, cool-offs).
"""

from __future__ import annotations

import secrets
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from coordinator.engine.limits import TokenBucket, TrustPolicy
from coordinator.wire import auth
from coordinator.wire.codes import CloseCode
from coordinator.wire.errors import AuthError
from coordinator.wire.messages import Challenge, Hello
from db.store import ACTIVE, BANNED, REVOKED, Store

# Settings keys (store.setting): each constant defined once.
JOIN_TOKEN, OPERATOR_TOKEN, COORDINATOR_ID = "join_token_sha256", "operator_token_sha256", "coordinator_id"


@dataclass(frozen=True)
class Admission:
    identity: int
    name: str
    secret: bytes | None = None  # set when the device has just enrolled: send it its credential


@dataclass
class Standing:
    """An identity's recent record in this process (bans and revocations are in the store)."""

    verified_total: int  # over every job, from the store at first sight, then counted here
    recent: deque[bool] = field(default_factory=deque)  # its last results: True verified, False rejected
    grown: int = 0  # verified results since it was last sent back to one slot
    taken_in_a_row: int = 0  # leases taken back since its last verified result
    unanswered: int = 0  # leases that ended without its result (lost to a copy, taken back) since then
    cuts: int = 0
    cooloff_until: float = 0.0
    budgets: tuple[TokenBucket, TokenBucket, TokenBucket] | None = None  # releases, resends, reconnects

    def on_probation(self, trust: TrustPolicy) -> bool:
        return self.verified_total < trust.probation_tiles

    def slots(self, trust: TrustPolicy, asked: int) -> int:
        """Tiles it may hold now: earned by verified work, never more than it asked for."""
        if self.on_probation(trust):
            return 1
        return max(1, min(asked, trust.max_slots, trust.first_slots + self.grown // trust.grow_every))

    def verified(self, trust: TrustPolicy) -> None:
        self._remember(True, trust)
        self.verified_total += 1
        self.grown += 1
        self.taken_in_a_row = 0
        self.unanswered = 0

    def rejected(self, trust: TrustPolicy) -> bool:
        """Counts a failed result; True when the identity must be banned."""
        probation = self.on_probation(trust)
        self._remember(False, trust)
        rejects = sum(1 for ok in self.recent if not ok)
        return rejects >= (1 if probation else trust.ban_rejects)

    def late(self) -> None:
        """A lease passed its deadline: back to one slot until it earns more again."""
        self.grown = 0

    def taken_back(self, trust: TrustPolicy) -> bool:
        """A lease was revoked; True when the identity must be cut."""
        self.taken_in_a_row += 1
        overtaken = self.overtaken(trust)
        return self.taken_in_a_row >= trust.cut_after or overtaken

    def overtaken(self, trust: TrustPolicy) -> bool:
        """A lease went to another copy without its result: back to its first slots; True when
        too many in a row mean it holds tiles without computing them (it must be cut)."""
        self.unanswered += 1
        self.grown = 0
        limit = trust.cut_unanswered if self.on_probation(trust) else trust.cut_unanswered_trusted
        return self.unanswered >= limit

    def cut(self, trust: TrustPolicy, now: float) -> float:
        """Cut it: it may come back after the returned number of seconds (doubling each time)."""
        self.cuts += 1
        self.taken_in_a_row = self.unanswered = 0
        wait = min(trust.cooloff_max, trust.cooloff * 2 ** (self.cuts - 1))
        self.cooloff_until = now + wait
        return wait

    def _remember(self, ok: bool, trust: TrustPolicy) -> None:
        self.recent.append(ok)
        while len(self.recent) > trust.window:
            self.recent.popleft()


class Gate:
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
        self.reload()

    # ------------------------------------------------------------------ tokens

    def set_tokens(self, *, join: str | None = None, operator: str | None = None) -> None:
        """Replace the join and/or operator token (only their hashes are stored)."""
        if join is not None:
            store_token(self.store, JOIN_TOKEN, join)
        if operator is not None:
            store_token(self.store, OPERATOR_TOKEN, operator)
        self.reload()

    def reload(self) -> None:
        """Read the token hashes again (an operator may have rotated one)."""
        join, operator = self.store.setting(JOIN_TOKEN), self.store.setting(OPERATOR_TOKEN)
        self._join = bytes.fromhex(join) if join else None
        self._operator = bytes.fromhex(operator) if operator else None

    def has_join(self) -> bool:
        return self._join is not None

    def has_operator(self) -> bool:
        return self._operator is not None

    def would_collide(self, *, join: str | None, operator: str | None) -> bool:
        """Would these tokens (None: keep the stored one) make the join and operator tokens equal?"""
        new_join = auth.token_hash(join) if join is not None else self._join
        new_operator = auth.token_hash(operator) if operator is not None else self._operator
        return new_join is not None and new_join == new_operator

    def is_operator(self, token: str) -> bool:
        return auth.token_matches(token, self._operator)

    # ------------------------------------------------------------------ devices

    def challenge(self) -> Challenge:
        return Challenge(self.randbytes(auth.NONCE_BYTES).hex(), self.coordinator)

    def admit(self, hello: Hello, nonce: str, now: float, record_now: float) -> Admission:
        """Check a device's hello against the nonce it was sent. Raises AuthError."""
        if hello.identity:
            return self._returning(hello, nonce)
        if not auth.token_matches(hello.token, self._join):
            raise AuthError(CloseCode.AUTH, "wrong join token")
        if not self._enrolments.take(now):
            raise AuthError(CloseCode.BUSY, "too many new devices at once; try again shortly")
        secret = self.randbytes(auth.SECRET_BYTES)
        name = hello.name or "device"
        identity = self.store.enrol(name, auth.stored_key(secret), record_now)
        return Admission(identity, name, secret)

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
        if row.state == REVOKED:
            raise AuthError(CloseCode.REVOKED, f"credential revoked by the operator{_why(row.reason)}")
        if row.state == BANNED:
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
        wait = self.standing(identity).cooloff_until - now
        if wait > 0:
            raise AuthError(
                CloseCode.STALLING, f"cut for holding tiles past their deadlines; come back in {wait:.0f} s"
            )

    def ban(self, identity: int, reason: str, record_now: float) -> None:
        self.store.set_identity_state(identity, BANNED, reason, record_now)

    def states(self, identities: list[int]) -> dict[int, str]:
        return self.store.identity_states(identities) if identities else {}

    @staticmethod
    def active(state: str | None) -> bool:
        return state == ACTIVE


def _why(reason: str) -> str:
    return f": {reason}" if reason else ""


def store_token(store: Store, which: str, token: str) -> None:
    """Keep ``token``'s hash as the join (``JOIN_TOKEN``) or operator (``OPERATOR_TOKEN``) token.
    A running coordinator on the same database picks it up within a second."""
    if which not in (JOIN_TOKEN, OPERATOR_TOKEN):
        raise ValueError(f"no such token: {which}")
    store.set_setting(which, auth.token_hash(token).hex())
