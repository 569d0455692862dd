"""The configuration's schema: every field, its default, its bound and its meaning, in one
place.

The YAML files under ``conf/`` are presets that only state what differs from these
defaults; Hydra merges them onto these dataclasses (replay_pipeline/config/compose.py), so a
typo in a preset or an override (``buffer.capacitty=3``) fails at composition with the list of
valid keys. A field's bound is declared with the field: ``bounded(default, ge=1)`` (the rule
and its words, replay_pipeline/algo/bounds.py), or ``owned(default, "learner")`` for a value whose
bound a library component states itself (the learner's coefficients, the sampling rules).
Rules across fields are replay_pipeline/config/rules.py's. Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, Optional

from replay_pipeline.algo.bounds import Bound


def bounded(default: Any, **bound: Any) -> Any:
    """A dataclass field with `default` and its `Bound` (checked by `validate`)."""
    return field(default=default, metadata={"bound": Bound(**bound)})


def owned(default: Any, owner: str) -> Any:
    """A dataclass field whose bound the component `owner` states (`learner`: LEARNER_BOUNDS
    of replay_pipeline/training/learner.py; `sampling`: RULE_BOUNDS of replay_pipeline/buffer/sampling.py)."""
    return field(default=default, metadata={"owner": owner})


class ConfigError(ValueError):
    """Invalid configuration; the message says which override fixes it."""

    @classmethod
    def listing(cls, problems: list[str]) -> "ConfigError":
        """One error naming every problem, each on its own line."""
        return cls("Invalid configuration:\n  - " + "\n  - ".join(problems))


@dataclass
class WarmStartConfig:
    lr: float = 1e-3
    """AdamW learning rate of the supervised warm start (CPU-DEMO: 1e-3 held)."""
    warmup_steps: int = 100
    """Linear learning-rate warm-up steps of the warm start."""
    batch_size: int = 128
    """Supervised examples per warm-start step."""
    max_steps: int = 3000
    """Give up (with an error) if the target accuracy is not reached by then."""
    eval_every: int = 25
    """Validation accuracy is checked this often; accuracy jumps abruptly, so keep it small."""
    target_accuracy: float = bounded(0.25, ge=0, le=1)
    """Stop at the first validation greedy accuracy at or above this (aim: 10-40% held-out)."""
    seed: int = 0
    """Seed of the warm start; separate from the run's seed so that runs with different
    seeds start from the same cached checkpoint, as the paper's seeds do."""


@dataclass
class ModelConfig:
    name: str = "tiny"
    """`tiny` is the built-in model; any other name labels a checkpoint given by `path`."""
    path: Optional[str] = None
    """A Hugging Face checkpoint directory (config.json + weights + tokenizer). None builds the
    built-in tiny Llama-style model and warm-starts it on the task (cached on disk)."""
    hidden_size: int = 192
    """Built-in model only: width of the residual stream."""
    num_layers: int = 4
    """Built-in model only: decoder layers."""
    num_heads: int = 6
    """Built-in model only: attention heads (must divide hidden_size)."""
    intermediate_size: int = 512
    """Built-in model only: MLP width."""
    warmstart: WarmStartConfig = field(default_factory=WarmStartConfig)
    """Supervised warm start of the built-in model (ignored when `path` is set)."""
    torch_threads: int = bounded(0, ge=0, integer=True, hint="0 chooses from the machine's load")
    """CPU threads for torch. 0 (auto): chosen when the run is built, every core on an idle
    machine, one fewer per core other processes keep busy (replay_pipeline/models/device.py,
    auto_threads; on a 2-core machine: 2 alone, 1 beside another job, the faster count in
    each case, docs/performance.md "Threads"); the run's config.yaml records the count chosen.
    Runs are bit for bit repeatable at a fixed thread count; another count sums in another order
    and the rollouts drift apart."""
    device: str = "auto"
    """Where the learner's model and the transformers generator run: `auto` (`cuda` when torch
    sees a GPU, else `cpu`; each process decides for itself), `cpu`, `cuda` or `cuda:N`
    (replay_pipeline/models/device.py). A hardware setting: a resume may change it. The vLLM
    engine is always on the GPU."""


@dataclass
class TaskConfig:
    name: str = "addition"
    """Registered task name (replay_pipeline.tasks.TASKS), or `custom`: your own task from
    task.target (task=custom; replay_pipeline/tasks/custom.py)."""
    target: Optional[str] = None
    """Custom task, required: the factory, `package.module:factory` (on PYTHONPATH) or
    `/path/to/file.py:factory`; replay_pipeline/tasks/template.py is an example to copy."""
    args: Dict[str, Any] = field(default_factory=dict)
    """Custom task: keyword arguments of the factory (+task.args.NAME=VALUE)."""
    digits: int = 3
    """Addition task: digits per operand (prompt "007+110=")."""
    heldout_size: int = bounded(512, ge=1, integer=True)
    """Prompts held out of warm start and RL, used for eval/ accuracy (CPU-DEMO: 256 is
    noisy by +/- 3 points, so 512 by default)."""
    validation_size: int = bounded(256, ge=0, integer=True)
    """Prompts used only to stop the warm start; disjoint from the held-out set."""
    split_seed: int = 1234
    """Seed of the train/validation/held-out split (keep fixed across runs to compare them)."""
    # Math task (task.name=math, presets task=gsm8k and task=math; replay_pipeline/tasks/math.py).
    # The addition task takes none of these; setting one with it is refused.
    path: Optional[str] = None
    """Math task, required: local training data, a .jsonl/.json/.parquet/.arrow file, a
    directory of them (e.g. a datasets cache directory) or a datasets save_to_disk directory.
    Nothing is downloaded."""
    format: str = "auto"
    """Math task: `gsm8k` (question + answer ending in "#### x"), `math` (problem + solution
    with \\boxed{x}, or an answer column) or `auto` (told from the columns)."""
    question_field: Optional[str] = None
    """Math task: column with the problem text (None: question / problem)."""
    answer_field: Optional[str] = None
    """Math task: column with the reference answer or solution (None: answer / solution)."""
    prompt_template: Optional[str] = None
    """Math task: prompt text with {question} where the problem goes (None: the format's
    default, asking for the answer after "####" or in \\boxed{})."""
    heldout_path: Optional[str] = None
    """Math task: separate held-out data (e.g. the test file), removed from training too;
    None: held out from task.path."""
    split: str = "train"
    """Math task: split read from a DatasetDict or a directory of per-split files."""
    heldout_split: str = "test"
    """Math task: the same for task.heldout_path."""
    max_prompts: Optional[int] = bounded(None, ge=1, integer=True, null="for all")
    """Math task: at most this many training problems (None: all left after held-out and
    validation)."""
    answer_fallback: Optional[str] = None
    """Math and reasoning_gym tasks: `last_number` scores the completion's last number when it gives no "####" or
    \\boxed{} answer (lenient); None: an explicit final answer is required."""
    # reasoning-gym datasets (task.name=reasoning_gym, preset task=reasoning_gym;
    # replay_pipeline/tasks/reasoning_gym.py).
    dataset: Any = None
    """reasoning_gym task, required: a reasoning-gym dataset name (`chain_sum`, `products`,
    `basic_arithmetic`, ...), or a list of them, mixed by its `composite` dataset
    ('task.dataset=[chain_sum,products]'; a quoted 'chain_sum,products' is the same)."""
    config: Dict[str, Any] = field(default_factory=dict)
    """reasoning_gym task: the dataset's settings, its config dataclass's fields
    (+task.config.max_digits=2); with several datasets one mapping each
    (+task.config.chain_sum.max_terms=2)."""
    weights: Dict[str, float] = field(default_factory=dict)
    """reasoning_gym task: a mixture's weight by dataset name (+task.weights.products=2;
    1 each by default)."""
    score_truncated: bool = True
    """Math task: completions cut by generator.max_new_tokens still score when their final
    answer is complete; false: only completions that emitted the end token score."""


@dataclass
class GeneratorConfig:
    backend: str = "transformers"
    """Generation backend: `transformers` (CPU or GPU, in the learner's process) or `vllm`
    (`generator=vllm`: a vLLM engine on a CUDA GPU, needs the `vllm` extra;
    replay_pipeline/generation/vllm_backend.py)."""
    chat_template: bool = False
    """Feed each prompt as one user message through the tokenizer's chat template (the
    assistant's turn opened), for instruction-tuned Hugging Face models; the template's own
    special tokens replace the tokenizer's BOS. The rollouts' `prompt` column keeps the task's
    text, `prompt_ids` what the model saw. Needs model.path with a tokenizer that has a chat
    template (checked before the run starts)."""
    system_prompt: Optional[str] = None
    """With chat_template: a system message before each prompt (reasoning-gym's examples ask
    for <answer> tags there); None: the template's own (SmolLM2's names the assistant). Part
    of what the model sees, so of `prompt_ids`."""
    temperature: float = bounded(1.0, gt=0)
    """Sampling temperature for training rollouts. Behaviour log-probs are those of
    softmax(logits / temperature), and the learner uses the same temperature."""
    top_p: float = bounded(1.0, gt=0, le=1)
    """Nucleus sampling for training rollouts (1.0 = off). Stored log-probs ignore the
    truncation, as in verl and TRL."""
    max_new_tokens: int = bounded(6, ge=1, integer=True)
    """Completion length cap; a completion that hits it ends with finish_reason="length"."""
    batch_size: int = bounded(256, ge=1, integer=True)
    """Prompt rows per generate() call (memory bound, not a training knob). vllm: the
    engine's max_num_seqs (sequences decoded at once); one call submits every prompt."""
    # vLLM engine settings (generator.backend=vllm only; setting one with the transformers
    # backend is refused). The defaults leave room for a learner on the same GPU.
    gpu_memory_utilization: float = bounded(0.3, gt=0, le=1)
    """vllm only: fraction of the GPU's total memory the engine takes for its weights,
    activations and KV cache (vLLM's own default, 0.92, would leave nothing for a learner on
    the same GPU); the engine refuses to start if that much is not free."""
    max_model_len: Optional[int] = bounded(None, ge=2, integer=True, null="for the model's")
    """vllm only: longest prompt + completion the engine serves, which sizes its KV cache;
    None: the model's max_position_embeddings. Longer requests are refused before sampling."""
    dtype: str = "auto"
    """vllm only: the engine's weight and activation dtype: `auto` (the checkpoint's; vLLM
    runs float32 checkpoints in float16), `bfloat16`, `float16` or `float32`. Behaviour
    log-probs come from this dtype's logits; the learner re-scores in its own."""
    enforce_eager: bool = False
    """vllm only: skip CUDA-graph capture (faster engine start, slower decoding)."""
    enable_sleep_mode: bool = False
    """vllm only: put the engine to sleep (level 1: weights offloaded to CPU memory, KV cache
    dropped) after every generate() call, freeing its GPU memory for the learner; it wakes
    the weights for the next load_weights and the KV cache for the next generate()."""
    rescore_top_p: bool = True
    """vllm only: re-score calls that sample with top_p < 1 with a teacher-forced pass of a
    transformers copy of the policy kept on the GPU (updated with every publication), so their
    log-probs are softmax(logits / temperature) without truncation, the learner's. false: no
    copy (saves one model of GPU memory); such calls keep vLLM's nucleus-renormalised
    log-probs, so generator.top_p must then be 1 (evaluation's pass@1 at top_p 0.95 reads no
    log-probs)."""


VLLM_ONLY_FIELDS = ("gpu_memory_utilization", "max_model_len", "dtype", "enforce_eager",
                    "enable_sleep_mode", "rescore_top_p")
VLLM_DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclass
class BufferConfig:
    strategy: str = "uniform"
    """How minibatches are drawn from the window (replay_pipeline.buffer.sampling): `uniform`
    (with replacement, the paper's vanilla buffer), `without_replacement` (within a step's
    round), `recency`, `prioritized` (by |advantage|), or `fresh` (the no-buffer baseline:
    the newest batch, each rollout once)."""
    capacity: int = bounded(128, ge=1, integer=True)
    """FIFO window: the newest `capacity` rollouts of the run can be sampled (ignored by
    `fresh`, whose window is always the newest generation step's batch)."""
    uri: Optional[str] = None
    """LanceDB database (a directory or an object-store URI such as s3://bucket/prefix,
    gs://bucket/prefix, az://container/prefix; see infra/object-storage.md). None:
    <root_dir>/lancedb."""
    storage_options: Optional[Dict[str, Any]] = field(default_factory=dict)
    """Object-store settings for an object-store `buffer.uri`, passed to Lance (flat keys,
    e.g. `buffer.storage_options={aws_endpoint:'http://127.0.0.1:9000',allow_http:true}`).
    Empty or null, and any key left out: taken from the usual environment variables, which
    Lance reads (AWS_ENDPOINT_URL, AWS_ALLOW_HTTP, AWS_REGION, AWS_ACCESS_KEY_ID,
    AWS_SECRET_ACCESS_KEY, ...). Keep secrets in the environment: the resolved config is saved
    with the run (config.yaml) and hashed for resume; MLflow params mask secret-looking keys.
    An object-store database is probed before the run starts (bucket, endpoint, credentials).
    (Empty, not null, by default: Hydra can merge a dict override into it, and it adds nothing
    to the config hash of runs made before it existed.)"""
    positive_bias: float = bounded(0.0, ge=0, lt=1, hint="the paper used 0.2 or 0.5")
    """The paper's positive-bias window, delta: the window holds the freshest (1 - delta) N
    rollouts plus the freshest delta N correct rollouts not already among them (the paper
    used 0.2 and 0.5). 0: plain FIFO window."""
    reuse_cap: Optional[int] = owned(None, 'sampling')
    """A rollout is never used by more than this many learner steps in total (None: no cap);
    counted from the durable usage records."""
    max_staleness: Optional[int] = owned(None, 'sampling')
    """Only rollouts at most this many policy versions old can be drawn (None: no bound). Policy
    versions count rounds (loop.updates_per_step learner updates each), not learner updates."""
    recency_half_life: float = owned(2.0, 'sampling')
    """`recency` strategy: a rollout's weight halves every this many policy versions of age
    (rounds of loop.updates_per_step learner updates, not updates)."""
    priority_alpha: float = owned(1.0, 'sampling')
    """`prioritized` strategy: weight = (|advantage| + 1e-3) ** priority_alpha."""
    compact_every: int = bounded(50, ge=0, integer=True, hint="0: never")
    """Compact the rollout table's fragments and refresh its indexes every this many steps
    (each append adds a fragment; without compaction appends and window reads slow down
    as the run grows). 0 never compacts."""
    read_cache: bool = True
    """Serve the sampler's reads of the live window (its rows, the chosen rows' token data
    and their reuse counts) from an in-memory mirror of the table's newest rows
    (replay_pipeline/buffer/cache.py) instead of three LanceDB queries a round. Same results
    either way; false reads the table every round."""
    read_ahead: bool = True
    """Async loop, with read_cache: a background thread of the learner reads the rows the
    generators commit while the learner trains, so a round only merges them into the mirror
    (replay_pipeline/buffer/cache.py). false: the learner reads them at the start of its round."""
    write_behind: bool = True
    """Commit each round's rollout append and usage records on a background thread while the
    learner computes (replay_pipeline/buffer/writer.py): one write in flight, validated before
    it is handed over, waited for before the next write, every checkpoint and the end of the
    run. false: every write finishes before the loop goes on."""
    commit_seconds: float = bounded(1.0, ge=0, hint="0: two commits every round")
    """Sync loop, with read_cache: group the commits. Each round's rollouts and usage records
    are validated and numbered at once but committed with the following rounds' once this many
    seconds passed since the previous group: two LanceDB commits per group instead of two a
    round (replay_pipeline/buffer/tables.py). Checkpoints, reads of the tables and the end of
    the run (stopped or failed too) commit what is held; a process killed outright loses at
    most this many seconds of rounds, which a resume regenerates from their seeds. 0: every
    round commits its own (the rollouts behind the learner, the records behind the next
    round). The async loop always commits per batch."""


@dataclass
class AlgoConfig:
    objective: str = "grpo_clip"
    """Policy loss, one of replay_pipeline.algo.objectives.OBJECTIVES: `grpo_clip` (the paper's),
    `asymre` (REINFORCE, baseline = group mean reward + delta_v), `tis` (REINFORCE weighted
    by min(ratio, tis_cap)), `topr` (positives unweighted, negatives by clip(ratio, 0, 1))."""
    delta_v: float = -0.1
    """asymre: shift of the baseline below the group mean reward (the paper's -0.1)."""
    tis_cap: float = bounded(2.0, gt=0)
    """tis: truncation c of the importance weight min(pi / mu, c)."""
    kl_coef: float = owned(0.0, 'learner')
    """Weight of a KL penalty to the frozen starting policy (k3 estimator); 0 = off, as in
    the paper."""
    entropy_coef: float = owned(0.0, 'learner')
    """Weight of an entropy bonus: the per-token loss minus entropy_coef times the entropy of
    the current policy's next-token distribution (on completion tokens, aggregated like the
    loss); 0 = off, as in the paper."""
    lr: float = bounded(3e-5, gt=0)
    """AdamW learning rate, constant (CPU-DEMO: 3e-5 and 6e-5 held, 1e-4 drifted, 3e-4 collapsed)."""
    eps_low: float = bounded(0.2, ge=0, lt=1)
    """Lower clip of the importance ratio: ratio >= 1 - eps_low."""
    eps_high: float = bounded(0.2, ge=0)
    """Upper clip of the importance ratio: ratio <= 1 + eps_high."""
    micro_batch_size: Optional[int] = bounded(None, ge=1, integer=True, null="for the whole minibatch")
    """Rows a learner update runs forward and backward at a time, their gradients summed into
    the minibatch's (the loss's denominator stays the minibatch's, so the update is the same
    up to float rounding); None: the whole minibatch at once. Memory, not a training knob: a
    pretrained model's activations grow with the rows (SmolLM2-135M at 64 rows of ~60 tokens
    took over 10 GB), so experiment=smollm2_chain_sum uses 16."""
    loss_agg: str = "token_mean"
    """`token_mean` (every completion token of the minibatch weighs the same) or `seq_mean`."""
    max_grad_norm: float = bounded(1.0, ge=0, hint="0 disables")
    """Gradient clipping by global norm; 0 disables it."""
    weight_decay: float = 0.0
    """AdamW weight decay (0: plain Adam, as in the paper)."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""


@dataclass
class LoopConfig:
    mode: str = "sync"
    """`sync`: generate, score, append, then learn, in turn (deterministic). `async`
    (`loop=async`): `workers` generator processes and the learner run at the same time and
    meet only at the rollout table and the published weights (replay_pipeline/run/workers.py)."""
    steps: int = bounded(500, ge=1, integer=True)
    """Generation steps (rounds) of the run (500: about 5 minutes on a 2-core CPU). In the
    async loop: learner rounds, i.e. published policy versions."""
    prompts_per_step: int = bounded(8, ge=1, integer=True)
    """Prompts per generation step (async: per generator batch)."""
    group_size: int = bounded(8, ge=2, integer=True, hint="the group-normalised advantage needs at least two completions per prompt")
    """Completions per prompt (G); advantages are normalised within each group."""
    minibatch_size: int = bounded(64, ge=1, integer=True)
    """Rollouts per learner step (B)."""
    updates_per_step: int = bounded(2, ge=1, integer=True)
    """Learner steps per generation step (K). Replay ratio = K x B / (prompts x G). In the
    async loop: learner steps per round, after which the weights are published."""
    workers: int = bounded(1, ge=1, integer=True)
    """Async loop: generator workers (W)."""
    engine: str = "local"
    """Async loop: where the generators run. `local`: child processes of the flow (spawn).
    `ray`: resident actors on a Ray cluster (local or multi-machine), placed by a placement group and replaced when they die (needs
    `pip install 'ray==2.60.*'`; the `ray.*` settings). Each generator is a `generator-W` task
    in Prefect either way; see infra/distributed.md."""
    heartbeat_timeout: float = bounded(180.0, ge=1, hint="seconds; default 180")
    """Async loop: a generator stops when the learner's heartbeat (<run_dir>/async/HEARTBEAT,
    written every timeout/6 s, at most every 10 s) has not changed for this many seconds,
    i.e. when the learner was killed without writing STOP (for generators on other machines)."""
    worker_threads: int = bounded(1, ge=1, integer=True)
    """Async loop: torch threads of each generator process (keep W x this + the learner's
    model.torch_threads within the cores)."""
    replay_cap: Optional[float] = bounded(None, gt=0, null="for no cap")
    """Async loop: the learner waits while a round would lift the replay ratio (uses / rows
    stored) above this; null: no cap."""
    replay_floor: Optional[float] = bounded(None, ge=0, null="for no floor")
    """Async loop: generators wait while the table holds a minibatch and the replay ratio is
    below this; null: no floor."""
    eval_every: int = bounded(25, ge=0, integer=True, hint="0: only first and last")
    """Held-out evaluation every this many steps (and always before the first and after the
    last); 0 evaluates only before and after."""
    passk_every: int = bounded(100, ge=0, integer=True, hint="0: never")
    """Sampled evaluation (pass@k for k up to eval_samples at temperature 1, pass@1 at
    temperature 0.1, sample entropy and length) every this many steps, and before the first
    and after the last; 0: never (greedy accuracy only). It generates heldout_size x
    (pass1_samples + eval_samples) completions: sized for the built-in model, far more than a
    pretrained model's first steps on a CPU."""
    eval_samples: int = bounded(16, ge=1, integer=True)
    """Completions per held-out prompt for pass@k (k = 1, 2, 4, ... up to this)."""
    eval_top_p: float = bounded(0.95, gt=0, le=1)
    """Nucleus top_p of the sampled evaluation's pass@k at temperature 1: the paper's 0.95
    (1.0 is plain sampling)."""
    pass1_samples: int = bounded(4, ge=1, integer=True)
    """Completions per held-out prompt for the paper's pass@1 at temperature 0.1, top_p 0.95:
    several, as the paper's."""
    checkpoint_every: int = bounded(100, ge=0, integer=True, hint="0: only after the last")
    """Checkpoint every this many steps (and after the last); 0 only after the last."""
    keep_checkpoints: int = bounded(3, ge=1, integer=True)
    """Newest checkpoints kept on disk."""
    rounds_per_task: int = bounded(10, ge=1, integer=True, hint="1: a Prefect task per round")
    """Consecutive rounds run as one Prefect task (`rounds-FIRST-LAST` in the UI), ending early
    where an evaluation or a checkpoint falls due; every round still logs its own metrics at
    its own step. A Prefect task run costs about as much CPU as a tenth of a default round
    (docs/performance.md, "Prefect's cost per task run"); 1 gives one task per round."""


@dataclass
class RayConfig:
    """loop.engine=ray: the Ray cluster the async loop's generators run on, one resident actor
    each in a bundle of one placement group (replay_pipeline/run/ray_engine.py,
    infra/distributed.md)."""
    address: Optional[str] = None
    """An existing cluster to join as its driver, HOST:PORT of its head (`ray start --head`
    prints it, e.g. 10.0.0.5:6379), left running at the end; every node must see the run root
    at the same path (a shared filesystem). None: the flow starts a Ray instance on this
    machine and shuts it down at the end."""
    num_cpus: Optional[int] = bounded(None, ge=1, integer=True, null="for this machine's CPU count")
    """address=None: CPUs the local instance offers for placement (Ray's CPUs are logical: the
    generators' bundles must fit, whatever the cores). None: this machine's CPU count."""
    num_gpus: Optional[int] = bounded(None, ge=0, integer=True, null="for the GPUs Ray detects")
    """address=None: GPUs the local instance offers (one per generator with generator=vllm).
    None: as many as Ray detects (CUDA_VISIBLE_DEVICES, else every visible GPU)."""
    placement_timeout: float = bounded(60.0, gt=0, finite=True, hint="seconds")
    """Seconds to wait for the generators' placement group to be placed, and for each
    generator actor to start in its bundle (a replacement after a node loss waits for its
    bundle to be placed again); past it the run is refused (at the start) or stops (mid-run),
    naming what is missing and what the cluster has."""
    max_restarts: int = bounded(3, ge=0, integer=True)
    """Times each generator's actor is replaced after it died (killed, its process or its node
    lost) while the run was going; the replacement takes over the worker id and regenerates
    the batch its predecessor had in flight. Past it the run stops with one line naming the
    generator, and `resume=RUN` continues it."""
    generator_python: Optional[str] = None
    """A Python executable for the generator actors (their runtime_env `py_executable`), e.g.
    a virtual environment with vLLM and its pinned torch, apart from the learner's (as
    NeMo-RL does); it must have replay-pipeline installed. It must exist at this path on
    every node. None: the driver's Python."""


@dataclass
class TrackingConfig:
    root_dir: str = "runs"
    """Everything a run writes lives under here: <run_id>/ (config, checkpoints), lancedb/,
    mlflow.db, mlartifacts/, cache/ (warm starts). Relative to the working directory."""
    mlflow_uri: Optional[str] = None
    """MLflow tracking URI. None: sqlite:///<root_dir>/mlflow.db (no server needed)."""
    artifact_location: Optional[str] = None
    """Where MLflow stores artifacts of a new experiment. None: <root_dir>/mlartifacts."""
    experiment: str = "replay-pipeline"
    """MLflow experiment name."""
    parent_run_id: Optional[str] = None
    """MLflow run id of a parent run (a sweep's, flows/sweep.py): the run is created as its
    child (tag mlflow.parentRunId), so the MLflow UI nests it under the sweep."""
    progress: bool = True
    """Show a progress bar with live reward and accuracy on the terminal."""
    log_model: bool = True
    """Log the final checkpoint's policy as an MLflow model (transformers flavour, task
    text-generation) linked to the run: `mlflow.transformers.load_model` or
    `mlflow.pyfunc.load_model` on the models:/ URI the summary prints. It is loaded on the CPU
    and written once more into the artifact store: false skips it (a run's checkpoints keep the
    weights either way)."""


@dataclass
class RewardConfig:
    """How the task's reward is called (replay_pipeline/algo/scoring.py), in training, in the async
    generators and in every evaluation alike."""
    timeout: Optional[float] = bounded(30.0, gt=0, finite=True, null="for no timeout")
    """Seconds one call of the reward may take. A call that takes longer scores 0, flagged
    "reward timed out after N s" like a reward that raises (the call is left to finish on a
    daemon thread: Python cannot stop it). The guard costs one thread hand-off a batch, a
    microsecond or two a call; None runs rewards inline."""
    max_flagged_fraction: float = bounded(0.9, ge=0, le=1)
    """A training batch with a larger share of flagged rollouts (raised, not a number, timed
    out) stops the run before the batch is stored, naming the first reason: that is a broken
    reward, not bad completions (1: never stop)."""
    verifier_weight: float = bounded(1.0, ge=0, finite=True)
    """Weight of the task's own verifier in the training reward (with reward.terms; 1 alone)."""
    terms: Dict[str, Any] = field(default_factory=dict)
    """Weighted reward terms added to the verifier in training, by name:
    `+reward.terms.NAME.target=package.module:fn` (or /path/file.py:fn), `.weight` (default 1),
    `.args` (keyword arguments of each call). `fn(prompt, completion, finish_reason, **args)`
    returns a number; the training reward is verifier_weight x verifier + the sum of weight x
    term, each term's batch mean logged as score/term/NAME. Correctness (score/accuracy, every
    evaluation) stays the verifier's alone. Guarded like the verifier (replay_pipeline/algo/scoring.py)."""


@dataclass
class ReuseConfig:
    """Adaptive reuse (replay_pipeline/algo/reuse.py): how many learner updates a round takes,
    decided before each update from its own diagnostics. `fixed` (the default) is the paper's
    constant K = loop.updates_per_step."""
    rule: str = "fixed"
    """fixed, grad_spike (a watched group's gradient norm jumps above spike_factor x the round's
    mean, as DGG), kl_budget (the minibatch's KL(behaviour || current) above kl_budget) or
    clip_budget (its clipped token fraction above clip_budget)."""
    max_updates: int = bounded(8, ge=1, integer=True)
    """The most updates a round draws and may take (replaces loop.updates_per_step unless fixed)."""
    min_updates: int = bounded(1, ge=1, integer=True)
    """Updates a round always takes before the rule is asked."""
    group: str = "output"
    """grad_spike: the parameters whose gradient norm is watched: `output` (the output
    embedding, DGG's output layer) or part of a parameter name (e.g. layers.3.mlp)."""
    spike_factor: float = bounded(2.0, gt=1, finite=True)
    """grad_spike: how many times the round's mean norm counts as a spike."""
    kl_budget: float = bounded(0.02, gt=0, finite=True)
    """kl_budget: the most KL(behaviour || current) (k3, per completion token) an update may see."""
    clip_budget: float = bounded(0.2, gt=0, le=1)
    """clip_budget: the largest clipped token fraction an update may have."""


@dataclass
class LearnerConfig:
    """The learner's processes (replay_pipeline/run/ranks.py): one by default; with
    `world_size` N > 1, N data-parallel ranks, each training on its share of every minibatch:
    replicas of the model and its optimizer with gradients all-reduced, or (`shard=fsdp2`)
    shards of them. Rank 0 is the flow's own process; the others are started by loop.engine
    (local: child processes; ray: actors)."""
    world_size: int = bounded(1, ge=1, integer=True)
    """Data-parallel ranks (N). Each minibatch is drawn once and split by rows: keep
    loop.minibatch_size (and algo.micro_batch_size) in mind, a rank with no rows still takes part."""
    backend: str = "auto"
    """torch.distributed backend: auto (NCCL on CUDA devices, gloo otherwise), gloo or nccl."""
    timeout: float = bounded(600.0, gt=0, finite=True, hint="seconds; longer than the slowest learner step")
    """Seconds any collective (the start's broadcast of the weights, each step's all-reduce) may
    take before the run stops with an error naming the ranks: a rank with a small share waits
    in the all-reduce for the slowest, so keep it above one learner step's time."""
    shard: Optional[str] = None
    """None: every rank holds the whole model and AdamW state (replicated; right where they fit
    one device). fsdp2: each rank holds 1/world_size of them (FSDP2, replay_pipeline/training/
    sharding.py), for a model that does not fit; needs world_size > 1. Checkpoints, published
    weights and the MLflow model are the gathered whole state, as a one-process run writes them;
    rank 0 also keeps a whole copy for its generator (replay_pipeline/run/handover.py says why)."""


@dataclass
class Config:
    seed: int = 0
    """Seeds model init, sampling and the replay sampler; a run is reproducible from it."""
    run_id: Optional[str] = None
    """Name of the run (letters, digits, - and _). None: a timestamp plus a random suffix."""
    resume: Optional[str] = None
    """Run id to continue from its newest valid checkpoint, into the same rollout table and
    MLflow run. Only keys that do not change the trajectory may be overridden with it
    (loop.steps to extend the run, evaluation/checkpoint cadence, tracking.progress,
    model.torch_threads); see replay_pipeline/run/resume.py."""
    fork: Optional[str] = None
    """`<run_id>@<step>`: start a new run from that run's checkpoint at `step`, its buffer
    beginning as the source's rollout table at tag step-<step> (shared, not copied). Any
    key but model.*, buffer.uri and tracking.* (except progress) may be overridden."""
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    reuse: ReuseConfig = field(default_factory=ReuseConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)


#: The task section's defaults: which fields a task left at them (replay_pipeline.tasks).
TASK_DEFAULTS = {f.name: f.default_factory() if f.default_factory is not MISSING else f.default
                 for f in fields(TaskConfig)}

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"

LOSS_AGGREGATIONS = ("token_mean", "seq_mean")
GENERATOR_BACKENDS = ("transformers", "vllm")  # replay_pipeline.generation.build_generator
LOOP_MODES = ("sync", "async")
LOOP_ENGINES = ("local", "ray")  # `dask` was retired (docs/log.md)
LEARNER_BACKENDS = ("auto", "gloo", "nccl")
#: learner.shard, besides None (replicated ranks).
LEARNER_SHARDS = ("fsdp2",)
