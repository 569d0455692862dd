"""Every relative link, anchor and image of README.md and docs/ resolves: the file exists, is
not ignored by git (so it is on GitHub too), and an anchor matches a heading of the target page
by GitHub's rules (tests/docs/doccheck.py); external links are not fetched. The checker is held
to a small broken tree, so that a dead link, a bad anchor or a missing image cannot pass."""

from __future__ import annotations

import subprocess

from tests.docs import doccheck


def test_every_link_anchor_and_image_of_the_docs_resolves():
    pages = doccheck.doc_pages()
    assert doccheck.ROOT / "README.md" in pages and len(pages) > 1
    assert sum(len(doccheck.links(p.read_text(encoding="utf-8"))) for p in pages) > 20
    problems = doccheck.link_problems()
    assert problems == [], f"{len(problems)} link(s) of README.md and docs/ do not resolve:\n" + "\n".join(problems)


def test_anchors_follow_githubs_rules():
    page = "\n".join([
        "# Quickstart: a first hour",
        "## Your own presets: `--config-dir`",
        "## The planner's *x* and **y**",
        "## [A link](elsewhere.md) and `code_name`",
        "### Ünïcode, 2 parts",
        "## Repeat", "## Repeat", "## Repeat",
        "```bash", "# not a heading", "```",
        "Setext title", "============",
        '<a name="explicit-spot"></a>',
        "#not-a-heading-either",
    ])
    assert doccheck.anchors(page) == [
        "quickstart-a-first-hour", "your-own-presets---config-dir", "the-planners-x-and-y",
        "a-link-and-code_name", "ünïcode-2-parts", "repeat", "repeat-1", "repeat-2", "setext-title",
        "explicit-spot"]


def test_the_checker_catches_dead_links_bad_anchors_and_missing_images(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "report.html").write_text("made by a run")
    (tmp_path / ".gitignore").write_text("/runs/\n")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "docs" / "page.md").write_text("# A heading\n\n## A heading\n\n![fine](../README.md)\n")
    (tmp_path / "README.md").write_text("\n".join([
        "# Front",                                            # 1
        "[dead](docs/missing.md) and [fine](docs/page.md)",   # 2
        "[bad anchor](docs/page.md#nowhere)",                 # 3
        "[good anchor](docs/page.md#a-heading-1)",            # 4
        "![missing image](docs/shot.png)",                    # 5
        "[external](https://example.com/nothing-here) and `[in code](nope.md)`",  # 6
        "[same page, bad](#fronts)",                          # 7
        "[a run's file](runs/report.html)",                   # 8
        "```bash",                                            # 9
        "[in a block](nope.md)",                              # 10
        "```",                                                # 11
        "[wrapped",                                           # 12
        "text](docs/gone.md)",                                # 13
        "[outside](../../etc/passwd)",                        # 14
    ]) + "\n")
    problems = doccheck.link_problems(tmp_path)
    assert len(problems) == 7, "\n".join(problems)
    expected = [
        ("README.md:2:", "docs/missing.md does not exist"),
        ("README.md:3:", "has the anchor #nowhere"),
        ("README.md:5:", "docs/shot.png does not exist"),
        ("README.md:7:", "no heading of README.md has the anchor #fronts (did you mean #front?)"),
        ("README.md:13:", "docs/gone.md does not exist"),
        ("README.md:14:", "leaves the repository"),
        ("README.md:8:", "runs/report.html is ignored by git"),
    ]
    for (where, what), problem in zip(expected, problems):
        assert problem.startswith(where) and what in problem, problem
