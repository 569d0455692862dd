"""Group-normalised advantages, worked by hand."""

import logging
import math
import threading
import time

import numpy as np
import pytest

from replay_pipeline.algo.scoring import (MAX_ERROR_CHARS, RewardTerm, group_advantages, rewards_of, safe_reward,
                                     safe_rewards, score_items, set_reward_timeout, warn_flagged)


def test_group_advantages_by_hand():
    # group [1, 0, 0, 0]: mean 0.25, population std sqrt(0.1875) = 0.4330
    adv = group_advantages([1, 0, 0, 0, 0, 1, 1, 0], group_size=4)
    s = math.sqrt(0.1875)
    np.testing.assert_allclose(adv[:4], [0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s], rtol=1e-5)
    # group [0, 1, 1, 0]: mean 0.5, std 0.5 -> [-1, 1, 1, -1]
    np.testing.assert_allclose(adv[4:], [-1, 1, 1, -1], rtol=1e-5)


def test_equal_rewards_give_zero_advantage():
    adv = group_advantages([1, 1, 1, 0, 0, 0], group_size=3)
    assert np.all(adv == 0.0)


def test_advantages_sum_to_zero_per_group():
    rng = np.random.default_rng(0)
    r = rng.random(64)
    adv = group_advantages(r, 8).reshape(8, 8)
    np.testing.assert_allclose(adv.sum(1), 0.0, atol=1e-5)
    np.testing.assert_allclose(adv.std(1), 1.0, atol=1e-4)


def test_bad_layout_raises():
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages([1, 0, 1], 4)


def test_safe_reward_flags_raise_and_nan_with_the_reason():
    assert safe_reward(lambda: 1.0) == (1.0, None)
    assert safe_reward(lambda: 0) == (0.0, None)
    assert safe_reward(lambda: float("nan")) == (0.0, "reward was nan")
    assert safe_reward(lambda: float("inf")) == (0.0, "reward was inf")
    assert safe_reward(lambda: float("-inf")) == (0.0, "reward was -inf")

    def boom():
        raise RuntimeError("verifier crashed")

    assert safe_reward(boom) == (0.0, "reward raised RuntimeError: verifier crashed")
    value, error = safe_reward(lambda: None)  # not a number at all
    assert value == 0.0 and error.startswith("reward raised TypeError: ")

    def silent():
        raise ValueError

    assert safe_reward(silent) == (0.0, "reward raised ValueError")


def test_safe_reward_keeps_long_messages_short_and_on_one_line():
    def chatty():
        raise ValueError("line one\nline two " + "x" * 500)

    value, error = safe_reward(chatty)
    assert value == 0.0 and len(error) == MAX_ERROR_CHARS and error.endswith("...")
    assert error.startswith("reward raised ValueError: line one line two x") and "\n" not in error


def test_warn_flagged_logs_once_with_the_count_and_the_first_reason(caplog):
    with caplog.at_level(logging.WARNING, logger="replay_pipeline.algo.scoring"):
        assert warn_flagged(3, [None, None]) == 0
        assert caplog.records == []
        assert warn_flagged(4, [None, "reward was nan", "reward raised ValueError: boom"]) == 2
    (record,) = caplog.records
    assert record.name == "replay_pipeline.algo.scoring" and record.levelno == logging.WARNING
    assert "step 4: 2 of 3 rollouts flagged" in record.getMessage()
    assert "first: reward was nan" in record.getMessage()


def test_a_reward_call_slower_than_the_timeout_is_flagged_and_the_next_call_runs():
    import threading
    import time

    from replay_pipeline.algo.scoring import safe_reward
    start = time.perf_counter()
    assert safe_reward(lambda: threading.Event().wait(60), timeout=0.1) == (0.0, "reward timed out after 0.1 s")
    assert time.perf_counter() - start < 5
    assert safe_reward(lambda: 1.0, timeout=0.1) == (1.0, None)  # a fresh worker thread
    assert safe_reward(lambda: 1 / 0, timeout=0.1)[1] == "reward raised ZeroDivisionError: division by zero"


def test_check_flagged_stops_only_above_the_fraction():
    import pytest

    from replay_pipeline.algo.scoring import RewardFailure, check_flagged
    check_flagged(3, ["x", None, None, None], max_fraction=0.25)  # exactly at the bound: goes on
    with pytest.raises(RewardFailure, match="step 3: 2 of 4 rollouts flagged \\(first: x\\)"):
        check_flagged(3, ["x", "y", None, None], max_fraction=0.25)
    check_flagged(3, ["x"] * 4, max_fraction=1.0)  # 1: never


class _BatchTask:
    """A task whose reward comes in one batch call (a reward model's way)."""

    def __init__(self, batch):
        self.calls, self._batch = 0, batch

    def reward(self, prompt, completion, finish_reason):  # never used while reward_batch exists
        raise AssertionError("reward_batch should have been called")

    def reward_batch(self, prompts, completions, finish_reasons):
        self.calls += 1
        return self._batch(prompts, completions, finish_reasons)


ITEMS = [("p1", "a", "stop"), ("p2", "bb", "stop"), ("p3", "ccc", "length")]


def test_a_batch_reward_is_one_call_judged_item_by_item():
    task = _BatchTask(lambda ps, cs, fs: [len(c) for c in cs])
    assert rewards_of(task, ITEMS) == [(1.0, None), (2.0, None), (3.0, None)] and task.calls == 1
    nan = rewards_of(_BatchTask(lambda ps, cs, fs: [1.0, float("nan"), "x"]), ITEMS)
    assert nan[0] == (1.0, None) and nan[1] == (0.0, "reward was nan") and nan[2][1].startswith("reward raised ValueError")


@pytest.mark.parametrize("batch, reason", [
    (lambda ps, cs, fs: [1.0], "reward_batch returned 1 values for 3 completions"),
    (lambda ps, cs, fs: 1 / 0, "reward raised ZeroDivisionError: division by zero"),
    (lambda ps, cs, fs: time.sleep(5), "reward timed out after 0.3 s"),  # 0.1 s a completion
], ids=["wrong-length", "raises", "hangs"])
def test_a_batch_reward_that_fails_flags_every_completion_with_the_reason(batch, reason):
    set_reward_timeout(0.1)
    try:
        assert rewards_of(_BatchTask(batch), ITEMS) == [(0.0, reason)] * 3
    finally:
        set_reward_timeout(30.0)


class _Verifier:
    def reward(self, prompt, completion, finish_reason):
        return 1.0 if completion == "bb" else 0.0


def test_weighted_terms_add_to_the_verifier_and_correctness_stays_the_verifiers():
    length = RewardTerm("length", 0.5, lambda p, c, f, scale: scale * len(c), {"scale": 2.0})
    stops = RewardTerm("stops", -1.0, lambda p, c, f: float(f == "stop"), {})
    scored = score_items(_Verifier(), ITEMS, [length, stops], verifier_weight=3.0)
    # p1: 3*0 + 0.5*2 - 1 = 0; p2: 3*1 + 0.5*4 - 1 = 4; p3: 3*0 + 0.5*6 - 0 = 3
    assert scored.rewards == [0.0, 4.0, 3.0] and scored.correct == [False, True, False]
    assert scored.errors == [None] * 3 and scored.term_means == {"length": 4.0, "stops": 2 / 3}


def test_a_failing_term_flags_its_completion_by_name_and_scores_it_zero():
    def picky(p, c, f):
        if c == "bb":
            raise KeyError("no length for bb")
        return 1.0

    scored = score_items(_Verifier(), ITEMS, [RewardTerm("picky", 1.0, picky, {})])
    assert scored.rewards == [1.0, 0.0, 1.0] and scored.correct == [False, False, False]
    assert scored.errors[1] == "term picky: reward raised KeyError: 'no length for bb'"
    assert scored.term_means == {"picky": 1.0}  # over the unflagged ones


def test_a_hung_call_is_given_up_and_the_calls_after_it_still_run():
    hang = threading.Event()
    calls = [lambda: 1.0, lambda: 0.0, lambda: hang.wait(60), lambda: 1.0, lambda: float("nan")]
    try:
        got = safe_rewards(calls, timeout=0.2)
    finally:
        hang.set()  # let the abandoned worker thread finish
    assert got == [(1.0, None), (0.0, None), (0.0, "reward timed out after 0.2 s"), (1.0, None),
                   (0.0, "reward was nan")]
    assert safe_rewards([lambda: 1.0] * 3, timeout=0.2) == [(1.0, None)] * 3  # a fresh worker serves on


def test_each_call_has_its_own_timeout_not_the_batch():
    # Five calls of 0.1 s under a 0.3 s timeout: 0.5 s in all, and none of them timed out.
    slow = lambda: (time.sleep(0.1), 1.0)[1]  # noqa: E731
    assert safe_rewards([slow] * 5, timeout=0.3) == [(1.0, None)] * 5


def test_batches_from_two_threads_at_once_do_not_wait_behind_each_other():
    # Two callers, each with 4 calls of 0.1 s under a 0.3 s timeout: with one worker shared,
    # the second batch's first call would run out of time while queued behind the first batch.
    slow = lambda: (time.sleep(0.1), 1.0)[1]  # noqa: E731
    got: dict[str, list] = {}
    callers = [threading.Thread(target=lambda name=name: got.__setitem__(name, safe_rewards([slow] * 4, timeout=0.3)))
               for name in ("a", "b")]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert got == {"a": [(1.0, None)] * 4, "b": [(1.0, None)] * 4}
