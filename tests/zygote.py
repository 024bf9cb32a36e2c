"""A fork server for the tests' ``cleave`` processes: torch imported once, each process forked.

Importing torch costs about 2.3 s of CPU here, and the suite starts hundreds of coordinators,
clients and doubles: most of its CPU was imports, on two cores. This server (one per test
process, ``procs.py`` starts it) imports torch and Cleave's heavy modules once, then forks a
child per request: the child starts in milliseconds with everything imported, and is otherwise
the process ``python -m cleave_cli ARGS`` (or ``python SCRIPT ARGS``) would have been: its own
pid and session, stdin and stdout/stderr on the file descriptors it was sent, its environment
and working folder, fresh random seeds, the default signal handlers.

Protocol, one Unix-socket connection per child: the client sends one JSON line
``{"argv": [...], "env": {...}, "cwd": "..."}`` with three file descriptors (stdin, stdout,
stderr) attached (``socket.send_fds``); the server answers ``{"pid": N}\\n`` and, when the child ends,
``{"status": S}\\n`` (``os.waitpid``'s status). The server is single-threaded (forking a process
with threads is unsafe), and exits when its listening socket's parent goes away (stdin closes).

Run as ``python tests/zygote.py SOCKET_PATH``.
"""

from __future__ import annotations

import json
import os
import runpy
import select
import signal
import socket
import sys


def _preload() -> None:
    import numpy  # noqa: F401
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (torch's AdamW imports it when built: 1.5-3 s of CPU a coordinator)

    import cleave.cli.app  # noqa: F401
    import cleave.client.runner  # noqa: F401
    import cleave.coordinator.job  # noqa: F401
    import cleave.emulator.devices  # noqa: F401


def _child(request: dict, fds: list[int]) -> None:
    """In the forked child: become the requested process, then exit with its code."""
    os.setsid()  # its own session and group, as a process started afresh would be signalled alone
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    # Python's own start-up dispositions: Ctrl-C raises KeyboardInterrupt, a write to a closed
    # pipe or socket raises (SIGPIPE ignored), the rest as the system has them.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    for sig in (signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    import random

    import numpy as np
    import torch

    random.seed()
    np.random.seed()
    torch.seed()
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    argv = request["argv"]
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int) and exc.code is not None:
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = 130
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def main() -> None:
    path = sys.argv[1]
    _preload()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    print("ready", flush=True)
    children: dict[int, socket.socket] = {}  # pid -> the connection waiting for its end
    while True:
        readable, _, _ = select.select([server, sys.stdin], [], [], 0.05)
        if sys.stdin in readable and not sys.stdin.buffer.read1(1):  # the test process is gone
            break
        if server in readable:
            conn, _ = server.accept()
            message, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
            request = json.loads(message.decode())
            pid = os.fork()
            if pid == 0:
                server.close()
                conn.close()
                for other in children.values():
                    other.close()
                _child(request, fds)
            for fd in fds:
                os.close(fd)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            children[pid] = conn
        while children:  # reap whoever ended, and tell its connection
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(json.dumps({"status": status}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


if __name__ == "__main__":
    main()
