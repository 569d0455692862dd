r"""The math task on real files: GSM8K- and MATH-style problems written by the tests as JSONL,
JSON, Parquet, Arrow (a datasets cache layout) and datasets save_to_disk directories; splits,
prompts, rewards, bad input, and the config presets (task=gsm8k / task=math).

Nothing is downloaded and no model runs: the tasks are for Hugging Face models (model=hf),
which the tests cannot fetch, and the built-in tiny model only knows addition.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from replay_pipeline.config import TASK_DEFAULTS, ConfigError, load_config
from replay_pipeline.tasks import TASKS, AdditionTask, MathTask, Task, task_from_config
from replay_pipeline.tasks.math import GSM8K_TEMPLATE, MATH_TEMPLATE, prompt_id

GSM8K_ROWS = [
    {"question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
     "answer": f"Tom has {a} apples.\nHe buys {b} more, so {a}+{b} = <<{a}+{b}={a + b}>>{a + b}.\n#### {a + b}"}
    for a, b in [(3, 4), (10, 5), (7, 8), (12, 30), (1, 1), (100, 250), (45, 55), (9, 9), (0, 6),
                 (21, 21), (33, 4), (600, 400), (2, 7), (8, 80)]
]
GSM8K_ROWS[5]["answer"] = "100 + 250 = 350 apples.\n#### 350"
GSM8K_ROWS[11]["answer"] = "600 + 400 = 1000.\n#### 1,000"  # a reference with a thousands separator

MATH_ROWS = [
    {"problem": r"Compute $\frac{1}{2} + 0$.", "solution": r"It is $\boxed{\frac{1}{2}}$."},
    {"problem": r"Simplify $\sqrt{8}$.", "solution": r"$\sqrt{8} = \boxed{2\sqrt{2}}$."},
    {"problem": r"Solve $x^2 = 4$ for $x > 0$.", "solution": r"So $x = \boxed{2}$."},
    {"problem": r"Find the point where $y = x$ meets $y = 2$.", "solution": r"It is $\boxed{(2, 2)}$."},
    {"problem": r"Write $\{1, 2\}$ in order.", "solution": r"The set is $\boxed{\{1, 2\}}$."},
    {"problem": r"What is $3^{2}$?", "solution": r"$3^{2} = \boxed{9}$."},
    {"problem": r"Expand $(x+1)^2$.", "solution": r"$\boxed{x^{2} + 2x + 1}$"},
    {"problem": r"What is $\pi$ rounded down?", "solution": r"$\boxed{3}$"},
    {"problem": r"Compute $\frac{3}{4}$ as a decimal.", "solution": r"$\boxed{0.75}$"},
    {"problem": r"How many degrees in a right angle?", "solution": r"$\boxed{90^\circ}$"},
    {"problem": r"What is $\sqrt{\frac{1}{4}}$?", "solution": r"$\boxed{\frac{1}{2}}$"},
    {"problem": r"Compute $2^{10}$.", "solution": r"$2^{10} = \boxed{1024}$."},
    {"problem": r"Give the interval where $0 \le x < 1$.", "solution": r"$\boxed{[0, 1)}$"},
]
SIZES = {"heldout_size": 4, "validation_size": 3}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_arrow_stream(path: Path, rows: list[dict]) -> Path:
    """An Arrow IPC stream file, as datasets writes its cache files."""
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return path


def layout(kind: str, root: Path, rows: list[dict]) -> Path:
    if kind == "jsonl":
        return write_jsonl(root / "train.jsonl", rows)
    if kind == "json":
        path = root / "train.json"
        path.write_text(json.dumps(rows))
        return path
    if kind == "json_object":
        path = root / "train.json"
        path.write_text(json.dumps({"data": rows}))
        return path
    if kind == "parquet":
        return write_parquet(root / "train.parquet", rows)
    if kind == "save_to_disk":
        import datasets

        datasets.Dataset.from_list(rows).save_to_disk(str(root / "saved"))
        return root / "saved"
    if kind == "dataset_dict":
        import datasets

        datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                              "test": datasets.Dataset.from_list(rows[:2])}).save_to_disk(str(root / "dd"))
        return root / "dd"
    if kind == "cache_dir":  # ~/.cache/huggingface/datasets/<name>/<config>/<version>/<hash>/
        folder = root / "cache" / "main" / "0.0.0" / "abc123"
        write_arrow_stream(folder / "gsm8k-train.arrow", rows)
        write_arrow_stream(folder / "gsm8k-test.arrow", rows[:2])
        (folder / "dataset_info.json").write_text("{}")
        return folder
    if kind == "hub_snapshot":  # parquet shards per split
        folder = root / "snapshot"
        half = len(rows) // 2
        write_parquet(folder / "main" / "train-00000-of-00002.parquet", rows[:half])
        write_parquet(folder / "main" / "train-00001-of-00002.parquet", rows[half:])
        write_parquet(folder / "main" / "test-00000-of-00001.parquet", rows[:2])
        return folder
    raise AssertionError(kind)


LAYOUTS = ["jsonl", "json", "json_object", "parquet", "save_to_disk", "dataset_dict", "cache_dir", "hub_snapshot"]


def ids(prompts) -> list[str]:
    return [p.prompt_id for p in prompts]


# ---------------------------------------------------------------------------- loading and splits

@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize(("rows", "style"), [(GSM8K_ROWS, "gsm8k"), (MATH_ROWS, "math")], ids=["gsm8k", "math"])
def test_every_layout_gives_the_same_disjoint_splits(tmp_path, kind, rows, style):
    reference = MathTask(path=str(layout("jsonl", tmp_path / "ref", rows)), **SIZES)
    task = MathTask(path=str(layout(kind, tmp_path, rows)), **SIZES)
    assert isinstance(task, Task) and task.style == style  # format "auto" told them apart
    held, val, train = ids(task.heldout_prompts()), ids(task.validation_prompts()), ids(task.all_train_prompts())
    assert (len(held), len(val), len(train)) == (4, 3, len(rows) - 7)
    assert not (set(held) & set(val)) and not (set(held) & set(train)) and not (set(val) & set(train))
    assert set(held) | set(val) | set(train) == {prompt_id(r.get("question") or r["problem"], style) for r in rows}
    # The split depends on the problems, not on the file type or the row order.
    assert (held, val, train) == (ids(reference.heldout_prompts()), ids(reference.validation_prompts()),
                                  ids(reference.all_train_prompts()))


def test_splits_are_deterministic_and_stable(tmp_path):
    path = str(write_jsonl(tmp_path / "g.jsonl", GSM8K_ROWS))
    a, b = MathTask(path=path, **SIZES), MathTask(path=path, **SIZES)
    assert a.heldout_prompts() == b.heldout_prompts() and a.validation_prompts() == b.validation_prompts()
    shuffled = MathTask(path=str(write_jsonl(tmp_path / "s.jsonl", GSM8K_ROWS[::-1])), **SIZES)
    assert shuffled.heldout_prompts() == a.heldout_prompts()
    # The held-out set does not move when the validation size or the training cap change.
    assert MathTask(path=path, heldout_size=4, validation_size=1).heldout_prompts() == a.heldout_prompts()
    capped = MathTask(path=path, max_prompts=2, **SIZES)
    assert capped.heldout_prompts() == a.heldout_prompts() and len(capped.all_train_prompts()) == 2
    assert set(ids(capped.all_train_prompts())) <= set(ids(a.all_train_prompts()))
    other_seed = MathTask(path=path, split_seed=99, **SIZES)
    assert ids(other_seed.heldout_prompts()) != ids(a.heldout_prompts())
    # Training prompts: drawn from the training pool only, reproducibly from the rng.
    draw = a.train_prompts(50, np.random.default_rng(0))
    assert draw == a.train_prompts(50, np.random.default_rng(0))
    assert set(ids(draw)) <= set(ids(a.all_train_prompts()))
    assert a.train_prompts(0, np.random.default_rng(0)) == []


def test_repeated_questions_are_kept_once(tmp_path):
    rows = GSM8K_ROWS + [dict(GSM8K_ROWS[0]), {**GSM8K_ROWS[1], "question": "  " + GSM8K_ROWS[1]["question"] + " "}]
    task = MathTask(path=str(write_jsonl(tmp_path / "g.jsonl", rows)), **SIZES)
    every = ids(task.heldout_prompts() + task.validation_prompts() + task.all_train_prompts())
    assert len(every) == len(set(every)) == len(GSM8K_ROWS)


def test_heldout_path_is_the_test_set_and_never_trained_on(tmp_path):
    train_rows, test_rows = GSM8K_ROWS[:10], GSM8K_ROWS[9:]  # row 9 is in both files
    task = MathTask(path=str(write_jsonl(tmp_path / "train.jsonl", train_rows)),
                    heldout_path=str(write_jsonl(tmp_path / "test.jsonl", test_rows)),
                    heldout_size=3, validation_size=2)
    test_ids = {prompt_id(r["question"], "gsm8k") for r in test_rows}
    assert set(ids(task.heldout_prompts())) <= test_ids and len(task.heldout_prompts()) == 3
    train_pool = set(ids(task.validation_prompts() + task.all_train_prompts()))
    assert not (train_pool & test_ids) and len(train_pool) == 9  # the shared problem left training


def test_dataset_dict_and_split_directories_read_the_named_split(tmp_path):
    dd = layout("dataset_dict", tmp_path, GSM8K_ROWS)
    task = MathTask(path=str(dd), heldout_path=str(dd), heldout_size=2, validation_size=1)
    assert set(ids(task.heldout_prompts())) == {prompt_id(r["question"], "gsm8k") for r in GSM8K_ROWS[:2]}
    cache = layout("cache_dir", tmp_path, GSM8K_ROWS)
    task = MathTask(path=str(cache), heldout_path=str(cache), heldout_size=2, validation_size=1)
    assert len(task.all_train_prompts()) == len(GSM8K_ROWS) - 2 - 1


# ---------------------------------------------------------------------------- prompts and references

def test_prompts_use_the_formats_template_and_references_are_extracted(tmp_path):
    g = MathTask(path=str(write_jsonl(tmp_path / "g.jsonl", GSM8K_ROWS)), **SIZES)
    m = MathTask(path=str(write_jsonl(tmp_path / "m.jsonl", MATH_ROWS)), **SIZES)
    by_q = {r["question"]: r for r in GSM8K_ROWS}
    for p in g.heldout_prompts() + g.all_train_prompts():
        question = p.text.split("Question: ", 1)[1].split("\n", 1)[0]
        assert p.text == GSM8K_TEMPLATE.replace("{question}", question) and "####" in p.text
        assert p.answer == by_q[question]["answer"].rsplit("#### ", 1)[1]
    references = {p.text: p.answer for p in m.heldout_prompts() + m.validation_prompts() + m.all_train_prompts()}
    text = MATH_TEMPLATE.replace("{question}", MATH_ROWS[4]["problem"])
    assert "\\boxed{}" in text and references[text] == r"\{1, 2\}"  # nested braces in the box
    assert references[MATH_TEMPLATE.replace("{question}", MATH_ROWS[0]["problem"])] == r"\frac{1}{2}"


def test_custom_template_columns_and_answer_column(tmp_path):
    rows = [{"q": f"What is {i} plus {i}?", "final": 2 * i, "solution": f"\\boxed{{{999}}}"} for i in range(12)]
    task = MathTask(path=str(write_jsonl(tmp_path / "c.jsonl", rows)), format="math", question_field="q",
                    answer_field="final", prompt_template="<problem>{question}</problem>\n", **SIZES)
    p = task.heldout_prompts()[0]
    i = int(p.text.split("What is ")[1].split(" ")[0])
    assert p.text == f"<problem>What is {i} plus {i}?</problem>\n" and p.answer == str(2 * i)
    assert task.reward(p, f"so \\boxed{{{2 * i}}}", "stop") == 1.0
    # A MATH file with an explicit answer column: the column wins over the solution's box.
    math_rows = [{**r, "answer": "42"} for r in MATH_ROWS]
    task = MathTask(path=str(write_jsonl(tmp_path / "a.jsonl", math_rows)), **SIZES)
    assert {p.answer for p in task.heldout_prompts()} == {"42"}


# ---------------------------------------------------------------------------- rewards

@pytest.fixture(scope="module")
def gsm8k_task(tmp_path_factory) -> MathTask:
    return MathTask(path=str(write_jsonl(tmp_path_factory.mktemp("g") / "g.jsonl", GSM8K_ROWS)),
                    heldout_size=13, validation_size=0)


def prompt_with_answer(task: MathTask, answer: str):
    return next(p for p in task.heldout_prompts() + task.all_train_prompts() if p.answer == answer)


@pytest.mark.parametrize(("completion", "finish", "expected"), [
    ("3 + 4 = 7.\n#### 7", "stop", 1.0),
    ("#### 7.00", "stop", 1.0),
    ("#### $7", "stop", 1.0),
    ("#### 7 apples", "stop", 1.0),
    ("so \\boxed{7}", "stop", 1.0),                          # the other marker counts too
    ("#### 8", "stop", 0.0),
    ("The answer is 7.", "stop", 0.0),                       # no final-answer marker
    ("", "stop", 0.0),
    ("#### 7\nQuestion: what is 1+1?\nAnswer: #### 2", "length", 1.0),  # cut at the next turn
    ("#### 7\nI am done.", "length", 1.0),                   # complete answer before the cap
    ("4 + 3 = #### 7", "length", 0.0),                       # runs into the cap: maybe "#### 70"
    ("#### 8\n#### 7", "stop", 1.0),                         # the last marker
])
def test_gsm8k_reward(gsm8k_task, completion, finish, expected):
    assert gsm8k_task.reward(prompt_with_answer(gsm8k_task, "7"), completion, finish) == expected


def test_thousands_separator_reference(gsm8k_task):
    p = prompt_with_answer(gsm8k_task, "1,000")
    assert gsm8k_task.reward(p, "#### 1000", "stop") == 1.0
    assert gsm8k_task.reward(p, "#### 1,000.0", "stop") == 1.0
    assert gsm8k_task.reward(p, "#### 100", "stop") == 0.0


def test_fallback_and_truncation_options(tmp_path):
    path = str(write_jsonl(tmp_path / "g.jsonl", GSM8K_ROWS))
    lenient = MathTask(path=path, answer_fallback="last_number", heldout_size=13, validation_size=0)
    strict = MathTask(path=path, score_truncated=False, heldout_size=13, validation_size=0)
    p = prompt_with_answer(lenient, "7")
    assert lenient.reward(p, "3 + 4 = 7 apples in all.", "stop") == 1.0
    assert lenient.extract("3 + 4 = 7 apples in all.") == "7"
    assert strict.reward(p, "#### 7\nI am done.", "length") == 0.0
    assert strict.reward(p, "#### 7", "stop") == 1.0


@pytest.mark.parametrize(("problem", "completion", "expected"), [
    (0, r"so the answer is $\boxed{0.5}$", 1.0),
    (0, r"$\boxed{\dfrac{1}{2}}$", 1.0),
    (0, r"$\boxed{\frac{1}{2}$", 0.0),                  # unclosed box: no answer
    (1, r"$\boxed{\sqrt{8}}$", 1.0),                    # symbolic equivalence
    (1, r"$\boxed{2.828}$", 0.0),
    (3, r"$\boxed{(2,2)}$", 1.0),
    (4, r"$\boxed{\{2, 1\}}$", 1.0),
    (6, r"$\boxed{(x+1)^2}$", 1.0),
    (6, r"$\boxed{x^2+1}$", 0.0),
    (9, r"$\boxed{90}$ degrees", 1.0),
    (12, r"$\boxed{[0,1)}$", 1.0),
    (12, r"$\boxed{(0,1)}$", 0.0),
    (2, "Problem: next one\n\\boxed{2}", 0.0),           # the answer belongs to an invented turn
])
def test_math_reward(tmp_path, problem, completion, expected):
    task = MathTask(path=str(write_jsonl(tmp_path / "m.jsonl", MATH_ROWS)), heldout_size=12, validation_size=0)
    pid = prompt_id(MATH_ROWS[problem]["problem"], "math")
    prompt = next(p for p in task.heldout_prompts() + task.all_train_prompts() if p.prompt_id == pid)
    assert task.reward(prompt, completion, "stop") == expected


# ---------------------------------------------------------------------------- bad input

def _bad(tmp_path: Path, name: str) -> dict:
    g = str(write_jsonl(tmp_path / "g.jsonl", GSM8K_ROWS))
    if name == "missing_file":
        return {"path": str(tmp_path / "nope.jsonl")}
    if name == "no_path":
        return {"path": None}
    if name == "unknown_format":
        return {"path": g, "format": "aime"}
    if name == "missing_column":
        return {"path": g, "format": "math", "question_field": "problem"}
    if name == "missing_override_column":
        return {"path": g, "answer_field": "final"}
    if name == "empty_file":
        (tmp_path / "e.jsonl").write_text("\n")
        return {"path": str(tmp_path / "e.jsonl")}
    if name == "too_few_rows":
        return {"path": g, "heldout_size": 10, "validation_size": 4}
    if name == "bad_json_line":
        (tmp_path / "b.jsonl").write_text(json.dumps(GSM8K_ROWS[0]) + "\n{not json\n")
        return {"path": str(tmp_path / "b.jsonl")}
    if name == "not_utf8":  # latin-1 bytes on line 2
        (tmp_path / "l.jsonl").write_bytes((json.dumps(GSM8K_ROWS[0]) + "\n").encode() + b'{"question": "caf\xe9"}\n')
        return {"path": str(tmp_path / "l.jsonl")}
    if name == "unsupported_extension":
        (tmp_path / "g.csv").write_text("question,answer\n")
        return {"path": str(tmp_path / "g.csv")}
    if name == "empty_directory":
        (tmp_path / "empty").mkdir()
        return {"path": str(tmp_path / "empty")}
    if name == "missing_split":
        return {"path": str(layout("dataset_dict", tmp_path, GSM8K_ROWS)), "split": "validation"}
    if name == "missing_split_files":
        return {"path": str(layout("cache_dir", tmp_path, GSM8K_ROWS)), "split": "validation"}
    if name == "heldout_too_small":
        return {"path": g, "heldout_path": str(write_jsonl(tmp_path / "t.jsonl", GSM8K_ROWS[:2])), "heldout_size": 5}
    if name == "template_without_question":
        return {"path": g, "prompt_template": "Solve it."}
    if name == "ambiguous_columns":
        return {"path": str(write_jsonl(tmp_path / "p.jsonl", [{"question": "1+1?", "answer": "2"}] * 3))}
    if name == "no_usable_rows":
        return {"path": str(write_jsonl(tmp_path / "n.jsonl", [{"question": "", "answer": "#### 1"}] * 3))}
    if name == "bad_sizes":
        return {"path": g, "heldout_size": 0}
    if name == "bad_fallback":
        return {"path": g, "answer_fallback": "first_number"}
    raise AssertionError(name)


@pytest.mark.parametrize(("name", "needle"), [
    ("missing_file", "does not exist"),
    ("no_path", "task.path"),
    ("unknown_format", "task.format"),
    ("missing_column", "task.question_field"),
    ("missing_override_column", "task.answer_field"),
    ("empty_file", "no rows"),
    ("too_few_rows", "lower those sizes"),
    ("bad_json_line", "line 2"),
    ("not_utf8", "l.jsonl line 2 is not UTF-8 (byte 0xe9"),
    ("unsupported_extension", "unsupported extension"),
    ("empty_directory", "without data files"),
    ("missing_split", "task.split"),
    ("missing_split_files", "task.split"),
    ("heldout_too_small", "task.heldout_size"),
    ("template_without_question", "{question}"),
    ("ambiguous_columns", "task.format=gsm8k"),
    ("no_usable_rows", "task.question_field"),
    ("bad_sizes", "task.heldout_size"),
    ("bad_fallback", "task.answer_fallback"),
])
def test_bad_input_fails_at_construction_saying_how_to_fix(tmp_path, name, needle):
    kwargs = {**SIZES, **_bad(tmp_path, name)}
    with pytest.raises(ValueError) as err:
        MathTask(**kwargs)
    assert needle in str(err.value)


def test_plain_answers_work_with_an_explicit_format(tmp_path):
    rows = [{"question": f"What is {i}+1?", "answer": str(i + 1)} for i in range(10)]
    task = MathTask(path=str(write_jsonl(tmp_path / "p.jsonl", rows)), format="gsm8k",
                    heldout_size=3, validation_size=2)
    p = task.heldout_prompts()[0]
    assert task.reward(p, f"#### {p.answer}", "stop") == 1.0


def test_rows_without_a_reference_are_skipped_with_a_warning(tmp_path):
    rows = GSM8K_ROWS + [{"question": "Unanswered?", "answer": "####"}, {"question": None, "answer": "#### 3"}]
    with pytest.warns(UserWarning, match="skipped 2 of"):
        task = MathTask(path=str(write_jsonl(tmp_path / "g.jsonl", rows)), **SIZES)
    assert len(task.all_train_prompts()) == len(GSM8K_ROWS) - 7


# ---------------------------------------------------------------------------- config

@pytest.fixture()
def hf_dir(tmp_path) -> Path:
    """A directory that passes config validation as a Hugging Face checkpoint (never loaded)."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"")  # the pre-flight looks for weights
    (tmp_path / "ckpt" / "tokenizer_config.json").write_text("{}")  # and a tokenizer
    return tmp_path / "ckpt"


@pytest.mark.parametrize(("preset", "rows", "style", "tokens"), [
    ("gsm8k", GSM8K_ROWS, "gsm8k", 512), ("math", MATH_ROWS, "math", 1024)])
def test_presets_compose_with_a_path_and_build_the_task(tmp_path, hf_dir, preset, rows, style, tokens):
    from replay_pipeline.run.resume import resolve_config
    from omegaconf import OmegaConf

    data = write_jsonl(tmp_path / "train.jsonl", rows)
    cfg = resolve_config([f"task={preset}", f"task.path={data}", "task.heldout_size=4", "task.validation_size=3",
                          "model=hf", f"model.path={hf_dir}"])
    assert cfg.task.name == "math" and cfg.task.format == style and cfg.generator.max_new_tokens == tokens
    task = task_from_config(OmegaConf.to_container(cfg.task, resolve=True), TASK_DEFAULTS)
    assert isinstance(task, MathTask) and task.style == style and len(task.heldout_prompts()) == 4


@pytest.mark.parametrize(("overrides", "needle"), [
    (["task=gsm8k"], "task.path"),
    (["task=math"], "task.path"),
    (["task=gsm8k", "task.format=aime"], "task.format"),
    (["task.path=/tmp"], "not used by task.name=addition"),
    (["task.format=math"], "task.format"),
])
def test_invalid_math_configuration_says_how_to_fix(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config(overrides)
    assert needle in str(err.value)


def test_missing_data_is_refused_before_any_work(tmp_path, hf_dir):
    """Valid as configuration; the pre-flight, which looks at the disk, refuses it."""
    from replay_pipeline.run.preflight import preflight

    cfg = load_config(["task=gsm8k", "task.path=/definitely/not/here.jsonl", "model=hf", f"model.path={hf_dir}",
                       f"tracking.root_dir={tmp_path / 'runs'}"])
    with pytest.raises(ConfigError, match="task.path=/definitely/not/here.jsonl does not exist"):
        preflight(cfg)


def test_math_tasks_need_a_hugging_face_model(tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", GSM8K_ROWS)
    with pytest.raises(ConfigError, match="model=hf"):
        load_config(["task=gsm8k", f"task.path={data}"])


def test_addition_is_unchanged_by_the_math_fields():
    from omegaconf import OmegaConf

    cfg = load_config([])
    assert cfg.task.path is None and cfg.task.format == "auto"
    task = task_from_config(OmegaConf.to_container(cfg.task, resolve=True), TASK_DEFAULTS)
    assert task == AdditionTask(digits=3, heldout_size=512, validation_size=256, split_seed=1234)
    assert TASKS["addition"] is AdditionTask and TASKS["math"] is MathTask
    with pytest.raises(ValueError, match="task.path"):
        task_from_config({**OmegaConf.to_container(cfg.task, resolve=True), "path": "/data/x.jsonl"}, TASK_DEFAULTS)
    with pytest.raises(TypeError):  # keys that are no TaskConfig field still reach the constructor
        task_from_config({"name": "addition", "digitz": 3}, TASK_DEFAULTS)


def test_bad_data_is_refused_by_the_preflight_before_any_work(tmp_path, hf_dir):
    """Issue 23 item 3: a data file with a missing field or bytes that are not UTF-8 failed only
    after Prefect had started; the pre-flight reads it and names the file and the fix."""
    from replay_pipeline.run.preflight import preflight

    bad = tmp_path / "bad.jsonl"
    bad.write_bytes((json.dumps(GSM8K_ROWS[0]) + "\n").encode() + b'{"question": "caf\xe9", "answer": "#### 1"}\n')
    cfg = load_config(["task=gsm8k", f"task.path={bad}", "model=hf", f"model.path={hf_dir}",
                       f"tracking.root_dir={tmp_path / 'runs'}"])
    with pytest.raises(ConfigError, match="bad.jsonl line 2 is not UTF-8"):
        preflight(cfg)
