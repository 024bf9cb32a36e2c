"""The model, the Linear seam and the training loop, against plain torch."""

from __future__ import annotations

import dataclasses
import math
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from torch import nn

from cleave.coordinator.planning.costmodel import PARTS_IN_FLIGHT
from cleave.coordinator.planning.tiles import TilingPolicy, plan_gemm, tiled_matmul
from cleave.coordinator.training.data import ByteBatches, load_corpus
from cleave.coordinator.training.hardware import coordinator_device, to_host
from cleave.coordinator.training.linear import GemmRequest, LocalEngine, TiledLinear, offload_linears
from cleave.coordinator.training.loop import TrainConfig, Trainer, draws_randomness
from cleave.coordinator.training.model import PRESETS, Transformer
from cleave.coordinator.training.tokens import DataError
from cleave.wire.errors import ConfigError


class TiledLocalEngine:
    """Every GEMM cut into tiles exactly as the coordinator would, computed in-process."""

    def __init__(self, devices: int = 3) -> None:
        self.devices = devices
        self.kinds: list[str] = []
        self.policy = TilingPolicy(max_edge=48, min_edge=16, min_k=32, min_tile_flops=1)

    def run(self, requests: Sequence[GemmRequest]) -> list[torch.Tensor]:
        out = []
        for r in requests:
            self.kinds.append(r.kind.value)
            plan = plan_gemm(r.a.shape[0], r.b.shape[1], r.a.shape[1], r.kind, self.devices, self.policy)
            out.append(tiled_matmul(r.a, r.b, plan.tiles, plan))
        return out


class DeferringLocalEngine(TiledLocalEngine):
    """Weight gradients taken in the background, as the coordinator's RemoteEngine takes them:
    computed only at ``finish_backward``, after backward has gone all the way down."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: list[tuple[torch.Tensor, GemmRequest]] = []
        self.order: list[str] = []

    def run(self, requests: Sequence[GemmRequest]) -> list[torch.Tensor]:
        self.order.extend(r.kind.value for r in requests)
        return super().run(requests)

    def defer(self, request: GemmRequest, param: torch.Tensor) -> None:
        self.order.append("dw (deferred)")
        self.pending.append((param, request))

    def finish_backward(self) -> None:
        pending, self.pending = self.pending, []
        for param, request in pending:
            (grad,) = super().run([request])
            param.grad = grad if param.grad is None else param.grad + grad


def test_deferred_weight_gradients_equal_autograds_with_shared_and_tied_weights() -> None:
    torch.manual_seed(3)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(11, 16)
            self.mid = nn.Linear(16, 16)
            self.head = nn.Linear(16, 11, bias=False)
            self.head.weight = self.emb.weight  # tied: autograd's grad and a deferred dW add up

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.emb(ids)
            h = self.mid(torch.tanh(self.mid(h)))  # one Linear used twice: two deferred dWs
            return self.head(h)

    ref, net = Net(), Net()
    net.load_state_dict(ref.state_dict())
    engine = DeferringLocalEngine()
    assert offload_linears(net, engine) == 2
    ids = torch.randint(0, 11, (4, 7))
    ref(ids).square().mean().backward()
    net(ids).square().mean().backward()
    assert net.mid.weight.grad is None and len(engine.pending) == 3  # nothing until backward is over
    assert "dw" not in engine.order and engine.order.count("dw (deferred)") == 3
    engine.finish_backward()
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_training_with_deferred_weight_gradients_equals_plain_training() -> None:
    cfg = TrainConfig(steps=3, seq_len=32, batch_size=4)
    plain = [r.loss for r in Trainer(cfg).run()]
    engine = DeferringLocalEngine()
    assert [r.loss for r in Trainer(cfg, engine).run()] == pytest.approx(plain, rel=1e-5)
    assert engine.order.count("dw (deferred)") > 0 and "dw" not in engine.order


def test_offloaded_linear_matches_nn_linear_forward_and_backward() -> None:
    torch.manual_seed(0)
    ref = nn.Linear(37, 53, bias=True)
    tiled = TiledLinear(nn.Linear(37, 53), TiledLocalEngine())
    tiled.load_state_dict(ref.state_dict())
    x1 = torch.randn(3, 5, 37, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    ref(x1).square().sum().backward()
    tiled(x2).square().sum().backward()
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tiled.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tiled.bias.grad, ref.bias.grad, rtol=1e-5, atol=1e-5)


def test_offload_works_on_any_model_and_routes_all_three_gemms() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Sequential(nn.Linear(16, 4)))
    ref = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Sequential(nn.Linear(16, 4)))
    ref.load_state_dict(model.state_dict())
    engine = TiledLocalEngine()
    assert offload_linears(model, engine) == 2
    assert not any(type(m) is nn.Linear for m in model.modules())
    x = torch.randn(10, 8)
    model(x).sum().backward()
    ref(x).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)
    assert set(engine.kinds) == {"fwd", "dx", "dw"}


def test_transformer_step_with_tiled_engine_equals_plain_step() -> None:
    cfg = TrainConfig(steps=3, seq_len=32, batch_size=4)
    plain = [r.loss for r in Trainer(cfg).run()]
    tiled = [r.loss for r in Trainer(cfg, TiledLocalEngine()).run()]
    local = [r.loss for r in Trainer(cfg, LocalEngine()).run()]
    assert local == pytest.approx(plain, rel=1e-6)
    assert tiled == pytest.approx(plain, rel=1e-5)


@pytest.mark.parametrize("micro_batches", [2, 4])
def test_micro_batches_take_the_whole_batchs_step(micro_batches: int) -> None:
    """Parts of the batch one after another, each loss weighted by its tokens: the same losses
    and the same weights as the whole batch at once, to float error (against plain torch), with
    the weight gradients deferred as the coordinator defers them too."""
    cfg = TrainConfig(steps=4, seq_len=32, batch_size=8)
    whole = Trainer(cfg)
    want = [r.loss for r in whole.run()]
    parts = Trainer(TrainConfig(steps=4, seq_len=32, batch_size=8, micro_batches=micro_batches), DeferringLocalEngine())
    got = [r.loss for r in parts.run()]
    assert got == pytest.approx(want, rel=1e-5)
    for (name, p), q in zip(whole.model.named_parameters(), parts.model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)
    assert parts.tokens_seen == whole.tokens_seen == 4 * 8 * 32


class PartsAtOnceEngine(TiledLocalEngine):
    """Takes GEMMs from several trainer threads at once, as the coordinator's RemoteEngine does:
    each thread's deferred dWs are its own, and each GEMM lingers a little so that parts overlap.
    Records the most threads inside ``run`` at once."""

    takes_parts_at_once = True

    def __init__(self, fail_on: int | None = None) -> None:
        super().__init__()
        self._mine = threading.local()
        self._lock = threading.Lock()
        self.inside = self.most_inside = 0
        self.threads: set[str] = set()
        self.fail_on = fail_on  # raise in the GEMM with this many tokens (one part's size)

    def run(self, requests: Sequence[GemmRequest]) -> list[torch.Tensor]:
        with self._lock:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
            self.threads.add(threading.current_thread().name)
        try:
            if self.fail_on is not None and threading.current_thread().name.endswith("_1"):
                raise FloatingPointError("a part's GEMM failed")
            time.sleep(0.002)
            with self._lock:  # the tiling bookkeeping (kinds) is shared
                return super().run(requests)
        finally:
            with self._lock:
                self.inside -= 1

    def defer(self, request: GemmRequest, param: torch.Tensor) -> None:
        if not hasattr(self._mine, "pending"):
            self._mine.pending = []
        self._mine.pending.append((param, request))

    def take_deferred(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        pending, self._mine.pending = getattr(self._mine, "pending", []), []
        return [(param, self.run([request])[0]) for param, request in pending]

    def finish_backward(self) -> None:
        for param, grad in self.take_deferred():
            param.grad = grad if param.grad is None else param.grad + grad


@pytest.mark.parametrize("micro_batches", [2, 4])
def test_micro_batches_at_once_take_the_whole_batchs_step(micro_batches: int) -> None:
    """Parts through forward and backward at the same time, on threads, each with its deferred
    dWs: the same losses and weights as plain torch's whole batch (1e-5 relative), and the same
    bits run after run (gradients are summed in part order, whichever part ends first)."""
    cfg = TrainConfig(steps=4, seq_len=32, batch_size=8, eval_every=0)  # (an evaluation runs on this thread)
    whole = Trainer(cfg)
    want = [r.loss for r in whole.run()]
    parts_cfg = dataclasses.replace(cfg, micro_batches=micro_batches)
    runs = []
    for _ in range(2):
        engine = PartsAtOnceEngine()
        trainer = Trainer(parts_cfg, engine)
        assert trainer.parts_at_once == micro_batches
        runs.append(([r.loss for r in trainer.run()], trainer, engine))
        trainer.close()
    (got, parts, engine), (again, _, _) = runs
    assert got == pytest.approx(want, rel=1e-5)
    assert got == again  # bit for bit
    for (name, p), q in zip(whole.model.named_parameters(), parts.model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)
    assert parts.tokens_seen == whole.tokens_seen == 4 * 8 * 32
    assert engine.most_inside >= 2 and len(engine.threads) == micro_batches  # they did overlap


def test_parts_at_once_hold_at_most_a_window_of_parts_however_many_there_are() -> None:
    """--micro-batches 16 runs 8 parts at a time: part i + 8 starts once part i is summed, so
    while the first part lingers no more than 8 parts' activations or gradients are held (the
    bound docs/cli.md states), and the step is still the whole batch's."""
    lock = threading.Lock()
    state = {"started": 0, "freed": 0, "peak": 0}

    class Counting(Trainer):
        def _one_part(self, xs, ys, share, scale):  # noqa: ANN001, ANN202
            with lock:
                state["started"] += 1
                first = state["started"] == 1
                state["peak"] = max(state["peak"], state["started"] - state["freed"])
            if first:
                time.sleep(0.3)  # the others finish meanwhile and must wait their turn to start
            loss, grads = super()._one_part(xs, ys, share, scale)
            held = next(g for g in grads if g is not None)

            def freed() -> None:
                with lock:
                    state["freed"] += 1

            weakref.finalize(held, freed)
            return loss, grads

    cfg = TrainConfig(steps=1, seq_len=8, batch_size=16, micro_batches=16)
    want = [r.loss for r in Trainer(TrainConfig(steps=1, seq_len=8, batch_size=16)).run()]
    trainer = Counting(cfg, PartsAtOnceEngine())
    assert trainer.parts_at_once == PARTS_IN_FLIGHT == 8
    got = [r.loss for r in trainer.run()]
    trainer.close()
    assert got == pytest.approx(want, rel=1e-5)
    assert state["started"] == 16
    # 8 parts in the window, plus the first part's gradients, which are the running sum until the
    # second is added (the sum is held besides the window). Without the window: all 16.
    assert state["peak"] <= PARTS_IN_FLIGHT + 1, state


def test_auto_micro_batches_start_as_one_part_and_take_the_jobs_choice_from_the_next_step() -> None:
    """--micro-batches auto (0): the trainer runs one part until the job hands it the cost
    model's choice; a checkpoint keeps saying auto, so a resumed job chooses again."""
    cfg = TrainConfig(steps=3, seq_len=32, batch_size=8)
    want = [r.loss for r in Trainer(cfg).run()]
    trainer = Trainer(TrainConfig(steps=3, seq_len=32, batch_size=8, micro_batches=0), PartsAtOnceEngine())
    assert (trainer.micro_batches, trainer.parts_at_once) == (1, 1)
    got = [trainer.train_step().loss]
    trainer.use_micro_batches(4)
    assert (trainer.micro_batches, trainer.parts_at_once) == (4, 4)
    got += [trainer.train_step().loss for _ in range(2)]
    trainer.close()
    assert got == pytest.approx(want, rel=1e-5)
    assert trainer.state_dict()["config"]["micro_batches"] == 0
    with pytest.raises(ConfigError, match="must divide"):
        trainer.use_micro_batches(3)
    local = Trainer(TrainConfig(steps=1, seq_len=32, batch_size=8, micro_batches=0))
    local.use_micro_batches(4)
    assert (local.micro_batches, local.parts_at_once) == (4, 1)  # no concurrent engine: one after another


def test_parts_at_once_are_bounded_and_kept_sequential_when_the_model_draws_randomness() -> None:
    cfg = TrainConfig(steps=1, seq_len=8, batch_size=16, micro_batches=16)
    assert Trainer(cfg, PartsAtOnceEngine()).parts_at_once == PARTS_IN_FLIGHT  # memory: at most 8 parts' activations
    assert Trainer(cfg, DeferringLocalEngine()).parts_at_once == 1  # an engine of one thread
    assert Trainer(TrainConfig(steps=1, seq_len=8, batch_size=4), PartsAtOnceEngine()).parts_at_once == 1
    # Dropout draws from torch's one generator: parts at once would draw in a different order.
    assert draws_randomness(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1)))
    assert not draws_randomness(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.0)))

    class Config:
        attention_dropout = 0.1

    class HFLike(nn.Module):
        config = Config()

    assert draws_randomness(HFLike())
    assert not draws_randomness(Transformer(PRESETS["tiny"]))
    custom = TrainConfig(model="custom:mine", steps=1, seq_len=8, batch_size=4, micro_batches=2)
    trainer = Trainer(custom, PartsAtOnceEngine(), model_factory=lambda: Transformer(PRESETS["tiny"]))
    assert trainer.parts_at_once == 1  # its forward is not ours to read


def test_a_failed_part_fails_the_step_after_every_part_has_stopped() -> None:
    engine = PartsAtOnceEngine(fail_on=1)
    trainer = Trainer(TrainConfig(steps=2, seq_len=16, batch_size=4, micro_batches=4), engine)
    with pytest.raises(FloatingPointError, match="a part's GEMM failed"):
        trainer.train_step()
    assert engine.inside == 0  # no part still computing when the step has failed
    trainer.close()


def test_training_is_deterministic_and_the_loss_falls() -> None:
    cfg = TrainConfig(steps=20)
    a = [r.loss for r in Trainer(cfg).run()]
    b = [r.loss for r in Trainer(cfg).run()]
    assert a == b
    assert sum(a[-5:]) / 5 < sum(a[:5]) / 5 - 0.5
    other = [r.loss for r in Trainer(TrainConfig(steps=2, seed=7)).run()]
    assert other != a[:2]


def test_presets_have_the_advertised_sizes() -> None:
    assert Transformer(PRESETS["tiny"]).num_params() < 1_000_000
    assert 10_000_000 <= Transformer(PRESETS["small"]).num_params() <= 20_000_000


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"model": "huge"}, "unknown model preset"),
        ({"steps": 0}, "^steps must"),
        ({"batch_size": 0}, "^batch_size must"),
        ({"seq_len": 1}, "^seq_len must"),
        ({"seq_len": 100_000}, "^seq_len must"),
        ({"lr": float("nan")}, "^lr must"),
        ({"lr": -1.0}, "^lr must"),
        ({"seed": -3}, "^seed must"),
        ({"micro_batches": 3}, "^micro_batches must"),  # does not divide the batch of 8
        ({"micro_batches": -1}, "^micro_batches must"),  # 0 is auto: the cost model chooses
        ({"warmup": -1}, "^warmup must be between 0 and 10,000,000 steps, got -1"),
        ({"warmup": 10_000_001}, "^warmup must"),
        ({"min_lr": 0.01}, r"^min_lr must be between 0 and the peak learning rate \(0.003\), got 0.01"),
        ({"min_lr": -1e-4}, "^min_lr must"),
        ({"min_lr": float("nan")}, "^min_lr must"),
        ({"weight_decay": -0.1}, "^weight_decay must be between 0 and 1, got -0.1"),
        ({"weight_decay": 2.0}, "^weight_decay must"),
        ({"weight_decay": float("inf")}, "^weight_decay must"),
        ({"grad_clip": -1.0}, r"^grad_clip must be a finite number >= 0 \(0: no clipping\), got -1.0"),
        ({"grad_clip": float("nan")}, "^grad_clip must"),
    ],
)
def test_absurd_options_are_refused_with_the_field_name(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**kwargs)


def test_default_corpus_is_the_standard_library() -> None:
    data = load_corpus(max_bytes=200_000)
    assert len(data) == 200_000
    assert b"def " in data and b"import " in data
    assert load_corpus(max_bytes=200_000) == data  # same Python, same bytes


def test_data_option_takes_a_file_or_a_folder(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("hello world " * 50)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("more text " * 50)
    (tmp_path / "blob.bin").write_bytes(b"\xff\xfe\x00" * 10)  # skipped inside a folder
    assert load_corpus(tmp_path / "a.txt").startswith(b"hello world")
    folder = load_corpus(tmp_path)
    assert b"hello world" in folder and b"more text" in folder and b"\xff\xfe" not in folder
    with pytest.raises(DataError, match="no such file"):
        load_corpus(tmp_path / "missing.txt")
    with pytest.raises(DataError, match="UTF-8"):
        load_corpus(tmp_path / "blob.bin")


def test_batches_are_shifted_windows() -> None:
    import numpy as np

    batches = ByteBatches(b"abcdefghijklmnopqrstuvwxyz" * 4, seq_len=8, batch_size=3, rng=np.random.default_rng(0))
    x, y = batches.next()
    assert x.shape == y.shape == (3, 8)
    assert torch.equal(x[:, 1:], y[:, :-1])
    with pytest.raises(DataError, match="shorter"):
        ByteBatches(b"tiny", seq_len=8, batch_size=1, rng=np.random.default_rng(0))


def test_the_coordinator_device_is_cuda_only_where_there_is_one() -> None:
    cuda = torch.cuda.is_available()
    assert coordinator_device("auto").type == ("cuda" if cuda else "cpu")
    assert coordinator_device("CPU") == torch.device("cpu")
    with pytest.raises(ConfigError, match="must be one of auto, cpu, cuda"):
        coordinator_device("mps")
    if not cuda:
        with pytest.raises(ConfigError, match="sees no CUDA device"):
            coordinator_device("cuda")


def test_to_host_gives_a_contiguous_copy_in_the_asked_dtype() -> None:
    t = torch.randn(6, 4).t()  # a transposed view
    host = to_host(t, torch.bfloat16)
    assert host.is_contiguous() and host.dtype == torch.bfloat16 and host.shape == t.shape
    assert torch.equal(host, t.to(torch.bfloat16))
    same = to_host(t)
    assert same.dtype == torch.float32 and torch.equal(same, t) and same.data_ptr() != t.data_ptr()


def test_a_trainer_on_the_cpu_device_is_the_default_trainer() -> None:
    cfg = TrainConfig(steps=3)
    default = [r.loss for r in Trainer(cfg).run()]
    placed = Trainer(cfg, device=torch.device("cpu"))
    assert [r.loss for r in placed.run()] == default
    assert all(p.device.type == "cpu" for p in placed.model.parameters())


class _AnsweringLoop:
    """Stands for the event loop and the server: answers each GEMM RemoteEngine submits with
    its product, computed here (as a GEMM the planner keeps home)."""

    def call_soon_threadsafe(self, fn, *args) -> None:  # type: ignore[no-untyped-def]
        requests, futures = fn.args[0], fn.args[1]
        for r, f in zip(requests, futures, strict=True):
            f.set_result(lambda r=r: r.a @ r.b)


def test_a_layers_deferred_dw_reaches_the_thread_that_ran_its_forward() -> None:
    """On a GPU, autograd runs backward on its own device thread, not the trainer's: a dW that
    backward defers must still reach the trainer thread's ``finish_backward`` (a CUDA
    coordinator once dropped every deferred dW, so its Linear weights never learned). Here
    backward runs on another thread, as CUDA's would."""
    from cleave.coordinator.net.remote import RemoteEngine

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    tiled = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    tiled.load_state_dict(plain.state_dict())
    server = type("S", (), {"submit": lambda *a, **k: None})()  # (the loop answers in its stead)
    engine = RemoteEngine(server=server, loop=_AnsweringLoop())  # type: ignore[arg-type]
    assert offload_linears(tiled, engine) == 2
    x = torch.randn(5, 8)
    plain(x).square().sum().backward()
    loss = tiled(x).square().sum()  # forward on this thread
    other = threading.Thread(target=loss.backward)  # backward on another
    other.start()
    other.join()
    engine.finish_backward()  # here, where the forward ran
    for (name, want), got in zip(plain.named_parameters(), tiled.parameters(), strict=True):
        assert got.grad is not None, name
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- the optimizer's settings

CORPUS = bytes(range(32, 127)) * 200  # 19 kB of text: no corpus to read
SMALL = {"batch_size": 2, "seq_len": 16}  # steps of a few milliseconds


def _schedule(step: int, lr: float, steps: int, warmup: int, floor: float) -> float:
    """The schedule docs/cli.md states, written out: linear warm-up, then cosine to the floor."""
    if warmup and step <= warmup:
        return lr * step / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def test_the_learning_rate_warms_up_then_decays_to_min_lr_and_the_optimizer_takes_it() -> None:
    cfg = TrainConfig(steps=5, lr=2e-3, warmup=2, min_lr=2e-4, **SMALL)
    trainer = Trainer(cfg, corpus=CORPUS)
    for step in range(1, 6):
        assert trainer.lr_at(step) == pytest.approx(_schedule(step, 2e-3, 5, 2, 2e-4), rel=1e-12), step
    assert trainer.lr_at(2) == 2e-3 and trainer.lr_at(5) == pytest.approx(2e-4, rel=1e-12)
    taken = []  # what the optimizer stepped with, as each step ends
    results = trainer.run(on_step=lambda r: taken.append([g["lr"] for g in trainer.optimizer.param_groups]))
    assert taken == [[r.lr, r.lr] for r in results]
    assert [r.lr for r in results] == [trainer.lr_at(s) for s in range(1, 6)]
    default = Trainer(TrainConfig(steps=30), corpus=CORPUS)  # no --min-lr: 10% of --lr, as before it existed
    for step in range(1, 31):
        progress = (step - 10) / 20  # the code before --min-lr, verbatim
        before = 3e-3 * step / 10 if step <= 10 else 3e-3 * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))
        assert default.lr_at(step) == before, step  # the same bits: old jobs' losses do not move
    no_warmup = Trainer(TrainConfig(steps=5, warmup=0, min_lr=0.0), corpus=CORPUS)
    assert [no_warmup.lr_at(s) for s in (1, 5)] == [pytest.approx(_schedule(1, 3e-3, 5, 0, 0.0)), 0.0]


def _plain_adamw(cfg: TrainConfig, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[dict, list[float]]:
    """The reference: plain torch's AdamW on the same model and batches, the decay on matrices
    only, the gradients clipped to ``grad_clip`` unless 0. Returns the weights and each step's
    gradient norm before clipping."""
    from cleave.coordinator.training import models

    torch.manual_seed(cfg.seed)
    model = models.build(cfg.model)
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": cfg.weight_decay}, {"params": others, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
        foreach=False,
    )
    floor = 0.1 * cfg.lr if cfg.min_lr is None else cfg.min_lr
    norms = []
    for step, (x, y) in enumerate(batches, start=1):
        for group in opt.param_groups:
            group["lr"] = _schedule(step, cfg.lr, cfg.steps, cfg.warmup, floor)
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip, foreach=False)
        opt.step()
    return model.state_dict(), norms


def _trained(cfg: TrainConfig) -> tuple[dict, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A Trainer's weights after ``cfg.steps`` steps, and the batches it drew."""
    trainer = Trainer(cfg, corpus=CORPUS)
    drawn = []
    draw = trainer.batches.next

    def recorded() -> tuple[torch.Tensor, torch.Tensor]:
        x, y = draw()
        drawn.append((x.clone(), y.clone()))
        return x, y

    trainer.batches.next = recorded  # type: ignore[method-assign]
    trainer.run()
    return trainer.model.state_dict(), drawn


@pytest.mark.parametrize("grad_clip", [0.05, 0.0], ids=["clipped", "no-clip"])
def test_weight_decay_and_clipping_are_plain_adamws_as_set(grad_clip: float) -> None:
    cfg = TrainConfig(steps=4, warmup=1, min_lr=1e-4, weight_decay=0.5, grad_clip=grad_clip, **SMALL)
    weights, batches = _trained(cfg)
    assert Trainer(cfg, corpus=CORPUS).optimizer.param_groups[0]["weight_decay"] == 0.5
    want, norms = _plain_adamw(cfg, batches)
    for name, tensor in want.items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-6, atol=1e-7, msg=name)
    # Each setting changes the weights: clipping bites (every norm is above it) and so does the decay.
    if grad_clip:
        assert min(norms) > grad_clip
    for changed in ({"grad_clip": 0.05 - grad_clip}, {"weight_decay": 0.0}):
        unlike, _ = _plain_adamw(dataclasses.replace(cfg, **changed), batches)
        assert any(not torch.equal(weights[name], tensor) for name, tensor in unlike.items()), changed


def test_the_optimizer_settings_are_stored_with_the_job_and_a_resume_keeps_them(tmp_path: Path) -> None:
    """A job's options are stored in its row and its checkpoints; a coordinator that resumes it
    takes the stored ones (those it was started with now are ignored, as for --lr), and a
    checkpoint is refused by a trainer of other settings."""
    from cleave.coordinator.config import CoordinatorConfig
    from cleave.coordinator.job import _plan
    from cleave.db.sqlite import SQLiteStore

    first = TrainConfig(steps=5, warmup=2, min_lr=1e-4, weight_decay=0.05, grad_clip=0.5, **SMALL)
    store = SQLiteStore(tmp_path / "j.db")
    store.create_job("a", first.to_dict(), 5, 0.0)  # left unfinished
    notes: list[str] = []

    class Notes:
        def note(self, text: str) -> None:
            notes.append(text)

    other = CoordinatorConfig(train=TrainConfig(steps=5, warmup=0, grad_clip=0.0), db=str(tmp_path / "j.db"))
    plan = _plan(other, store, Notes(), 1.0)  # type: ignore[arg-type]
    assert plan.train == first and "options as first given" in notes[-1]
    stored = store.job(plan.books.job_id).config  # read back from SQLite
    store.close()
    assert {k: stored[k] for k in ("warmup", "min_lr", "weight_decay", "grad_clip")} == {
        "warmup": 2,
        "min_lr": 1e-4,
        "weight_decay": 0.05,
        "grad_clip": 0.5,
    }
    trainer = Trainer(first, corpus=CORPUS)
    trainer.train_step()
    state = trainer.state_dict()
    again = Trainer(first, corpus=CORPUS)
    again.load_state_dict(state)
    assert again.step == 1
    for changed in ({"warmup": 3}, {"min_lr": None}, {"weight_decay": 0.1}, {"grad_clip": 1.0}):
        with pytest.raises(ConfigError, match="other options"):
            Trainer(dataclasses.replace(first, **changed), corpus=CORPUS).load_state_dict(state)
    # A checkpoint or job row from before these options existed: today's defaults, as it trained.
    old = Trainer(TrainConfig(steps=5), corpus=CORPUS).state_dict()
    del old["config"]["min_lr"]
    Trainer(TrainConfig(steps=5), corpus=CORPUS).load_state_dict(old)
    assert TrainConfig(**old["config"]) == TrainConfig(steps=5)
