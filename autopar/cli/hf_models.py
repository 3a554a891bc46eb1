"""A model given by ``--hf-config``: a HuggingFace causal LM built from its config on the meta
device, its dimensions read from its traced graph (the only path of the command line that
needs torch and transformers)."""

from __future__ import annotations

from autopar.planning.cost.models import ModelSpec

__all__ = ["hf_model_spec"]


def hf_model_spec(path: str, seq_len: int) -> ModelSpec:
    """Build a HuggingFace causal LM from its config on the meta device and read its dimensions."""
    import torch  # noqa: PLC0415  (only this path needs torch and transformers)

    from autopar.compiler.model_spec import SpecError, spec_from_model  # noqa: PLC0415

    try:
        import transformers  # noqa: PLC0415
    except ImportError:
        raise SystemExit("autopar: --hf-config needs transformers (pip install transformers)") from None
    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise SystemExit(f"autopar: cannot read a HuggingFace config from {path}: {e}") from None
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    try:
        return spec_from_model(model, (torch.zeros(1, seq_len, dtype=torch.long),), name=config.model_type)
    except SpecError as e:
        raise SystemExit(f"autopar: {e}") from None
