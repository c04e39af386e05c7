"""One name per concept: the moved-module shims stay gone, and no public top-level function or class name is defined
in two modules of the package (a second `check_output_dir` with another signature is how callers picked the wrong
one). Entry-point conventions (`main`, `build_parser`, `add_arguments`) and the per-architecture FLOPs interface
(`decode_flops` in each `core/flops_*.py`, reached through the registry) and the task generators' interface
(`make_split(split, n, seed, spec)` and `render` in each `data/*_task.py`, always called module-qualified) are the
allowed repeats."""

from __future__ import annotations

import ast
import importlib
import pathlib
from collections import defaultdict

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "hf_loops"
ENTRY_POINTS = {"main", "build_parser", "add_arguments"}
TASK_GENERATORS = {"data/depth_task.py", "data/hop_task.py"}
INTERFACES = {"decode_flops": {"core/flops_tah2.py", "core/flops_sgt.py", "core/flops_spiralformer.py"},
              "make_split": TASK_GENERATORS, "render": TASK_GENERATORS}
MOVED = ["hf_loops.analysis.flops_sgt", "hf_loops.analysis.flops_spiralformer", "hf_loops.analysis.flops_tah2",
         "hf_loops.training.sgt_selection", "hf_loops.conversion.outdir"]


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text(encoding="utf-8"))


def public_definitions() -> dict[str, list[str]]:
    where = defaultdict(list)
    for rel, tree in _modules():
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                where[node.name].append(rel)
    return where


def repeated(where: dict[str, list[str]]) -> dict[str, list[str]]:
    return {name: files for name, files in where.items()
            if len(files) > 1 and name not in ENTRY_POINTS and set(files) != INTERFACES.get(name)}


def test_no_public_name_is_defined_in_two_modules():
    assert repeated(public_definitions()) == {}


def test_the_check_sees_a_repeat():
    # the checker itself: a name in two modules is reported, an interface only with exactly its files
    assert repeated({"check_output_dir": ["core/outdir.py", "training/train_tah2.py"]}) == {
        "check_output_dir": ["core/outdir.py", "training/train_tah2.py"]}
    assert repeated({"decode_flops": sorted(INTERFACES["decode_flops"])}) == {}
    assert repeated({"decode_flops": ["core/flops_tah2.py", "evaluation/metrics.py"]}) != {}
    assert repeated({"main": ["cli.py", "demo.py"]}) == {}


@pytest.mark.parametrize("name", MOVED)
def test_moved_modules_keep_no_alias(name):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(name)


def test_no_module_replaces_itself_in_sys_modules():
    offenders = [rel for rel, tree in _modules()
                 for node in ast.walk(tree)
                 if isinstance(node, ast.Assign) and any(
                     isinstance(t, ast.Subscript) and ast.unparse(t.value) == "sys.modules" for t in node.targets)]
    assert offenders == []
