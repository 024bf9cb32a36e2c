"""A coordinator tier on torch.distributed: ranks in real processes, gloo on loopback."""

from __future__ import annotations

import json
import multiprocessing
import queue
import signal
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from procs import OPERATOR, Coordinator, join, wait_until

from cleave.coordinator.planning.tier import partition
from cleave.coordinator.tier.group import (
    HEARTBEAT,
    MAX_STATUS_BYTES,
    RankLost,
    RankSummary,
    Tier,
    TierRefused,
    job_digest,
    join_tier,
)
from cleave.coordinator.tier.rendezvous import LOOKOUT
from cleave.coordinator.training.loop import TrainConfig, Trainer
from cleave.coordinator.training.parallel import DataParallel, ShardedAdamW
from cleave.wire import auth

SECRET = "tier-secret-for-tests"
KEY = b"this meeting's key"  # (join_tier derives one from the secret and the ranks' nonces)
# Each rank is a fresh process forked by a server that has imported torch and this module once
# (torch's AdamW imports torch._dynamo when built): a rank starts in milliseconds, not after the
# 2-5 s of CPU that spawning one costs on two cores.
CTX = multiprocessing.get_context("forkserver")
CTX.set_forkserver_preload(
    ["torch", "torch._dynamo", "torch.distributed", "cleave.coordinator.training.loop", __name__]
)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, secret: str, options: dict, out: Any) -> None:
    """One rank: join, train, report (losses, final weights, optimizer state size)."""
    torch.set_num_threads(1)
    cfg = TrainConfig(**options)
    try:
        tier = join_tier(f"tcp://127.0.0.1:{port}", rank, world, secret, job_digest(options), timeout=4.0)
    except Exception as exc:
        out.put((rank, type(exc).__name__, str(exc)))
        return
    trainer = Trainer(cfg, parallel=tier.parallel)
    losses, held_out = [], []
    try:
        while trainer.step < cfg.steps:
            result = trainer.train_step()
            losses.append(result.loss)
            held_out.append(result.extra.get("val_loss"))
    except Exception as exc:
        out.put((rank, type(exc).__name__, str(exc)))
        tier.close()
        return
    state = sum(v.numel() for s in trainer.optimizer.state.values() for v in s.values() if v.dim())
    # numpy, not tensors: a tensor crosses a queue as a shared-memory handle that dies with this process
    weights = {k: v.numpy().copy() for k, v in trainer.model.state_dict().items()}
    out.put((rank, losses, weights, state, trainer.tokens_seen, held_out))
    tier.close()


def _tier(world: int, options: dict, secrets: list[str] | None = None) -> dict:
    port, out = _port(), CTX.Queue()
    procs = [
        CTX.Process(target=_rank, args=(r, world, port, (secrets or [SECRET] * world)[r], options, out))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + 120
    while len(results) < world and time.monotonic() < deadline:
        try:
            item = out.get(timeout=1)
        except queue.Empty:
            continue
        results[item[0]] = item[1:]
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    return results


OPTIONS = {"steps": 4, "batch_size": 6, "seq_len": 32, "eval_every": 2}  # the held-out loss at steps 2 and 4
# The drill's --tier-timeout: long enough for a look at the stalled tier (a rank shows as silent 3
# heartbeats after its last, 2-4 s after its kill; the others stop once this is out).
TIER_WAIT = 7


@pytest.mark.parametrize("world", [3])  # 3: gloo's own all-reduce would not be the rank-order sum here
def test_ranks_train_the_global_batch_exactly_as_one_process(world: int) -> None:
    """Each rank trains its slice; gradients summed in rank order, AdamW sharded: every rank
    logs the same global loss and ends with the same weights, the bits of one process running
    the slices as micro-batches in order, and plain torch's whole batch within 1e-5."""
    results = _tier(world, OPTIONS)
    assert sorted(results) == list(range(world)), results
    whole = Trainer(TrainConfig(**OPTIONS))
    whole_results = whole.run()
    want = [r.loss for r in whole_results]
    parts = Trainer(TrainConfig(**OPTIONS, micro_batches=world))
    in_order = [r.loss for r in parts.run()]
    losses, weights, state, tokens = results[0][0], results[0][1], results[0][2], results[0][3]
    for r in range(1, world):
        assert results[r][0] == losses  # the same global loss, bit for bit
        assert all((weights[k] == results[r][1][k]).all() for k in weights)
    assert losses == in_order
    assert losses == pytest.approx(want, rel=1e-5)
    for k, v in parts.model.state_dict().items():
        assert torch.equal(torch.from_numpy(weights[k]), v), k
    assert tokens == whole.tokens_seen  # the global count
    # The held-out loss: each rank evaluates its slice of the fixed batches and the ranks sum their
    # shares, so every rank logs the same one, that of one process within float error.
    held_out = results[0][4]
    assert all(results[r][4] == held_out for r in range(1, world))
    assert [v is None for v in held_out] == [True, False, True, False]
    want_held = [r.extra["val_loss"] for r in whole_results if "val_loss" in r.extra]
    assert [v for v in held_out if v is not None] == pytest.approx(want_held, rel=1e-5)
    # ZeRO-1: each rank holds AdamW's moments for its share of the parameters only (whole
    # parameters: within one parameter of an equal share).
    total = sum(p.numel() for p in whole.model.parameters())
    largest = max(p.numel() for p in whole.model.parameters())
    assert abs(state - 2 * total / world) <= 2 * largest, (state, total, largest)


def test_a_rank_without_the_secret_never_counts_as_one() -> None:
    """A stranger at the rendezvous port, taking rank 1's place without the secret: it never
    meets rank 0 (it waits in another namespace; its address would fail the seal). The tier
    refuses to start as soon as rank 0 sees the other secret's keys in its store (TierRefused),
    not when the meeting times out (JobAborted). Rank 1 refuses so too, or finds the store gone."""
    results = _tier(2, OPTIONS, secrets=[SECRET, "guessed"])
    assert results[0][0] == "TierRefused" and "needs the same --tier-secret" in results[0][1], results
    assert results[1][0] == "TierRefused" or "could not form the tier" in results[1][1], results


def test_sharded_adamw_on_one_rank_is_torchs_adamw_bit_for_bit() -> None:
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    plain = torch.optim.AdamW(
        [{"params": [a[0]], "weight_decay": 0.1}, {"params": [a[1]], "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.9, 0.95),
        foreach=False,
    )
    sharded = ShardedAdamW([([b[0]], 0.1), ([b[1]], 0.0)], DataParallel(0, 1), lr=1e-2, betas=(0.9, 0.95))
    for _ in range(3):
        grads = [torch.randn_like(p) for p in a]
        for p, q, g in zip(a, b, grads):
            p.grad, q.grad = g.clone(), g.clone()
        plain.step()
        sharded.step()
    assert all(torch.equal(p, q) for p, q in zip(a, b))


@given(st.lists(st.integers(0, 50), min_size=1, max_size=30), st.integers(1, 8))
def test_partition_gives_each_rank_a_contiguous_run_within_one_parameter_of_its_share(
    sizes: list[int], world: int
) -> None:
    owners = partition(sizes, world)
    assert owners == sorted(owners) and all(0 <= o < world for o in owners)
    total, largest = sum(sizes), max(sizes)
    for r in range(world):
        load = sum(n for n, o in zip(sizes, owners) if o == r)
        assert abs(load - total / world) <= largest


def _shard_rank(rank: int, world: int, path: str, out: Any) -> None:
    """One rank of a reduce-scatter, clip and all-gather in buckets of a few elements."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*shape)) for shape in SHAPES]
    opt = ShardedAdamW(
        [(params[:3], 0.1), (params[3:], 0.0)],
        DataParallel(rank, world),
        lr=1e-2,
        betas=(0.9, 0.95),
        order=params[::-1],  # the model's order need not be the groups'
        bucket_bytes=4 * 5 * world,  # 5 elements a rank a bucket: buckets cut parameters
    )
    for step in range(3):
        gen = torch.Generator().manual_seed(100 * step + rank)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * (10 if step == 1 else 0.1)
        params[2].grad = None if rank == 1 else params[2].grad  # counts as zeros there
        params[5].grad = None  # on no rank (a frozen or unused parameter): left alone, as in one process
        opt.reduce_gradients()
        opt.clip_grad_norm_(1.0)
        opt.step()
    out.put((rank, [p.detach().numpy().copy() for p in params]))
    dist.destroy_process_group()


SHAPES = [(3, 4), (7,), (2, 2, 3), (1,), (11, 2), (4,)]


def test_the_sharded_step_in_small_buckets_is_one_process_summing_the_ranks_in_order(tmp_path: Path) -> None:
    """Three ranks, buckets of 5 elements a rank (so buckets and shards cut parameters), one rank
    without a gradient for one parameter, a step that clips: every rank ends with the weights
    of one process that adds the ranks' gradients in rank order, clips and steps AdamW."""
    world, out = 3, CTX.Queue()
    procs = [CTX.Process(target=_shard_rank, args=(r, world, str(tmp_path / "rdv"), out)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in range(world))
    for p in procs:
        p.join(10)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*shape)) for shape in SHAPES]
    plain = torch.optim.AdamW(
        [{"params": params[:3], "weight_decay": 0.1}, {"params": params[3:], "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.9, 0.95),
        foreach=False,
    )
    for step in range(3):
        total = [torch.zeros_like(p) for p in params]
        for r in range(world):
            gen = torch.Generator().manual_seed(100 * step + r)
            grads = [torch.randn(p.shape, generator=gen) * (10 if step == 1 else 0.1) for p in params]
            if r == 1:
                grads[2] = torch.zeros_like(params[2])
            total = [g.clone() if r == 0 else t + g for t, g in zip(total, grads)]
        for p, g in zip(params, total):
            p.grad = g
        params[5].grad = None
        torch.nn.utils.clip_grad_norm_(params[::-1], 1.0, foreach=False)
        plain.step()
    for r in range(world):
        for p, q in zip(params, got[r]):
            assert torch.equal(p.detach(), torch.from_numpy(q)), r
    torch.manual_seed(0)
    assert torch.equal(torch.from_numpy(got[0][5]), [torch.randn(*shape) for shape in SHAPES][5])  # untouched


def _summary(seq: int, step: int = 3, url: str = "ws://10.0.0.2:8765") -> RankSummary:
    return RankSummary(seq, step, "training", 4, 12.5, 250.0, url)


def test_each_rank_sees_the_whole_tier_and_believes_only_sealed_fresh_summaries() -> None:
    """Two ranks' views through a real TCPStore: each sees both rows with figures and health; a
    stranger at the port who writes a summary without the secret, an oversized or malformed one,
    or an old genuine one again (a replay), changes nothing anyone believes; a rank that stops
    beating turns silent, then lost."""
    import torch.distributed as dist

    port = _port()
    now = [100.0]
    master = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    ranks = [
        Tier(r, 2, store, timeout=10.0, clock=lambda: now[0], secret=SECRET.encode(), key=KEY)
        for r, store in enumerate((master, client))
    ]
    summaries = [_summary(1, url="ws://10.0.0.1:8765"), _summary(1)]
    for r, tier in enumerate(ranks):
        tier.summary = lambda r=r: summaries[r]
        tier.beat(tier.store)
    for tier, store in [*zip(ranks, (master, client))] * 2:  # rank 0 reads rank 1's on its second look
        tier.exchange(store)
    view = ranks[0].view()
    assert view["rank"] == 0 and view["world"] == 2
    mine, other = view["ranks"]
    assert mine["health"] == "self" and other["health"] == "alive"
    assert other["url"] == "ws://10.0.0.2:8765" and other["devices"] == 4 and other["gflops"] == 250.0
    # A stranger at the port overwrites rank 1's summary without the secret, or with a summary
    # sealed in an earlier run of the tier (the same secret, another meeting's key).
    forged = _summary(9, step=999).to_json()
    client.set("status/1", auth.tier_status_mac(b"guessed", 1, forged) + forged)
    ranks[0].exchange(master)
    row = ranks[0].view()["ranks"][1]
    assert "step" not in row and "failed the tier's seal" in row["note"]
    earlier = auth.tier_session_key(SECRET.encode(), bytes(32), b"an earlier meeting's nonces")
    client.set("status/1", auth.tier_status_mac(earlier, 1, forged) + forged)
    ranks[0].exchange(master)
    row = ranks[0].view()["ranks"][1]
    assert "step" not in row and "failed the tier's seal" in row["note"]
    # Rank 0's genuine summary passed off as rank 1's: sealed for another rank, not believed.
    genuine = _summary(5, step=7).to_json()
    client.set("status/1", auth.tier_status_mac(KEY, 0, genuine) + genuine)
    ranks[0].exchange(master)
    assert "failed the tier's seal" in ranks[0].view()["ranks"][1]["note"]
    # Malformed (a field out of bounds) and oversized, even when sealed: not believed either.
    for payload in (
        json.dumps({**json.loads(_summary(6).to_json()), "devices": -1}).encode(),
        b" " * (MAX_STATUS_BYTES + 1),
    ):
        client.set("status/1", auth.tier_status_mac(KEY, 1, payload) + payload)
        ranks[0].exchange(master)
        assert "not believed" in ranks[0].view()["ranks"][1]["note"]
    # Fresh (seq 8), then an older genuine summary replayed (seq 2): the fresh one stands.
    for seq in (8, 2):
        fresh = _summary(seq, step=seq).to_json()
        client.set("status/1", auth.tier_status_mac(KEY, 1, fresh) + fresh)
        ranks[0].exchange(master)
    assert ranks[0].view()["ranks"][1]["step"] == 8
    # Rank 1 stops beating: silent after a few heartbeats, lost after the tier's timeout.
    now[0] += 5
    ranks[0].exchange(master)
    assert ranks[0].view()["ranks"][1]["health"] == "silent"
    now[0] += 10
    ranks[0].exchange(master)
    assert ranks[0].view()["ranks"][1]["health"] == "lost"
    ranks[1].beat(client)
    ranks[0].exchange(master)
    assert ranks[0].view()["ranks"][1]["health"] == "alive"


def _arrived(store: Any, step: int | str, *ranks: int) -> None:
    """Ranks ``ranks`` at ``step``'s barrier, as a rank marks its arrival (sealed)."""
    for r in ranks:
        name = f"step/{step}/{r}"
        store.set(name, auth.tier_value_mac(KEY, name, b""))


def test_a_lost_rank_is_named_alike_by_every_rank_and_only_on_a_ranks_sealed_word() -> None:
    """The rank that notices a lost one writes it to the store, sealed; another rank waiting at
    the barrier names that same rank from it. A stranger's unsealed "lost" changes nothing."""
    import torch.distributed as dist

    from cleave.coordinator.tier.group import LOST

    port = _port()
    master = dist.TCPStore("127.0.0.1", port, 3, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, 3, is_master=False)
    rank0, rank1 = Tier(0, 3, master, timeout=30.0, key=KEY), Tier(1, 3, client, timeout=30.0, key=KEY)
    client.set(LOST, b"x" * 32 + b"lost|2|a stranger says so")
    _arrived(client, 1, 1, 2)  # ranks 1 and 2 are there already
    rank0.arrive(1)  # not believed: the barrier passes
    news = b"lost|2|a summary's seal on it"  # sealed as a summary is, not as a loss: not believed either
    client.set(LOST, auth.tier_status_mac(KEY, 2, news) + news)
    _arrived(client, "1b", 1, 2)
    rank0.arrive("1b")  # type: ignore[arg-type]
    with pytest.raises(RankLost, match="rank 2 of the tier was lost [(]no heartbeat for 30 s[)]"):
        rank1._announce(2, "no heartbeat for 30 s")
    with pytest.raises(RankLost, match="rank 2 of the tier was lost [(]no heartbeat for 30 s[)]"):
        rank0.arrive(2)


class _DeletesBeforeTheRead:
    """A store client through which a stranger deletes ``name`` once, just before a rank reads it
    (after the rank looked and found it there): the read would wait for it."""

    def __init__(self, inner: Any, name: str, gone: Any) -> None:
        self.inner, self.name, self.gone = inner, name, gone

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)

    def _race(self, names: list[str]) -> None:
        if self.name in names and not self.gone.is_set():
            self.inner.delete_key(self.name)
            self.gone.set()

    def get(self, name: str) -> bytes:
        self._race([name])
        return self.inner.get(name)

    def multi_get(self, names: list[str]) -> list[bytes]:
        self._race(names)
        return self.inner.multi_get(names)


def test_a_key_deleted_between_a_look_and_its_read_holds_a_rank_up_a_heartbeat_not_the_store_timeout() -> None:
    """Ranks 1 and 2 have arrived at step 1's barrier; a stranger at the port deletes rank 1's
    arrival after rank 0 saw it there and before it read it, and rank 2 then announces rank 1
    lost. Rank 0 reads through a client that waits a heartbeat at most: it takes the key for not
    there yet, reads the notice at its next look, and names rank 1, not its own store (which
    would wait 10 s, the tier's timeout here, for the deleted key)."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from cleave.coordinator.tier.group import LOST

    port, name, gone = _port(), "step/1/1", threading.Event()
    master = dist.TCPStore("127.0.0.1", port, 3, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    quick = dist.TCPStore("127.0.0.1", port, 3, is_master=False, timeout=timedelta(seconds=HEARTBEAT))
    writer = dist.TCPStore("127.0.0.1", port, 3, is_master=False)
    rank0 = Tier(0, 3, _DeletesBeforeTheRead(master, name, gone), timeout=30.0, key=KEY)
    rank0.reads = _DeletesBeforeTheRead(quick, name, gone)
    _arrived(writer, 1, 1, 2)

    def rank_2_announces() -> None:
        gone.wait(10)
        news = b"lost|1|no heartbeat for 30 s"
        writer.set(LOST, auth.tier_lost_mac(KEY, 1, news) + news)

    threading.Thread(target=rank_2_announces, daemon=True).start()
    started = time.monotonic()
    with pytest.raises(RankLost) as lost:
        rank0.arrive(1)
    assert gone.is_set() and lost.value.rank == 1, lost.value
    assert time.monotonic() - started < 5 * HEARTBEAT  # a read's timeout and a look later: 2 s


def test_join_tier_refuses_bad_options_in_one_line() -> None:
    from cleave.wire.errors import ConfigError

    with pytest.raises(ConfigError, match="tcp://HOST:PORT or env://"):
        join_tier("udp://x:1", 0, 2, SECRET, bytes(32))
    with pytest.raises(ConfigError, match="--rank must be between 0 and 1"):
        join_tier("tcp://127.0.0.1:1", 2, 2, SECRET, bytes(32))
    with pytest.raises(ConfigError, match="needs its secret"):
        join_tier("tcp://127.0.0.1:1", 0, 2, "", bytes(32))
    assert RankLost(3, "x").rank == 3 and issubclass(TierRefused, ConfigError)


def test_a_rendezvous_name_that_resolves_to_loopback_is_said_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    """``--rendezvous $(hostname):P`` on Debian resolves to 127.0.1.1: rank 0 would listen where
    no other machine reaches it. A name that resolves to loopback is said, once, when other ranks
    are to come; an address typed as such, or a tier of one, is taken as meant."""
    import logging
    import os

    from cleave.coordinator.tier.rendezvous import listen

    caplog.set_level(logging.WARNING, logger="cleave.tier")
    for host, world in (("localhost", 2), ("127.0.0.1", 2), ("localhost", 1)):
        os.close(listen(host, _port(), world))
    said = [r.getMessage() for r in caplog.records if "loopback" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("tier: --rendezvous localhost resolves to "), said
    assert "ranks on other machines cannot reach it" in said[0]


def test_rank_0s_store_listens_only_on_the_rendezvous_host_and_under_the_secrets_namespace() -> None:
    """--rendezvous tcp://127.0.0.1:PORT: rank 0's store accepts there, and refuses at
    127.0.0.2:PORT (loopback too, on Linux), not every interface as torch binds by itself. Every
    key in it, gloo's included, is under a namespace only the secret names."""
    import torch.distributed as dist

    from cleave.coordinator.tier.rendezvous import namespace

    port = _port()
    tier = join_tier(f"tcp://127.0.0.1:{port}", 0, 1, SECRET, job_digest(OPTIONS), timeout=4.0)
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.2", port), timeout=2).close()
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        stranger = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=4))
        keys = stranger.list_keys()
        space = namespace(SECRET.encode())
        assert any("/pg/" in k for k in keys) and all(k.startswith(space) for k in keys), keys
        assert space != namespace(b"guessed")
    finally:
        tier.close()


def test_under_torchrun_rank_0_meets_at_the_agents_store_under_the_attempts_namespace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """env:// under torchrun: the agent serves the store (here, a TCPStore this test hosts), so
    rank 0 listens on nothing of its own; its keys are under the secret's namespace and this
    restart's attempt, apart from an earlier attempt's."""
    import torch.distributed as dist

    from cleave.coordinator.tier.rendezvous import namespace

    port = _port()
    agent = dist.TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}
    env |= {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "2"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    tier = join_tier("env://", None, None, SECRET, job_digest(OPTIONS), timeout=4.0)
    try:
        assert (tier.rank, tier.world) == (0, 1)
        keys = agent.list_keys()
        assert keys and all(k.startswith(namespace(SECRET.encode(), "2")) for k in keys), keys
    finally:
        tier.close()


def _stalls_with_a_stranger(rank: int, world: int, port: int, out: Any, skew: float = 0.0) -> None:
    """Rank 1 joins ``skew`` seconds late and dies; rank 0 waits for it at step 1's barrier, with
    a stranger at the store's port meanwhile. Reports what rank 0 met, after how long, and what
    it logged."""
    import logging
    import os

    torch.set_num_threads(1)
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("cleave.tier").addHandler(handler)
    if rank == 1:
        time.sleep(skew)
    try:
        tier = join_tier(f"tcp://127.0.0.1:{port}", rank, world, SECRET, job_digest(OPTIONS), timeout=4.0)
    except Exception as exc:
        out.put((rank, type(exc).__name__, str(exc), 0.0, lines))
        return
    if rank == 1:
        os._exit(0)  # as a SIGKILL would: no more heartbeats, no arrival
    tier.timeout = 0.5  # (the drill's --tier-timeout, shorter: the stranger has a second to act)
    started = time.monotonic()
    try:
        tier.arrive(1)
        out.put((rank, "passed the barrier", "", time.monotonic() - started, lines))
    except Exception as exc:
        out.put((rank, type(exc).__name__, str(exc), time.monotonic() - started, lines))


def _store_stranger(port: int, stop: Any) -> None:
    """A plain store client at rank 0's port, without the secret: while the ranks meet and wait,
    it writes gloo's addresses and bumps the heartbeat and barrier counters under the names the
    tier used to use, and overwrites every heartbeat and arrival it can list, forged or huge."""
    import torch.distributed as dist

    while not stop.is_set():  # at the port as soon as rank 0 opens it (torch's client backs off for seconds)
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.01)
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    except Exception:  # (rank 0 already gone: the test says what it met)
        return
    n = 0
    while not stop.is_set():
        n += 1
        writes: list[tuple[Any, ...]] = [(store.set, f"cleave-tier//pg//0//cpu//0/{r}", b"an address") for r in (0, 1)]
        writes += [(store.add, "cleave-tier//alive/1", 1), (store.add, "cleave-tier//step/1", 1)]
        try:
            listed = store.list_keys()
        except Exception:  # rank 0 is gone, and its store with it
            return
        for space in {key.removesuffix("/run") for key in listed if key.endswith("/run")}:
            huge = b"x" * (1 << 20) if n % 10 == 0 else b""
            beat, arrival = huge or bytes(32) + str(10**6 + n).encode(), huge or bytes(32)  # (shaped as a rank's)
            writes += [(store.set, f"{space}/alive/1", beat), (store.set, f"{space}/step/1/1", arrival)]
            writes += [(store.add, f"{space}/junk/{n}", 1)]
        for write, *args in writes:
            try:
                write(*args)
            except Exception:  # (its own junk where it adds: it goes on)
                pass
        time.sleep(0.02)


def test_a_stranger_at_the_store_port_can_neither_forge_heartbeats_nor_pass_the_barrier() -> None:
    """Rank 1 dies once the tier is formed; rank 0 waits for it at the barrier. A stranger at the
    store's port writes gloo's addresses and bumps heartbeats and arrivals under the tier's old
    key names, and overwrites rank 1's heartbeat and arrival in the tier's namespace (listed)
    with forged or 1 MiB values. Rank 1 starts a second after rank 0 (a loaded machine, or
    another one): the stranger's keys outside the namespace stop nothing meanwhile (they are no
    rank's arrival), and are logged once. The tier forms, rank 0 does not pass the barrier nor
    believe the heartbeats: it names rank 1 lost within its timeout, and logs each forged key once."""
    import threading

    port, out, stop = _port(), CTX.Queue(), threading.Event()
    stranger = threading.Thread(target=_store_stranger, args=(port, stop), daemon=True)
    stranger.start()
    skew = 1.5 * LOOKOUT  # rank 0 looks at the store's keys while it waits for rank 1
    procs = [CTX.Process(target=_stalls_with_a_stranger, args=(r, 2, port, out, skew)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = out.get(timeout=60)
    finally:
        stop.set()
        stranger.join(10)
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    rank, outcome, message, waited, lines = got
    assert (rank, outcome) == (0, "RankLost") and "rank 1 of the tier was lost (no heartbeat" in message, got
    assert waited < 0.5 + 3 * HEARTBEAT, got
    doubted = [line for line in lines if "is not believed" in line]
    assert any(line.startswith("tier: alive/1 in the") for line in doubted), lines
    assert any(line.startswith("tier: step/1/1 in the") for line in doubted), lines
    assert len(doubted) == len(set(doubted)), doubted  # one line a key, not one a look
    assert sum("outside this tier's namespace and no rank's" in line for line in lines) == 1, lines


def test_gloo_meets_only_through_addresses_sealed_in_this_run() -> None:
    """What gloo reads through the sealed store: a value a stranger overwrote, sealed in an
    earlier run, moved from another key or too big is looked past, and refused once the meeting's
    timeout is out (a clear error, not gloo connecting to it); a forged value that the rank then
    overwrites with its own is waited past."""
    import threading

    import torch.distributed as dist

    from cleave.coordinator.tier.rendezvous import SealedStore

    port = _port()
    master = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    stranger = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    key, earlier = auth.tier_store_key(SECRET.encode(), b"n" * 32), auth.tier_store_key(SECRET.encode(), b"e" * 32)
    sealed = SealedStore(key, dist.PrefixStore("ns/", master), timedelta(seconds=0.1))
    old = SealedStore(earlier, dist.PrefixStore("ns/", stranger), timedelta(seconds=0.1))
    sealed.set("pg/1", b"10.0.0.2:4242")
    assert sealed.get("pg/1") == b"10.0.0.2:4242"
    for forged in (
        bytes(32) + b"10.6.6.6:4242",  # no seal
        auth.tier_value_mac(key, "pg/0", b"10.6.6.6:4242") + b"10.6.6.6:4242",  # another key's seal
        b"x" * (1 << 17),  # too big
    ):
        stranger.set("ns//pg/1", forged)
        with pytest.raises(dist.DistStoreError, match="pg/1 in the rendezvous store is not believed"):
            sealed.get("pg/1")
    old.set("pg/1", b"10.6.6.6:4242")  # sealed in an earlier run (another nonce of rank 0's)
    with pytest.raises(dist.DistStoreError, match="fails the tier's seal"):
        sealed.get("pg/1")
    timer = threading.Timer(0.2, sealed.set, ("pg/1", b"10.0.0.2:4243"))  # the rank writes its own after
    timer.start()
    patient = SealedStore(key, dist.PrefixStore("ns/", master), timedelta(seconds=10))
    assert patient.get("pg/1") == b"10.0.0.2:4243"
    timer.join()


def _rows_seen(coord: Coordinator, seen: list[list[dict]]) -> list[dict]:
    """The tier's rows in ``coord``'s status snapshot, asked as ``cleave status`` asks (kept in
    ``seen``; none once it is gone). In this process: a new process a look is too slow here."""
    from websockets.exceptions import WebSocketException
    from websockets.sync.client import connect

    from cleave.wire.messages import StatusReply, StatusRequest, decode, encode

    try:
        with connect(coord.url, compression=None, max_size=None, open_timeout=10, proxy=None) as ws:
            ws.recv(timeout=10)  # the challenge
            ws.send(encode(StatusRequest(token=OPERATOR)))
            reply = decode(ws.recv(timeout=10))
    except (OSError, TimeoutError, WebSocketException):
        reply = None
    rows = reply.status.get("tier", {}).get("ranks", []) if isinstance(reply, StatusReply) else []
    seen.append(rows)
    return rows


def _ranks(tmp: Path, world: int, port: int, *args: str, steps: int, batch: int) -> list[Coordinator]:
    """``world`` real coordinators, one tier on loopback."""
    out = []
    secret = tmp / "tier-secret"  # from a file, as an operator should give it (not on the command line)
    secret.touch(mode=0o600)
    secret.write_text(SECRET + "\n")
    for r in range(world):
        (tmp / f"rank{r}").mkdir(exist_ok=True)
        out.append(
            Coordinator(
                tmp / f"rank{r}",
                *("--world-size", str(world), "--rank", str(r), "--rendezvous", f"tcp://127.0.0.1:{port}"),
                *("--tier-secret-file", str(secret), "--batch-size", str(batch), "--micro-batches", "1", *args),
                steps=steps,
            )
        )
    return out


@pytest.mark.drill
def test_ranks_with_uneven_pools_train_exactly_and_a_killed_rank_stops_them_until_a_restart(tmp_path: Path) -> None:
    """Three coordinator ranks with their own clients (2, 1 and 1). Rank 2 is SIGKILLed mid-run:
    the others stop within the tier timeout, exit 1 and name it. Rank 0's newest checkpoint is
    then lost; all three restarted on their databases resume from the newest step they all hold
    and finish: every rank logged the same global loss each step, plain torch's for the whole
    batch (1e-5), and tiles reached every client."""
    pools, steps, batch = (2, 1, 1), 6, 6
    # --no-redirect: each client stays at the rank it is given (the pools are this test's).
    args = ("--min-devices", "1", "--checkpoint-every", "2", "--tier-timeout", str(TIER_WAIT), "--no-redirect")
    ranks = _ranks(tmp_path, 3, _port(), *args, steps=steps, batch=batch)
    clients = [join(coord.url, f"r{r}-c{i}") for r, coord in enumerate(ranks) for i in range(pools[r])]
    ranks[2].wait_for_step(3)
    ranks[2].proc.send_signal(signal.SIGKILL)
    started = time.monotonic()
    # Any rank shows the whole tier: while the others wait for rank 2 at the barrier, rank 1's
    # status has a row per rank (its pool, step and URL), and rank 2's heartbeat has stopped.
    seen: list[list[dict]] = []

    def stalled() -> bool:
        rows = _rows_seen(ranks[1], seen)
        return len(rows) == 3 and rows[2]["health"] != "alive" and [r.get("devices") for r in rows[:2]] == [2, 1]

    wait_until(stalled, timeout=TIER_WAIT, what="rank 1's view of the tier")
    rows = seen[-1]
    assert [r["health"] for r in rows[:2]] == ["alive", "self"] and rows[2]["health"] in ("silent", "lost")
    # Rank 2's row has figures if its summary (published every other heartbeat) reached rank 1
    # before it was killed; the live ranks' rows always do.
    assert all("url" in r for r in rows[:2]), rows
    assert all(r["url"] == ranks[r["rank"]].url and 0 <= r["step"] <= steps for r in rows if "url" in r), rows
    assert all(r["gflops"] > 0 for r in rows[:2]), rows  # (rank 2's last summary may predate its client)
    assert [ranks[r].wait() for r in (0, 1)] == [1, 1], [c.output for c in ranks]
    assert time.monotonic() - started < 30  # the tier timeout and the barrier's look
    assert all("rank 2 of the tier was lost" in ranks[r].output for r in (0, 1)), [
        ranks[r].output[-600:] for r in (0, 1)
    ]
    assert all(f"tier: rank {r} of 3, every rank proven" in coord.output for r, coord in enumerate(ranks))
    for c in clients:
        c.kill()
    # Rank 0 loses its newest checkpoint (as if killed while writing it): the ranks resume from
    # the newest step they all hold, not refuse.
    newest = max((tmp_path / "rank0").glob("*-checkpoints/*.pt"), key=lambda p: p.name)
    newest.unlink()
    again = _ranks(tmp_path, 3, _port(), *args, steps=steps, batch=batch)
    clients = [join(coord.url, f"r{r}-c{i}") for r, coord in enumerate(again) for i in range(pools[r])]
    assert [c.wait() for c in again] == [0, 0, 0], [c.output for c in again]
    assert all("resuming job 1" in c.output for c in again)
    assert all("tier: the ranks hold different checkpoints" in c.output for c in again), again[1].output[-1500:]
    want = [r.loss for r in Trainer(TrainConfig(steps=steps, batch_size=batch)).run()]
    logged = [[row[0] for row in c.query("SELECT loss FROM steps WHERE job_id = 1 ORDER BY step")] for c in again]
    assert logged[0] == logged[1] == logged[2]  # one global loss, bit for bit
    assert logged[0] == pytest.approx(want, rel=1e-5)
    for r, coord in enumerate(again):
        done = dict(coord.query("SELECT name, tiles_done FROM devices"))
        assert len(done) == pools[r] and all(n > 0 for n in done.values()), done  # tiles were shipped


@pytest.mark.drill
def test_volunteers_given_one_ranks_url_fill_the_weaker_pool_and_compute_there(tmp_path: Path) -> None:
    """Two ranks; every volunteer is given rank 0's URL and join token. The first stays at rank 0
    (no pool is weaker than its empty one). Once rank 0 sees rank 1's pool empty beside its own,
    the second is redirected: it enrols at rank 1 on its ticket (never at rank 0) and computes
    tiles there, and rank 1 starts training with it."""
    ranks = _ranks(tmp_path, 2, _port(), "--min-devices", "1", "--checkpoint-every", "0", steps=200, batch=4)
    first = join(ranks[0].url, "first")
    seen: list[list[dict]] = []
    try:
        wait_until(
            lambda: [r.get("devices") for r in _rows_seen(ranks[0], seen)] == [1, 0] and seen[-1][0]["gflops"] > 0,
            what="rank 0's view of both pools",
        )
    except AssertionError:
        raise AssertionError(f"rank 0's view: {seen[-3:]}") from None
    time.sleep(
        1.5 * HEARTBEAT
    )  # the balancer takes the view once a heartbeat (a newcomer sooner is placed on the last)
    second = join(ranks[0].url, "second")

    def computed_at_rank_1() -> bool:
        rows = ranks[1].query("SELECT tiles_done FROM devices WHERE name = 'second'")
        return bool(rows) and rows[0][0] > 0

    wait_until(computed_at_rank_1, what="the second volunteer's tiles at rank 1")
    assert ranks[0].query("SELECT name FROM identities") == [("first",)]  # nothing of it at rank 0
    assert ranks[0].query("SELECT name FROM devices") == [("first",)]
    assert first.proc.poll() is None and second.proc.poll() is None


def _leaves_after_the_barrier(rank: int, world: int, port: int, out: Any) -> None:
    """Rank 1 reaches step 1's barrier at once and dies there, before the sums; rank 0 trains
    its slice and arrives later, so the barrier passes and rank 0 meets the loss in gloo."""
    import os

    torch.set_num_threads(1)
    try:
        tier = join_tier(f"tcp://127.0.0.1:{port}", rank, world, SECRET, job_digest(OPTIONS), timeout=3.0)
    except Exception as exc:
        out.put((rank, type(exc).__name__, str(exc)))
        return
    if rank == 1:
        tier.arrive(1)
        os._exit(0)  # as a SIGKILL would: no goodbye to the group
    trainer = Trainer(TrainConfig(**OPTIONS), parallel=tier.parallel)
    time.sleep(1.0)
    started = time.monotonic()
    try:
        trainer.train_step()
        out.put((rank, "no error", ""))
    except Exception as exc:
        out.put((rank, type(exc).__name__, f"{exc} after {time.monotonic() - started:.1f} s"))


def test_a_rank_lost_after_the_barrier_is_named_from_the_failed_collective() -> None:
    """The fastest rank dies while it waits at the barrier: the others pass the barrier and meet
    the loss in gloo's sums, not in the barrier. They still name it (RankLost), within the tier
    timeout and a few heartbeats, not a bare gloo error."""
    port, out = _port(), CTX.Queue()
    procs = [CTX.Process(target=_leaves_after_the_barrier, args=(r, 2, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = out.get(timeout=120)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert got[0] == 0 and got[1] == "RankLost", got
    assert "rank 1 of the tier was lost" in got[2] and "after a collective failed" in got[2], got
