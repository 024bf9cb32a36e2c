"""The operator's commands on a coordinator's database: the devices enrolled (list, revoke,
unban) and the tokens (rotate). They work while the coordinator runs (it reads the changes within a
second) and need no torch, so they answer in a fraction of a second."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from cleave.cli import render
from cleave.cli.errors import friendly, stderr_console
from cleave.cli.options import DEFAULT_DB, Db, print_json, read_secret
from cleave.coordinator.engine.identity import JOIN_TOKEN, OPERATOR_TOKEN, STRONG_TOKEN, new_token, store_token
from cleave.db.sqlite import SQLiteStore
from cleave.db.store import IdentityState
from cleave.wire.auth import token_hash
from cleave.wire.errors import ConfigError
from cleave.wire.messages import MAX_TOKEN

devices_app = typer.Typer(
    help="The devices enrolled on a coordinator's --db: list, revoke, unban.", no_args_is_help=True
)
token_app = typer.Typer(help="The coordinator's join and operator tokens.", no_args_is_help=True)
Identity = Annotated[int, typer.Argument(help="The device's number (cleave coordinator devices list).")]


def add_to(app: typer.Typer) -> None:
    """Mount ``devices`` and ``token`` under ``cleave coordinator``."""
    app.add_typer(devices_app, name="devices")
    app.add_typer(token_app, name="token")


def _open(db: Path) -> SQLiteStore:
    if not db.exists():
        raise ConfigError(f"no database at {db} (pass the coordinator's --db)")
    return SQLiteStore(db)


@devices_app.command("list")
@friendly
def devices_list(
    db: Db = DEFAULT_DB,
    limit: Annotated[int, typer.Option(help="Show at most this many, newest first.")] = 200,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON list.")] = False,
) -> None:
    """List enrolled devices: state, record and verified work (works while the coordinator runs)."""
    if not 1 <= limit <= 1_000_000:
        raise ConfigError(f"--limit must be between 1 and 1,000,000, got {limit}")
    store = _open(db)
    try:
        rows = store.identities(limit)
    finally:
        store.close()
    if as_json:
        print_json([{**row.__dict__, "reliability": round(row.reliability, 4)} for row in rows])
    else:
        Console(highlight=False).print(render.identities(rows))


def _set_state(db: Path, identity: int, want: str, reason: str, allowed_from: tuple[str, ...]) -> str:
    store = _open(db)
    try:
        row = store.identity(identity)
        if row is None:
            raise ConfigError(f"no device #{identity} in {db}")
        if row.state not in allowed_from:
            raise ConfigError(f"device #{identity} ({row.name}) is {row.state}")
        store.set_identity_state(identity, want, reason, time.time())
        return row.name
    finally:
        store.close()


@devices_app.command("revoke")
@friendly
def devices_revoke(
    identity: Identity,
    db: Db = DEFAULT_DB,
    reason: Annotated[str, typer.Option(help="Recorded, and shown to the device when it is refused.")] = "",
) -> None:
    """Revoke a device's credential: a running coordinator cuts it within a second and refuses it
    from then on. Its record and credit stay."""
    name = _set_state(db, identity, IdentityState.REVOKED, reason[:200], (IdentityState.ACTIVE, IdentityState.BANNED))
    Console(highlight=False).print(f"device #{identity} ({name}) revoked", markup=False)


@devices_app.command("unban")
@friendly
def devices_unban(
    identity: Identity,
    db: Db = DEFAULT_DB,
) -> None:
    """Let a banned device connect again; its record stays. A revoked credential cannot be
    reinstated: that device enrols again with the join token (cleave join --new-identity)."""
    name = _set_state(db, identity, IdentityState.ACTIVE, "", (IdentityState.BANNED,))
    Console(highlight=False).print(f"device #{identity} ({name}) may connect again", markup=False)


@token_app.command("rotate")
@friendly
def token_rotate(
    db: Db = DEFAULT_DB,
    operator: Annotated[
        bool, typer.Option("--operator", help="Rotate the operator token instead of the join token.")
    ] = False,
    token: Annotated[
        str | None,
        typer.Option(
            "--token",
            help="The new token. Default: a generated one (printed). Prefer --token-file: other users can read "
            "a command line.",
        ),
    ] = None,
    token_file: Annotated[
        Path | None,
        typer.Option(
            "--token-file",
            help="Read the new token from this file (one line; a trailing newline is dropped). CLEAVE_TOKEN and "
            "CLEAVE_OPERATOR_TOKEN are not read: they hold the token being replaced.",
        ),
    ] = None,
) -> None:
    """Replace the join token (enrolled devices are not affected: they use their credentials) or
    the operator token. A running coordinator on --db uses the new one within a second."""
    # No environment variable: an operator's CLEAVE_TOKEN is the old token, and rotating to it changes nothing.
    given = read_secret(token, token_file, "--token", None)
    new = given if given is not None else new_token()
    if not (new.strip() and new.isprintable() and len(new) <= MAX_TOKEN):
        raise ConfigError(f"--token must be 1 to {MAX_TOKEN} printable characters")
    if len(new) < STRONG_TOKEN:
        stderr_console().print(
            f"warning: a token of {len(new)} characters can be searched for by anyone who copies "
            "the database; generated tokens have 22",
            style="yellow",
        )
    store = _open(db)
    try:
        mine, other = (OPERATOR_TOKEN, JOIN_TOKEN) if operator else (JOIN_TOKEN, OPERATOR_TOKEN)
        if store.setting(other) == token_hash(new).hex():
            raise ConfigError("the join and operator tokens must differ")
        store_token(store, mine, new)
    finally:
        store.close()
    which = "operator" if operator else "join"
    Console(highlight=False).print(f"new {which} token: {new}", markup=False)
