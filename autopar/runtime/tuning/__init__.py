"""Timing the machine in hand: its kernels (``compute``) and its collectives over groups of ranks
(``collectives``), raw seconds for ``autopar tune`` to fit and write as a hardware profile."""
