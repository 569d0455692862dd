"""Adaptive reuse in the async loop (issue 24 item 1): the learner's rounds there take their
updates through the same rule, so a tight KL budget leaves one update a round (the first is
always applied) and the usage table records exactly those."""

from __future__ import annotations

from mlflow.tracking import MlflowClient

from replay_pipeline.buffer.usage import UsageStore
from tests.e2e.test_async import B, run_async


def test_a_tight_kl_budget_takes_one_update_a_round_in_the_async_loop(tmp_path):
    steps = 4
    run_async(tmp_path, "async-reuse", steps, "reuse.rule=kl_budget", "reuse.kl_budget=1e-12", "reuse.max_updates=3",
              "buffer.strategy=uniform")
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                filter_string="tags.`replay_pipeline.run_id` = 'async-reuse'")
    taken = [m.value for m in client.get_metric_history(run.info.run_id, "reuse/updates")]
    stopped = [m.value for m in client.get_metric_history(run.info.run_id, "reuse/stopped_by_rule")]
    assert taken == [1.0] * steps and stopped == [1.0] * steps
    usage = UsageStore.open(tmp_path / "lancedb", "async-reuse").rows(columns=["learner_step"]).to_pydict()
    assert sorted(set(usage["learner_step"])) == list(range(steps)) and len(usage["learner_step"]) == steps * B
