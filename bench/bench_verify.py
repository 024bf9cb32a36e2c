"""Benchmark: the cost of Freivalds' check against the GEMM it verifies, old check against new.

Run from the repository root::

    .venv/bin/python bench/bench_verify.py                 # tables on stdout (about a minute on 2 cores)
    .venv/bin/python bench/bench_verify.py --json          # one JSON object on stdout
    .venv/bin/python bench/bench_verify.py --repeats 31 --no-generators

Everything runs on one torch thread, in one process. For each tile shape, these are timed in
turn (interleaved, so that all see the same machine load) and their medians compared:

* **GEMM**: ``a @ b``, operands laid out as the trainer passes them (a dW tile's ``a`` is a
  transposed view of ``dY``);
* **old**: the check as first landed: one +-1 (Rademacher) vector, norms computed per call;
* **new**: ``wire.verify.freivalds`` with its defaults (``ROUNDS`` uniform vectors),
  norms computed per call;
* **old, shared norms** and **new, shared norms**: the same with ``a_row_norms`` and ``b_norm``
  passed in, as the coordinator does (it computes them once per block and shares them between
  tiles), so only ``||C_i||`` is computed per call;
* its parts: drawing R (``n x ROUNDS``), the norms (``||A_i||``, ``||B||_F``, ``||C_i||``) and
  the products ``max_j |A (B R) - C R|``.

A batched table (``freivalds_batch``) checks a device's share of a GEMM, ``rows`` row bands
of A times ``cols`` column blocks of B, tile by tile with ``freivalds`` and then as one batch, and
prints the GEMM rate each reaches (the check's FLOP over its seconds): what the simulator's
``PSProfile.check_rate`` prices. A last table (skip it with ``--no-generators``) times the
candidate generators of R for ``n`` up to 4096 and up to 16 columns. Ratios are what to compare; absolute times drift.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: 2 cores shared with other processes

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from timing import interleaved_medians

from cleave.wire.verify import (
    ROUNDS,
    Product,
    _row_norms,
    freivalds,
    freivalds_batch,
    rademacher,
    random_vectors,
)


@dataclass(frozen=True)
class Shape:
    name: str
    m: int
    k: int
    n: int
    dw: bool = False  # a is a transposed view (dW = dY^T X), as the trainer passes it

    def operands(self, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.randn(self.k, self.m, generator=gen).t() if self.dw else torch.randn(self.m, self.k, generator=gen)
        return a, torch.randn(self.k, self.n, generator=gen)


SHAPES = [
    Shape("512x512 @ 512x512", 512, 512, 512),
    Shape("512x2048 @ 2048x512", 512, 2048, 512),
    Shape("dW partial 256x512 @ 512x1024", 256, 512, 1024, dw=True),
    Shape("64x4096 @ 4096x64", 64, 4096, 64),
    Shape("2048x768 @ 768x3072", 2048, 768, 3072),
]


def old_check(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    rng: np.random.Generator,
    a_row_norms: torch.Tensor | None = None,
    b_norm: float | None = None,
) -> bool:
    """The check as first landed (one +-1 vector, TOL_FACTOR 16), for its cost only: it is unsound."""
    eps = torch.finfo(torch.float32).eps
    row_norms = _row_norms(a) if a_row_norms is None else a_row_norms
    ab = row_norms * (float(torch.linalg.vector_norm(b)) if b_norm is None else b_norm)
    c_norms = torch.minimum(torch.linalg.vector_norm(c, dim=1), ab)
    tol = 16.0 * eps * (ab + math.sqrt(b.shape[1]) * c_norms) + torch.finfo(torch.float32).tiny
    r = rademacher(b.shape[1], rng, a.dtype)
    return float(((a @ (b @ r) - c @ r).abs() / tol).max()) <= 1.0


@dataclass
class ShapeTiming:
    shape: str
    gemm_s: float
    old_s: float
    new_s: float
    old_shared_norms_s: float
    new_shared_norms_s: float
    draw_s: float  # R, n x ROUNDS
    norms_s: float  # ||A_i||, ||B||_F, ||C_i||
    products_s: float  # max_j |A(BR) - CR|


def time_shape(shape: Shape, repeats: int, rng: np.random.Generator, gen: torch.Generator) -> ShapeTiming:
    a, b = shape.operands(gen)
    c = a @ b
    a_norms, b_norm = _row_norms(a), float(torch.linalg.vector_norm(b))
    r = random_vectors(shape.n, ROUNDS, rng)
    if not (freivalds(a, b, c, rng).ok and old_check(a, b, c, rng)):
        raise RuntimeError(f"an honest {shape.name} product failed the check")
    fns: list[Callable[[], object]] = [
        lambda: a @ b,
        lambda: old_check(a, b, c, rng),
        lambda: freivalds(a, b, c, rng),
        lambda: old_check(a, b, c, rng, a_norms, b_norm),
        lambda: freivalds(a, b, c, rng, a_row_norms=a_norms, b_norm=b_norm),
        lambda: random_vectors(shape.n, ROUNDS, rng),
        lambda: (_row_norms(a), torch.linalg.vector_norm(b), _row_norms(c)),
        lambda: (a @ (b @ r) - c @ r).abs().amax(dim=1),
    ]
    return ShapeTiming(shape.name, *interleaved_medians(fns, repeats))


@dataclass(frozen=True)
class Share:
    """A device's share of one GEMM: ``rows`` x ``cols`` tiles of ``m x k @ k x n``."""

    name: str
    rows: int
    cols: int
    m: int
    k: int
    n: int


SHARES = [
    Share("1 x 1 of 512x4096 @ 4096x512", 1, 1, 512, 4096, 512),
    Share("1 x 8 of 512x4096 @ 4096x512", 1, 8, 512, 4096, 512),
    Share("2 x 4 of 512x4096 @ 4096x512", 2, 4, 512, 4096, 512),
    Share("2 x 4 of 256x11008 @ 11008x256", 2, 4, 256, 11008, 256),
    Share("4 x 4 of 256x1024 @ 1024x256", 4, 4, 256, 1024, 256),
]


@dataclass(frozen=True)
class ShareTiming:
    name: str
    tiles: int
    one_by_one_s: float  # freivalds per tile, norms shared as the coordinator shares them
    batched_s: float  # freivalds_batch over the share
    speedup: float
    one_by_one_gflops: float  # check FLOP (per tile: A(BR), BR, CR) over seconds
    batched_gflops: float


def time_share(share: Share, repeats: int, rng: np.random.Generator, gen: torch.Generator) -> ShareTiming:
    a_blocks = [torch.randn(share.m, share.k, generator=gen) for _ in range(share.rows)]
    b_blocks = [torch.randn(share.k, share.n, generator=gen) for _ in range(share.cols)]
    a_norms = [_row_norms(a) for a in a_blocks]
    b_norms = [float(torch.linalg.vector_norm(b)) for b in b_blocks]
    products = [
        Product(a, b, a @ b, a_key=i, b_key=j, a_row_norms=a_norms[i], b_norm=b_norms[j])
        for i, a in enumerate(a_blocks)
        for j, b in enumerate(b_blocks)
    ]
    if not all(v.ok for v in freivalds_batch(products, rng)):
        raise RuntimeError(f"an honest tile of {share.name} failed the batched check")

    def one_by_one() -> None:
        for p in products:
            freivalds(p.a, p.b, p.c, rng, a_row_norms=p.a_row_norms, b_norm=p.b_norm)

    single, batched = interleaved_medians([one_by_one, lambda: freivalds_batch(products, rng)], repeats)
    flops = 2.0 * ROUNDS * len(products) * (share.m * share.k + share.k * share.n + share.m * share.n)
    rates = (flops / single / 1e9, flops / batched / 1e9)
    return ShareTiming(share.name, len(products), single, batched, single / batched, *rates)


GENERATORS: dict[str, Callable[[int, int, np.random.Generator, torch.Generator], object]] = {
    "numpy uniform f32 (used)": lambda n, t, rng, g: random_vectors(n, t, rng),
    "numpy normal f32": lambda n, t, rng, g: torch.from_numpy(rng.standard_normal((n, t), dtype=np.float32)),
    "torch.rand": lambda n, t, rng, g: torch.rand(n, t, generator=g),
    "torch.randn": lambda n, t, rng, g: torch.randn(n, t, generator=g),
    "numpy +-1 (old)": lambda n, t, rng, g: torch.from_numpy(rng.integers(0, 2, (n, t), dtype=np.int8) * 2 - 1).float(),
}
GEN_SIZES = [(512, 1), (512, 16), (1024, 16), (2048, 16), (4096, 8), (4096, 16)]


def time_generators(repeats: int, rng: np.random.Generator, gen: torch.Generator) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for n, t in GEN_SIZES:
        fns = [lambda f=f: f(n, t, rng, gen) for f in GENERATORS.values()]  # noqa: B023 - timed here
        medians = interleaved_medians(fns, repeats * 10)
        out[f"{n}x{t}"] = dict(zip(GENERATORS, medians))
    return out


def render_shares(timings: list[ShareTiming], console: Console) -> None:
    table = Table(title=f"Batched checks (freivalds_batch, {ROUNDS} columns a tile): one device's share of a GEMM")
    for col in ("share", "tiles", "one by one", "batched", "speedup", "GFLOP/s one by one", "GFLOP/s batched"):
        table.add_column(col, justify="left" if col == "share" else "right")
    for t in timings:
        table.add_row(
            t.name,
            str(t.tiles),
            _ms(t.one_by_one_s),
            _ms(t.batched_s),
            f"{t.speedup:.2f}x",
            f"{t.one_by_one_gflops:.1f}",
            f"{t.batched_gflops:.1f}",
        )
    console.print(table)


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s < 0.01 else f"{s * 1e3:.2f} ms"


def render(timings: list[ShapeTiming], generators: dict[str, dict[str, float]] | None, console: Console) -> None:
    table = Table(
        title=f"Freivalds' check vs the GEMM, 1 thread, medians (new: {ROUNDS} uniform vectors)", title_justify="left"
    )
    for name in (
        "tile",
        "GEMM",
        "old",
        "new",
        "new/old",
        "old, shared",
        "new, shared",
        "new/old",
        "R",
        "norms",
        "products",
    ):
        table.add_column(name, justify="left" if name == "tile" else "right")
    for t in timings:
        table.add_row(
            t.shape,
            _ms(t.gemm_s),
            f"{_ms(t.old_s)}\n{t.old_s / t.gemm_s:.1%}",
            f"{_ms(t.new_s)}\n{t.new_s / t.gemm_s:.1%}",
            f"{t.new_s / t.old_s:.2f}x",
            f"{_ms(t.old_shared_norms_s)}\n{t.old_shared_norms_s / t.gemm_s:.1%}",
            f"{_ms(t.new_shared_norms_s)}\n{t.new_shared_norms_s / t.gemm_s:.1%}",
            f"{t.new_shared_norms_s / t.old_shared_norms_s:.2f}x",
            f"{t.draw_s / t.new_s:.0%}",
            f"{t.norms_s / t.new_s:.0%}",
            f"{t.products_s / t.new_s:.0%}",
        )
    console.print(table)
    console.print(
        "old: 1 +-1 vector; new: freivalds(). Second lines: share of the GEMM's time. \"shared\": A's row "
        "norms and ||B|| passed in, as the coordinator does. R, norms, products: share of the new check "
        "(norms computed per call).",
        style="dim",
    )
    if generators:
        gtable = Table(title="Drawing R (n x t), 1 thread, medians in microseconds", title_justify="left")
        gtable.add_column("generator")
        for size in generators:
            gtable.add_column(size, justify="right")
        for name in GENERATORS:
            gtable.add_row(name, *(f"{generators[size][name] * 1e6:.1f}" for size in generators))
        console.print(gtable)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--repeats", type=int, default=15, help="timed repeats per shape (default: 15)")
    p.add_argument("--no-generators", action="store_true", help="skip the table of generators of R")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout instead of tables")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    torch.set_num_threads(1)
    rng, gen = np.random.default_rng(), torch.Generator().manual_seed(0)
    timings = [time_shape(s, args.repeats, rng, gen) for s in SHAPES]
    shares = [time_share(s, max(3, args.repeats // 3), rng, gen) for s in SHARES]
    generators = None if args.no_generators else time_generators(args.repeats, rng, gen)
    if args.json:
        shapes = [asdict(t) for t in timings]
        batched = [asdict(t) for t in shares]
        print(json.dumps({"rounds": ROUNDS, "shapes": shapes, "batched": batched, "generators_s": generators}))
    else:
        console = Console(width=160)
        render(timings, generators, console)
        render_shares(shares, console)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
