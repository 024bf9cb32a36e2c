"""Presets: model shapes match their published sizes and our real model, a step's GEMMs obey
6ND, fleets are plausible, and fleet files are read strictly."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from cleave.coordinator.planning.costmodel import CostModelError, DeviceClass, Profile
from cleave.coordinator.planning.tiles import GemmKind
from cleave.coordinator.training.model import PRESETS, Transformer
from cleave.coordinator.whatif.presets import (
    FLEETS,
    MAX_FLEET_FILE,
    MODELS,
    ModelShape,
    fleet_preset,
    load_fleet,
    model_shape,
    parse_fleet,
    resolve_fleet,
    scale_fleet,
    step_gemms,
)

NOMINAL = {
    "opt-1.3b": 1.3e9,
    "opt-6.7b": 6.7e9,
    "opt-13b": 13e9,
    "opt-30b": 30e9,
    "llama2-7b": 6.7e9,
    "llama2-13b": 13e9,
    "llama2-70b": 69e9,
}
# Parameter counts of the Hugging Face checkpoints (sum of numel over the loaded model).
HF_PARAMS = {
    "opt-1.3b": 1_315_758_080,
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
}


# --------------------------------------------------------------------------- models


@pytest.mark.parametrize("name", sorted(NOMINAL))
def test_paper_presets_have_their_nominal_sizes(name: str) -> None:
    assert abs(model_shape(name).params / NOMINAL[name] - 1) < 0.03


@pytest.mark.parametrize("name", sorted(HF_PARAMS))
def test_params_count_exactly_what_the_hf_checkpoints_hold(name: str) -> None:
    assert model_shape(name).params == HF_PARAMS[name]


@pytest.mark.parametrize("name", ["tiny", "small", "base"])
def test_our_presets_count_the_real_models_parameters(name: str) -> None:
    assert model_shape(name).params == Transformer(PRESETS[name]).num_params()


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_our_presets_list_exactly_the_real_models_linears(name: str) -> None:
    real = Counter(
        (m.in_features, m.out_features) for m in Transformer(PRESETS[name]).modules() if isinstance(m, nn.Linear)
    )
    ours = Counter({(lin.in_features, lin.out_features): 0 for lin in model_shape(name).linears()})
    for lin in model_shape(name).linears():
        ours[(lin.in_features, lin.out_features)] += lin.count
    assert ours == real


def test_llama2_70b_projects_keys_and_values_to_eight_heads() -> None:
    lins = {lin.name: lin for lin in model_shape("llama2-70b").linears()}
    assert (lins["k"].in_features, lins["k"].out_features) == (8192, 1024)
    assert (lins["v"].in_features, lins["v"].out_features) == (8192, 1024)
    assert (lins["q"].in_features, lins["q"].out_features) == (8192, 8192)


def test_opt_has_relu_mlp_biases_and_a_tied_head_that_is_still_a_gemm() -> None:
    opt = model_shape("opt-1.3b")
    names = [lin.name for lin in opt.linears()]
    assert names == ["q", "k", "v", "o", "fc1", "fc2", "head"]
    assert opt.linears()[-1].in_features == 2048 and opt.linears()[-1].out_features == 50272
    assert all(lin.bias for lin in opt.linears()[:-1]) and not opt.linears()[-1].bias


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("batch, seq", [(1, 1), (4, 128), (3, 1000)])
def test_step_gemm_flops_are_six_tokens_times_linear_params(name: str, batch: int, seq: int) -> None:
    model = model_shape(name)
    if seq > model.max_seq_len:
        pytest.skip("longer than the model's positions")
    gemms = step_gemms(model, batch, seq)
    assert sum(g.flops for g in gemms) == 6 * batch * seq * model.linear_params()
    assert {g.kind for g in gemms} <= {kind.value for kind in GemmKind}
    assert len(gemms) == 3 * len(model.linears())


def test_step_gemms_have_the_shapes_of_forward_and_both_gradients() -> None:
    fwd, dx, dw = step_gemms(model_shape("tiny"), 2, 8)[:3]  # qkv: 64 -> 192, 16 tokens
    assert (fwd.m, fwd.k, fwd.n, fwd.kind) == (16, 64, 192, "fwd")
    assert (dx.m, dx.k, dx.n, dx.kind) == (16, 192, 64, "dx")
    assert (dw.m, dw.k, dw.n, dw.kind) == (192, 16, 64, "dw")
    assert fwd.count == PRESETS["tiny"].n_layers and fwd.layer == "qkv"


def test_attention_flops_are_full_not_causal_halved() -> None:
    model = model_shape("llama2-7b")
    assert model.attention_flops(2, 4096) == 4.0 * 2 * 4096**2 * 4096 * 32


@pytest.mark.parametrize(
    "batch, seq, message", [(0, 8, "batch"), (1, 0, "seq"), (1, 5000, "exceeds"), (True, 8, "batch")]
)
def test_bad_step_sizes_are_refused(batch: int, seq: int, message: str) -> None:
    with pytest.raises(CostModelError, match=message):
        step_gemms(model_shape("llama2-7b"), batch, seq)


def test_unknown_model_names_the_choices() -> None:
    with pytest.raises(CostModelError, match="unknown model preset 'gpt5'.*opt-1.3b"):
        model_shape("gpt5")


def test_model_shapes_refuse_inconsistent_heads() -> None:
    with pytest.raises(CostModelError, match="heads"):
        ModelShape("x", 100, 2, 3, 3, 400, 256, "relu", 128, "test")
    with pytest.raises(CostModelError, match="mlp"):
        ModelShape("x", 96, 2, 3, 3, 400, 256, "tanh", 128, "test")


# --------------------------------------------------------------------------- fleet presets


@pytest.mark.parametrize("name", sorted(FLEETS))
def test_fleet_presets_are_plausible_in_every_dtype(name: str) -> None:
    assert {"phones", "laptops", "apple-laptops", "desktop-gpus", "mixed"} <= set(FLEETS)
    for dtype in ("fp32", "bf16", "fp16"):
        classes = fleet_preset(name, dtype)
        assert len({c.name for c in classes}) == len(classes) >= 2
        assert sum(c.count for c in classes) == 1000
        for c in classes:
            p = c.profile
            assert p.flops_per_s(dtype) > 0 and p.memory > 0 and p.up > 0 and p.rtt > 0
            assert p.down >= p.up, f"{c.name}: home links download faster than they upload"
            assert 0 < p.session < math.inf


def test_x86_laptops_without_bf16_hardware_are_far_slower_in_bf16() -> None:
    for c in fleet_preset("laptops", "bf16"):
        if c.name != "laptop-zen4":  # AVX512-BF16
            assert c.profile.flops_per_s("bf16") * 20 < c.profile.flops_per_s("fp32")


def test_desktop_gpus_are_faster_in_bf16_than_fp32() -> None:
    for c in fleet_preset("desktop-gpus", "bf16"):
        assert c.profile.flops_per_s("bf16") > 2 * c.profile.flops_per_s("fp32")


def test_unknown_fleet_preset_and_dtype_are_refused() -> None:
    with pytest.raises(CostModelError, match="unknown fleet preset 'cloud'"):
        fleet_preset("cloud", "fp32")
    with pytest.raises(CostModelError, match="unknown dtype 'fp8'"):
        fleet_preset("phones", "fp8")


# --------------------------------------------------------------------------- fleet files

VALID = """
[[class]]
name = "laptop"
count = 1024
gflops = 5000
memory_gb = 8
down_mbps = 1200
up_mbps = 200
rtt_ms = 20
session_hours = 4

[[class]]
name = "gpu"
count = 3
gflops = 40000.5
gflops_fp32 = 20000
memory_gb = 0.5
down_mbps = 100
up_mbps = 100
rtt_ms = 0
reliability = 0.9
"""


def test_a_fleet_file_becomes_the_expected_profiles(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text(VALID)
    laptop, gpu = load_fleet(path, "bf16")
    assert laptop == DeviceClass(
        "laptop",
        1024,
        Profile(
            gflops={"bf16": 5000.0},
            memory=8 * 2**30,
            down=150e6,
            up=25e6,
            rtt=0.02,
            session=4 * 3600.0,
        ),
    )
    assert gpu == DeviceClass(
        "gpu",
        3,
        Profile(
            gflops={"fp32": 20000.0, "bf16": 40000.5},
            memory=2**29,
            down=12.5e6,
            up=12.5e6,
            rtt=0.0,
            session=math.inf,
            reliability=0.9,
        ),
    )


def test_gflops_means_the_training_dtype(tmp_path: Path) -> None:
    (gpu,) = parse_fleet("[[class]]" + VALID.split("[[class]]")[2], "fp16")
    assert dict(gpu.profile.gflops) == {"fp32": 20000.0, "fp16": 40000.5}


def _bad(replace: str, by: str) -> str:
    assert replace in VALID
    return VALID.replace(replace, by, 1)


BAD = [
    (_bad("gflops = 5000\n", "gflops = 5000\ngflop = 3\n"), "#1 'laptop': unknown key 'gflop'"),
    (_bad("memory_gb = 8\n", ""), "#1 'laptop': missing key 'memory_gb'"),
    (_bad('name = "laptop"\n', ""), "#1: missing key 'name'"),
    (_bad("count = 1024", "count = true"), "count must be an integer"),
    (_bad("count = 1024", "count = 10.0"), "count must be an integer"),
    (_bad("count = 1024", "count = -1"), "count must be an integer"),
    (_bad("count = 1024", "count = 10_000_001"), "count must be an integer"),
    (_bad("gflops = 5000", "gflops = true"), "gflops must be a number"),
    (_bad("gflops = 5000", 'gflops = "5000"'), "gflops must be a number"),
    (_bad("gflops = 5000", "gflops = 0"), "gflops must be finite and > 0"),
    (_bad("gflops = 5000", "gflops = nan"), "gflops must be finite"),
    (_bad("up_mbps = 200", "up_mbps = inf"), "up_mbps must be finite"),
    (_bad("down_mbps = 1200", "down_mbps = -5"), "down_mbps must be finite and > 0"),
    (_bad("memory_gb = 8", "memory_gb = 0"), "memory_gb must be finite and > 0"),
    (_bad("rtt_ms = 20", "rtt_ms = -1"), "rtt_ms must be finite and >= 0"),
    (_bad("session_hours = 4", "session_hours = 0"), "session_hours must be finite and > 0"),
    (_bad("reliability = 0.9", "reliability = 1.5"), "#2 'gpu': reliability must be between 0 and 1"),
    (_bad("gflops = 5000\n", ""), "#1 'laptop': no bf16 rate"),
    (_bad("gflops = 5000\n", "gflops = 5000\ngflops_bf16 = 10\n"), "disagree on the bf16 rate"),
    (_bad('name = "gpu"', 'name = "laptop"'), "#2 'laptop': duplicate class name 'laptop'"),
    (_bad('name = "laptop"', 'name = ""'), "name must be 1 to 64 printable"),
    (_bad('name = "laptop"', 'name = "a\\u001b[31m"'), "name must be 1 to 64 printable"),
    (_bad('name = "laptop"', "name = 7"), "#1: name must be"),
    (_bad("count = 1024", "count = 0").replace("count = 3", "count = 0"), "has no devices"),
    ("", "no [[class]] tables"),
    ("# nothing but a comment\n", "no [[class]] tables"),
    ("class = 3\n", "must be an array of tables"),
    ("devices = 3\n" + VALID, "unknown top-level key 'devices'"),
    ("[[class]\nname = 1", "not valid TOML"),
]


@pytest.mark.parametrize("text, message", BAD, ids=[m for _, m in BAD])
def test_bad_fleet_files_are_refused_with_one_line_naming_file_and_class(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(CostModelError) as info:
        load_fleet(path, "bf16")
    assert message in str(info.value)
    assert str(info.value).startswith(f"{path}: ") and "\n" not in str(info.value)


def test_a_huge_file_is_refused_before_parsing(tmp_path: Path) -> None:
    path = tmp_path / "huge.toml"
    path.write_bytes(b"[[class\n" + b"#" * MAX_FLEET_FILE)  # invalid TOML: parsing would say so
    with pytest.raises(CostModelError, match="larger than 1024 KiB"):
        load_fleet(path, "fp32")


def test_missing_and_binary_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(CostModelError, match="cannot read fleet file"):
        load_fleet(tmp_path / "absent.toml", "fp32")
    (tmp_path / "bin.toml").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(CostModelError, match="not UTF-8"):
        load_fleet(tmp_path / "bin.toml", "fp32")


# --------------------------------------------------------------------------- scaling


def _fleet(*counts: int) -> tuple[DeviceClass, ...]:
    profile = FLEETS["phones"][0].profile
    return tuple(DeviceClass(f"c{i}", n, profile) for i, n in enumerate(counts))


def test_scaling_keeps_proportions() -> None:
    scaled = scale_fleet(FLEETS["mixed"], 10_000)
    assert [c.count for c in scaled] == [10 * c.count for c in FLEETS["mixed"]]
    assert [c.count for c in scale_fleet(_fleet(1, 1, 1), 10)] == [4, 3, 3]
    assert [c.count for c in scale_fleet(_fleet(600, 300, 100), 7)] == [4, 2, 1]


def test_scaling_keeps_one_device_per_class_when_there_are_enough() -> None:
    assert [c.count for c in scale_fleet(_fleet(997, 1, 1, 1), 4)] == [1, 1, 1, 1]
    assert [c.count for c in scale_fleet(_fleet(997, 1, 0, 1), 3)] == [1, 1, 0, 1]
    assert sum(c.count for c in scale_fleet(_fleet(997, 1, 1, 1), 2)) == 2


@pytest.mark.parametrize("devices", [0, -3, True, 2.5])
def test_scaling_refuses_a_bad_device_count(devices: int) -> None:
    with pytest.raises(CostModelError, match="--devices"):
        scale_fleet(_fleet(1, 2), devices)


@given(st.lists(st.integers(0, 10_000_000), min_size=1, max_size=12), st.integers(1, 1_000_000))
def test_scaling_sums_exactly_and_stays_near_the_quota(counts: list[int], devices: int) -> None:
    if not sum(counts):
        with pytest.raises(CostModelError):
            scale_fleet(_fleet(*counts), devices)
        return
    scaled = [c.count for c in scale_fleet(_fleet(*counts), devices)]
    assert sum(scaled) == devices and min(scaled) >= 0
    present = [i for i, n in enumerate(counts) if n]
    assert all(scaled[i] == 0 for i, n in enumerate(counts) if not n)
    quota = [devices * n / sum(counts) for n in counts]
    if devices >= len(present):
        assert all(scaled[i] >= 1 for i in present)
        # Each class raised to one device took it from the largest: off by less than their number.
        assert all(abs(scaled[i] - quota[i]) < len(present) for i in present)
    else:
        assert all(abs(scaled[i] - quota[i]) < 1 for i in present)


# --------------------------------------------------------------------------- resolving


def test_resolve_fleet_takes_a_preset_a_path_or_refuses(tmp_path: Path) -> None:
    assert resolve_fleet("laptops", "fp32", None) == FLEETS["laptops"]
    assert sum(c.count for c in resolve_fleet("laptops", "fp32", 77)) == 77
    path = tmp_path / "fleet.toml"
    path.write_text(VALID)
    assert [c.count for c in resolve_fleet(str(path), "bf16", None)] == [1024, 3]
    assert [c.count for c in resolve_fleet(str(path), "bf16", 10)] == [9, 1]
    with pytest.raises(CostModelError, match="unknown fleet 'nonsense'.*phones"):
        resolve_fleet("nonsense", "fp32", None)
    with pytest.raises(CostModelError, match="cannot read fleet file"):
        resolve_fleet(str(tmp_path / "missing.toml"), "fp32", None)
