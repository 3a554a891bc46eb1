"""Plain helpers the tests share (``conftest.py`` builds its fixtures on them): the parity pattern below,
a tiny compiled program, bitwise state comparison, and checkpoints written as the checkpoint contract lays
them out.

A parity test follows one pattern: a seeded model and a few global batches of
token ids; in every rank of one ``autopar.spawn``, the model compiled for a
layout (the first microbatch as the example), trained, and its losses and full
gradients returned; in the test process, the same model trained on one device
and every rank compared with it, gradient by parameter name.

The model families themselves live in ``families.py``.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from families import SEQ, assert_steps_match, batches
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import autopar
from autopar.reference.models import build
from autopar.reference.parity import single_device_run

__all__ = ["seeded", "token_batches", "parallelize_on", "compiled", "tiny_gpt_program", "reference_run",
           "spawn_ranks", "layout_world", "layout_chunks", "assert_ranks_match", "assert_same_grads",
           "assert_bitwise_equal", "meta_model_from", "write_contract_checkpoint", "dcp_tensors", "calls_into_dist"]

Batches = list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]


def seeded(factory: Callable, *args, seed: int = 0, **kwargs):
    """``factory(*args, **kwargs)`` right after ``torch.manual_seed(seed)``: the same weights in every process."""
    torch.manual_seed(seed)
    return factory(*args, **kwargs)


def token_batches(vocab: int, steps: int, rows: int, seed: int, seq: int = SEQ) -> Batches:
    """``steps`` global batches of ``rows`` random sequences of ``seq`` token ids (``families.batches``)."""
    return batches(vocab, steps, seed, rows, seq)


_COMPILED: dict[tuple, tuple[autopar.ParallelProgram, torch.Tensor]] = {}
"""What ``compiled`` compiled in this process during the current test (``conftest`` empties it after each):
by ``_compile_key``, the program and the random state right after its compile."""


def parallelize_on(model, data: Batches, rows: int, **config) -> autopar.ParallelProgram:
    """``compiled(model, **config)`` with the first ``rows`` sequences of ``data``'s first batch as the example
    microbatch (``rows`` = global rows / (dp * microbatches))."""
    inputs, targets = data[0]
    return compiled(model, example_inputs=tuple(x[:rows] for x in inputs),
                    example_targets=tuple(y[:rows] for y in targets), **config)


def compiled(model: nn.Module, **config) -> autopar.ParallelProgram:
    """``autopar.parallelize(model, **config)``, compiled once per test for all its ranks.

    Every compile is kept for the rest of the test. In a rank (a process
    group is up), a call with the same model (class, structure and every
    weight's bytes) and the same config (example tensors by content, the rest
    by repr) as one kept, for this world size, returns that program and
    leaves torch's random state as its compile left it. Ranks forked by ``spawn_ranks`` inherit what the
    test compiled before the spawn: a test that compiles its layouts first
    ("compile once here") spares every rank the compile. The test process
    itself compiles afresh on every call (a test may change the compiler
    between two calls).
    """
    key = _compile_key(model, config)
    kept = _COMPILED.get(key) if dist.is_initialized() else None
    # a config that leaves dp to the world compiles for one rank outside the ranks: not theirs
    if kept is not None and kept[0].config.mesh.world == dist.get_world_size():
        program, rng = kept
        torch.set_rng_state(rng)
        return program
    program = autopar.parallelize(model, **config)
    _COMPILED[key] = program, torch.get_rng_state()
    return program


def _compile_key(model: nn.Module, config: dict) -> tuple:
    """What determines a compiled program: the model's structure (its repr, and every module's class and
    public attributes), the bytes of each parameter and buffer, and the config, tensors in it by content."""
    def content(value):
        if isinstance(value, torch.Tensor):
            t = value.detach()
            data = b"" if t.is_meta else t.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            return "tensor", tuple(t.shape), str(t.dtype), str(t.device), hash(data)
        if isinstance(value, (tuple, list)):
            return type(value).__name__, tuple(content(v) for v in value)
        if isinstance(value, dict):
            return "dict", tuple((k, content(v)) for k, v in sorted(value.items()))
        return repr(value)

    state = tuple((n, content(t)) for n, t in model.state_dict(keep_vars=True).items())
    # each module's own plain attributes (an activation function, a flag, a config): what its repr may omit
    attributes = tuple((name, type(m).__qualname__, tuple(sorted((k, repr(v)) for k, v in vars(m).items()
                                                                 if not k.startswith("_"))))
                       for name, m in model.named_modules())
    return repr(model), attributes, state, content(config)


def tiny_gpt_program(vocab: int = 64, **layout) -> autopar.ParallelProgram:
    """A 2-layer GPT (d_model 16, 2 heads, 8 positions) compiled for ``layout`` on 2 sequences of ids below 64:
    for what needs a real program but no particular model."""
    torch.manual_seed(0)
    model = build("gpt", vocab_size=vocab, seq_len=8, n_layer=2, n_head=2, d_model=16)
    x = torch.randint(0, 64, (2, 8))
    return autopar.parallelize(model, example_inputs=(x,), example_targets=x.clone(), **layout)


def reference_run(model, data: Batches, lr: float | None = None, loss_fn: Callable = autopar.lm_cross_entropy,
                  **kwargs) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """The single-device run of ``model`` on ``data``: each step's loss and gradients by parameter name.

    ``lr``: AdamW with that learning rate, as the ranks train; None for
    ``single_device_run``'s default (enough for a one-step comparison).
    """
    optimizer = None if lr is None else (lambda ps: torch.optim.AdamW(ps, lr=lr))
    return single_device_run(model, data, loss_fn, optimizer=optimizer, **kwargs)


def spawn_ranks(worker: Callable, world: int, *args, timeout_s: float = 900) -> list:
    """``worker(*args)`` on ``world`` gloo ranks in one spawn, forked from this process (so they inherit
    the programs ``parallelize_on`` compiled here); the ranks' results in rank order."""
    results = autopar.spawn(worker, world, args, timeout_s=timeout_s, inherit=True)
    assert len(results) == world, f"{len(results)} results from {world} ranks"
    return results


def layout_world(layout: dict) -> int:
    """The ranks a layout of ``parallelize`` keywords fills: tp x cp x pp x dp (each 1 when not given)."""
    return layout.get("tp", 1) * layout.get("cp", 1) * layout.get("pp", 1) * layout.get("dp", 1)


def layout_chunks(layout: dict) -> int:
    """The parts one step's global batch is cut into under a layout: dp x microbatches (each 1 when not
    given), what ``chunked_one_device_steps`` runs the one-device reference in."""
    return layout.get("dp", 1) * layout.get("microbatches", 1)


def on_rank0(value):
    """``value`` on global rank 0 only, None elsewhere (for what every rank holds alike, such as the
    full weights: one copy comes back from the spawn)."""
    return value if dist.get_rank() == 0 else None


def assert_ranks_match(reference: tuple[list[float], list[dict]], per_rank: Sequence[tuple[list[float], list[dict]]],
                       label: str) -> None:
    """Each rank's (losses, gradients per step) against the single-device ``reference``.

    The first step's gradients element-wise within FP32_TOLERANCE (rtol 1e-5,
    atol 1e-6: fp32, the parallel run only reorders sums), later steps per
    tensor (||g - g_ref|| <= 1e-4 ||g_ref|| + 1e-6: AdamW's first update
    lr*sign(g) amplifies rounding in near-zero gradients); see
    ``families.assert_steps_match``.
    """
    ref_losses, ref_grads = reference
    for rank, (losses, grads) in enumerate(per_rank):
        assert len(grads) == len(losses) <= len(ref_grads), (label, rank, len(losses), len(grads))
        assert_steps_match(ref_losses, ref_grads, losses, grads, label=f"{label} rank {rank}")


def chunked_one_device_steps(model: nn.Module, data: Batches, chunks: int, lr: float, loss_of: Callable,
                             clip: float | None = None, bf16: bool = False
                             ) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """One device, as a layout of ``chunks`` = dp x microbatches parts sees each step's global batch:
    each part's ``loss_of(model(x), y) / chunks`` backpropagated (a loss over the tokens of one
    forward, such as a router's auxiliary loss or an expert's capacity, depends on the part), then
    AdamW. Each step's summed loss and gradients (zeros where none reached), clipped to ``clip``
    (asserted to act: the norm above twice it)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, grads = [], []
    for (x,), (y,) in data:
        rows, total = x.shape[0] // chunks, 0.0
        for c in range(chunks):
            part = slice(c * rows, (c + 1) * rows)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = loss_of(model(x[part]), y[part]) / chunks
            loss.backward()
            total += float(loss.detach())
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            assert norm > 2 * clip, (float(norm), clip)  # the clip acts
        losses.append(total)
        grads.append({n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                      for n, p in model.named_parameters(remove_duplicate=False)})
        opt.step()
        opt.zero_grad()
    return losses, grads


def assert_same_grads(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], label: str, rtol: float,
                      atol: float) -> None:
    """Gradients equal by parameter name: the same names, and each within (rtol, atol), the message naming it."""
    assert got.keys() == want.keys(), (label, sorted(set(got) ^ set(want)))
    for name, ref in want.items():
        torch.testing.assert_close(got[name], ref, rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"{label} gradient of {name}: {m}")


def assert_bitwise_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], label: str) -> None:
    """The same names and every tensor bit for bit (a resumed or resharded state against the saved one)."""
    assert got.keys() == want.keys(), (label, sorted(set(got) ^ set(want)))
    for name, value in want.items():
        assert torch.equal(got[name], value), f"{label}: {name} differs by {(got[name] - value).abs().max()}"


def meta_model_from(path: Path) -> nn.Module:
    """The transformers model of the config saved in ``path``, on the meta device (no weights read)."""
    import transformers

    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path))


def write_contract_checkpoint(model: nn.Module, root: Path, step: int = 3) -> dict[str, torch.Tensor]:
    """A checkpoint as the checkpoint contract lays it out, of ``model`` with its weights moved off
    their initial values: DCP (no process group) of full tensors under ``model.<name>``, persistent
    buffers under ``buffer.<name>``, optimizer state under ``optim.*``; ``autopar.json``; ``latest``;
    and an interrupted later save beside it. Returns the saved tensors by every name the model uses."""
    torch.manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    params = dict(model.named_parameters())
    buffers = {k: v for k, v in model.state_dict().items() if k in dict(model.named_buffers())}
    tensors = {f"model.{k}": v.detach().clone() for k, v in params.items()}
    tensors.update({f"buffer.{k}": v.clone() for k, v in buffers.items()})
    tensors.update({f"optim.{k}.exp_avg": torch.zeros_like(v) for k, v in params.items()})
    tensors.update({f"optim.{k}.step": torch.tensor(float(step)) for k in params})
    step_dir = root / f"step-{step:08d}"
    with warnings.catch_warnings():  # DCP says it saves in one process: the contract's no_dist save
        warnings.simplefilter("ignore")
        dcp.save(tensors, checkpoint_id=step_dir, no_dist=True)
    config = getattr(model, "config", None)
    manifest = {"format": 1, "step": step, "params": {k: list(v.shape) for k, v in params.items()},
                "aliases": {group[0]: group for group in names.values()},
                "buffers": {k: list(v.shape) for k, v in buffers.items()},
                "hf_config": config.to_dict() if config is not None else None,
                "layout": {"tp": 2, "pp": 2, "dp": 1, "virtual_stages": 1}}
    (step_dir / "autopar.json").write_text(json.dumps(manifest))
    (root / "latest").write_text(step_dir.name)
    (root / f"step-{step + 10:08d}.partial").mkdir()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def dcp_tensors(step_dir: Path, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint directory whose key starts with one of ``prefixes``, in its full
    shape, read without a process group."""
    metadata = dcp.FileSystemReader(step_dir).read_metadata()
    state = {key: torch.full(md.size, float("nan"), dtype=md.properties.dtype)
             for key, md in metadata.state_dict_metadata.items()
             if key.startswith(prefixes) and isinstance(md, TensorStorageMetadata)}
    with warnings.catch_warnings():  # DCP notes that it assumes one process: that is the point here
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=dcp.FileSystemReader(step_dir), no_dist=True)
    return state


@contextlib.contextmanager
def calls_into_dist(names: Sequence[str], seen: Callable[[str, tuple, dict], None]) -> Iterator[None]:
    """Within the block, each call of ``torch.distributed``'s functions ``names`` (those this torch has) is
    shown to ``seen(name, args, kwargs)``, then made: how a test counts the collectives a rank really runs
    (``core/comm`` calls them through the module, so the wrappers see every one)."""
    real = {name: getattr(dist, name) for name in names if hasattr(dist, name)}

    def watched(name: str) -> Callable:
        def call(*args, **kwargs):
            seen(name, args, kwargs)
            return real[name](*args, **kwargs)
        return call
    for name in real:
        setattr(dist, name, watched(name))
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
