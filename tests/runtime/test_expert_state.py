"""Expert parallelism in the runtime's state: the distributed optimizer, checkpoints, Hub weights in and out.

A tiny Mixtral (hidden 32, 2 layers, 4 experts, top-2), its stacked expert
weights ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] split E/ep per
rank. Two spawns, run once for the module (``expert_runs``):

1. *4 ranks*: the distributed AdamW at dp=4 x ep=2 (the expert weights'
   flat buckets shared by the 2 replicas of the same experts, mesh 'edp') and
   at tp=2 x dp=2 x ep=2 with whole experts (``expert_tp=1``: the expert
   groups are the tp groups), 3 clipped steps each; at dp=4 x ep=4 (each rank
   alone with its experts), at tp=2 x dp=2 x ep=2 (tp's split inside each
   rank's experts) and at tp=2 x dp=2 x ep=4 with whole experts (one expert
   per rank), the plain and the distributed AdamW trained 3 steps, saved, and
   trained on to 5 steps.
2. *2 ranks*: the distributed AdamW at dp=2 x ep=2, 3 clipped steps; the
   same saves at ep=2 (plain and distributed); the ep=4 checkpoints loaded at
   ep=2, and the whole-expert ep=4 ones at tp=2 x ep=2 with whole experts,
   each saved again right after the load and trained on; a Mixtral written by
   ``save_pretrained`` (one tensor per expert) loaded with
   ``materialize(checkpoint=...)``, every byte each rank reads counted,
   evaluated, and exported with ``engine.save_pretrained``.

In this process: the ep=2 checkpoints (dp=2, and tp=2 x dp=2) loaded at ep=1
(no process group), saved again and trained on; the ep=4 checkpoint exported
by ``autopar export --to-hf``; and each expert-parallel rank's experts read
from a ``save_pretrained`` checkpoint at every tp split, bytes counted.

The checks: losses and (clipped) gradients of the distributed optimizer equal
the single-device run's; a checkpoint loaded at another ep gives the saved
weights bit for bit, saved again gives the saved optimizer state bit for bit
(plain and distributed), and the run continues with the uninterrupted run's
losses; a rank at ep=2 opens only its own experts' tensors and reads exactly
its shard's bytes of them, and evaluates as ``from_pretrained`` does; both
exports are what ``from_pretrained`` reads back, every tensor equal.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from families import tiny_mixtral
from helpers import assert_bitwise_equal, assert_ranks_match, dcp_tensors, on_rank0, parallelize_on, spawn_ranks, token_batches

import autopar
import autopar.runtime.hf.weights_in as weights_in
from autopar.core.tensor_placement import Replicate, Shard
from autopar.runtime.checkpoint.description import resolve
from autopar.runtime.hf.weights_in import HFCheckpoint
from autopar.runtime.weights.shards import assemble


VOCAB, ROWS, STEPS, SAVE_AT, LR, CLIP, EXPERTS = 64, 8, 5, 3, 1e-3, 0.5, 4
SMALL_BUCKETS = 4096
"""Flat buckets of 4 KiB: several per chunk, parameters straddling the replicas' ranges."""
PARITY = {"ep2dp4": dict(dp=4, ep=2, world_size=4), "ep2": dict(dp=2, ep=2, world_size=2),
          "ep2tp2-whole": dict(tp=2, dp=2, ep=2, expert_tp=1, world_size=4)}
"""The distributed optimizer against one device: layout -> config ('whole': each expert whole on its
rank, the expert groups over tp)."""
SAVES = {"ep4": dict(dp=4, ep=4, world_size=4), "ep2tp2": dict(tp=2, dp=2, ep=2, world_size=4),
         "ep4tp2-whole": dict(tp=2, dp=2, ep=4, expert_tp=1, world_size=4), "ep2": dict(dp=2, ep=2, world_size=2)}
"""Checkpoint layouts, each saved with the plain and the distributed AdamW."""
LOADS = {"ep4-to-ep2": ("ep4", SAVES["ep2"]), "ep2-to-ep1": ("ep2", {}), "ep2tp2-to-ep1": ("ep2tp2", {}),
         "ep4tp2-whole-to-ep2tp2-whole": ("ep4tp2-whole", dict(tp=2, ep=2, expert_tp=1, world_size=2))}
"""Case -> (the checkpoint's layout, the layout loading it)."""
OPTIMIZERS = ("plain", "distributed")
GATE_UP, DOWN = "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"


def _mixtral(device: str | None = None, seed: int = 0):
    return tiny_mixtral(seed, device, vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_local_experts=EXPERTS, max_position_embeddings=64,
                        bos_token_id=0, eos_token_id=0, pad_token_id=None)


def _data():
    return token_batches(VOCAB, STEPS, ROWS, seed=1)


def _program(layout: dict, model=None):
    rows = ROWS // layout.get("dp", 1)
    return parallelize_on(_mixtral() if model is None else model, _data(), rows, **layout)


def _hub_program():
    """A Mixtral of the hub's config compiled at ep=2 (dp=2), its own weights other than the hub's
    (seed 1): whatever it evaluates like, it read from the checkpoint. (Built on the CPU: one built on
    the meta device traces transformers' non-CPU branch, ``histc`` of int expert ids, which the CPU
    lacks.)"""
    return _program(SAVES["ep2"], _mixtral(seed=1))


def _compile_every_program() -> None:
    """Every program the spawns build, compiled here once: the ranks inherit them."""
    for layout in (*PARITY.values(), *SAVES.values(), *(layout for _, layout in LOADS.values() if layout)):
        _program(layout)
    _hub_program()


def _engine(layout: dict, optimizer: str):
    engine = _program(layout).materialize()
    engine.grads.bucket_bytes = SMALL_BUCKETS
    if optimizer == "distributed":
        return engine, engine.distributed_optimizer(torch.optim.AdamW, lr=LR, weight_decay=0.1)
    return engine, torch.optim.AdamW(engine.parameters(), lr=LR, weight_decay=0.1)


def _train(engine, optimizer, batches) -> list[float]:
    losses = []
    for (x,), (y,) in batches:
        losses.append(engine.train_step(x, y))
        engine.clip_grad_norm_(CLIP)
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _distributed_parity(layout: dict) -> dict:
    """3 clipped steps with the distributed AdamW (lr only, as the reference): each step's loss, its
    reduced, clipped gradients and clipping norm; the buckets' axes."""
    engine = _program(layout).materialize()
    engine.grads.bucket_bytes = SMALL_BUCKETS
    optimizer = engine.distributed_optimizer(torch.optim.AdamW, lr=LR)
    losses, grads, norms = [], [], []
    for (x,), (y,) in _data()[:3]:
        losses.append(engine.train_step(x, y))
        norms.append(engine.clip_grad_norm_(CLIP))
        grads.append(engine.full_grads())
        optimizer.step()
        optimizer.zero_grad()
    axes = [(b.axis, b.dp) for b in optimizer.buckets]
    return {"losses": losses, "grads": grads, "norms": norms, "axes": axes}


def _on_rank0(value):
    """``value`` on global rank 0 (every rank holds it alike), and in a process without ranks."""
    return value if not torch.distributed.is_initialized() else on_rank0(value)


def _save(root: str, name: str, layout: dict, optimizer: str) -> dict:
    """SAVE_AT steps, saved under ``root/<name>-<optimizer>``, then on to STEPS (the uninterrupted run)."""
    engine, opt = _engine(layout, optimizer)
    losses = _train(engine, opt, _data()[:SAVE_AT])
    saved = _on_rank0(engine.full_state_dict())
    engine.save(f"{root}/{name}-{optimizer}", opt, step=SAVE_AT).wait()
    losses += _train(engine, opt, _data()[SAVE_AT:])
    return {"saved": saved, "losses": losses}


def _load(root: str, case: str, layout: dict, optimizer: str) -> dict:
    """The checkpoint of ``case`` loaded at ``layout``, saved again at once, trained on to STEPS."""
    source = LOADS[case][0]
    engine, opt = _engine(layout, optimizer)
    step, _ = engine.load(f"{root}/{source}-{optimizer}", opt)
    loaded = _on_rank0(engine.full_state_dict())
    engine.save(f"{root}/resaved/{case}-{optimizer}", opt, step=step).wait()
    return {"loaded": loaded, "losses": _train(engine, opt, _data()[step:])}


class _CountedReads:
    """``safe_open`` of the checkpoint reader wrapped: every tensor or slice read, (stored name, bytes)."""

    def __init__(self, log: list):
        self.log = log
        self.original = weights_in.safe_open

    def __call__(self, file, **kwargs):
        return _CountedFile(self.original(file, **kwargs), self.log)


class _CountedFile:
    """A safetensors handle whose reads of tensor data are logged; the rest (keys, shapes) passed on."""

    def __init__(self, handle, log: list):
        self.handle, self.log = handle, log

    def __enter__(self):
        self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self.handle, name)

    def get_tensor(self, key):
        t = self.handle.get_tensor(key)
        self.log.append((key, t.numel() * t.element_size()))
        return t

    def get_slice(self, key):
        return _CountedSlice(self.handle.get_slice(key), key, self.log)


class _CountedSlice:
    def __init__(self, piece, key: str, log: list):
        self.piece, self.key, self.log = piece, key, log

    def __getattr__(self, name):  # get_shape, get_dtype: the header only
        return getattr(self.piece, name)

    def __getitem__(self, index):
        t = self.piece[index]
        self.log.append((self.key, t.numel() * t.element_size()))
        return t


def _from_hub(hub: str, export: str) -> dict:
    """The hub Mixtral loaded at ep=2, each read counted; its eval loss; exported."""
    program = _hub_program()
    log: list = []
    original, weights_in.safe_open = weights_in.safe_open, _CountedReads(log)
    try:
        engine = program.materialize(checkpoint=hub)
    finally:
        weights_in.safe_open = original
    (x,), (y,) = _data()[0]
    shards = {name: tuple(p.shape) for name, p in engine.named_local_parameters()}
    loss = engine.eval_step(x, y)
    engine.save_pretrained(export)
    return {"reads": log, "loss": loss, "shards": shards, "ep_rank": engine.mesh.ep_rank}


def _four_ranks(root: str) -> dict:
    out = {f"parity-{layout}": _distributed_parity(PARITY[layout]) for layout in ("ep2dp4", "ep2tp2-whole")}
    for optimizer in OPTIMIZERS:
        for name in ("ep4", "ep2tp2", "ep4tp2-whole"):
            out[f"{name}-{optimizer}"] = _save(root, name, SAVES[name], optimizer)
    return out


def _two_ranks(root: str, hub: str) -> dict:
    out = {"parity-ep2": _distributed_parity(PARITY["ep2"])}
    for optimizer in OPTIMIZERS:
        out[f"ep2-{optimizer}"] = _save(root, "ep2", SAVES["ep2"], optimizer)
        for case in ("ep4-to-ep2", "ep4tp2-whole-to-ep2tp2-whole"):
            out[f"{case}-{optimizer}"] = _load(root, case, LOADS[case][1], optimizer)
    out["hub"] = _from_hub(hub, f"{root}/exported")
    return out


def _load_in_process(root: str) -> dict:
    """The ep=2 checkpoints (dp=2, and tp=2 x dp=2) at ep=1, in this process (no process group)."""
    return {f"{case}-{optimizer}": _load(root, case, {}, optimizer) for optimizer in OPTIMIZERS
            for case in ("ep2-to-ep1", "ep2tp2-to-ep1")}


@pytest.fixture(scope="module")
def expert_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("experts")
    hub = root / "hub"
    _mixtral().save_pretrained(hub)
    _compile_every_program()
    four = spawn_ranks(_four_ranks, 4, str(root), timeout_s=600)
    two = spawn_ranks(_two_ranks, 2, str(root), str(hub), timeout_s=600)
    return {"root": root, "hub": hub, "four": four, "two": two, "one": _load_in_process(str(root))}


# ------------------------------------------------------------------- the distributed optimizer
@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", sorted(PARITY))
def test_distributed_optimizer_with_experts_equals_one_device(expert_runs, reference, layout):
    """Losses and clipped gradients over 3 AdamW steps equal the single-device run's; the expert
    weights have buckets of their own over their d/ep replicas (whole on a rank when d = ep)."""
    ranks = [r[f"parity-{layout}"] for r in expert_runs["four" if PARITY[layout]["world_size"] == 4 else "two"]]
    one_device = reference("tiny mixtral, 3 steps", _mixtral, lambda: _data()[:3], lr=LR, clip_grad_norm=CLIP)
    assert_ranks_match(one_device, [(r["losses"], r["grads"]) for r in ranks], layout)
    # each expert's replicas: d/ep when tp splits the experts; tp x d / ep when they are whole
    whole = PARITY[layout].get("expert_tp") == 1
    replicas = PARITY[layout].get("tp", 1) ** whole * PARITY[layout]["dp"] // PARITY[layout]["ep"]
    for r in ranks:
        assert min(r["norms"]) > CLIP  # the clipping scaled every step
        assert ("edp", replicas) in r["axes"] and ("dp", PARITY[layout]["dp"]) in r["axes"], r["axes"]
        assert r["norms"] == ranks[0]["norms"]  # one global norm on every rank


# ------------------------------------------------------------------- checkpoints across ep
def _saving_ranks(runs: dict, source: str) -> list[dict]:
    """Every rank's results of the spawn that saved checkpoint ``source``."""
    return runs["four" if SAVES[source]["world_size"] == 4 else "two"]


def _loading_ranks(runs: dict, case: str) -> list[dict]:
    """Every rank's results where ``case`` loaded (this process: one)."""
    return [runs["one"]] if not LOADS[case][1] else runs["two"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("case", sorted(LOADS))
def test_checkpoint_across_ep_keeps_weights_and_optimizer_state(expert_runs, case, optimizer):
    """The weights right after the load, and the optimizer state saved again right after it, equal
    the checkpoint's bit for bit; every expert of every moment is in the checkpoint exactly once."""
    source = LOADS[case][0]
    saved = _saving_ranks(expert_runs, source)[0][f"{source}-{optimizer}"]["saved"]
    loaded = _loading_ranks(expert_runs, case)[0][f"{case}-{optimizer}"]
    assert_bitwise_equal(loaded["loaded"], saved, f"{case} {optimizer} loaded")
    root = expert_runs["root"]
    before = dcp_tensors(resolve(root / f"{source}-{optimizer}"), ("optim.", "model."))
    after = dcp_tensors(resolve(root / "resaved" / f"{case}-{optimizer}"), ("optim.", "model."))
    assert before[f"optim.{GATE_UP}.exp_avg_sq"].shape[0] == EXPERTS
    assert not any(bool(t.isnan().any()) for t in before.values())  # every entry written by some rank
    assert_bitwise_equal(after, before, f"{case} {optimizer} state")


@pytest.mark.multiprocess
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("case", sorted(LOADS))
def test_training_continues_after_a_load_at_another_ep(expert_runs, case, optimizer):
    """Later losses against the run that saved the checkpoint and went on: another ep sums the same
    terms in another order (fp32 rounding, ~1e-7 relative per step), far below what one misplaced
    expert of a weight or a moment changes."""
    source = LOADS[case][0]
    want = [r[f"{source}-{optimizer}"]["losses"][SAVE_AT:] for r in _saving_ranks(expert_runs, source)]
    got = [r[f"{case}-{optimizer}"]["losses"] for r in _loading_ranks(expert_runs, case)]
    assert len(got[0]) == STEPS - SAVE_AT
    for rank, losses in enumerate(got):
        torch.testing.assert_close(losses, want[0], rtol=1e-5, atol=0, msg=lambda m: f"{case} rank {rank}: {m}")


# ------------------------------------------------------------------- Hub weights in and out
def _stored_bytes(hub: Path) -> dict[str, int]:
    """Bytes of every tensor stored in ``hub``'s one safetensors file."""
    from safetensors import safe_open

    with safe_open(hub / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys()}


def _expert_of(key: str) -> int | None:
    """The expert a stored per-expert tensor belongs to (``...experts.3.w1.weight`` -> 3), else None."""
    parts = key.split(".")
    return int(parts[parts.index("experts") + 1]) if "experts" in parts else None


@pytest.mark.multiprocess
def test_a_rank_at_ep2_reads_only_its_experts_and_evaluates_like_from_pretrained(expert_runs, show):
    """Each rank opens only its own experts' tensors, and reads exactly its shard's bytes of them
    (every other tensor whole, once); its eval loss is ``from_pretrained``'s."""
    import transformers

    hub = expert_runs["hub"]
    stored = _stored_bytes(hub)
    per_expert = [k for k in stored if _expert_of(k) is not None]
    assert len(per_expert) == 2 * EXPERTS * 3  # w1, w2, w3 of each expert of each layer
    reference = transformers.AutoModelForCausalLM.from_pretrained(hub).eval()
    (x,), (y,) = _data()[0]
    with torch.no_grad():
        want = autopar.lm_cross_entropy(reference(x).logits, y)
    for rank, run in enumerate(r["hub"] for r in expert_runs["two"]):
        mine = range(run["ep_rank"] * EXPERTS // 2, (run["ep_rank"] + 1) * EXPERTS // 2)
        experts_read = {k for k, _ in run["reads"] if _expert_of(k) is not None}
        assert experts_read == {k for k in per_expert if _expert_of(k) in mine}, (rank, sorted(experts_read))
        assert run["shards"][GATE_UP][0] == EXPERTS // 2
        expert_bytes = sum(n for k, n in run["reads"] if _expert_of(k) is not None)
        held = sum(4 * torch.Size(shape).numel() for name, shape in run["shards"].items() if "experts" in name)
        assert expert_bytes == held == sum(stored[k] for k in experts_read), (rank, expert_bytes, held)
        show(f"ep rank {run['ep_rank']}: {len(experts_read)} of {len(per_expert)} per-expert tensors read, "
             f"{expert_bytes} of {sum(stored[k] for k in per_expert)} bytes; all reads "
             f"{sum(n for _, n in run['reads'])} of {sum(stored.values())} bytes")
        others = [k for k, _ in run["reads"] if _expert_of(k) is None]
        assert sorted(others) == sorted(k for k in stored if _expert_of(k) is None)  # each once, whole
        torch.testing.assert_close(torch.tensor(run["loss"]), want, rtol=1e-5, atol=1e-6, msg=f"rank {rank}")


def _reloaded(path: Path) -> dict[str, torch.Tensor]:
    """``from_pretrained(path)``'s state dict, every tensor found and none left over."""
    import transformers

    got, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    problems = {k: v for k, v in info.items() if k != "conversion_errors" and v}
    assert not problems and not info.get("conversion_errors"), problems
    return got.state_dict()


def _stored_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


@pytest.mark.multiprocess
def test_export_at_ep2_is_what_from_pretrained_reads(expert_runs):
    """``engine.save_pretrained`` at ep=2: the per-expert names and shapes ``save_pretrained`` wrote,
    and the reloaded model equal to the original, every tensor."""
    import transformers

    hub, exported = expert_runs["hub"], expert_runs["root"] / "exported"
    assert _stored_shapes(exported) == _stored_shapes(hub)
    want = transformers.AutoModelForCausalLM.from_pretrained(hub).state_dict()
    assert_bitwise_equal(_reloaded(exported), want, "exported at ep=2")


@pytest.mark.multiprocess
def test_checkpoint_saved_at_ep4_exports_to_what_from_pretrained_reads(expert_runs, tmp_path):
    """``autopar export --to-hf`` (one process, no process group) of the checkpoint the ep=4 ranks
    wrote, each holding one expert: the reloaded model is the saved one, every tensor."""
    from autopar.runtime.hf.export_checkpoint import export_checkpoint

    export_checkpoint(str(expert_runs["root"] / "ep4-distributed"), str(tmp_path))
    assert _stored_shapes(tmp_path) == _stored_shapes(expert_runs["hub"])
    assert_bitwise_equal(_reloaded(tmp_path), expert_runs["four"][0]["ep4-distributed"]["saved"], "exported from ep=4")


def test_each_ep_rank_reads_its_experts_slices_at_every_tp_split(tmp_path, monkeypatch):
    """The reader at expert-parallel rank e (of 2) and any tp split of a stacked expert weight (none,
    or dim 1 or 2 over 2 ranks): equal to ``from_pretrained``'s experts [2e, 2e + 2) cut by tp, read
    from those experts' stored tensors only, exactly the shard's bytes."""
    import transformers

    _mixtral().save_pretrained(tmp_path)
    want = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    ckpt = HFCheckpoint.open(tmp_path)
    view = ckpt.view(_mixtral("meta"))
    log: list = []
    monkeypatch.setattr(weights_in, "safe_open", _CountedReads(log))
    for name in (GATE_UP, DOWN):
        source = view[name]
        for spec, tp in ((Replicate(), 1), (Shard(1), 2), (Shard(2), 2)):
            for ep_rank in range(2):
                first, count = ep_rank * EXPERTS // 2, EXPERTS // 2
                for tp_rank in range(tp):
                    log.clear()
                    with ckpt.opened(torch.device("cpu")):
                        read = ckpt.reader(source, spec, torch.float32, name, experts=(first, count))
                        shard = assemble(read, (count, *source.shape[1:]), spec, tp_rank, tp, torch.float32,
                                         torch.device("cpu"))
                    experts = want[name][first : first + count]
                    expected = experts if tp == 1 else experts.chunk(tp, spec.dim)[tp_rank]
                    label = (name, spec, ep_rank, tp_rank)
                    assert torch.equal(shard, expected), label
                    assert sum(n for _, n in log) == shard.numel() * 4, (label, log)
                    assert {_expert_of(k) for k, _ in log} == set(range(first, first + count)), (label, log)
