"""Cutting one GEMM ``C = A @ B`` into independent tiles, and putting the results back.

Pure math: no I/O, no clock. A tile owns a box ``rows x cols x ks`` of the iteration space;
its inputs are the A block ``A[rows, ks]`` and the B block ``B[ks, cols]`` and its output is
the ``C[rows, cols]`` contribution of that k-range.

* Output-tiled GEMMs (forward ``Y = X W^T`` and ``dX = dY W``) keep the full reduction in
  every tile: each C element is computed by exactly one tile.
* Split-K GEMMs (``dW = dY^T X``, a reduction over all tokens) cut the reduction; the
  coordinator sums the partial blocks in a fixed order, so the result does not depend on
  which device answered first.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from cleave.wire.codes import Name
from cleave.wire.errors import ConfigError


class GemmKind(Name):
    """Which of a linear layer's three GEMMs (``mm``: any other product)."""

    FORWARD = "fwd"  # Y = X W^T: output tiles
    GRAD_INPUT = "dx"  # dX = dY W: output tiles
    GRAD_WEIGHT = "dw"  # dW = dY^T X: split along tokens (k)
    PLAIN = "mm"  # any other product: output tiles

    @property
    def split_k(self) -> bool:
        """Whether its reduction (the tokens) is the dimension cut: dW."""
        return self is GemmKind.GRAD_WEIGHT


@dataclass(frozen=True)
class TilingPolicy:
    """Knobs of the tile planner. The cost model (a later issue) picks these per GEMM."""

    max_edge: int = 512  # largest row/col extent of an output tile
    min_edge: int = 64  # never cut an output dimension below this to make more tiles
    min_k: int = 256  # smallest reduction chunk of a split-K tile
    tiles_per_device: int = 2  # enough tiles that every device can keep its prefetch full
    min_tile_flops: float = 2e6  # below this, one more tile costs more than it saves
    max_partial_elems: int = 4 << 20  # largest dW partial block (16 MiB of float32)

    def __post_init__(self) -> None:
        if self.max_edge < 1:
            raise ConfigError(f"must be at least 1, got {self.max_edge}", field="TilingPolicy.max_edge")
        if not 1 <= self.min_edge <= self.max_edge:
            raise ConfigError(
                f"must be between 1 and max_edge ({self.max_edge}), got {self.min_edge}", field="TilingPolicy.min_edge"
            )
        for name in ("min_k", "tiles_per_device"):
            if getattr(self, name) < 1:
                raise ConfigError(f"must be at least 1, got {getattr(self, name)}", field=f"TilingPolicy.{name}")


@dataclass(frozen=True)
class Tile:
    """One work unit: index ``(i, j, p)`` in the tile grid and its index ranges."""

    index: int
    i: int
    j: int
    p: int
    r0: int
    r1: int
    c0: int
    c1: int
    k0: int
    k1: int
    pieces: int = 1  # consecutive reduction pieces ``p .. p + pieces - 1`` the device sums itself

    @property
    def flops(self) -> int:
        """FLOP of the tile (2 m n k)."""
        return 2 * (self.r1 - self.r0) * (self.c1 - self.c0) * (self.k1 - self.k0)


@dataclass(frozen=True)
class _Cuts:
    """A GEMM's iteration space cut along rows, columns and the reduction."""

    m: int
    n: int
    k: int
    row_cuts: tuple[int, ...]
    col_cuts: tuple[int, ...]
    k_cuts: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, int, int]:
        return len(self.row_cuts) - 1, len(self.col_cuts) - 1, len(self.k_cuts) - 1


@dataclass(frozen=True)
class TilePlan(_Cuts):
    """Every cell of the grid is a tile."""

    @property
    def tiles(self) -> list[Tile]:
        """Every tile of the grid, row by row."""
        out: list[Tile] = []
        for i in range(len(self.row_cuts) - 1):
            for j in range(len(self.col_cuts) - 1):
                for p in range(len(self.k_cuts) - 1):
                    out.append(
                        Tile(
                            len(out),
                            i,
                            j,
                            p,
                            self.row_cuts[i],
                            self.row_cuts[i + 1],
                            self.col_cuts[j],
                            self.col_cuts[j + 1],
                            self.k_cuts[p],
                            self.k_cuts[p + 1],
                        )
                    )
        return out


@dataclass(frozen=True)
class TileList(_Cuts):
    """Tiles that are not one grid: split-K units that each span a run of consecutive pieces
    of ``k_cuts`` (a device adds up its pieces' products and sends one partial). Per output
    cell, the runs partition the pieces, so exactly one of them starts at piece 0."""

    tiles: tuple[Tile, ...] = ()


def piece_tiles(plan: TilePlan | TileList, t: Tile) -> list[Tile]:
    """The one-piece tiles whose products ``t`` adds up (``[t]`` for a one-piece tile)."""
    if t.pieces == 1:
        return [t]
    kc = plan.k_cuts
    return [Tile(t.index, t.i, t.j, q, t.r0, t.r1, t.c0, t.c1, kc[q], kc[q + 1]) for q in range(t.p, t.p + t.pieces)]


def even_cuts(size: int, parts: int) -> tuple[int, ...]:
    """``parts`` near-equal ranges covering ``[0, size)``; never an empty range unless size is 0."""
    parts = max(1, min(parts, size)) if size else 1
    return tuple((size * i) // parts for i in range(parts + 1))


def plan_gemm(m: int, n: int, k: int, kind: GemmKind, devices: int, policy: TilingPolicy) -> TilePlan:
    """Choose the tile grid of an ``(m x k) @ (k x n)`` GEMM for ``devices`` workers.

    Tokens are cut the same way in every GEMM of a Linear layer: the rows of ``Y = X W^T`` and
    ``dX = dY W`` and the reduction of ``dW = dY^T X`` all use ``ceil(tokens / max_edge)`` even
    pieces. A device that computed rows ``i`` of the forward pass (and so holds ``X[i]``) or of
    dX (``dY[i]``) therefore already holds both inputs of the dW tile for token piece ``i``.
    Extra parallelism comes from cutting output columns first, rows only as a last resort.
    """
    if min(m, n, k) < 0:
        raise ValueError(f"negative GEMM shape {(m, n, k)}")
    devices = max(1, devices)
    total_flops = 2.0 * m * n * k
    # Never cut so fine that a tile is below the useful minimum of work.
    flop_cap = max(1, int(total_flops // policy.min_tile_flops)) if total_flops else 1
    want = min(devices * policy.tiles_per_device, flop_cap)
    if kind.split_k:
        # dW (out x in) partials of the whole weight, over token pieces aligned with forward/dX rows;
        # more, smaller pieces only when there are too few tokens to go around.
        gk = max(1, math.ceil(k / policy.max_edge), min(want, k // policy.min_k))
        gr = gc = 1
        while (m / gr) * (n / gc) > policy.max_partial_elems:  # a partial must fit a device
            if m / gr >= n / gc:
                gr += 1
            else:
                gc += 1
        return TilePlan(m, n, k, even_cuts(m, gr), even_cuts(n, gc), even_cuts(k, gk))
    gr = max(1, math.ceil(m / policy.max_edge))
    gc = max(1, math.ceil(n / policy.max_edge))
    while gr * gc < want:
        if n / gc >= 2 * policy.min_edge:
            gc += 1
        elif m / gr >= 2 * policy.min_edge:
            gr += 1
        else:
            break
    return TilePlan(m, n, k, even_cuts(m, gr), even_cuts(n, gc), (0, k))


def a_block(a: torch.Tensor, t: Tile) -> torch.Tensor:
    """The view of ``a`` that tile ``t`` reads."""
    return a[t.r0 : t.r1, t.k0 : t.k1]


def b_block(b: torch.Tensor, t: Tile) -> torch.Tensor:
    """The view of ``b`` that tile ``t`` reads."""
    return b[t.k0 : t.k1, t.c0 : t.c1]


class Layout(Name):
    """How a block travels."""

    PLAIN = "plain"  # already contiguous
    T = "t"  # contiguous once transposed back: blocks of ``W^T`` and ``dY^T``
    COPY = "copy"  # a strided slice, copied
    COPY_T = "copy_t"  # a strided slice whose transpose reads whole rows: copied that way, sent transposed


def wire_layout(block: torch.Tensor) -> Layout:
    """How ``block`` travels (``Layout``)."""
    if block.is_contiguous():
        return Layout.PLAIN
    if block.t().is_contiguous():
        return Layout.T
    # dW's A blocks, dY[k0:k1, r0:r1]^T: a transposing copy is 10x slower than copying the rows
    # of its transpose (a 16 MB block: 56 against 4.4 ms on one thread), which the device reads
    # back transposed as it reads any ``T`` block.
    if block.dim() == 2 and block.stride(0) == 1 and block.shape[0] > 1:
        return Layout.COPY_T
    return Layout.COPY


def assemble(
    plan: TilePlan | TileList, parts: dict[int, torch.Tensor], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Put the tiles' C blocks back together; split-K partials summed in tile order, in float32
    whatever the tiles' dtype (half-precision partial sums would round at every addition), and
    rounded to ``dtype`` once."""
    split = any(t.p for t in plan.tiles)
    work = torch.float32 if split and dtype in (torch.float16, torch.bfloat16) else dtype
    # No zero fill: the p == 0 tiles partition the output, so every element is written first.
    out = torch.empty(plan.m, plan.n, dtype=work)
    for t in plan.tiles:  # fixed order => deterministic sums whatever the arrival order
        block = parts[t.index]
        if t.p == 0:
            out[t.r0 : t.r1, t.c0 : t.c1] = block
        else:
            out[t.r0 : t.r1, t.c0 : t.c1] += block
    return out if work == dtype else out.to(dtype)


def tiled_matmul(a: torch.Tensor, b: torch.Tensor, tiles: Iterable[Tile], plan: TilePlan) -> torch.Tensor:
    """Reference: compute every tile locally and assemble (what the network does, minus the network)."""
    parts = {t.index: a_block(a, t) @ b_block(b, t) for t in tiles}
    return assemble(plan, parts, dtype=torch.result_type(a, b))


def check_operands(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int, int]:
    """``(m, n, k)`` of ``a @ b``; ValueError unless both are 2-D and chain."""
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"GEMM operands must be 2-D, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"GEMM shapes do not chain: {tuple(a.shape)} @ {tuple(b.shape)}")
    return a.shape[0], b.shape[1], a.shape[1]


def covers_exactly(plan: TilePlan, tiles: Sequence[Tile]) -> bool:
    """Invariant used by tests: the tiles partition the (m, n, k) iteration space."""
    volume = sum((t.r1 - t.r0) * (t.c1 - t.c0) * (t.k1 - t.k0) for t in tiles)
    return volume == plan.m * plan.n * plan.k and len({(t.i, t.j, t.p) for t in tiles}) == len(tiles)
