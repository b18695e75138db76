"""The grading sandbox: a real kernel started through its kernelspec, probed from inside.

One kernel serves most tests (starting one takes about a second); each test runs cells in it
the way nbgrader does and checks what student code can and cannot do.
"""

import json
import os
import socket
import time
from pathlib import Path

import pytest

from stepformer.course.sandbox import (
    RUNTIME_ENV,
    Limits,
    SandboxError,
    bwrap_command,
    install_kernelspec,
    make_runtime,
)
from tests.fixtures.prerequisites import missing

pytestmark = pytest.mark.usefixtures("sandbox_required")


jupyter_client = pytest.importorskip("jupyter_client")

LIMITS = Limits(notebook_seconds=300, memory_bytes=3 * 2**30, processes=64, file_bytes=8 * 2**20,
                tmp_bytes=16 * 2**20)


def _layout(root: Path) -> dict[str, Path]:
    """A course repository, a grading work folder and a home, each with a secret in it."""
    paths = {"repo": root / "repo", "work": root / "work", "home": root / "home"}
    (paths["repo"] / "solutions").mkdir(parents=True)
    (paths["repo"] / "solutions" / "secret.ipynb").write_text("the solution")
    (paths["work"] / "gradebook.db").parent.mkdir(parents=True)
    (paths["work"] / "gradebook.db").write_text("grades")
    (paths["work"] / "autograded" / "other" / "a1").mkdir(parents=True)
    (paths["work"] / "autograded" / "other" / "a1" / "answers.ipynb").write_text("another student")
    paths["cwd"] = paths["work"] / "autograded" / "student" / "a1"
    paths["cwd"].mkdir(parents=True)
    # nbgrader writes the notebook, hidden tests and all, into the kernel's working folder.
    (paths["cwd"] / "answers.ipynb").write_text("### BEGIN HIDDEN TESTS")
    paths["runtime"] = paths["work"] / "runtime" / "student"
    paths["runtime"].mkdir(parents=True)
    paths.update(make_runtime(paths["runtime"]))
    paths["home"].mkdir()
    (paths["home"] / "id_rsa").write_text("private key")
    return paths


def _start(paths: dict[str, Path], limits: Limits, monkeypatch) -> tuple:
    """Start a sandboxed kernel the way the grader does; return (manager, client)."""
    monkeypatch.setenv("HOME", str(paths["home"]))
    monkeypatch.setenv("STEPFORMER_GRADER_SECRET", "x")
    monkeypatch.setenv("JUPYTER_PATH", str(paths["work"] / "jupyter"))
    monkeypatch.setenv(RUNTIME_ENV, str(paths["runtime"]))
    name = install_kernelspec(paths["work"] / "jupyter" / "kernels", limits=limits,
                              hidden=[paths["repo"], paths["work"]])
    manager = jupyter_client.KernelManager(kernel_name=name, transport="ipc", ip=str(paths["sock"] / "ipc"),
                                           connection_file=str(paths["runtime"] / "kernel.json"))
    manager.start_kernel(cwd=str(paths["cwd"]))
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=60)
    except RuntimeError:
        manager.shutdown_kernel(now=True)
        raise
    return manager, client


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    paths = _layout(tmp_path_factory.mktemp("sandbox"))
    with pytest.MonkeyPatch.context() as monkeypatch:
        manager, client = _start(paths, LIMITS, monkeypatch)

    def run(code: str, timeout: float = 30) -> dict:
        """Run one cell; return its status, stdout and error name."""
        stdout = []

        def hook(message):
            if message["header"]["msg_type"] == "stream" and message["content"]["name"] == "stdout":
                stdout.append(message["content"]["text"])

        reply = client.execute_interactive(code, timeout=timeout, output_hook=hook)
        return {"status": reply["content"]["status"], "stdout": "".join(stdout),
                "ename": reply["content"].get("ename")}

    run.paths = paths
    run.manager = manager
    run.client = client
    yield run
    client.stop_channels()
    manager.shutdown_kernel(now=False)


def _alive(kernel) -> None:
    assert kernel("print(6 * 7)")["stdout"] == "42\n"


def test_hidden_folders_cannot_be_read(kernel):
    paths = kernel.paths
    secrets = [paths["repo"] / "solutions" / "secret.ipynb", paths["work"] / "gradebook.db",
               paths["work"] / "autograded" / "other" / "a1" / "answers.ipynb", paths["home"] / "id_rsa"]
    result = kernel(f"""
import json
found = []
for path in {json.dumps([str(p) for p in secrets])}:
    try:
        open(path).read()
        found.append(path)
    except (FileNotFoundError, PermissionError):
        pass
print(json.dumps(found))
""")
    assert result["status"] == "ok", result
    assert json.loads(result["stdout"]) == []


def test_writes_only_to_tmpfs_sockets_and_records(kernel):
    paths = kernel.paths
    forbidden = [paths["repo"] / "x", paths["work"] / "x", paths["cwd"].parent / "x", paths["home"] / "x",
                 paths["runtime"] / "x", Path("/etc/stepformer-x"), Path("/var/tmp/stepformer-x"),
                 Path("/run/stepformer-x"), Path("/dev/x")]
    result = kernel(f"""
import json, os
written = []
for path in {json.dumps([str(p) for p in forbidden])}:
    try:
        open(path, "w").write("x")
        written.append(path)
    except OSError:
        pass
open("answer.txt", "w").write("ok")
open("/tmp/scratch.txt", "w").write("ok")
open({str(paths["records"] / "r.txt")!r}, "w").write("ok")
print(json.dumps(written), os.getcwd())
""")
    assert result["status"] == "ok", result
    written, cwd = result["stdout"].split()
    assert json.loads(written) == []
    assert cwd == str(paths["cwd"].resolve())
    # The working folder is a tmpfs at the same path: the real one is never written.
    assert not (paths["cwd"] / "answer.txt").exists()
    assert (paths["records"] / "r.txt").read_text() == "ok"
    assert not any(p.exists() for p in forbidden)


def test_working_folder_is_empty_and_the_notebook_unreadable(kernel):
    result = kernel("""
import os
print(sorted(set(os.listdir('.')) - {'answer.txt'}))
try:
    print(open('answers.ipynb').read())
except OSError as error:
    print(type(error).__name__)
""")
    assert result["stdout"] == "[]\nFileNotFoundError\n", result


def test_kernel_starts_without_cwd_on_sys_path(kernel):
    result = kernel("import sys; print(sys.flags.safe_path, sys.flags.isolated)")
    assert result["stdout"] == "True 0\n", result


def test_host_unix_sockets_are_hidden(kernel):
    folders = [f for f in (Path("/run"), Path("/var/tmp")) if f.is_dir() and os.access(f, os.W_OK)]
    if not folders:
        missing("cannot create a socket in /run or /var/tmp here")
    listeners = []
    try:
        for folder in folders:
            path = folder / f"stepformer-test-{os.getpid()}.sock"
            listener = socket.socket(socket.AF_UNIX)
            listener.bind(str(path))
            listener.listen()
            listener.settimeout(0.2)
            listeners.append((path, listener))
        result = kernel(f"""
import socket
for path in {json.dumps([str(p) for p, _ in listeners])}:
    try:
        socket.socket(socket.AF_UNIX).connect(path)
        print("connected", path)
    except OSError:
        pass
""")
        assert result["status"] == "ok", result
        assert result["stdout"] == ""
        for _, listener in listeners:
            with pytest.raises(TimeoutError):
                listener.accept()
    finally:
        for path, listener in listeners:
            listener.close()
            path.unlink(missing_ok=True)


def test_links_in_the_socket_folder_do_not_widen_the_sandbox(tmp_path, monkeypatch):
    """A link planted where the sockets go, then a kernel restart: the new kernel sees no more."""
    paths = _layout(tmp_path)
    manager, client = _start(paths, LIMITS, monkeypatch)
    solutions = paths["repo"] / "solutions"
    try:
        client.execute(f"""
import json, os
from ipykernel.connect import get_connection_file
ip = json.load(open(get_connection_file()))["ip"]
os.symlink({str(solutions / "secret.ipynb")!r}, ip)
os.symlink({str(solutions)!r}, os.path.join(os.path.dirname(ip), "records"))
os._exit(1)
""")
        deadline = time.monotonic() + 15
        while manager.is_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (paths["sock"] / "ipc").is_symlink()
        # A fresh client: the old one's IOPub queue still holds the dead kernel's messages, which
        # would let wait_for_ready return before IOPub is connected to the new kernel.
        client.stop_channels()
        manager.restart_kernel(now=True)
        client = manager.client()
        client.start_channels()
        client.wait_for_ready(timeout=60)
        stdout = []
        reply = client.execute_interactive(f"""
for path in [{str(solutions / "secret.ipynb")!r}, {str(solutions / "planted.txt")!r}]:
    try:
        print(open(path, "a+").read())
    except OSError as error:
        print(type(error).__name__)
""", timeout=30, output_hook=lambda m: stdout.append(m["content"].get("text", "")))
        assert reply["content"]["status"] == "ok"
        assert "".join(stdout).split() == ["FileNotFoundError", "FileNotFoundError"]
        assert not (solutions / "planted.txt").exists()
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def test_the_launcher_imports_only_the_standard_library():
    """The launcher runs twice per kernel start (outside, then inside bwrap): an import of the checks (torch)
    there would cost every student about three seconds."""
    import subprocess
    import sys

    from stepformer.course import sandbox

    probe = ("import runpy, sys\nbefore = set(sys.modules)\nsys.argv = [sys.argv[1], '--help']\n"
             "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\nexcept SystemExit:\n    pass\n"
             "print(' '.join(sorted(set(sys.modules) - before)))")
    result = subprocess.run([sys.executable, "-I", "-c", probe, sandbox.__file__], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    imported = {name.split(".")[0] for name in result.stdout.splitlines()[-1].split()}
    assert "argparse" in imported and imported <= set(sys.stdlib_module_names), imported - set(sys.stdlib_module_names)


def test_the_kernel_gets_only_the_variables_passed_to_it(tmp_path, monkeypatch):
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    make_runtime(runtime)
    connection = runtime / "kernel.json"
    connection.write_text("{}")
    monkeypatch.setenv("STEPFORMER_LANG", "zh")
    monkeypatch.setenv("STEPFORMER_GRADER_SECRET", "x")
    command = bwrap_command(LIMITS, [], connection, tmp_path, runtime, passed=["STEPFORMER_LANG"])
    assert ["--setenv", "STEPFORMER_LANG", "zh"] == command[command.index("STEPFORMER_LANG") - 1:
                                                            command.index("STEPFORMER_LANG") + 2]
    assert "STEPFORMER_GRADER_SECRET" not in command
    assert "STEPFORMER_LANG" not in bwrap_command(LIMITS, [], connection, tmp_path, runtime)
    name = install_kernelspec(tmp_path / "kernels", limits=LIMITS, hidden=[])
    spec = json.loads((tmp_path / "kernels" / name / "kernel.json").read_text())
    assert spec["argv"][spec["argv"].index("--pass") + 1] == "STEPFORMER_LANG"


def test_launcher_refuses_a_linked_runtime_folder(tmp_path):
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    folders = make_runtime(runtime)
    connection = runtime / "kernel.json"
    connection.write_text("{}")
    command = bwrap_command(LIMITS, [tmp_path / "work"], connection, tmp_path, runtime)
    assert ["--bind", str(folders["sock"]), str(folders["sock"])] == command[command.index(str(folders["sock"])) - 1:
                                                                            command.index(str(folders["sock"])) + 2]
    assert ["--ro-bind", str(connection), str(connection)] == command[command.index(str(connection)) - 1:
                                                                      command.index(str(connection)) + 2]
    folders["sock"].rmdir()
    (tmp_path / "elsewhere").mkdir()
    folders["sock"].symlink_to(tmp_path / "elsewhere")
    with pytest.raises(SandboxError):
        bwrap_command(LIMITS, [], connection, tmp_path, runtime)
    folders["sock"].unlink()
    folders["sock"].mkdir()
    connection.unlink()
    connection.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(SandboxError):
        bwrap_command(LIMITS, [], connection, tmp_path, runtime)


def test_no_network(kernel):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        result = kernel(f"""
import socket
for host, port in [("127.0.0.1", {port}), ("1.1.1.1", 53), ("example.com", 80)]:
    try:
        socket.create_connection((host, port), timeout=2).close()
        print("connected", host)
    except OSError:
        pass
""")
        assert result["status"] == "ok", result
        assert result["stdout"] == ""
        with pytest.raises(TimeoutError):
            listener.accept()


def test_environment_is_clean(kernel):
    result = kernel("import os, json; print(json.dumps(dict(os.environ)))")
    env = json.loads(result["stdout"])
    assert "STEPFORMER_GRADER_SECRET" not in env
    assert "JPY_PARENT_PID" not in env
    assert env["HOME"] == "/tmp"
    assert env["OMP_NUM_THREADS"] == "1"


def test_torch_and_stepformer_import(kernel):
    result = kernel("""
import torch
from stepformer.attention import scaled_dot_product_attention
a = torch.ones(256, 256)
print(float((a @ a)[0, 0]), scaled_dot_product_attention.__name__)
""")
    assert result["status"] == "ok", result
    assert result["stdout"] == "256.0 scaled_dot_product_attention\n"


def test_rlimits_are_set_and_cannot_be_raised(kernel):
    result = kernel("""
import resource
names = ["RLIMIT_AS", "RLIMIT_NPROC", "RLIMIT_FSIZE", "RLIMIT_CPU", "RLIMIT_CORE"]
print(*[resource.getrlimit(getattr(resource, n))[1] for n in names])
try:
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    print("raised")
except (ValueError, OSError):
    pass
""")
    assert result["status"] == "ok", result
    expected = [LIMITS.memory_bytes, LIMITS.processes, LIMITS.file_bytes, LIMITS.cpu_limit, 0]
    assert result["stdout"] == " ".join(map(str, expected)) + "\n"


def test_memory_bomb_raises_memory_error(kernel):
    result = kernel(f"x = bytearray({LIMITS.memory_bytes + 2**30})")
    assert result["ename"] == "MemoryError"
    result = kernel("chunks = []\nwhile True: chunks.append(bytearray(2**28))")
    assert result["ename"] == "MemoryError"
    kernel("del chunks")
    _alive(kernel)


def test_fork_bomb_hits_process_limit(kernel):
    # Bounded so that it cannot hurt the machine even without a limit: 300 children that sleep
    # briefly and exit; the parent reaps them all before the cell ends.
    result = kernel("""
import os, time
children, error = [], None
for _ in range(300):
    try:
        pid = os.fork()
    except OSError as e:
        error = type(e).__name__
        break
    if pid == 0:
        time.sleep(0.5)
        os._exit(0)
    children.append(pid)
for pid in children:
    os.waitpid(pid, 0)
print(error, len(children))
""")
    assert result["status"] == "ok", result
    error, count = result["stdout"].split()
    assert error == "BlockingIOError", result
    assert int(count) < LIMITS.processes
    _alive(kernel)


def test_large_files_fail(kernel):
    result = kernel(f"with open('big.bin', 'wb') as f: f.write(bytes({LIMITS.file_bytes + 1}))")
    assert result["ename"] == "OSError"  # EFBIG: Python ignores SIGXFSZ
    # /tmp is a tmpfs of tmp_bytes: several files under file_bytes still fill it.
    result = kernel(f"""
for i in range(4):
    with open(f"/tmp/fill{{i}}", "wb") as f:
        f.write(bytes({LIMITS.file_bytes - 1}))
""")
    assert result["ename"] == "OSError"
    kernel("import glob, os\nfor f in glob.glob('/tmp/fill*') + ['big.bin']: os.remove(f)")
    _alive(kernel)


def _iopub_until(client, msg_id: str, done, timeout: float = 60) -> None:
    """Read the kernel's broadcasts for one request until `done(message)` holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        message = client.get_iopub_msg(timeout=max(deadline - time.monotonic(), 0.1))
        if message["parent_header"].get("msg_id") == msg_id and done(message):
            return
    raise AssertionError(f"no such message from the kernel within {timeout} s")


def test_interrupt_reaches_the_kernel(kernel):
    client, manager = kernel.client, kernel.manager
    # Short sleeps, not one of 30 s: a SIGINT that lands after Python's last check for signals but
    # before the sleep's system call starts (the kernel descheduled in between, on a loaded machine)
    # does not cut that call short, and a single sleep would then run its whole length. A cell of
    # Python code, like a student's loop, stops at the next check.
    msg_id = client.execute("import time\nprint('sleeping', flush=True)\nfor _ in range(300):\n    time.sleep(0.1)")
    # Interrupt only once the cell is inside the loop: on a loaded machine a fixed wait can
    # land the signal while the kernel is still setting the cell up, which tests something else.
    _iopub_until(client, msg_id, lambda m: m["msg_type"] == "stream" and "sleeping" in m["content"]["text"])
    started = time.monotonic()
    manager.interrupt_kernel()
    reply = client.get_shell_msg(timeout=30)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = client.get_shell_msg(timeout=30)
    assert reply["content"]["ename"] == "KeyboardInterrupt"
    assert time.monotonic() - started < 25, "the cell ran on: the interrupt did not cut the sleep short"
    # The interrupted cell's last broadcasts (traceback, idle) come before the next cell's.
    _iopub_until(client, msg_id, lambda m: m["msg_type"] == "status" and m["content"]["execution_state"] == "idle")
    _alive(kernel)


def test_kernel_is_killed_after_notebook_seconds(tmp_path, monkeypatch):
    paths = _layout(tmp_path)
    manager, client = _start(paths, Limits(notebook_seconds=3), monkeypatch)
    try:
        deadline = time.monotonic() + 15
        while manager.is_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not manager.is_alive()
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def test_kernelspec_argv(tmp_path):
    name = install_kernelspec(tmp_path, limits=Limits(), hidden=[tmp_path / "repo"], name="k", hide_home=False)
    spec = json.loads((tmp_path / "k" / "kernel.json").read_text())
    assert name == "k"
    assert spec["argv"][-2:] == ["--", "{connection_file}"]
    assert spec["argv"][spec["argv"].index("--hide") + 1] == str((tmp_path / "repo").resolve())
    assert Limits.from_json(spec["argv"][spec["argv"].index("--limits") + 1]) == Limits()
    assert spec["interrupt_mode"] == "message"
    assert os.path.isabs(spec["argv"][0])
