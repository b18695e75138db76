"""A bubblewrap sandbox for the Jupyter kernel that runs untrusted student notebooks while grading.

``install_kernelspec`` writes a kernelspec whose argv starts this file as a launcher; nbgrader then
starts every grading kernel through it (``Execute.kernel_name``). The launcher runs ``bwrap`` so
that the kernel:

* sees the whole filesystem read-only, with the ``--hide`` folders (the course repository with
  ``solutions/``, the grading work folder with the gradebook and every student's files, the
  grader's home) and the usual homes of host Unix sockets (``/run``, ``/var/run``, ``/var/tmp``)
  covered by empty tmpfs; the Python environment and the ``stepformer`` package are re-exposed
  read-only where they lie under a covered folder;
* starts in an empty, size-limited tmpfs mounted at the path of its working folder: it never sees
  nor writes the real notebook folder (which holds the notebook with its hidden tests, and whose
  files nbgrader copies into the feedback outside the sandbox);
* may write only to that tmpfs, to a size-limited tmpfs on ``/tmp`` (and ``/dev/shm``), and to two
  folders the grader made in its runtime folder (named by the ``STEPFORMER_SANDBOX_RUNTIME``
  variable of the launcher's environment): ``sock/`` for the ipc sockets and ``records/`` for the
  checks' records. Nothing the kernel can write decides what is mounted: the launcher binds only
  those two fixed folders, after checking with ``lstat`` that they are real folders, and binds
  the connection file read-only;
* has no network (``--unshare-net``: the kernel must use the ipc transport), its own pid, ipc,
  uts and user namespaces, no capabilities, and an environment of a few fixed variables;
* runs under rlimits (address space, processes, file size, CPU time, no core dumps) and a
  wall-clock limit on its whole life.

The launcher itself imports only the standard library and is started as ``python -I sandbox.py``:
``-m stepformer.course.sandbox`` would import ``stepformer`` (and with it torch, ~2 s) on every
kernel start. Both forms run the same ``main()``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

BWRAP = "bwrap"
# The package folder (src/stepformer or site-packages/stepformer), found without importing it.
PACKAGE_DIR = Path(__file__).resolve().parent.parent
# Tasks that the sandbox needs besides the student's: `timeout`, bwrap's monitor and its pid-1 init.
_OVERHEAD_TASKS = 3
# Size of the tmpfs that covers a hidden folder: it only holds the mount points bwrap creates.
_HIDDEN_TMPFS_BYTES = 1 << 20
# The launcher's environment variable naming the grader's runtime folder (see RUNTIME_FOLDERS).
RUNTIME_ENV = "STEPFORMER_SANDBOX_RUNTIME"
# The runtime folder's sub-folders that the kernel may write: ipc sockets, the checks' records.
RUNTIME_FOLDERS = ("sock", "records")
# Where host daemons keep their Unix sockets (D-Bus, PostgreSQL, docker, ...): covered by empty tmpfs.
_SOCKET_FOLDERS = ("/run", "/var/run", "/var/tmp")


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandboxed kernel.

    ``cell_seconds`` is for the grader (nbgrader's ``Execute.timeout``); ``notebook_seconds`` is
    the kernel's whole wall-clock life (the launcher kills it after that); the others are enforced
    inside the sandbox. ``memory_bytes`` is address space (RLIMIT_AS, per process), not resident
    memory: a kernel that has imported torch and run a matmul maps ~0.8 GiB (one thread per
    library; every extra thread reserves a 64 MiB malloc arena), so 4 GiB leaves ~3 GiB of data.
    """

    cell_seconds: int = 60
    notebook_seconds: int = 600
    memory_bytes: int = 4 * 2**30
    processes: int = 64  # tasks, threads included (RLIMIT_NPROC and pids.max both count threads)
    file_bytes: int = 64 * 2**20
    tmp_bytes: int = 256 * 2**20  # each tmpfs, and the grader's runtime folders (watched by the grader)
    cpu_seconds: int | None = None  # None: 2 * notebook_seconds

    @property
    def cpu_limit(self) -> int:
        """CPU seconds per process (RLIMIT_CPU): a backstop should the wall-clock limit fail."""
        return self.cpu_seconds if self.cpu_seconds is not None else 2 * self.notebook_seconds

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Limits:
        return cls(**json.loads(text))


@functools.cache
def sandbox_problem() -> str | None:
    """None when a bwrap sandbox starts on this machine (tried once per process), else why not and what to do."""
    bwrap = shutil.which(BWRAP)
    if bwrap is None:
        return "bubblewrap is not installed: apt-get install bubblewrap (or dnf install bubblewrap)"
    # The same options as the kernel's sandbox, so that an old bwrap (--size and --disable-userns
    # need 0.8) fails here, not in the middle of grading.
    command = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
               "--cap-drop", "ALL", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
               "--size", "1048576", "--tmpfs", "/tmp", "--remount-ro", "/dev", "--", "true"]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"bubblewrap ({bwrap}) cannot be run: {error}"
    if result.returncode == 0:
        return None
    message = " ".join(result.stderr.split()) or f"exit status {result.returncode}"
    if any(hint in message for hint in ("Operation not permitted", "No permission", "setting up uid map",
                                         "Permission denied", "namespace")):
        return (f"bubblewrap cannot create a user namespace ({message}): enable unprivileged user namespaces "
                "(sysctl kernel.unprivileged_userns_clone=1 on Debian; on Ubuntu 23.10+ allow bwrap in AppArmor "
                "or sysctl kernel.apparmor_restrict_unprivileged_userns=0; user.max_user_namespaces must be > 0)")
    return f"bubblewrap does not start a sandbox here: {message}"


def install_kernelspec(kernels_dir: Path, *, limits: Limits, hidden: list[Path], name: str = "stepformer-sandbox",
                       hide_home: bool = True) -> str:
    """Write ``kernels_dir/<name>/kernel.json`` for a sandboxed Python kernel; return the kernel name.

    ``hidden``: folders the kernel must not see (course repository, grading work folder). The
    grader's home is hidden too unless ``hide_home`` is false (it holds keys that a student could
    print into the feedback). Put ``kernels_dir.parent`` on JUPYTER_PATH.
    """
    from stepformer.checks._messages import LANGUAGE_ENV

    folders = [Path(p).resolve() for p in hidden]
    if hide_home:
        folders.append(Path.home().resolve())
    argv = [sys.executable, "-I", str(Path(__file__).resolve()), "--limits", limits.to_json()]
    for folder in folders:
        argv += ["--hide", str(folder)]
    # Named here, not imported by the launcher: importing the checks imports torch, twice a kernel start.
    argv += ["--pass", LANGUAGE_ENV]
    argv += ["--", "{connection_file}"]
    spec = {
        "argv": argv,
        "display_name": "Python 3 (stepformer sandbox)",
        "language": "python",
        # bwrap --new-session puts the kernel in its own session, so a SIGINT sent to the launcher's
        # process group never reaches it; ipykernel interrupts itself on an interrupt_request.
        "interrupt_mode": "message",
        "metadata": {"debugger": False},
    }
    folder = Path(kernels_dir) / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "kernel.json").write_text(json.dumps(spec, indent=1) + "\n")
    return name


def _within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _environment(passed: Sequence[str] = ()) -> dict[str, str]:
    """The kernel's whole environment: nothing of the grader's leaks in but NBGRADER_EXECUTION and the variables
    ``passed`` (the checks' language, which the grading worker sets to the submission's)."""
    env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
        "HOME": "/tmp",
        "LANG": "C.UTF-8",
        "MPLCONFIGDIR": "/tmp",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYDEVD_DISABLE_FILE_VALIDATION": "1",  # else debugpy warns on stderr at start
        "TOKENIZERS_PARALLELISM": "false",
    }
    # One kernel must not take every core (several students are graded at once), and each thread
    # counts against the process limit.
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
                     "VECLIB_MAXIMUM_THREADS"):
        env[variable] = "1"
    # Notebooks may skip slow work while autograded; nbgrader sets this in the grader.
    if "NBGRADER_EXECUTION" in os.environ:
        env["NBGRADER_EXECUTION"] = os.environ["NBGRADER_EXECUTION"]
    for variable in passed:
        if variable in os.environ and variable not in env:
            env[variable] = os.environ[variable]
    return env


def make_runtime(runtime: Path) -> dict[str, Path]:
    """Create the runtime folder's sub-folders the kernel may write (``sock``, ``records``); return them."""
    folders = {name: Path(runtime) / name for name in RUNTIME_FOLDERS}
    for folder in folders.values():
        folder.mkdir(mode=0o700, exist_ok=True)
    return folders


def _real_dir(path: Path) -> bool:
    """A directory itself, not a link to one (``lstat``), owned by us."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid()


class SandboxError(RuntimeError):
    """The launcher refuses to start the kernel (its runtime folder is missing or not what the grader made)."""


def _socket_folders() -> list[Path]:
    """The host's socket folders that exist as real directories (``/var/run`` is usually a link to ``/run``)."""
    found = []
    for name in _SOCKET_FOLDERS:
        try:
            if stat.S_ISDIR(os.lstat(name).st_mode):
                found.append(Path(name))
        except OSError:
            pass
    return found


def bwrap_command(limits: Limits, hidden: list[Path], connection_file: Path, cwd: Path, runtime: Path,
                  passed: Sequence[str] = ()) -> list[str]:
    """The bwrap command line that runs the kernel of ``connection_file`` in the sandbox.

    ``runtime`` is the grader's runtime folder: only its ``sock/`` and ``records/`` sub-folders are
    bound writable. ``cwd`` is covered by an empty tmpfs. Nothing is read from the connection file.
    ``passed``: environment variables the kernel gets from the launcher's environment.
    """
    runtime = Path(os.path.abspath(runtime))
    writable = [runtime / name for name in RUNTIME_FOLDERS]
    for folder in writable:
        if not _real_dir(folder):
            raise SandboxError(f"{folder} is not a folder of the grader's (missing, a link, or someone else's)")
    connection_file = Path(os.path.abspath(connection_file))
    try:
        regular = stat.S_ISREG(os.lstat(connection_file).st_mode)
    except OSError:
        regular = False
    if not regular:
        raise SandboxError(f"the connection file {connection_file} is not a regular file")
    cwd = cwd.resolve()
    hidden = [Path(p).resolve() for p in hidden]
    covered = [*hidden, *_socket_folders()]
    readable = {Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(), PACKAGE_DIR,
                Path(sys.executable).resolve().parent}
    # Mounts go in order of depth so that a path re-exposed inside a hidden folder, or a folder
    # hidden inside a re-exposed one, ends up on top; at equal depth hiding goes first.
    mounts: list[tuple[int, int, list[str]]] = []
    for folder in covered:
        if folder.is_dir():
            mounts.append((len(folder.parts), 0, ["--size", str(_HIDDEN_TMPFS_BYTES), "--tmpfs", str(folder)]))
    # The working folder: an empty tmpfs at the same path, on top of the hidden work folder's.
    mounts.append((len(cwd.parts), 1, ["--size", str(limits.tmp_bytes), "--tmpfs", str(cwd)]))
    shadowed = [*covered, Path("/tmp")]  # a venv under /tmp vanishes under the sandbox's own /tmp
    for path in readable:
        if path.exists() and any(_within(path, folder) for folder in shadowed) \
                and not any(_within(path, other) for other in writable):
            mounts.append((len(path.parts), 2, ["--ro-bind", str(path), str(path)]))
    for path in writable:
        mounts.append((len(path.parts), 2, ["--bind", str(path), str(path)]))
    mounts.append((len(connection_file.parts), 3, ["--ro-bind", str(connection_file), str(connection_file)]))
    command = [shutil.which(BWRAP) or BWRAP,
               "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
               "--cap-drop", "ALL",
               "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
               "--size", str(limits.tmp_bytes), "--tmpfs", "/tmp",
               "--size", str(limits.tmp_bytes), "--tmpfs", "/dev/shm"]
    for _, _, arguments in sorted(mounts, key=lambda m: (m[0], m[1])):
        command += arguments
    # The empty tmpfs over hidden folders and bwrap's /dev would otherwise be writable (unbounded
    # memory); --remount-ro is not recursive, so the binds and /dev/shm inside them stay as they are.
    for folder in covered:
        if folder.is_dir() and folder not in writable and folder != cwd:  # not a bind on the same path
            command += ["--remount-ro", str(folder)]
    command += ["--remount-ro", "/dev", "--clearenv"]
    for variable, value in _environment(passed).items():
        command += ["--setenv", variable, value]
    command += ["--chdir", str(cwd), "--",
                sys.executable, "-I", str(Path(__file__).resolve()), "--inside", "--limits", limits.to_json(),
                "--", str(connection_file)]
    return command


def _pids_cgroup(limit: int) -> str | None:
    """Move this process into a new pids cgroup limited to ``limit`` tasks; None on success, else why not.

    Needed when the grader runs as root: the kernel then runs as kernel uid 0 inside its user
    namespace, and Linux never applies RLIMIT_NPROC to uid 0 (copy_process exempts INIT_USER), so
    only a pids cgroup stops a fork bomb. Cgroups left empty by earlier kernels are removed here.
    """
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError as error:
        return str(error)
    base = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "pids" in controllers.split(","):  # cgroup v1
            base = Path("/sys/fs/cgroup/pids") / path.lstrip("/")
            break
        if controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").exists():  # cgroup v2
            base = Path("/sys/fs/cgroup") / path.lstrip("/")
            # v2 enables a controller for children only in a cgroup without processes of its own
            # (our session's cgroup has some): use the nearest ancestor that already delegates pids.
            for ancestor in [base, *base.parents]:
                try:
                    if "pids" in (ancestor / "cgroup.subtree_control").read_text().split():
                        base = ancestor
                        break
                except OSError:
                    break
    if base is None or not base.is_dir():
        return "no pids cgroup controller found"
    try:
        for stale in base.glob("stepformer-kernel-*"):
            try:
                stale.rmdir()  # fails (EBUSY) while a kernel still runs in it
            except OSError:
                pass
        control = base / "cgroup.subtree_control"
        if control.exists() and "pids" not in control.read_text().split():
            control.write_text("+pids")
        group = base / f"stepformer-kernel-{os.getpid()}"
        group.mkdir(exist_ok=True)
        (group / "pids.max").write_text(str(limit))
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as error:
        return f"{base}: {error}"
    return None


def _run_kernel(limits: Limits, connection_file: str) -> None:
    """Inside the sandbox: apply the rlimits, then become the ipykernel."""
    import resource

    for limit, value in ((resource.RLIMIT_AS, limits.memory_bytes), (resource.RLIMIT_NPROC, limits.processes),
                         (resource.RLIMIT_FSIZE, limits.file_bytes), (resource.RLIMIT_CPU, limits.cpu_limit),
                         (resource.RLIMIT_CORE, 0)):
        # Hard limit too, so that student code cannot raise it back.
        resource.setrlimit(limit, (value, value))
    # Python ignores SIGXFSZ, so a too-large write raises OSError (EFBIG) instead of killing the kernel.
    # -P: no working folder on sys.path, so a planted ipykernel_launcher.py cannot run instead.
    os.execv(sys.executable, [sys.executable, "-P", "-m", "ipykernel_launcher", "-f", connection_file,
                              "--HistoryManager.hist_file=:memory:"])


def main(argv: list[str] | None = None) -> None:
    """Launcher: ``sandbox.py --limits JSON [--hide DIR]... -- CONNECTION_FILE`` execs bwrap (under timeout)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limits", type=Limits.from_json, default=Limits())
    parser.add_argument("--hide", type=Path, action="append", default=[])
    parser.add_argument("--pass", dest="passed", action="append", default=[],
                        help="an environment variable the kernel gets, if set")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("connection_file")
    args = parser.parse_args(argv)
    limits: Limits = args.limits
    if args.inside:
        _run_kernel(limits, args.connection_file)
        return
    problem = sandbox_problem()
    if problem:
        sys.exit(f"stepformer sandbox: {problem}")
    runtime = os.environ.get(RUNTIME_ENV)
    if not runtime or not os.path.isabs(runtime):
        sys.exit(f"stepformer sandbox: {RUNTIME_ENV} must name the grader's runtime folder (an absolute path)")
    try:
        command = bwrap_command(limits, args.hide, Path(args.connection_file), Path.cwd(), Path(runtime), args.passed)
    except SandboxError as error:
        sys.exit(f"stepformer sandbox: {error}")
    if os.geteuid() == 0:
        why = _pids_cgroup(limits.processes + _OVERHEAD_TASKS)
        if why:
            print(f"stepformer sandbox: WARNING: no process limit (running as root, {why})", file=sys.stderr)
    timeout = shutil.which("timeout")
    if timeout:
        # The kernel's whole life; coreutils timeout forwards SIGTERM/SIGINT from jupyter_client to bwrap.
        command = [timeout, "-s", "KILL", str(limits.notebook_seconds), *command]
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
