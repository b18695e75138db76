"""Read a folder (or zip) of student submissions into one checked, normalised record per student.

Whatever students upload, this never raises for one student's mistake: each problem becomes a short
sentence on that student's :class:`Intake`, so the report has one line per student. Only a source that
cannot be read at all raises :class:`SubmissionsError`.

Accepted layouts (``S`` is a student id, ``A`` the assignment)::

    S/A/<nb>.ipynb   S/<nb>.ipynb   S/submission.zip   S.zip

optionally wrapped in one or more top-level folders or zips, and the bulk downloads of two LMSs, recognised
by their names (formats read from the LMSs' own source, canvas-lms ``lib/content_zipper.rb`` and Moodle's
``mod/assign`` download and ``assignfeedback_file`` zip import)::

    Canvas "Download Submissions":  <name>[_LATE]_<user id>_<file id>_<file name>   (flat files)
                                    [LATE_]anon_<anonymous id>_<file id>_<file name> (anonymous grading)
    Moodle "Download all submissions":  <full name>_<participant id>_assignsubmission_file[_]/<file name>
                                        (or the same prefix before each file's name, without folders)

Everything extracted or rewritten goes under ``scratch``; ``source`` is only read.
"""

from __future__ import annotations

import csv
import datetime
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import unicodedata
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import nbformat
from anyascii import anyascii

# A Chinese notebook lies in zh/ beside its English twin (stepformer.course.translation); a student answers one.
from stepformer.checks.given import TRANSLATION_FOLDER

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
    # sha256 of each normalised notebook, by name: what decides whether a graded student changed
    digests: dict[str, str] = field(default_factory=dict)
    # The hand-in time that decides between duplicate hand-ins (epoch seconds), and where it came from
    handed_in: float | None = None
    handed_in_from: str = ""
    # What the LMS needs to take feedback back: {"layout": "canvas", "prefix": ..., "user_id": ..., "late": "yes"}
    # or {"layout": "moodle", "folder": ..., "participant": ...}; empty for a plain folder
    lms: dict[str, str] = field(default_factory=dict)

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
    entries, rest = _lms_entries(_visible(level), reader)
    stray = []
    for entry in rest:
        if entry.is_dir():
            entries.append(_Entry(entry, entry.name, safe_id(entry.name)))
        elif entry.suffix.lower() == ".zip":
            entries.append(_Entry(entry, entry.stem, safe_id(entry.stem)))
        else:
            stray.append(entry.name)
    if stray:
        reader.warnings.append(f"ignored {_count(len(stray), 'file')} outside any student folder: {_few(stray)}")
    if not entries:
        reader.warnings.append(f"no student folders found in {source.name} (expected <student_id>/...)")

    read = []
    for entry in entries:
        intake = Intake(entry.id, problems=list(entry.notes), lms=dict(entry.lms))
        if entry.raw != entry.id and not entry.lms:
            intake.problems.append(f"folder name {entry.raw!r} changed to the id {entry.id!r}")
        reader.read_student(entry.path, intake, expected)
        read.append((entry, intake))
    intakes = _newest_of_duplicates(read, reader.warnings)
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
                # In a flat LMS download the notebook's own name follows the LMS's prefix.
                match = _CANVAS.match(path.name) or _CANVAS_ANON.match(path.name) or _MOODLE_FILE.match(path.name)
                name = match["file"] if match else path.name
                found.setdefault(owner.get(_norm_stem(name), ""), set()).add(name)
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


def safe_id(name: str) -> str:
    """The one id normalisation (folders, zip names, LMS names, rosters): ASCII letters, digits, ``-_.@``.

    Letters are transliterated, never dropped (José Núñez -> Jose_Nunez, Đặng -> Dang, 李雷 -> LiLei), so an id
    stays readable and a roster's spelling and a folder's give the same id. The result is safe for nbgrader as
    a folder name and a database key.
    """
    ascii_name = anyascii(unicodedata.normalize("NFC", name))
    cleaned = re.sub(r"[^A-Za-z0-9._@-]+", "_", ascii_name).strip("._-")
    cleaned = re.sub(r"\.{2,}", ".", cleaned)  # ".." would read as a parent folder
    if not cleaned:
        # Nothing usable (no letters or digits at all): a stable id derived from the name.
        cleaned = "student-" + hashlib.sha1(name.encode("utf-8", "surrogateescape")).hexdigest()[:8]
    return cleaned


@dataclass
class _Entry:
    """One hand-in found at the student level: a folder or zip, and the id it gives."""

    path: Path
    raw: str  # the name as found (folder, zip stem, or the LMS's name)
    id: str
    lms: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _newest_of_duplicates(read: list[tuple[_Entry, Intake]], warnings: list[str]) -> list[Intake]:
    """One Intake per student: of hand-ins whose ids are equal but for case, the newest is graded.

    Newest by hand-in time (``timestamp.txt`` when there is one, else the newest notebook's modification time,
    which a zip keeps for its members); a copy with no notebook never wins over one with. The others are set
    aside, named in the student's detail and in the run's warnings; nothing of theirs is graded.
    """
    groups: dict[str, list[tuple[_Entry, Intake]]] = {}
    for entry, intake in read:
        groups.setdefault(intake.student.casefold(), []).append((entry, intake))
    kept = []
    for group in groups.values():
        if len(group) == 1:
            kept.append(group[0][1])
            continue
        # The id's spelling does not depend on which copy is newest: a name that already is its id, in lower
        # case if there is one, else the first in sorted order.
        spelling = min(group, key=lambda pair: (pair[0].raw != pair[0].id, pair[0].id != pair[0].id.lower(),
                                                pair[0].raw))[1].student
        group.sort(key=lambda pair: (bool(pair[1].notebooks), pair[1].handed_in or 0.0), reverse=True)
        (winner_entry, winner), others = group[0], group[1:]
        winner.student = spelling
        winner.problems.append(
            f"{len(group)} hand-ins give the id {spelling!r} (ids compare without case): graded the newest, "
            f"{_label(winner_entry)} ({_when(winner)}); set aside "
            + ", ".join(f"{_label(e)} ({_when(i)})" for e, i in others))
        warnings.append(f"{spelling}: {len(group)} hand-ins; graded {_label(winner_entry)}, the newest; set aside "
                        + ", ".join(_label(e) for e, _ in others))
        kept.append(winner)
    return kept


def _label(entry: _Entry) -> str:
    return repr(entry.path.name + ("/" if entry.path.is_dir() and not entry.lms else ""))


def _when(intake: Intake) -> str:
    if intake.handed_in is None:
        return "no notebook" if not intake.notebooks else "no time known"
    when = datetime.datetime.fromtimestamp(intake.handed_in, datetime.UTC)
    return f"{intake.handed_in_from} {when:%Y-%m-%d %H:%M:%S} UTC"


def _canvas_squeeze(name: str) -> str:
    """A name as Canvas writes it into a download's file names: lower case, only letters, digits and ``_``."""
    return re.sub(r"[^a-z0-9_]", "", anyascii(unicodedata.normalize("NFC", name)).lower())


def _apply_roster(intakes: list[Intake], roster: list[str] | None) -> None:
    """Match submissions to roster entries through the same id normalisation (and Canvas's user id or name)."""
    if roster is None:
        return
    by_id: dict[str, str] = {}
    by_canvas_name: dict[str, str] = {}  # "Smith, Jane" -> smithjane, as Canvas names files
    for name in roster:
        by_id.setdefault(safe_id(name).casefold(), name)
        by_canvas_name.setdefault(_canvas_squeeze(name), name)
    seen = set()
    for intake in intakes:
        found = [by_id.get(intake.student.casefold())]
        if intake.lms.get("layout") == "canvas":
            # Canvas names a student by a squeezed sortable name and a user id; a roster may hold either.
            found += [by_canvas_name.get(intake.lms["name"]), by_id.get(intake.lms.get("user_id", ""))]
        listed = next((name for name in found if name is not None), None)
        if listed is None:
            intake.status = "not-on-roster"
            intake.problems.append("not on the roster")
            continue
        if safe_id(listed) != intake.student:
            intake.problems.append(f"id {intake.student!r} matched to roster id {listed!r}")
            intake.student = safe_id(listed)
        seen.add(listed)
    for name in roster:
        if name not in seen:
            problems = ["no submission found"]
            if safe_id(name) != name:
                problems.append(f"roster id {name!r} is {safe_id(name)!r} here")
            intakes.append(Intake(safe_id(name), {}, problems, "missing"))


# ---------------------------------------------------------------------------------------------------------
# LMS downloads

_CANVAS = re.compile(r"^(?P<name>[^_].*?)(?P<late>_LATE)?_(?P<user_id>\d+)_(?P<file_id>\d+)_(?P<file>.+)$")
_CANVAS_ANON = re.compile(r"^(?P<late>LATE_)?anon_(?P<name>[A-Za-z0-9]+)_(?P<file_id>\d+)_(?P<file>.+)$")
# A text entry or URL submission: no file id, and nothing to grade, but the student is there.
_CANVAS_TEXT = re.compile(r"^(?P<name>[^_].*?)(?P<late>_LATE)?_(?P<user_id>\d+)_(?P<file>text|link)\.html$")
# Moodle replaces "_" in full names with spaces, so the name ends at the first underscore.
_MOODLE_FOLDER = re.compile(r"^(?P<name>[^_]+)_(?P<participant>\d+)_(?P<plugin>assignsubmission_[a-z]+)_?$")
_MOODLE_FILE = re.compile(r"^(?P<name>[^_]+)_(?P<participant>\d+)_(?P<plugin>assignsubmission_[a-z]+)_(?P<file>.+)$")


def lms_name(name: str) -> bool:
    """Whether ``name`` (a file or folder) is named as in a Canvas or Moodle bulk download."""
    return any(p.match(name) for p in (_CANVAS, _CANVAS_ANON, _CANVAS_TEXT, _MOODLE_FOLDER, _MOODLE_FILE))


def _lms_entries(entries: list[Path], reader: _Reader) -> tuple[list[_Entry], list[Path]]:
    """(one entry per student of a Canvas or Moodle download, the entries that are neither).

    A Canvas download is flat: each student's files are gathered (by user id) into a folder in scratch under
    their original names. A Moodle download has a folder per student and submission plugin; a student's
    ``assignsubmission_file`` folder is the one read.
    """
    students: dict[tuple[str, str], dict] = {}  # (layout, the LMS's own id) -> what was found
    rest = []
    for entry in entries:
        name = entry.name
        if entry.is_file() and (match := _CANVAS.match(name) or _CANVAS_TEXT.match(name)):
            key = ("canvas", match["user_id"])
            prefix = name[:match.start("file")].rstrip("_")
            if match.re is _CANVAS_TEXT:
                prefix = ""
            file_name = match["file"] + (".html" if match.re is _CANVAS_TEXT else "")
            info = {"layout": "canvas", "name": match["name"], "user_id": match["user_id"]}
        elif entry.is_file() and (match := _CANVAS_ANON.match(name)):
            key = ("canvas", "anon_" + match["name"])
            prefix, file_name = name[:match.start("file")].rstrip("_"), match["file"]
            info = {"layout": "canvas", "name": "anon_" + match["name"]}
        elif entry.is_dir() and (match := _MOODLE_FOLDER.match(name)):
            key = ("moodle", match["participant"])
            prefix, file_name = name, ""
            info = {"layout": "moodle", "name": match["name"], "participant": match["participant"]}
        elif entry.is_file() and (match := _MOODLE_FILE.match(name)):
            key = ("moodle", match["participant"])
            # Moodle's importer reads the same prefix as a folder name: <name>_<id>_<plugin>_.
            prefix, file_name = name[:match.start("file")], match["file"]
            info = {"layout": "moodle", "name": match["name"], "participant": match["participant"]}
        else:
            rest.append(entry)
            continue
        found = students.setdefault(key, {"info": info, "files": [], "folders": [], "prefixes": [], "late": False})
        if match.groupdict().get("late"):
            found["late"] = True
        if prefix:
            found["prefixes"].append((match.groupdict().get("plugin", ""), prefix))
        (found["folders"] if entry.is_dir() else found["files"]).append((entry, file_name))

    if not students:
        return [], rest
    # The same name for different LMS ids (two "Wei Zhang"s, or Moodle's "Participant" under blind marking)
    # is two students: their ids keep the LMS's id.
    names: dict[str, set[tuple[str, str]]] = {}
    for key, found in students.items():
        names.setdefault(safe_id(found["info"]["name"]).casefold(), set()).add(key)
    result = []
    layouts = set()
    for key, found in sorted(students.items()):
        layout, lms_id = key
        layouts.add(layout)
        info = dict(found["info"])
        student = safe_id(info["name"])
        if len(names[student.casefold()]) > 1:
            student = f"{student}_{lms_id}"
        notes = []
        if layout == "canvas":
            notes.append("read as a Canvas download (file names <name>_<user id>_<file id>_<file>)")
            info["prefix"] = min((p for _, p in found["prefixes"]), default="")
            if found["late"]:
                info["late"] = "yes"
        else:
            notes.append("read as a Moodle download (folders <full name>_<participant id>_assignsubmission_file)")
            # Feedback goes back into the folder that held the files, as Moodle's importer expects.
            files_first = sorted(found["prefixes"], key=lambda pair: (pair[0] != "assignsubmission_file", pair[1]))
            info["folder"] = files_first[0][1].rstrip("/") if files_first else ""
        folders = sorted(found["folders"], key=lambda pair: (not pair[0].name.endswith(("file", "file_")),
                                                             pair[0].name))
        if folders and not found["files"]:
            path = folders[0][0]
            for other, _ in folders[1:]:
                notes.append(f"ignored {other.name!r} (another of Moodle's submission plugins)")
        else:
            path = reader.gather(f"{layout}-{lms_id}", found["files"] + [(f, "") for f, _ in folders])
        result.append(_Entry(path, info["name"], student, info, notes))
    shown = {"canvas": "Canvas", "moodle": "Moodle"}
    reader.warnings.append(f"recognised a {' and a '.join(shown[x] for x in sorted(layouts))} download: "
                           f"{_count(len(result), 'student')}")
    return result, rest


def write_lms_feedback(out: Path, assignment: str, students: list[tuple[str, dict[str, str]]]) -> list[Path]:
    """Each LMS's bulk upload of the feedback pages ``out/feedback/<student>/<assignment>/*.html``: the zips written.

    Moodle ("Upload multiple feedback files in a zip"): ``feedback-moodle.zip`` with one folder per student
    named as in the download (``<full name>_<participant id>_assignsubmission_file_``), which Moodle's
    importer maps back to the participant. Canvas ("Re-Upload Submissions" on the assignment's page):
    ``feedback-canvas.zip`` of files named ``<name>_<user id>_<file id>_<notebook>.html``, which Canvas
    attaches to the submission of that user as a comment.
    """
    written = []
    for layout in ("moodle", "canvas"):
        members = []
        for student, lms in students:
            if lms.get("layout") != layout:
                continue
            pages = sorted((out / "feedback" / student / assignment).glob("*.html"))
            if layout == "moodle" and lms.get("folder"):
                members += [(f"{lms['folder']}/{page.name}", page) for page in pages]
            elif layout == "canvas" and lms.get("prefix"):
                members += [(f"{lms['prefix']}_{page.name}", page) for page in pages]
        if not members:
            continue
        target = out / f"feedback-{layout}.zip"
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as archive:
            for name, page in members:
                archive.write(page, name)
        os.replace(tmp, target)
        written.append(target)
    return written


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
        # A fresh folder per run (scratch may be shared by runs at once, e.g. one per cluster job), and one
        # subfolder per hand-in, so two hand-ins with the same id never overwrite each other's notebooks.
        self._normalised: Path | None = None
        self.hand_ins = 0

    @property
    def normalised(self) -> Path:
        if self._normalised is None:
            self.scratch.mkdir(parents=True, exist_ok=True)
            self._normalised = Path(tempfile.mkdtemp(prefix="notebooks-", dir=self.scratch))
        return self._normalised

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
                # Only notebooks, zips and hand-in times are read; other files get an empty placeholder (counted).
                wanted = parts[-1].lower().endswith((".ipynb", ".zip")) or parts[-1].lower() == "timestamp.txt"
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
                    else:
                        self._extract(archive, info, target)
                    _keep_zip_time(target, info)
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

    def gather(self, key: str, files: list[tuple[Path, str]]) -> Path:
        """A folder in scratch holding ``files`` (path, name to give it; "" keeps the name): one student's
        files of a flat LMS download. Notebooks, zips and ``timestamp.txt`` are copied with their times;
        other files get an empty placeholder, as in a zip."""
        self.unpacked.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix=f"{safe_id(key)}-", dir=self.unpacked))
        for path, name in files:
            target = folder / (name or path.name)
            n = 1
            while target.exists():  # two files of one name (the LMS's prefixes told them apart): keep both
                target, n = target.with_name(f"{Path(name or path.name).stem}-{n}{target.suffix}"), n + 1
            if path.is_dir():
                shutil.copytree(path, target, dirs_exist_ok=True, symlinks=True)
                continue
            size = path.stat().st_size
            wanted = target.name.lower().endswith((".ipynb", ".zip")) or target.name.lower() == "timestamp.txt"
            if wanted and (size > self.budget or target.suffix.lower() == ".ipynb" and size > self.max_notebook_bytes):
                self.oversize[target] = size  # too big: its size is reported, it is not copied
                wanted = False
            if wanted:
                self.budget -= size
                shutil.copy2(path, target)
            else:
                target.touch()
                os.utime(target, (path.stat().st_mtime,) * 2)
        return folder

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
            if lms_name(entries[0].name):
                break  # one student of an LMS download, named as the LMS names them
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
        if intake.lms.get("late"):
            intake.problems.append(
                "marked late by Canvas" + ("" if intake.timestamp else
                                           " (the download gives no hand-in time, so no late penalty is applied)"))
        extras = [f for f in files if f.suffix.lower() != ".ipynb" and f != stamp]
        if folder is not None and not files:
            intake.problems.append("empty submission (no files)")

        chosen = self._match(expected, candidates, folder, intake)
        used = set(chosen.values())
        # The twin not graded is named by the note that says which one was (_answered_twin), not as ignored.
        twins = {t for f in used for t in (f.parent / TRANSLATION_FOLDER / f.name, f.parent.parent / f.name)
                 if _language_twins([f, t])}
        unused = [f for f in candidates if f not in used and f not in twins]
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

        self.hand_ins += 1
        for name in expected:
            if name in chosen:
                path = self._normalise(chosen[name], name, _rel(chosen[name], folder), intake)
                if path is not None:
                    intake.notebooks[name] = path
                    intake.digests[name] = hashlib.sha256(path.read_bytes()).hexdigest()
        if intake.timestamp:
            intake.handed_in, intake.handed_in_from = _epoch(intake.timestamp), "timestamp.txt"
        elif chosen:
            intake.handed_in = max(path.stat().st_mtime for path in chosen.values())
            intake.handed_in_from = "file modification time"
        got = len(intake.notebooks)
        intake.status = "ok" if got == len(expected) else "missing" if got == 0 else "partial"

    def _match(self, expected: list[str], candidates: list[Path], folder: Path | None,
               intake: Intake) -> dict[str, Path]:
        chosen: dict[str, Path] = {}
        for name in expected:
            exact = [f for f in candidates if unicodedata.normalize("NFC", f.name) == name]
            twins = _language_twins(exact)
            if twins:
                chosen[name], note = _answered_twin(*twins, folder)
                intake.problems.append(note)
            elif exact:
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
            if _number_cells(data):
                text = json.dumps(data)
            notebook = nbformat.reads(text, as_version=4)
            if version != 4:
                # Converting an old format invents random cell ids; ids from the position keep the digest stable.
                for index, cell in enumerate(notebook.cells):
                    cell["id"] = f"cell-{index}"
            _, notebook = nbformat.validator.normalize(notebook)
            notebook = nbformat.from_dict(notebook)
            nbformat.validate(notebook)
        except Exception as error:  # nbformat raises many kinds for a broken notebook; each is this student's
            intake.problems.append(f"{shown} is not a valid notebook (format {version}: {_short(error)}); "
                                   "not graded")
            return None
        if version != 4:
            intake.problems.append(f"{shown} was in the old notebook format v{version}; converted to v4")
        target = self.normalised / f"{self.hand_ins}-{intake.student}" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(notebook, target)
        return target




def _language_twins(exact: list[Path]) -> tuple[Path, Path] | None:
    """(English, Chinese) when the copies of a notebook are exactly an assignment's two languages: ``x.ipynb``
    and ``zh/x.ipynb`` beside it."""
    if len(exact) != 2:
        return None
    english, chinese = sorted(exact, key=lambda f: len(f.parts))
    if chinese.parent.name == TRANSLATION_FOLDER and chinese.parent.parent == english.parent:
        return english, chinese
    return None


def _answered_twin(english: Path, chinese: Path, folder: Path | None) -> tuple[Path, str]:
    """The twin the student answered, with a note saying which: the one with fewer answer cells left as
    nbgrader's stub, else (both answered alike) the one saved last."""
    def left(path: Path) -> int:
        try:
            cells = json.loads(path.read_text(encoding="utf-8-sig")).get("cells", [])
        except (OSError, ValueError, AttributeError):
            return 1 << 30  # unreadable: the other one, if it can be read
        return sum(1 for c in cells if isinstance(c, dict) and c.get("metadata", {}).get("nbgrader", {}).get("solution")
                   and "NotImplementedError" in "".join(c.get("source", [])) and "YOUR CODE HERE" in
                   "".join(c.get("source", [])))

    stubs = {english: left(english), chinese: left(chinese)}
    if stubs[english] != stubs[chinese]:
        used = min((english, chinese), key=stubs.get)
        why = "it has fewer answers left to write"
    else:
        used = max((english, chinese), key=lambda f: f.stat().st_mtime)
        why = "both are answered alike, and it was saved last"
    other = chinese if used == english else english
    return used, f"graded {_rel(used, folder)}, not {_rel(other, folder)}: {why}"


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


def _epoch(text: str) -> float:
    """Seconds since the epoch of a time nbgrader can read (a time without a zone is UTC, as for nbgrader)."""
    from nbgrader.utils import parse_utc

    when = parse_utc(text)
    return (when if when.tzinfo else when.replace(tzinfo=datetime.UTC)).timestamp()


def _keep_zip_time(target: Path, info: zipfile.ZipInfo) -> None:
    """Give an unpacked file the time the zip records for it: the hand-in time when nothing better is known."""
    try:
        stamp = time.mktime((*info.date_time, 0, 0, -1))
        os.utime(target, (stamp, stamp))
    except (OverflowError, ValueError, OSError):
        pass  # a nonsense date in the zip: the file keeps the unpacking time


def _number_cells(data: dict) -> bool:
    """Give cells without an id one from their position (whether any had none), so that the same file always
    normalises to the same bytes.

    nbformat would invent random ids on reading, and a digest of the result would then change on every run:
    every student would be graded again each time.
    """
    cells = data.get("cells")
    if data.get("nbformat") != 4 or not isinstance(data.get("nbformat_minor"), int) or data["nbformat_minor"] < 5 \
            or not isinstance(cells, list):
        return False
    taken = {cell.get("id") for cell in cells if isinstance(cell, dict)}
    added = False
    for index, cell in enumerate(cells):
        if isinstance(cell, dict) and not cell.get("id"):
            candidate = f"cell-{index}"
            while candidate in taken:
                candidate += "x"
            cell["id"] = candidate
            taken.add(candidate)
            added = True
    return added


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


__all__ = ["Intake", "SubmissionsError", "lms_name", "load_roster", "read_submissions", "safe_id",
           "write_lms_feedback"]
