"""replay-pipeline: RL post-training for LLMs with experience replay.

The library, one folder a concern (docs/architecture.md draws the floors):
tasks/ (prompt sets and verifiers), models/, generation/ (backends), buffer/ (the rollout and
usage tables, sampling), algo/ (the paper's math, pure), training/ (learner, checkpoints,
published weights, evaluation), run/ (one training run: the loop, its phases, resume), config/,
tracking/ (MLflow), reports/ (reading runs back: analysis, reports, the viewer, exports),
system/ (process plumbing: run files, lease, signals) and benchmarks/.
`flows/` wires these into Prefect flows; everything here works without Prefect.
"""

__version__ = "0.1.0"
