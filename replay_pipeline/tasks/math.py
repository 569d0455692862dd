r"""Math problems from local data: GSM8K-style word problems and MATH-style competition math.

    python -m flows.train task=gsm8k task.path=/data/gsm8k/train.jsonl model=hf model.path=...
    python -m flows.train task=math task.path=/data/math/train.parquet task.heldout_path=/data/math/test.parquet ...

Data (nothing is downloaded; ``load_dataset`` with a hub name is never called):
- ``path``: a ``.jsonl``/``.ndjson``, ``.json`` (a list of rows, an object holding one, or
  JSON lines), ``.parquet`` or ``.arrow`` file; a directory written by
  ``datasets.Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (read with
  ``datasets.load_from_disk``; a DatasetDict gives its ``split``); or any other directory of
  such files, e.g. a Hugging Face datasets cache directory (``gsm8k-train.arrow``,
  ``gsm8k-test.arrow``) or a hub snapshot (``main/train-00000-of-00001.parquet``). When file
  names carry split names (train, test, validation, ...), only the files of ``split`` are read.
- ``format``: ``gsm8k`` (columns question / answer, the reference after "####"), ``math``
  (problem / solution, the reference in the solution's last ``\boxed{}``, or an ``answer``
  column when there is one) or ``auto`` (told apart by the columns and markers);
  ``question_field`` / ``answer_field`` name other columns. An answer column without a marker
  is the reference as it stands.
- Rows without a question or an extractable reference are skipped with a warning; repeated
  questions are kept once (the first). Every problem is a :class:`Prompt` with id
  ``<format>-<sha256(question)[:16]>``, stable across files, row order and runs.

Splits: problems are ordered by id, then permuted by a PRNG seeded with ``split_seed``; the
first ``heldout_size`` are the held-out set, the next ``validation_size`` the validation set,
the rest training problems (at most ``max_prompts`` of them), so the held-out set does not
move when ``validation_size`` or ``max_prompts`` change. With ``heldout_path`` the held-out
set is ``heldout_size`` problems of that data instead (its ``heldout_split``, same seeded
order), and every problem of that data is removed from the training pool, so a test problem
repeated in the training file is never trained on.

Reward: 1.0 when the completion's final answer (answers.extract_final, in this task's style;
``answer_fallback="last_number"`` adds the lenient fallback) is equivalent to the reference
(answers.is_equivalent), else 0.0. Before extraction the completion is cut where it starts a
new turn, i.e. at a line beginning with the template's label before ``{question}``
("Question:"), because base models go on to invent the next question and answer it. A
completion that hit the length cap (finish_reason "length") still scores when its answer is
complete (a closed box, or a "####" line that ended), as in verl's and TRL's math rewards:
Hugging Face base models rarely emit the end token soon, and an answer given before the cap is
an answer; an answer running into the cap could be a prefix ("#### 4" of "#### 42") and
scores 0. ``score_truncated=False`` scores only completions that ended with the end token,
as the addition task does.

Bad input (missing file, unknown format, missing columns, empty data, too few problems for
the held-out and validation sets) raises ValueError at construction, saying what to change.
"""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Optional

import numpy as np

from replay_pipeline.tasks.answers import FALLBACKS, extract_answer, extract_final, is_equivalent
from replay_pipeline.tasks.base import Prompt

FORMATS = ("gsm8k", "math", "auto")
DATA_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet", ".arrow")
SPLIT_NAMES = ("train", "test", "validation", "valid", "val", "dev", "eval")
#: Files of a datasets directory that describe it rather than hold rows.
METADATA_FILES = {"dataset_info.json", "state.json", "dataset_dict.json", "dataset_infos.json"}

GSM8K_TEMPLATE = ("Question: {question}\nSolve the problem step by step, then write the final answer "
                  "as a number on its own line after \"####\".\nAnswer:")
MATH_TEMPLATE = ("Problem: {question}\nSolve the problem step by step, then put the final answer in "
                 "\\boxed{}.\nSolution:")
TEMPLATES = {"gsm8k": GSM8K_TEMPLATE, "math": MATH_TEMPLATE}
_HOW_TO_GIVE = ("give a .jsonl, .json, .parquet or .arrow file, a directory of them, or a directory "
                "written by datasets' save_to_disk (nothing is downloaded)")


@dataclass(frozen=True)
class MathTask:
    path: Optional[str] = None
    """Training data: a file, a directory of files, or a save_to_disk directory (see module)."""
    format: str = "auto"
    """`gsm8k` ("#### answer"), `math` (\\boxed{answer}) or `auto` (from columns and markers)."""
    question_field: Optional[str] = None
    """Column holding the problem text (default: question for gsm8k, problem for math)."""
    answer_field: Optional[str] = None
    """Column holding the reference (default: answer for gsm8k; answer, else solution, for math)."""
    prompt_template: Optional[str] = None
    """Prompt text with `{question}` where the problem goes (None: the format's default)."""
    heldout_path: Optional[str] = None
    """Separate held-out data (e.g. the test file); None: held out from `path`."""
    split: str = "train"
    """Split read from a DatasetDict or a directory whose file names carry split names."""
    heldout_split: str = "test"
    """The same for `heldout_path`."""
    heldout_size: int = 512
    """Size of the fixed held-out test set."""
    validation_size: int = 256
    """Size of the fixed validation set (0 allowed: only the built-in model's warm start uses it)."""
    split_seed: int = 1234
    """Seed of the held-out/validation/train split."""
    max_prompts: Optional[int] = None
    """At most this many training problems (None: all that remain after the held-out and
    validation sets)."""
    answer_fallback: Optional[str] = None
    """`last_number`: without a "####" or \\boxed{} answer, take the completion's last number."""
    score_truncated: bool = True
    """Score completions cut by the length cap when their answer is complete (see module)."""

    name: ClassVar[str] = "math"

    def __post_init__(self) -> None:
        self._check_params()
        rows, source = load_rows(self.path, self.split, "task.path")
        fmt, qf, af = resolve_columns(rows, self.format, self.question_field, self.answer_field, source)
        template = self.prompt_template if self.prompt_template is not None else TEMPLATES[fmt]
        items = _problems(rows, fmt, qf, af, source)
        order = _seeded_order(items, self.split_seed)
        if self.heldout_path is not None:
            h_rows, h_source = load_rows(self.heldout_path, self.heldout_split, "task.heldout_path")
            h_fmt, h_qf, h_af = resolve_columns(h_rows, fmt, self.question_field, self.answer_field, h_source)
            h_items = _problems(h_rows, h_fmt, h_qf, h_af, h_source, prefix=fmt)
            if len(h_items) < self.heldout_size:
                raise ValueError(f"task.heldout_path={self.heldout_path} has {len(h_items)} usable problems, "
                                 f"fewer than task.heldout_size={self.heldout_size}; lower task.heldout_size")
            heldout = _seeded_order(h_items, self.split_seed)[: self.heldout_size]
            test_ids = {pid for pid, _, _ in h_items}
            pool = [it for it in order if it[0] not in test_ids]
            rest = pool
        else:
            heldout, rest = order[: self.heldout_size], order[self.heldout_size:]
        validation, train = rest[: self.validation_size], rest[self.validation_size:]
        if not train:
            have = len(rest) if self.heldout_path is not None else len(order)
            need = self.validation_size + (0 if self.heldout_path is not None else self.heldout_size)
            raise ValueError(
                f"{source} has {have} usable problems"
                + (" not in task.heldout_path" if self.heldout_path is not None else "")
                + f": {need} go to the held-out and validation sets "
                f"(task.heldout_size={self.heldout_size}, task.validation_size={self.validation_size}) and none "
                "would remain for training; lower those sizes, give task.heldout_path, or use a bigger file")
        if self.max_prompts is not None:
            train = train[: self.max_prompts]
        object.__setattr__(self, "style", fmt)
        object.__setattr__(self, "template", template)
        object.__setattr__(self, "_turn", _turn_marker(template))
        def make(item: tuple[str, str, str]) -> Prompt:
            return Prompt(prompt_id=item[0], text=template.replace("{question}", item[1]), answer=item[2])

        object.__setattr__(self, "_heldout", tuple(make(it) for it in heldout))
        object.__setattr__(self, "_validation", tuple(make(it) for it in validation))
        object.__setattr__(self, "_train", tuple(make(it) for it in train))

    def _check_params(self) -> None:
        if self.path is None or not str(self.path).strip():
            raise ValueError("the math task needs its data: set task.path=/path/to/train.jsonl; " + _HOW_TO_GIVE)
        if self.format not in FORMATS:
            raise ValueError(f"task.format={self.format!r} is not one of {list(FORMATS)}: gsm8k for "
                             "'#### answer' solutions, math for \\boxed{} solutions, auto to tell from the columns")
        for arg in ("heldout_size", "validation_size"):
            value = getattr(self, arg)
            least = 1 if arg == "heldout_size" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"task.{arg}={value!r} must be an integer >= {least}")
        if self.max_prompts is not None and (isinstance(self.max_prompts, bool)
                                             or not isinstance(self.max_prompts, int) or self.max_prompts < 1):
            raise ValueError(f"task.max_prompts={self.max_prompts!r} must be a positive integer, or null for all")
        if self.answer_fallback not in FALLBACKS:
            raise ValueError(f"task.answer_fallback={self.answer_fallback!r} must be null or 'last_number'")
        if self.prompt_template is not None and "{question}" not in self.prompt_template:
            raise ValueError(f"task.prompt_template={self.prompt_template!r} has no {{question}} placeholder; "
                             "put {question} where the problem text goes")

    # ------------------------------------------------------------------ Task protocol
    def train_prompts(self, n: int, rng: np.random.Generator) -> list[Prompt]:
        if n < 0:
            raise ValueError(f"n={n} must be >= 0")
        return [self._train[int(i)] for i in rng.integers(0, len(self._train), size=n)]

    def heldout_prompts(self) -> list[Prompt]:
        return list(self._heldout)

    def validation_prompts(self) -> list[Prompt]:
        return list(self._validation)

    def all_train_prompts(self) -> list[Prompt]:
        """The whole training pool, in the split's order (for inspection and tests)."""
        return list(self._train)

    def reward(self, prompt: Prompt, completion: str, finish_reason: str) -> float:
        if finish_reason != "stop" and not self.score_truncated:
            return 0.0
        text, cut = self._own_turn(completion or "")
        answer, complete = extract_final(text, self.style, self.answer_fallback)
        if answer is None:
            return 0.0
        if finish_reason != "stop" and not (complete or cut):
            return 0.0  # the answer runs into the length cap: maybe only its prefix
        return 1.0 if is_equivalent(answer, prompt.answer) else 0.0

    def extract(self, completion: str) -> Optional[str]:
        """The final answer this task reads from a completion (None without one)."""
        return extract_final(self._own_turn(completion or "")[0], self.style, self.answer_fallback)[0]

    def _own_turn(self, completion: str) -> tuple[str, bool]:
        """The completion up to a line that starts a new turn (the template's label)."""
        if self._turn is None:
            return completion, False
        m = self._turn.search(completion)
        return (completion[: m.start()], True) if m else (completion, False)


# ---------------------------------------------------------------------------- loading


def load_rows(path: Any, split: str = "train", key: str = "task.path") -> tuple[list[dict], str]:
    """Rows (dicts) of a local data file or directory, and a description for messages."""
    if path is None:
        raise ValueError(f"{key} is not set; " + _HOW_TO_GIVE)
    p = Path(str(path)).expanduser()
    if not p.exists():
        raise ValueError(f"{key}={path} does not exist; " + _HOW_TO_GIVE)
    if p.is_file():
        rows = _read_file(p, key)
        source = f"{key}={path}"
    elif (p / "dataset_dict.json").is_file() or (p / "state.json").is_file():
        rows = _read_saved_dataset(p, split, key)
        source = f"{key}={path}" + (f" (split {split})" if (p / "dataset_dict.json").is_file() else "")
    else:
        files = sorted(f for f in p.rglob("*") if f.is_file() and _is_data_file(f, p))
        if not files:
            raise ValueError(f"{key}={path} is a directory without data files; " + _HOW_TO_GIVE)
        tagged = {f: _split_of(f.relative_to(p)) for f in files}
        if any(tagged.values()):
            chosen = [f for f, s in tagged.items() if s == split]
            if not chosen:
                found = sorted({s for s in tagged.values() if s})
                which = "task.heldout_split" if key == "task.heldout_path" else "task.split"
                raise ValueError(f"{key}={path} has no files of split {split!r} (file names carry the splits "
                                 f"{found}); set {which} to one of them")
            files = chosen
        rows = [row for f in files for row in _read_file(f, key)]
        source = f"{key}={path}" + (f" (split {split}, {len(files)} files)" if any(tagged.values()) else "")
    if not rows:
        raise ValueError(f"{source} holds no rows; point it at a file with problems")
    return rows, source


def _is_data_file(f: Path, root: Path) -> bool:
    rel = f.relative_to(root)
    if any(part.startswith(".") for part in rel.parts) or f.name in METADATA_FILES:
        return False
    return f.suffix.lower() in DATA_SUFFIXES


def _split_of(rel: Path) -> Optional[str]:
    """The split a data file belongs to, from its name or folder ("gsm8k-train.arrow"), or None."""
    text = rel.as_posix().lower()
    for name in SPLIT_NAMES:
        if re.search(rf"(?:^|[-_./]){name}(?:[-_./]|$)", text):
            return name
    return None


def _read_file(p: Path, key: str) -> list[dict]:
    suffix = p.suffix.lower()
    try:
        _check_utf8(p, suffix)
        if suffix in (".jsonl", ".ndjson"):
            return _read_json_lines(p.read_text(encoding="utf-8"), p)
        if suffix == ".json":
            text = p.read_text(encoding="utf-8")
            try:
                data = json.loads(text)
            except json.JSONDecodeError:
                return _read_json_lines(text, p)  # JSON lines in a .json file
            if isinstance(data, dict):
                lists = [v for v in data.values() if isinstance(v, list)]
                if len(lists) != 1:
                    raise ValueError(f"{p} holds a JSON object; expected a list of rows, or an object with "
                                     "exactly one list of rows")
                data = lists[0]
            if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
                raise ValueError(f"{p} must hold a list of JSON objects (one per problem)")
            return data
        if suffix == ".parquet":
            # start-up cost: pyarrow, only for this file format
            import pyarrow.parquet as pq

            return pq.read_table(p).to_pylist()
        if suffix == ".arrow":
            return _read_arrow(p)
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(f"{key}: cannot read {p} ({type(exc).__name__}: {exc}); is it a valid "
                         f"{suffix.lstrip('.')} file?") from exc
    raise ValueError(f"{key}={p} has an unsupported extension {suffix or '(none)'}; " + _HOW_TO_GIVE)


def _check_utf8(p: Path, suffix: str) -> None:
    """A text data file that is not UTF-8 is refused naming the file, line and byte (the
    decoder's own message names neither and the exception carries the whole file)."""
    if suffix not in (".jsonl", ".ndjson", ".json"):
        return
    data = p.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise ValueError(f"{p} line {line} is not UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
                         "save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def _read_json_lines(text: str, p: Path) -> list[dict]:
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{p} line {number} is not valid JSON ({exc.msg}); each line must be one "
                             "JSON object") from exc
        if not isinstance(row, dict):
            raise ValueError(f"{p} line {number} is not a JSON object; each line must be one problem "
                             "as an object, e.g. {\"question\": ..., \"answer\": ...}")
        rows.append(row)
    return rows


def _read_arrow(p: Path) -> list[dict]:
    """An Arrow file as datasets writes them (IPC stream; IPC file format also accepted)."""
    # start-up cost: pyarrow, only for this file format
    import pyarrow as pa

    try:
        with pa.memory_map(str(p)) as source:
            return pa.ipc.open_stream(source).read_all().to_pylist()
    except pa.ArrowInvalid:
        with pa.memory_map(str(p)) as source:
            return pa.ipc.open_file(source).read_all().to_pylist()


def _read_saved_dataset(p: Path, split: str, key: str) -> list[dict]:
    # optional dependency: datasets (only for datasets directories; comes with trl)
    import datasets

    try:
        data = datasets.load_from_disk(str(p))
    except Exception as exc:
        raise ValueError(f"{key}={p}: datasets.load_from_disk failed ({type(exc).__name__}: {exc}); "
                         "it must be a directory written by save_to_disk") from exc
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            which = "task.heldout_split" if key == "task.heldout_path" else "task.split"
            raise ValueError(f"{key}={p} is a DatasetDict without split {split!r}; its splits are "
                             f"{sorted(data)}: set {which} to one of them")
        data = data[split]
    return data.to_list()


# ---------------------------------------------------------------------------- columns and problems


def resolve_columns(rows: list[dict], fmt: str, question_field: Optional[str], answer_field: Optional[str],
                    source: str) -> tuple[str, str, str]:
    """(format, question column, answer column) for these rows; ValueError saying what to set."""
    columns: list[str] = []
    for row in rows[:1000]:
        columns.extend(k for k in row if k not in columns)
    have = set(columns)
    if fmt not in FORMATS:
        raise ValueError(f"task.format={fmt!r} is not one of {list(FORMATS)}")

    def pick(*names: str) -> Optional[str]:
        return next((n for n in names if n in have), None)

    if fmt == "auto":
        qf = question_field or pick("question", "problem", "Question", "Problem")
        af = answer_field or pick("answer", "solution", "Answer", "Solution")
        if qf is not None and af is not None and qf in have and af in have:
            sample = [str(r.get(af, "")) for r in rows[:200]]
            if any("####" in s for s in sample):
                fmt = "gsm8k"
            elif any(re.search(r"\\(?:boxed|fbox)", s) for s in sample) or qf.lower() == "problem" \
                    or "solution" in have or "Solution" in have:
                fmt = "math"
        if fmt == "auto":
            raise ValueError(f"{source}: cannot tell the format from the columns {columns}; set task.format=gsm8k "
                             "(question + answer ending in '#### x') or task.format=math (problem + solution with "
                             "\\boxed{x}, or an answer column), and task.question_field / task.answer_field if "
                             "the columns are named otherwise")
    if fmt == "gsm8k":
        qf = question_field or pick("question", "Question", "problem", "Problem") or "question"
        af = answer_field or pick("answer", "Answer") or "answer"
    else:
        qf = question_field or pick("problem", "Problem", "question", "Question") or "problem"
        af = answer_field or pick("answer", "Answer", "solution", "Solution") or "solution"
    for col, arg, what in ((qf, "question_field", "problem text"), (af, "answer_field", "reference answer or solution")):
        if col not in have:
            raise ValueError(f"{source} has no column {col!r} (columns: {columns}); set task.{arg}=<column> "
                             f"to the column that holds the {what}")
    return fmt, qf, af


def _problems(rows: list[dict], fmt: str, qf: str, af: str, source: str,
              prefix: Optional[str] = None) -> list[tuple[str, str, str]]:
    """[(prompt id, question, reference answer)], first occurrence of each question kept."""
    out: list[tuple[str, str, str]] = []
    seen: set[str] = set()
    skipped = 0
    for row in rows:
        question, raw = row.get(qf), row.get(af)
        if not isinstance(question, str) or not question.strip() or raw is None:
            skipped += 1
            continue
        reference = reference_answer(raw, fmt)
        if reference is None:
            skipped += 1
            continue
        question = question.strip()
        pid = prompt_id(question, prefix or fmt)
        if pid in seen:
            continue
        seen.add(pid)
        out.append((pid, question, reference))
    if not out:
        where = "after ####" if fmt == "gsm8k" else "in \\boxed{}, or plain"
        raise ValueError(f"{source}: none of its {len(rows)} rows has a question in {qf!r} and a reference "
                         f"answer in {af!r} ({where}); "
                         "check task.format, task.question_field and task.answer_field")
    if skipped:
        warnings.warn(f"{source}: skipped {skipped} of {len(rows)} rows without a question or an extractable "
                      "reference answer", stacklevel=3)
    return out


def reference_answer(raw: Any, fmt: str) -> Optional[str]:
    """The reference in a dataset's answer cell: after "####" / in \\boxed{} when the cell has
    the marker, else the cell itself; None when a marker holds no answer or the cell is empty."""
    if isinstance(raw, bool):
        return None
    if isinstance(raw, float) and raw.is_integer():
        raw = int(raw)
    text = str(raw).strip()
    if not text:
        return None
    if "####" in text or re.search(r"\\(?:boxed|fbox)(?![A-Za-z])", text):
        return extract_answer(text, style=fmt)
    return text


def prompt_id(question: str, fmt: str) -> str:
    """Stable id of a problem: its format and the SHA-256 of its (stripped) text."""
    return f"{fmt}-{hashlib.sha256(question.strip().encode('utf-8')).hexdigest()[:16]}"


def _seeded_order(items: list[tuple[str, str, str]], seed: int) -> list[tuple[str, str, str]]:
    ordered = sorted(items, key=lambda it: it[0])
    perm = np.random.default_rng(seed).permutation(len(ordered))
    return [ordered[int(i)] for i in perm]


def _turn_marker(template: str) -> Optional[re.Pattern]:
    before = template.split("{question}", 1)[0].strip()
    if not before:
        return None
    label = before.splitlines()[-1].strip()  # few-shot prefixes: the line that opens a turn
    return re.compile(r"(?m)^[ \t]*" + re.escape(label))
