"""The paper's Qwen3-0.6B preset runs end to end given a local Hugging Face checkpoint directory
and a local GSM8K-style file (issue 9): `python -m flows.train experiment=qwen3_0p6b
model.path=... task=gsm8k task.path=...`, with the transformers generator (no vLLM or GPU here)
and the batch scaled down so that a tiny random model runs it on a CPU. The checkpoint is a tiny
Llama written by save_pretrained with a character tokenizer covering the data; nothing is
downloaded. The preset's own numbers are checked in tests/unit/test_vllm_backend.py."""

from __future__ import annotations

import json
import os
import string
import subprocess
import sys


from replay_pipeline.buffer import RolloutStore
from replay_pipeline.models.tiny import build_tiny_model, build_tokenizer
from tests.conftest import ROOT


ROWS = [{"question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
         "answer": f"{a}+{b} = <<{a}+{b}={a + b}>>{a + b}.\n#### {a + b}"}
        for a, b in [(3, 4), (10, 5), (7, 8), (12, 30), (1, 1), (100, 250), (45, 55), (9, 9), (0, 6),
                     (21, 21), (33, 4), (600, 400), (2, 7), (8, 80), (5, 5), (6, 1)]]
SCALED_DOWN = ["loop.prompts_per_step=2", "loop.group_size=4", "loop.minibatch_size=8", "buffer.capacity=16",
               "generator.max_new_tokens=8", "task.heldout_size=4", "task.validation_size=2", "loop.steps=2",
               "loop.eval_every=0", "loop.eval_samples=2", "loop.checkpoint_every=0", "tracking.progress=false"]


def test_the_qwen3_preset_trains_from_a_local_checkpoint_on_a_local_gsm8k_file(tmp_path):
    tok = build_tokenizer(string.ascii_letters + string.digits + string.punctuation + " \n")
    checkpoint = tmp_path / "tiny-hf"
    model = build_tiny_model(tok, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    model.config.max_position_embeddings = 512  # the GSM8K template's prompts are ~190 characters
    model.save_pretrained(checkpoint)
    tok.save_pretrained(checkpoint)
    data = tmp_path / "gsm8k" / "train.jsonl"
    data.parent.mkdir()
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    root = tmp_path / "runs"
    cmd = [sys.executable, "-m", "flows.train", "experiment=qwen3_0p6b", f"model.path={checkpoint}",
           "generator=transformers", "task=gsm8k", f"task.path={data}", f"tracking.root_dir={root}",
           "run_id=qwen3-preset", *SCALED_DOWN]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PREFECT_HOME": str(root / ".prefect")},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Run qwen3-preset finished" in proc.stdout
    rows = RolloutStore.open(root / "lancedb", "qwen3-preset").window(10_000).to_pydict()
    assert len(rows["rollout_id"]) == 2 * 2 * 4  # 2 steps x 2 prompts x G = 4
    assert all("apples" in p for p in rows["prompt"])  # the GSM8K template over the file's questions
    assert all(len(ids) == len(lps) >= 1 for ids, lps in zip(rows["completion_ids"], rows["behaviour_logprobs"]))
    assert set(rows["reward"]) <= {0.0, 1.0}
    saved = (root / "qwen3-preset" / "config.yaml").read_text()
    assert "lr: 3.37e-07" in saved and "eps_low: 0.2" in saved  # the preset's optimiser settings held
