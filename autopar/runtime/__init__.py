"""The runtime: what runs a compiled program on a rank, in rooms.

- ``launch``: starting ranks (``spawn``, ``autopar run``, torchrun).
- ``tuning/``: timing this machine's kernels and collectives (what ``autopar tune`` measures).
- ``optim/``: gradient sync, the distributed optimizer, the split backward.
- ``checkpoint/``: training state saved, resumed and resharded.
- ``hf/``: HuggingFace checkpoints read and written.
- ``weights/``: where each rank's weights come from, and initialisation.
- ``engine/``: the step loop and its handlers, and the making of an engine.

Rooms import downward in that order (``tests/test_layering.py`` checks it):
the engine uses the others, and none of them reaches into the engine.
"""
