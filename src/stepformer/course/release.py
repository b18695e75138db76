"""The student release: ``exercises/`` is nbgrader's ``generate_assignment`` of ``solutions/``, and each notebook's
Chinese twin in ``exercises/<assignment>/zh/`` (:mod:`stepformer.course.translation`)."""

import filecmp
import shutil
import tempfile
from pathlib import Path

from stepformer.course.nbgrader_setup import api, load_config
from stepformer.course.paths import assignments
from stepformer.course.translation import write_release_chinese


class ReleaseError(RuntimeError):
    """nbgrader could not generate an assignment."""


def release(root: Path, target: Path | None = None, names: list[str] | None = None,
            source: Path | None = None) -> Path:
    """Generate the release of ``names`` (default: all) into ``target`` (default: exercises/).

    ``source`` is the folder of source notebooks (default: solutions/), e.g. the class edition's.
    """
    target = (target or root / "exercises").resolve()
    folders = {"root": str(root)} if source is None else {"root": str(source.resolve().parent),
                                                           "source_directory": source.name}
    with tempfile.TemporaryDirectory(prefix="stepformer-release-") as work:
        config = load_config(
            root,
            **folders,
            release_directory=str(target),
            db_url=f"sqlite:///{Path(work) / 'gradebook.db'}",
        )
        grader = api(config)
        for name in names or assignments(root):
            result = grader.generate_assignment(name, force=True)
            if not result["success"]:
                raise ReleaseError(f"nbgrader generate_assignment {name} failed:\n{result['error']}\n{result['log']}")
    # Each notebook's Chinese twin, beside it in zh/ (stepformer.course.translation), in both editions. A missing
    # translation does not stop the English release: the twin is left out, said here, and `release --check` (and
    # the class edition's test) fail until it is written.
    for problem in write_release_chinese(root, target, names or assignments(root)):
        print(f"the Chinese notebook was not written: {problem}")
    return target


def differences(root: Path) -> list[str]:
    """Files where the committed exercises/ differ from a fresh release (empty: in sync)."""
    with tempfile.TemporaryDirectory(prefix="stepformer-fresh-") as fresh:
        release(root, Path(fresh))
        return _diff(Path(fresh), root / "exercises")


def _diff(a: Path, b: Path, prefix: str = "") -> list[str]:
    if not b.is_dir():
        return [f"{prefix or 'exercises/'} is missing"]
    comparison = filecmp.dircmp(a, b, ignore=["__pycache__", ".ipynb_checkpoints"])
    found = [f"{prefix}{name}: only in the fresh release" for name in comparison.left_only]
    found += [f"{prefix}{name}: not produced by nbgrader" for name in comparison.right_only]
    found += [
        f"{prefix}{name}: differs from a fresh release"
        for name in comparison.common_files
        if (a / name).read_bytes() != (b / name).read_bytes()
    ]
    for name in comparison.common_dirs:
        found += _diff(a / name, b / name, f"{prefix}{name}/")
    return found


def replace_release(root: Path, names: list[str] | None = None) -> None:
    """Regenerate exercises/ (or only the assignments ``names``), so that files removed from solutions/ go too."""
    with tempfile.TemporaryDirectory(prefix="stepformer-release-") as fresh:
        release(root, Path(fresh) / "exercises", names)
        for name in names or [None]:
            part = Path(*([name] if name else []))
            shutil.rmtree(root / "exercises" / part, ignore_errors=True)
            shutil.copytree(Path(fresh) / "exercises" / part, root / "exercises" / part)
