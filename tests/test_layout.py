"""The harness's layout as harness/__init__.py states it: its index lists every module once, in
an order where each imports only modules above it; no module imports one of the worker side; no
module imports another's private names."""
from __future__ import annotations

import ast
import re

import harness
from helpers import REPO

HARNESS = REPO / "harness"
INDEX_LINE = re.compile(r"    ([a-z_.]+) +(trusted|worker|both)  +\S")  # '    worker.wire   both   what it holds'
# prepare.py exports these by the organisers' names, underscore and all (see harness/loader.py)
PREPARE_PRIVATE_NAMES = {"_row_groups_for_split", "_document_batches", "_row_group_texts"}


def index() -> dict[str, str]:
    """module -> side, in the index's order."""
    return {m.group(1): m.group(2) for m in map(INDEX_LINE.match, harness.__doc__.splitlines()) if m}


def modules() -> dict[str, object]:
    """module name ('worker.wire') -> path, for every file of harness/ but the packages' own."""
    return {".".join(p.relative_to(HARNESS).with_suffix("").parts): p
            for p in sorted(HARNESS.rglob("*.py")) if p.name != "__init__.py"}


def harness_imports(path) -> list[tuple[str, list[str]]]:
    """(module imported, names taken from it) for every import of a harness module in the file,
    function-local ones included. `from harness.worker import wire` imports the module worker.wire."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name.removeprefix("harness."), []) for a in node.names if a.name.startswith("harness.")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "harness":
            package = node.module.removeprefix("harness").lstrip(".")
            for a in node.names:
                submodule = f"{package}.{a.name}".lstrip(".")
                if (HARNESS / f"{submodule.replace('.', '/')}.py").is_file():
                    found.append((submodule, []))
                else:
                    found.append((package, [a.name]))
    return found


def test_the_index_lists_every_module_once():
    listed = [m.group(1) for m in map(INDEX_LINE.match, harness.__doc__.splitlines()) if m]
    assert len(listed) == len(set(listed))
    assert sorted(listed) == sorted(modules())


def test_each_module_imports_only_modules_above_it_and_none_of_the_worker_side():
    order, sides = list(index()), index()
    for name, path in modules().items():
        for imported, _ in harness_imports(path):
            assert imported in order and order.index(imported) < order.index(name), f"{name} imports {imported}"
            assert sides[imported] != "worker", f"{name} imports {imported}, which runs beside participant code"


def test_the_packages_own_files_import_nothing():
    for init in sorted(HARNESS.rglob("__init__.py")):
        tree = ast.parse(init.read_text())
        assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))], init


def test_no_module_imports_another_modules_private_names():
    for path in [*modules().values(), REPO / "prepare.py"]:
        allowed = PREPARE_PRIVATE_NAMES if path.name == "prepare.py" else set()
        for imported, names in harness_imports(path):
            private = [n for n in names if n.startswith("_") and n not in allowed]
            assert not private, f"{path.relative_to(REPO)} imports {private} from {imported}"
