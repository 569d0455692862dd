"""Structured configuration: every field, its default and its meaning, in one place.

The YAML files under ``conf/`` are presets that only state what differs from these
defaults; Hydra merges them onto these dataclasses, so a typo in a preset or an override
(``buffer.capacitty=3``) fails at composition with the list of valid keys.

``validate`` checks what types cannot (cross-field rules such as "the batch is a multiple
of the group size") and raises one ``ConfigError`` that lists every problem with the
override that fixes it, before any model is loaded or any table is opened.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf


class ConfigError(ValueError):
    """Invalid configuration; the message says which override fixes it."""


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
    target_accuracy: float = 0.25
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
    torch_threads: int = 2
    """CPU threads for torch; 0 keeps torch's own default. Runs are bit for bit repeatable at a
    fixed thread count; another count sums in another order and the rollouts drift apart."""
    device: str = "auto"
    """Where the learner's model and the transformers generator run: `auto` (`cuda` when torch
    sees a GPU, else `cpu`; each process decides for itself), `cpu`, `cuda` or `cuda:N`
    (replay_pipeline/models/device.py). A hardware setting: a resume may change it. The vLLM
    engine is always on the GPU."""


@dataclass
class TaskConfig:
    name: str = "addition"
    """Registered task name; see replay_pipeline.tasks.TASKS."""
    digits: int = 3
    """Addition task: digits per operand (prompt "007+110=")."""
    heldout_size: int = 512
    """Prompts held out of warm start and RL, used for eval/ accuracy (CPU-DEMO: 256 is
    noisy by +/- 3 points, so 512 by default)."""
    validation_size: int = 256
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
    max_prompts: Optional[int] = None
    """Math task: at most this many training problems (None: all left after held-out and
    validation)."""
    answer_fallback: Optional[str] = None
    """Math task: `last_number` scores the completion's last number when it gives no "####" or
    \\boxed{} answer (lenient); None: an explicit final answer is required."""
    score_truncated: bool = True
    """Math task: completions cut by generator.max_new_tokens still score when their final
    answer is complete; false: only completions that emitted the end token score."""


@dataclass
class GeneratorConfig:
    backend: str = "transformers"
    """Generation backend: `transformers` (CPU or GPU, in the learner's process) or `vllm`
    (`generator=vllm`: a vLLM engine on a CUDA GPU, needs the `vllm` extra;
    replay_pipeline/generation/vllm_backend.py)."""
    temperature: float = 1.0
    """Sampling temperature for training rollouts. Behaviour log-probs are those of
    softmax(logits / temperature), and the learner uses the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling for training rollouts (1.0 = off). Stored log-probs ignore the
    truncation, as in verl and TRL."""
    max_new_tokens: int = 6
    """Completion length cap; a completion that hits it ends with finish_reason="length"."""
    batch_size: int = 256
    """Prompt rows per generate() call (memory bound, not a training knob). vllm: the
    engine's max_num_seqs (sequences decoded at once); one call submits every prompt."""
    # vLLM engine settings (generator.backend=vllm only; setting one with the transformers
    # backend is refused). The defaults leave room for a learner on the same GPU.
    gpu_memory_utilization: float = 0.3
    """vllm only: fraction of the GPU's total memory the engine takes for its weights,
    activations and KV cache (vLLM's own default, 0.92, would leave nothing for a learner on
    the same GPU); the engine refuses to start if that much is not free."""
    max_model_len: Optional[int] = None
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
    capacity: int = 128
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
    positive_bias: float = 0.0
    """The paper's positive-bias window, delta: the window holds the freshest (1 - delta) N
    rollouts plus the freshest delta N correct rollouts not already among them (the paper
    used 0.2 and 0.5). 0: plain FIFO window."""
    reuse_cap: Optional[int] = None
    """A rollout is never used by more than this many learner steps in total (None: no cap);
    counted from the durable usage records."""
    max_staleness: Optional[int] = None
    """Only rollouts at most this many policy versions old can be drawn (None: no bound)."""
    recency_half_life: float = 2.0
    """`recency` strategy: a rollout's weight halves every this many policy versions of age."""
    priority_alpha: float = 1.0
    """`prioritized` strategy: weight = (|advantage| + 1e-3) ** priority_alpha."""
    compact_every: int = 50
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


@dataclass
class AlgoConfig:
    objective: str = "grpo_clip"
    """Policy loss, one of replay_pipeline.objectives.OBJECTIVES: `grpo_clip` (the paper's),
    `asymre` (REINFORCE, baseline = group mean reward + delta_v), `tis` (REINFORCE weighted
    by min(ratio, tis_cap)), `topr` (positives unweighted, negatives by clip(ratio, 0, 1))."""
    delta_v: float = -0.1
    """asymre: shift of the baseline below the group mean reward (the paper's -0.1)."""
    tis_cap: float = 2.0
    """tis: truncation c of the importance weight min(pi / mu, c)."""
    kl_coef: float = 0.0
    """Weight of a KL penalty to the frozen starting policy (k3 estimator); 0 = off, as in
    the paper."""
    entropy_coef: float = 0.0
    """Weight of an entropy bonus: the per-token loss minus entropy_coef times the entropy of
    the current policy's next-token distribution (on completion tokens, aggregated like the
    loss); 0 = off, as in the paper."""
    lr: float = 3e-5
    """AdamW learning rate, constant (CPU-DEMO: 3e-5 and 6e-5 held, 1e-4 drifted, 3e-4 collapsed)."""
    eps_low: float = 0.2
    """Lower clip of the importance ratio: ratio >= 1 - eps_low."""
    eps_high: float = 0.2
    """Upper clip of the importance ratio: ratio <= 1 + eps_high."""
    loss_agg: str = "token_mean"
    """`token_mean` (every completion token of the minibatch weighs the same) or `seq_mean`."""
    max_grad_norm: float = 1.0
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
    meet only at the rollout table and the published weights (replay_pipeline/async_loop.py)."""
    steps: int = 500
    """Generation steps (rounds) of the run (500: about 5 minutes on a 2-core CPU). In the
    async loop: learner rounds, i.e. published policy versions."""
    prompts_per_step: int = 8
    """Prompts per generation step (async: per generator batch)."""
    group_size: int = 8
    """Completions per prompt (G); advantages are normalised within each group."""
    minibatch_size: int = 64
    """Rollouts per learner step (B)."""
    updates_per_step: int = 2
    """Learner steps per generation step (K). Replay ratio = K x B / (prompts x G). In the
    async loop: learner steps per round, after which the weights are published."""
    workers: int = 1
    """Async loop: generator workers (W)."""
    engine: str = "local"
    """Async loop: where the generators run. `local`: child processes of the flow (spawn).
    `dask`: tasks on a Dask cluster (needs `pip install 'dask[distributed]'`), each still a
    `generator-W` task in Prefect; see infra/distributed.md."""
    dask_address: Optional[str] = None
    """loop.engine=dask: the scheduler to use, e.g. tcp://10.0.0.5:8786 (it must see the run
    root at the same path: a shared filesystem). None: the flow starts a local cluster of
    `workers` processes with one thread each and closes it at the end."""
    heartbeat_timeout: float = 180.0
    """Async loop: a generator stops when the learner's heartbeat (<run_dir>/async/HEARTBEAT,
    written every timeout/6 s, at most every 10 s) has not changed for this many seconds,
    i.e. when the learner was killed without writing STOP (for generators on other machines)."""
    worker_threads: int = 1
    """Async loop: torch threads of each generator process (keep W x this + the learner's
    model.torch_threads within the cores)."""
    replay_cap: Optional[float] = None
    """Async loop: the learner waits while a round would lift the replay ratio (uses / rows
    stored) above this; null: no cap."""
    replay_floor: Optional[float] = None
    """Async loop: generators wait while the table holds a minibatch and the replay ratio is
    below this; null: no floor."""
    eval_every: int = 25
    """Held-out evaluation every this many steps (and always before the first and after the
    last); 0 evaluates only before and after."""
    passk_every: int = 100
    """Sampled evaluation (pass@k for k up to eval_samples at temperature 1, pass@1 at
    temperature 0.1, sample entropy and length) every this many steps, and before the first
    and after the last; 0: only before and after."""
    eval_samples: int = 16
    """Completions per held-out prompt for pass@k (k = 1, 2, 4, ... up to this)."""
    checkpoint_every: int = 100
    """Checkpoint every this many steps (and after the last); 0 only after the last."""
    keep_checkpoints: int = 3
    """Newest checkpoints kept on disk."""
    rounds_per_task: int = 10
    """Consecutive rounds run as one Prefect task (`rounds-FIRST-LAST` in the UI), ending early
    where an evaluation or a checkpoint falls due; every round still logs its own metrics at
    its own step. A Prefect task costs 4-11 ms on this 2-core machine, 2-3% of a default
    round (README, "Overhead benchmark"); 1 gives one task per round."""


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
    model.torch_threads); see replay_pipeline/resume.py."""
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
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


CONF_DIR = Path(__file__).resolve().parent.parent / "conf"

LOSS_AGGREGATIONS = ("token_mean", "seq_mean")
GENERATOR_BACKENDS = ("transformers", "vllm")  # replay_pipeline.generation.build_generator
LOOP_MODES = ("sync", "async")
LOOP_ENGINES = ("local", "dask")


def register_configs() -> None:
    """Register the dataclasses as the schema that conf/config.yaml builds on, and the
    `rp.mul` resolver that presets use to size things from the batch (`${rp.mul:a,b}`)."""
    node = OmegaConf.structured(Config)
    # Free-form keys (Lance's own option names): `buffer.storage_options={k:v,...}` and
    # `buffer.storage_options.k=v` must not need Hydra's `+`; every other key stays strict.
    OmegaConf.set_struct(node.buffer.storage_options, False)
    ConfigStore.instance().store(name="base_config", node=node)
    if not OmegaConf.has_resolver("rp.mul"):
        OmegaConf.register_new_resolver("rp.mul", lambda a, b: int(a) * int(b))


def load_config(overrides: list[str] | None = None) -> DictConfig:
    """Compose conf/ with Hydra overrides and validate; raise ConfigError on any problem."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register_configs()
    overrides = list(overrides or [])
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(_explain_composition_error(exc, overrides)) from exc
    validate(cfg)
    return cfg


def _explain_composition_error(exc: Exception, overrides: list[str]) -> str:
    text = str(exc).strip()
    hint = (
        "Run `python -m flows.train --help` for the config groups and their options, or "
        "`python -m flows.train --cfg` to print every key with its value."
    )
    if "Could not override" in text or "not in struct" in text or "Key '" in text:
        hint = (
            "Check the key's spelling; keys are listed by `python -m flows.train --cfg`. "
            "To add a key that does not exist, Hydra needs `+key=value`, but unknown keys "
            "are rejected by the schema in replay_pipeline/config.py."
        )
    elif "Could not find" in text or "In 'config'" in text:
        hint = "Pick one of the options listed above (files under conf/<group>/)."
    return f"Invalid configuration (overrides: {overrides or 'none'}):\n{text}\n{hint}"


def validate(cfg: DictConfig | Config) -> None:
    """Cross-field checks; raises ConfigError listing every problem and how to fix it.
    Then an object-store buffer.uri is probed (one LIST request), so a missing bucket, a wrong
    endpoint or refused credentials fail here, saying what to set."""
    from replay_pipeline.buffer.sampling import SAMPLERS
    from replay_pipeline.objectives import OBJECTIVES
    from replay_pipeline.tasks import TASKS

    c = cfg
    problems: list[str] = []

    def need(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    try:
        # Touch every mandatory value once so a `???` surfaces here, not mid-run.
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True) if isinstance(cfg, DictConfig) else None
    except Exception as exc:  # MissingMandatoryValue and interpolation errors
        key = getattr(exc, "full_key", None) or str(exc)
        raise ConfigError(f"Missing value for `{key}`: set it on the command line, e.g. `{key}=...`") from exc

    loop, buf, algo, gen, model, task = c.loop, c.buffer, c.algo, c.generator, c.model, c.task
    rollouts = loop.prompts_per_step * loop.group_size

    need(loop.steps >= 1, f"loop.steps={loop.steps} must be >= 1")
    need(loop.prompts_per_step >= 1, f"loop.prompts_per_step={loop.prompts_per_step} must be >= 1")
    need(loop.group_size >= 2,
         f"loop.group_size={loop.group_size} must be >= 2: the group-normalised advantage needs "
         "at least two completions per prompt")
    need(loop.minibatch_size >= 1, f"loop.minibatch_size={loop.minibatch_size} must be >= 1")
    need(loop.minibatch_size % loop.group_size == 0,
         f"loop.minibatch_size={loop.minibatch_size} must be a multiple of "
         f"loop.group_size={loop.group_size}; raise loop.minibatch_size or lower loop.group_size")
    need(loop.updates_per_step >= 1, f"loop.updates_per_step={loop.updates_per_step} must be >= 1")
    need(loop.rounds_per_task >= 1, f"loop.rounds_per_task={loop.rounds_per_task} must be >= 1 (1: a Prefect task per round)")
    need(loop.eval_every >= 0, f"loop.eval_every={loop.eval_every} must be >= 0 (0: only first and last)")
    need(loop.passk_every >= 0, f"loop.passk_every={loop.passk_every} must be >= 0 (0: only first and last)")
    need(loop.eval_samples >= 1, f"loop.eval_samples={loop.eval_samples} must be >= 1")
    need(loop.checkpoint_every >= 0, f"loop.checkpoint_every={loop.checkpoint_every} must be >= 0")
    need(loop.keep_checkpoints >= 1, f"loop.keep_checkpoints={loop.keep_checkpoints} must be >= 1")
    need(loop.mode in LOOP_MODES, f"loop.mode={loop.mode!r} is not one of {list(LOOP_MODES)}")
    need(loop.workers >= 1, f"loop.workers={loop.workers} must be >= 1")
    _validate_engine(loop, need)
    need(loop.worker_threads >= 1, f"loop.worker_threads={loop.worker_threads} must be >= 1")
    need(loop.replay_cap is None or loop.replay_cap > 0, f"loop.replay_cap={loop.replay_cap} must be > 0, or null")
    need(loop.replay_floor is None or loop.replay_floor >= 0,
         f"loop.replay_floor={loop.replay_floor} must be >= 0, or null")
    if loop.replay_cap is not None and loop.replay_floor is not None:
        need(loop.replay_floor < loop.replay_cap,
             f"loop.replay_floor={loop.replay_floor} must be below loop.replay_cap={loop.replay_cap}, "
             "or the generators and the learner would wait for each other")
    if loop.mode == "async":
        need(buf.strategy != "fresh", "loop=async needs a buffer to decouple generators and learner; "
             "buffer=none (strategy fresh) is the sync on-policy baseline")

    need(buf.compact_every >= 0, f"buffer.compact_every={buf.compact_every} must be >= 0 (0: never)")
    need(buf.strategy in SAMPLERS,
         f"buffer.strategy={buf.strategy!r} is not one of {sorted(SAMPLERS)}")
    need(buf.capacity >= loop.minibatch_size or buf.strategy == "fresh",
         f"buffer.capacity={buf.capacity} is below one minibatch (loop.minibatch_size="
         f"{loop.minibatch_size}); raise buffer.capacity or lower loop.minibatch_size")
    need(0 <= buf.positive_bias < 1,
         f"buffer.positive_bias={buf.positive_bias} must be in [0, 1) (the paper used 0.2 or 0.5)")
    need(buf.reuse_cap is None or buf.reuse_cap >= 1,
         f"buffer.reuse_cap={buf.reuse_cap} must be >= 1, or null for no cap")
    need(buf.max_staleness is None or buf.max_staleness >= 0,
         f"buffer.max_staleness={buf.max_staleness} must be >= 0, or null for no bound")
    need(buf.recency_half_life > 0, f"buffer.recency_half_life={buf.recency_half_life} must be > 0")
    need(buf.priority_alpha >= 0, f"buffer.priority_alpha={buf.priority_alpha} must be >= 0")
    if buf.strategy == "fresh":  # the window is the fresh batch whatever buffer.capacity says
        need(buf.positive_bias == 0,
             "buffer.strategy=fresh (no-buffer baseline) has no window to bias; set buffer.positive_bias=0")
        need(loop.updates_per_step * loop.minibatch_size == rollouts,
             f"buffer.strategy=fresh uses each fresh rollout exactly once: loop.updates_per_step x "
             f"loop.minibatch_size ({loop.updates_per_step} x {loop.minibatch_size}) must equal the "
             f"rollouts per step ({rollouts}); use `buffer=none` as it is, or set them to match")
    problems.extend(_buffer_storage_problems(buf))

    need(algo.objective in OBJECTIVES,
         f"algo.objective={algo.objective!r} is not one of {sorted(OBJECTIVES)}")
    need(algo.loss_agg in LOSS_AGGREGATIONS,
         f"algo.loss_agg={algo.loss_agg!r} is not one of {list(LOSS_AGGREGATIONS)}")
    need(algo.lr > 0, f"algo.lr={algo.lr} must be > 0")
    need(algo.tis_cap > 0, f"algo.tis_cap={algo.tis_cap} must be > 0")
    need(algo.kl_coef >= 0, f"algo.kl_coef={algo.kl_coef} must be >= 0 (0 disables the KL penalty)")
    need(algo.entropy_coef >= 0,
         f"algo.entropy_coef={algo.entropy_coef} must be >= 0 (0 disables the entropy bonus)")
    need(0 <= algo.eps_low < 1, f"algo.eps_low={algo.eps_low} must be in [0, 1)")
    need(algo.eps_high >= 0, f"algo.eps_high={algo.eps_high} must be >= 0")
    need(algo.max_grad_norm >= 0, f"algo.max_grad_norm={algo.max_grad_norm} must be >= 0 (0 disables)")

    need(gen.backend in GENERATOR_BACKENDS,
         f"generator.backend={gen.backend!r} is not available here; choose one of {list(GENERATOR_BACKENDS)}")
    need(gen.temperature > 0, f"generator.temperature={gen.temperature} must be > 0")
    need(0 < gen.top_p <= 1, f"generator.top_p={gen.top_p} must be in (0, 1]")
    need(gen.max_new_tokens >= 1, f"generator.max_new_tokens={gen.max_new_tokens} must be >= 1")
    need(gen.batch_size >= 1, f"generator.batch_size={gen.batch_size} must be >= 1")
    problems.extend(_generator_backend_problems(gen, loop))

    need(task.name in TASKS, f"task.name={task.name!r} is not one of {sorted(TASKS)}")
    problems.extend(_task_problems(task))
    if model.path is None and model.name != "tiny":
        problems.append(f"model={model.name} needs a checkpoint: set model.path=/path/to/hf/checkpoint "
                        "(a directory written by save_pretrained), or use model=tiny")
    if model.path is not None:
        path = Path(os.path.expanduser(str(model.path)))
        if not path.is_dir():
            problems.append(f"model.path={model.path} is not a directory; point it at a Hugging Face "
                            "checkpoint directory (with config.json), or drop it to use the built-in model")
        elif not (path / "config.json").is_file():
            problems.append(f"model.path={model.path} has no config.json; it must be a Hugging Face "
                            "checkpoint directory as written by save_pretrained()")
    else:
        need(model.hidden_size % max(model.num_heads, 1) == 0,
             f"model.hidden_size={model.hidden_size} must be divisible by model.num_heads={model.num_heads}")
        from replay_pipeline.models.tiny import MAX_POSITIONS

        if task.name == "addition":  # prompt: <bos> a + b = (2 x digits + 3 tokens)
            longest = 2 * task.digits + 3 + gen.max_new_tokens
            need(longest <= MAX_POSITIONS,
                 f"generator.max_new_tokens={gen.max_new_tokens} with task.digits={task.digits} makes "
                 f"sequences of {longest} tokens, more than the built-in model's {MAX_POSITIONS} "
                 f"positions; lower generator.max_new_tokens to at most {MAX_POSITIONS - 2 * task.digits - 3}")
        need(task.name == "addition",
             f"task.name={task.name} needs a Hugging Face model: the built-in tiny model's tokenizer only "
             "knows the addition task's characters; add model=hf model.path=/path/to/checkpoint")
        need(0 <= model.warmstart.target_accuracy <= 1,
             f"model.warmstart.target_accuracy={model.warmstart.target_accuracy} must be in [0, 1]")
    need(model.torch_threads >= 0, f"model.torch_threads={model.torch_threads} must be >= 0")
    from replay_pipeline.models.device import device_problem

    device = device_problem(model.device)
    if device:
        problems.append(device)

    import re

    for key in ("run_id", "resume"):
        value = getattr(c, key, None)
        need(value is None or re.fullmatch(r"[A-Za-z0-9_-]+", str(value)) is not None,
             f"{key}={value!r} may only hold letters, digits, '-' and '_'")
    fork = getattr(c, "fork", None)
    need(fork is None or re.fullmatch(r"[A-Za-z0-9_-]+@[0-9]+", str(fork)) is not None,
         f"fork={fork!r} must be <run_id>@<step>, e.g. fork=20261129-171530-3fa2c1@100 "
         "(a run's checkpoints are <root_dir>/<run_id>/checkpoints/step-NNNNNN)")

    if problems:
        raise ConfigError("Invalid configuration:\n  - " + "\n  - ".join(problems))
    _probe_buffer_storage(buf)


def _generator_backend_problems(gen: Any, loop: Any) -> list[str]:
    """The vLLM backend's settings, and whether it can run here (vllm installed, a CUDA GPU:
    checked without importing vllm); vLLM-only settings with another backend."""
    defaults = GeneratorConfig()
    if gen.backend != "vllm":
        return [f"generator.{key}={getattr(gen, key)} is only used by generator.backend=vllm; drop it "
                "or add generator=vllm" for key in VLLM_ONLY_FIELDS if getattr(gen, key) != getattr(defaults, key)]
    from replay_pipeline.generation.vllm_backend import VLLM_INSTALL, vllm_unavailable

    problems = []
    reason = vllm_unavailable()
    if reason:
        problems.append(f"generator.backend=vllm cannot run here: {reason}. {VLLM_INSTALL}; or use "
                        "generator=transformers")
    if loop.mode == "async" and loop.engine == "dask":
        problems.append("generator.backend=vllm with loop.engine=dask is not supported (a Dask task runs in a thread "
                        "of a long-lived worker process, which would keep the engine's process-wide GPU state after "
                        "the task); use loop.engine=local, whose generator processes each own an engine, or "
                        "generator=transformers")
    elif loop.mode == "async" and (loop.workers + 1) * gen.gpu_memory_utilization >= 1:
        engines = loop.workers + 1  # one per generator process, one in the learner's for evaluation
        problems.append(f"loop.workers={loop.workers} with generator.gpu_memory_utilization="
                        f"{gen.gpu_memory_utilization} would give {engines} vLLM engines (one per generator process, one in the learner's "
                        f"process for evaluation) {engines * gen.gpu_memory_utilization:g} of the GPU, leaving "
                        f"nothing for the learner; lower generator.gpu_memory_utilization below {1 / engines:.3g} "
                        "or loop.workers")
    if not 0 < gen.gpu_memory_utilization <= 1:
        problems.append(f"generator.gpu_memory_utilization={gen.gpu_memory_utilization} must be in (0, 1]")
    if gen.max_model_len is not None and gen.max_model_len < 2:
        problems.append(f"generator.max_model_len={gen.max_model_len} must be >= 2, or null for the model's")
    if gen.dtype not in VLLM_DTYPES:
        problems.append(f"generator.dtype={gen.dtype!r} is not one of {list(VLLM_DTYPES)}")
    if not gen.rescore_top_p and gen.top_p < 1:
        problems.append(f"generator.top_p={gen.top_p} with generator.rescore_top_p=false would store vLLM's "
                        "nucleus-renormalised log-probs for training rollouts; set generator.rescore_top_p=true "
                        "or generator.top_p=1")
    return problems


def _task_problems(task: Any) -> list[str]:
    """What is wrong with the task section: fields of another task, the math task's data."""
    from replay_pipeline.tasks import unused_task_fields
    from replay_pipeline.tasks.answers import FALLBACKS
    from replay_pipeline.tasks.math import FORMATS

    fields = OmegaConf.to_container(task, resolve=True) if isinstance(task, DictConfig) else dict(vars(task))
    problems = [f"task.{key}={fields[key]} is not used by task.name={task.name}; drop it"
                + (" (the data fields are for task=gsm8k or task=math)" if task.name == "addition" else "")
                for key in unused_task_fields(str(task.name), fields)]
    if task.name != "math":
        return problems
    if task.path is None or not str(task.path).strip():
        problems.append("task.name=math needs its data: set task.path=/path/to/train.jsonl (a .jsonl, .json, "
                        ".parquet or .arrow file, a directory of them, or a datasets save_to_disk directory; "
                        "nothing is downloaded), e.g. python -m flows.train task=gsm8k "
                        "task.path=/data/gsm8k/train.jsonl model=hf model.path=/path/to/checkpoint")
    for key in ("path", "heldout_path"):
        value = getattr(task, key)
        if value is not None and str(value).strip() and not Path(os.path.expanduser(str(value))).exists():
            problems.append(f"task.{key}={value} does not exist; give a local file or directory")
    if task.format not in FORMATS:
        problems.append(f"task.format={task.format!r} is not one of {list(FORMATS)}")
    if task.answer_fallback not in FALLBACKS:
        problems.append(f"task.answer_fallback={task.answer_fallback!r} must be null or last_number")
    if task.max_prompts is not None and task.max_prompts < 1:
        problems.append(f"task.max_prompts={task.max_prompts} must be >= 1, or null for all")
    if task.heldout_size < 1 or task.validation_size < 0:
        problems.append(f"task.heldout_size={task.heldout_size} must be >= 1 and task.validation_size="
                        f"{task.validation_size} >= 0")
    if task.prompt_template is not None and "{question}" not in str(task.prompt_template):
        problems.append("task.prompt_template has no {question} placeholder; put {question} where the problem goes")
    return problems


def _buffer_storage_problems(buf: Any) -> list[str]:
    """What is wrong with buffer.uri / buffer.storage_options, without touching the store."""
    uri = "" if buf.uri is None else str(buf.uri)
    remote = "://" in uri and not uri.startswith("file://")
    options = buf.storage_options
    problems = []
    if uri.startswith("s3+ddb://"):
        problems.append(
            f"buffer.uri={uri}: the DynamoDB commit store (s3+ddb://) is not supported (the buffer "
            "appends through the Lance dataset, which would commit behind DynamoDB's back); use "
            "buffer.uri=s3://bucket/prefix on a store with conditional PUT (AWS S3, MinIO, R2), "
            "see infra/object-storage.md")
    if options and not remote:
        problems.append(
            "buffer.storage_options is set but "
            + (f"buffer.uri={buf.uri} is a local directory" if uri else
               "buffer.uri is unset (the local <tracking.root_dir>/lancedb)")
            + "; the options only apply to an object store: set buffer.uri=s3://bucket/prefix "
            "(or gs://, az://), or drop buffer.storage_options")
    for key, value in (dict(options) if options else {}).items():
        if value is not None and not isinstance(value, (str, int, float, bool)):
            problems.append(f"buffer.storage_options.{key} must be a string, number or boolean, "
                            f"not {type(value).__name__}: the options are flat, e.g. "
                            "buffer.storage_options={aws_endpoint:'http://127.0.0.1:9000',allow_http:true}")
    return problems


def _probe_buffer_storage(buf: Any) -> None:
    """An object-store buffer.uri must be reachable before any work starts (bucket, endpoint,
    credentials); one LIST request (replay_pipeline.buffer.lance_table.check_storage)."""
    uri = "" if buf.uri is None else str(buf.uri)
    if "://" not in uri or uri.startswith("file://"):
        return
    from replay_pipeline.buffer.lance_table import StoreError, check_storage

    try:
        check_storage(uri, buf.storage_options)
    except StoreError as exc:
        raise ConfigError(f"Invalid configuration: buffer.uri={uri}: {exc}") from exc


def _validate_engine(loop: Any, need: Any) -> None:
    """loop.engine, loop.dask_address and loop.heartbeat_timeout (the async loop's generators)."""
    import importlib.util

    from replay_pipeline.async_loop import DASK_INSTALL, valid_dask_address

    need(loop.engine in LOOP_ENGINES,
         f"loop.engine={loop.engine!r} is not one of {list(LOOP_ENGINES)}: `local` runs the generators "
         "as processes of the flow, `dask` as tasks on a Dask cluster")
    if loop.engine == "dask":
        need(importlib.util.find_spec("distributed") is not None,
             f"loop.engine=dask needs dask.distributed, which is not installed: {DASK_INSTALL}")
        need(loop.mode == "async", "loop.engine=dask runs the async loop's generators on Dask; add loop=async "
             "(the sync loop generates in the learner's own process)")
    if loop.dask_address is not None:
        need(loop.engine == "dask", f"loop.dask_address={loop.dask_address} is only used with loop.engine=dask; "
             "add loop.engine=dask or drop loop.dask_address")
        need(valid_dask_address(loop.dask_address),
             f"loop.dask_address={loop.dask_address!r} is not a Dask scheduler address; give "
             "[scheme://]host:port as `dask scheduler` prints it, e.g. loop.dask_address=tcp://10.0.0.5:8786")
    need(loop.heartbeat_timeout >= 1,
         f"loop.heartbeat_timeout={loop.heartbeat_timeout} must be >= 1 second (default 180)")


def to_dataclass(cfg: DictConfig) -> Config:
    """A typed Config from a composed DictConfig (for code that wants attribute types)."""
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def flatten(cfg: DictConfig | dict, prefix: str = "") -> dict[str, Any]:
    """{"algo.lr": 3e-5, ...}: the form MLflow params take."""
    container = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
    out: dict[str, Any] = {}
    for key, value in container.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, prefix=f"{name}."))
        else:
            out[name] = value
    return out
