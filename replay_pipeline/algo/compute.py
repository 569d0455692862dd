"""Compute ledger: tokens, estimated FLOPs and measured wall seconds per phase.

FLOPs follow the usual dense-transformer estimate (Kaplan et al.): 2 x parameters per
generated token (forward only) and 6 x parameters per trained token (forward + backward).
mu, the paper's generation/training cost ratio, is measured as the seconds spent
generating a batch over the seconds one learner pass over that many rollouts takes
(`compute/mu`; `compute/mu_flops` is the same ratio from the FLOPs estimate). gamma, the
paper's compute ratio against an on-policy run, is (1 + W/T) / (1 + mu) where W/T is the
measured ratio of generation to training seconds (`compute/gen_train_ratio`): below 1 the
run spent less compute per learner update than the on-policy loop would have.

Generated rollouts (`compute/gen_rollouts`) and tokens count every rollout the run generated,
whichever process did: a resumed sync run reads back the steps its stopped process had stored
beyond its last checkpoint instead of generating them again, and counts them as generated
(an unstopped run's totals, exactly). Their generation seconds ran in the stopped process and
are not known here: they are `compute/gen_untimed_rollouts`, left out of mu's per-rollout
seconds, and W/T scales the measured generation seconds up to every generated rollout at
the measured rate (the same as the measured W/T when nothing was replayed).

Phases: generate (tokens, FLOPs, seconds; in the async loop summed over the generator
workers), train (tokens, FLOPs, seconds), eval (tokens, FLOPs, seconds; not part of
`compute/total_flops`, which is the paper's trainer + inference compute) and other (seconds: storage,
tracking and orchestration, i.e. the pipeline's overhead). Every figure is cumulative and
logged under `compute/` at every step, so any metric can be plotted against compute.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ComputeLedger:
    parameters: int
    totals: dict[str, float] = field(default_factory=lambda: {
        "gen_tokens": 0.0, "gen_seconds": 0.0, "train_tokens": 0.0, "train_seconds": 0.0,
        "train_rollouts": 0.0, "gen_rollouts": 0.0, "gen_untimed_rollouts": 0.0, "eval_seconds": 0.0,
        "eval_tokens": 0.0, "other_seconds": 0.0,
    })

    def add(self, **amounts: float) -> None:
        for key, value in amounts.items():
            if key not in self.totals:
                raise KeyError(f"unknown ledger entry {key!r}; known: {sorted(self.totals)}")
            self.totals[key] += float(value)

    def gen_flops(self) -> float:
        return 2.0 * self.parameters * self.totals["gen_tokens"]

    def train_flops(self) -> float:
        return 6.0 * self.parameters * self.totals["train_tokens"]

    def _timed_rollouts(self) -> float:
        """Generated rollouts whose generation seconds this ledger holds."""
        return self.totals["gen_rollouts"] - self.totals["gen_untimed_rollouts"]

    def mu(self) -> float:
        """Seconds to generate one rollout / seconds to train on one rollout, run so far."""
        t, timed = self.totals, self._timed_rollouts()
        if timed <= 0 or t["train_rollouts"] == 0 or t["train_seconds"] == 0:
            return float("nan")
        return (t["gen_seconds"] / timed) / (t["train_seconds"] / t["train_rollouts"])

    def gen_train_ratio(self) -> float:
        """Generation seconds per training second so far (the effective W/T), the generation
        seconds scaled to every generated rollout when some were not timed (module docstring)."""
        t, timed = self.totals, self._timed_rollouts()
        if not t["train_seconds"] or (t["gen_untimed_rollouts"] and timed <= 0):
            return float("nan")
        scale = t["gen_rollouts"] / timed if t["gen_untimed_rollouts"] else 1.0
        return t["gen_seconds"] * scale / t["train_seconds"]

    def mu_flops(self) -> float:
        t = self.totals
        if not (t["gen_rollouts"] and t["train_rollouts"] and t["train_tokens"]):
            return float("nan")
        return (self.gen_flops() / t["gen_rollouts"]) / (self.train_flops() / t["train_rollouts"])

    def gamma(self) -> float:
        """(1 + W/T) / (1 + mu): compute per learner update relative to the on-policy loop."""
        return (1.0 + self.gen_train_ratio()) / (1.0 + self.mu())

    def metrics(self) -> dict[str, float]:
        """Cumulative figures, logged under compute/ so any metric can be read against them."""
        t = self.totals
        return {
            "compute/gen_tokens": t["gen_tokens"],
            "compute/train_tokens": t["train_tokens"],
            "compute/gen_flops": self.gen_flops(),
            "compute/train_flops": self.train_flops(),
            "compute/total_flops": self.gen_flops() + self.train_flops(),
            "compute/gen_seconds": t["gen_seconds"],
            "compute/train_seconds": t["train_seconds"],
            "compute/gen_train_seconds": t["gen_seconds"] + t["train_seconds"],
            "compute/eval_seconds": t["eval_seconds"],
            "compute/eval_tokens": t["eval_tokens"],
            "compute/eval_flops": 2.0 * self.parameters * t["eval_tokens"],
            "compute/other_seconds": t["other_seconds"],
            "compute/mu": self.mu(),
            "compute/mu_flops": self.mu_flops(),
            "compute/gen_train_ratio": self.gen_train_ratio(),
            "compute/gamma": self.gamma(),
            "compute/gen_rollouts": t["gen_rollouts"],
            "compute/gen_untimed_rollouts": t["gen_untimed_rollouts"],
            "compute/train_rollouts": t["train_rollouts"],
        }
