"""Feedback settings that hide the hidden checks wherever nbgrader makes a page; no notebook is graded here.

The pages themselves are checked where something is graded: ``test_grading.py`` (the grader, the
``feedback`` command, nbgrader started in the work folder) and ``test_exchange.py`` (way B).
"""

import json
from pathlib import Path

import pytest
from traitlets.config.loader import PyFileConfigLoader

from stepformer.course.cli import main
from stepformer.course.feedback import (
    FEEDBACK_PREPROCESSORS,
    config_problem,
    course_config_note,
    write_work_config,
)
from stepformer.course.grade import MARKER

ROOT = Path(__file__).resolve().parents[1]
SAFE_LINE = f"c.GenerateFeedback.preprocessors = {FEEDBACK_PREPROCESSORS!r}\n"


def _load(folder: Path):
    return PyFileConfigLoader("nbgrader_config.py", path=str(folder)).load_config()


def test_the_courses_own_configuration_makes_safe_feedback():
    assert config_problem(ROOT / "autograder") is None


def test_the_work_folders_configuration_names_its_gradebook_and_makes_safe_feedback(tmp_path, monkeypatch):
    monkeypatch.delenv("STEPFORMER_DB_URL", raising=False)
    assert write_work_config(tmp_path) is None
    assert config_problem(tmp_path) is None
    directory = _load(tmp_path).CourseDirectory
    assert directory.root == str(tmp_path) and directory.submitted_directory == "submitted"
    assert directory.db_url == f"sqlite:///{tmp_path}/gradebook.db" and directory.course_id == "stepformer"
    # The gradebook the grader uses is read when nbgrader starts, as the grader reads it.
    monkeypatch.setenv("STEPFORMER_DB_URL", "postgresql+psycopg2://grader@/stepformer_01")
    assert _load(tmp_path).CourseDirectory.db_url == "postgresql+psycopg2://grader@/stepformer_01"
    # An outdated file of the grader's is brought up to date; a file of someone else's is left as it is.
    (tmp_path / "nbgrader_config.py").write_text((tmp_path / "nbgrader_config.py").read_text() + "c.X.y = 1\n")
    assert write_work_config(tmp_path) is None and "c.X.y" not in (tmp_path / "nbgrader_config.py").read_text()
    (tmp_path / "nbgrader_config.py").write_text("c = get_config()\nc.Execute.timeout = 5\n")
    note = write_work_config(tmp_path)
    assert "was not written by the grader and was left as it is" in note and "ClearHiddenTests" in note
    assert (tmp_path / "nbgrader_config.py").read_text() == "c = get_config()\nc.Execute.timeout = 5\n"


def test_an_instructors_course_configuration_is_never_changed_and_unsafe_feedback_is_named(tmp_path):
    course = tmp_path / "course"
    course.mkdir()
    own = 'c = get_config()\nc.CourseDirectory.course_id = "tf101"\n'
    (course / "nbgrader_config.py").write_text(own)
    note = course_config_note(course)
    assert note.startswith("warning: ") and "ClearHiddenTests and ShortTracebacks" in note
    assert SAFE_LINE.strip() in note  # the line to add, exactly
    assert (course / "nbgrader_config.py").read_text() == own
    # With the line added (what the guide says to do), nothing to say.
    (course / "nbgrader_config.py").write_text(own + SAFE_LINE)
    assert course_config_note(course) is None
    # One that nbgrader could not load would be skipped by it: named too.
    (course / "nbgrader_config.py").write_text(own + "import no_such_module\n" + SAFE_LINE)
    assert "could not be loaded (ModuleNotFoundError" in course_config_note(course)
    # A course without a configuration gets one that sets the feedback alone.
    bare = tmp_path / "bare"
    bare.mkdir()
    assert course_config_note(bare).startswith(f"note: wrote {bare / 'nbgrader_config.py'}")
    assert config_problem(bare) is None and dict(_load(bare)) == {"GenerateFeedback": {
        "preprocessors": FEEDBACK_PREPROCESSORS}}


def test_the_feedback_command_refuses_a_folder_it_cannot_use_and_creates_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("STEPFORMER_COURSE_ROOT", str(ROOT))
    monkeypatch.delenv("STEPFORMER_DB_URL", raising=False)
    course = tmp_path / "course"
    (course / "submitted").mkdir(parents=True)
    assert main(["feedback", "--workdir", str(course), "--assignment", "01_attention"]) == 2
    assert "is not a work folder of this grader" in capsys.readouterr().err
    assert main(["feedback", "--workdir", str(tmp_path / "absent"), "--assignment", "01_attention"]) == 2
    assert "is not a folder" in capsys.readouterr().err
    work = tmp_path / "work"
    work.mkdir()
    (work / MARKER).write_text(json.dumps({"fingerprints": {}}))
    assert main(["feedback", "--workdir", str(work), "--assignment", "01_attention"]) == 2
    assert f"no gradebook at {work / 'gradebook.db'}" in capsys.readouterr().err
    assert not (work / "gradebook.db").exists() and not (course / "gradebook.db").exists()
    with pytest.raises(SystemExit):  # argparse: one folder or the other
        main(["feedback", "--workdir", str(work), "--course", str(course), "--assignment", "01_attention"])
