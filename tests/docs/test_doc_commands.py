"""Every `python -m flows.<name> ...` and `python -m replay_pipeline.benchmarks.<name> ...` line of
a shell block (bash, sh, console or untagged) in README.md and docs/ parses against that
command's real parser (flows.train: the flags flows/usage.py takes), and every `key=value`
override it gives (flows.train's, flows.sweep's shared ones and each --config's, flows.deploy's
--train-overrides, flows.plan's --probe-override, the benchmarks' overrides) names a key of the schema or a preset of conf/, and
the composed configuration validates (replay_pipeline.config.load_config: no Prefect, MLflow or
model). A sweep line is checked as flows.sweep checks it before any work (grid, seeds, protocol),
each configuration composed with the shared overrides.

Placeholders are replaced before a line is parsed (doccheck.PLACEHOLDERS): `<parent run id>`,
`<...mlflow...>`, PARENT, PARENT_RUN_ID and PARENT_B by an MLflow run id (32 hex digits);
`<run_id>`, `<...run...>`, RUN_ID and RUN_A by a run id (20261206-101502-3fa2c1); `<step>` and
STEP by 100; any other `<...>` by the word `placeholder`. A `...` argument is dropped and the
line then checked without composing its configuration. Lines with --config-dir are checked
without their presets (they live on the writer's machine).
"""

from __future__ import annotations

from tests.docs import doccheck


def test_every_documented_command_parses_and_its_overrides_compose():
    commands, problems = doccheck.check_commands()
    modules = {c.module for c in commands}
    assert {"flows.train", "flows.query", "flows.sweep"} <= modules, modules
    assert problems == [], (f"{len(problems)} command(s) of README.md and docs/ do not parse or compose:\n"
                            + "\n".join(problems))


def test_lines_are_read_as_a_shell_reads_them(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("\n".join([
        "```bash",
        "$ python -m flows.train \\",
        "    loop.steps=10 algo.lr=1e-4   # a comment",
        "OMP_NUM_THREADS=1 python -m flows.query runs &",
        "sh infra/install.sh && python -m flows.report <parent run id> --target 0.5 > out.txt 2>&1",
        "python -m flows.train fork=RUN_ID@100 ...",
        "pip install x",
        "```",
        "```python",
        "python -m flows.train not.read=1",
        "```",
        "```console",
        "$ python -m flows.view --port 8766",
        "usage: python -m flows.train key=value",
        "```",
        "```",
        "python -m replay_pipeline.benchmarks.buffer --quick",
        "```",
    ]) + "\n")
    commands, problems = doccheck.commands_in(page)
    assert problems == []
    assert [(c.line, c.module, c.args, c.elided) for c in commands] == [
        (2, "flows.train", ("loop.steps=10", "algo.lr=1e-4"), False),
        (4, "flows.query", ("runs",), False),
        (5, "flows.report", (doccheck.MLFLOW_RUN_ID, "--target", "0.5"), False),
        (6, "flows.train", (f"fork={doccheck.RUN_ID}@100",), True),
        (13, "flows.view", ("--port", "8766"), False),
        (17, "replay_pipeline.benchmarks.buffer", ("--quick",), False),
    ]


def test_the_checker_catches_bad_flags_keys_presets_and_configurations(tmp_path):
    page = tmp_path / "page.md"
    lines = [
        "python -m flows.query rollouts <run_id> --no-such-flag",
        "python -m flows.train --no-such-flag",
        "python -m flows.train buffer.capacitty=3",
        "python -m flows.train experiment=no_such_preset",
        "python -m flows.train loop.minibatch_size=7",
        "python -m flows.sweep --config a=buffer.capacitty=3 --seeds 0",
        "python -m flows.nope",
        "python -m replay_pipeline.benchmarks.buffer --rowz 3",
        "python -m flows.sweep --grid quick --seeds 10 --selection-seeds 10",
        "python -m flows.train --config-dir ~/mine task=mine loop.steps=5",
        "python -m flows.train resume=<run_id> loop.steps=800",
        "python -m flows.sweep --quick loop.steps=30",
        "python -m flows.train +task.args.terms=4 task=custom task.target=my.module:make",
        "python -m flows.deploy --train-overrides loop.stepz=3",
        "python -m flows.plan --probe 20 --probe-override buffer.capacity=0",
    ]
    page.write_text("```bash\n" + "\n".join(lines) + "\n```\n")
    commands, problems = doccheck.check_commands(tmp_path, [page])
    assert len(commands) == len(lines)
    by_line: dict[int, list[str]] = {}
    for problem in problems:
        assert problem.startswith("page.md:"), problem
        by_line.setdefault(int(problem.split(":")[1]), []).append(problem)
    expected = {
        2: "unrecognized arguments: --no-such-flag",
        3: "unknown flag(s) ['--no-such-flag']",
        4: "no key buffer.capacitty (did you mean buffer.capacity?)",
        5: "conf/experiment/ has no preset no_such_preset.yaml",
        6: "must be a multiple of loop.group_size",
        7: "configuration a: `buffer.capacitty=3`: the configuration has no key buffer.capacitty",
        8: "`python -m flows.nope` is not a command",
        9: "unrecognized arguments: --rowz 3",
        10: "refuses it",
        15: "no key loop.stepz",
        16: "buffer.capacity=0 must be an integer >= 1",
    }
    assert sorted(by_line) == sorted(expected), "\n".join(problems)
    for number, what in expected.items():
        assert len(by_line[number]) == 1 and what in by_line[number][0], by_line[number]
