"""The project's modules in layers, read from their import statements: each module imports only from its own layer
or the layers below it, no import circle exists, and no module of attention/ uses another module's private names
(tests/runs/test_layers.py holds the code to it).

    python -m scripts.layers            # the layers, their modules, and every import that breaks a rule
    python -m scripts.layers --imports  # also every import of a project module made inside a function

A module's layer is that of the longest prefix of its name in LAYERS. Inside a layer any import is allowed (but
no circle). An import from a lower layer to a higher one, or one made inside a function, is allowed only when it
is listed below with its reason.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NOT_MODULES = ("tests", "docs", "configs", "out", "wandb")  # folders of Python files that are no modules (configs
# are read by config.py, not imported)

# bottom to top: (layer, module name prefixes)
LAYERS = (
    ("common", ("common",)),
    ("attention", ("attention",)),
    ("config", ("config",)),  # ModelConfig's fields include the settings the variants declare (attention/registry.py)
    ("model", ("model",)),
    ("data", ("data",)),
    ("runs", ("runtime", "training")),
    ("evaluation", ("eval",)),
    ("entry points", ("train", "sample", "export", "eval.__main__", "scripts", "examples")),
)

# (importer, imported) -> why the import runs up the layers
UPWARD = {}

# (importer, imported) -> why the import is made inside a function rather than at the top of the module
LATE = {
    ("attention.ops.span.op", "attention.ops.span.triton_kernels"): "Triton may be absent, and its interpreter reads "
                                                                      "TRITON_INTERPRET as the kernels are defined",
    ("attention.ops.moba.op", "attention.ops.moba.triton_kernels"): "the same as span attention's kernels",
    ("eval.hf_model", "runtime.hf_gpt"): "imports transformers, after the check that it is installed",
    ("runtime.pretrained", "runtime.hf_gpt"): "imports transformers, which training needs only for init_from=gpt2 "
                                              "or hf:",
    ("scripts.sa.hf_window_sweep", "eval.lm_eval_adapter"): "imports lm_eval, an optional package the script checks "
                                                            "for first",
}


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int
    late: bool  # made inside a function


def modules(root: Path = REPO) -> dict[str, Path]:
    """Every module of the project by dotted name (a package by its __init__): the root's modules, its packages'
    and the examples' (not whatever else a clone holds, such as a virtual environment)."""
    tops = [path for path in root.iterdir() if path.name not in NOT_MODULES and not path.name.startswith(".")
            and (path.suffix == ".py" or (path / "__init__.py").exists() or path.name == "examples")]
    found = {}
    for path in sorted(p for top in tops for p in ([top] if top.is_file() else top.rglob("*.py"))):
        parts = path.relative_to(root).with_suffix("").parts
        if any(part.startswith(".") for part in parts):
            continue
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        found[".".join(parts)] = path
    return found


def imports(found: dict[str, Path]) -> list[Import]:
    """The imports of project modules in each module (the most specific module an import names)."""
    def owner(name: str) -> str | None:
        while name and name not in found:
            name = name.rpartition(".")[0]
        return name or None

    result = set()
    for name, path in found.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]

        def visit(node, late):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.Import):
                    targets = [alias.name for alias in child.names]
                elif isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:
                        parts = package.split(".")[:len(package.split(".")) - child.level + 1]
                        base = ".".join(parts + ([base] if base else []))
                    # `from package import module` names the module; `from module import name` the module
                    targets = [f"{base}.{alias.name}" if owner(f"{base}.{alias.name}") == f"{base}.{alias.name}"
                               else base for alias in child.names]
                else:
                    visit(child, late or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
                    continue
                for target in targets:
                    imported = owner(target)
                    if imported and imported != name:
                        result.add(Import(name, imported, child.lineno, late))

        visit(ast.parse(path.read_text(), str(path)), False)
    return sorted(result, key=lambda i: (i.importer, i.line, i.imported))


PRIVATE_CHECKED = ("attention",)  # packages whose modules use no private name of another module


def private_uses(found: dict[str, Path], packages=PRIVATE_CHECKED) -> list[tuple[str, int, str]]:
    """(module, line, what) for each private name (one leading underscore) a module of these packages takes from
    another project module: `from m import _name`, or `m._name` on a project module it imported. A name used across
    modules is part of its module's interface, so it has a public name."""
    result = []
    for name, path in found.items():
        if name.split(".")[0] not in packages:
            continue
        tree = ast.parse(path.read_text(), str(path))
        aliases = {}  # local name -> project module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in {
                    n.split(".")[0] for n in found}:
                for alias in node.names:
                    if f"{node.module}.{alias.name}" in found:
                        aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                    elif alias.name.startswith("_") and not alias.name.startswith("__"):
                        result.append((name, node.lineno, f"from {node.module} import {alias.name}"))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in found:
                        aliases[alias.asname or alias.name] = alias.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                    and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and aliases[node.value.id] != name:
                result.append((name, node.lineno, f"{node.value.id}.{node.attr}"))
    return sorted(result)


def layer_of(name: str) -> int:
    best, layer = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, layer = len(prefix), i
    if layer is None:
        raise KeyError(f"{name} is in no layer: add its package or module to scripts/layers.py's LAYERS")
    return layer


def circles(edges: list[Import]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm), each sorted."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.importer, set()).add(e.imported)
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def upward(edges: list[Import]) -> list[Import]:
    return [e for e in edges if layer_of(e.imported) > layer_of(e.importer)]


def late(edges: list[Import]) -> list[Import]:
    return [e for e in edges if e.late]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.layers", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--imports", action="store_true",
                        help="also list every import of a project module made inside a function, with its reason")
    args = parser.parse_args(argv)
    found = modules()
    edges = imports(found)
    for number in reversed(range(len(LAYERS))):
        members = [name for name in found if layer_of(name) == number]
        # a package wholly in this layer is named once
        tops = {m.split(".")[0] for m in members}
        whole = {top for top in tops if any("." in n for n in found if n.startswith(top + "."))
                 and all(layer_of(n) == number for n in found if n.split(".")[0] == top)}
        shown = sorted(f"{top}/" for top in whole) + [m for m in members if m.split(".")[0] not in whole]
        print(f"{number + 1}. {LAYERS[number][0]}: {', '.join(shown)}")
    problems = 0
    for group in circles(edges):
        problems += 1
        print(f"circle: {' -> '.join(group)}")
    for e in upward(edges):
        reason = UPWARD.get((e.importer, e.imported))
        problems += reason is None
        print(f"upward: {found[e.importer].relative_to(REPO)}:{e.line} imports {e.imported}"
              + (f" ({reason})" if reason else ": not listed in scripts/layers.py's UPWARD"))
    for e in late(edges):
        reason = LATE.get((e.importer, e.imported))
        problems += reason is None
        if reason is None or args.imports:
            print(f"inside a function: {found[e.importer].relative_to(REPO)}:{e.line} imports {e.imported}"
                  + (f" ({reason})" if reason else ": not listed in scripts/layers.py's LATE"))
    private = private_uses(found)
    for importer, line, what in private:
        problems += 1
        print(f"private name: {found[importer].relative_to(REPO)}:{line} uses {what} (give it a public name)")
    print(f"{len(found)} modules, {len(edges)} imports of project modules ({len(late(edges))} inside functions), "
          f"{len(upward(edges))} upward, {len(circles(edges))} circles, {len(private)} private names used across "
          f"modules of {', '.join(PRIVATE_CHECKED)}/: "
          + ("every rule holds" if not problems else f"{problems} problems"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
