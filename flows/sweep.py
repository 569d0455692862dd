"""A sweep: named training configurations, each with several seeds, as child runs of one Prefect
flow run and of one MLflow parent run; then a learning-rate stage and the report.

    python -m flows.sweep                                   # the default grid (GRIDS["default"], 38 min measured here)
    python -m flows.sweep --quick                           # the quick grid (~15 min)
    python -m flows.sweep --grid headline                   # baseline vs the two best + 2 controls, seeds 10-19
    python -m flows.sweep --grid long                       # baseline vs the best + 2 controls, 3x the budget
    python -m flows.sweep --grid adaptive                   # adaptive reuse rules, selection seeds 0-3
    python -m flows.sweep --grid adaptive-confirm --seeds 10,11,12,13,14 tracking.root_dir=runs-a   # one shard
    python -m flows.sweep --seeds 0,1,2,3 loop.steps=200    # overrides shared by every child
    python -m flows.sweep --config base=experiment=no_buffer \
        --config big=experiment=replay,buffer.capacity=512 --lr-factors 0.5,2 --name capacity

Each child is the `train` flow run as a sub-flow (so the Prefect UI shows it under the sweep),
with run id `<name>-<config>-s<seed>-<sweep id>` and `tracking.parent_run_id` set, so its MLflow
run is nested under the sweep's parent run. Every child configuration is composed and
validated before the first child starts; a bad one stops the sweep before any work (exit 2). A
child that fails is recorded as failed and the others still run; the parent run ends FAILED
then.

Every configuration gets the baseline's generation budget (`equal_budget`): one that generates
fewer rollouts a step runs proportionally more steps and is evaluated as often per generated
rollout, unless it sets `loop.steps` / `loop.eval_every` itself.

**Held-out protocol.** A grid that confirms configurations chosen elsewhere records where
(`Grid.selection`): the headline and long grids run confirmation seeds 10-19, disjoint from the
seeds that chose their configurations (the default grid's 0-3; the headline's 0-9), with the two
controls (`no_buffer_r32`, the on-policy baseline at the winners' size, and
`onpolicy_prio_r32_b32`, on-policy drawing by |advantage| from the fresh batch only).
`--selection-seeds` states them for a sweep of explicit configurations; seeds that both chose
and would confirm are refused (exit 2). sweep.json's `protocol` carries them to the report.

**Shards.** A grid's seeds may be split over processes or machines, each a sweep of the same
grid with its own `--seeds` and `tracking.root_dir`; `python -m flows.report PARENT --root A
--shard B PARENT_B` reports them as one (replay_pipeline.reports.report.merge_shards).

With learning-rate factors (the default grid: x0.5 and x2, on 2 of its seeds), a second stage follows: the
baseline (`--baseline`, default `no_buffer`) and the best buffer configuration of the first
stage (the lowest median per-seed crossing of the baseline's peak in projected compute,
replay_pipeline.reports.report.best_config) run again at their learning rate times each factor, as
configurations `<config>-lrx<factor>` of the same family, so the report can draw each family's
Pareto frontier of accuracy against compute.

The parent run holds `sweep.json` (each child's configuration, seed, run ids, status, held-out
accuracy before, after and best, and the generation and training compute; the baseline, the
families and the stage-1 best; the children not yet ended as `pending`), logged again after
every child, so a sweep still running or stopped part-way can be reported on the children it
finished; and, at the end, the report under `report/`
(replay_pipeline.reports.report; `python -m flows.report PARENT_RUN_ID` makes it again).

The same flow is the `sweep` deployment (flows/deploy.py): its parameters are `configs` (name
-> Hydra overrides), `seeds`, `overrides`, `name`, `grid`, `lr_factors`, `baseline`, `report`,
`mu` and `lr_seeds` (how many of the seeds the learning-rate stage uses; the default grid: 2).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tempfile
import uuid
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import flows  # noqa: F401  (sets Prefect's environment before prefect is imported)
from prefect import flow

from replay_pipeline.config import ConfigError, config_dir_override
from replay_pipeline.run.resume import resolve_config
from replay_pipeline.system.runs import RunPaths, ensure_writable

_NAME = re.compile(r"[A-Za-z0-9_-]+")
DEFAULT_BASELINE = "no_buffer"


@dataclass(frozen=True)
class Grid:
    """A named sweep: configurations (name -> Hydra overrides), seeds, overrides shared by every
    child, and the learning-rate factors of the second stage (see `sweep`)."""
    configs: dict[str, list[str]]
    seeds: list[int]
    overrides: list[str]
    lr_factors: list[float]
    about: str
    lr_seeds: int | None = None
    """How many of the seeds the learning-rate stage uses (None: all)."""
    selection: dict[str, Any] | None = None
    """How the grid's configurations were chosen, for the held-out protocol (`protocol`):
    {"seeds": the seeds whose runs chose them, "chosen_on": where, "configs_tried": how many
    configurations competed, "variants_tried": how many further variants were tried}. The
    grid's own seeds must be disjoint from these: its report is then a confirmation."""


def _shared(steps: int, eval_every: int = 10) -> list[str]:
    """Settings every child of a built-in grid shares: `steps` baseline steps (short enough for
    the grid's budget), held-out greedy accuracy every `eval_every` often enough to see when a
    run reaches the baseline's peak, pass@k (the paper's: top_p 0.95, pass@1 over 4 samples)
    at every other evaluation through training, so the report can read the maximum over
    training of the median pass@k curve, and a checkpoint at the end only. (Nothing that
    changes the task's split, such as task.heldout_size: that would warm-start a new model
    instead of reusing the cached one.)"""
    return [f"loop.steps={steps}", f"loop.eval_every={eval_every}", f"loop.passk_every={2 * eval_every}",
            "loop.checkpoint_every=0", "tracking.progress=false"]

#: What the default grid's half-generation configurations share (see there).
_HALF = ["experiment=replay", "buffer=positive_bias", "buffer.strategy=prioritized", "buffer.capacity=256",
         "loop.prompts_per_step=4", "loop.updates_per_step=1"]

#: The paper's comparison at this project's scale (issue 8): the on-policy baseline against FIFO
#: buffers of several capacities and replay ratios, positive-bias sampling and AsymRE, at equal
#: settings otherwise; then a learning-rate sweep of the baseline and of the best buffer
#: configuration. Measured: 38 min on a 2-core CPU machine (docs/results.md, "Exploration"; the
#: budget is 60).
_DEFAULT = Grid(
    configs={
        "no_buffer": ["experiment=no_buffer"],
        "fifo128_k2": ["experiment=replay"],
        "fifo256_k4": ["experiment=replay", "buffer.capacity=256", "loop.updates_per_step=4"],
        "posbias256_k4": ["experiment=replay", "buffer=positive_bias", "buffer.capacity=256",
                          "loop.updates_per_step=4"],
        "asymre128_k2": ["experiment=replay", "algo=asymre"],
        # Half the generation a learner step: 4 prompts (32 rollouts) a step, the window
        # positive-biased and drawn by |advantage| (zero-advantage rollouts, which carry no
        # gradient, almost never), one step of B=64 (replay ratio 2) or B=32 (ratio 1), from
        # a window of 256 or 512; by equal_budget they run 200 steps, evaluated every 20,
        # for the baseline's rollouts.
        "posbias_prio256_r32": _HALF,
        "posbias_prio256_r32_b32": [*_HALF, "loop.minibatch_size=32"],
        "posbias_prio512_r32_b32": [*_HALF, "loop.minibatch_size=32", "buffer.capacity=512"],
        # The control for those three: the on-policy baseline at the same 4 prompts a step.
        "no_buffer_r32": ["experiment=no_buffer", "loop.prompts_per_step=4"],
    },
    seeds=[0, 1, 2, 3],
    overrides=_shared(100),
    lr_factors=[0.5, 2.0],
    lr_seeds=2,  # 2 seeds: the learning-rate variants take about a fifth of the time
    about="the on-policy baseline against seven buffer configurations and a half-batch on-policy control, "
          "4 seeds, each generating 6,400 rollouts, then learning rates x0.5 and x2 (2 seeds) for the "
          "baseline and the best buffer configuration")

#: The control that could explain the winner's saving away: on-policy at its size (4 prompts, one
#: update of 32 a step) drawing by |advantage| from the fresh batch only (a window of exactly the
#: step's 32 rollouts), so zero-advantage rollouts are almost never trained on, with no replay.
_ONPOLICY_PRIO = ["experiment=replay", "buffer.strategy=prioritized", "buffer.capacity=32",
                  "loop.prompts_per_step=4", "loop.updates_per_step=1", "loop.minibatch_size=32"]

#: Confirmation seeds of the headline and long grids: never used to choose a configuration.
_CONFIRMATION = list(range(10, 20))

#: The adaptive grid's chosen rule (its selection stage, seeds 0-3: the only rule within 5% of
#: the static configuration's generated tokens to the baseline's peak).
_ADAPT_KL005 = ["reuse.max_updates=4", "reuse.rule=kl_budget", "reuse.kl_budget=0.005"]

#: The planner's recommendation from measured alpha and rho (see "adaptive-confirm").
_PLAN_MEASURED = ["buffer.capacity=1376", "loop.updates_per_step=2"]

#: What both adaptive confirmation grids compare: the baseline, the best static configuration
#: and the chosen rule on its design.
_ADAPT_COMPARED = {"no_buffer": ["experiment=no_buffer"],
                   "posbias_prio512_r32_b32": _DEFAULT.configs["posbias_prio512_r32_b32"],
                   "adapt_kl005": [*_DEFAULT.configs["posbias_prio512_r32_b32"], *_ADAPT_KL005]}

#: Where the adaptive confirmation's configurations were chosen: never on its seeds.
_ADAPT_SELECTION = {"seeds": [0, 1, 2, 3], "chosen_on": "the adaptive grid's selection stage (GRIDS['adaptive'], "
                    "seeds 0-3) and the planner's measurement on the static configuration's seed-0 run",
                    "configs_tried": 7, "variants_tried": 0}

#: The adaptive confirmation at three times the budget (GRIDS["adaptive-long"]); its control
#: shard (GRIDS["adaptive-long-controls"]) is the same grid with other configurations.
_ADAPT_LONG = Grid(
    configs=dict(_ADAPT_COMPARED),
    seeds=_CONFIRMATION[:5],
    overrides=_shared(300),
    lr_factors=[],
    selection=_ADAPT_SELECTION,
    about="adaptive reuse (kl_budget 0.005) against the best static configuration and the baseline at "
          "three times the budget, 5 confirmation seeds (10-14)")

#: adaptive-long's budget stated for a configuration of 32 rollouts a step in a shard without
#: the baseline (equal_budget scales only against a baseline in the grid): the baseline's 300
#: steps of 64 rollouts are 600 of 32, evaluated every 20 (every 640 rollouts), as equal_budget
#: would set them.
_LONG_R32_BUDGET = ["loop.steps=600", "loop.eval_every=20", "loop.passk_every=40"]

#: The measured plan on the static design at adaptive-long's budget (its shards without the baseline).
_PLAN_MEASURED_LONG = [*_DEFAULT.configs["posbias_prio512_r32_b32"], *_PLAN_MEASURED, *_LONG_R32_BUDGET]

#: The built-in grids, by name (`--grid`).
GRIDS: dict[str, Grid] = {
    "default": _DEFAULT,
    # The paper's headline figure uses 10 seeds (PAPER.md, "How results are read"): the baseline
    # and the default grid's two best buffer configurations, no learning-rate stage. Measured:
    # 44 min on a 2-core CPU machine (docs/results.md, "Headline on confirmation seeds").
    # Confirmation seeds 10-19: the two configurations were chosen on the default grid's seeds
    # 0-3 (and its pass@16 variants on seeds 0-1 and 0-3), so those seeds cannot confirm them.
    # With both controls: the on-policy baseline at the winners' size, and the same drawing by
    # |advantage| from the fresh batch only.
    "headline": Grid(
        configs={**{name: _DEFAULT.configs[name]
                    for name in ("no_buffer", "posbias_prio256_r32_b32", "posbias_prio512_r32_b32",
                                 "no_buffer_r32")},
                 "onpolicy_prio_r32_b32": _ONPOLICY_PRIO},
        seeds=_CONFIRMATION,
        overrides=_DEFAULT.overrides,
        lr_factors=[],
        selection={"seeds": [0, 1, 2, 3], "chosen_on": "the default grid (GRIDS['default']), seeds 0-3",
                   "configs_tried": len(_DEFAULT.configs), "variants_tried": 15},
        about="the paper's headline comparison at 10 confirmation seeds (10-19): the on-policy baseline "
              "against the default grid's two best buffer configurations and two controls (on-policy at "
              "their size; on-policy drawing by |advantage| from the fresh batch), equal generation budget"),
    # The headline's best configuration against the baseline at three times the budget (300
    # baseline steps, 19,200 rollouts): at 100 steps every baseline run is still climbing fast,
    # while the paper compares runs near their peak (PAPER.md, "How results are read"); over 300
    # steps the baseline's climb slows down (it has not stopped: its median peaks at step 300).
    # Measured: 142 min on a 2-core CPU machine at one thread beside other work (docs/results.md,
    # "Three times the budget on confirmation seeds").
    "long": Grid(
        configs={**{name: _DEFAULT.configs[name]
                    for name in ("no_buffer", "posbias_prio512_r32_b32", "no_buffer_r32")},
                 "onpolicy_prio_r32_b32": _ONPOLICY_PRIO},
        seeds=_CONFIRMATION,
        overrides=_shared(300),
        lr_factors=[],
        selection={"seeds": list(range(10)), "chosen_on": "the headline grid's seeds 0-9 (its best) and a "
                   "300-step exploration on seeds 0-2", "configs_tried": 3, "variants_tried": 0},
        about="the on-policy baseline against the headline's best buffer configuration and the two controls "
              "at three times the generation budget (19,200 rollouts, the baseline near its peak), 10 "
              "confirmation seeds (10-19)"),
    # Adaptive reuse (replay_pipeline/algo/reuse.py), its selection stage: the rules and their
    # thresholds on the best static configuration's design (4 prompts a step, minibatches of
    # 32 from a positive-biased window of 512 drawn by |advantage|), up to 4 updates a round
    # instead of 1, on the selection seeds 0-3, with the static configuration and the
    # baseline. The chosen rule is then confirmed on seeds 10-19 at both budgets (issue 24).
    "adaptive": Grid(
        configs={"no_buffer": ["experiment=no_buffer"],
                 "posbias_prio512_r32_b32": _DEFAULT.configs["posbias_prio512_r32_b32"],
                 **{name: [*_DEFAULT.configs["posbias_prio512_r32_b32"], "reuse.max_updates=4", *rule]
                    for name, rule in {
                        "adapt_kl005": ["reuse.rule=kl_budget", "reuse.kl_budget=0.005"],
                        "adapt_kl02": ["reuse.rule=kl_budget", "reuse.kl_budget=0.02"],
                        "adapt_spike15": ["reuse.rule=grad_spike", "reuse.spike_factor=1.5"],
                        "adapt_spike2": ["reuse.rule=grad_spike", "reuse.spike_factor=2"],
                        "adapt_clip01": ["reuse.rule=clip_budget", "reuse.clip_budget=0.1"],
                    }.items()}},
        seeds=[0, 1, 2, 3],
        overrides=_shared(100),
        lr_factors=[],
        about="adaptive reuse, selection stage: three rules at two thresholds (one for clip_budget), up to 4 "
              "updates a round on the best static configuration's design, against it and the baseline, "
              "selection seeds 0-3"),
    # Adaptive reuse, its confirmation (issue 24): the selection stage's best rule (kl_budget
    # 0.005, the adaptive grid's seeds 0-3) and the planner's recommendation from alpha and rho
    # measured on the static configuration's seed-0 run (`python -m flows.plan --run <seed-0 run>
    # --measure`: alpha -0.585, planned at 0.01, rho 0.160, mu 1.02 -> buffer.capacity=1376
    # loop.updates_per_step=2), against the best static configuration and the baseline, on the
    # confirmation seeds 10-19. A run takes about 3.3 min at one thread here, so the session
    # that ran it split the seeds over two processes (--seeds 10-14 and 15-19, one report
    # over both: flows.report --shard) and left out the controls, which the headline grid ran
    # on the same seeds at the same budget.
    "adaptive-confirm": Grid(
        configs={**_ADAPT_COMPARED,
                 "plan_measured": [*_DEFAULT.configs["posbias_prio512_r32_b32"], *_PLAN_MEASURED]},
        seeds=_CONFIRMATION,
        overrides=_shared(100),
        lr_factors=[],
        selection=_ADAPT_SELECTION,
        about="adaptive reuse (kl_budget 0.005) and the planner's measured plan against the best static "
              "configuration and the baseline, 10 confirmation seeds (10-19)"),
    # The same at three times the budget (300 baseline steps), the rule and the static
    # configuration against the baseline, on seeds 10-14; as two processes (--seeds 10,11,12 and
    # 13,14, --shard) about 75 min (docs/results.md, "At three times the budget, on one warm
    # start").
    "adaptive-long": _ADAPT_LONG,
    # The evidence protocol's better control (at 3x in the long grid: 0.86 of the baseline's
    # tokens against no_buffer_r32's 0.92) at the adaptive-long grid's budget, seeds and warm
    # start: a shard of that grid split by configuration (run with --name adaptive-long
    # --no-report, then one report over both: flows.report A --root RA --shard RB B --shard RC C),
    # so that adaptive reuse, the static configuration and the controls are read against one
    # baseline (docs/results.md, "At three times the budget, on one warm start"). equal_budget
    # scales a configuration against the baseline only when the baseline is among the grid's
    # configurations: this shard states the budget itself (the baseline's 300 steps of 64
    # rollouts = 600 of 32, evaluated every 640).
    "adaptive-long-controls": replace(
        _ADAPT_LONG,
        configs={"onpolicy_prio_r32_b32": [*_ONPOLICY_PRIO, *_LONG_R32_BUDGET]},
        about="the evidence protocol's better control (on-policy drawing by |advantage| from the fresh "
              "batch) at three times the budget, seeds 10-14: a shard of adaptive-long split by configuration"),
    # The rest of the adaptive comparison at three times the budget, a further shard of
    # adaptive-long split by configuration (run as the controls shard is): the planner's
    # measured plan on the static design and the other control (the on-policy baseline at the
    # winners' 4 prompts a step), so that every configuration of the 1x comparison is read at
    # 3x on one warm start; flows.report --budget 0.3333 reads the same runs at the default
    # budget (docs/results.md, "The same runs at the default budget").
    "adaptive-long-more": replace(
        _ADAPT_LONG,
        configs={"plan_measured": _PLAN_MEASURED_LONG,
                 "no_buffer_r32": [*_DEFAULT.configs["no_buffer_r32"], *_LONG_R32_BUDGET]},
        about="the planner's measured plan and the on-policy baseline at 4 prompts a step at three times "
              "the budget, seeds 10-14: a shard of adaptive-long split by configuration"),
    # The confirmation's other five seeds (15-19) for the baseline, the static configuration
    # and the measured plan (the best at 3x on seeds 10-14, 0.51 [0.36, 0.71]: decided after
    # that result, to read the best configuration on the protocol's ten confirmation seeds),
    # a shard of adaptive-long split by seed; run with --name adaptive-long --no-report and
    # reported with the other parts (docs/results.md, "At three times the budget, on one warm
    # start").
    "adaptive-long-best": replace(
        _ADAPT_LONG,
        configs={"no_buffer": _ADAPT_COMPARED["no_buffer"],
                 "posbias_prio512_r32_b32": _ADAPT_COMPARED["posbias_prio512_r32_b32"],
                 "plan_measured": _PLAN_MEASURED_LONG},
        seeds=_CONFIRMATION[5:],
        about="the baseline, the static configuration and the measured plan at three times the budget, "
              "seeds 15-19: a shard of adaptive-long split by seed"),
    # A newcomer's first sweep: the baseline against the headline's best configuration on three
    # of the confirmation seeds, so the report has a median seed (with two, the median crossing
    # is the mean of both seeds' and any seed that misses the target leaves no ratio) and reads
    # seeds that chose nothing. 60 baseline steps: the gap opens early, the runs stay short.
    "quick": Grid(
        configs={name: _DEFAULT.configs[name] for name in ("no_buffer", "posbias_prio512_r32_b32")},
        seeds=_CONFIRMATION[:3],
        overrides=_shared(60),
        lr_factors=[],
        selection={"seeds": [0, 1, 2, 3], "chosen_on": "the default grid (GRIDS['default']), seeds 0-3",
                   "configs_tried": len(_DEFAULT.configs), "variants_tried": 15},
        about="the on-policy baseline against the best buffer configuration, 3 held-out seeds, 60 steps: "
              "a look in about 15 minutes, not a result"),
    # A real pretrained model (issue 46): SmolLM2-135M-Instruct on reasoning-gym's chain_sum,
    # experiment=smollm2_chain_sum's model, task, sampling and evaluation (a test keeps them
    # equal), the on-policy baseline against the toy's confirmed winner and, where time allows,
    # its on-policy control at the same size. Chosen on the toy (the default grid's seeds 0-3;
    # the learning rate and temperature on seed 0 of this model), so seeds 10-12 confirm. 40
    # baseline steps (2,560 rollouts); a checkpoint every 10 steps, one kept (1.5 GB a run), so
    # a sweep stopped by a session's end continues (--continue) where each child was.
    "smollm2": Grid(
        configs={name: _DEFAULT.configs[name] for name in ("no_buffer", "posbias_prio256_r32_b32", "no_buffer_r32")},
        seeds=_CONFIRMATION[:3],
        overrides=["model=smollm2", "task=chain_sum", "generator.temperature=0.5", "algo.lr=2e-5", "algo.micro_batch_size=16",
                   "loop.eval_samples=8", "loop.pass1_samples=2", "loop.steps=40", "loop.eval_every=5",
                   "loop.passk_every=40", "loop.checkpoint_every=10", "loop.keep_checkpoints=1",
                   "tracking.progress=false"],
        lr_factors=[],
        selection={"seeds": [0, 1, 2, 3], "chosen_on": "the default grid (GRIDS['default']), seeds 0-3, on the toy; "
                   "this model's temperature and learning rate on seed 0", "configs_tried": len(_DEFAULT.configs),
                   "variants_tried": 15},
        about="SmolLM2-135M-Instruct on reasoning-gym chain_sum: the on-policy baseline against the toy's winner "
              "and its on-policy control, seeds 10-12, 40 baseline steps"),
}


@dataclass(frozen=True)
class Child:
    config: str
    seed: int
    run_id: str
    overrides: list[str]


def plan(configs: dict[str, list[str]], seeds: list[int], overrides: list[str], name: str,
         sweep_id: str) -> list[Child]:
    """Every child run of the sweep, each configuration composed and validated first; raises
    ConfigError naming every configuration that is wrong.

    A seed changes nothing but ``seed=``, so each configuration is composed at the first seed
    and each further seed at the first configuration: C + S - 1 compositions, not C x S (a
    composition takes a few tenths of a second; a built-in grid has 4-50 children)."""
    problems = []
    if not configs:
        problems.append("no configurations: give at least one --config NAME=OVERRIDE[,OVERRIDE...]")
    if not seeds:
        problems.append("no seeds: give at least one --seeds N")
    if len(set(seeds)) != len(seeds):
        problems.append(f"seeds repeat: {seeds}")
    for label in [name, *configs]:
        if not _NAME.fullmatch(str(label)):
            problems.append(f"{label!r}: sweep and configuration names use letters, digits, - and _ only")
    fixed = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") in ("seed", "run_id", "resume", "fork")]
    if fixed:
        problems.append(f"{fixed}: the sweep sets seed and run_id itself, and does not resume or fork")
    if problems:
        raise ConfigError("Invalid sweep:\n  - " + "\n  - ".join(problems))
    children = []
    for c, (config, extra) in enumerate(configs.items()):
        for s, seed in enumerate(seeds):
            run_id = f"{name}-{config}-s{seed}-{sweep_id}"
            child = [*overrides, *extra, f"seed={seed}", f"run_id={run_id}"]
            if s == 0 or c == 0:
                try:
                    resolve_config(child)
                except ConfigError as exc:
                    problems.append(f"configuration {config!r} (seed {seed}): {exc}")
                    break
            children.append(Child(config, int(seed), run_id, child))
    if problems:
        raise ConfigError("Invalid sweep:\n  - " + "\n  - ".join(problems))
    return children


#: What `equal_budget` scales: the run's length and how often it is evaluated, both counted in
#: generation steps.
_BUDGET_KEYS = ("steps", "eval_every", "passk_every")


def equal_budget(configs: dict[str, list[str]], overrides: list[str], baseline: str) -> dict[str, list[str]]:
    """Every configuration at the baseline's generation budget. A configuration that generates
    fewer (or more) rollouts per step than the baseline (loop.prompts_per_step x
    loop.group_size) runs proportionally more (or fewer) steps, rounded up, and is evaluated
    at the same interval of generated rollouts: its `loop.steps` and `loop.eval_every` are
    scaled by baseline rollouts / its rollouts (and `loop.passk_every` with them) (the baseline's own values when it sets them:
    a configuration of the same size then runs as long). So every child generates as many rollouts as
    the baseline's run, and every curve is sampled at the same points of the generated-token
    axis (a configuration evaluated more often would get more chances at a noisy peak). A
    configuration that sets one of these keys itself keeps its own value; without the
    baseline among the configurations nothing changes. Only the sync loop's steps are
    generation steps: an async configuration (or an async baseline) is left as it is, and so
    is one that does not compose (`plan` names it)."""
    def resolved(extra: list[str]) -> Any:
        try:
            return resolve_config([*overrides, *extra])
        except ConfigError:
            return None

    def rollouts(cfg: Any) -> int:
        return int(cfg.loop.prompts_per_step) * int(cfg.loop.group_size)

    base = resolved(configs[baseline]) if baseline in configs else None
    if base is None:
        return dict(configs)
    out = {}
    for name, extra in configs.items():
        if (cfg := resolved(extra)) is None or "async" in (cfg.loop.mode, base.loop.mode):
            out[name] = list(extra)
            continue
        ratio = Fraction(rollouts(base), rollouts(cfg))
        own = {o.split("=", 1)[0].lstrip("+~") for o in extra}
        target = {key: math.ceil(int(base.loop[key]) * ratio)
                  for key in _BUDGET_KEYS if f"loop.{key}" not in own}
        out[name] = list(extra) + [f"loop.{key}={value}" for key, value in target.items()
                                   if value != int(cfg.loop[key])]
    return out


def _parent_tracker(overrides: list[str], name: str, sweep_id: str, configs: dict[str, list[str]],
                    seeds: list[int]):
    # start-up cost: the library (torch, lancedb, mlflow) loads after the command has parsed its arguments
    from replay_pipeline.tracking.tracker import MlflowTracker
    from replay_pipeline.system.runs import artifact_location

    cfg = resolve_config(overrides)
    paths = RunPaths.make(cfg.tracking.root_dir, f"{name}-{sweep_id}")
    uri = cfg.tracking.mlflow_uri or paths.mlflow_uri
    tracker = MlflowTracker(uri=uri, experiment=cfg.tracking.experiment,
                            artifact_location=artifact_location(cfg, paths, uri),
                            run_name=f"{name}-{sweep_id}",
                            tags={"replay_pipeline.sweep": name, "replay_pipeline.sweep_id": sweep_id})
    tracker.log_params({"sweep.name": name, **_sweep_params(configs, seeds, overrides)})
    return tracker


def _sweep_params(configs: dict[str, list[str]], seeds: list[int], overrides: list[str]) -> dict[str, str]:
    """The settings a sweep's parent run records (MLflow params), which a continuation must match."""
    return {"sweep.seeds": str(seeds), **{f"sweep.config.{k}": " ".join(v) for k, v in configs.items()},
            "sweep.overrides": " ".join(overrides)}


def settle(grid: str | None, configs: dict[str, list[str]] | None, seeds: list[int] | None,
           overrides: list[str] | None, lr_factors: list[float] | None
           ) -> tuple[dict[str, list[str]], list[int], list[str], list[float]]:
    """The sweep's configurations, seeds, shared overrides and learning-rate factors: the
    grid's (default "default"), each replaced by what is given. Explicit `configs` without a
    grid use no grid at all (no shared overrides, no learning-rate stage unless given)."""
    if grid is not None and grid not in GRIDS:
        raise ConfigError(f"unknown sweep grid {grid!r}; choose one of {sorted(GRIDS)}")
    base = GRIDS[grid or "default"] if grid is not None or configs is None else None
    configs = dict(configs if configs is not None else base.configs)
    seeds = list(seeds if seeds is not None else (base.seeds if base else [0, 1]))
    shared = [*(base.overrides if base else []), *(overrides or [])]
    factors = [float(f) for f in (lr_factors if lr_factors is not None else (base.lr_factors if base else []))]
    bad = [f for f in factors if not (f > 0 and f != 1.0 and f == f and f != float("inf"))]
    if bad:
        raise ConfigError(f"learning-rate factors {bad}: each must be a finite number > 0 other than 1 "
                          "(1 is the configuration itself)")
    return configs, seeds, shared, factors


def protocol(seeds: list[int], selection_seeds: list[int] | None, grid: str | None,
             configs_given: bool) -> dict[str, Any]:
    """The held-out protocol recorded in sweep.json and read by the report: which seeds chose
    the configurations (the grid's `selection`, or `selection_seeds` as given) and which
    confirm them (this sweep's seeds). Overlapping seeds are refused: a configuration cannot
    be confirmed on the runs that chose it. Without a selection (a grid that chooses, such as
    the default, or explicit configurations): {"selection_seeds": None, ...}, and the report
    says that these runs may have chosen what they report."""
    chosen = GRIDS[grid or "default"].selection if grid is not None or not configs_given else None
    picked = list(selection_seeds) if selection_seeds is not None else (chosen or {}).get("seeds")
    out = {"confirmation_seeds": list(seeds), "selection_seeds": picked,
           "chosen_on": (chosen or {}).get("chosen_on") if selection_seeds is None else "as given (--selection-seeds)",
           "configs_tried": (chosen or {}).get("configs_tried"), "variants_tried": (chosen or {}).get("variants_tried")}
    overlap = sorted(set(seeds) & set(picked or []))
    if overlap:
        raise ConfigError(f"seeds {overlap} both chose the configurations (selection seeds {picked}) and would "
                          "confirm them: give confirmation seeds never used to choose, e.g. --seeds "
                          f"{max([*seeds, *picked]) + 1}-... (comma-separated)")
    return out


def lr_variants(config: str, extra: list[str], overrides: list[str], factors: list[float]) -> dict[str, list[str]]:
    """Configuration `config` at its learning rate times each factor: name `<config>-lrx<f>`
    (a dot written as p: `no_buffer-lrx0p5`), overrides + `algo.lr=<lr x f>`."""
    lr = float(resolve_config([*overrides, *extra]).algo.lr)
    return {f"{config}-lrx{f:g}".replace(".", "p"): [*extra, f"algo.lr={lr * f:.6g}"] for f in factors}


def _run_children(children: list[Child], parent, results: list[dict[str, Any]], root: str | None,
                  sweep_record: dict[str, Any]) -> None:
    """Train each child, recording its outcome. With `root` (a continued sweep): a child whose
    run is there and finished is not trained again (its summary is read back), one that was
    stopped part-way is resumed from its newest checkpoint (bit for bit), the rest start.
    `sweep_record` is the sweep's sweep.json, whose `children` is `results`: each child is
    listed in its `pending` until it ends, and the record is logged again after every child,
    so that a sweep stopped part-way can be reported on what it finished (flows.report)."""
    pending = sweep_record.setdefault("pending", [])
    pending.extend(child.run_id for child in children)
    # start-up cost: the library (torch, lancedb, mlflow) loads after the command has parsed its arguments
    from flows.train import train

    for child in children:
        record: dict[str, Any] = {"config": child.config, "seed": child.seed, "run_id": child.run_id,
                                  "overrides": child.overrides}
        try:
            state = _child_state(root, child.run_id) if root is not None else None
            if state == "finished":
                summary = _finished_summary(root, child.run_id)
                record["continued"] = "already finished"
            elif state == "resume":
                summary = train([f"resume={child.run_id}", f"tracking.root_dir={root}"])
                record["continued"] = "resumed"
            else:
                summary = train(child.overrides + [f"tracking.parent_run_id={parent.run_id}"])
            record |= {"status": "FINISHED", "mlflow_run_id": summary.get("mlflow_run_id"),
                       **{k: summary.get(k) for k in ("accuracy_before", "accuracy_after", "accuracy_best",
                                                      "gen_tokens", "gen_seconds", "train_seconds")}}
            for key in ("accuracy_after", "accuracy_best"):
                if isinstance(summary.get(key), (int, float)):
                    parent.log_metrics({f"{child.config}/{key}": float(summary[key])}, step=child.seed)
        except Exception as exc:  # one failed child does not stop the others
            record |= {"status": "FAILED", "error": f"{type(exc).__name__}: {exc}"}
        results.append(record)
        parent.log_metrics({"sweep/children_done": float(len(results))}, step=len(results) - 1)
        pending.remove(child.run_id)
        parent.log_dict(sweep_record, "sweep.json")


def _child_state(root: str, run_id: str) -> str | None:
    """What a continued sweep does with child `run_id`: "finished" (ended with every planned
    step), "resume" (it exists and was stopped, crashed or failed part-way), None (not there)."""
    from replay_pipeline.run.lineage import run_status  # start-up cost: the library, as above

    if not (RunPaths.make(root, run_id).run_dir / "config.yaml").is_file():
        return None
    state = run_status(root, run_id)
    if state.get("status") == "running":
        raise RuntimeError(f"child {run_id} is running in another process ({state.get('holder')}); "
                           "stop that process first, or wait for it")
    done, planned = state.get("steps_done"), state.get("steps_planned")
    if state.get("status") == "finished" and done is not None and planned is not None and done >= planned:
        return "finished"
    return "resume"


def _finished_summary(root: str, run_id: str) -> dict[str, Any]:
    """The summary a finished child logged (its MLflow run's summary.json)."""
    from mlflow.tracking import MlflowClient  # start-up cost: mlflow, only when continuing

    from replay_pipeline.run.lineage import read_run_info  # start-up cost: the library, as above

    info = read_run_info(root, run_id)
    client = MlflowClient(tracking_uri=info["mlflow_uri"])
    with tempfile.TemporaryDirectory() as tmp:
        return json.loads(Path(client.download_artifacts(info["mlflow_run_id"], "summary.json", tmp)).read_text())


def continued_parent(overrides: list[str], name: str, sweep_id: str, configs: dict[str, list[str]],
                     seeds: list[int]) -> tuple[str, str]:
    """(MLflow URI, run id) of the parent run of sweep `name-sweep_id` under the configured
    root; ConfigError when there is none, or when its configurations, seeds or shared overrides
    differ from these (a continuation runs the same sweep)."""
    if not _NAME.fullmatch(str(sweep_id)):
        raise ConfigError(f"--continue {sweep_id!r}: a sweep id is the letters and digits after the sweep's name "
                          "(sweep-3f9a1c: 3f9a1c), as the sweep printed when it started")
    cfg = resolve_config(overrides)
    uri = cfg.tracking.mlflow_uri or RunPaths.make(cfg.tracking.root_dir, f"{name}-{sweep_id}").mlflow_uri
    from mlflow.tracking import MlflowClient  # start-up cost: mlflow, only when continuing

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(cfg.tracking.experiment)
    found = [] if experiment is None else client.search_runs(
        [experiment.experiment_id], filter_string=f"tags.`replay_pipeline.sweep_id` = '{sweep_id}'")
    found = [r for r in found if r.data.tags.get("replay_pipeline.sweep") == name]
    if not found:
        raise ConfigError(f"no sweep {name}-{sweep_id} under tracking.root_dir={cfg.tracking.root_dir} (MLflow {uri}); "
                          "give the same --name, tracking.root_dir and sweep id the sweep printed when it started")
    params = found[0].data.params
    expected = _sweep_params(configs, seeds, overrides)
    given = {k: v for k, v in params.items() if k.startswith("sweep.") and k != "sweep.name"}
    if given != expected:
        differ = sorted(k for k in set(given) | set(expected) if given.get(k) != expected.get(k))
        raise ConfigError(f"sweep {name}-{sweep_id} ran other settings ({', '.join(differ)} differ): continue it "
                          "with the grid, configurations, seeds and overrides it started with")
    return uri, found[0].info.run_id


def _best(parent, record: dict[str, Any], baseline: str, log) -> str | None:
    """The best buffer configuration of the first stage (replay_pipeline.reports.report.best_config)."""
    # start-up cost: the library (torch, lancedb, mlflow) loads after the command has parsed its arguments
    from replay_pipeline.reports import report

    parent.log_dict(record, "sweep.json")
    try:
        summary, _ = report.summarise(report.load(parent.uri, parent.run_id, baseline))
    except report.ReportError as exc:
        log(f"no learning-rate stage for a buffer configuration: {exc}")
        return None
    return (summary.get("best") or {}).get("config")


@flow(name="sweep", flow_run_name="sweep-{name}")
def sweep(configs: dict[str, list[str]] | None = None, seeds: list[int] | None = None,
          overrides: list[str] | None = None, name: str = "sweep", grid: str | None = None,
          lr_factors: list[float] | None = None, baseline: str = DEFAULT_BASELINE, report: bool = True,
          mu: float = 5.28, lr_seeds: int | None = None, selection_seeds: list[int] | None = None,
          continue_id: str | None = None) -> dict[str, Any]:
    """Train every configuration (name -> Hydra overrides) with every seed, as child runs;
    `overrides` apply to all of them. Without `configs`, the grid `grid` (default "default").

    Two stages when there are learning-rate factors: (1) every configuration; (2) the
    baseline and the best buffer configuration of stage 1 (replay_pipeline.reports.report.best_config)
    at their learning rate times each factor, as
    configurations of the same family (the report draws each family's Pareto frontier). Then
    the report (replay_pipeline.reports.report: plots, report.md) on the parent run.

    `continue_id`: the id of a sweep that was stopped (its process killed, a session ended),
    given with the same settings: its parent run is attached again, finished children are kept,
    stopped ones resume bit for bit from their newest checkpoint, the rest start."""
    if lr_seeds is None and (grid is not None or configs is None):
        lr_seeds = GRIDS[grid or "default"].lr_seeds
    given = configs is not None
    configs, seeds, overrides, factors = settle(grid, configs, seeds, overrides, lr_factors)
    held_out = protocol(seeds, selection_seeds, grid, given)
    configs = equal_budget(configs, overrides, baseline)
    sweep_id = continue_id or uuid.uuid4().hex[:6]
    children = plan(configs, seeds, overrides, name, sweep_id)
    if factors and baseline in configs:  # the baseline's variants are known now: validate them too
        plan(lr_variants(baseline, configs[baseline], overrides, factors), seeds, overrides, name, sweep_id)
    if continue_id:
        # start-up cost: the library (torch, lancedb, mlflow) loads after the command has parsed its arguments
        from replay_pipeline.tracking.tracker import MlflowTracker

        parent = MlflowTracker.attach(*continued_parent(overrides, name, sweep_id, configs, seeds))
    else:
        parent = _parent_tracker(overrides, name, sweep_id, configs, seeds)
        print(f"sweep {name}-{sweep_id}: if it is stopped, continue it with the same arguments and "
              f"--continue {sweep_id}", flush=True)
    root = resolve_config(overrides).tracking.root_dir if continue_id else None
    results: list[dict[str, Any]] = []
    families = {c: c for c in configs}
    out = {"name": name, "sweep_id": sweep_id, "mlflow_run_id": parent.run_id, "baseline": baseline,
           "families": families, "lr_factors": factors, "protocol": held_out, "children": results}
    _run_children(children, parent, results, root, out)
    if factors and baseline in configs:
        best = _best(parent, out, baseline, print)
        stage2: dict[str, list[str]] = {}
        for config in [baseline] + ([best] if best else []):
            variants = lr_variants(config, configs[config], overrides, factors)
            stage2 |= variants
            families |= {v: config for v in variants}
        out["best_stage1"] = best
        _run_children(plan(stage2, seeds[:lr_seeds or len(seeds)], overrides, name, sweep_id), parent, results, root,
                      out)
    failed = [r for r in results if r["status"] != "FINISHED"]
    parent.log_dict(out, "sweep.json")
    if report and baseline in configs:
        out["report"] = _report(parent, baseline, mu, overrides)
    elif report:  # said, not skipped in silence: every ratio of the report is against the baseline
        print(f"no report: no configuration is named {baseline!r}, the baseline every ratio is taken against; "
              f"name one of {sorted(configs)} with --baseline NAME, or add the on-policy baseline "
              f"(--config {baseline}=experiment=no_buffer), then: python -m flows.report {parent.run_id} "
              "--baseline NAME", file=sys.stderr, flush=True)
    parent.finish("FAILED" if failed else "FINISHED")
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(results)} sweep children failed: "
                           + "; ".join(f"{r['run_id']}: {r['error']}" for r in failed))
    return out


def _report(parent, baseline: str, mu: float, overrides: list[str]) -> dict[str, Any]:
    """The report on the finished sweep; a report that cannot be made is said, not raised (the
    runs are done and stored; `python -m flows.report` can be run again)."""
    # start-up cost: the library (torch, lancedb, mlflow) loads after the command has parsed its arguments
    from replay_pipeline.reports import report

    root = resolve_config(overrides).tracking.root_dir
    try:
        made = report.build_report(parent.uri, parent.run_id, mu=mu, root=root, baseline=baseline)
    except report.ReportError as exc:
        print(f"no report: {exc}", file=sys.stderr)
        return {"error": str(exc)}
    print(made.table)
    return {"path": str(made.path), "artifacts": made.artifact_uri}


def _config_arg(text: str) -> tuple[str, list[str]]:
    name, sep, rest = text.partition("=")
    if not sep or not rest:
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME=OVERRIDE[,OVERRIDE...], e.g. big=buffer.capacity=512")
    return name, [o for o in rest.split(",") if o]


def _list_arg(kind: type):
    def parse(text: str) -> list:
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated {kind.__name__} values, e.g. "
                                             + ("0,1,2,3" if kind is int else "0.5,2")) from None
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m flows.sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid", choices=sorted(GRIDS), default=None,
                        help="a built-in grid: " + "; ".join(f"{k}: {g.about}" for k, g in GRIDS.items())
                             + " (default: default, unless --config is given)")
    parser.add_argument("--quick", action="store_const", const="quick", dest="grid", help="= --grid quick")
    parser.add_argument("--config", action="append", type=_config_arg, default=None, metavar="NAME=OVERRIDES",
                        help="a configuration: its name and comma-separated Hydra overrides (repeat); "
                             "replaces the grid's configurations")
    parser.add_argument("--seeds", "--confirmation-seeds", type=_list_arg(int), default=None, metavar="S1,S2,...",
                        dest="seeds", help="comma-separated seeds the sweep runs and reports (default: the grid's)")
    parser.add_argument("--selection-seeds", type=_list_arg(int), default=None, metavar="S1,S2,...",
                        help="the seeds whose runs chose these configurations (default: the grid's record; "
                             "must be disjoint from --seeds): the report reads the sweep as their confirmation")
    parser.add_argument("--lr-factors", type=_list_arg(float), default=None, metavar="F1,F2,...",
                        help="comma-separated learning-rate factors of the second stage (default: the grid's; "
                             "'' for none)")
    parser.add_argument("--baseline", default=DEFAULT_BASELINE, help="the baseline configuration's name")
    parser.add_argument("--mu", type=float, default=5.28, help="mu of the report's projected compute")
    parser.add_argument("--no-report", action="store_true", help="do not build the report at the end")
    parser.add_argument("--name", default="sweep")
    parser.add_argument("--continue", dest="continue_id", default=None, metavar="SWEEP_ID",
                        help="continue the stopped sweep NAME-SWEEP_ID (same arguments otherwise): finished children "
                             "are kept, stopped ones resume from their newest checkpoint, the rest start")
    parser.add_argument("--config-dir", action="append", default=None, metavar="DIR",
                        help="a directory of your own presets (DIR/<group>/<option>.yaml), for every child (repeat)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every child (loop.steps=100 ...)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.config_dir is not None:
            args.overrides = [config_dir_override(*args.config_dir), *args.overrides]
        configs, seeds, overrides, factors = settle(args.grid, dict(args.config) if args.config else None,
                                                    args.seeds, args.overrides, args.lr_factors)
        protocol(seeds, args.selection_seeds, args.grid, bool(args.config))
        configs = equal_budget(configs, overrides, args.baseline)
        plan(configs, seeds, overrides, args.name, "check")  # fail before Prefect starts
        if factors and args.baseline in configs:
            plan(lr_variants(args.baseline, configs[args.baseline], overrides, factors), seeds, overrides,
                 args.name, "check")
        ensure_writable(resolve_config(overrides).tracking.root_dir)
        if args.continue_id is not None:  # the sweep to continue exists and ran these settings
            continued_parent(overrides, args.name, args.continue_id, configs, seeds)
    except (ConfigError, PermissionError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = sweep(configs=dict(args.config) if args.config else None, seeds=args.seeds, overrides=args.overrides,
                name=args.name, grid=args.grid, lr_factors=args.lr_factors, baseline=args.baseline,
                report=not args.no_report, mu=args.mu, selection_seeds=args.selection_seeds,
                continue_id=args.continue_id)
    for r in out["children"]:
        print(f"{r['run_id']:<48} {r['status']:<9} held-out accuracy {r.get('accuracy_after')}")
    print(f"MLflow parent run {out['mlflow_run_id']}")
    if "path" in out.get("report", {}):
        print(f"report: {out['report']['path']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
