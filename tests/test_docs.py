"""The documentation is checked like code: its runnable blocks run, and its index of Notes is current.

Runnable blocks. A fenced block whose info string is `python runnable`, `bash runnable` or
`console runnable` (GitHub renders the first word; the second marks it for this test) in README.md
or docs/*.md is extracted and run, each in a fresh temporary folder with a 10-minute bound:
shell blocks with `bash -euo pipefail`, the project's interpreter first on PATH (so `python`,
`torchrun`, `elastic-finetune` are the ones `make` installed); Python blocks as the script
`__main__` of a fresh process forked from a server that has imported torch, transformers, peft and
the library once ([Note: ranks start from a fork server] in tests/_dist.py: the same reason, a
fresh interpreter pays ~10 s of CPU for those imports on the development VM), with one intra-op
thread. A runnable block must be quick: a tiny model built in code or the CLI's tiny model, a few
steps. Blocks that need a GPU, a hub, the real model or minutes are left unmarked and say so.

The index of Notes. Design reasoning lives in named `[Note: name]` blocks in the code
(python_api/, elastic_kernels/, csrc/, tests/, bench/; .py, C++/CUDA and .sh files). A Note is *defined* by a docstring or
comment line that is `[Note: name]` alone, followed by its text on the next lines of the same
docstring or comment, or by a line that starts with `[Note: name]` and goes on with a sentence
(`// [Note: CPU copies] Both ops ...`). Every other `[Note: name]` is a *reference*, including
`# [Note: name]: ...` and `# [Note: name]` above a line of code, the way code cites a Note where it
applies. A
reference whose name ends in "..." abbreviates: it matches the one definition whose name starts
with what precedes the dots. docs/notes.md lists every definition with its file, line and first
sentence; it is generated, never edited by hand:

    python tests/test_docs.py --write-notes-index

The tests fail when docs/notes.md differs from what that command writes, when a Note is defined
twice, and when a reference in the code, README.md, NOTES.md or docs/ names no definition (or an
abbreviation matches several).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import runpy
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```(\w+)([^\n`]*)\n(.*?)^```\s*$", re.M | re.S)
_LANGS = {"python": "python", "bash": "bash", "sh": "bash", "console": "bash"}
BLOCK_TIMEOUT_S = 600


def runnable_blocks(path: Path) -> list[tuple[str, int, str, str]]:
    """(id, line, language, code) of the blocks of `path` marked runnable."""
    text = path.read_text()
    out = []
    for m in _FENCE.finditer(text):
        lang, info, code = m.group(1), m.group(2).split(), m.group(3)
        if "runnable" not in info or lang not in _LANGS:
            continue
        line = text.count("\n", 0, m.start()) + 1
        rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        out.append((f"{rel}:{line}", line, _LANGS[lang], code))
    return out


BLOCKS = [b for p in DOCS if p.exists() for b in runnable_blocks(p)]

# What the server imports once before forking each Python block (as tests/_dist.py's _PRELOAD).
_PRELOAD = ["torch", "torch.distributed", "elastic_kernels", "elastic_kernels.api", "transformers", "peft"]


def _run_script(script: str, cwd: str, environ: dict, log: str) -> None:
    """A Python block in a forked process: its cwd, its environment, stdout and stderr to `log`,
    run as __main__; the exit status is the script's."""
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    import torch

    torch.set_num_threads(1)  # the server's OpenMP read its environment before this block's
    sys.argv = [script]
    sys.path.insert(0, cwd)
    status = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int) and exc.code is not None:
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _block_env() -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_block(lang: str, code: str, folder: Path) -> tuple[int | None, str]:
    """Run one block in `folder`: (exit status or None on timeout, its output)."""
    env = _block_env()
    if lang == "bash":
        try:
            proc = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=folder, env=env,
                                  capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            return None, f"{exc.stdout or ''}{exc.stderr or ''}"
        return proc.returncode, proc.stdout + proc.stderr
    script, log = folder / "block.py", folder / "block.log"
    script.write_text(code)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    proc = ctx.Process(target=_run_script, args=(str(script), str(folder), env, str(log)))
    proc.start()
    proc.join(BLOCK_TIMEOUT_S)
    if proc.is_alive():
        proc.kill()
        proc.join()
        return None, log.read_text() if log.exists() else ""
    return proc.exitcode, log.read_text() if log.exists() else ""


# ---------------------------------------------------------------------------------------------
# The index of Notes

NOTE_ROOTS = ("python_api", "elastic_kernels", "csrc", "tests", "bench")
NOTE_SUFFIXES = {".py", ".cpp", ".h", ".cu", ".cuh", ".sh"}
NOTES_INDEX = ROOT / "docs" / "notes.md"
REGENERATE = "python tests/test_docs.py --write-notes-index"
# Markdown whose references must resolve (docs/notes.md is generated from the definitions; the
# dated files under bench/results/ are records quoted verbatim, kept as they were written).
REF_DOCS = ("README.md", "NOTES.md", "docs")

# A comment or docstring line's lead: indentation, then `#`, `//`, `/*`, `*`, or a docstring's
# opening quotes.
_LEAD = re.compile(r"""^\s*(#+|//+|/\*+|\*+(?!/)|[rRbBuU]?(?:\"\"\"|'''))?\s*""")
_DEF = re.compile(r"^\[Note: ([^\]\n]+)\](?:\s*$|\s+(?=[A-Z]))")
_ITEM = re.compile(r"^\s*(?:#+|//+)?\s*[-*]\s")  # a list item of a comment or docstring
_REF = re.compile(r"\[Note:\s+([^\]]+?)\s*\]", re.S)
_REF_WRAP = re.compile(r"\s*\n\s*(?:#+|//+|\*+(?!/))?\s*")  # a reference wrapped over comment lines
_SENTENCE_END = re.compile(r"(?<!\be\.g)(?<!\bi\.e)(?<!\betc)(?<!\bvs)(?<!\bcf)\.(?=\s|$)")
FIRST_SENTENCE_MIN, FIRST_SENTENCE_MAX = 20, 300


@dataclass(frozen=True)
class Note:
    name: str
    path: str  # relative to the repository root
    line: int
    first_sentence: str


@dataclass(frozen=True)
class NoteRef:
    name: str
    path: str
    line: int


def _is_comment(lead: str | None) -> bool:
    return bool(lead) and lead.startswith(("#", "/", "*"))


def _paragraph(lines: list[str], start: int, comment: bool, first: str) -> str:
    """The text of a Note: `first` (what follows the name on its line) and the next lines of the
    same comment (or docstring), up to a blank line, a closing quote or the next Note."""
    words = [first] if first else []
    for raw in lines[start:]:
        m = _LEAD.match(raw)
        if comment and not _is_comment(m.group(1)):
            break
        text = raw[m.end():].strip()
        if not text or _DEF.match(text) or m.group(1) in ('"""', "'''"):
            break
        if words and _ITEM.match(raw):  # a list after the opening sentence: the sentence ends there
            break
        closing = re.search(r"(\"\"\"|''')", text)
        if closing:
            text = text[:closing.start()].strip()
            if text:
                words.append(text)
            break
        words.append(text)
    return " ".join(words)


def first_sentence(text: str) -> str:
    text = re.sub(r"^[-*]\s+", "", text.strip())
    m = _SENTENCE_END.search(text, FIRST_SENTENCE_MIN)  # "1." or "What moves." alone say little
    if m:
        text = text[:m.end()]
    if len(text) > FIRST_SENTENCE_MAX:
        text = _drop_open_span(text[:FIRST_SENTENCE_MAX].rsplit(" ", 1)[0]) + " ..."
    return text


def _drop_open_span(text: str) -> str:
    """`text` without a code span (`x`, ``x``) or emphasis (*x*) that a cut left open."""
    i, emph = 0, None  # emph: where an open *emphasis* started
    while i < len(text):
        run = re.match(r"`+|\*+", text[i:])
        if run is None:
            i += 1
        elif run.group()[0] == "`":  # a code span: skip to its closing run, stars inside included
            end = text.find(run.group(), i + len(run.group()))
            if end < 0:
                return text[:i if emph is None else emph].rstrip()
            i = end + len(run.group())
        else:
            emph = i if emph is None else None
            i += len(run.group())
    return text if emph is None else text[:emph].rstrip()


def scan_file(path: Path, rel: str) -> tuple[list[Note], list[NoteRef]]:
    """The Notes `path` defines and the references it makes (definitions excluded)."""
    text = path.read_text(errors="replace")
    lines = text.splitlines()
    defs, def_lines = [], set()
    for i, raw in enumerate(lines):
        m = _LEAD.match(raw)
        rest = raw[m.end():]
        d = _DEF.match(rest)
        if not d:
            continue
        comment, tail = _is_comment(m.group(1)), rest[d.end():].strip()
        body = _paragraph(lines, i + 1, comment, tail)
        if not body:  # `# [Note: X]` above code: a pointer to the Note, not its text
            continue
        defs.append(Note(d.group(1).strip(), rel, i + 1, first_sentence(body)))
        def_lines.add((i + 1, d.group(1).strip()))
    refs = []
    for m in _REF.finditer(text):
        name = _REF_WRAP.sub(" ", m.group(1)).strip()
        line = text.count("\n", 0, m.start()) + 1
        if not name.strip(". …") or (line, name) in def_lines:  # `[Note: ...]` is the generic form
            continue
        refs.append(NoteRef(name, rel, line))
    return defs, refs


def _code_files(root: Path):
    for top in NOTE_ROOTS:
        for path in sorted((root / top).rglob("*")):
            if path.suffix in NOTE_SUFFIXES and "__pycache__" not in path.parts and path.is_file():
                yield path


def scan_notes(root: Path = ROOT) -> tuple[list[Note], list[NoteRef]]:
    """Every Note defined in the code and every reference in the code and the docs."""
    defs, refs = [], []
    self_rel = Path(__file__).resolve().relative_to(ROOT).as_posix() if root == ROOT else None
    for path in _code_files(root):
        rel = path.relative_to(root).as_posix()
        if rel == self_rel:  # this file's docstring and patterns describe Notes, they cite none
            continue
        d, r = scan_file(path, rel)
        defs += d
        refs += r
    for entry in REF_DOCS:
        target = root / entry
        paths = sorted(target.glob("*.md")) if target.is_dir() else [target]
        for path in paths:
            if path.exists() and path.resolve() != (root / "docs" / "notes.md").resolve():
                refs += scan_file(path, path.relative_to(root).as_posix())[1]
    return sorted(defs, key=lambda n: (n.path, n.line)), refs


def resolve(name: str, names: set[str]) -> list[str]:
    """The definitions a reference names: itself, or for "prefix ..." every name with that prefix."""
    for dots in ("...", "…"):
        if name.endswith(dots):
            prefix = name[: -len(dots)].rstrip()
            return sorted(n for n in names if n.startswith(prefix))
    return [name] if name in names else []


def note_problems(defs: list[Note], refs: list[NoteRef]) -> list[str]:
    """Notes defined twice, references that name no definition or several."""
    problems, seen = [], {}
    for n in defs:
        if n.name in seen:
            first = seen[n.name]
            problems.append(f"[Note: {n.name}] is defined twice: {first.path}:{first.line} and {n.path}:{n.line}")
        seen.setdefault(n.name, n)
    names = set(seen)
    for r in refs:
        hits = resolve(r.name, names)
        if not hits:
            problems.append(f"{r.path}:{r.line}: [Note: {r.name}] is referenced but defined nowhere")
        elif len(hits) > 1:
            problems.append(f"{r.path}:{r.line}: [Note: {r.name}] abbreviates several Notes: {hits}")
    return sorted(problems)


_GROUPS = [
    ("csrc/", "The C++ and CUDA extension (csrc/)"),
    ("elastic_kernels/", "The mechanism layer (elastic_kernels/)"),
    ("python_api/", "The library and its application (python_api/, installed as elastic_kernels.api)"),
    ("tests/", "The tests (tests/)"),
    ("bench/", "The benchmarks (bench/)"),
]


def render_notes_index(defs: list[Note]) -> str:
    out = [
        "# Index of Notes",
        "",
        "Design reasoning lives in named `[Note: ...]` blocks beside the code it explains; code elsewhere",
        "cites them by name. This page lists every Note: where it is defined and its first sentence.",
        "NOTES.md gives the decisions by subject; this index finds the reasoning behind a line of code.",
        "",
        "Generated by `" + REGENERATE + "`; do not edit by hand.",
        f"`tests/test_docs.py` fails when this page is stale or a reference names no Note. {len(defs)} Notes.",
        "",
    ]
    for prefix, title in _GROUPS:
        group = sorted((n for n in defs if n.path.startswith(prefix)), key=lambda n: (n.path, n.line))
        if not group:
            continue
        out += [f"## {title}", ""]
        path = None
        for n in group:
            if n.path != path:
                if path is not None:
                    out.append("")
                path = n.path
                out += [f"### {path}", ""]
            out.append(f"- **{n.name}** ([line {n.line}](../{n.path}#L{n.line})): {n.first_sentence}")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def write_notes_index() -> Path:
    defs, _ = scan_notes()
    NOTES_INDEX.write_text(render_notes_index(defs))
    return NOTES_INDEX


# ---------------------------------------------------------------------------------------------
# Tests (pytest is imported here so that the regeneration command needs only the standard library)

if __name__ != "__main__":
    import pytest

    def test_the_readme_has_runnable_quick_starts():
        """The README's quick starts are run by this file, not only shown: removing their markers
        would silently stop checking them."""
        assert len(runnable_blocks(ROOT / "README.md")) >= 2

    def test_relative_links_resolve():
        """Every relative link of the README, NOTES.md and docs/ names a file or folder of the
        repository: a page that was renamed, moved or never written is a broken promise."""
        link = re.compile(r"\]\(([^)\s]+)\)")
        broken = []
        for page in [*DOCS, ROOT / "NOTES.md"]:
            text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks are not links
            for target in link.findall(text):
                if re.match(r"[a-z]+:", target) or target.startswith("#"):
                    continue
                path = (page.parent / target.split("#", 1)[0]).resolve()
                if not path.exists():
                    broken.append(f"{page.relative_to(ROOT)}: {target}")
        assert not broken, "links to nothing:\n" + "\n".join(broken)

    def test_every_dated_result_file_is_listed():
        """docs/benchmarks.md lists every dated result file under bench/results/ (the files
        NOTES.md and the docs cite for their figures), and each result file NOTES.md cites is
        one of them: a measurement moved out of NOTES.md lands in a listed, dated file."""
        page = (ROOT / "docs" / "benchmarks.md").read_text()
        dated = sorted(p.name for p in (ROOT / "bench" / "results").glob("20*.md"))
        unlisted = [name for name in dated if f"](../bench/results/{name})" not in page]
        assert not unlisted, "dated result files docs/benchmarks.md does not list: " + ", ".join(unlisted)
        cited = set(re.findall(r"\]\(bench/results/([^)#]+)\)", (ROOT / "NOTES.md").read_text()))
        undated = sorted(c for c in cited if c not in dated)
        assert not undated, "NOTES.md cites result files that are not dated <date>_<subject>.md: " + ", ".join(undated)

    def test_block_extraction_sees_markers_and_languages(tmp_path):
        doc = tmp_path / "x.md"
        doc.write_text("a\n```python runnable\nprint(1)\n```\n```python\nskip\n```\n```bash runnable\necho hi\n```\n"
                       "```text runnable\nnot code\n```\n")
        got = [(line, lang, code) for _, line, lang, code in runnable_blocks(doc)]
        assert got == [(2, "python", "print(1)\n"), (8, "bash", "echo hi\n")]

    def test_a_failing_block_fails(tmp_path):
        """The runner reports a Python block's exception and exit status, and its output."""
        status, out = run_block("python", "print('before')\nraise ValueError('boom')\n", tmp_path)
        assert status == 1 and "before" in out and "ValueError: boom" in out
        status, out = run_block("python", "import sys\nsys.exit(3)\n", tmp_path)
        assert status == 3
        status, out = run_block("bash", "echo x; false\n", tmp_path)
        assert status == 1 and "x" in out

    @pytest.mark.parametrize("block", BLOCKS, ids=[b[0] for b in BLOCKS])
    def test_runnable_block(block, tmp_path):
        where, _, lang, code = block
        status, out = run_block(lang, code, tmp_path)
        assert status == 0, (
            f"{where}: " + ("timed out" if status is None else f"exited {status}") + f"\n--- output (tail)\n{out[-6000:]}")

    def test_notes_index_is_current():
        defs, _ = scan_notes()
        want = render_notes_index(defs)
        have = NOTES_INDEX.read_text() if NOTES_INDEX.exists() else ""
        assert have == want, (
            f"docs/notes.md is stale (Notes were added, renamed, moved or reworded); regenerate it with: {REGENERATE}")

    def test_every_note_reference_names_one_definition():
        defs, refs = scan_notes()
        problems = note_problems(defs, refs)
        assert not problems, "\n".join(problems)

    _PY_FIXTURE = """\"\"\"Module.

<<alpha beta>>
Alpha is first, e.g. before beta. Then more.

<<gamma>>
- Gamma in a list; see <<alpha>> and <<alpha
  beta>> wrapped.
\"\"\"

# <<delta>>
# Delta: the comment form.

x = 1  # <<gamma>>
# <<gamma>>
y = 2
# see <<alpha be ...>> and <<...>>
"""
    _CPP_FIXTURE = """// <<epsilon>> Starts on the name's line
// and goes on. Second.
int x;
// <<zeta>>: a reference with a colon, not a definition.
// <<epsilon>>: cites the Note above.
"""

    def _notes(text):  # this file's own text must not read as Notes
        return text.replace("<<", "[" + "Note: ").replace(">>", "]")

    def test_first_sentence_is_cut_cleanly():
        """Abbreviations do not end a sentence, a too-short opening does not either, and a cut of a
        long sentence closes no code span it opened (the index stays valid markdown)."""
        assert first_sentence("- One thing, e.g. this one, goes first. Then another.") == \
            "One thing, e.g. this one, goes first."
        assert first_sentence("1. Who is where: every rank contributes. 2. The creator.") == \
            "1. Who is where: every rank contributes."
        long = "word " * 55 + "``x * y`` and `z` " + "more " * 30
        cut = first_sentence(long)
        assert cut.endswith(" ...") and len(cut) <= FIRST_SENTENCE_MAX + 4
        assert cut.count("``") % 2 == 0 and cut.replace("``", "").count("`") % 2 == 0
        assert _drop_open_span("a ``r*c`` *em b") == "a ``r*c``"

    def test_note_scanner_on_every_form(tmp_path):
        """Definitions alone on a line (comment or docstring), with a sentence after the name, a
        pointer above code (not a definition), references wrapped over lines, abbreviations."""
        (tmp_path / "python_api").mkdir()
        (tmp_path / "csrc").mkdir()
        (tmp_path / "python_api" / "m.py").write_text(_notes(_PY_FIXTURE))
        (tmp_path / "csrc" / "k.cpp").write_text(_notes(_CPP_FIXTURE))
        defs, refs = scan_notes(tmp_path)
        assert [(n.name, n.path, n.line, n.first_sentence) for n in defs] == [
            ("epsilon", "csrc/k.cpp", 1, "Starts on the name's line and goes on."),
            ("alpha beta", "python_api/m.py", 3, "Alpha is first, e.g. before beta."),
            ("gamma", "python_api/m.py", 6, _notes("Gamma in a list; see <<alpha>> and <<alpha beta>> wrapped.")),
            ("delta", "python_api/m.py", 11, "Delta: the comment form."),
        ]
        assert sorted((r.name, r.path, r.line) for r in refs) == [
            ("alpha", "python_api/m.py", 7), ("alpha be ...", "python_api/m.py", 17),
            ("alpha beta", "python_api/m.py", 7), ("epsilon", "csrc/k.cpp", 5),
            ("gamma", "python_api/m.py", 14), ("gamma", "python_api/m.py", 15), ("zeta", "csrc/k.cpp", 4)]
        assert note_problems(defs, refs) == [
            _notes("csrc/k.cpp:4: <<zeta>> is referenced but defined nowhere"),
            _notes("python_api/m.py:7: <<alpha>> is referenced but defined nowhere"),
        ]
        assert resolve("alpha be ...", {"alpha beta", "alpha bet", "gamma"}) == ["alpha bet", "alpha beta"]
        several = note_problems(defs + [Note("alpha bet", "x.py", 1, "")], [NoteRef("alpha be ...", "y.py", 2)])
        assert several == [_notes("y.py:2: <<alpha be ...>> abbreviates several Notes: ['alpha bet', 'alpha beta']")]
        twice = note_problems(defs + [Note("delta", "z.py", 9, "")], [])
        assert twice == [_notes("<<delta>> is defined twice: python_api/m.py:11 and z.py:9")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write-notes-index", action="store_true", help="regenerate docs/notes.md from the code")
    parser.add_argument("--check-notes", action="store_true", help="list dangling or duplicate Notes; exit 1 if any")
    args = parser.parse_args(argv)
    if not (args.write_notes_index or args.check_notes):
        parser.error("nothing to do: --write-notes-index or --check-notes (the tests run under pytest)")
    status = 0
    if args.write_notes_index:
        path = write_notes_index()
        print(f"wrote {path.relative_to(ROOT)} ({len(scan_notes()[0])} Notes)")
    defs, refs = scan_notes()
    for problem in note_problems(defs, refs):
        print(problem, file=sys.stderr)
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
