"""Pre-flight: the checks of a validated configuration that need I/O, run before any work.

`validate` (replay_pipeline/config/rules.py) is pure; what it cannot see without touching the
machine is checked here, and fails with one `ConfigError` that lists every problem with the
override that fixes it (flows.train turns it into exit code 2 before Prefect starts; a
deployed run fails in its first task, before any model is built):

- the run root can be written (`tracking.root_dir`);
- `model.path` is a Hugging Face checkpoint directory with weights and a tokenizer that loads
  and fits the model's vocabulary (with generator.chat_template, one that has a template), or
  a packaged model's directory (model.name `smollm2-135m-instruct`) still to be prepared,
  whose package is installed (the run prepares it after these checks); the math
  task's data files exist and read (fields, UTF-8, enough rows); a custom task's target
  and every reward term's function (reward.terms) import;
- a new run's `run_id` is not a run that exists; the root has room for the planned run
  (`planned_bytes`, a generous estimate);
- an MLflow tracking server (`tracking.mlflow_uri` over http) and a Prefect API
  (`PREFECT_API_URL`) answer within 3 s;
- `model.device` exists on this machine (a CUDA probe);
- the vLLM backend can run here (vllm installed and a GPU, without importing vllm);
- an object-store `buffer.uri` answers (one LIST request);
- `loop.engine=ray`: ray is installed; the cluster at `ray.address` answers (TCP, then joined
  and left), and the generators' bundles fit its nodes, or the local instance's CPUs and GPUs
  (replay_pipeline/run/ray_engine.py `check_placement`).

`check_start_point` finds and verifies the checkpoint and tables a resume or fork needs (a
resume's tables: no damaged file, no row lost before the checkpoint,
replay_pipeline/run/lineage.py `check_resume_tables`); the CLI runs it too before Prefect
starts (building the run does the same work again anyway, before the MLflow run is touched).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

from omegaconf import OmegaConf

from replay_pipeline.buffer import RolloutStore
from replay_pipeline.buffer.lance_table import StoreError, check_storage
from replay_pipeline.buffer.usage import UsageStore
from replay_pipeline.config import RAY_INSTALL, TASK_DEFAULTS, ConfigError
from replay_pipeline.generation import vllm_backend
from replay_pipeline.system.lease import LeaseHeld, holder
from replay_pipeline.models.device import device_problem, resolve_device
from replay_pipeline.models.packaged import PACKAGED, is_prepared, packaged_problems
from replay_pipeline.run.ray_engine import check_placement
from replay_pipeline.run.ray_ranks import rank_bundles
from replay_pipeline.run.lineage import check_resume_tables, start_point
from replay_pipeline.system.runs import RunPaths, ensure_writable
from replay_pipeline.tasks import CUSTOM, task_from_config
from replay_pipeline.tasks.custom import load_target


def preflight(cfg: Any) -> None:
    """Every I/O check of the module docstring; ConfigError (or PermissionError for an
    unwritable root) listing what to fix."""
    ensure_writable(cfg.tracking.root_dir)
    problems = [*_model_problems(cfg.model), *_chat_template_problems(cfg), *_task_problems(cfg.task),
                *_term_problems(cfg.reward), *_run_id_problems(cfg), *_server_problems(cfg), *_disk_problems(cfg)]
    device = device_problem(cfg.model.device)
    if device:
        problems.append(device)
    if cfg.generator.backend == "vllm":
        reason = vllm_backend.vllm_unavailable()  # read at call time (the tests stand in for a GPU)
        if reason:
            problems.append(f"generator.backend=vllm cannot run here: {reason}. {vllm_backend.VLLM_INSTALL}; or use "
                            "generator=transformers")
    if cfg.loop.engine == "ray" and importlib.util.find_spec("ray") is None:
        problems.append(f"loop.engine=ray needs ray, which is not installed: {RAY_INSTALL}")
    if problems:
        raise ConfigError.listing(problems)
    _probe_buffer_storage(cfg.buffer)
    if cfg.loop.engine == "ray":  # an unreachable cluster, or bundles that cannot fit, fail here
        check_placement(cfg, rank_bundles(cfg, resolve_device(cfg.model.device).type))


def _model_problems(model: Any) -> list[str]:
    if model.path is None:
        return []
    if _to_prepare(model):  # a packaged model the run prepares first (models/packaged.py)
        return packaged_problems(str(model.name))
    path = Path(os.path.expanduser(str(model.path)))
    if not path.is_dir():
        return [f"model.path={model.path} is not a directory; point it at a Hugging Face "
                "checkpoint directory (with config.json), or drop it to use the built-in model"]
    if not (path / "config.json").is_file():
        return [f"model.path={model.path} has no config.json; it must be a Hugging Face "
                "checkpoint directory as written by save_pretrained()"]
    problems = []
    if not any(path.glob("*.safetensors")) and not any(path.glob("pytorch_model*.bin")):
        problems.append(f"model.path={model.path} holds no weights (*.safetensors or pytorch_model*.bin); "
                        "save the model there with model.save_pretrained(dir)")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        problems.append(f"model.path={model.path} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                        "save it beside the model with tokenizer.save_pretrained(dir)")
    return problems or _vocabulary_problems(model.path, path)


def _vocabulary_problems(shown: Any, path: Path) -> list[str]:
    """The tokenizer's ids must fit the model's embedding (config.json vocab_size): a token id
    past it fails deep inside the first forward pass with an index error."""
    from replay_pipeline.models.loading import load_tokenizer  # start-up cost: transformers' tokenizers

    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return [f"model.path={shown}: config.json does not read as JSON ({exc}); write it again with "
                "model.save_pretrained(dir)"]
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    try:
        tokenizer = load_tokenizer(path)
    except Exception as exc:  # noqa: BLE001 - whatever the tokenizer files hold, said in one line
        return [f"model.path={shown}: its tokenizer does not load ({type(exc).__name__}: "
                f"{' '.join(str(exc).split())[:200]}); save it again with tokenizer.save_pretrained(dir)"]
    if isinstance(size, int) and len(tokenizer) > size:
        return [f"model.path={shown}: the tokenizer has {len(tokenizer)} tokens but the model's embedding only "
                f"{size} rows (config.json vocab_size), so token ids {size}..{len(tokenizer) - 1} would index past "
                "it; save the tokenizer the model was trained with, or resize the embedding "
                "(model.resize_token_embeddings(len(tokenizer)); model.save_pretrained(dir))"]
    return []


def _chat_template_problems(cfg: Any) -> list[str]:
    """generator.chat_template=true: the model directory's tokenizer has a chat template (in
    tokenizer_config.json, or a chat_template.jinja / chat_template.json beside it)."""
    if not getattr(cfg.generator, "chat_template", False) or cfg.model.path is None or _to_prepare(cfg.model):
        return []
    path = Path(os.path.expanduser(str(cfg.model.path)))
    if any((path / name).is_file() for name in ("chat_template.jinja", "chat_template.json")):
        return []
    try:
        held = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError):
        held = None
    if held:
        return []
    return [f"generator.chat_template=true, but the tokenizer in model.path={cfg.model.path} has no chat template "
            "(none in tokenizer_config.json, no chat_template.jinja); use an instruction-tuned model's "
            "directory, save one with tokenizer.chat_template = ...; tokenizer.save_pretrained(dir), or set "
            "generator.chat_template=false"]


def _to_prepare(model: Any) -> bool:
    """Whether model.path is a packaged model's directory not prepared yet: the run makes it
    (build_run, ensure_prepared) after these checks, which then only ask whether it can."""
    return str(model.name) in PACKAGED and not is_prepared(os.path.expanduser(str(model.path)))


#: Files of which a Hugging Face tokenizer directory holds at least one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def planned_bytes(cfg: Any) -> int:
    """A generous estimate of what the run will write under its root: the rollout rows (token
    ids and log-probs, 8 bytes a token, plus ~400 bytes of text and metadata), the usage
    records (~120 bytes each), and loop.keep_checkpoints checkpoints (weights and two Adam
    moments, 12 bytes a parameter; a Hugging Face model's weight files give its size); the
    tables four times over, for versions not yet compacted and indexes (measured: a 300-step
    baseline run's tables take about 50 MB, 2.6 kB a rollout; this says 2.1 kB)."""
    loop, gen, model = cfg.loop, cfg.generator, cfg.model
    if model.path is not None:
        path = Path(os.path.expanduser(str(model.path)))
        weights = sum(f.stat().st_size for f in path.glob("*.safetensors")) + \
            sum(f.stat().st_size for f in path.glob("pytorch_model*.bin"))
        checkpoint, prompt_tokens = 3 * weights, 512
    else:
        h, layers, inner = model.hidden_size, model.num_layers, model.intermediate_size
        checkpoint = 12 * (layers * (4 * h * h + 3 * h * inner) + 2 * 64 * h)
        prompt_tokens = 2 * int(cfg.task.get("digits", 3)) + 3
    rollouts = loop.steps * loop.prompts_per_step * loop.group_size
    rows = rollouts * (8 * (prompt_tokens + gen.max_new_tokens) + 400)
    usage = loop.steps * loop.updates_per_step * loop.minibatch_size * 120
    return int(4 * (rows + usage) + checkpoint * (loop.keep_checkpoints + 1))


def _disk_problems(cfg: Any) -> list[str]:
    """The run's root must have room for the planned run (`planned_bytes`)."""
    need = planned_bytes(cfg)
    free = shutil.disk_usage(ensure_writable(cfg.tracking.root_dir)).free
    if need <= free:
        return []
    return [f"tracking.root_dir={cfg.tracking.root_dir} has {free / 1e9:.2f} GB free; the planned run needs about "
            f"{need / 1e9:.2f} GB (loop.steps={cfg.loop.steps}, its rollouts, usage records and "
            f"{cfg.loop.keep_checkpoints} checkpoints); free space, lower loop.steps or loop.keep_checkpoints, "
            "or choose a root on a larger disk"]


def _run_id_problems(cfg: Any) -> list[str]:
    """A new run (or fork) whose run_id names a run that exists under the root."""
    if cfg.resume is not None or not cfg.run_id:
        return []
    existing = RunPaths.make(cfg.tracking.root_dir, cfg.run_id).run_dir / "config.yaml"
    if not existing.is_file():
        return []
    live = holder(existing.parent)
    if live is not None:  # a live run: say who drives it (replay_pipeline/system/lease.py)
        return [str(LeaseHeld(existing.parent, live))]
    return [f"run_id={cfg.run_id} is a run that exists ({existing.parent}); continue it with "
            f"resume={cfg.run_id}, or give the new run another run_id (or none: a fresh one is made)"]


def _server_problems(cfg: Any, timeout: float = 3.0) -> list[str]:
    """An MLflow tracking server (tracking.mlflow_uri over http) and a Prefect API
    (PREFECT_API_URL) must answer within `timeout` seconds: nothing listening there would
    otherwise be retried for minutes after the run had started."""
    targets = []
    uri = str(cfg.tracking.mlflow_uri or "")
    if uri.startswith(("http://", "https://")):
        targets.append(("tracking.mlflow_uri", uri, uri.rstrip("/") + "/health"))
    prefect = os.environ.get("PREFECT_API_URL", "")
    if prefect.startswith(("http://", "https://")):
        targets.append(("PREFECT_API_URL", prefect, prefect.rstrip("/") + "/health"))
    problems = []
    for name, where, health in targets:
        try:
            with urllib.request.urlopen(health, timeout=timeout):
                pass
        except urllib.error.HTTPError:
            pass  # something answers there: the server's own error says more later
        except (OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            problems.append(f"{name}={where} does not answer within {timeout:.0f} s ({reason}); start the server, "
                            f"or fix the address" + (" (unset PREFECT_API_URL to use a temporary local server)"
                                                     if name == "PREFECT_API_URL" else
                                                     " (unset tracking.mlflow_uri for <root>/mlflow.db)"))
    return problems


def _task_problems(task: Any) -> list[str]:
    problems = [f"task.{key}={getattr(task, key)} does not exist; give a local file or directory"
                for key in ("path", "heldout_path")
                if getattr(task, key, None) is not None and str(getattr(task, key)).strip()
                and not Path(os.path.expanduser(str(getattr(task, key)))).exists()]
    if task.name == CUSTOM and task.target:
        try:  # importable here (a resume whose task module is gone is refused here too)
            load_target(task.target)
        except ValueError as exc:
            problems.append(str(exc))
    if task.name in ("math", "reasoning_gym") and not problems:
        try:  # its data read (math) or its datasets and settings checked (reasoning_gym) now
            task_from_config(OmegaConf.to_container(task, resolve=True), TASK_DEFAULTS)
        except ValueError as exc:
            problems.append(str(exc))
    return problems


def _term_problems(reward: Any) -> list[str]:
    """Each reward term's function imports here (a resume whose module is gone is refused too)."""
    problems = []
    for name, term in (reward.terms or {}).items():
        try:
            load_target(term.target, key=f"reward.terms.{name}.target")
        except ValueError as exc:
            problems.append(str(exc))
    return problems


def _probe_buffer_storage(buf: Any) -> None:
    """An object-store buffer.uri must be reachable before any work starts (bucket, endpoint,
    credentials); one LIST request (replay_pipeline.buffer.lance_table.check_storage)."""
    uri = "" if buf.uri is None else str(buf.uri)
    if "://" not in uri or uri.startswith("file://"):
        return
    try:
        check_storage(uri, buf.storage_options)
    except StoreError as exc:
        raise ConfigError(f"Invalid configuration: buffer.uri={uri}: {exc}") from exc


def check_start_point(cfg: Any, log: Callable[[str], Any] = print) -> None:
    """Find (and verify) the checkpoint a resume or fork needs, and check the tables it will
    open (a missing table or a schema mismatch is refused, the table left untouched)."""
    mode = "resume" if cfg.resume else "fork"
    paths = RunPaths.make(cfg.tracking.root_dir, cfg.resume or cfg.run_id or "pending-fork")
    found, lineage = start_point(cfg, mode, paths, log=log)
    if found is None and mode == "resume":
        return  # no checkpoint yet: the run restarts from step 0 and opens (or creates) its tables
    table_run = cfg.resume if mode == "resume" else cfg.fork.partition("@")[0]
    uri = cfg.buffer.uri or str(paths.lancedb)
    opts = cfg.buffer.storage_options  # an unreachable object store was refused by preflight
    store = RolloutStore.open(uri, table_run, storage_options=opts)
    usage = UsageStore.open(uri, table_run, storage_options=opts)
    if mode == "resume" and not lineage.get("fork_restart"):
        # damaged files (the repair command) or rows lost before the checkpoint (the fork to take)
        check_resume_tables(store, usage, found[1], cfg.loop.mode == "async", paths.checkpoints, log=log, deep=True)
