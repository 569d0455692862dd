"""The bare loop: the physical reference for a learner step on this machine.

Generate, score, one GRPO step, nothing stored: the same warm-started policy, prompts, group
size, sampling settings, objective and optimizer as our no-buffer loop, written directly in
torch and transformers, with none of the pipeline (no rollout table, usage records, tracking,
Prefect, weight publication, diagnostics or input checks). `replay_pipeline.benchmarks.peers`
runs it beside our flow and TRL's GRPOTrainer; what our loop spends beyond it is the price of
the pipeline.

One step, as our sync round does it:
1. this step's prompts and generation seed (`run.batches.step_prompts`, the flow's own);
2. `model.generate` on the left-padded prompts, G samples each (group-major), top_k = 0,
   with the raw logits, so that the behaviour log-probs are those of softmax(logits / T) at
   each sampled token (as our generator stores them); the same model object generates and
   learns (as our sync loop's generator shares the learner's weights);
3. rewards from the task's verifier, group-normalised advantages (population std + 1e-6, 0 for
   an all-equal group: `scoring.group_advantages`);
4. one forward pass over prompt + completion (right-padded by `learner.collate`, the learner's
   own layout), log-probs of the completion
   tokens at temperature T, the GRPO-clip surrogate aggregated per `algo.loss_agg`
   (`objectives.grpo_clip`, `objectives.aggregate`: pure tensor functions, the same
   arithmetic by definition), backward, global-norm clipping at `algo.max_grad_norm`, AdamW
   with the configured betas and weight decay (torch's fused kernel, as our learner and
   transformers' Trainer take it).

Timed per step: generation (2-3: sampling, decoding, reward, advantages) and training (4);
the step is their sum plus the loop's own few lines. Held-out greedy accuracy at step 0,
every `eval_every` steps and at the end with the project's evaluator on a copy of the weights,
outside the timed region and inside `torch.random.fork_rng` (evaluating does not move the
sampling stream), as the TRL side does.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from replay_pipeline.benchmarks.sides import load_side_policy


def run_bare(cfg, steps: int, eval_every: int, log: Callable[[str], Any] = print) -> dict[str, Any]:
    """`steps` bare GRPO steps from the flow's cached warm start; the side's record for
    `peers` (step, generation and training seconds, generated tokens, evaluations)."""
    # start-up cost: torch, only on this path
    import torch

    from replay_pipeline.training.evaluation import evaluate_greedy
    from replay_pipeline.generation import TransformersGenerator
    from replay_pipeline.training.learner import collate
    from replay_pipeline.algo.objectives import LossInputs, aggregate, grpo_clip
    from replay_pipeline.run.accounting import process_started
    from replay_pipeline.run.batches import step_prompts
    from replay_pipeline.algo.scoring import group_advantages

    start = time.perf_counter()
    task, model, tokenizer = load_side_policy(cfg, log)
    heldout = list(task.heldout_prompts())
    loop, gen, algo = cfg.loop, cfg.generator, cfg.algo
    temperature, group = float(gen.temperature), int(loop.group_size)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    pad = eos if pad is None else pad
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(algo.lr), weight_decay=float(algo.weight_decay),
                                  betas=(float(algo.adam_beta1), float(algo.adam_beta2)), fused=True)
    eval_generator = TransformersGenerator.from_config(model, tokenizer, gen)  # its own copy of the weights

    step_seconds: list[float] = []
    step_ended_at: list[float] = []  # epoch seconds (the clock peers.py's turns record pauses in)
    gen_seconds: list[float] = []
    train_seconds: list[float] = []
    tokens: list[int] = []
    points: list[dict[str, float]] = []
    eval_seconds = eval_tokens = 0.0

    def evaluate(done: int) -> None:
        nonlocal eval_seconds, eval_tokens
        t0 = time.perf_counter()
        with torch.random.fork_rng(devices=[]):
            eval_generator.load_weights(model.state_dict(), done)
            scores = evaluate_greedy(eval_generator, task, heldout, seed=cfg.seed)
        acc = scores["eval/accuracy"]
        seconds = time.perf_counter() - t0
        eval_tokens += scores["eval/greedy_tokens"]
        eval_seconds += seconds
        points.append({"step": done, "accuracy": acc, "gen_tokens": float(sum(tokens)),
                       "seconds": sum(step_seconds), "gen_train_seconds": sum(gen_seconds) + sum(train_seconds),
                       "eval_seconds": seconds, "eval_tokens": scores["eval/greedy_tokens"], "ended_at": time.time()})

    evaluate(0)
    startup_at = time.time()
    startup = startup_at - process_started() - eval_seconds
    for step in range(steps):
        t0 = time.perf_counter()
        prompts, seed = step_prompts(task, cfg, step)
        rows = [tokenizer.encode(p.text) for p in prompts for _ in range(group)]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        attention = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, width - len(r):] = torch.tensor(r)
            attention[i, width - len(r):] = 1
        torch.manual_seed(seed)
        model.eval()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=attention, do_sample=True, temperature=temperature,
                                 top_p=float(gen.top_p), top_k=0, max_new_tokens=int(gen.max_new_tokens),
                                 eos_token_id=eos, pad_token_id=pad, return_dict_in_generate=True,
                                 output_logits=True)
        new = out.sequences[:, width:]
        logp_all = torch.log_softmax(torch.stack(out.logits, dim=1).float() / temperature, dim=-1)
        behaviour = logp_all.gather(-1, new.unsqueeze(-1)).squeeze(-1)
        completions, rewards = [], []
        for i, row in enumerate(new.tolist()):
            length = row.index(eos) + 1 if eos in row else len(row)
            completions.append(row[:length])
            reason = "stop" if length and row[length - 1] == eos else "length"
            prompt = prompts[i // group]
            rewards.append(task.reward(prompt, tokenizer.decode(row[:length], skip_special_tokens=True), reason))
        advantages = group_advantages(rewards, group)
        t1 = time.perf_counter()

        model.train()
        batch = collate(rows, completions, [behaviour[i, :len(c)].tolist() for i, c in enumerate(completions)],
                        advantages, pad)
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
        targets = batch.input_ids[:, 1:].unsqueeze(-1)
        mask = batch.completion_mask
        logp = torch.log_softmax(logits / temperature, dim=-1).gather(-1, targets).squeeze(-1)
        logp = torch.where(mask > 0, logp, torch.zeros_like(logp))
        loss_out = grpo_clip(LossInputs(logprobs=logp, behaviour_logprobs=batch.behaviour_logprobs,
                                        advantages=batch.advantages, mask=mask),
                             eps_low=float(algo.eps_low), eps_high=float(algo.eps_high))
        loss = aggregate(loss_out.per_token, mask, str(algo.loss_agg))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if float(algo.max_grad_norm) > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), float(algo.max_grad_norm))
        optimizer.step()
        t2 = time.perf_counter()

        gen_seconds.append(t1 - t0)
        train_seconds.append(t2 - t1)
        step_seconds.append(t2 - t0)
        step_ended_at.append(time.time())
        tokens.append(sum(len(c) for c in completions))
        done = step + 1
        if done == steps or (eval_every and done % eval_every == 0):
            evaluate(done)
    return {
        "name": "bare torch loop", "step_seconds": step_seconds, "gen_seconds": gen_seconds,
        "train_seconds": train_seconds, "gen_tokens": float(sum(tokens)), "evals": points,
        "eval_seconds": eval_seconds, "eval_tokens": eval_tokens, "startup_seconds": startup,
        "startup_at": startup_at, "startup_eval_seconds": points[0]["eval_seconds"], "step_ended_at": step_ended_at,
        "torch_threads": torch.get_num_threads(),
        "wall_seconds": time.perf_counter() - start,
    }
