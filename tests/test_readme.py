"""Every command in the README names files, make targets and flags that exist.

The commands themselves run elsewhere at reduced size (quickstart, train CLI and
`accelerate launch`, sample CLI, FID evaluator, feature extraction, kernel benchmark):
this test catches the README drifting from the code.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def readme_commands() -> list[str]:
    """Shell commands of the README's ```bash blocks (continuations joined)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


COMMANDS = readme_commands()
PY_COMMANDS = [c for c in COMMANDS if re.search(r"\b(scripts|eval)/\w+\.py\b", c)]


@cache
def help_text(script: str) -> str:
    proc = subprocess.run([sys.executable, str(ROOT / script), "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{script} --help failed: {proc.stderr[-2000:]}"
    return proc.stdout


def test_readme_opens_with_the_two_setup_commands() -> None:
    assert COMMANDS[:2] == ["make quickstart", "make test"]


def test_make_targets_exist() -> None:
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", makefile, flags=re.M))
    for command in COMMANDS:
        if command.startswith("make "):
            assert command.split()[1] in targets, command


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, flags=re.M)


@pytest.mark.parametrize("command", PY_COMMANDS)
def test_script_paths_configs_and_flags_exist(command: str) -> None:
    words = shlex.split(command)
    scripts = [w for w in words if w.endswith(".py") and "/" in w and w.split("/")[0] in
               ("scripts", "eval")]
    assert len(scripts) == 1, f"expected one script in: {command}"
    script = scripts[0]
    assert (ROOT / script).is_file(), script
    options = help_text(script)
    for word in words[words.index(script) + 1:]:
        if word.startswith("--"):
            flag = word.split("=")[0]
            assert re.search(rf"(^|[\s,\[]){re.escape(flag)}\b", options), (
                f"{script} has no option {flag} (README: {command})")
    for word in words:
        if word.startswith("configs/"):
            assert (ROOT / word).is_file(), word
