"""A job served in this process with client processes on this machine (demo and benchmarks)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from pathlib import Path

from cleave.cli.options import Secret
from cleave.coordinator.config import CoordinatorConfig
from cleave.coordinator.job import JobOutcome, Reporter, serve_job
from cleave.wire.errors import CleaveError


async def serve_with_local_clients(
    cfg: CoordinatorConfig,
    reporter: Reporter,
    *,
    clients: int,
    threads: int,
    name: str = "laptop",
    exit_timeout: float = 30.0,
    quiet_clients: bool = False,
) -> JobOutcome:
    """Serve ``cfg``'s job and start ``clients`` `cleave join --once --always` processes for it."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[str] = loop.create_future()
    job = asyncio.create_task(serve_job(cfg, reporter, ready=ready.set_result))
    done, _ = await asyncio.wait({job, ready}, return_when=asyncio.FIRST_COMPLETED)
    if job in done:  # failed before listening
        return job.result()
    url = ready.result()
    output = asyncio.subprocess.DEVNULL if quiet_clients else None
    # The token by environment: other users can read a command line, not another user's environment.
    env = {**os.environ, Secret.JOIN_TOKEN.value: str(cfg.token)}
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "cleave",
            "join",
            url,
            "--once",
            "--quiet",
            "--threads",
            str(threads),
            "--name",
            f"{name}-{i + 1}",
            "--device",
            "cpu",
            "--always",
            # Beside the job's database: a throwaway job's credentials do not belong in the user's folder.
            "--credentials",
            str(Path(cfg.db).resolve().parent / "credentials.json"),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=output,
            env=env,
        )
        for i in range(clients)
    ]
    # A job waits for its devices: should every client exit first (it could not start, or could
    # not join), the job would wait for ever. The clients exit with the job's end too, so the job
    # gets ``exit_timeout`` to end after them before it is stopped.
    exits = asyncio.ensure_future(asyncio.gather(*(p.wait() for p in procs)))
    try:
        await asyncio.wait({job, exits}, return_when=asyncio.FIRST_COMPLETED)
        if not job.done():
            finished, _ = await asyncio.wait({job}, timeout=exit_timeout)
            if not finished:
                job.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await job
                codes = exits.result()
                raise CleaveError(
                    f"every local client exited (codes {codes}) and the job did not end within "
                    f"{exit_timeout:g} s: nothing is left to compute its tiles (the clients' errors are above)"
                )
        outcome = await job
        try:
            codes = await asyncio.wait_for(asyncio.shield(exits), exit_timeout)
        except (TimeoutError, asyncio.TimeoutError):
            raise CleaveError(f"the clients did not exit within {exit_timeout:g} s of the job's end") from None
        if any(codes):
            raise CleaveError(f"a client exited with {codes}")
        return outcome
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
                await p.wait()
        await asyncio.gather(exits, return_exceptions=True)  # done once every process is
