"""docs/simulation.md's generated tables against the code: the ``ci`` table is rerun through
``cleave simulate`` and must be the page's text, the baselines' table at batch 8 recomputed, and every block
of the page belongs to a table of bench/sim_tables.py. A change that moves a figure fails here
until the page is regenerated with the command in the message."""

from __future__ import annotations

import pytest

from bench import sim_tables

FIX = f"regenerate the docs' tables: {sim_tables.COMMAND} (--light for the quick ones, --only NAME for one)"


@pytest.fixture(scope="module")
def ci_report() -> dict:
    """``cleave simulate --json`` of the ``ci`` table's one configuration (about a second)."""
    (args,) = sim_tables.BY_NAME["ci"].commands()
    return sim_tables.simulate(args)


def test_the_ci_configuration_on_the_page_is_what_cleave_simulate_reports_today(ci_report: dict) -> None:
    fresh = sim_tables.generate("ci", lambda args: ci_report)
    assert fresh == sim_tables.current("ci"), f"docs/simulation.md's `ci` table is stale: {FIX}"


def test_the_baselines_table_on_the_page_is_what_the_baselines_compute() -> None:
    # The batch of 8 only: the 1,024 table takes 2.4 s of CPU here, and the same code makes both.
    fresh = sim_tables.generate("dtfm-8x256")
    assert fresh == sim_tables.current("dtfm-8x256"), f"docs/simulation.md's `dtfm-8x256` table is stale: {FIX}"


def test_every_table_has_one_block_and_every_block_a_table() -> None:
    sim_tables.check_markers()
    text = "intro\n<!-- generated: sim_tables.py ci -->\nold\n<!-- end generated -->\noutro\n"
    once = sim_tables.splice(text, "ci", "new\n")
    assert once == "intro\n<!-- generated: sim_tables.py ci -->\nnew\n<!-- end generated -->\noutro\n"
    assert sim_tables.splice(once, "ci", "new\n") == once  # idempotent: only the block's text changes
    with pytest.raises(sim_tables.TableError, match="two blocks"):
        sim_tables.blocks(text + text)
    with pytest.raises(sim_tables.TableError, match="no block"):
        sim_tables.splice(text, "headline", "x\n")


def test_every_tables_commands_parse_and_render_before_anyone_waits_for_them(ci_report: dict) -> None:
    """The heavy tables take minutes a configuration: a typo in one must not wait for that run."""
    import shlex

    import typer

    from cleave.cli.app import build

    group = typer.main.get_command(build(["simulate"]))
    command = group.get_command(group.make_context("cleave", ["simulate"]), "simulate")
    for t in sim_tables.TABLES:
        for args in t.commands():
            command.make_context("simulate", [*shlex.split(args), "--json"])  # the CLI's own parsing
        if isinstance(t, sim_tables.SimTable):
            text = t.render(lambda args: ci_report)
            assert text.startswith("`cleave simulate --") and "\n\n| " in text, t.name
            rows = [line for line in text.splitlines() if line.startswith("| ")]
            assert len({line.count(" | ") for line in rows}) == 1, f"{t.name}: ragged rows"
