"""A volunteer's side of identities: where credentials live, and which URLs a client accepts."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from cleave.client.connection import URLRefused, check_url, client_tls
from cleave.client.credentials import Credential, CredentialError, CredentialStore
from cleave.client.runner import EXIT_USAGE, WorkerConfig
from cleave.wire.errors import ClientError


def test_credentials_are_kept_per_coordinator_and_name_in_a_private_file(tmp_path: Path) -> None:
    store = CredentialStore(tmp_path / "cfg" / "credentials.json")
    assert store.get("coord-a", "laptop", "wss://a:1") is None
    store.put("coord-a", "laptop", Credential(3, b"s" * 32, "wss://a:1"))
    store.put("coord-a", "laptop-gpu1", Credential(4, b"t" * 32, "wss://a:1"))
    store.put("coord-b", "laptop", Credential(9, b"u" * 32, "wss://b:1"))
    again = CredentialStore(tmp_path / "cfg" / "credentials.json")
    assert again.get("coord-a", "laptop", "wss://A:1/x") == Credential(3, b"s" * 32, "wss://a:1", "laptop")
    assert again.get("coord-b", "laptop", "wss://b:1").identity == 9
    assert again.get("coord-a", "laptop-gpu1", "wss://a:1").identity == 4
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600
    again.forget("coord-a", "laptop", "wss://a:1")
    assert store.get("coord-a", "laptop", "wss://a:1") is None and store.get("coord-b", "laptop", "wss://b:1")


def test_a_credential_is_only_presented_to_the_address_it_was_issued_at(tmp_path: Path) -> None:
    """A rogue server that claims the coordinator's id (to relay its challenge) gets nothing."""
    store = CredentialStore(tmp_path / "credentials.json")
    store.put("coord-a", "laptop", Credential(3, b"s" * 32, "wss://coordinator.example.org:8765"))
    assert store.get("coord-a", "laptop", "wss://coordinator.example.org:8765") is not None
    assert store.get("coord-a", "laptop", "wss://rogue.example.org:8765") is None
    assert store.get("coord-a", "laptop", "wss://coordinator.example.org:9999") is None
    assert store.get("coord-a", "laptop", "wss://coordinator.example.org") is None  # port 443


def test_a_damaged_credentials_file_is_a_clear_error_not_a_silent_reset(tmp_path: Path) -> None:
    path = tmp_path / "credentials.json"
    path.write_text("{not json")
    with pytest.raises(CredentialError, match="not valid JSON"):
        CredentialStore(path).get("c", "n", "ws://h:1")
    path.write_text('{"credentials": {"c|n|h:1": {"identity": "x", "secret": "zz"}}}')
    assert CredentialStore(path).get("c", "n", "ws://h:1") is None  # an unusable entry: enrol again


@pytest.mark.parametrize(
    "url",
    ["ws://127.0.0.1:8765", "ws://localhost:1", "ws://[::1]:9", "wss://example.org:8765", "wss://192.168.1.10:8765"],
)
def test_loopback_ws_and_any_wss_are_accepted(url: str) -> None:
    check_url(url)


@pytest.mark.parametrize("url", ["ws://192.168.1.10:8765", "ws://example.org", "ws://0.0.0.0:8765"])
def test_plain_ws_to_another_host_is_refused_unless_insecure(url: str) -> None:
    with pytest.raises(URLRefused, match="unencrypted"):
        check_url(url)
    check_url(url, insecure=True)
    with pytest.raises(ClientError) as info:
        WorkerConfig(url=url, token="t")
    assert info.value.exit_code == EXIT_USAGE


def test_urls_that_are_not_websockets_are_refused() -> None:
    for url in ("http://example.org", "example.org:8765", "wss://"):
        with pytest.raises(URLRefused):
            check_url(url, insecure=True)


def test_tls_contexts_verify_by_default(tmp_path: Path) -> None:
    import ssl

    assert client_tls("ws://127.0.0.1:1") is None
    ctx = client_tls("wss://example.org")
    assert ctx is not None and ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    with pytest.raises(URLRefused, match="cafile"):
        client_tls("wss://example.org", str(tmp_path / "missing.pem"))


def test_names_must_be_printable_and_short() -> None:
    for name in ("", "x" * 65, "bad\nname"):
        with pytest.raises(ClientError):
            WorkerConfig(url="ws://127.0.0.1:1", token="t", name=name)
