"""Loading the course's nbgrader configuration, with the folders a command needs."""

import os
import sys
from pathlib import Path

from traitlets.config import Config
from traitlets.config.loader import PyFileConfigLoader


def load_config(course: Path, **course_directory: str) -> Config:
    """``autograder/nbgrader_config.py``, with ``CourseDirectory`` traits overridden."""
    config = PyFileConfigLoader("nbgrader_config.py", path=str(course / "autograder")).load_config()
    for name, value in course_directory.items():
        setattr(config.CourseDirectory, name, value)
    return config


def tools_on_path() -> None:
    """Put this environment's bin/ first on PATH.

    nbgrader's gradebook runs `alembic`, and nbgrader starts kernels by name: they must be this
    environment's even when the command was started as .venv/bin/stepformer-course without activating it.
    """
    bin_dir = str(Path(sys.executable).parent)
    if os.environ.get("PATH", "").split(os.pathsep)[0] != bin_dir:
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def api(config: Config):
    """An ``NbGraderAPI`` for ``config`` (imported late: nbgrader is slow to import)."""
    tools_on_path()
    from nbgrader.apps import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory

    return NbGraderAPI(CourseDirectory(config=config), config=config)
