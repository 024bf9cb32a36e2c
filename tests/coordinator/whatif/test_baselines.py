"""Baselines: the step's FLOP, the cloud baseline by hand, and the DTFM-style baseline against
hand-computed pipelines, memory limits, monotonicity and a 10,000-device fleet."""

from __future__ import annotations

import dataclasses
import math

import pytest

from cleave.coordinator.planning.costmodel import CostModelError, DeviceClass, Profile
from cleave.coordinator.whatif import baselines
from cleave.coordinator.whatif.baselines import CloudResult, DtfmResult, cloud_step, dtfm_step, step_flops
from cleave.coordinator.whatif.presets import FLEETS, MODELS, model_shape, resolve_fleet


def _close(a: float, b: float, rel: float = 1e-9) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


# --------------------------------------------------------------------------- step FLOP


@pytest.mark.parametrize("name", sorted(MODELS))
def test_step_flops_is_6_tokens_linear_params_plus_three_attention_passes(name: str) -> None:
    model = MODELS[name]
    batch, seq = 3, min(128, model.max_seq_len)
    tokens = batch * seq
    linear = sum(lin.in_features * lin.out_features * lin.count for lin in model.linears())
    attention = 4 * batch * seq * seq * model.d_model * model.n_layers  # QK^T and PV, full square
    assert step_flops(model, batch, seq) == 6 * tokens * linear + 3 * attention


def test_stage_pieces_add_up_to_the_model() -> None:
    for model in MODELS.values():
        seq = 64
        parts = baselines._parts(model, seq)
        head = 0 if model.tied_head else parts.head_params
        assert (
            model.n_layers * parts.layer_params + parts.embedding_params + parts.final_norm_params + head
            == model.params
        ), model.name
        assert _close(model.n_layers * parts.layer_flops + parts.head_flops, step_flops(model, 1, seq)), model.name


# --------------------------------------------------------------------------- cloud


def test_cloud_llama2_7b_bf16_by_hand() -> None:
    # Llama-2-7B: d 4096, 32 layers, FFN 11008 (SwiGLU: gate, up, down), vocab 32000, untied head.
    per_layer = 4 * 4096 * 4096 + 3 * 4096 * 11008
    linear = 32 * per_layer + 4096 * 32000
    tokens = 8 * 256
    flops = 6 * tokens * linear + 3 * (4 * 8 * 256 * 256 * 4096 * 32)
    expected = flops / (8 * 312e12 * 0.45)  # 8 A100s, 312 TFLOP/s dense bf16, 45% MFU
    got = cloud_step(model_shape("llama2-7b"), 8, 256, "bf16")
    assert isinstance(got, CloudResult)
    assert got.flops == flops
    assert _close(got.step_s, expected)
    assert (got.gpus, got.gpu, got.peak_tflops, got.utilisation) == (8, "a100-80gb", 312.0, 0.45)
    assert got.fits and got.memory_per_gpu < 80 * 2**30
    assert "A100" in got.source


def test_cloud_fp32_runs_at_the_tf32_rate() -> None:
    model = model_shape("llama2-7b")
    fp32 = cloud_step(model, 8, 256, "fp32")
    assert fp32.peak_tflops == baselines.A100_TF32_FLOPS / 1e12 == 156.0
    assert _close(fp32.step_s, step_flops(model, 8, 256) / (8 * 156e12 * baselines.MFU_FP32_TF32))
    # Explicit arguments are honoured.
    h100 = cloud_step(model, 8, 256, "fp16", gpus=16, gpu="h100-80gb", utilisation=0.3)
    assert _close(h100.step_s, step_flops(model, 8, 256) / (16 * 989.4e12 * 0.3))


def test_cloud_memory_says_when_the_training_state_does_not_fit() -> None:
    assert cloud_step(model_shape("opt-13b"), 8, 256, "bf16").fits
    big = cloud_step(model_shape("llama2-70b"), 8, 256, "bf16")
    assert not big.fits and big.memory_per_gpu > model_shape("llama2-70b").params * 16 / 8


@pytest.mark.parametrize(
    "kwargs",
    [
        {"gpus": 0},
        {"gpus": True},
        {"gpu": "tpu"},
        {"utilisation": 0.0},
        {"utilisation": 1.5},
        {"utilisation": True},
    ],
)
def test_cloud_refuses_bad_arguments(kwargs: dict) -> None:
    with pytest.raises(CostModelError):
        cloud_step(model_shape("tiny"), 8, 64, "fp32", **kwargs)


# --------------------------------------------------------------------------- DTFM by hand

TINY_LINEAR_PER_LAYER = 64 * 192 + 64 * 64 + 64 * 352 + 176 * 64  # qkv, proj, gate_up, down
TINY_LAYER = TINY_LINEAR_PER_LAYER + 2 * 64  # plus two RMSNorms
TINY_EMBEDDING = TINY_HEAD = 256 * 64


def _device(
    count: int,
    *,
    gflops: float = 1.0,
    memory: int = 1 << 30,
    up: float = 1e6,
    down: float = 4e6,
    rtt: float = 0.01,
    name: str = "dev",
) -> DeviceClass:
    return DeviceClass(name, count, Profile(gflops={"fp32": gflops}, memory=memory, down=down, up=up, rtt=rtt))


def _tiny_expected(batch: int, seq: int, stages: int, replicas: int, dev: Profile) -> dict[str, float]:
    """The documented formulas, written out for the tiny model on identical devices."""
    rate = dev.gflops["fp32"] * 1e9
    layer_flops = 6 * seq * TINY_LINEAR_PER_LAYER + 3 * 4 * seq * seq * 64  # per sequence
    head_flops = 6 * seq * TINY_HEAD
    micro = math.ceil(batch / replicas)  # micro-batches of one sequence
    act = seq * 64 * 4  # one sequence's activation, fp32
    one_way = dev.rtt / 2
    per_layer_stage = 2 // stages
    if stages == 1:
        compute, link = (2 * layer_flops + head_flops) / rate, 0.0
        grads = [(2 * TINY_LAYER + TINY_EMBEDDING + TINY_HEAD + 64) * 4]
    else:
        compute = (per_layer_stage * layer_flops + head_flops) / rate  # the last stage is the slowest
        link = act / min(dev.up, dev.down) + one_way  # first and last each send one tensor a micro-batch
        grads = [(TINY_LAYER + TINY_EMBEDDING) * 4, (TINY_LAYER + TINY_HEAD + 64) * 4]
    pace = max(compute, link)
    allreduce = max(
        2 * (replicas - 1) / replicas * g / min(dev.up, dev.down) + 2 * (replicas - 1) * one_way for g in grads
    )
    return {
        "step": (micro + stages - 1) * pace + allreduce,
        "compute": micro * compute,
        "comm": micro * (pace - compute),
        "bubble": (stages - 1) * pace,
        "allreduce": allreduce,
        "micro": micro,
    }


def _assert_matches(got: DtfmResult, want: dict[str, float]) -> None:
    assert got.step_s is not None and _close(got.step_s, want["step"])
    assert _close(got.compute_s, want["compute"])
    assert _close(got.pipeline_comm_s, want["comm"])
    assert _close(got.bubble_s, want["bubble"])
    assert _close(got.allreduce_s, want["allreduce"])
    assert got.micro_batches == want["micro"]
    assert _close(got.step_s, got.compute_s + got.pipeline_comm_s + got.bubble_s + got.allreduce_s)


def test_two_devices_that_each_hold_half_the_tiny_model() -> None:
    model = model_shape("tiny")
    assert model.params == 2 * TINY_LAYER + TINY_EMBEDDING + TINY_HEAD + 64
    # Room for a stage of one layer (with the embedding or the head), not for the whole model.
    memory = (TINY_LAYER + TINY_HEAD + 64) * 16 + 200_000  # activations: ~80 kB a layer and sequence
    assert memory < model.params * 16
    fleet = [_device(2, memory=memory)]
    got = dtfm_step(model, fleet, 4, 16, "fp32")
    assert (got.stages, got.replicas, got.devices_used, got.rounds) == (2, 1, 2, 1)
    _assert_matches(got, _tiny_expected(4, 16, 2, 1, fleet[0].profile))
    # The pace is the link's (4 KiB at 1 MB/s + 5 ms = 9.1 ms against 6.6 ms of compute), but the
    # largest share is compute: 4 x 6.6 ms against 4 x 2.5 ms exposed plus a 9.1 ms bubble.
    assert got.pipeline_comm_s > 0 and got.bound == "compute"
    assert got.memory_per_device <= memory


@pytest.mark.parametrize("up", [1e5, 1e6, 1e8])
def test_four_identical_devices_take_the_fastest_split(up: float) -> None:
    model = model_shape("tiny")
    fleet = [_device(4, up=up, down=4 * up)]
    got = dtfm_step(model, fleet, 4, 16, "fp32")
    # Every split of 2 layers over at most 4 devices: (stages, replicas).
    options = {
        (s, r): _tiny_expected(4, 16, s, r, fleet[0].profile) for s, r in [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2)]
    }
    best = min(options, key=lambda k: (options[k]["step"], k[0] * k[1]))
    assert (got.stages, got.replicas) == best
    _assert_matches(got, options[best])


def test_fast_links_make_a_compute_bound_pipeline() -> None:
    model = model_shape("tiny")
    fleet = [_device(2, up=1e12, down=1e12, rtt=0.0, memory=(TINY_LAYER + TINY_HEAD + 64) * 16 + 200_000)]
    got = dtfm_step(model, fleet, 4, 16, "fp32")
    assert got.bound == "compute" and got.pipeline_comm_s == 0.0
    _assert_matches(got, _tiny_expected(4, 16, 2, 1, fleet[0].profile))


# --------------------------------------------------------------------------- DTFM on the presets


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_phones_cannot_hold_llama2_7b(dtype: str) -> None:
    got = dtfm_step(model_shape("llama2-7b"), FLEETS["phones"], 8, 256, dtype)
    assert got.step_s is None and got.bound == "infeasible"
    assert "memory" in got.why and "phone-flagship" in got.why
    # One layer alone: 202,383,360 parameters at 16 bytes is already more than 3 GiB.
    assert got.memory_per_device > 3 * 2**30


def test_no_device_in_the_dtype() -> None:
    fleet = [DeviceClass("cpu", 10, Profile(gflops={"fp32": 100.0}, memory=1 << 34, down=1e7, up=1e6))]
    got = dtfm_step(model_shape("tiny"), fleet, 8, 64, "bf16")
    assert got.step_s is None and "bf16" in got.why


@pytest.mark.parametrize("fleet,model", [("desktop-gpus", "opt-13b"), ("laptops", "llama2-7b"), ("mixed", "opt-13b")])
def test_big_models_pipeline_over_many_stages(fleet: str, model: str) -> None:
    shape = model_shape(model)
    got = dtfm_step(shape, resolve_fleet(fleet, "fp32", 1000), 8, 256, "fp32")
    assert got.step_s is not None and math.isfinite(got.step_s) and got.step_s > 0
    layers = got.stages - got.head_stage - got.embed_stage  # the head and embedding may have stages of their own
    assert got.stages > 1 and shape.n_layers % layers == 0
    assert got.devices_used == got.stages * got.replicas <= 1000
    assert got.replicas <= 8  # never more replicas than sequences
    assert _close(got.step_s, got.compute_s + got.pipeline_comm_s + got.bubble_s + got.allreduce_s)
    assert got.memory_per_device <= max(cls.profile.memory for cls in FLEETS[fleet])
    assert got.bound in ("compute", "pipeline", "allreduce")


def _scaled(fleet: tuple[DeviceClass, ...], *, link: float = 1.0, compute: float = 1.0) -> list[DeviceClass]:
    return [
        DeviceClass(
            cls.name,
            cls.count,
            dataclasses.replace(
                cls.profile,
                up=cls.profile.up * link,
                down=cls.profile.down * link,
                gflops={k: v * compute for k, v in cls.profile.gflops.items()},
            ),
        )
        for cls in fleet
    ]


@pytest.mark.parametrize("model", ["small", "llama2-7b", "opt-13b"])
@pytest.mark.parametrize("fleet", ["laptops", "mixed", "desktop-gpus", "apple-laptops"])
@pytest.mark.parametrize("batch", [8, 64])
def test_faster_links_compute_or_more_devices_never_slow_a_step(model: str, fleet: str, batch: int) -> None:
    shape, classes = model_shape(model), FLEETS[fleet]
    base = dtfm_step(shape, classes, batch, 256, "fp32")
    if base.step_s is None:
        return
    for faster in (_scaled(classes, link=2.0), _scaled(classes, compute=2.0)):
        got = dtfm_step(shape, faster, batch, 256, "fp32")
        assert got.step_s is not None and got.step_s <= base.step_s * (1 + 1e-12)
    more = [DeviceClass(cls.name, cls.count * 2, cls.profile) for cls in classes]
    assert dtfm_step(shape, more, batch, 256, "fp32").step_s <= base.step_s * (1 + 1e-12)


def test_ten_thousand_devices() -> None:
    for model in ("llama2-7b", "opt-13b", "llama2-70b"):
        fleet = resolve_fleet("mixed", "bf16", 10_000)
        assert sum(cls.count for cls in fleet) == 10_000
        got = dtfm_step(model_shape(model), fleet, 8, 256, "bf16")
        assert got.step_s is not None and got.devices_used <= 10_000


def test_accumulation_when_only_fewer_micro_batches_fit() -> None:
    # llama2-70b on 10,000 desktop GPUs at 1,024 sequences: only the 4090s hold a stage, too
    # few for enough replicas to keep a first stage's 1F1B activations in memory.
    got = dtfm_step(model_shape("llama2-70b"), resolve_fleet("desktop-gpus", "fp32", 10_000), 1024, 256, "fp32")
    assert got.step_s is not None
    pace = (got.compute_s + got.pipeline_comm_s) / got.micro_batches
    assert _close(got.bubble_s, got.rounds * (got.stages - 1) * pace)
    assert got.memory_per_device <= 20 * 2**30


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"batch": 0}, "batch"),
        ({"batch": True}, "batch"),
        ({"seq": 0}, "seq"),
        ({"seq": 5000}, "positions"),
        ({"dtype": "fp8"}, "dtype"),
        ({"micro_batch": 0}, "micro_batch"),
        ({"fleet": []}, "no devices"),
        ({"fleet": [_device(0)]}, "no devices"),
    ],
)
def test_dtfm_refuses_bad_arguments(kwargs: dict, message: str) -> None:
    args = {"model": model_shape("tiny"), "fleet": [_device(4)], "batch": 8, "seq": 64, "dtype": "fp32"}
    args.update(kwargs)
    with pytest.raises(CostModelError, match=message):
        dtfm_step(args.pop("model"), args.pop("fleet"), args.pop("batch"), args.pop("seq"), args.pop("dtype"), **args)


def _brute_force(model, fleet: list[DeviceClass], batch: int, seq: int) -> float | None:
    """Every split (the lm head and the embedding each in a stage of its own or not), every number in flight and every
    placement of individual devices on stages, priced with the documented per-device formulas."""
    import itertools

    devices = [cls.profile for cls in fleet for _ in range(cls.count)]
    parts = baselines._parts(model, seq)
    best = None
    divisors = [s for s in range(1, model.n_layers + 1) if model.n_layers % s == 0]
    splits = [(s, h, e) for s in divisors for h in (False, True) for e in (False, True)]
    for layers, head_stage, embed_stage in splits:
        stages = layers + head_stage + embed_stage
        for replicas in range(1, min(batch, len(devices) // stages) + 1):
            micro = math.ceil(batch / replicas)
            roles = baselines._roles(model, parts, layers, replicas, 1, seq, "fp32", head_stage, embed_stage)
            slots = [role for role in roles for _ in range(role.count)]
            act = seq * model.d_model * 4
            full = min(micro, roles[0].depth)
            for in_flight in range(full, 0, -1):
                rounds = 1 if in_flight == full else math.ceil(micro / in_flight)
                for chosen in itertools.permutations(range(len(devices)), len(slots)):
                    pace = reduce = 0.0
                    ok = True
                    for role, d in zip(slots, chosen):
                        p = devices[d]
                        if role.memory(in_flight) > p.memory:
                            ok = False
                            break
                        link = role.sends * act / min(p.up, p.down) + role.sends * p.rtt / 2
                        pace = max(pace, role.flops / (p.gflops["fp32"] * 1e9), link)
                        share = 2 * (replicas - 1) / replicas * role.params * 4
                        reduce = max(reduce, share / min(p.up, p.down) + 2 * (replicas - 1) * p.rtt / 2)
                    if ok:
                        step = (micro + rounds * (stages - 1)) * pace + reduce
                        best = step if best is None else min(best, step)
    return best


@pytest.mark.parametrize("seed", range(60))
def test_assignment_search_matches_brute_force_on_small_fleets(seed: int) -> None:
    import random

    rng = random.Random(seed)
    model = model_shape("tiny")
    stage = (TINY_LAYER + TINY_HEAD + 64) * 16  # weights and state of a one-layer stage
    fleet = []
    for i in range(rng.randint(1, 3)):
        fleet.append(
            _device(
                rng.randint(1, 3 - i),  # at most 6 devices: the brute force tries every placement
                gflops=rng.choice([0.5, 1.0, 4.0]),
                up=rng.choice([1e5, 1e6, 1e7, 1e10]),
                down=rng.choice([1e6, 1e7, 1e10]),
                rtt=rng.choice([0.0, 0.001, 0.05]),
                name=f"c{i}",
                memory=stage + rng.choice([50_000, 100_000, 200_000, 2_000_000, 4_000_000, 4_000_000]),
            )
        )
    batch = rng.randint(1, 4)
    want = _brute_force(model, fleet, batch, 16)
    got = dtfm_step(model, fleet, batch, 16, "fp32")
    if want is None:
        assert got.step_s is None and got.why
    else:
        assert got.step_s is not None and _close(got.step_s, want)


@pytest.mark.parametrize(
    "fleet,batch",
    [
        # Two fast and two slightly slower devices that each hold the model: four replicas of mixed classes.
        (
            [
                _device(2, gflops=4.0, memory=4_000_000, up=1e10, down=1e10, rtt=0.0, name="a"),
                _device(2, gflops=3.0, memory=4_000_000, up=1e10, down=1e10, rtt=0.0, name="b"),
            ],
            4,
        ),
        # Only "big" holds the first stage with the embedding; "small" ones hold a layer alone.
        (
            [
                _device(2, gflops=2.0, memory=4_000_000, up=1e9, down=1e9, rtt=0.001, name="big"),
                _device(
                    3,
                    gflops=4.0,
                    memory=(TINY_LAYER + TINY_HEAD + 64) * 16 + 100_000,
                    up=1e9,
                    down=1e9,
                    rtt=0.001,
                    name="small",
                ),
            ],
            4,
        ),
        # A slow uplink class: best kept out of the all-reduce.
        (
            [
                _device(4, gflops=3.0, memory=4_000_000, up=1e10, down=1e10, rtt=0.0, name="fast-link"),
                _device(2, gflops=8.0, memory=4_000_000, up=1e4, down=1e10, rtt=0.0, name="slow-up"),
            ],
            4,
        ),
    ],
)
def test_heterogeneous_replicas_match_brute_force(fleet: list[DeviceClass], batch: int) -> None:
    model = model_shape("tiny")
    got = dtfm_step(model, fleet, batch, 16, "fp32")
    assert got.step_s is not None and _close(got.step_s, _brute_force(model, fleet, batch, 16))
    # Several replicas, unless the head and embedding in stages of their own beat them (the
    # "big"/"small" fleet: one replica of four stages, every small device holding a piece).
    assert got.replicas > 1 or (got.head_stage and got.embed_stage and got.stages == 4)


def test_the_lm_head_and_the_embedding_get_stages_of_their_own_where_that_fits_smaller_devices() -> None:
    """OPT-13B's first stage (embedding and a layer) needs 8.79 GiB and its last (a layer and the
    lm head) about as much: 8 GB laptops hold neither, but they hold a layer, the embedding alone
    and the head alone, as DT-FM's own planner would place them: 42 stages."""
    laptops = resolve_fleet("laptops", "fp32", 1024)
    got = dtfm_step(model_shape("opt-13b"), laptops, 8, 256, "fp32")
    assert got.step_s is not None and got.head_stage and got.embed_stage
    assert got.stages == model_shape("opt-13b").n_layers + 2
    assert got.memory_per_device <= 8 * 2**30
    parts = baselines._parts(model_shape("opt-13b"), 256)
    glued = baselines._roles(model_shape("opt-13b"), parts, 40, 1, 1, 256, "fp32")
    assert min(r.memory(1) for r in glued if r.name in ("first", "last")) > 8 * 2**30  # as before: no fit
