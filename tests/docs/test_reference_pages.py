"""The generated reference pages (infra/reference.py: docs/reference/config.md from the schema
and conf/, docs/reference/cli.md from the parsers) are what the code makes now, the comparison
`python infra/reference.py --check` does; every schema field has documentation (its docstring);
the README stays within its line budget. Each check is also fed a broken example."""

from __future__ import annotations

import importlib.util
import sys

from tests.docs import doccheck

reference = doccheck.reference
README_LINES = 250


def test_the_reference_pages_are_what_the_code_makes():
    problems = reference.stale()
    assert problems == [], "\n\n".join(problems)


def test_every_schema_field_is_documented_and_listed():
    fields = reference.schema_fields()
    keys = [f.key for f in fields if not f.section]
    assert len(keys) > 100 and {"seed", "buffer.capacity", "model.warmstart.lr", "reuse.rule"} <= set(keys)
    assert reference.undocumented(fields) == []
    page = (reference.OUT_DIR / reference.CONFIG_PAGE).read_text(encoding="utf-8")
    assert all(f"| `{key}` |" in page for key in keys)
    cli = (reference.OUT_DIR / reference.CLI_PAGE).read_text(encoding="utf-8")
    for module in reference.entry_point_modules():
        assert (f"$ python -m {module} --help" in cli) == (module not in reference.INTERNAL), module


def test_the_readme_stays_within_its_line_budget(tmp_path):
    assert doccheck.line_budget_problems(doccheck.ROOT / "README.md", README_LINES) == []
    long = tmp_path / "README.md"
    long.write_text("line\n" * (README_LINES + 1))
    assert doccheck.line_budget_problems(long, README_LINES, tmp_path) == [
        f"README.md has {README_LINES + 1} lines, over its budget of {README_LINES}; move detail to a page "
        "under docs/ and link to it"]


def test_a_stale_page_and_an_undocumented_field_are_caught(tmp_path, capsys):
    assert reference.main(["--out", str(tmp_path)]) == 0
    assert reference.main(["--check", "--out", str(tmp_path)]) == 0
    page = tmp_path / reference.CLI_PAGE
    page.write_text(page.read_text(encoding="utf-8").replace("--help", "--hlep", 1), encoding="utf-8")
    capsys.readouterr()
    assert reference.main(["--check", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"{page} is stale: run `python infra/reference.py`" in err and "config.md is stale" not in err

    source = tmp_path / "tiny_schema.py"
    source.write_text('from dataclasses import dataclass, field\n\n\n@dataclass\nclass Inner:\n'
                      '    depth: int = 2\n    """How deep."""\n    width: int = 3\n\n\n'
                      '@dataclass\nclass Root:\n    seed: int = 0\n    """Seeds."""\n'
                      '    inner: Inner = field(default_factory=Inner)\n')
    spec = importlib.util.spec_from_file_location("tiny_schema", source)
    module = importlib.util.module_from_spec(spec)
    sys.modules["tiny_schema"] = module
    try:
        spec.loader.exec_module(module)
        fields = reference.schema_fields(module.Root, source)
    finally:
        del sys.modules["tiny_schema"]
    assert [(f.key, f.group, f.doc) for f in fields] == [
        ("seed", "top-level", "Seeds."), ("inner.depth", "inner", "How deep."), ("inner.width", "inner", "")]
    assert reference.undocumented(fields) == [
        "inner.width has no documentation: add a docstring under the field in replay_pipeline/config/schema.py"]
