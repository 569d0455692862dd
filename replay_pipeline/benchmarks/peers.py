"""Performance side by side, interleaved: our no-buffer loop, TRL's GRPOTrainer and a bare
torch loop on the same warm start, prompts, shapes and settings, alternated in blocks.

    python -m replay_pipeline.benchmarks.peers                              # 120 steps, 3 repeats
    python -m replay_pipeline.benchmarks.peers --steps 60 --repeats 5 --root /tmp/peers
    python -m replay_pipeline.benchmarks.peers --sides ours,bare algo.lr=6e-5

Needs the dev extra for TRL's side (`pip install -e '.[dev]'`, which brings `trl`).

The sides (replay_pipeline/benchmarks/sides.py and bare.py):
- **ours**: `python -m flows.train experiment=no_buffer` as a user runs it (every rollout stored
  in LanceDB, usage records, MLflow, Prefect), its figures read back from its MLflow ledger;
- **trl**: `trl.GRPOTrainer` with every setting mirrored from our resolved configuration;
- **bare**: generate, score, one GRPO step, nothing stored (the physical reference).

How it runs:
1. every input is checked before any work (sides.check_inputs); model.torch_threads=0 (auto)
   is resolved once here and passed to every side, so all sides run on the same thread count;
2. the warm start is built or found in `<root>/cache` by a process of its own, not timed;
3. repeats x sides processes, in blocks: ours trl bare, ours trl bare, ... (each side a fresh
   process with the same seed; their output goes to `<out>/logs/`). Within a repeat the three
   processes take **turns** of `--slice-seconds` (2 s; replay_pipeline/benchmarks/turns.py):
   one runs while the other two are stopped (SIGSTOP on the whole process tree, our Prefect
   server included), ours trl bare ours trl bare ... until each has ended, so every side's
   steps are spread over the same minute and a slow spell of the machine falls on all of them.
   `--interleave processes` runs one whole process after another instead (each side's few
   seconds of steps then sit tens of seconds away from the others', and a 2-core VM's speed
   drifts by 10-15% over such spans);
4. per side and repeat, the median seconds per learner step and the generation / training /
   pipeline split (the medians of each part) over the steps no pause touched (neither the step
   nor the one before it, which resumes on caches the others evicted) and that lie in the
   repeat's **shared window**, the stretch of wall time in which every side was taking steps
   (`apply_window`; over every step no pause touched when a side has fewer than
   MIN_WINDOW_STEPS there, and the summary's `steps_compared` says which and why), start-up
   (process creation to the first step, less the step-0 evaluation and the pauses), evaluation cost
   (the evaluations no pause touched); per side, the median of the repeats' figures with their
   min and max; the ratios ours/trl and ours/bare taken within each repeat, with their
   median, min and max.

Targets (issue 26): ours <= 1.0x TRL and <= 1.05x the bare loop (the within-repeat ratios);
start-up to the first round under 10 s with a cached warm start (ours);
evaluations no slower per token than the round's own generation (greedy evaluation in
batches of up to generator.batch_size against sampling the step's rollouts: `eval_ms_per_token`
<= `gen_ms_per_token`).

Output: a table on stdout, `<root>/benchmarks/peers-<stamp>/peers.json` (every side's record
of every repeat, the summary and the settings) and `peers.png` (held-out accuracy against
generated tokens and against seconds in learner steps, each repeat; the per-step split),
both logged as artifacts of an MLflow run in experiment `peer-benchmark` of the store the flow
uses, with the summary as metrics; our side's flow runs are its children.

Verdicts (`verdict`): a target is **met** when every repeat meets it (the largest
within-repeat ratio, or start-up, is within the target), **missed** when no repeat does, and
**unresolved** when the repeats straddle it. [min, max] of n repeats covers the median of the
repeats' distribution with probability 1 - 2 / 2^n: 75% with 3 repeats, 94% with 5; a median
that happens to fall on the right side of the target while the repeats disagree is not quoted
as a result (a drifting machine gave ours/TRL 0.907 with repeats 0.815-1.435). Each ratio
also gets the median's distribution-free interval (`median_interval`: the k-th smallest to the
k-th largest repeat, at least 93.75% coverage; min-max up to 8 repeats, narrower with more) and
that interval's verdict (`median_verdict`), printed under it: with 9 repeats one repeat on each
side may fall outside it. What spreads a repeat's ratio is mostly how few steps its medians rest
on: single steps of the same code vary by 10-20% on this machine from one second to the next
(the same side, even within a turn), so `--steps` narrows the repeats more than turns alone do.

Noise (`noise`): whether the machine was quiet, and how much one step varies.
- In turns, measured: the cores that processes other than the sides (and this one) kept busy
  during the sides' turns (`other_cores`, from /proc/stat less the running side's process tree;
  turns.py). `quiet` is at most QUIET_OTHER_CORES (0.1 of a core: a tenth of one of the two
  torch threads' cores, a few per cent of a step). An idle machine reads 0.00-0.02; one other
  CPU-bound process reads about 1.
- Per side and repeat, the spread of its steps' seconds, interquartile range over median
  (`step_noise`, the median over sides and repeats in the summary). With `--interleave
  processes` it is the only reading and `quiet` is at most NOISE_QUIET (10%). It is not a
  reading of the machine's load: idle 2-core VMs (load 0.0, no steal) have shown from 8% to
  15%, the same code's steps varying from 135 to 230 ms, and a drifting one over 17%.

Decisions:
- Fresh processes rather than resets: a process carries allocator and thread-pool state and
  imported modules, and our side's start-up is only measurable in a new process.
- Turns rather than one process after another: the sides' own clocks keep running while they
  are stopped, so each side stamps its steps and evaluations in epoch seconds (`step_ended_at`,
  `startup_at`, each evaluation's `ended_at`; ours: MLflow's timestamps of the round metrics,
  logged right after each round) and `apply_turns` drops or corrects what a pause touched. Turns
  of 2 s hold about a dozen default steps; about two steps a turn are dropped.
- The shared window: turns put the sides on the same minute only while all of them are taking
  steps. Ours starts its steps last (the longest start-up) and ends them last (its evaluations
  take longer), and after the others have ended it runs on alone, so over every step its first
  and last ones have no counterpart, and a 2-core VM's speed drifts within a minute (turns.py).
  In an ablation of three flows and three bare loops in the same turns, the bare loops differed
  from each other by up to 8% within a repeat over every step and by at most 2.5% over the
  window. The ratio over every step stays in the summary (`every_step` under each ratio) as
  the control.
- The order within a block stays ours, trl, bare (A B C A B C): with at least 3 repeats each
  side has neighbours on both sides in time; the per-repeat ratios show a drift if there is one.
- Accuracy is deterministic per side under the seed; `accuracy_repeatable` says whether every
  repeat gave the same accuracies (seconds are not).
- Measure on a quiet machine (see sides.py): interleaving spreads a slow spell over the sides
  of a block, but only a quiet machine gives figures to quote.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from replay_pipeline.benchmarks.sides import (EXPERIMENT, BenchmarkError, _prefect_home, _remove_if_empty,
                                              _version, check_inputs, ours_command, read_ours)
from replay_pipeline.benchmarks.turns import (CORES, Turned, in_window, kept_steps, overlap, shared_window,
                                              take_turns)

RESULT_JSON = "peers.json"
RESULT_PNG = "peers.png"
SIDES = ("ours", "trl", "bare")
LABELS = {"ours": "ours (no_buffer)", "trl": "TRL GRPOTrainer", "bare": "bare torch loop"}
#: Target ratios, ours over each peer, seconds per learner step (within each repeat; see `verdict`).
RATIO_TARGETS = {"trl": 1.0, "bare": 1.05}
STARTUP_TARGET_S = 10.0
#: The least coverage of the median's interval (`median_interval`): min-max of 5 repeats (15/16).
MEDIAN_COVERAGE = 0.9375
#: The largest step-time spread within a repeat (interquartile range / median, the median over
#: sides and repeats) at which the machine counts as quiet enough to quote the figures, where
#: the load beside the sides was not measured (--interleave processes).
NOISE_QUIET = 0.10
#: In turns: the most cores other processes may keep busy beside the sides for a quiet run.
QUIET_OTHER_CORES = 0.1
#: The per-repeat figures summarised for every side.
FIGURES = ("step_s", "gen_s", "train_s", "other_s", "step_mean_s", "steps_total_s", "startup_s",
           "eval_ms_per_token", "gen_ms_per_token", "process_s", "outside_s", "step_noise", "steps_kept")
#: How the sides alternate: in turns of SLICE_SECONDS within each repeat (the default), or one
#: whole process after another.
INTERLEAVE = ("turns", "processes")
SLICE_SECONDS = 2.0
#: In turns, the fewest steps (no pause in them) every side of every repeat must have in the
#: repeat's shared window (`apply_window`) for the figures to be taken over it; with fewer,
#: they are taken over every step no pause touched, and the summary says so.
MIN_WINDOW_STEPS = 10


# ------------------------------------------------------------------ one side, one repeat
def repeat_figures(record: Mapping[str, Any], window: bool = False) -> dict[str, float | None]:
    """One side's figures for one repeat: medians per learner step of the step and of its
    parts (other = step - generation - training: the pipeline's own cost, 0 for TRL whose
    step is generation + training by construction), the mean and total, start-up, evaluation
    and generation cost per token, the process's wall seconds and the steps' spread
    (interquartile range over median, 0 for fewer than two steps). In turns (`apply_turns`),
    the medians, mean and spread are over the steps no pause touched (`step_kept`), and with
    `window` only those in the repeat's shared window (`step_in_window`, `apply_window`); the
    total and the process's seconds are without the pauses."""
    steps, gen, train = record["step_seconds"], record["gen_seconds"], record["train_seconds"]
    if not steps or not (len(steps) == len(gen) == len(train)):
        raise ValueError(f"{record.get('name')}: {len(steps)} step, {len(gen)} generation and {len(train)} "
                         "training times: they must be as many, and at least one")
    kept = record.get("step_kept") or [True] * len(steps)
    if not any(kept):
        raise ValueError(f"{record.get('name')}: every one of its {len(steps)} steps was cut by a pause: "
                         "use longer --slice-seconds or more --steps")
    if window:
        kept = [k and w for k, w in zip(kept, record["step_in_window"])]
        if not any(kept):
            raise ValueError(f"{record.get('name')}: none of its steps lies in the repeat's shared window: "
                             "use more --steps")
    total = sum(record.get("step_unpaused_seconds") or steps)
    steps, gen, train = ([x for x, k in zip(xs, kept) if k] for xs in (steps, gen, train))
    other = [max(s - g - t, 0.0) for s, g, t in zip(steps, gen, train)]
    tokens = float(record["gen_tokens"]) * len(steps) / len(kept)  # the kept steps' share
    evals = [p for p in record["evals"] if p.get("clean", True)] if "step_kept" in record else []
    eval_s, eval_tokens = ((sum(p["eval_seconds"] for p in evals), sum(p["eval_tokens"] for p in evals)) if evals
                           else (record["eval_seconds"], float(record.get("eval_tokens") or 0.0)))
    return {
        "step_s": statistics.median(steps), "gen_s": statistics.median(gen), "train_s": statistics.median(train),
        "other_s": statistics.median(other), "step_mean_s": statistics.fmean(steps), "steps_total_s": total,
        "startup_s": record.get("startup_seconds"),
        "eval_ms_per_token": 1000 * eval_s / eval_tokens if eval_tokens else None,
        "gen_ms_per_token": 1000 * sum(gen) / tokens if tokens else None,
        "process_s": record.get("process_seconds"),
        # what the process spent outside its learner steps and greedy evaluations: start-up, our
        # side's sampled evaluations (pass@1, pass@k: at the start and the end), shutting down
        "outside_s": (record["process_seconds"] - total - record["eval_seconds"]
                      if record.get("process_seconds") is not None else None),
        "step_noise": _relative_iqr(steps),
        "steps_kept": float(len(steps)),
    }


def apply_turns(record: dict[str, Any], turned: Turned) -> None:
    """What a side's pauses (replay_pipeline/benchmarks/turns.py) did to its record, in place:
    `step_kept` (no pause touched the step or the one before it), `step_unpaused_seconds`
    (each step without the pauses inside it), start-up and evaluation seconds and the process's
    wall without the pauses in their windows, and `clean` on each evaluation no pause touched
    (with the time since the previous step: the flow's start and end evaluations log their
    greedy seconds after the sampled ones). Needs the sides' epoch stamps (`step_ended_at`,
    `startup_at`, `startup_eval_seconds`, each evaluation's `ended_at`)."""
    pauses, ends, seconds = turned.pauses, record["step_ended_at"], record["step_seconds"]
    if len(ends) != len(seconds):
        raise ValueError(f"{record.get('name')}: {len(ends)} step end stamps for {len(seconds)} steps")
    record["pauses"], record["turns"] = [list(p) for p in pauses], turned.turns
    record["machine_cpu"], record["other_cpu"] = turned.machine_cpu, turned.other_cpu
    record["step_kept"] = kept_steps(ends, seconds, pauses)
    record["step_unpaused_seconds"] = [s - overlap(e - s, e, pauses) for e, s in zip(ends, seconds)]
    at, eval0 = record["startup_at"], record.get("startup_eval_seconds") or 0.0
    created = at - record["startup_seconds"] - eval0
    # the pauses of the step-0 evaluation are in its seconds, which start-up already leaves out
    record["startup_seconds_measured"] = record["startup_seconds"]  # as the side measured it
    record["startup_seconds"] -= overlap(created, at, pauses) - overlap(at - eval0, at, pauses)
    record["process_seconds"] = turned.seconds - turned.paused_seconds
    for p in record["evals"]:
        since = created if p["step"] == 0 else ends[p["step"] - 1]
        p["clean"] = p.get("ended_at") is not None and overlap(since, p["ended_at"], pauses) == 0.0
        p["seconds"] = sum(record["step_unpaused_seconds"][:p["step"]])
        if p.get("ended_at") is not None and p.get("eval_seconds") is not None:
            p["eval_seconds"] -= overlap(p["ended_at"] - p["eval_seconds"], p["ended_at"], pauses)
    record["eval_seconds"] = sum(p["eval_seconds"] for p in record["evals"] if p.get("eval_seconds") is not None)


def apply_window(records: Sequence[dict[str, Any]]) -> None:
    """The sides of one repeat in turns, in place: `window` (epoch seconds, or None), the
    stretch in which every side was taking steps (turns.shared_window), and `step_in_window`
    (each step inside it) and `window_steps` (the steps no pause touched inside it) on each."""
    window = shared_window([(r["step_ended_at"], r["step_seconds"]) for r in records])
    for r in records:
        r["window"] = None if window is None else list(window)
        r["step_in_window"] = in_window(r["step_ended_at"], r["step_seconds"], window)
        r["window_steps"] = sum(k and w for k, w in zip(r["step_kept"], r["step_in_window"]))


def window_estimator(records: Mapping[str, Sequence[Mapping[str, Any]]]) -> tuple[bool, str]:
    """Whether the figures are taken over the shared windows (every side of every repeat has at
    least MIN_WINDOW_STEPS steps no pause touched in its repeat's window), and why (or why not)."""
    if not all("step_in_window" in r for recs in records.values() for r in recs):
        return False, "the sides ran one after another (--interleave processes): there is no shared window"
    short = [(side, r.get("repeat", i + 1), r["window_steps"]) for side, recs in records.items()
             for i, r in enumerate(recs) if r["window_steps"] < MIN_WINDOW_STEPS]
    if short:
        side, repeat, n = min(short, key=lambda x: x[2])
        return False, (f"{side} had {n} measured steps in repeat {repeat}'s shared window (fewer than "
                       f"{MIN_WINDOW_STEPS}): over every step no pause touched instead; more --steps widen the window")
    fewest = min(r["window_steps"] for recs in records.values() for r in recs)
    return True, (f"over the stretch of each repeat in which every side was taking steps (at least {fewest} "
                  "steps a side and repeat)")


def _relative_iqr(values: Sequence[float]) -> float:
    """Interquartile range over median (0 for fewer than two values)."""
    if len(values) < 2:
        return 0.0
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (q3 - q1) / median if median else 0.0


def verdict(low: float, high: float, target: float, strict: bool = False) -> str:
    """'met' when the whole range [low, high] is within the target (<=, or < when `strict`),
    'missed' when none of it is, else 'unresolved' (the repeats straddle the target)."""
    within = (lambda x: x < target) if strict else (lambda x: x <= target)
    return "met" if within(high) else "missed" if not within(low) else "unresolved"


def median_interval(values: Sequence[float], coverage: float = MEDIAN_COVERAGE) -> dict[str, float]:
    """The distribution-free interval for the median of what the values were drawn from: the
    k-th smallest and k-th largest value, k the largest that still covers the median with
    probability >= `coverage` (1 - 2 P(Binomial(n, 1/2) < k)); k = 1 (min and max) when no k
    does. With the default, min-max up to 8 values (93.75% for 5), the 2nd smallest to the 2nd
    largest (96.1%) for 9."""
    ordered, n = sorted(values), len(values)
    if not n:
        raise ValueError("an interval of no values")

    def covers(k: int) -> float:
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2 ** n

    k = 1
    while 2 * (k + 1) <= n and covers(k + 1) >= coverage:
        k += 1
    return {"low": ordered[k - 1], "high": ordered[n - k], "coverage": covers(k)}


def spread(values: Sequence[float | None]) -> dict[str, float] | None:
    """median, min and max of the values that are there (None when none is)."""
    present = [float(v) for v in values if v is not None]
    if not present:
        return None
    return {"median": statistics.median(present), "min": min(present), "max": max(present), "n": len(present)}


def summarise(records: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    """Per side: each figure's median, min and max over the repeats, the final and best
    accuracy and whether the accuracies repeat. Ratios ours/peer within each repeat (a
    repeat's median seconds per step), with their median, min and max, against the targets
    (`verdict`: met by every repeat, missed by every repeat, or unresolved); the machine's
    noise over the run."""
    repeats = {len(v) for v in records.values()}
    if len(repeats) != 1 or not repeats.pop():
        raise ValueError(f"every side needs the same number (>= 1) of repeats: {({k: len(v) for k, v in records.items()})}")
    out: dict[str, Any] = {"sides": {}, "ratios": {}}
    windowed, why = window_estimator(records)
    out["steps_compared"] = {"shared_window": windowed, "why": why, "min_window_steps": MIN_WINDOW_STEPS}
    per_repeat = {side: [repeat_figures(r, windowed) for r in recs] for side, recs in records.items()}
    for side, figures in per_repeat.items():
        accuracies = [[p["accuracy"] for p in r["evals"]] for r in records[side]]
        out["sides"][side] = {
            **{name: spread([f[name] for f in figures]) for name in FIGURES},
            "per_repeat": figures,
            "gen_tokens": spread([r["gen_tokens"] for r in records[side]]),
            "accuracy_start": accuracies[0][0], "accuracy_final": accuracies[0][-1],
            "accuracy_best": max(accuracies[0]),
            "accuracy_repeatable": all(a == accuracies[0] for a in accuracies),
        }
    if "ours" in per_repeat:
        ours = [f["step_s"] for f in per_repeat["ours"]]
        # the control with the window: each side's step medians over every step no pause touched
        every_step = ({side: [repeat_figures(r)["step_s"] for r in recs] for side, recs in records.items()}
                      if windowed else {})
        for peer, target in RATIO_TARGETS.items():
            if peer in per_repeat:
                ratios = [a / f["step_s"] for a, f in zip(ours, per_repeat[peer])]
                of_ratios = spread(ratios)
                judged = verdict(of_ratios["min"], of_ratios["max"], target)
                interval = median_interval(ratios)
                out["ratios"][peer] = {**of_ratios, "per_repeat": ratios, "target": target, "verdict": judged,
                                       "met": judged == "met", "median_interval": interval,
                                       "median_verdict": verdict(interval["low"], interval["high"], target)}
                if windowed:
                    every = [a / b for a, b in zip(every_step["ours"], every_step[peer])]
                    out["ratios"][peer]["every_step"] = {**spread(every), "per_repeat": every}
        startup = out["sides"]["ours"]["startup_s"]
        judged = verdict(startup["min"], startup["max"], STARTUP_TARGET_S, strict=True) if startup else "missed"
        out["startup"] = {"target_s": STARTUP_TARGET_S, "median_s": startup and startup["median"],
                          "verdict": judged, "met": judged == "met"}
    noise = statistics.median(f["step_noise"] for figures in per_repeat.values() for f in figures)
    machine = sum(r.get("machine_cpu") or 0.0 for recs in records.values() for r in recs)
    if machine:
        other = sum(r.get("other_cpu") or 0.0 for recs in records.values() for r in recs) / machine * CORES
        out["noise"] = {"step_noise_median": noise, "other_cores": other, "quiet_at_most": QUIET_OTHER_CORES,
                        "quiet": other <= QUIET_OTHER_CORES, "measured": "other_cores"}
    else:
        out["noise"] = {"step_noise_median": noise, "quiet_at_most": NOISE_QUIET, "quiet": noise <= NOISE_QUIET,
                        "measured": "step_noise"}
    out["evaluation"] = {side: {"eval_ms_per_token": s["eval_ms_per_token"] and s["eval_ms_per_token"]["median"],
                                "gen_ms_per_token": s["gen_ms_per_token"] and s["gen_ms_per_token"]["median"]}
                         for side, s in out["sides"].items()}
    for side, e in out["evaluation"].items():
        e["met"] = None if None in e.values() else e["eval_ms_per_token"] <= e["gen_ms_per_token"]
    return out


# ------------------------------------------------------------------ processes
def worker_command(side: str, root: str | Path, steps: int, eval_every: int, overrides: Sequence[str],
                   out: Path) -> list[str]:
    """A side other than ours (or the untimed preparation) in a process of its own."""
    return [sys.executable, "-m", "replay_pipeline.benchmarks.peers", "--side", side, "--out", str(out),
            "--root", str(root), "--steps", str(steps), "--eval-every", str(eval_every), *overrides]


def run_process(command: list[str], log_path: Path, timeout: float) -> float:
    """Run `command` to its end with its output in `log_path`; its wall seconds. A failure
    raises with the log's last lines (`take_turns` with this one command: nobody to take turns
    with, the same failure report, and its process tree killed on a timeout or SIGTERM)."""
    name = f"{' '.join(command[:4])} ..."
    return take_turns([(name, command, log_path)], SLICE_SECONDS, timeout)[name].seconds


def run_worker(side: str, steps: int, root: str, eval_every: int, overrides: Sequence[str], out: Path) -> None:
    """`--side`: one side (trl, bare) or the preparation (prepare: the warm start only) in this
    process; its record goes to `out` as JSON."""
    cfg, eval_every = check_inputs(steps, root, eval_every, overrides, need_trl=side == "trl")
    if side == "prepare":
        # start-up cost: the library (torch, lancedb, mlflow) loads after the command has parsed its arguments
        from replay_pipeline.benchmarks.sides import load_side_policy

        load_side_policy(cfg)
        record: dict[str, Any] = {"prepared": True}
    elif side == "trl":
        # start-up cost: the library (torch, lancedb, mlflow) loads after the command has parsed its arguments
        from replay_pipeline.benchmarks.sides import run_trl

        record = run_trl(cfg, steps, eval_every, out.parent / f"{out.stem}-trl-output")
        _remove_if_empty(out.parent / f"{out.stem}-trl-output")
    elif side == "bare":
        # start-up cost: the library (torch, lancedb, mlflow) loads after the command has parsed its arguments
        from replay_pipeline.benchmarks.bare import run_bare

        record = run_bare(cfg, steps, eval_every)
    else:
        raise BenchmarkError(f"--side {side!r}: one of trl, bare, prepare (ours runs as python -m flows.train)")
    out.write_text(json.dumps(record, default=str))


# ------------------------------------------------------------------ report
def _fmt(spread: Mapping[str, float] | None, scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    if not spread:
        return "-"
    mid, lo, hi = (fmt.format(spread[k] * scale) for k in ("median", "min", "max"))
    return f"{mid} [{lo}-{hi}]"


def _said(judged: str) -> str:
    return {"met": "met (every repeat)", "missed": "MISSED (every repeat)",
            "unresolved": "UNRESOLVED (the repeats straddle the target: more --repeats on a quiet machine)"}[judged]


def _median_said(judged: str, median: float, target: float) -> str:
    where = "meets" if median <= target else "misses"
    return {"met": "within the target", "missed": "over the target",
            "unresolved": f"straddles the target (the median {where} it)"}[judged]


def report(result: Mapping[str, Any]) -> str:
    s, summary = result["settings"], result["summary"]
    sides = [side for side in SIDES if side in summary["sides"]]
    lines = [
        f"Peer benchmark, interleaved: {s['repeats']} repeats of {' '.join(sides)} (a fresh process each; "
        f"{s.get('order', 'blocks')}), "
        f"{s['steps']} learner steps a side, {s['prompts_per_step']} prompts x {s['group_size']} completions a "
        f"step, T={s['temperature']}, max_new_tokens={s['max_new_tokens']}, lr={s['lr']}, "
        f"{s['torch_threads']} torch threads, seed {s['seed']}",
        "  medians over the repeats [min-max]; per step, the median of its steps",
        "",
        f"  {'':36}" + "".join(f"{LABELS[side]:>26}" for side in sides),
    ]

    def row(label: str, key: str, scale: float = 1000.0, fmt: str = "{:.1f}") -> None:
        lines.append(f"  {label:36}" + "".join(f"{_fmt(summary['sides'][side][key], scale, fmt):>26}"
                                               for side in sides))

    row("ms / learner step", "step_s")
    row("  generation (+ reward)", "gen_s")
    row("  training", "train_s")
    row("  pipeline (the rest)", "other_s")
    row("ms / learner step, mean", "step_mean_s")
    row("steps measured", "steps_kept", 1.0, "{:.0f}")
    row("start-up to the first step, s", "startup_s", 1.0)
    row("process wall seconds", "process_s", 1.0, "{:.0f}")
    row("  outside steps and greedy evals, s", "outside_s", 1.0, "{:.0f}")
    row("evaluation, ms / greedy token", "eval_ms_per_token", 1.0, "{:.3f}")
    row("generation in steps, ms / token", "gen_ms_per_token", 1.0, "{:.3f}")
    row("generated tokens", "gen_tokens", 1.0, "{:,.0f}")
    for key in ("accuracy_start", "accuracy_final", "accuracy_best"):
        lines.append(f"  {'held-out accuracy, ' + key.split('_')[1]:36}"
                     + "".join(f"{summary['sides'][side][key]:>26.3f}" for side in sides))
    lines.append(f"  {'accuracy the same in every repeat':36}"
                 + "".join(f"{str(summary['sides'][side]['accuracy_repeatable']).lower():>26}" for side in sides))
    if "ours" in sides:
        lines.append("  (ours also runs its sampled evaluations, pass@1 and pass@k, at the start and the end: in its "
                     "process seconds, not in its steps)")
    lines.append("")
    noise = summary["noise"]
    if noise.get("measured") == "other_cores":
        lines.append(f"  machine: other processes kept {noise['other_cores']:.2f} of {CORES} cores busy during the "
                     "turns: " + (f"quiet (at most {noise['quiet_at_most']:.2f})" if noise["quiet"] else
                                  f"NOT QUIET (over {noise['quiet_at_most']:.2f}): these figures are not for "
                                  "quoting"))
        lines.append(f"  steps within a repeat spread {100 * noise['step_noise_median']:.1f}% (interquartile range "
                     "/ median, median over sides and repeats)")
    else:
        lines.append(f"  machine noise: steps within a repeat spread {100 * noise['step_noise_median']:.1f}% "
                     f"(interquartile range / median, median over sides and repeats): "
                     + ("quiet" if noise["quiet"] else
                        f"NOT QUIET (over {100 * noise['quiet_at_most']:.0f}%): these figures are not for quoting"))
    compared = summary.get("steps_compared")
    if compared:
        lines.append(f"  steps compared: {compared['why']}")
    for peer, r in summary["ratios"].items():
        each = ", ".join(f"{x:.3f}" for x in r["per_repeat"])
        lines.append(f"  ours / {peer}, seconds per step: {r['median']:.3f} [{r['min']:.3f}-{r['max']:.3f}] "
                     f"(repeats: {each}); target <= {r['target']:.2f}: {_said(r['verdict'])}")
        if "median_interval" in r:
            iv = r["median_interval"]
            lines.append(f"    the median's {100 * iv['coverage']:.0f}% interval [{iv['low']:.3f}-{iv['high']:.3f}]: "
                         f"{_median_said(r['median_verdict'], r['median'], r['target'])}")
        if "every_step" in r:
            e = r["every_step"]
            lines.append(f"    over every step no pause touched (the same repeats, outside the shared window too): "
                         f"{e['median']:.3f} [{e['min']:.3f}-{e['max']:.3f}]")
    if "startup" in summary:
        st = summary["startup"]
        shown = "-" if st["median_s"] is None else f"{st['median_s']:.1f} s"
        lines.append(f"  ours, start-up to the first round: {shown}; target < {st['target_s']:.0f} s: "
                     f"{_said(st['verdict'])}")
    for side, e in summary["evaluation"].items():
        if e["met"] is not None:
            lines.append(f"  {side}: evaluation {e['eval_ms_per_token']:.3f} ms per greedy token against "
                         f"{e['gen_ms_per_token']:.3f} ms per sampled token in its steps: "
                         f"{'no slower' if e['met'] else 'SLOWER'}")
    lines += ["", f"  {result['json_path']}", f"  {result['png_path']}",
              f"  MLflow: experiment {EXPERIMENT!r}, run {result['mlflow_run_id']} ({result['mlflow_uri']})"]
    return "\n".join(lines)


def plot(result: Mapping[str, Any], path: Path) -> None:
    # start-up cost: matplotlib, only when a plot is drawn
    import matplotlib

    matplotlib.use("Agg")
    # start-up cost: matplotlib, only when a plot is drawn
    import matplotlib.pyplot as plt

    summary, records = result["summary"], result["records"]
    sides = [side for side in SIDES if side in records]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    styles = {"ours": ("o", "-", 7), "trl": ("s", "--", 5), "bare": ("^", ":", 4)}  # coinciding lines stay visible
    for i, side in enumerate(sides):
        color, (marker, line, size) = f"C{i}", styles[side]
        for r, record in enumerate(records[side]):
            evals = record["evals"]
            acc = [p["accuracy"] for p in evals]
            label = LABELS[side] if r == 0 else None
            axes[0].plot([p["gen_tokens"] for p in evals], acc, marker=marker, linestyle=line, markersize=size,
                         color=color, alpha=0.8, label=label)
            axes[1].plot([p["seconds"] for p in evals], acc, marker=marker, linestyle=line, markersize=size,
                         color=color, alpha=0.5, label=label)
    axes[0].set_xlabel("cumulative generated tokens")
    axes[1].set_xlabel("cumulative seconds in learner steps (each repeat)")
    for ax in axes[:2]:
        ax.set_ylabel("held-out greedy accuracy")
        ax.grid(alpha=0.3)
        ax.legend()
    bottom = [0.0] * len(sides)
    for part, label in (("gen_s", "generation"), ("train_s", "training"), ("other_s", "pipeline")):
        heights = [1000 * summary["sides"][side][part]["median"] for side in sides]
        axes[2].bar([LABELS[side] for side in sides], heights, bottom=bottom, label=label)
        bottom = [b + h for b, h in zip(bottom, heights)]
    step = [summary["sides"][side]["step_s"] for side in sides]
    axes[2].errorbar([LABELS[side] for side in sides], [1000 * s["median"] for s in step],
                     yerr=[[1000 * (s["median"] - s["min"]) for s in step], [1000 * (s["max"] - s["median"]) for s in step]],
                     fmt="k.", capsize=4, label="step (min-max over repeats)")
    axes[2].set_ylabel("ms per learner step (medians)")
    axes[2].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    s = result["settings"]
    turns = f" (sides in turns of {s['slice_seconds']:g} s)" if s.get("interleave") == "turns" else ""
    fig.suptitle(f"{s['repeats']} interleaved repeats{turns}, {s['steps']} steps, {s['prompts_per_step']}x"
                 f"{s['group_size']} rollouts/step, {s['torch_threads']} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ the benchmark
def check_interleave(interleave: str, slice_seconds: float) -> None:
    """BenchmarkError unless `interleave` is one of INTERLEAVE and a turn is longer than 0 s."""
    if interleave not in INTERLEAVE:
        raise BenchmarkError(f"--interleave {interleave!r}: one of {', '.join(INTERLEAVE)}")
    if slice_seconds <= 0:
        raise BenchmarkError(f"--slice-seconds {slice_seconds} must be > 0 (2 is the default)")


def run_benchmark(steps: int, repeats: int, root: str | Path, eval_every: int | None = None,
                  overrides: Sequence[str] = (), sides: Sequence[str] = SIDES, timeout: float = 3600.0,
                  log: Callable[[str], Any] = print, interleave: str = "turns",
                  slice_seconds: float = SLICE_SECONDS) -> dict[str, Any]:
    """Check, prepare, run the blocks and write the outputs; returns the result (also the JSON)."""
    check_interleave(interleave, slice_seconds)
    overrides = list(overrides)
    _prefect_home(root)
    cfg, eval_every = check_inputs(steps, root, eval_every, overrides, need_trl="trl" in sides)
    # start-up cost: the library (torch, lancedb, mlflow) loads after the command has parsed its arguments
    from replay_pipeline.models.device import auto_threads
    from replay_pipeline.system.runs import RunPaths, artifact_location, new_run_id
    from replay_pipeline.tracking.tracker import MlflowTracker

    if not cfg.model.torch_threads:  # one count for every side, chosen once
        threads, why = auto_threads()
        overrides.append(f"model.torch_threads={threads}")
        log(f"[peers] torch threads: {threads} (model.torch_threads=0: {why})")
        cfg, eval_every = check_inputs(steps, root, eval_every, overrides, need_trl="trl" in sides)
    stamp = new_run_id()
    paths = RunPaths.make(root, f"peers-{stamp}")
    out_dir = paths.root / "benchmarks" / f"peers-{stamp}"
    out_dir.mkdir(parents=True, exist_ok=True)
    mlflow_uri = cfg.tracking.mlflow_uri or paths.mlflow_uri
    tracker = MlflowTracker(uri=mlflow_uri, experiment=EXPERIMENT,
                            artifact_location=artifact_location(cfg, paths, mlflow_uri),
                            run_name=f"peers-{stamp}", tags={"replay_pipeline.benchmark": "peers"})
    status = "FAILED"
    try:
        settings = {
            "steps": steps, "repeats": repeats, "sides": list(sides), "eval_every": eval_every, "seed": int(cfg.seed),
            "prompts_per_step": cfg.loop.prompts_per_step, "group_size": cfg.loop.group_size,
            "temperature": cfg.generator.temperature, "top_p": cfg.generator.top_p,
            "max_new_tokens": cfg.generator.max_new_tokens, "lr": cfg.algo.lr, "eps_low": cfg.algo.eps_low,
            "eps_high": cfg.algo.eps_high, "max_grad_norm": cfg.algo.max_grad_norm, "loss_agg": cfg.algo.loss_agg,
            "torch_threads": cfg.model.torch_threads, "heldout_prompts": cfg.task.heldout_size,
            "overrides": overrides, "interleave": interleave,
            "slice_seconds": slice_seconds if interleave == "turns" else None,
            "order": (f"each repeat: {' '.join(sides)} in turns of {slice_seconds:g} s" if interleave == "turns"
                      else "blocks: " + " ".join(sides) + " per repeat, one whole process after another"),
            "versions": {p: _version(p) for p in ("trl", "transformers", "torch", "accelerate", "prefect", "mlflow",
                                                  "lancedb")},
        }
        tracker.log_params({f"settings.{k}": v for k, v in settings.items() if k != "versions"}
                           | {f"versions.{k}": v for k, v in settings["versions"].items()})
        log("[peers] preparing the warm start (not timed)")
        run_process(worker_command("prepare", root, steps, eval_every, overrides, out_dir / "prepare.json"),
                    out_dir / "logs" / "prepare.log", timeout)
        records: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
        for r in range(repeats):
            jobs, outs, run_ids = [], {}, {}
            for side in sides:
                name = f"repeat{r + 1}-{side}"
                outs[side] = out_dir / f"{name}.json"
                if side == "ours":
                    run_ids[side] = f"peers-{stamp}-r{r + 1}"
                    command = ours_command(root, steps, eval_every, overrides, run_ids[side], tracker.run_id)
                else:
                    command = worker_command(side, root, steps, eval_every, overrides, outs[side])
                jobs.append((side, command, out_dir / "logs" / f"{name}.log"))
            if interleave == "turns":
                log(f"[peers] repeat {r + 1}/{repeats}: {' '.join(sides)} in turns of {slice_seconds:g} s")
                turned = take_turns(jobs, slice_seconds, timeout)
            else:
                turned = {}
                for side, command, log_path in jobs:
                    log(f"[peers] repeat {r + 1}/{repeats}: {side}")
                    turned[side] = Turned(seconds=run_process(command, log_path, timeout), turns=1)
            for side in sides:
                record = (read_ours(mlflow_uri, run_ids[side], steps) if side == "ours"
                          else json.loads(outs[side].read_text()))
                record["repeat"] = r + 1
                apply_turns(record, turned[side])
                records[side].append(record)
            if interleave == "turns":
                apply_window([records[side][-1] for side in sides])
            windowed = window_estimator({side: records[side][-1:] for side in sides})[0]
            for side in sides:  # this repeat's figures, as the summary will take them if every repeat agrees
                figures = repeat_figures(records[side][-1], windowed)
                tracker.log_metrics({f"{side}/{k}": v for k, v in figures.items() if v is not None}, step=r + 1)
        summary = summarise(records)
        result = {"settings": settings, "summary": summary, "records": records, "out_dir": str(out_dir),
                  "json_path": str(out_dir / RESULT_JSON), "png_path": str(out_dir / RESULT_PNG),
                  "mlflow_run_id": tracker.run_id, "mlflow_uri": mlflow_uri, "experiment": EXPERIMENT}
        (out_dir / RESULT_JSON).write_text(json.dumps(result, indent=2, default=str))
        plot(result, out_dir / RESULT_PNG)
        for side in sides:
            for p in records[side][0]["evals"]:
                tracker.log_metrics({f"{side}/accuracy": p["accuracy"], f"{side}/gen_tokens": p["gen_tokens"]},
                                    step=p["step"])
            tracker.log_metrics({f"{side}/{k}_median": v["median"] for k, v in summary["sides"][side].items()
                                 if isinstance(v, dict) and "median" in v}, step=steps)
        tracker.log_metrics({f"ratio/ours_over_{peer}": r["median"] for peer, r in summary["ratios"].items()}
                            | {f"ratio_every_step/ours_over_{peer}": r["every_step"]["median"]
                               for peer, r in summary["ratios"].items() if "every_step" in r}
                            | {"noise/step_noise_median": summary["noise"]["step_noise_median"]}
                            | ({"noise/other_cores": summary["noise"]["other_cores"]}
                               if "other_cores" in summary["noise"] else {}), step=steps)
        tracker.log_artifacts(out_dir)
        status = "FINISHED"
        return result
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        tracker.finish(status)


def _sides_arg(text: str) -> list[str]:
    sides = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in sides if s not in SIDES]
    if bad or not sides or len(set(sides)) != len(sides):
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of distinct sides among {', '.join(SIDES)}")
    return sides


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m replay_pipeline.benchmarks.peers",
        description="Our no-buffer loop, TRL's GRPOTrainer and a bare torch loop, interleaved: seconds per "
                    "learner step with their split, start-up, and held-out accuracy against compute.")
    parser.add_argument("--steps", type=int, default=120,
                        help="learner steps a side and repeat (default 120: about 60 a side in the shared window)")
    parser.add_argument("--repeats", type=int, default=3, help="blocks of every side (default 3)")
    parser.add_argument("--sides", type=_sides_arg, default=list(SIDES), help="comma-separated, in block order "
                        "(default ours,trl,bare)")
    parser.add_argument("--root", default=os.environ.get("REPLAY_PIPELINE_ROOT", "runs"),
                        help="run root (tracking.root_dir); outputs under <root>/benchmarks/")
    parser.add_argument("--eval-every", type=int, default=None,
                        help="held-out evaluation every E steps, plus start and end (default steps // 10; "
                             "0: start and end only)")
    parser.add_argument("--interleave", choices=INTERLEAVE, default="turns",
                        help="turns (default): within each repeat the sides' processes take turns of "
                             "--slice-seconds, the others stopped meanwhile; processes: one whole process after "
                             "another")
    parser.add_argument("--slice-seconds", type=float, default=SLICE_SECONDS,
                        help=f"a turn's length with --interleave turns (default {SLICE_SECONDS:g})")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds a side's process may take")
    parser.add_argument("--side", default=None, help=argparse.SUPPRESS)  # a worker process (run_worker)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every side, e.g. algo.lr=6e-5")
    args = parser.parse_args(argv)
    _prefect_home(args.root)
    # start-up cost: the library (torch, lancedb, mlflow) loads after the command has parsed its arguments
    from replay_pipeline.config import ConfigError

    if args.side is not None:
        run_worker(args.side, args.steps, args.root, args.eval_every, args.overrides, args.out)
        return 0
    try:
        if args.repeats < 1:
            raise BenchmarkError(f"--repeats {args.repeats} must be >= 1 (3 or more to read a spread)")
        check_interleave(args.interleave, args.slice_seconds)
        check_inputs(args.steps, args.root, args.eval_every, args.overrides, need_trl="trl" in args.sides)
    except (BenchmarkError, ConfigError, PermissionError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = run_benchmark(args.steps, args.repeats, args.root, args.eval_every, args.overrides, args.sides,
                           args.timeout, interleave=args.interleave, slice_seconds=args.slice_seconds)
    print()
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
