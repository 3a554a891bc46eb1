"""What materialize and save refuse before any work, on one process: weights of another shape, a
dtype other than the model's, a checkpoint value a load could not read back."""

import numpy as np
import pytest
import torch

import autopar
from autopar.reference.models import build


def test_a_state_dict_of_another_shape_is_refused_naming_each_tensor(tiny_program):
    other = build("gpt", vocab_size=72, seq_len=8, n_layer=2, n_head=2, d_model=16).state_dict()
    with pytest.raises(ValueError, match=r"wte\.weight: given \(72, 16\), the model has \(64, 16\).*Fix: pass the "
                                         r"weights of this model"):
        tiny_program.materialize(state_dict=other)


def test_given_weights_take_the_model_dtype(tiny_program):
    program = tiny_program
    bf16 = {k: v.to(torch.bfloat16) for k, v in program.model.state_dict().items()}
    engine = program.materialize(state_dict=bf16)
    assert {p.dtype for p in engine.parameters()} == {torch.float32}
    want = program.model.state_dict()["h.0.mlp.fc.weight"].to(torch.bfloat16).float()
    torch.testing.assert_close(dict(engine.named_local_parameters())["h.0.mlp.fc.weight"], want, rtol=0, atol=0)


def test_a_checkpoint_value_a_load_could_not_read_is_refused_before_writing(tmp_path, tiny_program):
    engine = tiny_program.materialize()
    refused = r"(?s)extra holds a value a checkpoint cannot load safely \(numpy[\w.]*scalar\).*int\(x\)"
    with pytest.raises(autopar.CheckpointError, match=refused):
        engine.save(str(tmp_path), step=1, extra={"position": np.int64(3)})
    assert not (tmp_path / "latest").exists() and not (tmp_path / "step-00000001").exists()
    engine.save(str(tmp_path), step=1, extra={"position": 3}).wait()  # plain values save and load back
    assert engine.load(str(tmp_path)) == (1, {"position": 3})
