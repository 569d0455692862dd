"""The sides of the peer benchmark (replay_pipeline/benchmarks/peers.py), each run in a
process of its own: our no-buffer loop (the real flow) and TRL's GRPOTrainer on the same model,
task, group size and batch, with the input checks both share and the policy loading they
share with the bare loop (replay_pipeline/benchmarks/bare.py).

Needs the dev extra (`pip install -e '.[dev]'`, which brings `trl`).

**Our side** is the real flow, `flows.train.train`, with `experiment=no_buffer` (generate
prompts_per_step x group_size rollouts, one learner step on all of them, never reuse them),
evaluations every `--eval-every` steps and sampled evaluations and the checkpoint only at the
ends; its figures are read back from the run's MLflow ledger (`compute/round_seconds`,
`compute/gen_seconds`, `compute/gen_tokens`, `compute/gen_train_seconds`, `learn/seconds`,
`eval/accuracy`).

**TRL's side** is `trl.GRPOTrainer` on the same warm-started policy, loaded by the project's
own `load_policy` (`load_side_policy`: the cached warm start, built before the first side; the
model object and tokenizer are handed to TRL, nothing is downloaded), with every setting taken from the resolved
configuration of our side:

| TRL (GRPOConfig)                          | ours                                               |
|-------------------------------------------|----------------------------------------------------|
| num_generations                           | loop.group_size                                    |
| per_device_train_batch_size               | loop.prompts_per_step x loop.group_size            |
| steps_per_generation = 1, num_iterations = 1 | one learner step per generation step (no_buffer) |
| temperature, top_p, top_k = 0             | generator.temperature, generator.top_p (no top-k)  |
| max_completion_length                     | generator.max_new_tokens                           |
| learning_rate, constant, no warm-up       | algo.lr (constant AdamW)                           |
| epsilon, epsilon_high                     | algo.eps_low, algo.eps_high                        |
| loss_type "dapo" / "grpo"                 | algo.loss_agg token_mean / seq_mean                |
| max_grad_norm                             | algo.max_grad_norm                                 |
| optim "adamw_torch_fused", adam_beta1/2, weight_decay | algo.adam_beta1/2, algo.weight_decay (our learner's fused AdamW; transformers' default) |
| beta = 0.0, scale_rewards "group"         | no KL, group-normalised advantages                 |
| seed                                      | seed                                               |

plus `bf16=False`, no gradient (activation) checkpointing, `use_cpu=True` (our flow's policy
lives on the CPU too), `report_to="none"`, no checkpoints. The training prompts are the very
prompts our flow draws at each step (`replay_pipeline.run.batches.step_prompts`), in order
(`shuffle_dataset=False`), and the reward is the task's own verifier (an exact match that ends
with the end token).

Measured, for each side:
- seconds per learner step. TRL: a TrainerCallback's on_step_begin -> on_step_end (generation,
  scoring, forward, backward, optimizer step). Ours: each round's share of
  `compute/round_seconds` (generation, scoring, storage, sampling, the learner step, weight
  publication, Prefect and MLflow; evaluations and checkpoints are left out).
- the generation / training split. Ours: `compute/gen_seconds` (generation + verifier) and
  `learn/seconds` per round, the rest is the pipeline's own cost. TRL: the time spent in
  `GRPOTrainer._generate_and_score_completions` (tokenising, generation, decoding, reward,
  advantages; timed by a subclass that only wraps it), the rest of the step is training.
- generated tokens: completion tokens including the end token, counted from the
  `completion_ids` TRL hands the reward function (ours: `compute/gen_tokens`, same rule).
- held-out greedy accuracy at step 0, every `--eval-every` steps and at the end, with the
  project's evaluator (`evaluation.evaluate_greedy` with a `TransformersGenerator` built from
  the generator config, on the task's held-out prompts), outside the timed region; for TRL in
  the callback, on a copy of the weights loaded into a generator built before TRL patches the
  model, inside `torch.random.fork_rng` so that evaluating does not move TRL's sampling
  stream. Step 0 is the same weights on both sides, so the two first accuracies are equal.

Decisions:
- algo.max_grad_norm is mirrored (1.0 by default, which clips) rather than CPU-DEMO's 0.0:
  CPU-DEMO turned clipping off to match a prototype loop that did not clip; our learner clips
  at algo.max_grad_norm, so TRL gets the same value. `algo.max_grad_norm=0` on the command
  line turns clipping off on both sides (CPU-DEMO's setting).
- Differences TRL does not let us remove, so they stay (and are part of what is compared):
  TRL divides advantages by the unbiased group std + 1e-4 (ours: population std + 1e-6, and
  0 for an all-equal group, which TRL's numerator also gives); TRL's old log-probs are the
  learner's own detached log-probs (ratio exactly 1), ours are the generator's (ratio 1 up to
  rounding); TRL computes the entropy of every completion position in the loss forward.
- Seconds are wall time within the steps on each side; for TRL the generation + training
  seconds equal the step seconds by construction (its orchestration happens inside them).
  Cumulative seconds in the plot and table are those step seconds (ours: round seconds);
  `gen_train_seconds` (ours: compute/gen_train_seconds) is in the JSON as well.
- Each side runs in a fresh process (peers.py alternates them in blocks), with the same torch
  thread count (model.torch_threads; 0 leaves torch's default). TRL's trajectory differs from
  ours from the first sample (different sampling streams), but each side is deterministic
  under `seed` (accuracies repeat to the last digit; seconds do not).
- Measure on a quiet machine: every side is CPU-bound on model.torch_threads threads, and
  any other CPU-heavy process inflates its seconds by as much as it takes.
- `--eval-every` defaults to steps // 10 (at least 1), so a run has about ten accuracy points;
  0 evaluates only at the start and the end.
- Only configurations TRL can mirror are accepted: the sync no-buffer loop (buffer strategy
  `fresh`, one update per step), objective `grpo_clip`, no KL penalty, the transformers
  backend. Keys the benchmark sets itself (loop.steps, loop.eval_every, tracking.root_dir,
  ...) are refused as overrides, with the flag to use instead. All of this, and a bad
  `--steps`/`--eval-every`, an unwritable root or a missing TRL, fails before any work.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
import time
import warnings
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Callable, Sequence

EXPERIMENT = "peer-benchmark"
INSTALL_HINT = "install the dev extra: pip install -c infra/constraints-cpu.txt -e '.[dev]' (or pip install 'trl>=1.0')"

#: Overrides the benchmark sets itself: key -> what to use instead.
CONTROLLED = {
    "experiment": "the benchmark always runs experiment=no_buffer",
    "tracking.root_dir": "use --root",
    "loop.steps": "use --steps",
    "loop.eval_every": "use --eval-every",
    "loop.passk_every": "sampled evaluations run only at the ends",
    "loop.checkpoint_every": "checkpoints are written only at the end",
    "tracking.experiment": f"the flow's run goes to experiment {EXPERIMENT!r}",
    "tracking.parent_run_id": "the flow's run is a child of the comparison run",
    "run_id": "each repeat of our side names its own run",
    "resume": "the benchmark starts a new run",
    "fork": "the benchmark starts a new run",
}


class BenchmarkError(ValueError):
    """Bad input to the benchmark; the message says what to change."""


# ------------------------------------------------------------------ input checks
def default_eval_every(steps: int) -> int:
    return max(1, steps // 10)


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def flow_overrides(root: str | Path, steps: int, eval_every: int, overrides: Sequence[str],
                   parent_run_id: str | None = None) -> list[str]:
    """The Hydra overrides our side runs with (the user's, then the benchmark's own)."""
    out = [*overrides, "experiment=no_buffer", f"tracking.root_dir={root}", f"loop.steps={steps}",
           f"loop.eval_every={eval_every}", "loop.passk_every=0", "loop.checkpoint_every=0",
           f"tracking.experiment={EXPERIMENT}"]
    if not any(_override_key(o) == "tracking.progress" for o in overrides):
        out.append("tracking.progress=false")  # the bar would scroll the benchmark's log away
    if parent_run_id:
        out.append(f"tracking.parent_run_id={parent_run_id}")
    return out


def check_inputs(steps: int, root: str | Path, eval_every: int | None, overrides: Sequence[str],
                 need_trl: bool = True):
    """Everything that can be refused, refused before any work: returns (resolved config of
    our side, eval_every). Raises BenchmarkError (or ConfigError, also a ValueError). TRL
    must be installed only when its side runs (`need_trl`)."""
    # start-up cost: the library (torch, lancedb, mlflow) loads after the command has parsed its arguments
    from replay_pipeline.run.resume import resolve_config

    if not isinstance(steps, int) or steps < 1:
        raise BenchmarkError(f"--steps {steps} must be an integer >= 1 (learner steps on each side)")
    eval_every = default_eval_every(steps) if eval_every is None else eval_every
    if not isinstance(eval_every, int) or eval_every < 0:
        raise BenchmarkError(f"--eval-every {eval_every} must be >= 0 (0: evaluate only at the start and the end)")
    bad = [o for o in overrides if o.startswith("-") or "=" not in o]
    if bad:
        raise BenchmarkError(f"{bad} are not overrides; give key=value (e.g. algo.lr=6e-5) or one of the flags "
                             "--steps, --root, --eval-every")
    for o in overrides:
        key = _override_key(o)
        if key in CONTROLLED:
            raise BenchmarkError(f"override {o!r} is set by the benchmark ({CONTROLLED[key]})")
    if need_trl:
        check_trl()
    cfg = resolve_config(flow_overrides(root, steps, eval_every, overrides))
    problems = []
    if cfg.loop.mode != "sync":
        problems.append(f"loop.mode={cfg.loop.mode}: TRL's GRPOTrainer mirrors the sync loop only; drop loop=async")
    if cfg.buffer.strategy != "fresh":
        problems.append(f"buffer.strategy={cfg.buffer.strategy}: the comparison is with the no-buffer baseline "
                        "(strategy fresh); drop the buffer override")
    if cfg.loop.updates_per_step != 1:
        problems.append(f"loop.updates_per_step={cfg.loop.updates_per_step}: the comparison takes one learner step "
                        "per generation step, as GRPOTrainer does with steps_per_generation=1; drop the override")
    if cfg.algo.objective != "grpo_clip":
        problems.append(f"algo.objective={cfg.algo.objective}: GRPOTrainer's loss is the GRPO clip; use algo=grpo")
    if cfg.algo.kl_coef != 0:
        problems.append(f"algo.kl_coef={cfg.algo.kl_coef}: the comparison runs without a KL penalty "
                        "(TRL beta=0); set algo.kl_coef=0")
    if cfg.generator.backend != "transformers":
        problems.append(f"generator.backend={cfg.generator.backend}: TRL generates with transformers here")
    if problems:
        raise BenchmarkError("this configuration has no TRL counterpart:\n  - " + "\n  - ".join(problems))
    # start-up cost: the library (torch, lancedb, mlflow) loads after the command has parsed its arguments
    from replay_pipeline.system.runs import ensure_writable

    ensure_writable(root)  # PermissionError with the fix
    return cfg, eval_every


def check_trl() -> None:
    """TRL is installed and new enough (BenchmarkError with the install command if not)."""
    if importlib.util.find_spec("trl") is None:
        raise BenchmarkError(f"TRL is not installed; {INSTALL_HINT}")
    # start-up cost: only when the TRL version is checked
    from packaging.version import Version

    if Version(version("trl")) < Version("1.0"):
        raise BenchmarkError(f"TRL {version('trl')} is too old (GRPOConfig as used here needs >= 1.0); {INSTALL_HINT}")


def load_side_policy(cfg, log: Callable[[str], Any] = print):
    """(task, model, tokenizer) for a side outside the flow: the task the configuration names
    and the policy our flow starts from (the cached warm start under tracking.root_dir, or
    model.path), at model.torch_threads threads."""
    # start-up cost: torch/transformers, only on this path
    import torch
    from omegaconf import OmegaConf

    from replay_pipeline.config import TASK_DEFAULTS
    from replay_pipeline.models.policy import load_policy
    from replay_pipeline.system.runs import RunPaths
    from replay_pipeline.tasks import task_from_config

    if cfg.model.torch_threads:
        torch.set_num_threads(cfg.model.torch_threads)
    task = task_from_config(OmegaConf.to_container(cfg.task, resolve=True), TASK_DEFAULTS)
    paths = RunPaths.make(cfg.tracking.root_dir, "peer-benchmark")  # only its cache/ is used
    model, tokenizer, _ = load_policy(cfg, task, paths, log=log)
    return task, model, tokenizer


# ------------------------------------------------------------------ our side
def _history(client, run_id: str, key: str) -> dict[int, float]:
    """A metric's value at each step (`_timed_history` without the timestamps)."""
    return _timed_history(client, run_id, key)[0]


def _timed_history(client, run_id: str, key: str) -> tuple[dict[int, float], dict[int, float]]:
    """`_history`, and when each step's value was logged, epoch seconds (one read): MLflow keeps
    milliseconds, truncated, so 1 ms is added (a later bound, never an earlier one). The flow
    logs a round's metrics right after the round, an evaluation's right after it."""
    metrics = client.get_metric_history(run_id, key)
    return ({int(m.step): float(m.value) for m in metrics},
            {int(m.step): m.timestamp / 1000 + 0.001 for m in metrics})


def ours_command(root: str | Path, steps: int, eval_every: int, overrides: Sequence[str], run_id: str,
                 parent_run_id: str | None = None) -> list[str]:
    """Our side as a user runs it: `python -m flows.train` with the benchmark's overrides."""
    return [sys.executable, "-m", "flows.train", *flow_overrides(root, steps, eval_every, overrides, parent_run_id),
            f"run_id={run_id}"]


def read_ours(mlflow_uri: str, run_id: str, steps: int) -> dict[str, Any]:
    """Our side's record, read back from the MLflow ledger of the flow run `run_id` (the run
    tagged replay_pipeline.run_id = run_id in experiment EXPERIMENT)."""
    # start-up cost: mlflow takes seconds to import; only this path talks to the store
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    found = client.search_runs([experiment.experiment_id], filter_string=f"tags.`replay_pipeline.run_id` = '{run_id}'",
                               max_results=1) if experiment else []
    if not found:
        raise RuntimeError(f"no MLflow run of flow run {run_id} in experiment {EXPERIMENT!r} at {mlflow_uri}")
    run = found[0]
    rid = run.info.run_id
    rounds, round_ends = _timed_history(client, rid, "compute/round_seconds")
    gen = _history(client, rid, "compute/gen_seconds")
    tokens = _history(client, rid, "compute/gen_tokens")
    gen_train = _history(client, rid, "compute/gen_train_seconds")
    learn = _history(client, rid, "learn/seconds")
    evals, eval_ends = _timed_history(client, rid, "eval/accuracy")
    eval_seconds = _history(client, rid, "eval/seconds")
    eval_tokens = _history(client, rid, "eval/greedy_tokens")
    startup, startup_at = _timed_history(client, rid, "startup/seconds")
    startup_eval = _history(client, rid, "startup/eval_seconds")
    missing = [s for s in range(steps) if s not in rounds or s not in learn or s not in gen]
    if missing:
        raise RuntimeError(f"the flow's MLflow run {rid} lacks round metrics for steps {missing[:5]}")
    step_s, gen_s = _diffs([rounds[s] for s in range(steps)]), _diffs([gen[s] for s in range(steps)])
    points = []
    for done, acc in sorted(evals.items()):
        before = done - 1  # ledger figures are logged after the round with index done - 1
        points.append({"step": done, "accuracy": acc,
                       "gen_tokens": tokens[before] if done else 0.0,
                       "seconds": rounds[before] if done else 0.0,
                       "gen_train_seconds": gen_train[before] if done else 0.0,
                       "eval_seconds": eval_seconds.get(done), "eval_tokens": eval_tokens.get(done),
                       "ended_at": eval_ends.get(done)})
    threads = run.data.params.get("model.torch_threads")
    return {
        "name": "ours (python -m flows.train experiment=no_buffer)",
        "run_id": run_id, "mlflow_run_id": rid,
        "step_seconds": step_s, "gen_seconds": gen_s, "train_seconds": [learn[s] for s in range(steps)],
        "gen_tokens": tokens[steps - 1], "evals": points,
        "eval_seconds": sum(eval_seconds.values()), "eval_tokens": sum(eval_tokens.values()),
        "startup_seconds": startup.get(0), "torch_threads": int(threads) if threads else None,
        "startup_at": startup_at.get(0), "startup_eval_seconds": startup_eval.get(0),
        "step_ended_at": [round_ends[s] for s in range(steps)],
        "wall_seconds": (run.info.end_time - run.info.start_time) / 1000 if run.info.end_time else None,
    }


def _diffs(cumulative: list[float]) -> list[float]:
    return [b - a for a, b in zip([0.0, *cumulative[:-1]], cumulative)]


# ------------------------------------------------------------------ TRL's side
def trl_config_kwargs(cfg, steps: int, output_dir: str | Path) -> dict[str, Any]:
    """GRPOConfig arguments that mirror our resolved configuration (module docstring)."""
    # optional dependency: trl (the dev extra)
    from trl import GRPOConfig

    loop, gen, algo = cfg.loop, cfg.generator, cfg.algo
    kwargs: dict[str, Any] = dict(
        output_dir=str(output_dir), seed=int(cfg.seed), max_steps=steps,
        per_device_train_batch_size=loop.prompts_per_step * loop.group_size,
        gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
        num_generations=loop.group_size, shuffle_dataset=False,
        temperature=float(gen.temperature), top_p=float(gen.top_p), top_k=0,
        max_completion_length=int(gen.max_new_tokens),
        learning_rate=float(algo.lr), lr_scheduler_type="constant", warmup_steps=0,
        optim="adamw_torch_fused", adam_beta1=float(algo.adam_beta1), adam_beta2=float(algo.adam_beta2),
        weight_decay=float(algo.weight_decay), max_grad_norm=float(algo.max_grad_norm),
        epsilon=float(algo.eps_low), epsilon_high=float(algo.eps_high), beta=0.0,
        loss_type={"token_mean": "dapo", "seq_mean": "grpo"}[algo.loss_agg], scale_rewards="group",
        bf16=False, fp16=False, use_cpu=True, report_to="none",
        save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
    )
    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    # transformers 5 renamed gradient checkpointing; setting the new name avoids its warning
    kwargs["activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"] = False
    return kwargs


def run_trl(cfg, steps: int, eval_every: int, work_dir: Path, log: Callable[[str], Any] = print) -> dict[str, Any]:
    """TRL's GRPOTrainer on the flow's warm-started policy; see the module docstring."""
    # start-up cost: torch/transformers, only on this path
    import torch
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    # start-up cost: the library (torch, lancedb, mlflow) loads after the command has parsed its arguments
    from replay_pipeline.training.evaluation import evaluate_greedy
    from replay_pipeline.generation import TransformersGenerator
    from replay_pipeline.run.accounting import process_started
    from replay_pipeline.run.batches import step_prompts
    from replay_pipeline.tasks.base import Prompt

    start = time.perf_counter()
    task, model, tokenizer = load_side_policy(cfg, log)
    heldout = list(task.heldout_prompts())
    eos = tokenizer.eos_token_id

    prompts = [p for s in range(steps) for p in step_prompts(task, cfg, s)[0]]  # our flow's, in order
    dataset = Dataset.from_dict({"prompt": [p.text for p in prompts], "answer": [p.answer for p in prompts],
                                 "prompt_id": [p.prompt_id for p in prompts]})
    completion_lengths: list[list[int]] = []  # one list per generation batch (= per step)

    def verifier(prompts, completions, completion_ids, answer, prompt_id, **_):
        completion_lengths.append([len(ids) for ids in completion_ids])
        return [task.reward(Prompt(pid, text, ans), completion, "stop" if ids and ids[-1] == eos else "length")
                for text, completion, ids, ans, pid in zip(prompts, completions, completion_ids, answer, prompt_id)]

    gen_seconds: list[float] = []

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                gen_seconds.append(time.perf_counter() - t0)

    step_seconds: list[float] = []
    threads_seen: set[int] = set()
    points: list[dict[str, float]] = []
    eval_seconds: list[float] = []
    eval_tokens: list[float] = []
    startup: list[float] = []  # process creation to the first step, less the step-0 evaluation
    startup_at: list[float] = []  # when the first step began, epoch seconds
    step_ended_at: list[float] = []  # epoch seconds (the clock peers.py's turns record pauses in)

    # Built before TRL patches the model's forward (GRPOTrainer adds a fused LM head whose
    # closure calls the original module's forward, so a deep copy made later would still run
    # the trainer's module); each evaluation copies the current weights into it.
    eval_generator = TransformersGenerator.from_config(model, tokenizer, cfg.generator)

    def evaluate(done: int, policy) -> None:
        t0 = time.perf_counter()
        with torch.random.fork_rng(devices=[]):  # evaluating must not move TRL's sampling stream
            eval_generator.load_weights(policy.state_dict(), done)
            scores = evaluate_greedy(eval_generator, task, heldout, seed=cfg.seed)
        acc = scores["eval/accuracy"]
        eval_tokens.append(scores["eval/greedy_tokens"])
        eval_seconds.append(time.perf_counter() - t0)
        tokens = float(sum(sum(batch) for batch in completion_lengths))
        points.append({"step": done, "accuracy": acc, "gen_tokens": tokens, "seconds": sum(step_seconds),
                       "gen_train_seconds": sum(step_seconds), "eval_seconds": eval_seconds[-1],
                       "eval_tokens": eval_tokens[-1], "ended_at": time.time()})

    class StepTimer(TrainerCallback):
        began = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            if not startup:
                startup_at.append(time.time())
                startup.append(startup_at[0] - process_started() - sum(eval_seconds))
            threads_seen.add(torch.get_num_threads())
            self.began = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            step_seconds.append(time.perf_counter() - self.began)
            step_ended_at.append(time.time())
            done = state.global_step
            if done == steps or (eval_every and done % eval_every == 0):
                evaluate(done, model)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5's renames, inside TRL
        args = GRPOConfig(**trl_config_kwargs(cfg, steps, work_dir))
        trainer = TimedGRPOTrainer(model=model, reward_funcs=verifier, args=args, train_dataset=dataset,
                                   processing_class=tokenizer, callbacks=[StepTimer()])
        trainer.remove_callback(PrinterCallback)  # it prints every log dict
        evaluate(0, trainer.model)
        trainer.train()
    wall = time.perf_counter() - start
    if len(step_seconds) != steps or len(gen_seconds) != steps or len(completion_lengths) != steps:
        raise RuntimeError(f"TRL ran {len(step_seconds)} steps and {len(gen_seconds)} generations "
                           f"({len(completion_lengths)} scored batches), expected {steps} of each")
    logged = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    return {
        "name": f"TRL {_version('trl')} GRPOTrainer",
        "step_seconds": step_seconds, "gen_seconds": gen_seconds,
        "train_seconds": [s - g for s, g in zip(step_seconds, gen_seconds)],
        "gen_tokens": float(sum(sum(b) for b in completion_lengths)),
        "completion_lengths": completion_lengths, "logged_mean_lengths": logged,
        "batch": cfg.loop.prompts_per_step * cfg.loop.group_size,
        "evals": points, "eval_seconds": sum(eval_seconds), "eval_tokens": sum(eval_tokens),
        "startup_seconds": startup[0] if startup else None,
        "startup_at": startup_at[0] if startup_at else None, "startup_eval_seconds": eval_seconds[0],
        "step_ended_at": step_ended_at,
        "torch_threads": sorted(threads_seen)[0] if len(threads_seen) == 1 else sorted(threads_seen),
        "wall_seconds": wall,
        # as the trainer resolved them (not as passed), so a setting TRL overrode would show here
        "config": {k: _plain(getattr(trainer.args, k)) for k in trl_config_kwargs(cfg, steps, work_dir)
                   if k != "output_dir"},
        "optimizer": type(getattr(trainer.optimizer, "optimizer", trainer.optimizer)).__name__,
        "lr_scheduler": type(trainer.lr_scheduler).__name__,
    }


def _plain(value: Any) -> Any:
    """A JSON-friendly value (enums by their value)."""
    value = getattr(value, "value", value)
    return value if isinstance(value, (bool, int, float, str, type(None))) else str(value)


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "?"


def _prefect_home(root: str | Path) -> None:
    """Prefect's ephemeral state under the run root, as `python -m flows.train` keeps it
    (effective only before Prefect is first imported; a set PREFECT_HOME wins)."""
    os.environ.setdefault("PREFECT_HOME", str(Path(root).expanduser().resolve() / ".prefect"))


def _remove_if_empty(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass
