"""Make a packaged pretrained model a Hugging Face directory: python -m flows.prepare_model.

    python -m flows.prepare_model smollm2-135m-instruct              # into runs/cache/models/
    python -m flows.prepare_model smollm2-135m-instruct --root /data/runs
    python -m flows.prepare_model smollm2-135m-instruct --out /models/smollm2 --force

Converts the GGUF file the model's package ships (replay_pipeline/models/packaged.py) into a
standard directory (config.json, model.safetensors, tokenizer, chat template), verifies it
and prints its path; a second call finds it prepared and only prints. `model=smollm2` runs
read it from `<tracking.root_dir>/cache/models/smollm2-135m-instruct` and prepare it there
themselves when it is missing; this command does it ahead of time, or somewhere else
(`--out`, then `model=hf model.path=DIR`). Errors (package not installed, unknown name) go to
stderr with exit status 2 and say what to install.
"""

from __future__ import annotations

import argparse
import json
import sys

import flows  # noqa: F401  (the package's environment defaults)
from replay_pipeline.models.packaged import PACKAGED, cache_dir, prepare


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flows.prepare_model",
        description="Convert a pretrained model shipped as a Python package (a GGUF file) into a verified "
                    "Hugging Face checkpoint directory, once.")
    parser.add_argument("name", choices=sorted(PACKAGED), help="the packaged model")
    parser.add_argument("--root", default="runs",
                        help="run root whose cache/models/ holds it (tracking.root_dir; default: runs)")
    parser.add_argument("--out", default=None, help="write it here instead of the run root's cache")
    parser.add_argument("--force", action="store_true", help="convert again even if it is prepared")
    parser.add_argument("--json", action="store_true", help="print the preparation record as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    target = args.out or cache_dir(args.root, args.name)
    log = (lambda line: print(line, file=sys.stderr)) if args.json else print
    try:
        record = prepare(args.name, target, force=args.force, log=log)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"path": str(target), **record}, indent=2))
    else:
        facts = record["verified"]
        print(f"{args.name}: {target}")
        print(f"  {facts['layers']} layers, hidden {facts['hidden_size']}, vocab {facts['vocab_size']}, "
              f"{facts['parameters'] / 1e6:.1f}M parameters, tied embeddings; eos {facts['eos_token']} "
              f"(id {facts['eos_id']}) pads; chat template {facts['chat_template']}; one token a digit")
        print(f"  train on it: python -m flows.train model=smollm2 tracking.root_dir={args.root}"
              if not args.out else f"  train on it: python -m flows.train model=hf model.path={target} "
                                   "generator.chat_template=true")
    return 0


if __name__ == "__main__":
    sys.exit(main())
