"""Imports point one way (DESIGN.md 2): model, kv_cache <- engine <- transfer, store <-
cluster <- api, cli. This walks every module's imports and fails when a layer reaches up."""
from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

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


# Inside cluster/ (issue 17): the router is pure logic, the worker knows only the protocol,
# the runtime only how to start a worker; the launcher (composition root) sees everything.
CLUSTER_ALLOWED = {
    "codec": set(),
    "protocol": {"codec", "fault_spec", "protocol_store"},
    "protocol_store": set(),  # the KV store's messages, re-exported by protocol
    "fault_spec": set(),  # InjectFault's payload: fault kinds and where they fire
    "auth": set(),  # control-plane keys (CURVE): shared by both ends and the runtimes
    "heap": set(),  # a serving process's startup heap, frozen (frontend and workers)
    "router": {"codec", "protocol"},  # shared enums (Role); nothing of the other parts
    "worker": {"protocol", "auth", "heap"},
    "runtime": {"worker", "protocol", "auth"},
    "frontend": {"protocol", "router", "auth"},
    "planner": {"protocol", "router"},  # pure sizing logic + its actuator (through Pools)
    "specs": {"auth", "protocol", "runtime", "worker"},  # the launcher's worker specs
    # keeps the workers running: restarts, kills the hung (the launcher's own handles)
    "supervisor": {"runtime", "frontend", "planner"},
    "launcher": {"codec", "protocol", "auth", "router", "frontend", "worker", "runtime",
                 "planner", "specs", "supervisor"},
    "__init__": set(),
}


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _imports(path: pathlib.Path) -> set[str]:
    """Every splitserve module this file imports, TYPE_CHECKING blocks included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("splitserve.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.startswith("splitserve."):
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def test_cluster_parts_point_one_way() -> None:
    cluster = PKG / "cluster"
    violations = []
    for path in cluster.rglob("*.py"):
        part = path.relative_to(cluster).parts[0].removesuffix(".py")
        assert part in CLUSTER_ALLOWED, f"add cluster/{part} to CLUSTER_ALLOWED"
        for name in _imports(path):
            bits = name.split(".")
            if bits[:2] != ["splitserve", "cluster"] or len(bits) < 3:
                continue
            used = bits[2]
            if used != part and used not in CLUSTER_ALLOWED[part]:
                violations.append(f"cluster/{path.relative_to(cluster)} imports {name}")
    assert not violations, "\n".join(violations)


def test_no_import_cycles() -> None:
    """No two modules import each other, directly or around a circle (TYPE_CHECKING
    imports count: a friend class hidden behind one is still a circle)."""
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph = {name: {m for m in _imports(path) if m in modules and m != name}
             for name, path in modules.items()}
    # A package's __init__ re-exporting its own modules is not a circle.
    for name in graph:
        graph[name] = {m for m in graph[name] if not name.startswith(m + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        stack.append(name)
        for nxt in sorted(graph[name]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state:
            cycle = visit(name)
            assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cli_the_bench_client_and_the_http_layer_load_no_torch() -> None:
    """The package's promise (splitserve/__init__.py): light users do not pay for torch,
    ~1.2-2 s of import and ~200-300 MB. `splitserve --help` and `splitserve bench` never
    load it, nor does importing the HTTP server, nor the layout's profile key (the
    frontend runs no model); the engine's users (workers, `splitserve chat`) load it when
    they build one."""
    code = ("import sys, splitserve.cli, splitserve.bench.command, splitserve.api.serve; "
            "from splitserve.cluster.planner.profile import profile_key; "
            "from splitserve.config import ServeConfig; "
            "profile_key(ServeConfig().engine_args(), 1); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:5])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.strip() == "[]", done.stdout


def test_only_the_kernels_binding_files_include_pybind11_and_none_the_cpp_frontend() -> None:
    """`<torch/extension.h>` (torch's whole C++ frontend + the bindings) cost each kernel
    file ~31 s of compile, 7 files on 2 cores ~2 minutes of every fresh setup; ATen's
    tensor costs ~2 s. Only the files that bind to Python include pybind11."""
    csrc = PKG / "model" / "kernels" / "csrc"
    binding = {"exact.cpp", "decoder.cpp", "helpers.cpp"}
    for path in sorted(csrc.iterdir()):
        includes = re.findall(r"^#include <([^>]+)>", path.read_text(), re.MULTILINE)
        assert not {"torch/extension.h", "torch/all.h", "torch/python.h"} & set(includes), path
        if path.name not in binding:
            assert not [i for i in includes if "pybind" in i], path
