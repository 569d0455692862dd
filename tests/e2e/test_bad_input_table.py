"""infra/bad_input.py, the bad-input table, on a few of its cases: it runs, and each case is
refused with exit code 2 and no traceback (the cases chosen need the tiny Hugging Face model
directories and data files, not the script's existing runs, so this takes seconds)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import ROOT

CASES = ["unknown-key", "plus-typo", "jsonl-not-utf8", "model-no-tokenizer"]


def test_the_bad_input_script_refuses_each_case_with_exit_code_2_and_no_traceback(tmp_path):
    markdown = tmp_path / "t.md"
    done = subprocess.run([sys.executable, "infra/bad_input.py", "--root", str(tmp_path), "--cases", ",".join(CASES),
                           "--markdown", str(markdown)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PREFECT_HOME": str(tmp_path / ".prefect")})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line for line in markdown.read_text().splitlines() if line.startswith("| ")][1:]  # after the header
    assert [r.split(" | ")[0].lstrip("| ") for r in rows] == CASES, rows
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        exit_code, traceback = cells[-6], cells[-4]
        assert (exit_code, traceback) == ("2", "no"), row
    assert f"{len(CASES)} cases in " in done.stdout
    assert not (tmp_path / "existing").exists()  # only what the chosen cases need was made
