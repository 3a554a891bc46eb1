"""The memory model against the runtime: predicted bytes per rank within 10% of what a training step holds.

Two reference GPTs of different shapes run on 4 gloo ranks (fp32, the runtime's CPU precision)
at layouts varying t, p, d, v, the micro-batch, the schedule, recomputation and the
distributed optimizer (and sequence parallelism when ``autopar.parallelize`` takes it). Each
rank measures, after one step and one optimizer step:

- parameters: bytes of its local shards;
- gradients: bytes of its parameters' ``.grad``, plus the distributed optimizer's reduced shards;
- optimizer state: the optimizer's state tensors (AdamW's m and v; the distributed optimizer's
  inner state over its 1/d range and its fp32 master copies);
- peak kept activations: the bytes autograd keeps for the pending backwards, counted by storage
  (a tensor saved by three ops counts once; the inputs a checkpointed region keeps are saved
  through the same hooks), plus the chunks' outputs held for their backward, summed over the
  chunk-microbatches in flight, at its peak.

The prediction is ``planning.cost.memory.stage_memory`` for the rank's stage, with a ``ModelSpec`` read
from the traced model (``compiler.model_spec.spec_from_model``), the layout from the program's
config (``Layout.from_config``) and the byte sizes the runtime uses
(``precision.runtime_precision``). 10%: the model counts tensors by the layer's structure and
leaves out what is small against them (biases' gradients in flight, the scalar loss, the
attention mask), and pipelined in-flight counts are the schedule's bound.
"""

import dataclasses
import functools
import inspect

import pytest
import torch
from helpers import compiled, spawn_ranks

import autopar
from autopar.compiler.model_spec import spec_from_model
from autopar.planning.cost.layout import Layout
from autopar.planning.cost.memory import Memory, stage_memory
from autopar.planning.cost.models import ModelSpec
from autopar.planning.cost.precision import runtime_precision
from autopar.reference.models import build
from autopar.schedules import in_flight_bound

pytestmark = pytest.mark.multiprocess
WORLD, TOLERANCE = 4, 0.10
SHAPES = {
    "gpt-a": dict(vocab_size=320, seq_len=32, n_layer=4, n_head=4, d_model=64),
    "gpt-b": dict(vocab_size=384, seq_len=48, n_layer=4, n_head=4, d_model=96, d_ff=192),
}
LAYOUTS = [  # (model, micro-batch, parallelize keywords, distributed optimizer)
    ("gpt-a", 2, dict(dp=4, microbatches=2), False),
    ("gpt-a", 2, dict(dp=4, microbatches=2), True),
    ("gpt-a", 2, dict(tp=2, dp=2, microbatches=2), True),
    ("gpt-a", 2, dict(tp=2, pp=2, microbatches=4), False),
    ("gpt-a", 1, dict(pp=2, dp=2, virtual_stages=2, schedule="interleaved", microbatches=4, recompute="layer"),
     True),
    ("gpt-b", 2, dict(tp=4, microbatches=2, recompute="layer"), False),
    ("gpt-b", 1, dict(pp=4, microbatches=4), False),
    ("gpt-b", 4, dict(tp=2, dp=2, microbatches=1), True),
    ("gpt-b", 2, dict(pp=2, dp=2, schedule="gpipe", microbatches=3), False),
]
if "sequence_parallel" in inspect.signature(autopar.parallelize).parameters:
    LAYOUTS += [
        ("gpt-a", 2, dict(tp=2, dp=2, microbatches=2, sequence_parallel=True), True),
        ("gpt-b", 2, dict(tp=4, microbatches=2, sequence_parallel=True, recompute="layer"), False),
    ]


def _gpt_of_shape(name: str):
    torch.manual_seed(0)
    return build("gpt", **SHAPES[name])


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _example(name: str, b: int) -> tuple[torch.Generator, torch.Tensor]:
    """The generator the measurement draws from and its first draw: ``b`` sequences (inputs and shifted targets)."""
    gen = torch.Generator().manual_seed(1)
    return gen, torch.randint(0, SHAPES[name]["vocab_size"], (b, SHAPES[name]["seq_len"] + 1), generator=gen)


def _predicted_program(index: int) -> autopar.ParallelProgram:
    """``LAYOUTS[index]`` compiled for the 4 ranks (once per process: the ranks inherit the test process's)."""
    name, b, config, _ = LAYOUTS[index]
    _, example = _example(name, b)
    return compiled(_gpt_of_shape(name), example_inputs=(example[:, :-1],), example_targets=example[:, 1:],
                    world_size=WORLD, **config)


def _measure(index: int) -> dict:
    name, b, config, distributed = LAYOUTS[index]
    vocab, seq = SHAPES[name]["vocab_size"], SHAPES[name]["seq_len"]
    gen, _ = _example(name, b)
    program = _predicted_program(index)
    engine = program.materialize()
    if distributed:
        optimizer = engine.distributed_optimizer(torch.optim.AdamW, lr=1e-3)
    else:
        optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-3)
    rows = b * program.microbatches * engine.dp_size
    tokens = torch.randint(0, vocab, (rows, seq + 1), generator=gen)
    engine.train_step(tokens[:, :-1], tokens[:, 1:])
    params = list(engine.parameters())
    grads = _nbytes(p.grad for p in params if p.grad is not None)
    optimizer.step()
    if distributed:
        grads += _nbytes(bucket.grad for bucket in optimizer.buckets)
        # a master that is the parameters' own storage (fp32 weights: masters_shared) is not a second copy
        state = optimizer.state_bytes() + _nbytes(bucket.master for bucket in optimizer.buckets
                                                  if not bucket.masters_shared)
    else:
        state = _nbytes(t for s in optimizer.state.values() for t in s.values()
                        if isinstance(t, torch.Tensor) and t.dim() > 0)
    return {"stage": engine.stage, "params": _nbytes(params), "grads": grads, "optimizer": state,
            "kept": engine.stats["peak_activation_bytes"]}


def _all_layouts() -> list[dict]:
    return [_measure(index) for index in range(len(LAYOUTS))]


@functools.lru_cache(maxsize=None)
def _layout(index: int) -> tuple[ModelSpec, Layout, int]:
    """The layout ``LAYOUTS[index]`` as the planner sees it: the model's spec read from its traced
    graph, the ``Layout`` of the program's config in the runtime's byte sizes, the microbatches."""
    name, b, config, distributed = LAYOUTS[index]
    model = _gpt_of_shape(name)
    example = torch.zeros(b, SHAPES[name]["seq_len"], dtype=torch.long)
    spec = spec_from_model(model, (example,), name=name)
    program = _predicted_program(index)  # the program the ranks measure
    cfg = program.config
    lay = Layout.from_config(cfg, b, precision=runtime_precision(cfg.precision))
    # sequence parallelism as the compiler decided it (on by default where it fits)
    lay = dataclasses.replace(lay, distributed_optimizer=distributed, sequence_parallel=program.sequence is not None)
    return spec, lay, cfg.microbatches


def _predict(index: int, stage: int) -> Memory:
    spec, lay, m = _layout(index)
    return stage_memory(spec, lay, stage, in_flight_bound(lay.schedule, lay.p, lay.v, m, stage))


@pytest.fixture(scope="module")
def measured() -> list[list[dict]]:
    for index in range(len(LAYOUTS)):  # compile once here (the planner's view reads it too): the ranks inherit it
        _layout(index)
    return spawn_ranks(_all_layouts, WORLD)


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=lambda i: f"{LAYOUTS[i][0]}-{LAYOUTS[i][2]}"
                         + ("-distopt" if LAYOUTS[i][3] else ""))
def test_predicted_memory_per_rank_within_10_percent(measured, index):
    name, b, config, distributed = LAYOUTS[index]
    for rank, per_layout in enumerate(measured):
        got = per_layout[index]
        want = stage_memory_fields(_predict(index, got["stage"]))
        for key, value in want.items():
            assert abs(value - got[key]) <= TOLERANCE * got[key], (
                f"{name} {config} distopt={distributed} rank {rank} stage {got['stage']}: {key} predicted "
                f"{value:,.0f} B, measured {got[key]:,} B ({value / got[key] - 1:+.1%})")


def stage_memory_fields(mem: Memory) -> dict[str, float]:
    """The predicted parts the runtime measures, by the measurement's names."""
    return {"params": mem.weights, "grads": mem.grads, "optimizer": mem.optimizer, "kept": mem.kept}
