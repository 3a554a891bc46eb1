"""HuggingFace checkpoints in and out.

``weights_in`` reads a safetensors checkpoint slice by slice; ``conversion``
maps a model's own names to the checkpoint's (transformers' conversion
mapping where it has one); ``layout`` is the directory (index, configs, file
names) and which tensors ``save_pretrained`` writes under which names;
``export`` writes a running program's weights (``save_pretrained``) and
``export_checkpoint`` an autopar checkpoint's (found and described by
``checkpoint.description``), both through ``safetensors_stream`` one tensor
at a time. What cannot be read or written is a ``CheckpointError``; a write
that fails while running, an ``ExportError`` (``errors``).
"""

from autopar.runtime.hf.errors import ExportError
from autopar.runtime.hf.export import save_pretrained
from autopar.runtime.hf.export_checkpoint import export_checkpoint

__all__ = ["save_pretrained", "export_checkpoint", "ExportError"]
