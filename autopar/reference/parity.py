"""The parity contract as a feature: the parallel run against the single-device run.

``single_device_run`` trains a copy of the model in one process exactly as the
engine does (same loss, same optimizer); ``assert_parity`` compares losses and
every gradient, naming the parameter that differs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn as nn

from autopar.compiler.trace import default_logits

__all__ = ["single_device_run", "assert_parity", "FP32_TOLERANCE"]

# fp32: the parallel run sums the same terms in another order (split matmuls,
# all-reduces), so results differ by a few ulps per reduction, ~1e-6 relative.
FP32_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def single_device_run(
    model: nn.Module,
    batches: list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]],
    loss_fn: Callable,
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
    output_fn: Callable | None = None,
    clip_grad_norm: float | None = None,
    precision: str = "fp32",
    chunks: int = 1,
) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Train a deep copy of ``model`` on ``batches``; return the losses and each step's gradients.

    ``precision='bf16'`` runs the forward under bf16 autocast (fp32 parameters and gradients), as the engine does.
    ``chunks``: each batch cut into that many equal parts along its rows, each part's loss divided by
    ``chunks`` and backpropagated: the engine's mean over its replicas' microbatches (``dp x m`` of
    them) for a loss that is not a token mean, such as one with a mixture of experts' auxiliary losses,
    which are computed per forward.
    """
    model = copy.deepcopy(model)
    model.train()
    output_fn = output_fn or default_logits
    opt = (optimizer or (lambda ps: torch.optim.AdamW(ps, lr=1e-2)))(list(model.parameters()))
    losses, grads = [], []
    for inputs, targets in batches:
        total = 0.0
        for c in range(chunks):
            part = lambda t: t.chunk(chunks)[c] if chunks > 1 else t  # noqa: E731
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss = loss_fn(output_fn(model(*map(part, inputs))), *map(part, targets)) / chunks
            loss.backward()
            total += float(loss.detach())
        if clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
        losses.append(total)
        grads.append({n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
                      for n, p in model.named_parameters(remove_duplicate=False)})
        opt.step()
        opt.zero_grad()
    return losses, grads


def assert_parity(ref_losses: list[float], ref_grads: dict[str, torch.Tensor], losses: list[float],
                  grads: dict[str, torch.Tensor], rtol: float = FP32_TOLERANCE["rtol"],
                  atol: float = FP32_TOLERANCE["atol"], label: str = "", rel_norm: float | None = None) -> None:
    """Losses and every gradient equal within tolerance; the message names what differs.

    With ``rel_norm`` each gradient is compared as a whole, ||g - g_ref|| <=
    rel_norm * ||g_ref|| + atol, instead of element by element: right after an
    Adam step, whose first update is lr * sign(g), a gradient element that is
    zero up to rounding may take either sign, and the next step's gradients
    differ by more than ulps in a few elements while the tensor agrees.
    """
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=atol,
                               msg=lambda m: f"{label} losses {losses} vs single device {ref_losses}: {m}")
    missing = sorted(set(ref_grads) - set(grads))
    if missing:
        raise AssertionError(f"{label} parallel run has no gradient for {missing[:5]}")
    for name, ref in ref_grads.items():
        if rel_norm is not None:
            err, scale = float((grads[name] - ref).norm()), float(ref.norm())
            if err > rel_norm * scale + atol:
                raise AssertionError(f"{label} gradient of {name}: ||diff|| {err:.3g} > {rel_norm:g} * ||ref|| "
                                     f"{scale:.3g} + {atol:g}")
            continue
        torch.testing.assert_close(grads[name], ref, rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"{label} gradient of {name}: {m}")
