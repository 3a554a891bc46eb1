"""The code base's shape, as the layering issue measured it: modules, import cycles, longest functions.

    .venv/bin/python scripts/code_metrics.py            # this checkout
    .venv/bin/python scripts/code_metrics.py /path/to/another/checkout

The import graph is the one ``tests/test_layering.py`` enforces (read from the
source, imports inside functions included).
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def _layering():
    spec = importlib.util.spec_from_file_location("test_layering", HERE / "tests" / "test_layering.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(root: Path) -> None:
    layering = _layering()
    layering.ROOT = root
    graph = layering.import_graph()
    cycles = layering._cycles(graph)
    lengths = []
    for pkg in layering.PACKAGES:
        for path in (root / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lengths.append((node.end_lineno - node.lineno + 1, f"{path.relative_to(root)}:{node.name}"))
    lengths.sort(reverse=True)
    print(f"modules: {len(graph)}")
    print(f"import cycles: {len(cycles)}" + "".join(f"\n  {' <-> '.join(c)}" for c in cycles))
    print(f"functions over 60 lines: {sum(n > 60 for n, _ in lengths)}; longest:")
    for n, name in lengths[:8]:
        print(f"  {n:4d}  {name}")


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else HERE)
