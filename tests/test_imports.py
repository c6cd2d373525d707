"""The layering of NOTES.md ("The library's layout"), checked from the source: no module of the
library imports, even inside a function, anything that leads back to itself; the mechanism layer
(`elastic_kernels/`) never imports the library (`elastic_kernels.api`, the `python_api/` folder);
the library's rooms never import the application (`finetune/`)."""

from __future__ import annotations

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def module_names(folder: str, package: str) -> dict[str, str]:
    """Dotted module name -> file, for every .py under `folder` installed as `package`."""
    out = {}
    for d, _, files in os.walk(folder):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                parts = os.path.relpath(path, folder)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                out[".".join([package, *parts])] = path
    return out


def import_graph(modules: dict[str, str], external: dict[str, str] | None = None) -> dict[str, set[str]]:
    """Module -> the modules (of `modules` or `external`) its import statements name, wherever
    they stand. `from pkg import sub` names the submodule only (the package is already being
    imported when a submodule runs); `from pkg import name` names pkg."""
    known = dict(modules, **(external or {}))
    graph = {}
    for name, path in modules.items():
        is_package = path.endswith("__init__.py")
        deps: set[str] = set()
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in known)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                subs = [f"{source}.{a.name}" for a in node.names]
                deps.update(s for s in subs if s in known)
                if source in known and not all(s in known for s in subs):
                    deps.add(source)
        deps.discard(name)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root] & graph.keys())))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w] & graph.keys()))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


LIBRARY = module_names(os.path.join(REPO, "python_api"), "elastic_kernels.api")
MECHANISM = {n: p for n, p in module_names(os.path.join(REPO, "elastic_kernels"), "elastic_kernels").items()}


def test_the_checker_finds_a_circle_and_a_layer_crossing(tmp_path):
    """The checks below can fail: a circle through a function-level import and a submodule
    import are found; `from pkg import sub` alone is not a circle."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("from .b import f\n")
    (pkg / "b.py").write_text("def f():\n    from . import c\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    graph = import_graph(module_names(str(pkg), "pkg"))
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
    (pkg / "c.py").write_text("x = 1\n")
    assert cycles(import_graph(module_names(str(pkg), "pkg"))) == []


def test_no_import_circle_in_the_library_or_the_mechanism():
    graph = import_graph(dict(LIBRARY, **MECHANISM))
    assert cycles(graph) == []


def test_the_mechanism_layer_never_imports_the_library():
    graph = import_graph(MECHANISM, external=LIBRARY)
    crossing = {m: sorted(d for d in deps if d.startswith("elastic_kernels.api")) for m, deps in graph.items()}
    assert {m: d for m, d in crossing.items() if d} == {}


def test_the_rooms_never_import_the_application():
    graph = import_graph(LIBRARY)
    app = "elastic_kernels.api.finetune"
    crossing = {m: sorted(d for d in deps if d == app or d.startswith(app + "."))
                for m, deps in graph.items() if not (m == app or m.startswith(app + "."))}
    assert {m: d for m, d in crossing.items() if d} == {}
