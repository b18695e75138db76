"""Loading the course's nbgrader configuration, with the folders a command needs."""

import functools
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
    """Put this environment's bin/ first on PATH, and have nbgrader ask `alembic` only once per process.

    nbgrader's gradebook runs `alembic`, and nbgrader starts kernels by name: they must be this
    environment's even when the command was started as .venv/bin/stepformer-course without activating it.
    """
    bin_dir = str(Path(sys.executable).parent)
    if os.environ.get("PATH", "").split(os.pathsep)[0] != bin_dir:
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    _alembic_once()


def _alembic_once() -> None:
    """Every new gradebook runs the `alembic` command (3 s of CPU) for the head revision of nbgrader's own
    migrations, a constant of the installed nbgrader: remember its answer for the rest of the process.

    A failed run (no `alembic` on PATH) is not remembered: it fails again, as it would without this.
    """
    import nbgrader.api

    if not hasattr(nbgrader.api.get_alembic_version, "cache_info"):
        nbgrader.api.get_alembic_version = functools.cache(nbgrader.api.get_alembic_version)


def api(config: Config):
    """An ``NbGraderAPI`` for ``config`` (imported late: nbgrader is slow to import)."""
    tools_on_path()
    from nbgrader.apps import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory

    return NbGraderAPI(CourseDirectory(config=config), config=config)
