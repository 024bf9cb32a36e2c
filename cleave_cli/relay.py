"""``cleave relay``: serve the coordinator's operand blocks to the devices it puts behind you."""

from __future__ import annotations

import asyncio
import logging
import math
from pathlib import Path
from typing import Annotated

import typer

from cleave.cli import options as opt
from cleave.cli.errors import friendly
from cleave.wire.addresses import url_host
from cleave.wire.errors import ConfigError

MAX_MEMORY_GB = 1024.0


def _listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"--listen must be HOST:PORT, got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


@friendly
def relay(
    url: Annotated[str, typer.Argument(help="The coordinator's address, e.g. wss://coordinator.example.org:8765")],
    token: Annotated[
        str | None,
        opt.secret_option("--token", "The join token, to enrol once (then its credential).", opt.Secret.JOIN_TOKEN),
    ] = None,
    token_file: opt.TokenFile = None,
    listen: Annotated[str, typer.Option("--listen", help="Where devices connect: HOST:PORT.")] = "0.0.0.0:8766",
    public_url: Annotated[
        str | None,
        typer.Option("--public-url", help="The URL devices reach this relay at (default: ws://HOST:PORT of --listen)."),
    ] = None,
    memory_gb: Annotated[float, typer.Option("--memory-gb", help="Blocks cached at most, in GB.")] = 4.0,
    name: Annotated[str, typer.Option("--name", help="This relay's name at the coordinator.")] = "relay",
    cafile: Annotated[
        str | None, typer.Option("--cafile", help="Verify the coordinator's wss:// certificate against this CA.")
    ] = None,
    certfile: Annotated[str | None, typer.Option("--certfile", help="Serve devices wss:// with this chain.")] = None,
    keyfile: Annotated[str | None, typer.Option("--keyfile", help="The key of --certfile.")] = None,
    credentials: Annotated[
        Path | None, typer.Option("--credentials", help="Where its credential is kept (default: as cleave join's).")
    ] = None,
) -> None:
    """Serve the coordinator's operand blocks to the devices it puts behind this machine: each block
    comes from the coordinator once, however many of them need it. Results still go straight to
    the coordinator, which verifies them; devices check every block against its digest."""
    from cleave.client.relay import Relay, RelayConfig

    if not url.startswith(("ws://", "wss://")):
        raise ConfigError(f"the coordinator URL must start with ws:// or wss://, got {url!r}")
    token = opt.read_secret(token, token_file, "--token", opt.Secret.JOIN_TOKEN)
    host, port = _listen(listen)
    if not (math.isfinite(memory_gb) and 0 < memory_gb <= MAX_MEMORY_GB):
        raise ConfigError(f"--memory-gb must be above 0 and at most {MAX_MEMORY_GB:g}, got {memory_gb}")
    if (certfile is None) != (keyfile is None):
        raise ConfigError("--certfile and --keyfile go together")
    scheme = "wss" if certfile else "ws"
    public = public_url or f"{scheme}://{host}:{port}"
    if not public.startswith(("ws://", "wss://")) or not url_host(public):
        raise ConfigError(f"--public-url must be a ws:// or wss:// URL, got {public!r}")
    if host in ("0.0.0.0", "::") and public_url is None:
        raise ConfigError("--listen on every address needs --public-url: the URL devices reach this relay at")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = RelayConfig(
        url,
        (host, port),
        public,
        token=token or "",
        name=name,
        memory_bytes=int(memory_gb * 1e9),
        credentials=credentials,
        cafile=cafile,
        certfile=certfile,
        keyfile=keyfile,
    )
    why = asyncio.run(Relay(cfg).run())
    typer.echo(f"relay stopped: {why}")
