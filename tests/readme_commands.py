"""The documentation's commands: the words of the README and of every page in docs/, and
the argv each command runs on this machine.

For tests/test_readme.py, which runs or checks every one of them, and for the tests that
run a documented command themselves (tests/test_quickstart.py) or read a page's example
(`page`). Import with ``from readme_commands import ...`` (pytest puts tests/ on sys.path).

A command is taken as the README writes it. Running it here changes only what names this
machine: `python`, `accelerate` and `.venv/bin/...` are the virtual environment running the
tests, the repository's own files (``scripts/``, ``configs/``, ``eval/``, ``tests/``) are
given as absolute paths so the command runs in any folder, and a ``make`` command runs the
recipe ``make -n`` prints for it (with that virtual environment, the install step
assumed done).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The tested pages: the README, the front door, then the reference pages of docs/.
PAGES = ("README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")))


def page(name: str) -> str:
    """The text of a tested page (`PAGES`: "README.md", "docs/sampling.md", ...)."""
    assert name in PAGES, f"{name} is not one of {PAGES}"
    return (ROOT / name).read_text()


def section(name: str, heading: str) -> str:
    """The text of page `name` under the heading line `heading` (e.g. "## Layout"), up to
    the next heading of the same or a higher level."""
    level = len(heading.split(" ")[0])
    lines, out, inside, code = page(name).splitlines(), [], False, False
    for line in lines:
        if line.startswith("```"):
            code = not code
        elif not code and re.match(r"#+ ", line):
            if inside and len(line.split(" ")[0]) <= level:
                break
            if line == heading:
                inside = True
                continue
        if inside:
            out.append(line)
    assert inside, f"{name} has no heading {heading!r}"
    return "\n".join(out)


README = page("README.md")
VENV = Path(sys.executable).parents[1]  # the environment running the tests (make's VENV)
REPO_FOLDERS = ("scripts/", "configs/", "eval/", "tests/")
# A code span that is a whole command, e.g. `make quickstart ARGS="--threads 1"`.
INLINE_COMMAND = re.compile(r"`((?:make|python|accelerate) [^`]+)`")


def bash_commands(text: str = README) -> list[str]:
    """Shell commands of the ```bash blocks, line continuations joined, comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = " ".join(line.split(" #")[0].split())
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def inline_commands(text: str = README) -> list[str]:
    """Whole commands written inline in the prose (`make ...`, `python ...`)."""
    return [" ".join(c.split()) for c in INLINE_COMMAND.findall(text)]


def readme_commands(text: str | None = None) -> list[str]:
    """Every command of `text`, once each, in order of first appearance; without `text`,
    of every page (`PAGES`: the README's first)."""
    texts = [text] if text is not None else [page(name) for name in PAGES]
    return list(dict.fromkeys(c for t in texts for c in bash_commands(t) + inline_commands(t)))


# What a running make hands its children: its flags and its command-line variables.
MAKE_VARIABLES = ("MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES", "MAKELEVEL")


def outside_make(environ: dict[str, str] | os._Environ) -> dict[str, str]:
    """`environ` without what an enclosing make passes down: under `make test ARGS=...`
    the suite's environment holds `MAKEFLAGS= -- ARGS=...` and `ARGS` itself, and a make
    run by a test would take that ARGS as its own (the README's `make quickstart` would
    run with pytest's options). Command-line variables are dropped by name too."""
    assigned = environ.get("MAKEFLAGS", "").partition(" -- ")[2]
    names = {word.split("=", 1)[0] for word in shlex.split(assigned) if "=" in word}
    return {k: v for k, v in environ.items()
            if k not in MAKE_VARIABLES and k not in names and k != "ARGS"}


def make_recipe(command: str) -> list[str]:
    """The shell lines a README `make ...` command runs (`make -n`)."""
    words = shlex.split(command)
    assert words[0] == "make", command
    proc = subprocess.run(
        ["make", "-n", "--no-print-directory", "-C", str(ROOT), "-o", str(VENV / ".installed"),
         f"VENV={VENV}", *words[1:]], capture_output=True, text=True, timeout=60,
        env=outside_make(os.environ))
    assert proc.returncode == 0, f"{command}: {proc.stderr}"
    return [line for line in proc.stdout.splitlines() if line and not line.startswith("make:")]


def localize(words: list[str]) -> list[str]:
    """Words of a command as they run here: this environment's programs, the repository's
    files by absolute path; everything else (outputs, data) stays relative to the cwd."""
    out = []
    for i, word in enumerate(words):
        if i == 0 and word in ("python", "python3"):
            word = sys.executable
        elif i == 0 and word == "accelerate":
            word = str(VENV / "bin" / "accelerate")
        elif word.startswith(".venv/"):
            word = str(VENV / word.removeprefix(".venv/"))
        elif word.startswith(REPO_FOLDERS) and (ROOT / word).exists():
            word = str(ROOT / word)
        out.append(word)
    return out


def split_env(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """Leading `NAME=value` words (environment) and the command after them."""
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        name, value = words[0].split("=", 1)
        env[name] = value
        words = words[1:]
    return env, words


def command_line(command: str) -> tuple[dict[str, str], list[str]]:
    """The environment variables a README command sets and the argv it runs here (a
    `make` command: its one-line recipe)."""
    env, words = split_env(shlex.split(command))
    if words[0] == "make":
        lines = make_recipe(command)
        assert len(lines) == 1, f"{command} runs {len(lines)} lines: {lines}"
        env, words = split_env(shlex.split(lines[0]))
    return env, localize(words)


def argv(command: str) -> list[str]:
    """The argv a README command that sets no environment variables runs here."""
    env, words = command_line(command)
    assert not env, f"{command} sets {env}"
    return words
