"""The project's import map, read from the source (every `import`, also those inside functions): no cycles, the
layering of docs/layout.md, and no private name imported from another module.

A short AST walk rather than a library: it needs nothing installed and reads function-level imports, which is
where this project's lazy imports (and its past cycles) live."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("tasks", "flows", "hydra_plugins", "bench")
THIRD_PARTY = REPO / "bench" / "third_party"  # bench: no cycles, no private names; never imported by the product

# What a package may import from the project (prefixes; a package may always import itself and tasks.lazy).
# Read top down: each layer may import only layers below it.
LAYERS = {
    "tasks.store": (),  # content-addressed entries, keys, bookkeeping: nothing else of the project
    "tasks.demo": (),  # the demo's generated world and its scorer: numpy and PIL only
    # what goes in: images, captions, prompts, augmentation (tasks.plan: the plan's schema, which imports nothing)
    "tasks.data": ("tasks.store", "tasks.config", "tasks.config_schema", "tasks.plan"),
    "tasks.models": ("tasks.store", "tasks.config", "tasks.config_schema", "tasks.runtime", "tasks.data"),  # one adapter per family
    # its parts (docs/layout.md), each below the adapters: what the adapters share, the weights' readers, the
    # LoRA variants, and the tiny builders (which need nothing of an adapter: a family's tests build its model alone)
    "tasks.models.bases": ("tasks.config", "tasks.config_schema", "tasks.runtime", "tasks.data", "tasks.models.loading",
                           "tasks.models.lora_variants"),
    "tasks.models.loading": ("tasks.config", "tasks.config_schema",),
    "tasks.models.lora_variants": ("tasks.config", "tasks.config_schema",),
    "tasks.models.tiny": (),
    # the train node's parts; never tasks.train. The samples rendered during training are the sample node's
    # (and name prompts as validate plans them, texts as cache_text keys them)
    "tasks.training": ("tasks.store", "tasks.config", "tasks.config_schema", "tasks.plan", "tasks.runtime", "tasks.data", "tasks.models",
                       "tasks.items", "tasks.sample", "tasks.cache_text", "tasks.cache_latents", "tasks.validate"),
    # loraflow-lora: LoRA files (training.export's names and writer) and base models (the families' classes)
    "tasks.lora_tools": ("tasks.training", "tasks.models"),
}
NEVER = {  # importer prefix -> what it must never import, whatever the layers say
    "tasks": ("flows", "hydra_plugins", "prefect", "bench"),  # the pure core runs without Prefect
    "flows": ("bench",),  # benchmarks measure the product; it never needs them
}


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            if THIRD_PARTY in path.parents:  # another project's source, kept as it is (bench/musubi_source.sh)
                continue
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


MODULES = _modules()


def _resolve(importer: str, node: ast.ImportFrom | ast.Import) -> list[tuple[str, list[str]]]:
    """(project module, names imported from it) for one import statement."""
    out = []
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name.split(".")[0] in PACKAGES or alias.name == "prefect" or alias.name.startswith("prefect."):
                out.append((alias.name, []))
        return out
    base = node.module or ""
    if node.level:  # relative: from the importer's package
        package = importer.split(".") if MODULES[importer].name == "__init__.py" else importer.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    if not (base.split(".")[0] in PACKAGES or base.split(".")[0] == "prefect"):
        return out
    names = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        if sub in MODULES:  # `from tasks import cache_text`: the module itself
            out.append((sub, []))
        else:
            names.append(alias.name)
    if names:
        out.append((base, names))
    return out


def _is_main_block(node: ast.AST) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and isinstance(node.test.left, ast.Name)
            and node.test.left.id == "__name__")


def _walk(tree: ast.AST):
    """ast.walk without `if __name__ == "__main__":` bodies: an entry point runs a module as a program, it is
    not a dependency of the module (`python -m flows.train` hands over to flows/cli.py, which imports the flow)."""
    for node in ast.iter_child_nodes(tree):
        if _is_main_block(node):
            continue
        yield node
        yield from _walk(node)


def _imports() -> dict[str, dict[str, list[str]]]:
    """importer -> {imported project module: names}."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(dict)
    for name, path in MODULES.items():
        for node in _walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target, names in _resolve(name, node):
                    graph[name].setdefault(target, []).extend(names)
    return graph


GRAPH = _imports()


def _owner(module: str) -> str:
    """The module itself if it is a project module, else the nearest project package above it."""
    while module not in MODULES and "." in module:
        module = module.rsplit(".", 1)[0]
    return module


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for importer, targets in GRAPH.items():
        for target in targets:
            target = _owner(target)
            if target in MODULES and target != importer and not importer.startswith(target + "."):
                # a module importing its own package's __init__ (re-exports) is no cycle of two modules
                edges[importer].add(target)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(sorted(scc))

    for v in sorted(MODULES):
        if v not in index:
            visit(v)
    return out


def test_the_walk_sees_the_project():
    assert "tasks.train" in MODULES and "flows.train" in MODULES
    assert "tasks.cache_latents" in _edges()["tasks.train"]  # `from tasks import cache_latents`


def test_no_import_cycles():
    cycles = _cycles(_edges())
    assert not cycles, "import cycles (each a set of modules that import each other):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def _package(module: str) -> str | None:
    return next((p for p in sorted(LAYERS, key=len, reverse=True) if module == p or module.startswith(p + ".")), None)


def test_each_package_imports_only_the_layers_below_it():
    wrong = []
    for importer, targets in GRAPH.items():
        package = _package(importer)
        for target in targets:
            for prefix, banned in NEVER.items():
                if importer.startswith(prefix + ".") or importer == prefix:
                    wrong += [f"{importer} imports {target}" for b in banned if target == b or target.startswith(b + ".")]
            if package is None or not target.startswith(PACKAGES):
                continue
            allowed = (package, "tasks.lazy", *LAYERS[package])
            if not any(target == a or target.startswith(a + ".") for a in allowed):
                wrong.append(f"{importer} ({package}) imports {target}")
    assert not wrong, "imports that break the layering (tests/test_imports.py LAYERS):\n" + "\n".join(sorted(set(wrong)))


def test_no_private_name_is_imported_from_another_module():
    wrong = [f"{importer} imports {name} from {target}" for importer, targets in GRAPH.items()
             for target, names in targets.items() for name in names
             if name.startswith("_") and not name.startswith("__") and _owner(target) != importer]
    assert not wrong, "private names used across modules (make them public, or move the code):\n" + "\n".join(wrong)


def test_tests_share_helpers_through_support_not_each_others_private_names():
    """A helper two test files use lives, public, in tests/support.py (or another helper module); no test file
    imports a private name of another test file (issue 44)."""
    wrong = []
    for path in sorted((REPO / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and (REPO / "tests" / f"{node.module}.py").exists():
                wrong += [f"{path.name} imports {a.name} from {node.module}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert not wrong, "\n".join(wrong)


def test_the_plan_schema_imports_nothing_of_the_project():
    """tasks/plan.py is the schema every layer reads: it may import nothing of the project (else the layers that
    read it would reach whatever it imports)."""
    assert not GRAPH.get("tasks.plan"), GRAPH.get("tasks.plan")


def test_no_test_file_imports_another():
    """Tests share helpers through the public support modules (support.py, lora_fixtures.py, ...) and
    conftest.py's fixtures, never another test file: each test file runs alone."""
    wrong = []
    for path in sorted((REPO / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            wrong += [f"{path.name} imports {n}" for n in names if n.split(".")[0].startswith("test_")]
    assert not wrong, wrong
