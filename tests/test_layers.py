"""tfdist's imports run one way: no cycle, and no module imports a higher layer (imports inside
functions count). The layers are written down in tfdist/__init__.py's docstring."""

import ast
import pathlib

import tfdist

PACKAGE = pathlib.Path(tfdist.__file__).resolve().parent

# The first matching prefix decides a module's layer; tfdist/__init__.py (the root) wires them all.
LAYERS = [
    (0, ("errors", "state", "cluster", "patching", "startup", "extras", "atomic_files", "stop_signals", "events", "run",
         "cli", "launch", "sharding", "fit_start")),
    (1, ("buckets", "autotune", "compression", "fusion", "devices", "watchdog", "kvstore", "preemption", "step_clock",
         "stragglers", "timeline", "save_rounds", "replica_collectives")),
    (2, ("precision", "process_group")),
    (3, ("strategy",)),
    (4, ("keras_fixes", "tf_fixes", "runtime_hooks", "ray_fixes", "checkpoint")),
    (5, ("collectives", "ranks", "optimizer", "callbacks", "data")),
    (6, ("horovod", "ray_train", "bench", "doctor")),
]


def layer(module: str) -> int:
    name = module.removeprefix("tfdist.")
    for number, prefixes in LAYERS:
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return number
    raise AssertionError(f"{module} has no layer: add it to LAYERS and to tfdist/__init__.py's docstring")


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports() -> dict[str, set[str]]:
    """module -> the tfdist modules it imports, at any depth of its code."""
    mods = modules()
    graph = {name: set() for name in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
            else:
                continue
            for target in targets:
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def test_every_module_has_a_layer_and_imports_only_its_own_or_lower_ones():
    upward = [f"{src} (layer {layer(src)}) imports {dst} (layer {layer(dst)})"
              for src, targets in imports().items() if src != "tfdist" for dst in sorted(targets)
              if layer(dst) > layer(src)]
    assert upward == []


def test_no_import_cycle():
    graph = imports()
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(node):  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert cycles == []
