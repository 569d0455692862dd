"""The cheap documented commands run for real, as processes: every `--help` the command page
(docs/reference/cli.md) shows exits 0 and prints exactly the page's text, and
`python -m flows.train --cfg` composes and validates the configuration of each distinct override
set of the training commands in README.md and docs/ (one process per set). A training command is
not run where it needs what this machine lacks (doccheck.not_runnable: a saved run for resume
or fork, presets of --config-dir, a path or address of the writer's machine (a Ray head's
too), a GPU for vLLM,
the user's code for a custom task or reward term) or elides arguments (`...`); the parse and
composition tests (test_doc_commands.py) still check it.
"""

from __future__ import annotations

from tests.docs import doccheck

CLI_PAGE = doccheck.ROOT / "docs" / "reference" / "cli.md"


def test_every_usage_on_the_command_page_is_what_the_command_prints(tmp_path):
    text = CLI_PAGE.read_text(encoding="utf-8")
    checked, problems = doccheck.usage_problems(text, tmp_path)
    assert checked >= len(doccheck.reference.entry_point_modules()) - len(doccheck.reference.INTERNAL)
    assert problems == [], "\n".join(problems)


def test_each_documented_training_configuration_composes_in_a_real_process(tmp_path):
    commands = []
    for page in doccheck.doc_pages():
        commands += doccheck.commands_in(page)[0]
    ran, problems = doccheck.cfg_problems(commands, tmp_path)
    assert ran >= 2  # the bare default run and at least one with overrides
    assert problems == [], "\n".join(problems)


def test_a_usage_the_command_does_not_print_and_a_configuration_that_fails_are_caught(tmp_path):
    page = "\n".join(["# Commands", "", "```console", "$ python -m flows.query --help",
                      "usage: python -m flows.query [-h] {an,old,usage}", "```", ""])
    checked, problems = doccheck.usage_problems(page, tmp_path, page="cli.md")
    assert checked == 1 and len(problems) == 1
    assert problems[0].startswith("cli.md:4: `python -m flows.query --help` prints something else"), problems
    assert "-usage: python -m flows.query [-h] {an,old,usage}" in problems[0]

    bad = doccheck.Command(tmp_path / "page.md", 7, "flows.train", ("loop.minibatch_size=7",), "")
    skipped = doccheck.Command(tmp_path / "page.md", 8, "flows.train", ("resume=x",), "")
    ran, problems = doccheck.cfg_problems([bad, skipped], tmp_path, root=tmp_path)
    assert ran == 1 and len(problems) == 1
    assert problems[0].startswith("page.md:7: `python -m flows.train --cfg loop.minibatch_size=7` exited 2")
    assert "multiple of loop.group_size" in problems[0]
