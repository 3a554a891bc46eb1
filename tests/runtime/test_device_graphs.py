"""Chunk graphs make their tensors on the engine's device, not on the device they were traced on."""

import torch
from helpers import tiny_gpt_program

from autopar.runtime.engine.device_graphs import foreign_devices, on_device


def test_factory_ops_follow_the_engine_device_on_a_copy():
    program = tiny_gpt_program(tp=2, pp=2, world_size=4, recompute="layer")
    first = program.split.chunks[0].module
    cpu, meta = torch.device("cpu"), torch.device("meta")
    traced_on_cpu = foreign_devices(first, meta)
    assert traced_on_cpu  # the position ids' arange was traced with device=cpu
    assert on_device(first, cpu) is first  # nothing to change: the compiled module itself
    moved = on_device(first, meta)
    assert moved is not first and foreign_devices(moved, meta) == []
    assert foreign_devices(first, meta) == traced_on_cpu  # the program is left as compiled
    code = "".join(gm.code for gm in moved.modules() if isinstance(gm, torch.fx.GraphModule))
    assert "device(type='meta')" in code and "device(type='cpu')" not in code
