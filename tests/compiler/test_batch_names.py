"""The batch tensors' names: the forward's and the loss's parameter names, unless a graph would rename them.

``nn.Linear`` and ``nn.Sequential`` name their argument ``input``, a Python
builtin: a graph made anew from the traced one (each pipeline chunk) renames
such a placeholder (``input_1``), where the batch would no longer find it. The
name becomes ``input_``; the model trains.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar


def test_a_forward_argument_named_like_a_builtin_still_reaches_its_chunk():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    program = autopar.parallelize(model, example_inputs=(x,), example_targets=y, loss_fn=F.mse_loss)
    assert program.traced.input_names == ["input_"] and program.traced.target_names == ["target"]
    loss = program.materialize().train_step(x, y)
    assert abs(loss - float(F.mse_loss(model(x), y).detach())) < 1e-6
