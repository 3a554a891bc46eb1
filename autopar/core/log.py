"""Library logging: ``get_logger(name)``, whose records say which rank wrote them.

autopar's modules report through ``logging`` (the CLI and the examples print): a
warning from one rank of eight reads ``[rank 3] ...``. The rank is torch.distributed's
once its process group is initialised, else the launcher's ``RANK`` variable; a
process with neither (one device, a planner) writes no prefix.

The ``autopar`` logger gets one default handler, added once however many loggers are
asked for: it writes warnings and worse to the current ``sys.stderr`` only while the
application has configured no handler of its own on the root logger, so a record is
never written twice (once here, once by the application's handler) and a test
runner's log capture keeps a passing test quiet. Applications that configure
``logging`` see every record, rank included, through their own handlers.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["get_logger", "current_rank", "LIBRARY_LOGGER"]

LIBRARY_LOGGER = "autopar"
"""The logger above every module's: its handler is the default one."""


def current_rank() -> int | None:
    """This process's global rank: torch.distributed's when initialised, else ``RANK``; None without either."""
    dist = sys.modules.get("torch.distributed")  # never imports torch for a log record
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    rank = os.environ.get("RANK", "")
    return int(rank) if rank.isdigit() else None


class _RankPrefix(logging.Filter):
    """Puts ``rank`` on each record and ``[rank r]`` in front of its message, once per record."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "rank"):
            record.rank = current_rank()
            if record.rank is not None:
                record.msg = f"[rank {record.rank}] {record.msg}"
        return True


class _StderrUnlessConfigured(logging.StreamHandler):
    """Warnings to the current ``sys.stderr`` (a runner may swap it), while the root logger has no handler."""

    def __init__(self) -> None:
        super().__init__()
        self.setLevel(logging.WARNING)
        self.setFormatter(logging.Formatter("%(name)s: %(levelname)s: %(message)s"))
        self.addFilter(_RANK_PREFIX)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        """The stream is always the current ``sys.stderr``."""

    def handle(self, record: logging.LogRecord) -> bool:
        if logging.getLogger().handlers:  # the application's own handlers write it
            return False
        return super().handle(record)


_RANK_PREFIX = _RankPrefix()


def _default_handler_once() -> None:
    library = logging.getLogger(LIBRARY_LOGGER)
    if not any(isinstance(h, _StderrUnlessConfigured) for h in library.handlers):
        library.addHandler(_StderrUnlessConfigured())


def get_logger(name: str) -> logging.Logger:
    """The logger of module ``name`` (``get_logger(__name__)``): its records carry the rank."""
    _default_handler_once()
    logger = logging.getLogger(name)
    if _RANK_PREFIX not in logger.filters:
        logger.addFilter(_RANK_PREFIX)
    return logger
