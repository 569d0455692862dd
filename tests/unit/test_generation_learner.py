"""Generator and learner on a small random Llama: shapes, log-probs consistent with a
forward pass, determinism under a seed, a weight update taking effect, and the learner
moving the weights."""

import pytest
import torch

from replay_pipeline.generation import TransformersGenerator
from replay_pipeline.training.learner import Learner, collate, token_logprobs_and_entropy
from replay_pipeline.models.tiny import build_tiny_model, build_tokenizer


@pytest.fixture(scope="module")
def policy():
    tok = build_tokenizer()
    tok.padding_side = "left"
    model = build_tiny_model(tok, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, seed=0)
    return model, tok


def _gen(policy, **kw):
    model, tok = policy
    return TransformersGenerator(model, tok, max_new_tokens=5, **kw)


def test_generate_shapes_and_finish_reasons(policy):
    gen = _gen(policy)
    out = gen.generate(["012+345=", "999+001="], n=3, seed=0)
    assert len(out) == 2 and all(len(g) == 3 for g in out)
    for group in out:
        for s in group:
            assert len(s.completion_ids) == len(s.logprobs) >= 1
            assert s.finish_reason in ("stop", "length")
            if s.finish_reason == "stop":
                assert s.completion_ids[-1] == gen.eos_id
            else:
                assert len(s.completion_ids) == 5
            assert all(lp <= 0 for lp in s.logprobs)


def test_generation_is_deterministic_under_a_seed(policy):
    gen = _gen(policy)
    a = gen.generate(["012+345="], n=8, seed=123)
    b = gen.generate(["012+345="], n=8, seed=123)
    c = gen.generate(["012+345="], n=8, seed=124)
    ids = lambda out: [s.completion_ids for s in out[0]]  # noqa: E731
    assert ids(a) == ids(b)
    assert ids(a) != ids(c)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_match_a_forward_pass(policy, temperature):
    model, tok = policy
    gen = _gen(policy, temperature=temperature)
    samples = [s for g in gen.generate(["012+345=", "500+500="], n=4, seed=1) for s in g]
    batch = collate([s.prompt_ids for s in samples], [s.completion_ids for s in samples],
                    [s.logprobs for s in samples], [0.0] * len(samples), pad_id=tok.pad_token_id)
    with torch.no_grad():
        logp, _ = token_logprobs_and_entropy(model.eval(), batch, temperature)
    m = batch.completion_mask.bool()
    torch.testing.assert_close(logp[m], batch.behaviour_logprobs[m], atol=1e-4, rtol=1e-4)


def test_weight_update_takes_effect(policy):
    model, tok = policy
    gen = _gen(policy)
    before = gen.generate(["012+345="], n=1, seed=0, greedy=True)[0][0]
    new = {k: torch.zeros_like(v) if "lm_head" in k or "embed" in k else v.clone()
           for k, v in model.state_dict().items()}
    gen.load_weights(new, version=7)
    after = gen.generate(["012+345="], n=1, seed=0, greedy=True)[0][0]
    assert gen.policy_version == 7
    # all-zero logits: every token equally likely, log-prob = -log(V) exactly
    assert after.logprobs[0] == pytest.approx(-torch.log(torch.tensor(float(len(tok)))).item(), abs=1e-5)
    assert before.logprobs[0] != pytest.approx(after.logprobs[0], abs=1e-5)
    # the generator owns a copy: the learner's model is untouched
    assert any(v.abs().sum() > 0 for k, v in model.state_dict().items() if "embed" in k)


def test_collate_aligns_completion_tokens():
    b = collate([[1, 2, 3], [1, 2]], [[7, 8], [9]], [[-0.1, -0.2], [-0.3]], [1.0, -1.0], pad_id=0)
    assert b.input_ids.tolist() == [[1, 2, 3, 7, 8], [1, 2, 9, 0, 0]]
    # column t predicts token t+1: completion tokens 7, 8 predicted at columns 2, 3
    assert b.completion_mask.tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]
    assert b.behaviour_logprobs[0, 2].item() == pytest.approx(-0.1)
    assert b.behaviour_logprobs[1, 1].item() == pytest.approx(-0.3)
    with pytest.raises(ValueError, match="behaviour log-probs"):
        collate([[1]], [[2, 3]], [[-0.1]], [0.0], pad_id=0)


def test_learner_step_changes_weights_and_raises_rewarded_logprob(policy):
    model, tok = policy
    model = build_tiny_model(tok, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, seed=0)
    gen = TransformersGenerator(model, tok, max_new_tokens=5)
    samples = gen.generate(["012+345="], n=4, seed=3)[0]
    rows = {"prompt_ids": [s.prompt_ids for s in samples],
            "completion_ids": [s.completion_ids for s in samples],
            "behaviour_logprobs": [s.logprobs for s in samples],
            "advantage": [1.5, -0.5, -0.5, -0.5]}
    learner = Learner(model, lr=1e-2, pad_id=tok.pad_token_id, max_grad_norm=1.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seq_logp = lambda: sum(  # noqa: E731
        token_logprobs_and_entropy(model, collate([samples[0].prompt_ids], [samples[0].completion_ids],
                                                   [samples[0].logprobs], [0.0], tok.pad_token_id), 1.0)[0]
        .squeeze(0)[len(samples[0].prompt_ids) - 1:].tolist())
    lp0 = seq_logp()
    m = learner.step(rows)
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # first step is on-policy
    assert m["clip_frac"] == 0.0
    assert m["entropy"] > 0
    assert seq_logp() > lp0  # the positive-advantage completion became more likely


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("micro", [1, 3, 5])
def test_micro_batches_give_the_whole_minibatchs_update(policy, loss_agg, micro):
    """learner.micro_batch_size (gradient accumulation) changes memory, not the update: over 3
    steps on 10 rollouts of mixed lengths (one of them empty), with a KL term and an entropy
    bonus, the losses, diagnostics and weights equal the whole-minibatch learner's within float
    rounding, whether the loss is a token mean or a sequence mean and whatever the parts' sizes
    (micro 3 leaves a part of 1): 1e-5 relative on the metrics, 1e-5 absolute on the weights
    after 3 Adam steps of lr 1e-2 (up to 3e-2 each: Adam divides by the gradient's own scale,
    so a rounding difference in a near-zero gradient moves a weight by up to 2.3e-6 here)."""
    _, tok = policy
    gen = TransformersGenerator(build_tiny_model(tok, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                                                 seed=0), tok, max_new_tokens=6)
    samples = [s for group in gen.generate(["012+345=", "9+1=", "123+4="], n=3, seed=5) for s in group]
    rows = {"prompt_ids": [s.prompt_ids for s in samples] + [samples[0].prompt_ids],
            "completion_ids": [s.completion_ids for s in samples] + [[]],
            "behaviour_logprobs": [s.logprobs for s in samples] + [[]],
            "advantage": [1.0, -0.5, 0.3, -1.2, 0.8, 0.0, 0.4, -0.9, 0.6, 0.2]}
    assert len({len(c) for c in rows["completion_ids"]}) > 2  # lengths differ, one is empty

    def train(micro_batch_size):
        model = build_tiny_model(tok, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, seed=0)
        learner = Learner(model, lr=1e-2, pad_id=tok.pad_token_id, loss_agg=loss_agg, kl_coef=0.05,
                          entropy_coef=0.01, micro_batch_size=micro_batch_size)
        metrics = [learner.step(rows) for _ in range(3)]
        return metrics, {k: v.clone() for k, v in model.state_dict().items()}

    whole, whole_weights = train(None)
    parts, part_weights = train(micro)
    for a, b in zip(whole, parts):
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
    assert max(float((whole_weights[k] - part_weights[k]).abs().max()) for k in whole_weights) < 1e-5
    assert whole[0]["loss"] != 0 and whole[2]["kl_ref"] > 0  # the check has something to compare


def test_micro_batch_size_must_be_a_positive_integer(policy):
    model, tok = policy
    for bad in (0, -2, True):
        with pytest.raises(ValueError, match="micro_batch_size"):
            Learner(model, pad_id=tok.pad_token_id, micro_batch_size=bad)
