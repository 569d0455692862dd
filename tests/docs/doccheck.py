"""The docs tier's checkers: what a page of README.md or docs/ links to, and the commands its
code blocks show, held against the repository, the real parsers and the configuration schema.

Every checker returns problems as `path:line: what is wrong; what to fix`, so that a page's
writer can act on each one, and takes the repository root as an argument, so that the tests can
feed it a small broken tree. Nothing here fetches a URL or starts Prefect, MLflow or a model:
commands are parsed with the parsers the commands use (infra/reference.py finds them),
configurations composed and validated with replay_pipeline.config (no I/O).

GitHub's heading anchors (`slugify`): the heading's text as rendered (markup, links and code
backticks dropped), lowercased, every character that is not a letter, digit, `_`, `-` or space
removed, each space made a `-`; a repeated anchor gets `-1`, `-2`, ... in page order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import importlib.util
import io
import re
import shlex
import subprocess
import sys
import urllib.parse
from pathlib import Path
from typing import Any, Iterator

from tests.conftest import ROOT

def _load_reference() -> Any:
    """infra/reference.py as a module (infra/ is no package); one instance per process."""
    if "infra_reference" not in sys.modules:
        spec = importlib.util.spec_from_file_location("infra_reference", ROOT / "infra" / "reference.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["infra_reference"] = module  # dataclasses look their module up while it loads
        spec.loader.exec_module(module)
    return sys.modules["infra_reference"]


reference = _load_reference()

#: Fenced blocks whose lines are shell commands (the first word of the info string).
SHELL_BLOCKS = {"", "bash", "sh", "shell", "console", "zsh", "shell-session"}
#: Placeholders a page writes where a reader puts their own value, and the dummy of the same
#: shape each is replaced with before a command is parsed, in this order (first match wins).
RUN_ID = "20261206-101502-3fa2c1"
MLFLOW_RUN_ID = "0123456789abcdef0123456789abcdef"
PLACEHOLDERS = [
    (r"<[^<>\n]*(?:parent|mlflow)[^<>\n]*>|\bPARENT(?:_[A-Z0-9]+)*\b", MLFLOW_RUN_ID),
    (r"<[^<>\n]*run[^<>\n]*>|\bRUN_ID\b|\bRUN_[A-Z]\b", RUN_ID),
    (r"<[^<>\n]*step[^<>\n]*>|\bSTEP\b", "100"),
    (r"<[^<>\n]+>", "placeholder"),
]
#: The arguments of the argparse commands that hold Hydra overrides (flows.deploy --train-overrides,
#: flows.plan --probe-override, the benchmarks' positional overrides); flows.sweep's are read apart.
OVERRIDE_ARGUMENTS = ("overrides", "train_overrides", "probe_override")
#: What is dropped from a command line: an ellipsis standing for "and so on".
ELLIPSES = {"...", "…"}


@dataclasses.dataclass(frozen=True)
class Command:
    path: Path
    line: int
    module: str
    args: tuple[str, ...]
    text: str
    """The line(s) as the page writes them, continuations joined."""
    elided: bool = False
    """It has a `...` standing for more arguments: checked, but not composed."""

    def where(self, root: Path) -> str:
        return f"{_rel(self.path, root)}:{self.line}"


def _rel(path: Path, root: Path) -> str:
    try:
        return str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)


def doc_pages(root: Path = ROOT) -> list[Path]:
    """README.md and every Markdown page under docs/."""
    pages = [root / "README.md"] if (root / "README.md").is_file() else []
    return pages + sorted((root / "docs").rglob("*.md")) if (root / "docs").is_dir() else pages


# --- Markdown --------------------------------------------------------------------------------

_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^`\s]*)")


@dataclasses.dataclass
class Block:
    info: str
    lines: list[tuple[int, str]]
    """(line number, text) of the lines between the fences, indentation of the fence removed."""


def split_page(text: str) -> tuple[list[tuple[int, str]], list[Block]]:
    """(the lines outside fenced code blocks, the blocks), 1-based line numbers."""
    prose: list[tuple[int, str]] = []
    blocks: list[Block] = []
    fence: tuple[str, int, str] | None = None  # (the fence's characters, its indentation, ...)
    block: Block | None = None
    for number, line in enumerate(text.splitlines(), 1):
        if fence is None:
            m = _FENCE.match(line)
            if m:
                fence = (m.group(2), len(m.group(1)), "")
                block = Block(m.group(3).lower(), [])
                continue
            prose.append((number, line))
            continue
        stripped = line.strip()
        if stripped.startswith(fence[0][0] * len(fence[0])) and set(stripped) <= {fence[0][0]}:
            blocks.append(block)
            fence, block = None, None
            continue
        indent = fence[1]
        block.lines.append((number, line[indent:] if line[:indent].strip() == "" else line.lstrip()))
    if block is not None:  # an unclosed fence runs to the end of the page, as GitHub renders it
        blocks.append(block)
    return prose, blocks


def _without_code_spans(line: str) -> str:
    """The line with its inline code spans blanked out (same length, so columns stay)."""
    return re.sub(r"(`+)(.+?)\1", lambda m: " " * len(m.group(0)), line)


def _plain(heading: str) -> str:
    """A heading's text as GitHub renders it: images and links to their text, code spans to
    their content, emphasis markers and HTML tags dropped."""
    text = re.sub(r"!\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"\[([^\]]*)\]\[[^\]]*\]", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    text = re.sub(r"(`+)(.+?)\1", lambda m: m.group(2), text)
    text = re.sub(r"(\*+|(?<!\w)_+|_+(?!\w))", "", text)
    return text.strip()


#: GitHub's anchor for a heading's rendered text (before the duplicate suffix): the rule the
#: generated pages' contents links are made with.
slugify = reference.slug


def anchors(text: str) -> list[str]:
    """Every anchor a page has: its headings' (ATX and setext, duplicates numbered) and the
    `id`/`name` attributes of its HTML."""
    prose, _ = split_page(text)
    seen: dict[str, int] = {}
    out: list[str] = []
    lines = [line for _, line in prose]
    for i, line in enumerate(lines):
        heading = None
        m = re.match(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$", line)
        if m:
            heading = m.group(2) or ""
        elif (i + 1 < len(lines) and line.strip() and re.match(r"^ {0,3}(=+|-+)[ \t]*$", lines[i + 1])
              and not re.match(r"^ {0,3}([-*+]|\d+[.)]|>|\|)", line) and "|" not in line):
            heading = line.strip()
        if heading is not None:
            slug = slugify(_plain(heading))
            unique, n = slug, seen.get(slug, 0)
            while unique in seen:
                n += 1
                unique = f"{slug}-{n}"
            seen[slug] = n
            seen.setdefault(unique, 0)
            out.append(unique)
        for attr in re.findall(r"<[a-zA-Z][^>]*\s(?:id|name)=[\"']([^\"']+)[\"']", line):
            out.append(attr)
    return out


_LINK = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\]]*\])*)\]\(\s*(<[^>]*>|[^)\s]*)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
_REF_DEF = re.compile(r"^ {0,3}\[([^\]]+)\]:\s*(<[^>]*>|\S+)")
_HTML_REF = re.compile(r"<(img|a|source)\b[^>]*?\s(src|href|srcset)=[\"']([^\"']+)[\"']", re.I)


def links(text: str) -> list[tuple[int, str, str]]:
    """(line, kind, target) of every link, image and reference definition outside code:
    kind is `link` or `image`. A link's text may wrap over lines of its paragraph; the line
    given is the one its target is on."""
    prose, _ = split_page(text)
    out = []

    def scan(first: int, text: str, offset: int = 0) -> None:
        for m in _LINK.finditer(text):
            number = first + text.count("\n", 0, m.start(3)) + offset
            out.append((number, "image" if m.group(1) else "link", m.group(3).strip("<>")))
            # [![badge](img)](link): the image inside the link's text
            scan(first, m.group(2), offset + text.count("\n", 0, m.start(2)))

    paragraph: list[tuple[int, str]] = []
    for number, raw in [*prose, (0, "")]:
        line = _without_code_spans(raw)
        if (m := _REF_DEF.match(line)):
            out.append((number, "link", m.group(2).strip("<>")))
            continue
        for tag, _, target in _HTML_REF.findall(line):
            out.append((number, "image" if tag.lower() in ("img", "source") else "link", target.split()[0]))
        if line.strip() and (not paragraph or paragraph[-1][0] == number - 1):
            paragraph.append((number, line))
            continue
        if paragraph:
            scan(paragraph[0][0], "\n".join(text for _, text in paragraph))
        paragraph = [(number, line)] if line.strip() else []
    return sorted(out)


@functools.lru_cache(maxsize=None)
def _page_anchors(path: Path) -> tuple[str, ...]:
    return tuple(anchors(path.read_text(encoding="utf-8")))


def _ignored(root: Path, paths: list[Path]) -> set[Path]:
    """Which of `paths` git ignores (not in the repository, so not on GitHub); none without git."""
    if not paths:
        return set()
    try:
        done = subprocess.run(["git", "check-ignore", "--stdin"], cwd=root, capture_output=True, text=True,
                              input="\n".join(str(p) for p in paths), timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return {Path(line).resolve() for line in done.stdout.splitlines() if line}


def link_problems(root: Path = ROOT, pages: list[Path] | None = None) -> list[str]:
    """Every relative link, anchor and image of `pages` (default: README.md and docs/) that does
    not resolve. External links (a scheme such as https:) are not fetched."""
    root = root.resolve()
    problems = []
    targets: list[tuple[str, Path]] = []
    for page in pages if pages is not None else doc_pages(root):
        page = page.resolve()
        for number, kind, target in links(page.read_text(encoding="utf-8")):
            where = f"{_rel(page, root)}:{number}"
            if not target:
                problems.append(f"{where}: {kind} with an empty target; give the path or #anchor it points to")
                continue
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("//"):
                continue  # external: not fetched
            raw_path, _, anchor = target.partition("#")
            path = urllib.parse.unquote(raw_path.split("?")[0])
            if not path:
                dest = page
            elif path.startswith("/"):
                dest = (root / path.lstrip("/")).resolve()
            else:
                dest = (page.parent / path).resolve()
            if root not in dest.parents and dest != root:
                problems.append(f"{where}: {kind} `{target}` leaves the repository ({dest}); link to a file "
                                "inside it, or to a full https:// address")
                continue
            if not dest.exists():
                hint = _closest(dest, root)
                problems.append(f"{where}: {kind} `{target}`: {_rel(dest, root)} does not exist; fix the path"
                                + (f" (did you mean {hint}?)" if hint else "") + " or add the file")
                continue
            if kind == "image" and not dest.is_file():
                problems.append(f"{where}: image `{target}` is not a file; point it at the image file")
                continue
            targets.append((where, dest))
            if anchor:
                problems += _anchor_problems(where, kind, target, dest, anchor, root)
    ignored = _ignored(root, [dest for _, dest in targets])
    for where, dest in targets:
        if dest in ignored:
            problems.append(f"{where}: {_rel(dest, root)} is ignored by git (.gitignore), so it is not in the "
                            "repository and the link breaks on GitHub; link to a committed file")
    return problems


def _anchor_problems(where: str, kind: str, target: str, dest: Path, anchor: str, root: Path) -> list[str]:
    anchor = urllib.parse.unquote(anchor)
    if dest.is_dir():
        return [f"{where}: {kind} `{target}`: #{anchor} on a directory; link to a page in it"]
    if dest.suffix.lower() != ".md":
        if re.fullmatch(r"L\d+(-L\d+)?", anchor):
            return []  # GitHub's line anchors of a source file
        return [f"{where}: {kind} `{target}`: #{anchor} on a file that is not Markdown; use #L<line> or drop it"]
    have = _page_anchors(dest)
    if anchor in have:
        return []
    close = difflib.get_close_matches(anchor.lower(), have, 1, 0.5)
    return [f"{where}: {kind} `{target}`: no heading of {_rel(dest, root)} has the anchor #{anchor}"
            + (f" (did you mean #{close[0]}?)" if close else "")
            + "; anchors are the heading lowercased, punctuation dropped, spaces as -"]


def _closest(dest: Path, root: Path) -> str | None:
    folder = dest.parent
    while not folder.is_dir() and folder != root:
        folder = folder.parent
    names = [p.name for p in folder.iterdir()] if folder.is_dir() else []
    close = difflib.get_close_matches(dest.name, names, 1, 0.6)
    return _rel(folder / close[0], root) if close else None


# --- commands in code blocks -----------------------------------------------------------------

def substitute(text: str) -> str:
    """`text` with every placeholder (PLACEHOLDERS) replaced by its dummy."""
    for pattern, dummy in PLACEHOLDERS:
        text = re.sub(pattern, dummy, text)
    return text


def _logical_lines(block: Block) -> Iterator[tuple[int, str]]:
    """(first line number, line) of a block, `\\` continuations joined; in a console block that
    has `$ ` prompts only the prompted lines (the rest is output)."""
    prompted = (block.info in ("console", "shell-session")
                and any(line.lstrip().startswith("$ ") for _, line in block.lines))
    pending: tuple[int, str] | None = None
    for number, line in block.lines:
        if pending is not None:
            start, text = pending
        else:
            stripped = line.lstrip()
            if prompted and not stripped.startswith("$ "):
                continue
            start, text, line = number, "", stripped[2:] if stripped.startswith("$ ") else stripped
        if line.rstrip().endswith("\\"):
            pending = (start, text + line.rstrip()[:-1] + " ")
            continue
        pending = None
        yield start, text + line


_OPERATORS = {"&&", "||", ";", "|", "&", ";;", "(", ")", "|&"}


def _segments(tokens: list[str]) -> Iterator[list[str]]:
    segment: list[str] = []
    for token in tokens:
        if token in _OPERATORS:
            yield segment
            segment = []
        else:
            segment.append(token)
    yield segment


def _drop_redirections(tokens: list[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for token in tokens:
        if skip:
            skip = False
            continue
        if token and set(token) <= set("<>&"):
            if out and out[-1].isdigit():
                out.pop()
            skip = True
            continue
        out.append(token)
    return out


def _command_of(tokens: list[str]) -> tuple[str, list[str]] | None:
    """(module, args) when the segment runs `python -m flows.<x>` or a benchmark."""
    tokens = _drop_redirections(tokens)
    while tokens and (re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", tokens[0]) or tokens[0] in ("time", "nohup", "exec", "env")):
        tokens = tokens[1:]
    if tokens and tokens[0] == "timeout" and len(tokens) > 1:
        tokens = tokens[2:]
    if len(tokens) < 3 or Path(tokens[0]).name not in ("python", "python3") or tokens[1] != "-m":
        return None
    module = tokens[2]
    if not (module.startswith("flows.") or module.startswith("replay_pipeline.benchmarks.")):
        return None
    return module, list(tokens[3:])


def commands_in(path: Path, text: str | None = None) -> tuple[list[Command], list[str]]:
    """(the `python -m flows.<x>` and `python -m replay_pipeline.benchmarks.<x>` commands of the
    page's shell blocks, problems splitting a line): a leading `$ ` stripped, `\\` continuations
    joined, a trailing `# comment` and `&` ignored, leading `VAR=value` assignments skipped, each
    part of a `&&`/`;`/`|` chain on its own, placeholders substituted (PLACEHOLDERS), a `...`
    argument dropped (the command is then `elided`)."""
    text = path.read_text(encoding="utf-8") if text is None else text
    _, blocks = split_page(text)
    commands, problems = [], []
    for block in blocks:
        if block.info.split("{")[0] not in SHELL_BLOCKS:
            continue
        for number, line in _logical_lines(block):
            if "python" not in line:
                continue
            lexer = shlex.shlex(substitute(line), posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            lexer.commenters = "#"
            try:
                tokens = list(lexer)
            except ValueError as exc:
                problems.append(f"{path}:{number}: `{line.strip()}` does not split as a shell line ({exc}); "
                                "close its quotes")
                continue
            for segment in _segments(tokens):
                if (found := _command_of(segment)) is not None:
                    module, args = found
                    commands.append(Command(path, number, module, tuple(a for a in args if a not in ELLIPSES),
                                            line.strip(), elided=any(a in ELLIPSES for a in args)))
    return commands, problems


# --- what the commands say, against the parsers and the schema -------------------------------

@functools.lru_cache(maxsize=None)
def _parser(module: str) -> Any:
    return reference.parser_of(module)


@functools.lru_cache(maxsize=None)
def _modules() -> tuple[str, ...]:
    return tuple(reference.entry_point_modules())


@functools.lru_cache(maxsize=None)
def conf_options() -> dict[str, tuple[str, ...]]:
    """{config group: its presets} from conf/."""
    return {group: tuple(o.name for o in options) for group, options in reference.conf_groups().items()}


@functools.lru_cache(maxsize=None)
def schema_keys() -> frozenset[str]:
    """Every key of the schema, sections (`model.warmstart`, `buffer.storage_options`) included."""
    keys = set()
    for f in reference.schema_fields():
        parts = f.key.split(".")
        keys.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return frozenset(keys)


#: Sections whose keys are free-form (replay_pipeline/config/compose.py FREE_FORM).
def _free_form() -> tuple[str, ...]:
    from replay_pipeline.config.compose import FREE_FORM

    return FREE_FORM


_OVERRIDE = re.compile(r"(\+\+|\+|~)?([A-Za-z_][\w.\-/]*)(@[\w.\-/]+)?(=(.*))?", re.S)


def override_problems(overrides: list[str], presets_elsewhere: bool = False, compose: bool = True) -> list[str]:
    """What is wrong with Hydra overrides: a key the schema lacks, a preset conf/ lacks, or a
    composition that `load_config` refuses (bounds and cross-field rules, no I/O).
    `presets_elsewhere`: the command adds --config-dir, whose presets are not here to read, so
    group options are not checked and nothing is composed."""
    problems = []
    groups = conf_options()
    for override in overrides:
        m = _OVERRIDE.fullmatch(override)
        if not m or (m.group(4) is None and m.group(1) != "~"):
            problems.append(f"`{override}` is not an override: write key=value (every key: "
                            "docs/reference/config.md)")
            continue
        key, value = m.group(2), m.group(5)
        if key.startswith("hydra.") or key == "hydra":
            continue
        if key in groups:
            if value not in groups[key] and value not in ("null", None) and not presets_elsewhere:
                problems.append(f"`{override}`: conf/{key}/ has no preset {value}.yaml; choose one of "
                                f"{', '.join(groups[key])}")
            continue
        if key in schema_keys() or key.startswith(_free_form()):
            continue
        close = difflib.get_close_matches(key, sorted(schema_keys() | set(groups)), 1, 0.6)
        problems.append(f"`{override}`: the configuration has no key {key}"
                        + (f" (did you mean {close[0]}?)" if close else "")
                        + "; every key: docs/reference/config.md")
    if problems or presets_elsewhere or not compose:
        return problems
    problem = composition_problem(tuple(overrides))
    return [problem] if problem else []


@functools.lru_cache(maxsize=None)
def composition_problem(overrides: tuple[str, ...]) -> str | None:
    """None if the overrides compose and validate, else the reason in one line."""
    from replay_pipeline.config import ConfigError, load_config

    try:
        load_config(list(overrides))
    except ConfigError as exc:
        return f"`{' '.join(overrides) or '(no overrides)'}` does not compose: " + " ".join(str(exc).split())
    return None


def _parse(parser: Any, args: list[str]) -> tuple[Any, str | None]:
    """(namespace, None), or (None, the parser's error) where it exits; --help is fine."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            return parser.parse_args(args), None
    except SystemExit as exc:
        if exc.code in (0, None):
            return None, None
        lines = [line for line in err.getvalue().splitlines() if line.strip()]
        return None, lines[-1] if lines else f"exit {exc.code}"


def command_problems(command: Command) -> list[str]:
    """What is wrong with one command (messages without the location)."""
    module, args = command.module, list(command.args)
    if module not in _modules():
        known = ", ".join(sorted(_modules()))
        close = difflib.get_close_matches(module, _modules(), 1, 0.6)
        return [f"`python -m {module}` is not a command" + (f" (did you mean {close[0]}?)" if close else "")
                + f"; the commands are {known}"]
    compose = not command.elided
    if module == "flows.train":
        return _train_problems(args, compose)
    parser = _parser(module)
    ns, error = _parse(parser, args)
    if error:
        return [f"`python -m {module}` refuses {' '.join(args) or '(no arguments)'}: {error}; "
                f"see `python -m {module} --help` (docs/reference/cli.md)"]
    if ns is None:  # --help
        return []
    presets_elsewhere = bool(getattr(ns, "config_dir", None))
    if module == "flows.sweep":
        return _sweep_problems(ns, presets_elsewhere, compose)
    problems = []
    for name in OVERRIDE_ARGUMENTS:
        if isinstance(getattr(ns, name, None), list):
            problems += override_problems(getattr(ns, name), presets_elsewhere, compose)
    return problems


def _train_problems(args: list[str], compose: bool = True) -> list[str]:
    """flows.train: --help, --cfg and --config-dir DIR (flows/usage.py's command_line), then
    key=value and group=option overrides."""
    from flows.usage import UnknownFlags, command_line

    if any(a in ("-h", "--help") for a in args):
        return []
    rest, folders = [], []
    while args:
        arg = args.pop(0)
        if arg == "--config-dir":
            if not args:
                return ["--config-dir needs a directory: --config-dir DIR"]
            folders.append(args.pop(0))
        elif arg.startswith("--config-dir="):
            folders.append(arg.partition("=")[2])
        else:
            rest.append(arg)
    try:
        overrides, _ = command_line(rest)
    except UnknownFlags as exc:
        return [f"`python -m flows.train`: {exc}; it takes --help, --cfg, --config-dir DIR and key=value "
                "overrides (flows/usage.py, docs/reference/cli.md)"]
    return override_problems(overrides, bool(folders), compose)


def _sweep_problems(ns: Any, presets_elsewhere: bool, compose: bool = True) -> list[str]:
    """flows.sweep: what its main() checks before Prefect starts (the grid, seeds and protocol),
    and every configuration composed with the shared overrides."""
    from flows.sweep import protocol, settle
    from replay_pipeline.config import ConfigError

    try:
        configs, seeds, shared, _ = settle(ns.grid, dict(ns.config) if ns.config else None, ns.seeds,
                                           ns.overrides, ns.lr_factors)
        protocol(seeds, ns.selection_seeds, ns.grid, bool(ns.config))
    except ConfigError as exc:
        return [f"`python -m flows.sweep` refuses it: {' '.join(str(exc).split())}"]
    problems = override_problems(list(ns.overrides), presets_elsewhere, compose=False)
    if problems:
        return problems
    for name, extra in configs.items():
        for problem in override_problems([*shared, *extra], presets_elsewhere, compose):
            problems.append(f"configuration {name}: {problem}")
    return problems


def check_commands(root: Path = ROOT, pages: list[Path] | None = None) -> tuple[list[Command], list[str]]:
    """(every command of the pages, every problem as `path:line: ...`)."""
    commands, problems = [], []
    for page in pages if pages is not None else doc_pages(root):
        found, split = commands_in(page)
        commands += found
        problems += [p.replace(str(page), _rel(page, root), 1) for p in split]
    for command in commands:
        problems += [f"{command.where(root)}: {p}" for p in command_problems(command)]
    return commands, problems


# --- the commands that are cheap enough to run -----------------------------------------------

def not_runnable(command: Command) -> str | None:
    """Why `python -m flows.train --cfg` with this command's overrides is not run here (None:
    it is run): it names a saved run (resume, fork), presets elsewhere (--config-dir), a path or
    address of the writer's machine (its value starts with / or ~ or holds ://, or a Ray head's
    HOST:PORT in ray.address), a vLLM
    generator (a GPU), or a custom task or reward term (their code is imported)."""
    args = list(command.args)
    if any(a.startswith("--config-dir") for a in args):
        return "--config-dir"
    for arg in args:
        key, sep, value = arg.lstrip("+~").partition("=")
        if not sep:
            continue
        if key in ("resume", "fork"):
            return f"{key}= needs a saved run"
        if value.startswith(("/", "~")) or "://" in value or key == "ray.address":
            return f"{key}= names a path or address of another machine"
        if key in ("generator", "generator.backend") and value == "vllm":
            return "vLLM needs a GPU"
        if (key == "task" and value == "custom") or key.startswith(("task.target", "reward.terms")):
            return "imports the user's code"
    return None


def cli_blocks(text: str) -> list[tuple[str, str]]:
    """[(command, the text the page shows it printing)] of docs/reference/cli.md."""
    _, blocks = split_page(text)
    out = []
    for block in blocks:
        if block.lines and block.lines[0][1].startswith("$ "):
            out.append((block.lines[0][1][2:], "\n".join(line for _, line in block.lines[1:])))
    return out


def environment() -> dict[str, str]:
    """The environment a documented command runs in here: the usage width of the pages, this
    checkout first on the path."""
    import os

    env = dict(os.environ, COLUMNS=reference.COLUMNS)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def run(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m ...` as a process, from `cwd` (a scratch directory: a command may create its
    run root there)."""
    return subprocess.run([sys.executable, *args], cwd=cwd, env=environment(), capture_output=True, text=True,
                          timeout=timeout)


def _parallel(jobs: list[Any], work: Any, workers: int = 3) -> list[Any]:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(work, jobs))


def usage_problems(cli_text: str, cwd: Path, page: str = "docs/reference/cli.md") -> tuple[int, list[str]]:
    """(usage texts checked, problems): each `$ python -m ... --help` block of the command
    page run as a process, which must exit 0 printing exactly the block's text."""
    blocks = cli_blocks(cli_text)
    lines = cli_text.splitlines()

    def check(block: tuple[str, str]) -> str | None:
        command, shown = block
        number = next((i for i, line in enumerate(lines, 1) if line == f"$ {command}"), 0)
        done = run(shlex.split(command)[1:], cwd)
        if done.returncode != 0:
            return f"{page}:{number}: `{command}` exited {done.returncode}: {done.stderr.strip()[-500:]}"
        printed = done.stdout.rstrip("\n")
        if printed != shown:
            diff = difflib.unified_diff(shown.splitlines(), printed.splitlines(), "the page", "the command",
                                        n=0, lineterm="")
            return (f"{page}:{number}: `{command}` prints something else than the page shows; run "
                    "`python infra/reference.py`:\n" + "\n".join(list(diff)[:12]))
        return None

    return len(blocks), [p for p in _parallel(blocks, check) if p]


def cfg_problems(commands: list[Command], cwd: Path, root: Path = ROOT) -> tuple[int, list[str]]:
    """(override sets run, problems): `python -m flows.train --cfg` once per distinct override
    set of the training commands that can run here (`not_runnable`), as a process, which must
    exit 0 printing the configuration."""
    sets: dict[tuple[str, ...], list[Command]] = {}
    for command in commands:
        if (command.module != "flows.train" or command.elided or not_runnable(command)
                or any(a in ("-h", "--help") for a in command.args)):
            continue
        sets.setdefault(tuple(a for a in command.args if a != "--cfg"), []).append(command)

    def check(overrides: tuple[str, ...]) -> str | None:
        done = run(["-m", "flows.train", "--cfg", *overrides], cwd)
        if done.returncode == 0 and "\nloop:\n" in f"\n{done.stdout}":
            return None
        where = ", ".join(c.where(root) for c in sets[overrides])
        return (f"{where}: `python -m flows.train --cfg {' '.join(overrides)}` exited {done.returncode}: "
                f"{' '.join(done.stderr.split())[-600:]}")

    return len(sets), [p for p in _parallel(list(sets), check) if p]


def line_budget_problems(path: Path, limit: int, root: Path = ROOT) -> list[str]:
    """A page over its line budget."""
    count = len(path.read_text(encoding="utf-8").splitlines())
    if count <= limit:
        return []
    return [f"{_rel(path, root)} has {count} lines, over its budget of {limit}; move detail to a page under docs/ "
            "and link to it"]
