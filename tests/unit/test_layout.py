"""The layout holds: no import cycle, no module of the run over its budget, every import inside
a function says why (infra/check_imports.py), and the learner side imports without lancedb,
prefect or mlflow, so a bare torch + transformers machine runs it (DESIGN.md principle 10)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

from tests.conftest import ROOT

spec = importlib.util.spec_from_file_location("check_imports", ROOT / "infra" / "check_imports.py")
check_imports = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_imports)


def test_the_import_graph_has_no_cycle_and_every_rule_holds():
    report = check_imports.report()
    assert report["problems"] == [], "\n".join(report["problems"])
    assert report["cycles"] == [] and report["modules"] > 50
    name, lines = report["largest_run_module"]
    assert name.startswith("replay_pipeline.run") and lines <= check_imports.RUN_MODULE_LINES


def test_the_check_finds_a_cycle_an_unexplained_inner_import_and_a_heavy_learner(tmp_path):
    """The same check on a small tree that breaks each rule: it must say so (and exit 1)."""
    pkg = tmp_path / "replay_pipeline"
    (pkg / "run").mkdir(parents=True)
    (tmp_path / "flows").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "run" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from replay_pipeline import b\n")
    (pkg / "b.py").write_text("def f():\n    from replay_pipeline import a\n    return a\n")
    (pkg / "training").mkdir()
    (pkg / "training" / "learner.py").write_text("import mlflow\n")
    (pkg / "run" / "big.py").write_text("x = 1\n" * (check_imports.RUN_MODULE_LINES + 1))
    report = check_imports.report(tmp_path)
    text = "\n".join(report["problems"])
    assert report["cycles"] == [["replay_pipeline.a", "replay_pipeline.b"]]
    assert "import cycle: replay_pipeline.a -> replay_pipeline.b" in text
    assert "b.py:2: `import replay_pipeline.a` inside a function says not why" in text
    assert "replay_pipeline.training.learner imports mlflow" in text
    assert f"replay_pipeline.run.big: {check_imports.RUN_MODULE_LINES + 1} lines" in text
    done = subprocess.run([sys.executable, str(ROOT / "infra" / "check_imports.py")], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "cycles 0" in done.stdout, done.stdout + done.stderr


def test_the_learner_side_runs_without_lancedb_prefect_or_mlflow(tmp_path):
    """lancedb, prefect and mlflow that raise when imported sit first on the path; the learner,
    objectives, generation backends and models import, and a generate-score-learn step runs."""
    for name in ("lancedb", "lance", "prefect", "mlflow"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('{name} was imported')\n")
    code = textwrap.dedent("""
        import torch
        import replay_pipeline.algo.objectives, replay_pipeline.training.learner
        import replay_pipeline.generation, replay_pipeline.generation.vllm_backend
        import replay_pipeline.models.tiny, replay_pipeline.models.loading, replay_pipeline.models.device
        import replay_pipeline.models.warmstart, replay_pipeline.models.policy
        from replay_pipeline.generation import TransformersGenerator
        from replay_pipeline.training.learner import Learner
        from replay_pipeline.models.tiny import build_tiny_model, build_tokenizer
        from replay_pipeline.algo.scoring import group_advantages
        torch.manual_seed(0)
        tok = build_tokenizer()
        model = build_tiny_model(tok, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
        gen = TransformersGenerator(model, tok, max_new_tokens=4)
        groups = gen.generate(["1+2=", "3+4="], n=4, seed=1)
        rewards = [float(s.text.startswith(a)) for a, g in zip(["3", "7"], groups) for s in g]
        adv = group_advantages(rewards, 4)
        rows = [s for g in groups for s in g]
        stats = Learner(model, pad_id=tok.pad_token_id).step({
            "prompt_ids": [s.prompt_ids for s in rows], "completion_ids": [s.completion_ids for s in rows],
            "behaviour_logprobs": [s.logprobs for s in rows], "advantage": adv,
            "reward": rewards, "group_reward_mean": [sum(rewards[i // 4 * 4:i // 4 * 4 + 4]) / 4 for i in range(8)]})
        import sys
        assert not {"lancedb", "prefect", "mlflow"} & set(sys.modules), sorted(sys.modules)
        print("ok", stats["tokens"])
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stdout + done.stderr[-3000:]
