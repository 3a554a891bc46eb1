"""``autopar::grouped_mm``: the grouped matmul of the reference mixture-of-experts model, on any device.

A mixture-of-experts layer sorts its (token, slot) rows by expert and multiplies
each expert's run of rows by that expert's weights: rows x (S, K), stacked
weights w (E, K, N), ``offs`` (E,) the cumulative rows per expert.
``torch._grouped_mm`` does that, but not on CPU in torch 2.13: it needs
16-byte-aligned strides ("strides should be multiple of 16 bytes" otherwise),
leaves the rows past ``offs[-1]`` uninitialised, and its backward fails
("Invalid strides/sizes"). This one is a loop over the groups, registered as a
``torch.library`` custom op with

- a fake implementation (shapes for tracing: autopar's export sees one op),
- its autograd, the backward another custom op (``autopar::grouped_mm_backward``),
  so that a traced backward keeps it whole too,
- bf16 autocast like an aten matmul (both operands cast under autocast).

Rows past ``offs[-1]`` are zeros in the output and in the input's gradient, the
contract expert parallelism relies on (its all-gather dispatcher puts the rows
of other ranks' experts behind the offsets). autopar finds it by name
(``passes/rules/matmul.py GROUPED_MM_OPS``).
"""

from __future__ import annotations

import torch

from autopar.core.errors import AutoparError

__all__ = ["grouped_mm", "GroupedMatmulError"]


class GroupedMatmulError(AutoparError, ValueError):
    """Operands of ``autopar::grouped_mm`` that do not fit together; the message gives the shapes."""


def _check(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> None:
    if x.dim() != 2 or w.dim() != 3 or offs.dim() != 1:
        raise GroupedMatmulError(f"autopar::grouped_mm multiplies rows x (S, K) by stacked weights w (E, K, N) with "
                                 f"offsets (E,); got x {tuple(x.shape)}, w {tuple(w.shape)}, offs {tuple(offs.shape)}")
    if x.shape[1] != w.shape[1] or offs.shape[0] != w.shape[0]:
        raise GroupedMatmulError(f"autopar::grouped_mm: x (S, K) = {tuple(x.shape)}, w (E, K, N) = {tuple(w.shape)}, "
                                 f"offs (E,) = {tuple(offs.shape)}: K and E must agree")
    if offs.dtype not in (torch.int32, torch.int64):
        raise GroupedMatmulError(f"autopar::grouped_mm: offs must be int32 or int64 cumulative row counts, got "
                                 f"{offs.dtype}")
    if x.dtype != w.dtype:
        raise GroupedMatmulError(f"autopar::grouped_mm: x is {x.dtype} and w {w.dtype}; cast one (under autocast "
                                 f"both are cast to the autocast dtype)")


def _bounds(offs: torch.Tensor, rows: int) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of each non-empty group; one host copy of the offsets."""
    out, start = [], 0
    for e, end in enumerate(offs.tolist()):
        end = min(int(end), rows)
        if end > start:
            out.append((e, start, end))
        start = max(start, end)
    return out


@torch.library.custom_op("autopar::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows ``x`` (S, K) sorted by group, times ``w[e]`` (K, N) for group e's rows
    ``offs[e-1]:offs[e]`` (``offs`` the cumulative rows per group, (E,)): (S, N), zeros past ``offs[-1]``."""
    _check(x, w, offs)
    out = x.new_zeros(x.shape[0], w.shape[2])
    for e, start, end in _bounds(offs, x.shape[0]):
        torch.mm(x[start:end], w[e], out=out[start:end])
    return out


@grouped_mm.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    _check(x, w, offs)
    return x.new_empty(x.shape[0], w.shape[2])


@torch.library.custom_op("autopar::grouped_mm_backward", mutates_args=())
def _grouped_mm_backward(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
                         grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw) of ``grouped_mm``: dx zeros past ``offs[-1]``, dw zeros for an expert with no rows."""
    dx, dw = torch.zeros_like(x), torch.zeros_like(w)
    for e, start, end in _bounds(offs, x.shape[0]):
        torch.mm(grad[start:end], w[e].T, out=dx[start:end])
        torch.mm(x[start:end].T, grad[start:end], out=dw[e])
    return dx, dw


@_grouped_mm_backward.register_fake
def _(x, w, offs, grad):
    return torch.empty_like(x), torch.empty_like(w)


def _setup(ctx, inputs, output):
    x, w, offs = inputs
    ctx.save_for_backward(x, w, offs)


def _backward(ctx, grad):
    x, w, offs = ctx.saved_tensors
    dx, dw = torch.ops.autopar.grouped_mm_backward(x, w, offs, grad.contiguous())
    return dx, dw, None


grouped_mm.register_autograd(_backward, setup_context=_setup)
for _device in ("cpu", "cuda"):  # like an aten matmul: under autocast both operands in the autocast dtype
    torch.library.register_autocast("autopar::grouped_mm", _device, torch.bfloat16)
