"""Check jspec's import structure: no function-local imports of jspec modules (they hide import
cycles), except in the command-line entry points listed below, and no import cycles between
jspec modules at all.

    python scripts/check_imports.py        # exit 1 and list the offenders on failure
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "jspec"

# Command-line entry points may import subcommands where they run: `jspec bench` and
# `jspec train-head` pull heavy optional stacks (transformers/torch, matplotlib, optax/orbax), and
# train-head must initialise jax.distributed before the rest of the training stack loads.
LAZY_OK = {"jspec/cli.py", "jspec/bench/cli.py", "jspec/train/cli.py"}


# Layers, lowest first: a module may import only modules of its own layer or lower ones
# (longest matching prefix decides a module's layer).
LAYERS = [
    ["jspec", "jspec.cards", "jspec.compile_cache", "jspec.config", "jspec.sampling", "jspec.sharding", "jspec.kernels",
     "jspec.checkpoint", "jspec.checkpoint.errors", "jspec.checkpoint.layout", "jspec.refill", "jspec.user_cache"],
    ["jspec.model"],
    ["jspec.decode", "jspec.scoring"],
    ["jspec.heads"],
    ["jspec.checkpoint.gguf_io", "jspec.checkpoint.hf", "jspec.checkpoint.orbax_io", "jspec.checkpoint.eagle_format",
     "jspec.checkpoint.draft_format", "jspec.checkpoint.synthetic",
     "jspec.tokenizer", "jspec.tasks"],
    ["jspec.presets"],
    ["jspec.checkpoint.convert"],
    ["jspec.speculative", "jspec.speculative.state"],
    ["jspec.speculative.drafters", "jspec.speculative.verify", "jspec.speculative.policies"],
    ["jspec.speculative.engines"],
    ["jspec.speculative.factory", "jspec.speculative.config"],
    ["jspec.generate"],
    ["jspec.train", "jspec.bench"],
    ["jspec.cli"],
]


def layer_of(mod: str) -> int:
    best, rank = -1, None
    for i, names in enumerate(LAYERS):
        for name in names:
            if (mod == name or mod.startswith(name + ".")) and len(name) > best:
                best, rank = len(name), i
    if rank is None:
        raise SystemExit(f"{mod}: not in LAYERS; add it to scripts/check_imports.py")
    return rank


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve(node: ast.ImportFrom | ast.Import, mod: str, is_pkg: bool) -> list[str]:
    """Absolute jspec module names an import statement refers to (empty if not jspec)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "jspec"]
    if node.level:
        base = mod.split(".") if is_pkg else mod.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if target.split(".")[0] != "jspec":
        return []
    # `from pkg import name`: name may be a submodule
    return [f"{target}.{a.name}" for a in node.names] + [target]


def main() -> int:
    files = sorted(PKG.rglob("*.py"))
    modules = {module_name(f): f for f in files}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    problems = []
    for f in files:
        mod, rel = module_name(f), f.relative_to(PKG.parent).as_posix()
        tree = ast.parse(f.read_text())
        top = set(id(n) for n in tree.body)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            targets = [t for t in resolve(node, mod, f.name == "__init__.py") if t in modules]
            if not targets:
                continue
            if id(node) not in top:
                if rel not in LAZY_OK:
                    problems.append(f"{rel}:{node.lineno}: function-local import of {', '.join(sorted(set(targets)))}")
                continue
            # a submodule importing its own parent package is no cycle: the parent is already loading
            graph[mod].update(t for t in targets if t != mod and not mod.startswith(t + "."))
    # Importing a submodule imports its parent packages first.
    for m in list(graph):
        for t in list(graph[m]):
            parts = t.split(".")
            graph[m].update(".".join(parts[:i]) for i in range(2, len(parts)) if ".".join(parts[:i]) != m
                            and not m.startswith(".".join(parts[:i]) + "."))
    for m, targets in sorted(graph.items()):
        for t in sorted(targets):
            if layer_of(t) > layer_of(m):
                problems.append(f"layer order: {m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})")
    # cycles (Tarjan's strongly connected components)
    index, low, stack, on, sccs = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v); on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w); low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop(); on.discard(w); comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    problems += [f"import cycle: {' <-> '.join(c)}" for c in sccs]
    for p in problems:
        print(p)
    print(f"{len(modules)} modules, {sum(map(len, graph.values()))} top-level jspec imports: "
          f"{'OK' if not problems else f'{len(problems)} problem(s)'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
