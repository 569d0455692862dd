"""What a configuration must satisfy, checked without I/O: every field's bound (declared with
the field in replay_pipeline/config/schema.py) and the rules across fields ("the batch is a
multiple of the group size", "the no-buffer baseline uses each rollout once").

`validate` raises one `ConfigError` listing every problem with the override that fixes it.
It touches no file, network, device or installed package: what needs those (a model
directory, a data file, a GPU, vLLM or Ray installed, an object store, a Ray cluster's
nodes) is replay_pipeline/run/preflight.py's, which runs before any work.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from omegaconf import DictConfig, OmegaConf

from replay_pipeline.config.schema import (GENERATOR_BACKENDS, LEARNER_BACKENDS, LEARNER_SHARDS, LOOP_ENGINES,
                                           LOOP_MODES, LOSS_AGGREGATIONS, TASK_DEFAULTS, VLLM_DTYPES, VLLM_ONLY_FIELDS,
                                           AlgoConfig, Config, ConfigError, GeneratorConfig, RayConfig)
from replay_pipeline.algo.reuse import RULES
from replay_pipeline.tasks import CUSTOM, TASKS, unused_task_fields
from replay_pipeline.tasks.answers import FALLBACKS
from replay_pipeline.tasks.math import FORMATS
from replay_pipeline.tasks.reasoning_gym import dataset_names

#: loop.engine=dask, retired (docs/log.md says when and why); a resume or fork of a run that used
#: it is refused by replay_pipeline/run/resume.py with the command that continues it.
DASK_REASON = ("Ray does everything it did, on one machine or a multi-machine cluster, and more (learner "
               "ranks, placement checked before work, replaced generators), and one engine halves the tests "
               "and docs (docs/log.md)")
DASK_RETIRED = (f"loop.engine=dask was retired: {DASK_REASON}; use loop.engine=ray (a local Ray instance, or "
                "ray.address=HEAD:6379 for a cluster: infra/distributed.md) or loop.engine=local")
RAY_INSTALL = "pip install 'ray==2.60.*' (CPU machines: pip install -c infra/constraints-cpu.txt ray)"
DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")
_RAY_ADDRESS = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[^\s/:\[\]]+):[0-9]{1,5}")


def owner_bounds(owner: str) -> dict[str, Any]:
    """The bounds a library component states for its own values (see schema.owned)."""
    if owner == "learner":
        from replay_pipeline.training.learner import LEARNER_BOUNDS  # start-up cost: torch, only when validating

        return LEARNER_BOUNDS
    from replay_pipeline.buffer.sampling import RULE_BOUNDS  # start-up cost: the buffer package loads lancedb

    return RULE_BOUNDS


def field_problems(section: Any, schema: type, prefix: str = "") -> list[str]:
    """Every field of `section` (a config node or dataclass of class `schema`) outside its
    declared bound, recursing into nested sections."""
    problems = []
    nested = _SECTIONS[schema]
    for f in dataclasses.fields(schema):
        value = getattr(section, f.name)
        name = f"{prefix}{f.name}"
        if f.name in nested:
            problems += field_problems(value, nested[f.name], f"{name}.")
            continue
        bound = owner_bounds(f.metadata["owner"])[f.name] if "owner" in f.metadata else f.metadata.get("bound")
        problem = bound.problem(name, value) if bound is not None else None
        if problem:
            problems.append(problem)
    return problems


def _sections() -> dict[type, dict[str, type]]:
    """{schema class: {field name: nested schema class}} (annotations are strings here)."""
    out: dict[type, dict[str, type]] = {}
    todo = [Config]
    while todo:
        cls = todo.pop()
        nested = {f.name: f.default_factory for f in dataclasses.fields(cls)
                  if isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory)}
        out[cls] = nested
        todo += list(nested.values())
    return out


_SECTIONS = _sections()


def validate(cfg: DictConfig | Config) -> None:
    """Field bounds and cross-field rules; raises ConfigError listing every problem and how to
    fix it. Pure: no I/O (replay_pipeline/run/preflight.py does that)."""
    try:
        # Touch every mandatory value once so a `???` surfaces here, not mid-run.
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True) if isinstance(cfg, DictConfig) else None
    except Exception as exc:  # MissingMandatoryValue and interpolation errors
        key = getattr(exc, "full_key", None) or str(exc)
        raise ConfigError(f"Missing value for `{key}`: set it on the command line, e.g. `{key}=...`") from exc

    problems = field_problems(cfg, Config)

    def need(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    loop, buf, algo, gen, model, task = cfg.loop, cfg.buffer, cfg.algo, cfg.generator, cfg.model, cfg.task
    rollouts = loop.prompts_per_step * loop.group_size

    need(loop.group_size < 1 or loop.minibatch_size % loop.group_size == 0,
         f"loop.minibatch_size={loop.minibatch_size} must be a multiple of "
         f"loop.group_size={loop.group_size}; raise loop.minibatch_size or lower loop.group_size")
    need(loop.mode in LOOP_MODES, f"loop.mode={loop.mode!r} is not one of {list(LOOP_MODES)}")
    problems.extend(_engine_problems(loop))
    problems.extend(_learner_problems(cfg.learner, loop))
    problems.extend(_ray_problems(loop, cfg.ray))
    if loop.replay_cap is not None and loop.replay_floor is not None:
        need(loop.replay_floor < loop.replay_cap,
             f"loop.replay_floor={loop.replay_floor} must be below loop.replay_cap={loop.replay_cap}, "
             "or the generators and the learner would wait for each other")
    if loop.mode == "async":
        need(buf.strategy != "fresh", "loop=async needs a buffer to decouple generators and learner; "
             "buffer=none (strategy fresh) is the sync on-policy baseline")

    from replay_pipeline.buffer.sampling import SAMPLERS  # start-up cost: the buffer package loads lancedb

    need(buf.strategy in SAMPLERS,
         f"buffer.strategy={buf.strategy!r} is not one of {sorted(SAMPLERS)}")
    need(buf.capacity >= loop.minibatch_size or buf.strategy == "fresh",
         f"buffer.capacity={buf.capacity} is below one minibatch (loop.minibatch_size="
         f"{loop.minibatch_size}); raise buffer.capacity or lower loop.minibatch_size")
    reuse = cfg.reuse
    need(reuse.rule in RULES, f"reuse.rule={reuse.rule!r} is not one of {list(RULES)}")
    need(reuse.min_updates <= reuse.max_updates,
         f"reuse.min_updates={reuse.min_updates} is above reuse.max_updates={reuse.max_updates}")
    need(reuse.rule == "fixed" or buf.strategy != "fresh",
         f"reuse.rule={reuse.rule} decides how often rollouts are reused, but buffer.strategy=fresh uses each "
         f"once; to reuse only the fresh batch use buffer.strategy=uniform buffer.capacity={rollouts}")
    if buf.strategy == "fresh":  # the window is the fresh batch whatever buffer.capacity says
        need(buf.positive_bias == 0,
             "buffer.strategy=fresh (no-buffer baseline) has no window to bias; set buffer.positive_bias=0")
        need(loop.updates_per_step * loop.minibatch_size == rollouts,
             f"buffer.strategy=fresh uses each fresh rollout exactly once: loop.updates_per_step x "
             f"loop.minibatch_size ({loop.updates_per_step} x {loop.minibatch_size}) must equal the "
             f"rollouts per step ({rollouts}); use `buffer=none` as it is, or set them to match")
    problems.extend(buffer_storage_problems(buf))

    from replay_pipeline.algo.objectives import OBJECTIVES, objective_param_names  # start-up cost: torch

    need(algo.objective in OBJECTIVES,
         f"algo.objective={algo.objective!r} is not one of {sorted(OBJECTIVES)}")
    if algo.objective in OBJECTIVES:  # its hyper-parameters are algo.* fields of the same names
        fields = {f.name for f in dataclasses.fields(AlgoConfig)}
        missing = [n for n in objective_param_names(OBJECTIVES[algo.objective]) if n not in fields]
        need(not missing, f"algo.objective={algo.objective} takes {missing}, which the configuration does not "
             "have: add a field of that name to AlgoConfig in replay_pipeline/config/schema.py")
    need(algo.loss_agg in LOSS_AGGREGATIONS,
         f"algo.loss_agg={algo.loss_agg!r} is not one of {list(LOSS_AGGREGATIONS)}")

    need(gen.backend in GENERATOR_BACKENDS,
         f"generator.backend={gen.backend!r} is not available here; choose one of {list(GENERATOR_BACKENDS)}")
    problems.extend(_generator_backend_problems(gen, loop))

    need(task.name in TASKS or task.name == CUSTOM,
         f"task.name={task.name!r} is not one of {sorted(TASKS)}, or custom (your own task: task=custom "
         "task.target=package.module:factory)")
    problems.extend(_task_problems(task))
    problems.extend(reward_term_problems(cfg.reward))
    if model.path is None and model.name != "tiny":
        problems.append(f"model={model.name} needs a checkpoint: set model.path=/path/to/hf/checkpoint "
                        "(a directory written by save_pretrained), or use model=tiny")
    need(not (gen.system_prompt and not gen.chat_template),
         "generator.system_prompt is set but generator.chat_template=false: a system message goes through the "
         "chat template; set generator.chat_template=true (an instruct model) or drop generator.system_prompt")
    need(not (gen.chat_template and model.path is None),
         "generator.chat_template=true needs a Hugging Face model whose tokenizer has a chat template: add "
         "model=hf model.path=/path/to/checkpoint (the built-in model's tokenizer has none)")
    if model.path is None:
        need(model.num_heads < 1 or model.hidden_size % model.num_heads == 0,
             f"model.hidden_size={model.hidden_size} must be divisible by model.num_heads={model.num_heads}")
        from replay_pipeline.models.tiny import MAX_POSITIONS  # start-up cost: transformers

        if task.name == "addition":  # prompt: <bos> a + b = (2 x digits + 3 tokens)
            longest = 2 * task.digits + 3 + gen.max_new_tokens
            need(longest <= MAX_POSITIONS,
                 f"generator.max_new_tokens={gen.max_new_tokens} with task.digits={task.digits} makes "
                 f"sequences of {longest} tokens, more than the built-in model's {MAX_POSITIONS} "
                 f"positions; lower generator.max_new_tokens to at most {MAX_POSITIONS - 2 * task.digits - 3}")
        need(task.name in ("addition", CUSTOM),
             f"task.name={task.name} needs a Hugging Face model: the built-in tiny model's tokenizer only "
             "knows the addition task's characters; add model=hf model.path=/path/to/checkpoint")
    need(DEVICE.fullmatch(str(model.device)) is not None,
         f"model.device={model.device!r} is not one of ['auto', 'cpu', 'cuda', 'cuda:N']; set "
         "model.device=auto (the GPU if there is one) or model.device=cpu")

    problems.extend(identity_problems(cfg))
    if problems:
        raise ConfigError.listing(problems)


def identity_problems(cfg: Any) -> list[str]:
    """What is wrong with run_id, resume and fork as written (names a path is made of): checked
    by `validate`, and on its own before a resume or fork reads the run it names."""
    problems = [f"{key}={value!r} may only hold letters, digits, '-' and '_'"
                for key in ("run_id", "resume") if (value := getattr(cfg, key, None)) is not None
                and re.fullmatch(r"[A-Za-z0-9_-]+", str(value)) is None]
    fork = getattr(cfg, "fork", None)
    if fork is not None and re.fullmatch(r"[A-Za-z0-9_-]+@[0-9]+", str(fork)) is None:
        problems.append(f"fork={fork!r} must be <run_id>@<step>, e.g. fork=20261129-171530-3fa2c1@100 "
                        "(a run's checkpoints are <root_dir>/<run_id>/checkpoints/step-NNNNNN)")
    return problems


#: The keys of one reward term (reward.terms.NAME.*).
TERM_KEYS = ("target", "weight", "args")


def reward_term_problems(reward: Any) -> list[str]:
    """What is wrong with reward.terms (each a mapping of target, weight, args) and
    reward.verifier_weight; whether a target imports is the pre-flight's."""
    terms = reward.terms
    terms = OmegaConf.to_container(terms, resolve=True) if isinstance(terms, DictConfig) else dict(terms or {})
    example = "+reward.terms.NAME.target=package.module:fn +reward.terms.NAME.weight=0.1"
    problems = []
    for name, term in terms.items():
        key = f"reward.terms.{name}"
        if re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", str(name)) is None:
            problems.append(f"{key}: a term's name is its metric score/term/NAME: letters, digits and '_', "
                            "starting with a letter")
        if not isinstance(term, dict):
            problems.append(f"{key}={term!r} must be a mapping of {', '.join(TERM_KEYS)}, e.g. {example}")
            continue
        extra = sorted(set(term) - set(TERM_KEYS))
        if extra:
            problems.append(f"{key} has unknown key(s) {extra}; a term has {', '.join(TERM_KEYS)}")
        target = term.get("target")
        if not isinstance(target, str) or ":" not in target.strip(":"):
            problems.append(f"{key}.target={target!r}: give the reward function as package.module:fn "
                            f"or /path/to/file.py:fn, e.g. {example}")
        weight = term.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            problems.append(f"{key}.weight={weight!r} must be a finite number (default 1)")
        if not isinstance(term.get("args", {}), dict):
            problems.append(f"{key}.args={term.get('args')!r} must be a mapping of keyword arguments "
                            f"({key}.args.NAME=VALUE)")
    if not terms and reward.verifier_weight == 0:
        problems.append("reward.verifier_weight=0 with no reward.terms makes every reward 0; keep it at 1, "
                        f"or add terms ({example})")
    return problems


def _engine_problems(loop: Any) -> list[str]:
    """loop.engine (where the async loop's generators run); whether ray is installed, and
    whether its cluster answers, is the pre-flight's."""
    if loop.engine == "dask":
        return [DASK_RETIRED]
    if loop.engine not in LOOP_ENGINES:
        return [f"loop.engine={loop.engine!r} is not one of {list(LOOP_ENGINES)}: `local` runs the generators "
                "as processes of the flow, `ray` as actors on a Ray cluster"]
    return []


def _learner_problems(learner: Any, loop: Any) -> list[str]:
    """The learner's ranks (learner.*): a backend torch.distributed has, an engine that can
    hold a rank, and a shard mode with ranks to shard over."""
    problems = []
    if learner.backend not in LEARNER_BACKENDS:
        problems.append(f"learner.backend={learner.backend!r} is not one of {list(LEARNER_BACKENDS)}")
    if learner.shard is not None and learner.shard not in LEARNER_SHARDS:
        problems.append(f"learner.shard={learner.shard!r} is not one of {[None, *LEARNER_SHARDS]}: null keeps the "
                        "whole model on every rank, fsdp2 shards it over the ranks")
    elif learner.shard is not None and learner.world_size < 2:
        problems.append(f"learner.shard={learner.shard} shards the model over the learner's ranks, and "
                        f"learner.world_size={learner.world_size} has one; add learner.world_size=2 (or more), "
                        "or drop learner.shard")
    if loop.engine == "ray" and loop.mode != "async" and learner.world_size == 1:
        problems.append("loop.engine=ray with the sync loop and one learner process places nothing on Ray: add "
                        "loop=async (generators as Ray actors) or learner.world_size=N (the learner's ranks as Ray "
                        "actors)")
    return problems


def _ray_problems(loop: Any, ray: Any) -> list[str]:
    """The `ray` section: used only with loop.engine=ray, an address as `ray start --head`
    prints it, the local instance's sizes only without an address. Whether ray is installed,
    the cluster answers and the generators' bundles fit is the pre-flight's."""
    defaults = RayConfig()
    if loop.engine != "ray":
        return [f"ray.{key}={getattr(ray, key)} is only used with loop.engine=ray; add loop.engine=ray or drop it"
                for key in ("address", "num_cpus", "num_gpus", "generator_python")
                if getattr(ray, key) != getattr(defaults, key)]
    problems = []
    if ray.address is not None:
        if not _RAY_ADDRESS.fullmatch(str(ray.address)):
            problems.append(f"ray.address={ray.address!r} is not a Ray head's address; give HOST:PORT as "
                            "`ray start --head` prints it, e.g. ray.address=10.0.0.5:6379, or drop it to start "
                            "a local instance")
        problems += [f"ray.{key}={getattr(ray, key)} sizes the local instance, which ray.address={ray.address} "
                     "replaces (a cluster's nodes declare their own resources: `ray start --num-cpus N`); drop it"
                     for key in ("num_cpus", "num_gpus") if getattr(ray, key) is not None]
    return problems


def _generator_backend_problems(gen: Any, loop: Any) -> list[str]:
    """The vLLM backend's settings (whether it can run here is the pre-flight's); vLLM-only
    settings with another backend."""
    defaults = GeneratorConfig()
    if gen.backend != "vllm":
        return [f"generator.{key}={getattr(gen, key)} is only used by generator.backend=vllm; drop it "
                "or add generator=vllm" for key in VLLM_ONLY_FIELDS if getattr(gen, key) != getattr(defaults, key)]
    problems = []
    if loop.mode == "async" and loop.engine == "local" and (loop.workers + 1) * gen.gpu_memory_utilization >= 1:
        engines = loop.workers + 1  # one per generator process, one in the learner's for evaluation
        problems.append(f"loop.workers={loop.workers} with generator.gpu_memory_utilization="
                        f"{gen.gpu_memory_utilization} would give {engines} vLLM engines (one per generator process, one in the learner's "
                        f"process for evaluation) {engines * gen.gpu_memory_utilization:g} of the GPU, leaving "
                        f"nothing for the learner; lower generator.gpu_memory_utilization below {1 / engines:.3g} "
                        "or loop.workers")
    if gen.dtype not in VLLM_DTYPES:
        problems.append(f"generator.dtype={gen.dtype!r} is not one of {list(VLLM_DTYPES)}")
    if not gen.rescore_top_p and gen.top_p < 1:
        problems.append(f"generator.top_p={gen.top_p} with generator.rescore_top_p=false would store vLLM's "
                        "nucleus-renormalised log-probs for training rollouts; set generator.rescore_top_p=true "
                        "or generator.top_p=1")
    return problems


def _task_problems(task: Any) -> list[str]:
    """What is wrong with the task section: fields of another task, the math task's settings
    (whether its data exists is the pre-flight's)."""
    fields = OmegaConf.to_container(task, resolve=True) if isinstance(task, DictConfig) else dict(vars(task))
    problems = [f"task.{key}={fields[key]} is not used by task.name={task.name}; drop it"
                + (" (the data fields are for task=gsm8k or task=math)" if task.name == "addition" else "")
                for key in unused_task_fields(str(task.name), fields, TASK_DEFAULTS)]
    if task.name == CUSTOM and not str(task.target or "").strip():
        problems.append("task.name=custom needs its factory: task.target=package.module:factory (on PYTHONPATH) "
                        "or task.target=/path/to/file.py:factory; replay_pipeline/tasks/template.py is an "
                        "example to copy")
    if task.name == "reasoning_gym":
        if not dataset_names(task.dataset):
            problems.append("task.name=reasoning_gym needs a dataset: task.dataset=NAME (e.g. chain_sum; several "
                            "in a list, [a,b], are mixed), e.g. python -m flows.train model=smollm2 task=reasoning_gym "
                            "task.dataset=chain_sum")
        if task.answer_fallback not in FALLBACKS:
            problems.append(f"task.answer_fallback={task.answer_fallback!r} must be null or last_number")
    if task.name != "math":
        return problems
    if task.path is None or not str(task.path).strip():
        problems.append("task.name=math needs its data: set task.path=/path/to/train.jsonl (a .jsonl, .json, "
                        ".parquet or .arrow file, a directory of them, or a datasets save_to_disk directory; "
                        "nothing is downloaded), e.g. python -m flows.train task=gsm8k "
                        "task.path=/data/gsm8k/train.jsonl model=hf model.path=/path/to/checkpoint")
    if task.format not in FORMATS:
        problems.append(f"task.format={task.format!r} is not one of {list(FORMATS)}")
    if task.answer_fallback not in FALLBACKS:
        problems.append(f"task.answer_fallback={task.answer_fallback!r} must be null or last_number")
    if task.prompt_template is not None and "{question}" not in str(task.prompt_template):
        problems.append("task.prompt_template has no {question} placeholder; put {question} where the problem goes")
    return problems


def buffer_storage_problems(buf: Any) -> list[str]:
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


#: An evaluation generating more completions than this with a pretrained model is worth a word.
LARGE_EVALUATION = 2048


def toy_default_warnings(cfg: Any) -> list[str]:
    """Defaults sized for the built-in model and addition task that a pretrained model
    (model.path set) would inherit without a word: the 6-token completion cap, which cuts a
    sentence off, and a sampled evaluation of thousands of completions before the first step.
    Warnings, not errors: a run may mean them."""
    if cfg.model.path is None:
        return []
    out = []
    if cfg.generator.max_new_tokens == GeneratorConfig().max_new_tokens:
        out.append(f"generator.max_new_tokens={cfg.generator.max_new_tokens} is the built-in addition task's "
                   "default: a pretrained model that answers in a sentence is cut off (finish_reason=length, "
                   "reward 0). Set generator.max_new_tokens for the task (experiment=smollm2_chain_sum uses 32)")
    loop = cfg.loop
    total = cfg.task.heldout_size * (1 + (loop.pass1_samples + loop.eval_samples if loop.passk_every > 0 else 0))
    if total > LARGE_EVALUATION:
        out.append(f"every evaluation generates {total} completions (task.heldout_size={cfg.task.heldout_size}"
                   + (f" x (1 greedy + loop.pass1_samples={loop.pass1_samples} + loop.eval_samples="
                      f"{loop.eval_samples})" if loop.passk_every > 0 else "")
                   + "), sized for the built-in model: with a pretrained model on a CPU that is many minutes "
                   "before the first step. Lower task.heldout_size, or loop.passk_every=0 for greedy accuracy only")
    return out
