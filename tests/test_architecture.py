"""The layering of the code: no module of embbench or baselines imports, directly or through
others, a module that imports it back; and the launcher (the parent process) never imports
the runner (a cell's rank).

Imports inside functions count (they run, only later); imports under ``if TYPE_CHECKING:``
do not (they never run, and only name types in annotations).
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("embbench", "baselines")


def _modules(root: Path) -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported_names(module: str, path: Path) -> dict[str, int]:
    """Every dotted name ``module`` imports (``from a import b`` gives ``a`` and ``a.b``), with
    the line of its first import."""
    names: dict[str, int] = {}
    is_package = path.name == "__init__.py"

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                names.setdefault(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package this module is in (or is)
                package = module.split(".")[: None if is_package else -1]
                package = package[: len(package) - node.level + 1]
                base = ".".join(package + ([node.module] if node.module else []))
            names.setdefault(base, node.lineno)
            for alias in node.names:
                names.setdefault(f"{base}.{alias.name}", node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return names


def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """``graph[a][b]``: the line at which module ``a`` first imports module ``b`` of the project."""
    modules = _modules(root)

    def owner(name: str) -> str | None:  # the project module a dotted name lives in
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, {})
        for name, line in _imported_names(module, path).items():
            target = owner(name)
            # importing a submodule of one's own package (or the package itself) is not a cycle
            if target and target != module and not module.startswith(target + "."):
                edges.setdefault(target, line)
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle of the graph as ``[a, b, ..., a]``, or None when it is acyclic."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_no_module_imports_itself_back():
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {_describe(cycle, graph)}"


def test_the_launcher_does_not_import_the_runner():
    graph = import_graph()
    assert "embbench.runner" in graph and "embbench.launch" in graph
    assert "embbench.runner" not in graph["embbench.launch"], (
        f"embbench/launch.py imports embbench.runner at line {graph['embbench.launch']['embbench.runner']}: "
        "the parent process must not need the cell worker (put what both use in a module below them)")


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import(tmp_path):
    for package, files in {"embbench": {"a.py": "from embbench import b\n",
                                        "b.py": "def f():\n    from embbench.c import x\n",
                                        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                "    from embbench import b\nfrom embbench.a import y\n"},
                           "baselines": {"d.py": "from embbench import c\n"}}.items():
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
        for name, text in files.items():
            (tmp_path / package / name).write_text(text)
    graph = import_graph(tmp_path)
    assert graph["embbench.c"] == {"embbench.a": 4}  # the TYPE_CHECKING import does not count
    assert find_cycle(graph) == ["embbench.c", "embbench.a", "embbench.b", "embbench.c"]  # reached from baselines.d
    assert _describe(find_cycle(graph), graph) == \
        "embbench.c (line 4) -> embbench.a (line 1) -> embbench.b (line 2) -> embbench.c"


def embbench_imports_outside_the_plugin_interface(root: Path = ROOT) -> list[str]:
    """``module (line n): name`` for every import by a module of baselines/ of embbench other
    than :mod:`embbench.plugin`'s public names."""
    import embbench.plugin

    public = {"embbench.plugin", *(f"embbench.plugin.{name}" for name in embbench.plugin.__all__)}
    found = []
    for module, path in _modules(root).items():
        if module.startswith("baselines"):
            found += [f"{module} (line {line}): {name}" for name, line in _imported_names(module, path).items()
                      if (name == "embbench" or name.startswith("embbench.")) and name not in public]
    return sorted(found)


def test_baselines_use_only_the_public_plugin_interface():
    """DESIGN.md: baselines/ uses exactly the public interface a third party would use."""
    assert embbench_imports_outside_the_plugin_interface() == []


def test_the_plugin_check_finds_an_import_from_embbench_s_inside(tmp_path):
    (tmp_path / "baselines").mkdir()
    (tmp_path / "embbench").mkdir()
    (tmp_path / "baselines" / "mine.py").write_text(
        "from embbench.plugin import Strategy\nfrom embbench.plugin import not_public\n"
        "def f():\n    from embbench.embedding import RowStore\n")
    assert embbench_imports_outside_the_plugin_interface(tmp_path) == [
        "baselines.mine (line 2): embbench.plugin.not_public",
        "baselines.mine (line 4): embbench.embedding", "baselines.mine (line 4): embbench.embedding.RowStore"]


def test_every_public_plugin_name_is_documented():
    """Each name of embbench.plugin has its own docstring and is listed in the module's."""
    import embbench.plugin

    for name in embbench.plugin.__all__:
        value = getattr(embbench.plugin, name)
        assert name in embbench.plugin.__doc__, f"embbench.plugin's docstring does not list {name}"
        if callable(value):
            assert (value.__doc__ or "").strip(), f"embbench.plugin.{name} has no docstring"


def _commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    """``(words, function)`` for every command a parser reaches, sub-subcommands included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if sub.get_default("func") is None:
                    yield from _commands(sub, prefix + (name,))
                else:
                    yield prefix + (name,), sub.get_default("func")


def test_each_command_lives_in_its_own_module_of_the_cli_package():
    """``embbench X ...`` is parsed and run by ``embbench/cli/X.py`` (its ``register`` and its
    ``main``), not by one file holding every command."""
    import importlib

    from embbench.cli import build_parser

    found = dict(_commands(build_parser()))
    assert ("run",) in found and ("data", "prepare") in found and ("trace", "record") in found
    for words, func in found.items():
        assert (ROOT / "embbench" / "cli" / f"{words[0]}.py").is_file(), f"embbench {words[0]}: no embbench/cli/{words[0]}.py"
        module = importlib.import_module("embbench.cli." + words[0])
        assert func.__module__ == module.__name__, \
            f"embbench {' '.join(words)} runs {func.__module__}.{func.__name__}, not a function of {module.__name__}"


#: How long a module may grow before it says, at its top, why it stays whole.
MAX_LINES = 600
#: The line of a module's docstring that gives that reason.
REASON = "Longer than 600 lines because:"


def long_modules(root: Path = ROOT) -> list[str]:
    """``path: N lines`` for each module of the packages longer than :data:`MAX_LINES` whose
    docstring has no line starting with :data:`REASON` followed by the reason."""
    found = []
    for path in _modules(root).values():
        lines = len(path.read_text().splitlines())
        if lines <= MAX_LINES:
            continue
        doc = ast.get_docstring(ast.parse(path.read_text(), str(path))) or ""
        if not any(line.startswith(REASON) and line[len(REASON):].strip() for line in doc.splitlines()):
            found.append(f"{path.relative_to(root)}: {lines} lines")
    return sorted(found)


def test_no_module_is_longer_than_600_lines_without_saying_why_at_its_top():
    assert long_modules() == [], (f"split these along a seam, or give their docstring a line '{REASON} ...': "
                                  f"{long_modules()}")


def test_the_length_check_finds_a_long_module_without_a_reason(tmp_path):
    body = "x = 1\n" * MAX_LINES
    for package, files in {"embbench": {"short.py": body, "long.py": '"""A module."""\n' + body,
                                        "empty_reason.py": f'"""A module.\n\n{REASON}\n"""\n' + body,
                                        "said.py": f'"""A module.\n\n{REASON} it is one table.\n"""\n' + body},
                           "baselines": {"long.py": body + "y = 2\n"}}.items():
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
        for name, text in files.items():
            (tmp_path / package / name).write_text(text)
    assert long_modules(tmp_path) == ["baselines/long.py: 601 lines", "embbench/empty_reason.py: 604 lines",
                                      "embbench/long.py: 601 lines"]
