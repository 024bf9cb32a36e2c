"""The command line: every command and option has help text and an entry in docs/cli.md."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import typer.main
from conftest import ROOT

from cleave.cli.app import app
from cleave.cli.options import micro_batches_of
from cleave.wire.errors import ConfigError


def _commands() -> dict[str, Any]:
    root = typer.main.get_command(app)  # typer's own (vendored) click command objects
    out: dict[str, Any] = {}

    def walk(cmd: Any, path: str) -> None:
        if hasattr(cmd, "commands"):
            for name, sub in cmd.commands.items():
                walk(sub, f"{path} {name}")
        else:
            out[path] = cmd

    walk(root, "cleave")
    return out


def test_every_command_has_help_and_a_docs_section() -> None:
    docs = (ROOT / "docs" / "cli.md").read_text()
    sections = dict(re.findall(r"^## (cleave [^\n]+)\n(.*?)(?=^## |\Z)", docs, flags=re.M | re.S))
    commands = _commands()
    assert set(commands) == {
        "cleave coordinator start",
        "cleave join",
        "cleave status",
        "cleave train",
        "cleave demo",
        "cleave benchmark",
        "cleave plan",
        "cleave simulate",
        "cleave emulate",
        "cleave relay",
        "cleave data prepare",
        "cleave export",
        "cleave sample",
        "cleave coordinator devices list",
        "cleave coordinator devices revoke",
        "cleave coordinator devices unban",
        "cleave coordinator token rotate",
    }
    for path, cmd in commands.items():
        assert cmd.help and cmd.help.strip(), f"{path} has no help"
        assert path in sections, f"docs/cli.md lacks a '## {path}' section"
        for param in cmd.params:
            if param.param_type_name == "option" and not param.hidden:  # hidden: test-only hooks
                assert param.help, f"{path} {param.opts[0]} has no help"
                for opt in param.opts:
                    assert f"`{opt}" in sections[path], f"docs/cli.md: {path} does not document {opt}"


def test_readme_quick_start_names_real_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/setup.sh && .venv/bin/cleave demo" in readme
    assert "bash scripts/setup.sh && .venv/bin/python -m pytest -q" in readme
    assert "cleave demo" in _commands_text()


def _commands_text() -> str:
    return " ".join(_commands())


def test_help_shows_brackets_as_written() -> None:
    """Help goes through rich markup: ``[hf]`` in ``pip install 'cleave[hf]'`` must be escaped or it
    vanishes (a newcomer met ``pip install 'cleave'``)."""
    from typer.testing import CliRunner

    runner = CliRunner()
    checked = 0
    for path, cmd in _commands().items():
        wanted = [
            re.sub(r"\\\[", "[", text)
            for param in cmd.params
            for text in re.findall(r"\S*\\?\[[a-z]+\]\S*", param.help or "")
        ]
        if not wanted:
            continue
        result = runner.invoke(app, [*path.split()[1:], "--help"], env={"COLUMNS": "400", "NO_COLOR": "1"})
        assert result.exit_code == 0, result.output
        flat = " ".join(result.output.split())
        for text in wanted:
            assert text.strip("'\").,") in flat, f"{path} --help lost {text!r}"
            checked += 1
    assert checked >= 3  # coordinator start, train and demo name the hf extra


def test_each_command_alone_parses_as_in_the_whole_app() -> None:
    """``cleave X ...`` builds an app holding only X (app.py): the command keeps its name, its
    arguments and its options, and the narrowed app holds exactly the command asked for."""
    from typer.testing import CliRunner

    from cleave.cli.app import build

    runner = CliRunner()
    whole = _commands()
    for path, command in whole.items():
        argv = path.split()[1:]
        narrowed = typer.main.get_command(build(argv))
        node: Any = narrowed
        for name in argv:
            assert hasattr(node, "commands") and name in node.commands, f"{path}: not a group holding {name}"
            node = node.commands[name]
        assert [p.name for p in node.params] == [p.name for p in command.params], path
    shown = runner.invoke(build(["join"]), ["join", "--show-config"], env={"NO_COLOR": "1"})
    assert shown.exit_code == 0 and "[policy]" in shown.output, shown.output
    alone = typer.main.get_command(build(["coordinator", "devices", "list"]))
    assert set(alone.commands) == {"coordinator"}
    assert set(alone.commands["coordinator"].commands) == {"devices", "token"}  # no start: no torch


def test_micro_batches_take_a_number_or_auto() -> None:

    assert [micro_batches_of(v) for v in ("auto", " Auto ", "1", "8")] == [0, 0, 1, 8]
    for bad, why in (("0", "at least 1"), ("-2", "at least 1"), ("many", "whole number or auto"), ("2.5", "whole")):
        with pytest.raises(ConfigError, match=why):
            micro_batches_of(bad)


def test_the_optimizer_flags_reach_the_schedule_and_bad_ones_are_one_line_errors(tmp_path: Path) -> None:
    """--warmup, --min-lr, --weight-decay and --grad-clip: `cleave train --local` steps with the
    schedule they set (the metrics' lr column), and both training commands refuse a bad value in
    one line, exit 2, before anything starts."""
    from typer.testing import CliRunner

    corpus, out = tmp_path / "corpus.txt", tmp_path / "m.jsonl"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 100)
    runner = CliRunner()
    flags = ["--warmup", "1", "--min-lr", "0.0001", "--weight-decay", "0.05", "--grad-clip", "0.5"]
    small = ["--steps", "3", "--batch-size", "2", "--seq-len", "16", "--data", str(corpus)]
    done = runner.invoke(app, ["train", "--local", *small, *flags, "--metrics", str(out), "--quiet"])
    assert done.exit_code == 0, done.output
    lrs = [json.loads(line)["lr"] for line in out.read_text().splitlines()]
    assert lrs == pytest.approx([0.003, 0.0001 + (0.003 - 0.0001) * 0.5, 0.0001], rel=1e-12)  # warm-up, cosine, floor
    for bad, why in (
        (["--warmup", "-1"], "--warmup must be between 0 and 10,000,000 steps, got -1"),
        (["--min-lr", "0.5"], "--min-lr must be between 0 and the peak learning rate (0.003), got 0.5"),
        (["--weight-decay", "nan"], "--weight-decay must be between 0 and 1, got nan"),
        (["--grad-clip", "-2"], "--grad-clip must be a finite number >= 0 (0: no clipping), got -2.0"),
    ):
        for command in (["train", "--local"], ["coordinator", "start", "--db", str(tmp_path / "x.db")]):
            result = runner.invoke(app, [*command, *small, *bad])
            assert result.exit_code == 2, result.output
            assert result.output.strip() == f"error: {why}", result.output
    assert not (tmp_path / "x.db").exists()  # refused before the coordinator opened its database


def test_a_bad_value_names_its_field_in_the_api_and_its_flag_on_the_command_line(tmp_path: Path) -> None:
    """The configuration objects check each value once and name the field as the Python API
    spells it; ``cleave coordinator start`` names the flag that set it, exit 2, before the
    coordinator opens its database."""
    from typer.testing import CliRunner

    from cleave.coordinator.config import CoordinatorConfig
    from cleave.coordinator.engine.standby import StandbyPolicy

    with pytest.raises(ConfigError, match=r"^port must be between 0 and 65535, got 70000$") as refused:
        CoordinatorConfig(port=70000)
    assert refused.value.field == "port"
    with pytest.raises(ConfigError, match=r"^StandbyPolicy\.after must be between 0 \(never\) and 86400 s, got -1\.0$"):
        StandbyPolicy(after=-1.0)
    runner = CliRunner()
    db = tmp_path / "x.db"
    for flags, why in (
        (["--port", "70000"], "--port must be between 0 and 65535, got 70000"),
        (["--standby-after", "-1"], "--standby-after must be between 0 (never) and 86400 s, got -1.0"),
        (["--max-connections", "0"], "--max-connections must be between 1 and 1,000,000, got 0"),
        (["--certfile", "c.pem"], "--keyfile is needed too: a certificate chain and its private key go together"),
        (["--steps", "0"], "--steps must be between 1 and 10,000,000, got 0"),
    ):
        result = runner.invoke(app, ["coordinator", "start", "--db", str(db), *flags])
        assert result.exit_code == 2, result.output
        assert result.output.strip() == f"error: {why}", result.output
    assert not db.exists()


def test_each_field_the_flags_table_names_exists_and_its_flag_is_an_option() -> None:
    """options.FLAGS: a renamed field or flag would leave an error naming neither."""
    import dataclasses

    from cleave.cli.options import FLAGS, TRAIN_OPTIONS
    from cleave.coordinator.config import CoordinatorConfig, TierOptions
    from cleave.coordinator.engine.limits import Limits
    from cleave.coordinator.engine.scheduler import FaultPolicy
    from cleave.coordinator.engine.standby import StandbyPolicy
    from cleave.coordinator.planning.tiles import TilingPolicy
    from cleave.coordinator.training.loop import TrainConfig

    def fields(cls: type) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    policies = (TilingPolicy, FaultPolicy, StandbyPolicy, Limits, TierOptions)
    known = fields(CoordinatorConfig) | fields(TrainConfig) | {f"{c.__name__}.{n}" for c in policies for n in fields(c)}
    assert set(FLAGS) <= known, set(FLAGS) - known
    assert set(TRAIN_OPTIONS) <= fields(TrainConfig)
    commands = _commands()
    start = {o for p in commands["cleave coordinator start"].params for o in p.opts}
    assert set(FLAGS.values()) <= start, set(FLAGS.values()) - start
    train = {o for p in commands["cleave train"].params for o in p.opts}
    assert {FLAGS[name] for name in TRAIN_OPTIONS} <= train & start  # declared once, taken by both
