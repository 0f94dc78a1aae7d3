"""The package's import graph shows its architecture: no circles, and no arrow back up.

Every import counts, the ones inside functions too (a lazy import is still a dependency)."""
import ast
import pathlib

import networkx as nx

import deeprec

ROOT = pathlib.Path(deeprec.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> nx.DiGraph:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                names = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                target = resolve(name) if name.startswith("deeprec") else None
                if target and target != module and not module.startswith(target + "."):
                    graph.add_edge(module, target)
    return graph


def _packages(graph: nx.DiGraph, depth) -> nx.DiGraph:
    """Edges between packages (`depth(name)` components of a module's name)."""
    out = nx.DiGraph()
    for a, b in graph.edges():
        pa, pb = depth(a), depth(b)
        if pa != pb and not pb.startswith(pa + ".") and not pa.startswith(pb + "."):
            out.add_edge(pa, pb)
    return out


def _top(name: str) -> str:
    parts = name.split(".")
    if parts[:2] == ["deeprec", "distributed"] and len(parts) > 3:
        return ".".join(parts[:3])  # ps/ and collective/ count as packages of their own
    return ".".join(parts[:2])


def test_no_module_imports_itself_through_others():
    graph = _import_graph()
    assert graph.number_of_edges() > 100  # the graph was really read
    cycles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert not cycles, cycles


def test_packages_form_layers():
    packages = _packages(_import_graph(), _top)
    cycles = list(nx.simple_cycles(packages))
    assert not cycles, cycles
    below = nx.descendants
    # the lower floors never reach the top floor
    for low in ("deeprec.ops", "deeprec.nn", "deeprec.optim", "deeprec.graph", "deeprec.data", "deeprec.models"):
        reached = below(packages, low) if low in packages else set()
        assert not reached & {"deeprec.trainer", "deeprec.cli", "deeprec.runtime", "deeprec.distributed.ps",
                              "deeprec.distributed.collective", "deeprec.serving"}, (low, reached)


def test_the_trainer_names_no_way_of_training_and_ps_and_collective_stay_apart():
    graph = _import_graph()
    for module in ("deeprec.trainer", "deeprec.train_config", "deeprec.runtime.strategy", "deeprec.runtime.updater"):
        assert not [t for t in graph.successors(module) if t.startswith("deeprec.distributed")], module
    for a, b in (("deeprec.distributed.ps", "deeprec.distributed.collective"),
                 ("deeprec.distributed.collective", "deeprec.distributed.ps")):
        crossing = [(m, t) for m, t in graph.edges() if m.startswith(a) and t.startswith(b)]
        assert not crossing, crossing
