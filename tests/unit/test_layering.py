"""The house's rules on imports, read from the source with `ast` (lazy imports inside functions count too).

* The engine subsystems (`engines/embedded`, `remote`, `serve`, `launch`) import only the rooms below them:
  `embedded` and `remote` know nothing of each other, of `serve` or of `launch`; only the registry (and the
  `sglang` kind's builders in `launch`) put them together.
* `lora_rl_core/adapters` never reaches into the store (the store reads adapters, not the other way round).
* The library never imports the harness, the tests, the benchmarks, the flows, the tasks or the CLI; the
  benchmarks and the harness never import the test tree.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENGINES = "lora_rl_core.engines"


def imported_modules(folder: Path) -> dict[str, set[str]]:
    """`{file: every module it imports}` for `folder` (a file, or the Python files under a folder)."""
    out: dict[str, set[str]] = {}
    for path in [folder] if folder.is_file() else sorted(folder.rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
        out[str(path.relative_to(ROOT))] = names
    return out


def offenders(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{file} imports {name}"
        for file, names in imported_modules(ROOT / folder).items()
        for name in sorted(names)
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    ]


@pytest.mark.parametrize(
    ("subsystem", "forbidden"),
    [
        ("embedded", ("remote", "serve", "launch", "registry", "multi")),
        ("remote", ("embedded", "serve", "launch", "registry")),
        ("serve", ("remote", "launch", "registry", "multi")),
        ("launch", ("embedded", "serve", "registry")),
    ],
)
def test_engine_subsystems_import_only_what_lies_below_them(subsystem, forbidden):
    assert not offenders(f"lora_rl_core/engines/{subsystem}", tuple(f"{ENGINES}.{f}" for f in forbidden))


def test_low_rooms_import_no_engine_subsystem():
    low = ("base", "spec", "multi")
    forbidden = tuple(f"{ENGINES}.{f}" for f in ("embedded", "remote", "serve", "launch", "registry"))
    assert not [o for name in low for o in offenders(f"lora_rl_core/engines/{name}.py", forbidden)]


def test_the_check_sees_imports_where_they_are():
    """The registry is where the subsystems meet: the check must find that (else every rule passes vacuously)."""
    assert offenders("lora_rl_core/engines/registry.py", (f"{ENGINES}.embedded", f"{ENGINES}.launch"))
    assert offenders("lora_rl_core/engines/launch/sglang.py", (f"{ENGINES}.remote",))


def test_adapters_never_reach_into_the_store():
    assert not offenders("lora_rl_core/adapters", ("lora_rl_core.store",))


def test_the_library_imports_nothing_above_it():
    above = ("lora_rl_testing", "tests", "benchmarks", "flows", "tasks", "cli", "prefect")
    assert not offenders("lora_rl_core", above)


@pytest.mark.parametrize("folder", ["benchmarks", "lora_rl_testing"])
def test_benchmarks_and_the_harness_never_import_the_test_tree(folder):
    assert not offenders(folder, ("tests",))
