"""The coordinator on a GPU (``--device cuda``) and volunteers on GPUs (``join --device cuda``),
against the CPU reference. These need a CUDA device: elsewhere each skips and says why."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
from procs import TOKEN, Coordinator, Proc, cleave_cmd, join

from cleave.coordinator.training.loop import TrainConfig, Trainer

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here (torch.cuda.is_available() is False)"
)

STEPS = 12
# The same float32 step on a GPU sums in another order (cuBLAS's blocking, its reductions), so
# the losses agree to float32 rounding carried over the steps, not bit for bit: 1e-5 relative
# was the most seen over 12 steps of the tiny model on an H100 (the CPU reference, too, agrees
# with itself run in parts to 2e-7).
CUDA_REL = 1e-4


def _same(got: list[float], want: list[float], rel: float = CUDA_REL) -> None:
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want, strict=True), start=1):
        assert abs(g - w) <= rel * abs(w), f"step {step}: {g} vs {w} ({abs(g - w) / abs(w):.2e} relative)"


@pytest.fixture(scope="module")
def cpu_losses() -> list[float]:
    return [r.loss for r in Trainer(TrainConfig(steps=STEPS), device=torch.device("cpu")).run()]


@pytest.fixture(scope="module")
def cuda_losses() -> list[float]:
    return [r.loss for r in Trainer(TrainConfig(steps=STEPS), device=torch.device("cuda")).run()]


def test_local_training_on_cuda_equals_the_cpu_reference(cpu_losses: list[float], cuda_losses: list[float]) -> None:
    _same(cuda_losses, cpu_losses)
    assert cuda_losses[-1] < cuda_losses[0] - 0.5  # it learns


@pytest.mark.parametrize("micro_batches", ["1", "2"])
def test_a_cuda_coordinator_trains_through_cpu_clients_exactly(
    tmp_path: Path, micro_batches: str, cpu_losses: list[float], cuda_losses: list[float]
) -> None:
    coord = Coordinator(
        tmp_path, "--device", "cuda", "--min-devices", "2", "--micro-batches", micro_batches, steps=STEPS
    )
    clients = [join(coord.url, f"laptop-{i}") for i in range(2)]
    assert coord.wait() == 0, coord.output
    assert [c.wait() for c in clients] == [0, 0], [c.output for c in clients]
    assert "coordinator device: cuda" in coord.output
    _same(coord.losses(), cuda_losses)
    _same(coord.losses(), cpu_losses)
    # Tiles reached both clients and every one was verified.
    done = dict(coord.query("SELECT name, tiles_done FROM devices"))
    assert set(done) == {"laptop-0", "laptop-1"} and all(n > 0 for n in done.values()), done
    assert coord.query("SELECT COUNT(*) FROM tiles WHERE state != 'verified'") == [(0,)]


def _cuda_client(url: str, name: str) -> Proc:
    return Proc(
        cleave_cmd("join", url, "--token", TOKEN, "--once", "--name", name, "--device", "cuda", "--always", "--quiet"),
        name,
    )


@pytest.mark.parametrize("wire", ["fp32", "bf16", "fp16"])
def test_cuda_clients_tiles_verify_without_false_rejections(tmp_path: Path, wire: str) -> None:
    """GPU rounding (cuBLAS, half-precision products summed in float32) against the
    coordinator's check: not one honest tile rejected."""
    coord = Coordinator(tmp_path, "--device", "cpu", "--min-devices", "2", "--wire-dtype", wire, steps=STEPS)
    clients = [_cuda_client(coord.url, f"gpu-{i}") for i in range(2)]
    assert coord.wait() == 0, coord.output
    assert [c.wait() for c in clients] == [0, 0], [c.output for c in clients]
    outcomes = dict(coord.query("SELECT outcome, COUNT(*) FROM leases GROUP BY outcome"))
    assert outcomes.get("verified", 0) > 100, outcomes
    assert outcomes.get("rejected", 0) == 0, outcomes
    done = dict(coord.query("SELECT name, tiles_done FROM devices"))
    assert all(n > 0 for n in done.values()) and len(done) == 2, done


def test_a_gpu_jobs_checkpoint_resumes_on_the_cpu(tmp_path: Path, cpu_losses: list[float]) -> None:
    """``--device`` is not part of the job: a checkpoint written on a GPU resumes on the CPU."""
    args = ("--checkpoint-every", "4", "--min-devices", "1")
    first = Coordinator(tmp_path, "--device", "cuda", *args, steps=STEPS)
    client = join(first.url, "laptop")
    first.wait_for_step(6)
    first.proc.send_signal(signal.SIGKILL)
    first.wait()
    client.kill()
    again = Coordinator(tmp_path, "--device", "cpu", *args, steps=STEPS)
    client = join(again.url, "laptop")
    assert again.wait() == 0, again.output
    client.wait()
    assert "resuming job 1" in again.output
    losses = [row[0] for row in again.query("SELECT loss FROM steps WHERE job_id = 1 ORDER BY step")]
    _same(losses, cpu_losses)


def test_a_tier_of_two_gpu_ranks_trains_exactly(tmp_path: Path) -> None:
    """Two coordinator ranks on the one GPU (buckets staged through host memory, gloo), a CPU
    client each: every rank logs the same global loss, bit for bit, and it is one CUDA
    coordinator's on the whole batch (and the CPU reference) within CUDA's tolerance."""
    from tests.coordinator.tier.test_tier import _port, _ranks  # the tier's own helpers: real ranks on loopback

    steps, batch = 6, 4
    ranks = _ranks(
        tmp_path, 2, _port(), "--device", "cuda", "--min-devices", "1", "--no-redirect", steps=steps, batch=batch
    )
    clients = [join(coord.url, f"r{r}") for r, coord in enumerate(ranks)]
    assert [c.wait() for c in ranks] == [0, 0], [c.output[-2000:] for c in ranks]
    for c in clients:
        c.wait()
    assert all("coordinator device: cuda" in c.output for c in ranks)
    logged = [[row[0] for row in c.query("SELECT loss FROM steps ORDER BY step")] for c in ranks]
    assert logged[0] == logged[1] and len(logged[0]) == steps
    cfg = TrainConfig(steps=steps, batch_size=batch)
    _same(logged[0], [r.loss for r in Trainer(cfg, device=torch.device("cuda")).run()])
    _same(logged[0], [r.loss for r in Trainer(cfg, device=torch.device("cpu")).run()])
    for coord in ranks:  # tiles reached each rank's client
        done = dict(coord.query("SELECT name, tiles_done FROM devices"))
        assert len(done) == 1 and all(n > 0 for n in done.values()), done
