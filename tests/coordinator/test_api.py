"""The Python API of docs/api.md: a model of one's own, trained through real local clients, with
the losses of plain torch. The example is read from the doc and run as written."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from conftest import ROOT
from torch import nn

from cleave.coordinator.training.loop import TrainConfig, Trainer
from cleave.wire.errors import ConfigError


def _example() -> str:
    doc = (ROOT / "docs" / "api.md").read_text()
    (code,) = re.findall(r"## Example.*?```python\n(.*?)```", doc, re.S)
    return code


@pytest.mark.drill
def test_the_documented_example_trains_through_clients_like_plain_torch(capsys: pytest.CaptureFixture[str]) -> None:
    scope: dict = {"__name__": "example"}
    exec(compile(_example(), "docs/api.md", "exec"), scope)  # noqa: S102 -- our own doc's code
    outcome, local = scope["outcome"], scope["local"]
    got, want = [r.loss for r in outcome.results], [r.loss for r in local]
    assert len(got) == len(want) == 20
    assert got == pytest.approx(want, rel=1e-4)
    assert want[-1] < want[0] - 0.5  # it learns
    assert outcome.status["job"]["gemm_share"]["share"] == pytest.approx(1.0)  # no attention: every GEMM
    assert sum(d["tiles_done"] for d in outcome.status["devices"]) > 0


def test_a_custom_model_needs_its_factory() -> None:
    cfg = TrainConfig(model="custom:mine", steps=1, seq_len=4096)  # the model checks lengths itself
    with pytest.raises(ConfigError, match="model_factory"):
        Trainer(cfg)
    with pytest.raises(ConfigError, match="custom:LABEL"):
        Trainer(TrainConfig(model="tiny", steps=1), model_factory=lambda: nn.Linear(2, 2))


def test_the_factory_is_called_after_seeding() -> None:
    cfg = TrainConfig(model="custom:mine", steps=1)
    weights = [Trainer(cfg, model_factory=lambda: nn.Linear(4, 4)).model.weight.detach().clone() for _ in range(2)]
    assert torch.equal(*weights)


def test_an_unfinished_job_of_another_model_is_never_resumed_with_this_factory(tmp_path) -> None:  # noqa: ANN001
    from cleave.coordinator.config import CoordinatorConfig
    from cleave.coordinator.job import _plan
    from cleave.db.sqlite import SQLiteStore

    store = SQLiteStore(tmp_path / "j.db")
    store.create_job("a", TrainConfig(model="custom:A", steps=5).to_dict(), 5, 0.0)  # left unfinished
    other = CoordinatorConfig(
        train=TrainConfig(model="custom:B", steps=5), model_factory=lambda: nn.Linear(2, 2), db=str(tmp_path / "j.db")
    )

    class Quiet:
        def note(self, text: str) -> None: ...

    with pytest.raises(ConfigError, match="trains 'custom:A', not 'custom:B'.*--new-job"):
        _plan(other, store, Quiet(), 1.0)  # type: ignore[arg-type]
    store.close()


def test_derived_defaults_are_the_api_s_too() -> None:
    """The heartbeat follows the timeout, and the caps on kinds of connection the cap on all of
    them, wherever the configuration is built (not only by ``cleave coordinator start``)."""
    from cleave.coordinator.config import CoordinatorConfig
    from cleave.coordinator.engine.limits import Limits
    from cleave.coordinator.engine.scheduler import FaultPolicy

    assert CoordinatorConfig().faults.beat == 2.0  # a fifth of 30 s, at most 2 s
    assert FaultPolicy(heartbeat_timeout=5.0).beat == 1.0
    assert FaultPolicy(heartbeat=0.5, heartbeat_timeout=5.0).beat == 0.5  # given: kept
    # Derived, not stored: a copy with another timeout beats at its own pace (and is valid).
    assert dataclasses.replace(FaultPolicy(), heartbeat_timeout=1.0).beat == 0.2
    with pytest.raises(ConfigError, match=r"^FaultPolicy\.heartbeat must be above 0 and below heartbeat_timeout"):
        FaultPolicy(heartbeat=5.0, heartbeat_timeout=5.0)
    with pytest.raises(ConfigError, match=r"^FaultPolicy\.heartbeat_timeout must be a number of seconds above 0"):
        FaultPolicy(heartbeat_timeout=float("nan"))
    small = Limits(max_connections=4)
    assert (small.unauthenticated, small.observers) == (4, 4)
    assert (Limits().unauthenticated, Limits().observers) == (256, 8)
    assert dataclasses.replace(small, max_connections=5000).unauthenticated == 256  # the given cap again
