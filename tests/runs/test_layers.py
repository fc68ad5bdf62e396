"""The code's layers (scripts/layers.py): no import circle, imports run down the layers, imports inside functions
only where listed with their reason, eval/ in modules that read in one sitting, and a root that shows the
architecture."""

from conftest import REPO
from scripts import layers

FOUND = layers.modules()
EDGES = layers.imports(FOUND)


def test_the_checker_sees_circles_upward_and_late_imports(tmp_path):
    # a small tree with each fault: a circle (a <-> b through a function-level import), an upward import
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "__init__.py").write_text("")
    (tmp_path / "common" / "outputs.py").write_text("import model\n")
    (tmp_path / "model.py").write_text("from common.outputs import x\n\ndef f():\n    from common import outputs\n")
    found = layers.modules(tmp_path)
    edges = layers.imports(found)
    assert {(e.importer, e.imported, e.late) for e in edges} == {
        ("common.outputs", "model", False), ("model", "common.outputs", False), ("model", "common.outputs", True)}
    assert layers.circles(edges) == [["common.outputs", "model"]]
    assert [(e.importer, e.imported) for e in layers.upward(edges)] == [("common.outputs", "model")]
    assert [(e.importer, e.line) for e in layers.late(edges)] == [("model", 4)]


def test_no_import_circle():
    assert layers.circles(EDGES) == []


def test_imports_run_down_the_layers_but_for_at_most_three_each_with_its_reason():
    upward = {(e.importer, e.imported) for e in layers.upward(EDGES)}
    assert upward <= set(layers.UPWARD), f"imports up the layers not listed in scripts/layers.py: {upward - set(layers.UPWARD)}"
    assert set(layers.UPWARD) <= upward, "scripts/layers.py lists upward imports the code no longer makes"
    assert len(layers.UPWARD) <= 3 and all(layers.UPWARD.values())


def test_imports_inside_functions_are_at_most_fifteen_each_with_its_reason():
    late = {(e.importer, e.imported) for e in layers.late(EDGES)}
    assert late <= set(layers.LATE), f"imports inside functions not listed in scripts/layers.py: {late - set(layers.LATE)}"
    assert set(layers.LATE) <= late, "scripts/layers.py lists imports inside functions the code no longer makes"
    assert len(layers.late(EDGES)) <= 15 and all(layers.LATE.values())


def test_every_module_has_a_layer():
    for name in FOUND:
        layers.layer_of(name)  # raises for a module outside every layer


def test_evaluation_modules_read_in_one_sitting():
    long = {path.name: n for path in (REPO / "eval").glob("*.py")
            if path.name != "__main__.py" and (n := len(path.read_text().splitlines())) > 500}
    assert not long, f"eval/ modules over 500 lines: {long}"


def test_the_root_holds_the_entry_points_the_model_the_config_and_a_package_per_layer():
    modules = sorted(p.name for p in REPO.glob("*.py"))
    assert modules == ["config.py", "export.py", "model.py", "sample.py", "train.py"]
    packages = sorted(p.name for p in REPO.iterdir() if (p / "__init__.py").exists())
    assert packages == ["attention", "common", "data", "eval", "runtime", "scripts", "training"]
    # a package is one layer: its name says where it sits
    for package in ("attention", "common", "data", "eval", "runtime", "training"):
        assert len({layers.layer_of(name) for name in FOUND if name.split(".")[0] == package
                    and name != "eval.__main__"}) == 1, package


def test_no_module_of_attention_uses_another_modules_private_names(tmp_path):
    assert layers.private_uses(FOUND) == []
    # the check sees both forms: a private name imported, and one read off an imported module
    (tmp_path / "attention").mkdir()
    (tmp_path / "attention" / "__init__.py").write_text("")
    (tmp_path / "attention" / "a.py").write_text("def _helper():\n    pass\n")
    (tmp_path / "attention" / "b.py").write_text("from attention.a import _helper\nfrom attention import a\n\n"
                                                 "a._helper()\n")
    assert layers.private_uses(layers.modules(tmp_path)) == [
        ("attention.b", 1, "from attention.a import _helper"), ("attention.b", 4, "a._helper")]
