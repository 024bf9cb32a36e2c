"""Secrets (the join and operator tokens, a tier's secret) from the environment or a file: none
needs to be on a command line, which every user of the machine can read (ps, /proc/PID/cmdline)."""

from __future__ import annotations

import contextlib
import os
import queue
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import ROOT, TIMEOUT
from procs import Proc, cleave_cmd, env, join_cmd
from typer.testing import CliRunner
from websockets.exceptions import ConnectionClosed
from websockets.sync.server import ServerConnection, serve

from cleave.cli.app import app
from cleave.cli.options import MAX_SECRET_FILE, Secret, read_secret
from cleave.coordinator.engine.identity import JOIN_TOKEN, OPERATOR_TOKEN
from cleave.db.sqlite import SQLiteStore
from cleave.wire.auth import token_hash
from cleave.wire.codes import CloseCode
from cleave.wire.errors import ConfigError
from cleave.wire.messages import Challenge, Hello, StatusReply, StatusRequest, decode, encode

NOT_MINE = {s.value: f"the {s.name.lower()}" for s in Secret}  # every variable set, to catch a wrong one read


def _file(path: Path, text: str, mode: int = 0o600) -> Path:
    path.touch(mode=mode)
    path.chmod(mode)
    path.write_text(text)
    return path


def _cli(*args: str, environ: dict[str, str] | None = None) -> tuple[int, str]:
    """A command run in this process, with only ``environ``'s secrets in its environment."""
    clean = {s.value: None for s in Secret}  # None: unset in CliRunner's environment
    result = CliRunner().invoke(app, list(args), env={**clean, **(environ or {}), "COLUMNS": "400", "NO_COLOR": "1"})
    return result.exit_code, " ".join(result.output.split())


# --------------------------------------------------------------------------- the one helper


@pytest.mark.parametrize("secret", list(Secret))
def test_each_secret_comes_from_its_flag_else_its_file_else_its_variable(secret: Secret, tmp_path: Path) -> None:
    path = _file(tmp_path / "secret", "from the file\n")
    mine = {**NOT_MINE, secret.value: "from the variable"}
    assert read_secret(None, None, "--x", secret, environ=mine) == "from the variable"
    assert read_secret(None, path, "--x", secret, environ=mine) == "from the file"  # named here: beats the variable
    assert read_secret("from the flag", None, "--x", secret, environ=mine) == "from the flag"
    others = {k: v for k, v in NOT_MINE.items() if k != secret.value}
    assert read_secret(None, None, "--x", secret, environ=others) is None  # only its own variable counts
    assert read_secret(None, None, "--x", secret, environ={**others, secret.value: ""}) is None  # empty: unset
    assert read_secret(None, None, "--x", None, environ=mine) is None  # a command that reads no variable
    path.write_bytes(b"crlf line\r\n")
    assert read_secret(None, path, "--x", secret, environ={}) == "crlf line"
    path.write_bytes(b" no newline ")
    assert read_secret(None, path, "--x", secret, environ={}) == " no newline "  # only the line's end is dropped


def test_a_value_and_a_file_together_or_a_bad_file_is_one_clear_error(tmp_path: Path) -> None:
    good = _file(tmp_path / "good", "token\n")
    with pytest.raises(ConfigError, match="^pass --token or --token-file, not both$"):
        read_secret("token", good, "--token", Secret.JOIN_TOKEN, environ={})
    bad = {
        b"": "is empty",
        b"\n": "is empty",
        b"  \n": "is empty",
        b"one\ntwo\n": "holds several lines",
        b"one\n\n": "holds several lines",
        b"nul\x00inside": "holds unprintable characters",
        b"\xff\xfe": "is not UTF-8 text",
        b"x" * (MAX_SECRET_FILE + 1): f"is over {MAX_SECRET_FILE} bytes",
    }
    for content, why in bad.items():
        path = tmp_path / "bad"
        path.write_bytes(content)
        with pytest.raises(ConfigError, match=f"^--operator-token-file: {path} {why}"):
            read_secret(None, path, "--operator-token", Secret.OPERATOR_TOKEN, environ={})
    for path, why in ((tmp_path / "missing", "No such file"), (tmp_path, "Is a directory")):
        with pytest.raises(ConfigError, match=f"^--tier-secret-file: cannot read {path}: {why}"):
            read_secret(None, path, "--tier-secret", Secret.TIER_SECRET, environ={})


@pytest.mark.skipif(os.name != "posix", reason="file modes")
def test_a_secret_file_other_users_may_read_is_taken_with_a_warning_as_ssh_would(tmp_path: Path) -> None:
    warnings: list[str] = []
    path = _file(tmp_path / "secret", "s3cret\n", mode=0o644)
    assert read_secret(None, path, "--token", Secret.JOIN_TOKEN, warn=warnings.append) == "s3cret"
    assert warnings == [f"warning: other users may read or change {path} (mode 0644); chmod 600 it"]
    path.chmod(0o620)  # group-writable: another user could put their own token there
    read_secret(None, path, "--token", Secret.JOIN_TOKEN, warn=warnings.append)
    path.chmod(0o600)
    read_secret(None, path, "--token", Secret.JOIN_TOKEN, warn=warnings.append)
    assert len(warnings) == 2 and "mode 0620" in warnings[1]
    r, w = os.pipe()  # --token-file <(pass show cleave): a pipe has no owner-only mode to check
    os.write(w, b"piped\n")
    os.close(w)
    try:
        assert read_secret(None, Path(f"/dev/fd/{r}"), "--token", Secret.JOIN_TOKEN, warn=warnings.append) == "piped"
    finally:
        os.close(r)
    assert len(warnings) == 2


# --------------------------------------------------------------------------- a coordinator double


@dataclass
class _Double:
    url: str
    heard: queue.Queue = field(default_factory=queue.Queue)  # (message, [its peers' command lines])
    pids: list[int] = field(default_factory=list)  # whose command lines to read


@contextlib.contextmanager
def _double(operator: str = "") -> Iterator[_Double]:
    """A coordinator that speaks the real handshake and tells what each peer sent: a hello is
    refused (4001) once heard, a status request answered when it carries ``operator``. With
    each message, the command lines of the processes in ``pids``, read while the peer waits."""
    double = _Double("")

    def handler(ws: ServerConnection) -> None:
        ws.send(encode(Challenge(nonce="ab" * 32, coordinator="double")))
        try:
            msg = decode(ws.recv(timeout=TIMEOUT))
        except (ConnectionClosed, TimeoutError):
            return
        double.heard.put((msg, [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in double.pids]))
        if isinstance(msg, StatusRequest) and msg.token == operator:
            ws.send(encode(StatusReply({"job": {"state": "training"}})))
        else:
            ws.close(CloseCode.AUTH, "refused by the double")

    with serve(handler, "127.0.0.1", 0) as server:
        double.url = f"ws://127.0.0.1:{server.socket.getsockname()[1]}"
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield double
        finally:
            server.shutdown()
            thread.join(TIMEOUT)


def _token_heard(double: _Double) -> str:
    msg, _ = double.heard.get(timeout=TIMEOUT)
    assert isinstance(msg, (Hello, StatusRequest)), msg
    return msg.token


# --------------------------------------------------------------------------- the commands


def test_status_takes_the_operator_token_from_its_variable_a_file_or_the_flag(tmp_path: Path) -> None:
    """``cleave status`` against a real websocket: the token that reaches the coordinator."""
    op = "operator-s3cret"
    with _double(op) as double:
        for args, environ in (
            ((), {**NOT_MINE, "CLEAVE_OPERATOR_TOKEN": op}),
            (("--token-file", str(_file(tmp_path / "op", op + "\n"))), {}),
            (("--token", op), {"CLEAVE_OPERATOR_TOKEN": "stale"}),  # the flag, named here, beats the variable
        ):
            code, out = _cli("status", "--url", double.url, "--json", *args, environ=environ)
            assert (code, out) == (0, '{"job": {"state": "training"}}'), (args, out)
            assert _token_heard(double) == op
        only_join = {"CLEAVE_TOKEN": op}  # the join token's variable is not the operator's
        code, out = _cli("status", "--url", double.url, "--json", environ=only_join)
        assert code == 2 and "the operator token is needed: set CLEAVE_OPERATOR_TOKEN or pass --token-file" in out
        assert double.heard.empty()  # nothing was sent
    code, out = _cli("status", "--token", op, "--token-file", str(tmp_path / "op"))
    assert code == 2 and "pass --token or --token-file, not both" in out


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs /proc")
def test_a_real_status_process_sends_the_token_of_its_environment_and_no_argv_shows_it() -> None:
    """Started afresh (not forked from the tests' zygote, whose command line it would show): what
    another user reads in /proc/PID/cmdline while it talks to the coordinator."""
    op = "operator-s3cret-in-env"
    with _double(op) as double:
        proc = subprocess.Popen(
            cleave_cmd("status", "--url", double.url, "--json"),
            env={**env(), "CLEAVE_OPERATOR_TOKEN": op},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        double.pids.append(proc.pid)
        try:
            out, _ = proc.communicate(timeout=TIMEOUT)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        msg, (cmdline,) = double.heard.get(timeout=TIMEOUT)
    assert proc.returncode == 0 and b'"training"' in out, out
    assert isinstance(msg, StatusRequest) and msg.token == op
    assert b"cleave\x00status\x00--url" in cmdline and op.encode() not in cmdline and b"--token" not in cmdline


def test_join_enrols_with_the_token_of_its_environment_or_its_file(tmp_path: Path) -> None:
    """Real `cleave join` processes (forked by the tests' zygote), no token on their command line."""
    with _double() as double:
        by_env = Proc(
            join_cmd(double.url, "by-env", "--quiet", token=None), "by-env", extra_env={"CLEAVE_TOKEN": "env-tok"}
        )
        assert _token_heard(double) == "env-tok"
        path = _file(tmp_path / "join", "file-tok\n")
        by_file = Proc(
            join_cmd(double.url, "by-file", "--quiet", "--token-file", str(path), token=None),
            "by-file",
            extra_env={**NOT_MINE, "CLEAVE_TOKEN": "env-tok"},
        )
        assert _token_heard(double) == "file-tok"
        for proc in (by_env, by_file):
            assert proc.wait() != 0 and "refused the join token" in proc.output, proc.output
            assert "--token" not in proc.proc.args


def test_the_coordinator_takes_its_tokens_and_tier_secret_from_variables_or_files(tmp_path: Path) -> None:
    """``cleave coordinator start`` stores the tokens it was given, and its tier gets the secret:
    rank 5 of 2 is refused only after the secret was found (no rank is ever contacted)."""
    tier = ("--rendezvous", "tcp://127.0.0.1:1", "--world-size", "2", "--rank", "5", "--port", "0", "--linger", "0")
    files = {
        "--token-file": _file(tmp_path / "join", "join-from-file\n"),
        "--operator-token-file": _file(tmp_path / "op", "op-from-file\n"),
        "--tier-secret-file": _file(tmp_path / "tier", "tier-from-file\n"),
    }
    by_file = [arg for flag, path in files.items() for arg in (flag, str(path))]
    variables = {"CLEAVE_TOKEN": "join-from-env", "CLEAVE_OPERATOR_TOKEN": "op-from-env", "CLEAVE_TIER_SECRET": "t"}
    for name, args, environ, join, op in (
        ("files", by_file, {}, "join-from-file", "op-from-file"),
        ("env", [], variables, "join-from-env", "op-from-env"),
    ):
        db = tmp_path / f"{name}.db"
        code, out = _cli("coordinator", "start", "--db", str(db), *tier, *args, environ=environ)
        assert code == 2 and "--rank must be between 0 and 1, got 5" in out, out
        store = SQLiteStore(db)
        try:
            assert store.setting(JOIN_TOKEN) == token_hash(join).hex()
            assert store.setting(OPERATOR_TOKEN) == token_hash(op).hex()
        finally:
            store.close()
    code, out = _cli(
        "coordinator", "start", "--tier-secret", "x", "--tier-secret-file", str(files["--tier-secret-file"])
    )
    assert code == 2 and "pass --tier-secret or --tier-secret-file, not both" in out


def test_token_rotate_reads_a_file_but_never_the_variable_that_holds_the_old_token(tmp_path: Path) -> None:
    db = tmp_path / "cleave.db"
    SQLiteStore(db).close()
    code, out = _cli(
        "coordinator",
        "token",
        "rotate",
        "--db",
        str(db),
        "--token-file",
        str(_file(tmp_path / "new", "n3w-join-token-of-22ch\n")),
    )
    assert code == 0 and "new join token: n3w-join-token-of-22ch" in out, out
    code, out = _cli("coordinator", "token", "rotate", "--db", str(db), "--operator", environ=NOT_MINE)
    new = out.rsplit("new operator token: ", 1)[-1].strip()
    assert code == 0 and new not in NOT_MINE.values() and len(new) == 22, out  # generated, not the old one
    store = SQLiteStore(db)
    try:
        assert store.setting(JOIN_TOKEN) == token_hash("n3w-join-token-of-22ch").hex()
        assert store.setting(OPERATOR_TOKEN) == token_hash(new).hex()
    finally:
        store.close()


def test_emulate_relay_and_benchmark_read_the_token_from_their_variable_or_file(tmp_path: Path) -> None:
    path = str(_file(tmp_path / "t", "tok\n"))
    # emulate: without a token it stops at once; with one from CLEAVE_TOKEN it goes on to check --devices.
    code, out = _cli("emulate", "ws://127.0.0.1:1", "--devices", "0", "--fleet", "laptops")
    assert code == 2 and "enrols with the join token: set CLEAVE_TOKEN or pass --token-file" in out, out
    for args, environ in (((), {"CLEAVE_TOKEN": "tok"}), (("--token-file", path), {})):
        code, out = _cli("emulate", "ws://127.0.0.1:1", "--devices", "0", "--fleet", "laptops", *args, environ=environ)
        assert code == 2 and "--devices must be between" in out, out
    code, out = _cli("relay", "ws://127.0.0.1:1", "--token", "x", "--token-file", path)
    assert code == 2 and "pass --token or --token-file, not both" in out, out
    code, out = _cli("benchmark", "--url", "ws://127.0.0.1:1", environ={"CLEAVE_TOKEN": "a join token"})
    assert code == 2 and "--url needs the operator token (CLEAVE_OPERATOR_TOKEN, --token-file or --token)" in out


def test_relay_enrols_with_the_token_of_its_environment(tmp_path: Path) -> None:
    """``cleave relay`` in this process, against the double: the hello carries CLEAVE_TOKEN's token."""
    with _double() as double:
        code, out = _cli(
            "relay",
            double.url,
            *("--listen", "127.0.0.1:0", "--credentials", str(tmp_path / "credentials.json")),
            environ={**NOT_MINE, "CLEAVE_TOKEN": "relay-env-tok"},
        )
        assert _token_heard(double) == "relay-env-tok"
    assert (code, out) == (2, "error: the coordinator refused this relay: refused by the double"), out
