"""nbgrader's Execute, made to survive what student notebooks do to kernels.

- A cell that kills the kernel (``os._exit``, a segfault, the memory killer) gets an error
  output saying so; the kernel is restarted, the cells before it are run again silently, and
  grading goes on, so only the checks that need that cell lose their points.
- A cell's output is capped (``max_output_bytes``); the rest is dropped with a note, so a
  submission that prints gigabytes cannot exhaust the grader's memory.
- The whole notebook has a time budget (``notebook_timeout``) on top of nbgrader's per-cell
  ``timeout``; cells past it are not run and say so.
- A cell that outlives its time and ignores the interrupt (SIGINT ignored, long C code) would
  keep the kernel busy and make every later cell time out: after a timeout the kernel must
  answer a silent request within ``answer_seconds``, else it is restarted as if it had died.
- The folders the sandbox lets the kernel write on the host (its sockets and the checks'
  records, ``runtime_dir``) are weighed several times a second; a kernel whose files there pass
  ``runtime_bytes`` is killed, the largest files are removed until the folder is under half
  its limit, and the cell says what happened. (The kernel's other writable places are
  size-limited tmpfs.)
- Before each graded cell the kernel is told, silently, where the checks should record the
  student's results (``STEPFORMER_RECORD``), so that the grader can re-run the checks in its
  own process (see ``stepformer.checks._core``). The records go to ``records_dir`` (the sandbox
  binds the grader's folder for them), by default beside the notebook.
"""

import os
import shutil
import signal
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from queue import Empty

from jupyter_core.utils import run_sync
from nbclient.exceptions import CellTimeoutError, DeadKernelError
from nbformat import NotebookNode
from nbgrader import utils
from nbgrader.preprocessors import Execute
from traitlets import Bool, Integer, Unicode

from stepformer.checks._core import RECORD_ENV
from stepformer.course.sandbox import Limits


class GradingExecute(Execute):
    max_output_bytes = Integer(1_000_000, help="Largest output one cell may keep, in bytes").tag(config=True)
    notebook_timeout = Integer(600, help="Seconds the whole notebook may run").tag(config=True)
    record = Bool(True, help="Have the checks record the student's results for the grader's re-check").tag(config=True)
    records_dir = Unicode("", help="Folder for the checks' records (one sub-folder per notebook); "
                                   "empty: beside the notebook").tag(config=True)
    sealed_dir = Unicode("", help="Folder the kernel cannot reach, where each graded cell's records are moved as "
                                  "soon as the cell has run (one sub-folder per notebook); empty: they stay"
                         ).tag(config=True)
    runtime_dir = Unicode("", help="Host folder the sandboxed kernel may write (sockets, records); "
                                   "empty: not watched").tag(config=True)
    runtime_bytes = Integer(Limits.tmp_bytes, help="Largest total size of the kernel's files in runtime_dir"
                            ).tag(config=True)
    answer_seconds = Integer(10, help="After a cell timed out, seconds the kernel has to answer before it is "
                                      "restarted").tag(config=True)

    def preprocess(self, nb, resources=None, km=None):
        self._started = time.monotonic()
        self._killers: set[int] = set()
        self._output_bytes: dict[int, int] = {}
        self._timed_out = False
        self._records = records_folder(Path((resources or {}).get("metadata", {}).get("path") or "."),
                                       (resources or {}).get("unique_key") or "notebook", self.records_dir or None)
        self._sealed = records_folder(Path("."), (resources or {}).get("unique_key") or "notebook",
                                      self.sealed_dir) if self.sealed_dir else None
        self._overflow = False
        stop = threading.Event()
        watcher = threading.Thread(target=self._watch_runtime, args=(stop,), daemon=True) if self.runtime_dir else None
        if watcher:
            watcher.start()
        try:
            return super().preprocess(nb, resources, km)
        finally:
            stop.set()
            if watcher:
                watcher.join()

    def _watch_runtime(self, stop: threading.Event) -> None:
        """Kill the kernel when its files in ``runtime_dir`` outgrow ``runtime_bytes``; free the space."""
        folder = Path(self.runtime_dir)
        while not stop.wait(0.2):
            files = _files_by_size(folder)
            if sum(size for size, _ in files) <= self.runtime_bytes:
                continue
            self._overflow = True
            provisioner = getattr(self.km, "provisioner", None)
            pgid, launcher = getattr(provisioner, "pgid", None), getattr(provisioner, "process", None)
            if pgid:
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            # The kernel runs in a session of its own inside bwrap and dies with bwrap a moment
            # later: weigh again only then, or its last writes would count against its successor.
            deadline = time.monotonic() + 5
            while launcher is not None and launcher.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)
            files = _files_by_size(folder)
            # The biggest files go first (the checks' own records are small), down to half the
            # limit: the restarted kernel's records need room, or they would trip the limit again.
            total = sum(size for size, _ in files)
            for size, path in sorted(files, reverse=True):
                if total <= self.runtime_bytes // 2:
                    break
                path.unlink(missing_ok=True)
                total -= size

    def preprocess_cell(self, cell, resources, index):
        if cell.cell_type != "code":
            return cell, resources
        if time.monotonic() - self._started > self.notebook_timeout:
            cell.outputs = [_error("NotebookTimeLimit", f"not run: the notebook used up its {self.notebook_timeout} s")]
            return cell, resources
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id") if utils.is_grade(cell) else None
        try:
            self._timed_out = False
            try:
                # Inside the try: a kernel may die between cells too (a thread, a patched os.environ).
                if grade_id and self.record:
                    self._silent(f"__import__('os').environ[{RECORD_ENV!r}] = {str(self._records / grade_id)!r}")
                cell, resources = super().preprocess_cell(cell, resources, index)
                if not self._timed_out or self._answers(self.answer_seconds):
                    return cell, resources
                what = "kept running past its time and ignored the interrupt"
            except (DeadKernelError, CellTimeoutError) as error:
                what = "died" if isinstance(error, DeadKernelError) else "stopped answering"
            self._killers.add(index)
            if self._overflow:
                self._overflow = False
                what = (f"was stopped while running this cell: it wrote more than {self.runtime_bytes} bytes into "
                        "the grader's folders, and the largest files were removed")
            else:
                what += (" while running this cell (os._exit, a crash, too much memory, a broken interpreter, or an "
                         "interrupt ignored)")
            cell.outputs.append(_error(
                "KernelDied", f"the kernel {what}; it was restarted and the cells before this one were run again"))
            self._restart(index)
            return cell, resources
        finally:
            if grade_id and self.record and self._alive():
                try:
                    self._silent(f"__import__('os').environ.pop({RECORD_ENV!r}, None)")
                except (DeadKernelError, TimeoutError):
                    pass  # the next cell finds the kernel dead and says so
            if grade_id and self.record and self._sealed is not None:
                self._seal(grade_id)

    def _seal(self, grade_id: str) -> None:
        """Move the cell's records where the kernel cannot reach: no later cell can rewrite them.

        So a later cell that tampers can cost only the checks that run after it.
        """
        written, sealed = self._records / grade_id, self._sealed / grade_id
        sealed.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(sealed, ignore_errors=True)
        if written.is_dir() and not written.is_symlink():
            try:
                os.replace(written, sealed)  # one step on one file system
            except OSError:
                shutil.copytree(written, sealed, symlinks=True)
                shutil.rmtree(written, ignore_errors=True)

    async def _async_handle_timeout(self, timeout, cell=None):
        self._timed_out = True
        return await super()._async_handle_timeout(timeout, cell)

    def _answers(self, seconds: float) -> bool:
        """Whether the kernel replies to an empty silent request within ``seconds``."""
        try:
            msg_id = self.kc.execute("", silent=True, store_history=False, allow_stdin=False)
            deadline = time.monotonic() + seconds
            while (left := deadline - time.monotonic()) > 0:
                reply = run_sync(self.kc.get_shell_msg)(timeout=left)
                if reply.get("parent_header", {}).get("msg_id") == msg_id:
                    return True
        except (Empty, TimeoutError, RuntimeError):
            pass
        return False

    def output(self, outs, msg, display_id, cell_index):
        size = len(str(msg.get("content", "")))
        used = self._output_bytes.get(cell_index, 0)
        self._output_bytes[cell_index] = used + size
        if used + size > self.max_output_bytes:
            if used <= self.max_output_bytes:
                outs.append(NotebookNode(output_type="stream", name="stdout",
                                         text=f"\n[output cut: more than {self.max_output_bytes} bytes]\n"))
                self._output_bytes[cell_index] = self.max_output_bytes + 1
            return None
        return super().output(outs, msg, display_id, cell_index)

    def _alive(self) -> bool:
        try:
            return bool(run_sync(self.km.is_alive)())
        except Exception:
            return False

    def _silent(self, code: str) -> None:
        msg_id = self.kc.execute(code, silent=True, store_history=False, allow_stdin=False)
        self.wait_for_reply(msg_id)

    def _restart_kernel(self) -> None:
        run_sync(self.km.restart_kernel)(now=True)
        # The dead kernel's messages still queued on IOPub would let wait_for_ready (which waits for
        # any IOPub message) return before IOPub is connected to the new kernel, and its output be lost.
        while True:
            try:
                run_sync(self.kc.iopub_channel.get_msg)(timeout=0.1)
            except Empty:
                break
        run_sync(self.kc.wait_for_ready)(timeout=self.startup_timeout)

    def _restart(self, index: int) -> None:
        self._restart_kernel()
        for earlier, cell in enumerate(self.nb.cells[:index]):
            if cell.cell_type == "code" and earlier not in self._killers and cell.source.strip():
                try:
                    self._silent(cell.source)
                except (DeadKernelError, TimeoutError):
                    self._restart_kernel()
                    self._killers.add(earlier)


def records_folder(notebook_folder: Path, notebook: str, records_dir: Path | str | None = None) -> Path:
    """Where the checks of ``notebook`` record results during grading: under ``records_dir`` if given
    (the sandbox's bound records folder), else beside the notebook."""
    if records_dir:
        return Path(records_dir).resolve() / notebook
    return notebook_folder.resolve() / ".stepformer-records" / notebook


def entries(folder: Path) -> Iterator[tuple[Path, os.stat_result]]:
    """Every file and folder under ``folder`` with its ``lstat`` (links are listed, never followed)."""
    for top, dirs, files in os.walk(folder, followlinks=False):
        for name in [*dirs, *files]:
            path = Path(top) / name
            try:
                yield path, os.lstat(path)
            except OSError:
                continue


def _files_by_size(folder: Path) -> list[tuple[int, Path]]:
    """``(size on disk, path)`` of every plain file under ``folder``: a sparse file takes little."""
    return [(info.st_blocks * 512, path) for path, info in entries(folder) if stat.S_ISREG(info.st_mode)]


def _error(name: str, message: str) -> NotebookNode:
    return NotebookNode(output_type="error", ename=name, evalue=message, traceback=[f"{name}: {message}"])
