"""Which grading worker grades which student: a manifest written once, claim files taken atomically.

The intake phase writes ``manifest.json`` (the students to grade and what a worker needs) into the
assignment's state folder; any number of workers, on one machine or many sharing that folder, then
pull students from it one at a time. A worker owns a student when it creates the claim file
``claims/<run>/<student>.<generation>`` with ``O_CREAT | O_EXCL``: the file system lets exactly one
creator succeed (on NFS from version 3 on, where the server makes the exclusive create; never on NFSv2).
Claims are never renamed or deleted while a run lasts, so a slow listing of the folder (NFS caches
them) can only cost a wasted attempt, never a second owner. A worker walks the manifest once, trying
one exclusive create per student, and lists the folder only when every student is claimed: a class of
thousands costs each worker about one try per student, not a listing per claim.

A worker that dies holding a claim leaves a claim with no ``done/<student>.json``. Another worker takes
it over by creating the next generation's claim file (again exclusively, so only one succeeds) once
the claim is *abandoned*: older than ``take_over_after`` seconds (the grading process's own hard time
limit plus a margin, so its owner has surely been stopped by then), or made on this same machine (host
name and PID namespace) by a process that no longer exists.
"""

import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "manifest.json"
# Added to a grading process's own time limit before its claim may be taken over: clocks of the
# machines that share the folder may differ a little, and NFS clients cache a folder's listing
# for up to a minute (acdirmax), so a done/ record just written elsewhere may not show at once.
CLAIM_MARGIN = 300


class ManifestMissing(RuntimeError):
    """No intake has written a manifest for this assignment in this folder."""


class RunReplaced(RuntimeError):
    """The run's claims folder is gone: a newer intake started another run."""


def new_run_id() -> str:
    """A name for one intake's run: its claims live in a folder of that name."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(4)}"


def write_manifest(state: Path, manifest: dict) -> Path:
    """Write ``state/manifest.json`` atomically (a worker never reads half of one) and start its run's claims.

    The claims of earlier runs go: they are this grader's own files and name a run that is over.
    """
    state.mkdir(parents=True, exist_ok=True)
    claims = state / "claims"
    if claims.is_dir():
        for old in claims.iterdir():
            if old.name != manifest["run"]:
                for path in old.iterdir():
                    path.unlink()
                old.rmdir()
    (claims / manifest["run"]).mkdir(parents=True, exist_ok=True)
    tmp = state / f".{MANIFEST}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, state / MANIFEST)
    return state / MANIFEST


def read_manifest(state: Path) -> dict:
    path = state / MANIFEST
    if not path.is_file():
        raise ManifestMissing(f"no {path}: the intake has not run for this assignment in this folder")
    return json.loads(path.read_text())


def claims_folder(state: Path, run: str) -> Path:
    return state / "claims" / run


def machine() -> str:
    """This machine as a claim names it: the host name and the PID namespace, where PIDs mean something."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = "?"
    return f"{socket.gethostname()}/{namespace}"


@dataclass(frozen=True)
class Claim:
    """The newest claim file of one student."""

    path: Path
    generation: int
    owner: dict  # what its worker wrote in it (empty while it is being written, or if unreadable)
    age: float  # seconds since it was made, by the file's modification time

    def abandoned(self, take_over_after: float) -> bool:
        if self.age >= take_over_after:
            return True
        # A process of this same machine that is gone holds nothing.
        if self.owner.get("machine") == machine() and isinstance(self.owner.get("pid"), int):
            try:
                os.kill(self.owner["pid"], 0)
            except ProcessLookupError:
                return True
            except PermissionError:
                return False
        return False

    def describe(self) -> str:
        who = self.owner.get("worker", "an unknown worker")
        return f"claimed by {who} at {self.owner.get('claimed', '?')} ({self.age:.0f} s ago)"


def latest_claims(claims: Path, skip: set[str] = frozenset()) -> dict[str, Claim]:
    """Each claimed student's newest claim, but those in ``skip`` (their claim files are not even read)."""
    newest: dict[str, tuple[int, Path]] = {}
    for name in os.listdir(claims):
        student, _, generation = name.rpartition(".")
        if student and student not in skip and generation.isdigit() \
                and int(generation) > newest.get(student, (0, claims))[0]:
            newest[student] = (int(generation), claims / name)
    found = {}
    now = time.time()
    for student, (generation, path) in newest.items():
        try:
            made = path.stat().st_mtime
            owner = json.loads(path.read_text() or "{}")
        except (OSError, ValueError):
            made, owner = now, {}
        found[student] = Claim(path, generation, owner if isinstance(owner, dict) else {}, max(0.0, now - made))
    return found


def finished(done: Path) -> set[str]:
    """Students whose grading in this run has ended (graded or failed): those with ``done/<student>.json``."""
    if not done.is_dir():
        return set()
    return {name[:-5] for name in os.listdir(done) if name.endswith(".json") and not name.startswith(".")}


def try_claim(claims: Path, student: str, generation: int, worker: str) -> bool:
    """Create ``<student>.<generation>`` exclusively: True when this worker now owns the student."""
    path = claims / f"{student}.{generation}"
    try:
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    except FileNotFoundError:
        raise RunReplaced(f"{claims} is gone: a newer intake replaced this run") from None
    with os.fdopen(handle, "w") as out:
        json.dump({"worker": worker, "machine": machine(), "pid": os.getpid(),
                   "claimed": time.strftime("%Y-%m-%d %H:%M:%S %z")}, out)
    return True


def claim_next(claims: Path, done: Path, students: list[str], worker: str, take_over_after: float,
               start: int = 0) -> tuple[str | None, int]:
    """The next student this worker now owns (None when none is left), and where its next search starts.

    First one that nobody claimed, from ``students[start]`` on: one exclusive create each, no listing of
    the folder, so a class of thousands costs each worker one try per student over the whole run. Then,
    once every student is claimed, one whose claim is abandoned: the claims folder is listed, and only
    the claims without a result are read. Raises :class:`RunReplaced` when the run's claims folder is
    gone (a newer intake replaced the run).
    """
    if not claims.is_dir():
        raise RunReplaced(f"{claims} is gone: a newer intake replaced this run")
    for index in range(start, len(students)):
        student = students[index]
        # A result without a claim can only come from outside this run's workers: it stands.
        if try_claim(claims, student, 1, worker) and not (done / f"{student}.json").exists():
            return student, index + 1
    over = finished(done)
    held = latest_claims(claims, skip=over)
    for student in students:
        claim = held.get(student)
        if claim is not None and claim.abandoned(take_over_after) \
                and try_claim(claims, student, claim.generation + 1, worker):
            return student, len(students)
    return None, len(students)


def pull(claims: Path, done: Path, students: list[str], grade_one: Callable[[str], None], *, worker: str,
         take_over_after: float, budget: Callable[[], bool] = lambda: True) -> list[str]:
    """Claim and grade students one at a time until none is left (or ``budget`` says stop); return them."""
    graded: list[str] = []
    position = 0
    while budget():
        student, position = claim_next(claims, done, students, worker, take_over_after, position)
        if student is None:
            break
        grade_one(student)
        graded.append(student)
    return graded


class Budget:
    """At most ``limit`` students for all of one worker's threads together (None: no limit)."""

    def __init__(self, limit: int | None):
        self.left = limit
        self.lock = threading.Lock()

    def __call__(self) -> bool:
        with self.lock:
            if self.left is None:
                return True
            if self.left <= 0:
                return False
            self.left -= 1
            return True


def live_claims(state: Path, manifest: dict, take_over_after: float) -> list[tuple[str, Claim]]:
    """Students of the manifest that a worker holds now: claimed, no result yet, the claim not abandoned."""
    claims = claims_folder(state, manifest["run"])
    if not claims.is_dir():
        return []
    held = latest_claims(claims, skip=finished(state / "done"))
    return [(student, claim) for student, claim in sorted(held.items()) if not claim.abandoned(take_over_after)]


def worker_name(index: int = 0) -> str:
    """How this worker (a process, or one of its threads) signs its claims."""
    return f"{socket.gethostname()} pid {os.getpid()} #{index}"
