"""Imports point one way (DESIGN.md 2): model, kv_cache <- engine <- transfer, store <-
cluster <- api, cli. This walks every module's imports and fails when a layer reaches up."""
from __future__ import annotations

import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parents[1] / "splitserve"

# What each layer may import from splitserve (besides itself).
ALLOWED = {
    "errors": set(),
    "config": {"errors"},
    "model": {"errors", "config"},
    "kv_cache": {"errors", "config"},
    "engine": {"errors", "config", "model", "kv_cache"},
    "transfer": {"errors", "config", "model", "kv_cache", "engine"},
    "store": {"errors", "config", "model", "kv_cache", "engine", "transfer"},
    "cluster": {"errors", "config", "model", "kv_cache", "engine", "transfer", "store"},
    "api": {"errors", "config", "model", "kv_cache", "engine", "transfer", "store", "cluster"},
    "bench": {"errors", "config"},
    "cli": {"errors", "config", "model", "kv_cache", "engine", "transfer", "store", "cluster",
            "api", "bench"},
    "__init__": {"engine"},
}


def _layer(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0].removesuffix(".py")


def _imported_layers(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "splitserve" and len(parts) > 1:
                found.add(parts[1])
    return found


def test_every_module_is_in_a_known_layer() -> None:
    layers = {_layer(p) for p in PKG.rglob("*.py")}
    assert layers <= ALLOWED.keys(), f"add {layers - ALLOWED.keys()} to ALLOWED"


def test_imports_point_one_way() -> None:
    violations = []
    for path in PKG.rglob("*.py"):
        layer = _layer(path)
        for used in _imported_layers(path) - {layer}:
            if used not in ALLOWED[layer]:
                violations.append(f"{path.relative_to(PKG)} imports splitserve.{used}")
    assert not violations, "\n".join(violations)
