"""Read a folder (or zip) of student submissions into one checked, normalised record per student.

Whatever students upload, this never raises for one student's mistake: each problem becomes a short
sentence on that student's :class:`Intake`, so the report has one line per student. Only a source that
cannot be read at all raises :class:`SubmissionsError`.

Accepted layouts (``S`` is a student id, ``A`` the assignment)::

    S/A/<nb>.ipynb   S/<nb>.ipynb   S/submission.zip   S.zip

optionally wrapped in one or more top-level folders or zips. Everything extracted or rewritten goes under
``scratch``; ``source`` is only read.
"""

from __future__ import annotations

import csv
import hashlib
import json
import re
import tempfile
import unicodedata
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import nbformat

MB = 1024 * 1024
MAX_NOTEBOOK_BYTES = 20 * MB
MAX_TOTAL_BYTES = 500 * MB  # all zips of one run together, after unpacking
MAX_MEMBERS = 10_000  # entries in one zip
MAX_ZIP_DEPTH = 4  # zips inside zips
_JUNK = {"__MACOSX", "Thumbs.db", "desktop.ini"}
_CHUNK = 1 << 20


class SubmissionsError(ValueError):
    """The submissions cannot be read at all (a single student's problem never raises this)."""


@dataclass
class Intake:
    student: str
    notebooks: dict[str, Path] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    status: str = "missing"  # "ok" | "partial" | "missing" | "not-on-roster"
    timestamp: str | None = None  # when it was handed in, from nbgrader collect's timestamp.txt

    def line(self) -> str:
        """One line for the report."""
        return f"{self.student}: {self.status}" + (f" - {'; '.join(self.problems)}" if self.problems else "")


def load_roster(path: Path) -> list[str]:
    """Student ids from a CSV with a ``student`` (or ``id``) column, or from a file with one id per line."""
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as error:
        raise SubmissionsError(f"cannot read roster {path}: {error}") from None
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise SubmissionsError(f"roster {path} is empty")
    if "," in lines[0] or "\t" in lines[0] or ";" in lines[0]:
        dialect = csv.Sniffer().sniff(lines[0], delimiters=",;\t")
        rows = list(csv.reader(lines, dialect))
        header = [cell.strip().lower() for cell in rows[0]]
        column = next((header.index(name) for name in ("student", "id", "student_id") if name in header), None)
        if column is None:
            raise SubmissionsError(f"roster {path} has no 'student' or 'id' column (columns: {', '.join(rows[0])})")
        ids = [row[column].strip() for row in rows[1:] if len(row) > column and row[column].strip()]
    else:
        ids = [line.strip() for line in lines]
        # A one-column CSV still has its header line.
        if ids[0].lower() in ("student", "id", "student_id"):
            ids = ids[1:]
    return list(dict.fromkeys(ids))


def read_submissions(source: Path, assignment: str, expected: list[str], scratch: Path,
                     roster: list[str] | None = None, *, others: dict[str, list[str]] | None = None,
                     max_notebook_bytes: int = MAX_NOTEBOOK_BYTES, max_total_bytes: int = MAX_TOTAL_BYTES,
                     max_members: int = MAX_MEMBERS) -> tuple[list[Intake], list[str]]:
    """-> (one Intake per student, sorted by id; run-level warnings).

    ``others`` maps the course's other assignments to their notebooks' names: a notebook of one of
    them is never taken for a renamed notebook of ``assignment``, and is reported as what it is.
    """
    source = Path(source)
    reader = _Reader(Path(scratch), assignment, max_notebook_bytes, max_total_bytes, max_members)
    reader.others = {_norm_stem(name): other for other, names in (others or {}).items() if other != assignment
                     for name in names}
    top = _open_source(source, reader)
    level = reader.find_student_level(top)
    students = []  # (folder or zip, raw name)
    stray = []
    for entry in _visible(level):
        if entry.is_dir():
            students.append((entry, entry.name))
        elif entry.suffix.lower() == ".zip":
            students.append((entry, entry.stem))
        else:
            stray.append(entry.name)
    if stray:
        reader.warnings.append(f"ignored {_count(len(stray), 'file')} outside any student folder: {_few(stray)}")
    if not students:
        reader.warnings.append(f"no student folders found in {source.name} (expected <student_id>/...)")

    intakes = []
    for (entry, _), student in zip(students, _assign_ids([raw for _, raw in students]), strict=True):
        intake = Intake(student.id, problems=list(student.problems))
        reader.read_student(entry, intake, expected)
        intakes.append(intake)
    _apply_roster(intakes, roster)
    intakes.sort(key=lambda i: i.student)
    return intakes, reader.warnings


def _open_source(source: Path, reader: _Reader) -> Path:
    """The folder to read: ``source`` itself, or where its zip was unpacked."""
    if not source.exists():
        raise SubmissionsError(f"{source} does not exist")
    if source.is_file():
        if not zipfile.is_zipfile(source):
            raise SubmissionsError(f"{source} is neither a folder nor a .zip file")
        top, problems = reader.open_zip(source, depth=0)
        if top is None:
            raise SubmissionsError(f"{source}: {problems[-1]}")
        reader.warnings.extend(problems)
        return top
    if source.is_dir():
        return source
    raise SubmissionsError(f"{source} is neither a folder nor a .zip file")


def infer_assignment(source: Path, notebooks: dict[str, list[str]], scratch: Path) -> str:
    """The one assignment whose notebooks every submitted notebook is (names compared loosely).

    ``notebooks`` maps each assignment to its notebooks' names. Raises :class:`SubmissionsError`, saying
    what was found, when a notebook fits no assignment or the notebooks fit more than one: the
    assignment is then for the instructor to say, never guessed.
    """
    reader = _Reader(Path(scratch), "", MAX_NOTEBOOK_BYTES, MAX_TOTAL_BYTES, MAX_MEMBERS)
    owner = {_norm_stem(name): assignment for assignment, names in notebooks.items() for name in names}
    found: dict[str, set[str]] = {}  # assignment (or "" for none) -> the names seen
    pending = [(_open_source(Path(source), reader), 1)]  # (folder, how many zips deep it lies)
    while pending:
        folder, depth = pending.pop()
        for path in _files_under(folder):
            if path.suffix.lower() == ".ipynb":
                found.setdefault(owner.get(_norm_stem(path.name), ""), set()).add(path.name)
            elif path.suffix.lower() == ".zip":
                unpacked, _ = reader.open_zip(path, depth=depth)
                if unpacked is not None:
                    pending.append((unpacked, depth + 1))
    say = "say which with --assignment (make grade ... ASSIGNMENT=<name>)"
    if not found:
        raise SubmissionsError(f"{source}: no notebooks found, so no assignment to infer; {say}")
    if "" in found:
        raise SubmissionsError(f"{source}: {_few(sorted(found['']))}: not the name of any assignment's notebook; {say}")
    if len(found) > 1:
        seen_where = "; ".join(f"{a}: {_few(sorted(names))}" for a, names in sorted(found.items()))
        raise SubmissionsError(f"{source} holds notebooks of {len(found)} assignments ({seen_where}); {say}")
    return next(iter(found))


# ---------------------------------------------------------------------------------------------------------
# Student ids


@dataclass
class _Id:
    id: str
    problems: list[str]


def safe_id(name: str) -> str:
    """A student id nbgrader can use as a folder name and database key: ASCII letters, digits, ``-_.@``."""
    # NFKD splits accents off (José -> Jose) so names stay readable instead of collapsing to "_".
    ascii_name = unicodedata.normalize("NFKD", name).encode("ascii", "ignore").decode()
    cleaned = re.sub(r"[^A-Za-z0-9._@-]+", "_", ascii_name).strip("._-")
    cleaned = re.sub(r"\.{2,}", ".", cleaned)  # ".." would read as a parent folder
    if not cleaned:
        # Nothing usable (e.g. a name in a non-Latin script): a stable id derived from the name.
        cleaned = "student-" + hashlib.sha1(name.encode("utf-8", "surrogateescape")).hexdigest()[:8]
    return cleaned


def _assign_ids(names: list[str]) -> list[_Id]:
    ids = [_Id(safe_id(name), []) for name in names]
    for name, sid in zip(names, ids, strict=True):
        if sid.id != name:
            sid.problems.append(f"folder name {name!r} changed to the id {sid.id!r}")
    # Case-insensitive: nbgrader's folders would collide on macOS and Windows file systems.
    groups: dict[str, list[int]] = {}
    for index, sid in enumerate(ids):
        groups.setdefault(sid.id.casefold(), []).append(index)
    taken = {sid.id.casefold() for sid in ids}
    for indices in groups.values():
        if len(indices) < 2:
            continue
        # The folder whose name already is the id keeps it; the others get a suffix.
        indices.sort(key=lambda i: (names[i] != ids[i].id, names[i]))
        keeper = indices[0]
        for n, index in enumerate(indices[1:], start=2):
            base, suffix = ids[index].id, n
            while f"{base}-{suffix}".casefold() in taken:
                suffix += 1
            new = f"{base}-{suffix}"
            taken.add(new.casefold())
            ids[index].problems.append(f"folder {names[index]!r} gives the same id as {names[keeper]!r}; "
                                       f"listed as {new!r}")
            ids[keeper].problems.append(f"another folder ({names[index]!r}) gives the same id; listed as {new!r}")
            ids[index].id = new
    return ids


def _apply_roster(intakes: list[Intake], roster: list[str] | None) -> None:
    if roster is None:
        return
    by_fold = {name.casefold(): name for name in roster}
    seen = set()
    for intake in intakes:
        listed = by_fold.get(intake.student.casefold())
        if listed is None:
            intake.status = "not-on-roster"
            intake.problems.append("not on the roster")
            continue
        if listed != intake.student:
            intake.problems.append(f"id {intake.student!r} matched to roster id {listed!r}")
            intake.student = listed
        seen.add(listed)
    for name in roster:
        if name not in seen:
            intakes.append(Intake(name, {}, ["no submission found"], "missing"))


# ---------------------------------------------------------------------------------------------------------
# Reading files


def _visible(folder: Path) -> list[Path]:
    """Entries a student meant to hand in: no hidden files, no macOS or Windows metadata, no symlinks."""
    try:
        entries = sorted(folder.iterdir())
    except OSError:
        return []
    return [e for e in entries if not e.name.startswith(".") and e.name not in _JUNK and not e.is_symlink()]


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _few(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown + (", ..." if len(names) > limit else "")


def _member_name(info: zipfile.ZipInfo) -> str:
    name = info.filename
    if not info.flag_bits & 0x800:
        # Without the UTF-8 flag zipfile decodes as cp437; many tools write UTF-8 without setting the flag.
        try:
            name = name.encode("cp437").decode("utf-8")
        except (UnicodeEncodeError, UnicodeDecodeError):
            pass
    # Windows tools sometimes use backslashes; macOS stores decomposed accents.
    return unicodedata.normalize("NFC", name.replace("\\", "/"))


def _norm_stem(name: str) -> str:
    """Compare notebook names loosely: case, copies ("(1)", "-copy", "Copy of") and separators."""
    stem = unicodedata.normalize("NFC", name).casefold()
    stem = stem[:-6] if stem.endswith(".ipynb") else stem
    stem = re.sub(r"^copy of ", "", stem)
    stem = re.sub(r"(\s*\(\d+\)|[\s_-]*copy(\s*\d+)?)+$", "", stem)
    stem = re.sub(r"[\s_-]+(v?\d+|final|submission)$", "", stem)
    return re.sub(r"[\s_.-]+", "", stem)


class _Reader:
    def __init__(self, scratch: Path, assignment: str, max_notebook_bytes: int, max_total_bytes: int,
                 max_members: int):
        self.scratch = scratch
        self.assignment = assignment
        self.max_notebook_bytes = max_notebook_bytes
        self.budget = max_total_bytes
        self.max_total_bytes = max_total_bytes
        self.max_members = max_members
        self.warnings: list[str] = []
        self.others: dict[str, str] = {}  # another assignment's notebook (loose name) -> that assignment
        self.opened: dict[Path, tuple[Path | None, list[str]]] = {}
        self.oversize: dict[Path, int] = {}  # placeholders for members too big to unpack -> real size
        self.unpacked = scratch / "unpacked"
        self.normalised = scratch / "notebooks"

    # -- zips ---------------------------------------------------------------------------------------------

    def open_zip(self, path: Path, depth: int) -> tuple[Path | None, list[str]]:
        """Unpack ``path`` once into scratch: (folder or None, problem sentences)."""
        if path in self.opened:
            return self.opened[path]
        result = self._unpack(path, depth)
        self.opened[path] = result
        return result

    def _unpack(self, path: Path, depth: int) -> tuple[Path | None, list[str]]:
        label = path.name
        if depth > MAX_ZIP_DEPTH:
            return None, [f"{label}: zips nested more than {MAX_ZIP_DEPTH} deep; not unpacked"]
        try:
            archive = zipfile.ZipFile(path)
        except (zipfile.BadZipFile, UnicodeDecodeError, OSError, ValueError, NotImplementedError) as error:
            return None, [f"{label} is not a readable zip file ({_short(error)})"]
        problems: list[str] = []
        with archive:
            infos = archive.infolist()
            if len(infos) > self.max_members:
                return None, [f"{label} holds {len(infos)} entries, over the limit of {self.max_members}; "
                              "not unpacked"]
            plan = []
            for info in infos:
                name = _member_name(info)
                parts = PurePosixPath(name).parts
                if name.startswith("/") or re.match(r"^[A-Za-z]:", name) or ".." in parts:
                    problems.append(f"{label}: refused unsafe path {name!r}")
                    continue
                parts = tuple(p for p in parts if p not in ("", "."))
                if not parts or info.is_dir() or any(p.startswith(".") or p in _JUNK for p in parts):
                    continue
                # Only notebooks and zips are read; other files get an empty placeholder (to be counted).
                wanted = parts[-1].lower().endswith((".ipynb", ".zip"))
                if wanted and parts[-1].lower().endswith(".ipynb") and info.file_size > self.max_notebook_bytes:
                    wanted = None  # too big to grade: record the size instead of unpacking
                plan.append((info, parts, wanted))
            total = sum(info.file_size for info, _, wanted in plan if wanted)
            if total > self.budget:
                return None, [f"{label} would unpack to {total / MB:.0f} MB, over the "
                              f"{self.max_total_bytes / MB:.0f} MB limit for all submissions; not unpacked"]
            # A fresh folder even when scratch is reused by an earlier run.
            self.unpacked.mkdir(parents=True, exist_ok=True)
            dest = Path(tempfile.mkdtemp(prefix="zip-", dir=self.unpacked))
            root = dest.resolve()
            for info, parts, wanted in plan:
                target = dest.joinpath(*parts)
                try:
                    # Belt and braces: the name checks above should already make this impossible.
                    if not target.resolve().is_relative_to(root):
                        problems.append(f"{label}: refused unsafe path {info.filename!r}")
                        continue
                    target.parent.mkdir(parents=True, exist_ok=True)
                    if not wanted:
                        target.touch()
                        if wanted is None:
                            self.oversize[target] = info.file_size
                        continue
                    self._extract(archive, info, target)
                except (OSError, zipfile.BadZipFile, RuntimeError, NotImplementedError, EOFError,
                        ValueError) as error:
                    # One damaged, encrypted or unnameable entry spoils only itself.
                    problems.append(f"{label}: could not unpack {'/'.join(parts)!r} ({_short(error)})")
                    target.unlink(missing_ok=True)
        return dest, problems

    def _extract(self, archive: zipfile.ZipFile, info: zipfile.ZipInfo, target: Path) -> None:
        written = 0
        with archive.open(info) as member, target.open("wb") as out:
            while chunk := member.read(_CHUNK):
                written += len(chunk)
                # Declared sizes were checked against the budget; a lying header must not exceed them.
                if written > info.file_size or written > self.budget:
                    raise ValueError("larger than its header says")
                out.write(chunk)
        self.budget -= written

    def open_node(self, entry: Path, depth: int) -> tuple[Path | None, list[str]]:
        if entry.is_dir():
            return entry, []
        return self.open_zip(entry, depth)

    # -- layout -------------------------------------------------------------------------------------------

    def find_student_level(self, top: Path) -> Path:
        """Skip wrapper folders and zips until the level that holds one entry per student."""
        level = top
        for depth in range(1, 12):
            entries = _visible(level)
            if len(entries) != 1 or not (entries[0].is_dir() or entries[0].suffix.lower() == ".zip"):
                break
            if self._has_work(entries[0], depth):
                break  # a single student
            inner, problems = self.open_node(entries[0], depth)
            if inner is None:
                break  # a broken zip: reported as that student's problem
            self.warnings.extend(problems)
            level = inner
        return level

    def _has_work(self, entry: Path, depth: int) -> bool:
        """Whether ``entry`` is one student's submission rather than a wrapper around several."""
        folder, _ = self.open_node(entry, depth)
        if folder is None:
            return True
        entries = _visible(folder)
        if any(e.suffix.lower() == ".ipynb" and e.is_file() for e in entries):
            return True
        for e in entries:
            if e.is_dir() and e.name.casefold() == self.assignment.casefold():
                return True
        zips = [e for e in entries if e.is_file() and e.suffix.lower() == ".zip"]
        # One zip and nothing else is a student's submission.zip; several zips are one per student.
        if len(zips) == 1 and len(entries) == 1:
            return self._has_work(zips[0], depth + 1)
        return False

    def _work_folder(self, entry: Path, intake: Intake) -> Path | None:
        """The folder that holds this student's notebooks (after the assignment folder, wrappers, zips)."""
        folder, problems = self.open_node(entry, 1)
        intake.problems.extend(problems)
        for depth in range(2, 12):
            if folder is None:
                return None
            entries = _visible(folder)
            inner = [e for e in entries if e.is_dir() and e.name.casefold() == self.assignment.casefold()]
            if inner and any(_notebooks_under(inner[0])):
                folder = inner[0]
                continue
            if any(e.suffix.lower() == ".ipynb" and e.is_file() for e in entries):
                return folder
            zips = [e for e in entries if e.is_file() and e.suffix.lower() == ".zip"]
            dirs = [e for e in entries if e.is_dir()]
            if len(entries) == 1 and dirs:
                folder = dirs[0]
            elif len(zips) == 1:
                folder, problems = self.open_zip(zips[0], depth)
                intake.problems.extend(problems)
            else:
                return folder
        return folder

    # -- one student --------------------------------------------------------------------------------------

    def read_student(self, entry: Path, intake: Intake, expected: list[str]) -> None:
        folder = self._work_folder(entry, intake)
        files = _files_under(folder) if folder is not None else []
        candidates = sorted((f for f in files if f.suffix.lower() == ".ipynb"),
                            key=lambda f: (len(f.relative_to(folder).parts), str(f)))
        stamp = folder / "timestamp.txt" if folder is not None else None
        if stamp is not None and stamp in files:
            intake.timestamp = _timestamp(stamp, intake)
        extras = [f for f in files if f.suffix.lower() != ".ipynb" and f != stamp]
        if folder is not None and not files:
            intake.problems.append("empty submission (no files)")

        chosen = self._match(expected, candidates, folder, intake)
        used = set(chosen.values())
        unused = [f for f in candidates if f not in used]
        misplaced = [f for f in unused if _norm_stem(f.name) in self.others]
        for f in misplaced:
            intake.problems.append(f"{_rel(f, folder)} is the notebook of assignment "
                                   f"{self.others[_norm_stem(f.name)]}, not of {self.assignment}")
        unused = [f for f in unused if f not in misplaced]
        if unused:
            intake.problems.append(f"ignored {_count(len(unused), 'other notebook')}: "
                                   f"{_few([_rel(f, folder) for f in unused])}")
        if extras:
            intake.problems.append(f"ignored {_count(len(extras), 'extra file')}")

        for name in expected:
            if name in chosen:
                path = self._normalise(chosen[name], name, _rel(chosen[name], folder), intake)
                if path is not None:
                    intake.notebooks[name] = path
        got = len(intake.notebooks)
        intake.status = "ok" if got == len(expected) else "missing" if got == 0 else "partial"

    def _match(self, expected: list[str], candidates: list[Path], folder: Path | None,
               intake: Intake) -> dict[str, Path]:
        chosen: dict[str, Path] = {}
        for name in expected:
            exact = [f for f in candidates if unicodedata.normalize("NFC", f.name) == name]
            if exact:
                chosen[name] = exact[0]  # the shallowest copy
                if len(exact) > 1:
                    intake.problems.append(f"{len(exact)} copies of {name}; used {_rel(exact[0], folder)}")
        # Loose matches ("Attention.ipynb", "attention (1).ipynb") when exactly one file fits.
        for name in expected:
            if name in chosen:
                continue
            fits = [f for f in candidates if f not in chosen.values() and _norm_stem(f.name) == _norm_stem(name)]
            if len(fits) == 1:
                chosen[name] = fits[0]
                intake.problems.append(f"used {_rel(fits[0], folder)} for {name} (renamed from {fits[0].name!r})")
            elif len(fits) > 1:
                intake.problems.append(f"could not tell which of {_few([_rel(f, folder) for f in fits])} is {name}")
        missing = [name for name in expected if name not in chosen]
        # Another assignment's notebook is never a renamed copy of this one's.
        unmatched = [f for f in candidates if f not in chosen.values() and _norm_stem(f.name) not in self.others]
        if len(missing) == 1 and len(unmatched) == 1:
            chosen[missing[0]] = unmatched[0]
            intake.problems.append(f"used {_rel(unmatched[0], folder)} for {missing[0]} "
                                   f"(renamed from {unmatched[0].name!r})")
            missing = []
        if missing:
            intake.problems.append(f"missing {', '.join(missing)}")
        return chosen

    def _normalise(self, path: Path, name: str, shown: str, intake: Intake) -> Path | None:
        """A validated nbformat-4 copy of ``path`` in scratch, or None with the reason in ``intake.problems``."""
        size = self.oversize.get(path)
        if size is None:
            try:
                size = path.stat().st_size
            except OSError as error:
                intake.problems.append(f"{shown} could not be read ({_short(error)})")
                return None
        if size > self.max_notebook_bytes:
            intake.problems.append(f"{shown} is {size / MB:.1f} MB, over the {self.max_notebook_bytes / MB:g} MB "
                                   "limit; not graded")
            return None
        try:
            raw = path.read_bytes()
        except OSError as error:
            intake.problems.append(f"{shown} could not be read ({_short(error)})")
            return None
        if not raw.strip():
            intake.problems.append(f"{shown} is empty; not graded")
            return None
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError:
            intake.problems.append(f"{shown} is not UTF-8 text, so not a notebook; not graded")
            return None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            intake.problems.append(f"{shown} is damaged: not valid JSON (line {error.lineno}, column {error.colno}: "
                                   f"{error.msg}); not graded")
            return None
        except RecursionError:
            intake.problems.append(f"{shown} is nested too deeply to read; not graded")
            return None
        if not isinstance(data, dict) or "nbformat" not in data or not ("cells" in data or "worksheets" in data):
            intake.problems.append(f"{shown} is JSON but not a Jupyter notebook; not graded")
            return None
        version = data.get("nbformat")
        try:
            notebook = nbformat.reads(text, as_version=4)
            _, notebook = nbformat.validator.normalize(notebook)
            notebook = nbformat.from_dict(notebook)
            nbformat.validate(notebook)
        except Exception as error:  # nbformat raises many kinds for a broken notebook; each is this student's
            intake.problems.append(f"{shown} is not a valid notebook (format {version}: {_short(error)}); "
                                   "not graded")
            return None
        if version != 4:
            intake.problems.append(f"{shown} was in the old notebook format v{version}; converted to v4")
        target = self.normalised / intake.student / name
        target.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(notebook, target)
        return target


def _timestamp(path: Path, intake: Intake) -> str | None:
    """The time in nbgrader's ``timestamp.txt``, checked as nbgrader will read it (None, noted, if unreadable)."""
    from nbgrader.utils import parse_utc

    text = path.read_bytes()[:200].decode("utf-8", errors="replace").strip()
    try:
        parse_utc(text)
    except Exception:
        intake.problems.append(f"timestamp.txt does not hold a time ({text[:40]!r}); the submission counts as on time")
        return None
    return text


def _files_under(folder: Path) -> list[Path]:
    """Every visible regular file under ``folder`` (skipping hidden folders such as .ipynb_checkpoints)."""
    found = []
    for entry in _visible(folder):
        if entry.is_dir():
            found.extend(_files_under(entry))
        elif entry.is_file():
            found.append(entry)
    return found


def _notebooks_under(folder: Path):
    return (f for f in _files_under(folder) if f.suffix.lower() == ".ipynb")


def _rel(path: Path, folder: Path | None) -> str:
    try:
        return path.relative_to(folder).as_posix() if folder is not None else path.name
    except ValueError:
        return path.name


def _short(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    first = text[0] if text else type(error).__name__
    return first[:160]


__all__ = ["Intake", "SubmissionsError", "load_roster", "read_submissions", "safe_id"]
