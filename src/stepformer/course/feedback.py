"""What students see in their feedback: their scores as the gradebook holds them, never the hidden checks.

Feedback is made from the gradebook (:func:`generate`), after grading and after the instructor's
manual scores are back, so a page always says what ``grades.csv`` and the exports say. Every path
that makes a page uses the preprocessors of :data:`FEEDBACK_PREPROCESSORS`: the grader, the
``stepformer-course feedback`` command, and nbgrader's own ``generate_feedback`` (or formgrader's
"Generate Feedback" button) in a folder whose ``nbgrader_config.py`` sets them (:func:`work_config`
writes the work folder's; :func:`config_problem` checks a course's).
"""

import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from nbconvert.preprocessors import Preprocessor
from nbgrader import utils
from tqdm import tqdm

# nbgrader's own (GetGrades: scores, manual ones included, and comments from the gradebook), then what
# keeps the hidden checks hidden. Dotted names rather than classes, so that an nbgrader_config.py can
# set them without importing this package: a config file that fails to import is skipped whole by
# nbgrader, which would silently bring back its defaults (hidden tests shown), whereas a name that
# does not import makes generate_feedback fail, and no page is written.
FEEDBACK_PREPROCESSORS = [
    "nbgrader.preprocessors.GetGrades",
    "nbconvert.preprocessors.CSSHTMLHeaderPreprocessor",
    "nbgrader.preprocessors.ClearHiddenTests",
    "stepformer.course.feedback.ShortTracebacks",
]
# What a page must be made with: without either, hidden checks or their tracebacks reach students.
REQUIRED = ("ClearHiddenTests", "ShortTracebacks")

WORK_CONFIG_HEADER = "# nbgrader_config.py of a grading work folder, written by stepformer-course."


class ShortTracebacks(Preprocessor):
    """Cut a graded cell's traceback down to its last line (the check's message).

    nbgrader clears hidden tests from a cell's source, but a failing hidden check's traceback
    quotes the lines around it; the message itself says what is wrong and where to look.
    """

    enabled = True

    def preprocess_cell(self, cell, resources, index):
        if cell.cell_type == "code" and utils.is_grade(cell):
            for output in cell.get("outputs", []):
                if output.output_type == "error":
                    output.traceback = [f"{output.ename}: {output.evalue}"]
        return cell, resources


class FeedbackError(ValueError):
    """Feedback cannot be made at all (no gradebook entry for the assignment, an unknown student)."""


@dataclass
class Feedback:
    """What :func:`generate` did: each student's pages, and why a student has none."""

    pages: dict[str, list[Path]] = field(default_factory=dict)  # student -> pages written in course/feedback
    failed: dict[str, str] = field(default_factory=dict)  # student -> what went wrong (one line)


def safe_feedback(config) -> None:
    """Make ``config``'s feedback hide the hidden checks (``c`` of an nbgrader_config.py, or a traitlets Config)."""
    config.GenerateFeedback.preprocessors = list(FEEDBACK_PREPROCESSORS)


def generate(root: Path, course: Path, assignment: str, students: list[str] | None = None, out: Path | None = None,
             *, progress: bool = True) -> Feedback:
    """Write every (or each given) student's feedback for ``assignment`` from the gradebook of ``course``.

    ``course`` is the grader's work folder or an nbgrader course folder; the pages go to
    ``course/feedback/<student>/<assignment>/`` (where formgrader and ``nbgrader release_feedback``
    look), made by nbgrader's GenerateFeedback with the course's configuration and
    :data:`FEEDBACK_PREPROCESSORS`: scores as the gradebook holds them (a manual score wins), the
    instructor's comments, hidden checks cleared, tracebacks of checks cut to their message. With
    ``out``, each student's pages are also copied to ``out/feedback/<student>/<assignment>/``.

    ``students`` defaults to everyone with an autograded submission of ``assignment``. A student whose
    pages cannot be made is named in ``Feedback.failed`` and the others go on; that student's old page
    in ``out`` (if any) is left as it was.
    """
    from nbgrader.api import MissingEntry

    from stepformer.course.nbgrader_setup import api
    from stepformer.course.worker import course_config

    course = course.resolve()
    config = course_config(root, course)
    db_url = config.CourseDirectory.db_url
    # nbgrader would create an empty gradebook where none is: say where none was found instead.
    if db_url.startswith("sqlite:///") and not Path(db_url.removeprefix("sqlite:///")).is_file():
        raise FeedbackError(f"no gradebook at {db_url.removeprefix('sqlite:///')}: grade {assignment} there first "
                            "(or set STEPFORMER_DB_URL to the gradebook the grading used)")
    safe_feedback(config)
    grader = api(config)
    with grader.gradebook as gb:
        try:
            submitted = {s.student.id for s in gb.find_assignment(assignment).submissions}
        except MissingEntry:
            raise FeedbackError(f"{assignment} is not in the gradebook of {course}: grade it first") from None
    autograded = course / "autograded"
    if students is None:
        students = sorted(s for s in submitted if (autograded / s / assignment).is_dir())
    elif unknown := sorted(set(students) - submitted):
        raise FeedbackError(f"no graded submission of {assignment} in {course} for: {', '.join(unknown)}")
    result = Feedback()
    for student in tqdm(students, desc=f"feedback {assignment}", unit="student", disable=not progress):
        made = grader.generate_feedback(assignment, student, force=True)
        folder = course / "feedback" / student / assignment
        pages = sorted(folder.glob("*.html")) if made["success"] else []
        if not pages:
            result.failed[student] = _problem(made, autograded / student / assignment)
            continue
        result.pages[student] = pages
        if out is not None:
            _copy_files(folder, out.resolve() / "feedback" / student / assignment)
    return result


def _problem(made: dict, source: Path) -> str:
    """One line saying what nbgrader reported (its whole log goes to stderr)."""
    text = "\n".join(filter(None, [made.get("log"), made.get("error")]))
    print(text, file=sys.stderr)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    causes = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b.*:", line)]
    errors = [line for line in lines if "[ERROR]" in line and "Please see" not in line]
    found = (causes or errors or lines or [f"no page was written from {source}"])[-1]
    return f"feedback not written ({found[:300]}); an earlier page may still be in the output folder"


def _copy_files(source: Path, target: Path) -> None:
    """Copy the plain files under ``source`` into ``target`` (links and special files are never followed)."""
    for path in sorted(source.rglob("*")):
        if path.is_file() and not path.is_symlink():
            destination = target / path.relative_to(source)
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, destination)


def work_config() -> str:
    """The text of a grading work folder's ``nbgrader_config.py``.

    nbgrader's own commands and formgrader (a Jupyter server started in the folder) read it: the
    folder's layout, the grader's gradebook (``STEPFORMER_DB_URL`` where set, as for the grader) and
    course id, and the feedback preprocessors, so formgrader's "Generate Feedback" button and
    ``nbgrader generate_feedback`` hide the hidden checks. Plain Python with no import of this package:
    a config that fails to import would be skipped by nbgrader (see :data:`FEEDBACK_PREPROCESSORS`).
    """
    from stepformer.course.worker import COURSE_ID

    return "\n".join([
        WORK_CONFIG_HEADER,
        "# It is written again on every grading run: change the course's settings in autograder/nbgrader_config.py.",
        "import os",
        "",
        "c = get_config()  # noqa: F821",
        "# This file's own folder, wherever the work folder has been moved.",
        "c.CourseDirectory.root = os.path.dirname(os.path.abspath(__file__))",
        *(f"c.CourseDirectory.{name}_directory = {name!r}"
          for name in ("source", "release", "submitted", "autograded", "feedback")),
        "# The grader's gradebook, as stepformer.course.worker.course_config names it.",
        "c.CourseDirectory.db_url = (os.environ.get('STEPFORMER_DB_URL')",
        "                            or 'sqlite:///' + os.path.join(c.CourseDirectory.root, 'gradebook.db'))",
        f"c.CourseDirectory.course_id = {COURSE_ID!r}",
        "# Feedback: hidden checks cleared, tracebacks of checks cut to their message.",
        f"c.GenerateFeedback.preprocessors = {FEEDBACK_PREPROCESSORS!r}",
        "",
    ])


def write_work_config(workdir: Path) -> str | None:
    """Write (or bring up to date) the work folder's ``nbgrader_config.py``; a note when one is left alone.

    Only a file this grader wrote (it starts with :data:`WORK_CONFIG_HEADER`) is replaced; any other is kept
    and named, with what it lacks.
    """
    path = workdir / "nbgrader_config.py"
    text = work_config()
    if path.is_file() and not path.read_text(errors="replace").startswith(WORK_CONFIG_HEADER):
        problem = config_problem(workdir)
        return f"{path} was not written by the grader and was left as it is" + (f"; {problem}" if problem else "")
    if not path.is_file() or path.read_text() != text:
        tmp = workdir / f".nbgrader_config.py.{os.getpid()}.tmp"
        tmp.write_text(text)
        os.replace(tmp, path)
    return None


def config_problem(folder: Path) -> str | None:
    """What would make nbgrader's own feedback in ``folder`` show the hidden checks, or None when nothing would.

    nbgrader's ``generate_feedback``, ``release_feedback`` and formgrader's "Generate Feedback" button read
    ``nbgrader_config.py`` from the folder they are started in; a page made without ClearHiddenTests shows
    the hidden checks, one without ShortTracebacks the lines around a failing one.
    """
    from traitlets.config.loader import PyFileConfigLoader

    path = folder / "nbgrader_config.py"
    lines = "c.GenerateFeedback.preprocessors = " + repr(FEEDBACK_PREPROCESSORS)
    if not path.is_file():
        return f"{folder} has no nbgrader_config.py; nbgrader's own feedback there would show the hidden checks"
    try:
        config = PyFileConfigLoader(path.name, path=str(folder)).load_config()
    except Exception as error:  # nbgrader skips a config it cannot load, falling back to its defaults
        return (f"{path} could not be loaded ({type(error).__name__}: {error}); nbgrader would skip it and its "
                "own feedback would show the hidden checks")
    names = [p if isinstance(p, str) else f"{p.__module__}.{p.__qualname__}"
             for p in config.GenerateFeedback.get("preprocessors", [])]
    missing = [need for need in REQUIRED if not any(name.rsplit(".", 1)[-1] == need for name in names)]
    if missing:
        return (f"{path} does not set GenerateFeedback.preprocessors with {' and '.join(missing)}: nbgrader's own "
                f"generate_feedback and formgrader's \"Generate Feedback\" would show the hidden checks; add "
                f"this line to it: {lines}")
    return None


def course_config_note(course: Path) -> str | None:
    """For an nbgrader course folder (way B): a ``note:`` or ``warning:`` line about its feedback settings, or None.

    A course without ``nbgrader_config.py`` gets one that sets only the feedback preprocessors; an
    instructor's own file is never changed: if nbgrader's feedback there would show the hidden checks, the
    warning says which line to add.
    """
    path = course / "nbgrader_config.py"
    if not path.exists():
        path.write_text("\n".join([
            "# Written by stepformer-course: nbgrader's own feedback (generate_feedback, release_feedback's pages,",
            "# formgrader's \"Generate Feedback\") must hide the hidden checks. Add your course's settings below.",
            "c = get_config()  # noqa: F821",
            f"c.GenerateFeedback.preprocessors = {FEEDBACK_PREPROCESSORS!r}",
            "",
        ]))
        return f"note: wrote {path}, which makes nbgrader's own feedback there hide the hidden checks"
    problem = config_problem(course)
    return f"warning: {problem}" if problem else None


def feedback_command(root: Path, assignment: str, *, workdir: Path | None = None, course: Path | None = None,
                     out: Path | None = None, only: list[str] | None = None) -> int:
    """``stepformer-course feedback``: the pages of ``assignment`` made again from the gradebook; the exit status."""
    from stepformer.course.grade import MARKER

    folder = (course or workdir or root / "autograder" / "work" / "grading").resolve()
    try:
        if not folder.is_dir():
            raise FeedbackError(f"{folder} is not a folder: say where the grading happened (--workdir, --course)")
        if course is None and not (folder / MARKER).is_file():
            raise FeedbackError(f"{folder} is not a work folder of this grader (it has no {MARKER}); for an nbgrader "
                                "course folder use --course")
        # Formgrader's button and nbgrader's own commands in this folder must make pages as safe as these.
        note = course_config_note(folder) if course else write_work_config(folder)
        made = generate(root, folder, assignment, only, out)
    except FeedbackError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if note:
        print(note if course else f"warning: {note}", file=sys.stderr)
    for student, problem in made.failed.items():
        print(f"error: {student}: {problem}", file=sys.stderr)
    where = f"{folder / 'feedback'}/<student>/{assignment}/" + (
        f" and {out.resolve() / 'feedback'}/<student>/{assignment}/" if out else "")
    print(f"feedback of {len(made.pages)} student(s) written from the gradebook to {where}")
    return 1 if made.failed else 0
