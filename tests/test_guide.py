"""The instructors' guide (autograder/README.md): every command in it runs as written.

Each command the guide shows is read out of it and checked against the tool that runs it: a
`make` target and its variables against the Makefile, a `stepformer-course` command against its
own argument parser, an `nbgrader` command against nbgrader's subcommands. The way-B set-up (an
nbgrader course folder outside the checkout) is then run for real, exactly as the guide writes it.
"""

import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "autograder" / "README.md"
BIN = Path(sys.executable).parent
PROGRAMS = ("make", "stepformer-course", "nbgrader", "jupyter")


def _commands(text: str) -> list[str]:
    """Every command line of the guide: in ```bash blocks and in `code spans` that start with a program."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                found.append(line)
    for span in re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S)):
        found.append(span.strip())
    commands = []
    for found_line in found:
        # "cd folder && cmd", "A=1 cmd", "../../.venv/bin/cmd": what matters is the program and its words.
        for part in re.split(r"\s*(?:&&|;|\|)\s*", found_line):
            words = part.split()
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                words = words[1:]
            if words and Path(words[0]).name in PROGRAMS and not words[0].startswith("-"):
                commands.append(" ".join([Path(words[0]).name, *words[1:]]))
    return commands


def _placeholder(command: str) -> bool:
    """A schematic line (``...``, ``<student>``) rather than one to run as it stands."""
    return "..." in command or re.search(r"<[a-z_ -]+>", command) is not None


COMMANDS = [c for c in _commands(GUIDE.read_text(encoding="utf-8")) if not _placeholder(c)]


def test_the_guide_shows_commands_of_each_tool():
    programs = {c.split()[0] for c in COMMANDS}
    assert {"make", "stepformer-course", "nbgrader"} <= programs, programs


def _makefile() -> tuple[set[str], set[str]]:
    text = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z-]*):", text, flags=re.M))
    variables = set(re.findall(r"\$\(([A-Z_]+)\)", text)) | set(re.findall(r"^([A-Z_]+) \?=", text, flags=re.M))
    return targets, variables


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.startswith("make")])
def test_make_commands_name_real_targets_and_variables(command):
    targets, variables = _makefile()
    words = shlex.split(command)[1:]
    assert words, command
    for word in words:
        if word.startswith("GRADE_FLAGS="):  # passed on to `stepformer-course grade`: its parser must take them
            _parses(["grade", "submissions", *shlex.split(word.split("=", 1)[1])])
        if "=" in word:
            assert word.split("=", 1)[0] in variables, f"{command}: the Makefile reads no {word.split('=')[0]}"
        else:
            assert word in targets, f"{command}: the Makefile has no target {word}"


def _parses(argv: list[str]) -> None:
    """``stepformer-course argv`` is accepted by the real parser (the command stops just after parsing)."""
    from stepformer.course import cli
    from stepformer.course.paths import CourseNotFound

    def stop(*_, **__):
        raise CourseNotFound("parsed")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cli, "course_root", stop)
        try:
            code = cli.main(argv)
        except SystemExit:  # argparse refused it
            raise AssertionError(f"stepformer-course {shlex.join(argv)}: refused by its parser") from None
    assert code == 2, argv


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.startswith("stepformer-course")])
def test_stepformer_course_commands_parse(command, capsys):
    argv = shlex.split(command)[1:]
    if len(argv) == 1:  # the prose names a command ("`stepformer-course feedback` writes ..."): it must exist
        from stepformer.course import cli

        with pytest.raises(SystemExit) as exit_:
            cli.main([*argv, "--help"])
        assert exit_.value.code == 0, f"{command}: no such command"
        return
    _parses(argv)


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.startswith("nbgrader")])
def test_nbgrader_commands_exist_in_this_nbgrader(command):
    from nbgrader.apps.nbgraderapp import NbGraderApp

    sub = shlex.split(command)[1]
    # `formgrade` is a stub in nbgrader 0.9 that only says the formgrader is now a Jupyter extension.
    assert sub in NbGraderApp.subcommands and sub != "formgrade", f"{command}: no such nbgrader command"


# Way B, as the guide's table writes it, in a course folder outside the checkout; the placeholders
# the guide uses are the only words replaced.
WAY_B = [
    "source {venv}/bin/activate",
    "stepformer-course class-edition --out . --assignment 03_multihead",
    "nbgrader generate_assignment 03_multihead --force",
    "nbgrader db assignment add 03_multihead --duedate '2026-12-01 17:00 Europe/Paris'",
    "stepformer-course grade --course . --assignment 03_multihead",
]


@pytest.mark.slow
def test_way_b_set_up_runs_as_written_in_a_course_folder_outside_the_checkout(tmp_path):
    text = GUIDE.read_text(encoding="utf-8")
    for step in WAY_B:
        shown = step.replace("{venv}", "/path/to/checkout/.venv")
        assert shown in text, f"the guide no longer says: {shown}"
    course = tmp_path / "course"
    course.mkdir()
    (course / "nbgrader_config.py").write_text(textwrap.dedent("""\
        c = get_config()
        c.CourseDirectory.course_id = "tf101"
        """))
    script = "set -e\n" + "\n".join(step.format(venv=BIN.parent) for step in WAY_B[:-1])
    # The last step grades what `nbgrader collect` left; nobody has submitted yet, so it must say so
    # (which it can only do once it has found the course checkout and the gradebook).
    script += "\n" + WAY_B[-1] + " && exit 1 || true\n"
    env = {k: v for k, v in os.environ.items() if k not in ("STEPFORMER_COURSE_ROOT", "VIRTUAL_ENV")}
    env["PATH"] = "/usr/bin:/bin"  # nothing of the course's environment until the guide's `source`
    run = subprocess.run(["bash", "-c", script], cwd=course, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "No such file or directory: 'alembic'" not in run.stderr
    assert "submitted/ folder: collect first" in run.stderr
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}", course_id="tf101") as gb:
        assignment = gb.find_assignment("03_multihead")
        assert assignment.duedate is not None and len(assignment.notebooks) == 1
    assert (course / "release" / "03_multihead" / "multihead.ipynb").is_file()
