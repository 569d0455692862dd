"""Weighted reward terms (reward.terms, issue 23 item 1): functions in a file outside the
project add to the task's verifier in training, each term's mean is logged under score/term/,
the stored reward is the weighted total while `correct` and every accuracy stay the
verifier's, the run's config records the file absolute, and a term whose file is gone or
whose function raises is refused or flagged like the verifier."""

from __future__ import annotations

import numpy as np
import pytest
from omegaconf import OmegaConf

from replay_pipeline.config import ConfigError, load_config
from replay_pipeline.run.build import build_run
from replay_pipeline.run.loop import sync_round
from replay_pipeline.tracking.tracker import NullTracker
from tests.conftest import TINY_OVERRIDES

TERMS = '''
def length(prompt, completion, finish_reason, per_char=1.0):
    return per_char * len(completion)

def stopped(prompt, completion, finish_reason):
    if completion.startswith("9"):
        raise ValueError("nines are not allowed")
    return 1.0 if finish_reason == "stop" else 0.0
'''


def _config(root, terms_file, *extra):
    return load_config([f"tracking.root_dir={root}", *TINY_OVERRIDES, "run_id=shaped", "loop.steps=2",
                        "reward.verifier_weight=2", f"+reward.terms.length.target={terms_file}:length",
                        "+reward.terms.length.weight=0.25", "+reward.terms.length.args.per_char=2",
                        f"+reward.terms.stopped.target={terms_file}:stopped", *extra])


def test_terms_add_to_the_verifier_and_are_logged_by_name(tmp_path):
    terms_file = tmp_path / "elsewhere" / "terms.py"
    terms_file.parent.mkdir()
    terms_file.write_text(TERMS)
    run = build_run(_config(tmp_path, terms_file), log=lambda _: None, tracker=NullTracker())
    metrics = sync_round(run, 0)
    run.flush_writes()
    rows = run.store.window(1000, columns=["prompt", "completion", "finish_reason", "reward", "correct",
                                           "reward_error"])
    completions = rows.column("completion").to_pylist()
    finish = rows.column("finish_reason").to_pylist()
    errors = rows.column("reward_error").to_pylist()
    answers = [str(sum(int(x) for x in p.rstrip("=").split("+"))) for p in rows.column("prompt").to_pylist()]
    verified = [f == "stop" and c == a for c, f, a in zip(completions, finish, answers)]  # the addition task's
    expected_length = [0.25 * 2 * len(c) for c in completions]
    expected_stop = [1.0 if f == "stop" else 0.0 for f in finish]
    correct = rows.column("correct").to_pylist()
    for reward, ok, length, stop, error, text, right in zip(rows.column("reward").to_pylist(), correct,
                                                            expected_length, expected_stop, errors, completions,
                                                            verified):
        if text.startswith("9"):
            assert error == "term stopped: reward raised ValueError: nines are not allowed" and reward == 0
            assert not ok
        else:
            assert error is None and ok == right
            assert reward == pytest.approx(2.0 * float(ok) + length + stop)
    clean = [not t.startswith("9") for t in completions]
    assert metrics["score/term/length"] == pytest.approx(np.mean([2 * len(c) for c, k in zip(completions, clean) if k]))
    assert metrics["score/term/stopped"] == pytest.approx(np.mean([s for s, k in zip(expected_stop, clean) if k]))
    assert metrics["score/accuracy"] == pytest.approx(np.mean(correct))  # the verifier's, not the total's
    saved = OmegaConf.load(run.paths.run_dir / "config.yaml")
    assert saved.reward.terms.length.target == f"{terms_file}:length" and saved.reward.terms.length.weight == 0.25
    run.finish()


def test_a_term_that_cannot_be_imported_or_is_malformed_is_refused_before_work(tmp_path):
    with pytest.raises(ConfigError, match=r"reward.terms.length.target=.*no file"):
        build_run(_config(tmp_path, tmp_path / "missing.py"), log=lambda _: None, tracker=NullTracker())
    assert not (tmp_path / "shaped").exists()  # refused before the run directory was made
    with pytest.raises(ConfigError, match=r"reward.terms.x has unknown key\(s\) \['wieght'\]"):
        load_config(["+reward.terms.x.target=m:f", "+reward.terms.x.wieght=1"])
    with pytest.raises(ConfigError, match=r"reward.terms.x.weight='heavy' must be a finite number"):
        load_config(["+reward.terms.x.target=m:f", "+reward.terms.x.weight=heavy"])
