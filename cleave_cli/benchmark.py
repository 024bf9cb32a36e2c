"""``cleave benchmark``: how fast this device multiplies, and how fast its link to a coordinator is."""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer
from rich.console import Console

from cleave.cli import options as opt
from cleave.cli import render
from cleave.cli.errors import friendly
from cleave.client import benchmark as bench
from cleave.client import kernels
from cleave.client.connection import URLRefused, check_url
from cleave.wire.errors import CleaveError, ConfigError


@friendly
def benchmark(
    device: Annotated[
        str, typer.Option(help="Device to measure: auto (CUDA, then MPS, then CPU), cpu, mps or cuda.")
    ] = "auto",
    threads: Annotated[int | None, typer.Option(help="CPU threads for the GEMMs. Default: torch's choice.")] = None,
    url: Annotated[
        str | None, typer.Option("--url", help="Also measure round trip and throughput to this coordinator.")
    ] = None,
    token: Annotated[
        str | None,
        opt.secret_option(
            "--token", "The coordinator's operator token (needed with --url).", opt.Secret.OPERATOR_TOKEN
        ),
    ] = None,
    token_file: opt.StatusTokenFile = None,
    cafile: opt.CaFile = None,
    insecure: opt.Insecure = False,
    seconds: Annotated[float, typer.Option(help="Seconds per GEMM measurement.")] = 0.4,
    as_json: opt.AsJson = False,
) -> None:
    """Measure GEMM GFLOP/s (float32, bfloat16, float16 where supported) at tile-like shapes,
    usable memory and, with --url, the link to a coordinator. Refreshes the cache `cleave join` uses."""
    if not 0.05 <= seconds <= 60:
        raise ConfigError(f"--seconds must be between 0.05 and 60, got {seconds}")
    if threads is not None and not 1 <= threads <= 1024:
        raise ConfigError(f"--threads must be between 1 and 1024, got {threads}")
    token = opt.read_secret(token, token_file, "--token", opt.Secret.OPERATOR_TOKEN)
    if url is not None and not token:
        raise ConfigError(
            "--url needs the operator token (CLEAVE_OPERATOR_TOKEN, --token-file or --token): the coordinator "
            "checks it before answering"
        )
    if url is not None:
        try:
            check_url(url, insecure=insecure)
        except URLRefused as exc:
            raise ConfigError(str(exc)) from None
    dev = kernels.pick_device(device)
    kernels.configure(dev, threads)
    err = Console(stderr=True, highlight=False)
    link = None
    if url is not None:  # first: a wrong token or an unreachable coordinator fails before the GEMMs
        with err.status(f"measuring the link to {url} ..."):
            try:
                link = asyncio.run(bench.measure_link(url, str(token), cafile=str(cafile) if cafile else None))
            except (OSError, RuntimeError, TimeoutError) as exc:
                raise CleaveError(f"cannot measure the link to {url}: {exc}") from None
            except Exception as exc:  # websockets' handshake and close errors
                raise CleaveError(f"the coordinator at {url} refused the link test: {exc}") from None
    with err.status(f"measuring GEMMs on {dev} ..."):
        result = bench.run(dev, seconds=seconds)
        bench.quick_gflops(dev, seconds=0.3, refresh=True)  # what `cleave join` reports at registration
    result.link = link
    if as_json:
        opt.print_json(result.to_dict())
    else:
        Console(highlight=False).print(render.benchmark_table(result))
