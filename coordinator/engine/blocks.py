"""Input blocks: what travels to devices, under which key, and how long devices keep it.

A block is named by the tensor memory it comes from, not by the GEMM that uses it, so one block
serves every GEMM that reads the same memory. In a Linear layer:

    forward  Y  = X @ W^T     sends X's row pieces          (kept: dW reads them again)
    dX       dX = dY @ W      sends dY's row pieces         (kept: dW reads them again)
    dW       dW = dY^T @ X    reads dY^T and X by token piece: already on the devices

Keys are ``"<source id>.<offset>.<rows>x<cols>"`` for slices that travel as they lie in memory
(as they are, or transposed back), and ``"<source id>.g<gemm>.<operand>"`` for strided slices
that must be copied. The source id is the key's namespace: when a source is dropped, devices
are told to forget the namespace.

A source holds a reference to its storage, so its address cannot be reused by another tensor
while keys derived from it live, and its version counter, so an in-place change (an optimizer
step on a weight) makes a new source rather than a stale cache hit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from cleave.coordinator.planning.tiles import Layout, wire_layout


@dataclass(eq=False)
class Source:
    """A tensor (one storage at one version) whose blocks devices may cache: its id is the namespace of their keys."""

    id: int
    storage: torch.UntypedStorage
    version: int
    users: int = 0  # live GEMMs reading it
    retained: bool = False  # a later GEMM will read it again (X and dY until their dW)


def row_norms(wire: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``||A_i||`` for the rows of ``wire`` (of ``wire.t()`` when ``transposed``), read from the
    contiguous wire tensor: on a transposed view torch's norms run up to 20x slower."""
    if not transposed:
        return torch.linalg.vector_norm(wire, dim=1)
    if wire.dtype in (torch.float32, torch.float64):  # column norms: numpy's einsum streams the
        # rows once without a temporary, 3-4x faster than torch's (w * w).sum(0) here
        w = wire.detach().numpy()
        return torch.from_numpy(np.sqrt(np.einsum("ij,ij->j", w, w)))
    return (wire * wire).sum(0).sqrt()


@dataclass(eq=False)
class BlockRef:
    """One input block of a GEMM: its key, how the tile uses it, and cached facts about it."""

    key: str
    namespace: int
    transposed: bool  # the tile uses ``wire().t()``
    logical: torch.Tensor  # the block as the GEMM reads it (a view of the operand)
    _wire: torch.Tensor | None = field(default=None, repr=False)
    _row_norms: torch.Tensor | None = field(default=None, repr=False)
    _norm: float | None = field(default=None, repr=False)
    _digest: str | None = field(default=None, repr=False)

    def digest(self) -> str:
        """Its content address as it travels (``wire/digest.py``), taken once (a relay's devices
        fetch it by this)."""
        if self._digest is None:
            from cleave.wire.digest import block_digest

            self._digest = block_digest(self.wire())
        return self._digest

    def wire(self) -> torch.Tensor:
        """The contiguous tensor that travels (a copy only for strided slices, made once)."""
        if self._wire is None:
            self._wire = (self.logical.t() if self.transposed else self.logical).contiguous()
        return self._wire

    @property
    def nbytes(self) -> int:
        """Bytes of the block as it travels."""
        return self.logical.numel() * self.logical.element_size()

    def row_norms(self) -> torch.Tensor:
        """``||A_i||`` for every row of the logical block, computed once per block."""
        if self._row_norms is None:
            self._row_norms = row_norms(self.wire(), self.transposed)
        return self._row_norms

    def norm(self) -> float:
        """Frobenius norm (transpose-invariant), computed once per block."""
        if self._norm is None:
            self._norm = float(torch.linalg.vector_norm(self.wire()))
        return self._norm


class Sources:
    """The registry of tensors whose blocks devices may hold."""

    def __init__(self) -> None:
        self._live: dict[tuple[int, int], Source] = {}
        self._next_id = 1

    def __len__(self) -> int:
        return len(self._live)

    def acquire(self, tensor: torch.Tensor, *, retain: bool) -> Source:
        """The source of ``tensor``, registered for a GEMM that reads it (``retain``: kept on devices
        after that GEMM, for a later one that reads it again)."""
        storage = tensor.untyped_storage()
        ident = (storage.data_ptr(), tensor._version)
        src = self._live.get(ident)
        if src is None:
            src = Source(self._next_id, storage, tensor._version)
            self._next_id += 1
            self._live[ident] = src
        src.users += 1
        src.retained = src.retained or retain
        return src

    def release(self, src: Source, *, last_use: bool) -> bool:
        """One GEMM is done with ``src``; returns True when the source is dropped."""
        src.users -= 1
        if last_use:
            src.retained = False
        if src.users <= 0 and not src.retained:
            self._live.pop((src.storage.data_ptr(), src.version), None)
            return True
        return False

    def sweep(self) -> list[int]:
        """Drop every source no GEMM is reading (a step ended); returns their ids."""
        dead = [ident for ident, src in self._live.items() if src.users <= 0]
        return [self._live.pop(ident).id for ident in dead]


def block_ref(src: Source, gemm_id: int, operand: str, logical: torch.Tensor) -> BlockRef:
    """Name ``logical`` (a slice of ``src``'s memory) and decide how it travels."""
    layout = wire_layout(logical)
    if layout in (Layout.COPY, Layout.COPY_T):  # copied when it first travels (``wire``)
        return BlockRef(f"{src.id}.g{gemm_id}.{operand}", src.id, layout is Layout.COPY_T, logical)
    wire = logical.t() if layout is Layout.T else logical
    rows, cols = wire.shape
    key = f"{src.id}.{wire.storage_offset()}.{rows}x{cols}"
    return BlockRef(key, src.id, layout is Layout.T, logical, _wire=wire)
