"""Every error autopar raises on purpose is an ``AutoparError``.

(a) No module raises a plain ``ValueError``/``RuntimeError``/``TypeError``/``KeyError`` with a
message: each part raises its own class, which derives from ``AutoparError`` and from the
built-in it replaces. (b) Every exception class the packages define derives from
``AutoparError``. Both read the source (AST), so no module has to be imported.
"""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import pytest

import autopar

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("autopar", "passes")
PLAIN = {"ValueError", "RuntimeError", "TypeError", "KeyError"}

# Exceptions used as signals inside one pass, raised and caught there: never reach a user.
SIGNALS = {"NeedSegments"}


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _plain_raises(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Raise) or not isinstance(node.exc, ast.Call):
            continue
        call = node.exc
        if isinstance(call.func, ast.Name) and call.func.id in PLAIN and (call.args or call.keywords):
            found.append(f"{_relative(path)}:{node.lineno} raise {call.func.id}(...)")
    return found


def test_no_plain_builtin_raise_with_a_message():
    found = [hit for path in _sources() for hit in _plain_raises(path)]
    assert not found, "raise the part's own AutoparError subclass instead:\n" + "\n".join(found)


def _base_name(base: ast.expr) -> str | None:
    if isinstance(base, ast.Name):
        return base.id
    if isinstance(base, ast.Attribute):
        return base.attr
    return None


def _classes() -> dict[str, tuple[str, set[str]]]:
    """Class name -> (where it is defined, the names of its bases), over both packages."""
    classes: dict[str, tuple[str, set[str]]] = {}
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                bases = {name for name in map(_base_name, node.bases) if name}
                classes[node.name] = (f"{_relative(path)}:{node.lineno}", bases)
    return classes


def _closure(classes: dict[str, tuple[str, set[str]]], seeds: set[str]) -> set[str]:
    """The classes deriving (through classes of the packages) from one of ``seeds``."""
    reached = set(seeds)
    grew = True
    while grew:
        grew = False
        for name, (_, bases) in classes.items():
            if name not in reached and bases & reached:
                reached.add(name)
                grew = True
    return reached


def test_every_exception_class_derives_from_autopar_error():
    classes = _classes()
    builtin_exceptions = {name for name, value in vars(builtins).items()
                          if isinstance(value, type) and issubclass(value, BaseException)}
    exceptions = _closure(classes, builtin_exceptions) & set(classes)
    ours = _closure(classes, {"AutoparError"})
    strays = sorted(f"{classes[name][0]} {name}" for name in exceptions - ours - SIGNALS)
    assert not strays, "derive these from autopar.core.errors.AutoparError:\n" + "\n".join(strays)


def test_the_scan_sees_the_error_classes():
    classes = _classes()
    ours = _closure(classes, {"AutoparError"})
    assert {"ShardingError", "ScheduleError", "ConfigError", "CollectiveError", "CheckpointError"} <= ours


def test_the_base_and_the_new_classes_are_exported_lazily():
    from autopar.core.errors import AutoparError, ConfigError

    assert autopar.AutoparError is AutoparError
    assert autopar.ConfigError is ConfigError
    for name in ("MeshError", "ArgumentError", "ProgramError", "ModelStateError", "RuleError", "ReplayError",
                 "ShardingError", "TraceError", "PipelineError"):
        cls = getattr(autopar, name)
        assert issubclass(cls, AutoparError), name
        assert name in autopar.__all__


def test_a_bad_layout_is_a_config_error_and_still_a_value_error():
    from autopar.core.config import ParallelConfig

    with pytest.raises(autopar.ConfigError, match="tp must be >= 1"):
        ParallelConfig(tp=0)
    with pytest.raises(ValueError):
        ParallelConfig(tp=0)
