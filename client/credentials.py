"""A volunteer's credentials: one per coordinator and device name, in the user's config folder.

The file (``credentials.json``, mode 0600) maps ``"<coordinator id>|<name>|<host>:<port>"`` to
the identity number and the 32-byte secret a coordinator issued when this device enrolled. The
coordinator id comes from its challenge; the address is the one the device enrolled at, so a
credential is only ever presented to that address: another server claiming the same id (to
relay the proof) gets nothing. The same coordinator reached under another name or address is a
new enrolment. Several clients on one machine share the file under a lock; give each its own
``--name``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from cleave.client.paths import user_dir
from cleave.wire.errors import ConfigError

try:  # POSIX advisory locks; elsewhere concurrent enrolments may race (a second identity, no harm)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]


class CredentialError(ConfigError):
    """The credentials file cannot be read or written."""


@dataclass(frozen=True)
class Credential:
    identity: int
    secret: bytes
    url: str = ""
    name: str = ""


def endpoint(url: str) -> str:
    """``host:port`` of a ws:// or wss:// URL, with the scheme's default port."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    return f"{(parts.hostname or '').lower()}:{port or (443 if parts.scheme == 'wss' else 80)}"


def default_path() -> Path:
    return user_dir("config") / "credentials.json"


class CredentialStore:
    def __init__(self, path: Path | None = None) -> None:
        self.path = path or default_path()

    @staticmethod
    def _key(coordinator: str, name: str, url: str) -> str:
        return f"{coordinator}|{name}|{endpoint(url)}"

    def get(self, coordinator: str, name: str, url: str) -> Credential | None:
        entry = self._read().get(self._key(coordinator, name, url))
        if not isinstance(entry, dict):
            return None
        try:
            secret = bytes.fromhex(entry["secret"])
            identity = int(entry["identity"])
        except (KeyError, TypeError, ValueError):
            return None
        return Credential(identity, secret, str(entry.get("url", "")), name)

    def put(self, coordinator: str, name: str, credential: Credential) -> None:
        with self._locked():
            entries = self._read()
            entries[self._key(coordinator, name, credential.url)] = {
                "identity": credential.identity,
                "secret": credential.secret.hex(),
                "url": credential.url,
                "name": name,
                "enrolled": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            }
            self._write(entries)

    def forget(self, coordinator: str, name: str, url: str) -> None:
        with self._locked():
            entries = self._read()
            if entries.pop(self._key(coordinator, name, url), None) is not None:
                self._write(entries)

    def _read(self) -> dict:
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise CredentialError(f"cannot read {self.path}: {exc}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            raise CredentialError(f"{self.path} is not valid JSON; move it aside to enrol again") from None
        entries = data.get("credentials") if isinstance(data, dict) else None
        return entries if isinstance(entries, dict) else {}

    def _write(self, entries: dict) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"version": 1, "credentials": entries}, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as exc:
            raise CredentialError(f"cannot write {self.path}: {exc}") from None

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        if fcntl is None:
            yield
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            lock = open(self.path.with_name(f".{self.path.name}.lock"), "a")  # noqa: SIM115 - closed below
        except OSError as exc:
            raise CredentialError(f"cannot lock {self.path}: {exc}") from None
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
