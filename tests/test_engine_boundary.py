"""Outside splitserve/engine, an engine is used through its public methods and its KV
connector (engine/kv_connector.py), never through its scheduler or block pool: this walks
every module (and every test but the engine's own) and fails at `<...engine>.scheduler`
or `<...engine>.kv`."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
INTERNALS = {"scheduler", "kv"}
# The engine's own code and unit tests may look inside it.
EXEMPT = [ROOT / "splitserve" / "engine", ROOT / "tests" / "engine"]


def _names_an_engine(node: ast.expr) -> bool:
    """`engine`, `self.engine`, `pair.a.engine`, `src_engine`, ...: the heuristic is the
    name, since an AST knows no types."""
    if isinstance(node, ast.Name):
        return node.id.endswith("engine")
    return isinstance(node, ast.Attribute) and node.attr.endswith("engine")


def _reaches_inside(source: str, name: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Attribute) and node.attr in INTERNALS
                and _names_an_engine(node.value)):
            found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_nothing_outside_the_engine_reaches_into_its_scheduler_or_kv() -> None:
    paths = [p for folder in ("splitserve", "tests", "benchmarks")
             for p in (ROOT / folder).rglob("*.py")
             if not any(p.is_relative_to(exempt) for exempt in EXEMPT)]
    violations = [v for path in paths
                  for v in _reaches_inside(path.read_text(), str(path.relative_to(ROOT)))]
    assert not violations, ("use the engine's methods or its KV connector instead:\n"
                            + "\n".join(violations))


def test_the_check_sees_a_violation() -> None:
    source = ("a = self.engine.scheduler.requests\nb = pair.b.engine.kv.pool.num_used_blocks\n"
              "c = engine.config.scheduler.max_num_seqs\nd = self.kv.pool\n")
    assert sorted(_reaches_inside(source, "probe.py")) == [
        "probe.py:1: self.engine.scheduler", "probe.py:2: pair.b.engine.kv"]
