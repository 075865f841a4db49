"""Run model-written Python in a separate, limited process: :func:`run_python`.

A policy early in RL writes anything, and a policy late in RL optimizes against whatever checks its
code, so the code it writes is treated as hostile. Each run gets a fresh interpreter and a fresh scratch
directory, and the layers below hold independently (each is attacked by a test in
``tests/test_sandbox.py``; the list with its limits is in docs/guarantees.md):

Operating-system layer (holds whatever the code does inside the interpreter):

* a separate process, ``python -I -S -B``: no site-packages, no user site, no ``PYTHON*`` variables, no
  current directory on the path; the standard library only unless :attr:`SandboxLimits.python_paths`
  names more;
* an empty environment: none of the trainer's variables (tokens, keys, paths) reach the child;
* a fresh scratch directory as the working directory, deleted after the run whatever happened in it;
* ``resource`` limits set in the child before ``exec`` (``preexec_fn``): CPU seconds, address space,
  size of any file written (stdout and stderr included), open files, no core dumps; the number of
  processes (``RLIMIT_NPROC``) is lowered by the child itself once started, since at ``exec`` it counts
  every process of the user, other sandboxes' included;
* a new session: on the wall-clock timeout the whole process group is killed with SIGKILL;
* when the trainer is root, the child drops to ``nobody`` (65534) before ``exec``, so file permissions
  apply to it and ``RLIMIT_NPROC`` binds (root is exempt from it), where ``nobody`` can reach the
  interpreter (:func:`drops_to_nobody`; not under a private home such as pyenv's ``/root``);
* a network namespace of its own where the kernel allows one (``unshare(CLONE_NEWNET)``, or with a user
  namespace when not root): no interface but a down loopback. :func:`network_isolation` says which.

Interpreter layer (an audit hook, ``sys.addaudithook``, installed before the model's code runs and
impossible to remove from Python): sockets, processes (fork, exec, spawn, ``os.system``, subprocess),
signals to other processes, ``ctypes`` and the modules that bypass audit events are refused; files may be
written only inside the scratch directory and read only there, in the standard library and the configured
import paths (``/proc``, the repository, the run directory, ``/etc`` are refused); links out of the scratch
directory are resolved before the check, hard links refused. Audit hooks are not a security boundary
against code that corrupts the interpreter's memory, which is why the OS layer stands on its own.

Output is written to files the parent opened (bounded by the file-size limit) and only the first
:attr:`SandboxLimits.output_chars` characters are read back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field

__all__ = ["SandboxLimits", "SandboxResult", "run_python", "network_isolation", "drops_to_nobody", "isolation",
           "NOBODY"]

NOBODY = 65534
"""The uid/gid a root trainer's sandbox runs as."""

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use. The defaults fit small functions with unit tests."""

    timeout_s: float = 5.0
    """Wall-clock seconds before the process group is killed (sleeping counts; CPU time is ``cpu_s``)."""
    cpu_s: int = 5
    """CPU seconds (RLIMIT_CPU): the kernel ends the process past it."""
    memory_mb: int = 512
    """Address space (RLIMIT_AS), in MiB; an allocation past it is a ``MemoryError``."""
    file_mb: int = 4
    """Largest file the child may write (RLIMIT_FSIZE), stdout and stderr included, in MiB."""
    open_files: int = 32
    """Open file descriptors (RLIMIT_NOFILE)."""
    processes: int = 1
    """RLIMIT_NPROC once started: 1 allows no new process or thread."""
    output_chars: int = 4000
    """Characters of stdout (and of stderr) read back."""
    python_paths: tuple[str, ...] = ()
    """Directories added to the child's import path (and readable); empty: the standard library only."""


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    returncode: int | None
    """None when killed on the wall-clock timeout."""
    timed_out: bool
    seconds: float
    error: str = ""
    """The error's last line (``ZeroDivisionError: division by zero``), empty on success."""
    cut: bool = False
    """stdout was longer than ``output_chars`` and was cut."""

    @property
    def ok(self) -> bool:
        return not self.timed_out and self.returncode == 0

    def for_model(self) -> str:
        """What the model reads: its stdout, then ``error: ...`` (or ``error: timed out``) on failure."""
        out = self.stdout + (" ...(output cut)" if self.cut else "")
        if self.timed_out:
            return (out + "\n" if out else "") + f"error: timed out after {self.seconds:.1f}s (killed)"
        if self.returncode != 0:
            return (out + "\n" if out else "") + f"error: {self.error or f'exit status {self.returncode}'}"
        return out if out else "(no output)"


# The child's first code: limits it sets itself, the audit hook, then the model's code from main.py.
_BOOTSTRAP = r'''
import sys, os, resource
_nproc, _reads, _paths = int(sys.argv[1]), tuple(sys.argv[2].split("\x1f")) if sys.argv[2] else (), sys.argv[3]
resource.setrlimit(resource.RLIMIT_NPROC, (_nproc, _nproc))
_scratch = os.path.realpath(os.getcwd())
sys.path[:0] = [p for p in _paths.split("\x1f") if p]
with open("main.py", encoding="utf-8") as _f:
    _source = _f.read()
_real, _join, _isabs, _getcwd, _str, _bytes, _fsdecode = (os.path.realpath, os.path.join, os.path.isabs,
                                                         os.getcwd, str, bytes, os.fsdecode)
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_BLOCKED_IMPORTS = frozenset({"ctypes", "_ctypes", "_posixsubprocess", "_socket", "socket", "ssl", "_ssl",
                              "_multiprocessing", "mmap", "_xxsubinterpreters", "_testcapi", "_testinternalcapi"})
_BLOCKED_EVENTS = frozenset({
    "socket.__new__", "socket.bind", "socket.connect", "socket.getaddrinfo", "socket.gethostbyname",
    "socket.gethostbyaddr", "socket.sendto", "os.system", "os.fork", "os.forkpty", "os.exec", "os.spawn",
    "os.posix_spawn", "subprocess.Popen", "os.kill", "os.killpg", "pty.spawn", "ctypes.dlopen",
    "ctypes.dlsym", "ctypes.cdata", "sys.addaudithook", "os.link", "os.putenv", "os.unsetenv",
    "os.setuid", "os.setgid", "os.chroot", "os.chown", "fcntl.ioctl", "sys.remote_exec",
    "signal.pthread_kill", "os.startfile", "webbrowser.open", "urllib.Request", "ftplib.connect",
    "http.client.connect", "smtplib.connect", "imaplib.open", "poplib.connect", "telnetlib.Telnet.open",
    "_thread.start_new_thread",
})
_PATH_WRITE_EVENTS = {"os.remove": 1, "os.rmdir": 1, "os.mkdir": 1, "os.rename": 2, "os.replace": 2,
                      "os.truncate": 1, "os.chmod": 1, "os.utime": 1, "os.symlink": (1,), "os.chdir": 1,
                      "shutil.rmtree": 1, "os.chflags": 1, "os.mkfifo": 1, "os.mknod": 1, "os.setxattr": 1,
                      "os.removexattr": 1}
_PATH_READ_EVENTS = ("os.listdir", "os.scandir", "glob.glob", "os.listxattr", "os.getxattr")


def _resolve(path):
    if isinstance(path, int):
        return None
    if isinstance(path, _bytes):
        path = _fsdecode(path)
    if not isinstance(path, _str):
        path = _str(path)
    return _real(path if _isabs(path) else _join(_getcwd(), path))


def _under(path, roots):
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _refuse(what):
    raise PermissionError(f"sandbox: {what} is not allowed")


def _hook(event, args):
    if event == "import":
        name = args[0] or ""
        if name in _BLOCKED_IMPORTS or name.split(".")[0] in _BLOCKED_IMPORTS:
            _refuse(f"import {name}")
        return
    if event in _BLOCKED_EVENTS:
        _refuse(event)
    if event == "open":
        path, mode, flags = args
        where = _resolve(path)
        if where is None:
            return
        writes = (mode is not None and any(c in mode for c in "wax+")) or (mode is None and flags & _WRITE_FLAGS)
        if mode is None and not _under(where, (_scratch, "/dev/null", "/dev/urandom", "/dev/zero")):
            # os.open outside the scratch directory: a directory fd there would let dir_fd= paths escape
            # the check above, which resolves them against the working directory
            _refuse(f"os.open of {where}")
        if writes and not _under(where, (_scratch,)):
            _refuse(f"writing {where}")
        if not writes and not _under(where, (_scratch,) + _reads):
            _refuse(f"reading {where}")
        return
    if event in _PATH_READ_EVENTS:
        where = _resolve(args[0] if args[0] is not None else ".")
        if where is not None and not _under(where, (_scratch,) + _reads):
            _refuse(f"listing {where}")
        return
    which = _PATH_WRITE_EVENTS.get(event)
    if which is not None:
        idx = which if isinstance(which, tuple) else range(which)
        for i in idx:
            where = _resolve(args[i])
            if where is not None and not _under(where, (_scratch,)):
                _refuse(f"{event} on {where}")


sys.addaudithook(_hook)
del _f
try:
    sys.stdin.close()
except Exception:
    pass
_code = compile(_source, "solution.py", "exec")
del _source
exec(_code, {"__name__": "__main__", "__builtins__": __builtins__})
'''


_NO_AUDIT_BOOTSTRAP = (
    "import resource, sys\nn = int(sys.argv[1])\nresource.setrlimit(resource.RLIMIT_NPROC, (n, n))\n"
    "exec(compile(open('main.py').read(), 'solution.py', 'exec'), {'__name__': '__main__'})")
"""The OS layer alone (``run_python(..., _audit=False)``, for tests): the process limit, then the code."""


def _stdlib_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib")}
    dirs.add(os.path.realpath(os.path.join(sys.base_prefix, "lib", f"python{sys.version_info.major}."
                                           f"{sys.version_info.minor}")))
    return tuple(sorted(d for d in dirs if os.path.isdir(d)))


@functools.lru_cache(maxsize=None)
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:
        return None


def _unshare_net(libc: ctypes.CDLL | None, root: bool) -> bool:
    """Give the calling process a network namespace of its own (in the child, before exec)."""
    if libc is None:
        return False
    flags = _CLONE_NEWNET if root else (_CLONE_NEWUSER | _CLONE_NEWNET)
    return libc.unshare(flags) == 0


@functools.lru_cache(maxsize=None)
def network_isolation() -> str:
    """``"namespace"`` where the child gets a network namespace of its own, else ``"audit hook only"``
    (sockets are then refused inside the interpreter alone). Probed once per process."""
    libc, root = _libc(), os.geteuid() == 0

    def probe() -> None:
        if not _unshare_net(libc, root):
            os._exit(3)

    try:
        rc = subprocess.run([sys.executable, "-I", "-S", "-c", "pass"], preexec_fn=probe, env={},
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            timeout=30).returncode
    except (OSError, subprocess.SubprocessError):
        return "audit hook only"
    return "namespace" if rc == 0 else "audit hook only"


@functools.lru_cache(maxsize=None)
def drops_to_nobody() -> bool:
    """Whether the child runs as ``nobody``: only a root trainer can switch, and only where ``nobody`` can
    reach the interpreter (not under a 0700 home, e.g. pyenv in /root). Otherwise it runs as the trainer's
    user and the audit hook alone keeps it from the trainer's files. Probed once per process."""
    if os.geteuid() != 0:
        return False

    def probe() -> None:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)

    try:
        return subprocess.run([os.path.realpath(sys.executable), "-I", "-S", "-c", "pass"], preexec_fn=probe,
                              env={}, cwd="/", stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def isolation() -> dict[str, str]:
    """Which OS-level measures apply on this machine (docs/environments.md reports them)."""
    return {"network": network_isolation(),
            "user": "nobody" if drops_to_nobody() else ("root (nobody cannot reach the interpreter)"
                                                        if os.geteuid() == 0 else "the trainer's")}


def _preexec(limits: SandboxLimits, net_ns: bool, libc: ctypes.CDLL | None, root: bool, drop: bool) -> None:
    """In the child between fork and exec: namespaces, limits, then the user (setuid last: it needs root)."""
    if net_ns and not _unshare_net(libc, root):
        os._exit(126)
    mem = limits.memory_mb * 1024 * 1024
    fsize = limits.file_mb * 1024 * 1024
    for what, value in ((resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1)), (resource.RLIMIT_AS, (mem, mem)),
                        (resource.RLIMIT_FSIZE, (fsize, fsize)), (resource.RLIMIT_CORE, (0, 0)),
                        (resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))):
        resource.setrlimit(what, value)
    if drop:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)


def _read(path: str, limit: int) -> tuple[str, bool]:
    with open(path, "rb") as f:
        data = f.read(limit * 4 + 4)
    text = data.decode("utf-8", errors="replace")
    return (text[:limit], True) if len(text) > limit else (text, False)


def _last_line(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), *, files: dict[str, str] | None = None,
               _audit: bool = True) -> SandboxResult:
    """Run ``code`` in a fresh sandboxed interpreter (module docstring) and return what it printed.

    ``files`` are written into the scratch directory first (e.g. test data). ``_audit=False`` leaves the
    interpreter layer out; only tests use it, to show the OS layer holds alone."""
    root = os.geteuid() == 0
    drop = drops_to_nobody()
    net_ns = network_isolation() == "namespace"
    libc = _libc()
    scratch = tempfile.mkdtemp(prefix="lmforge-sandbox-")
    private = tempfile.mkdtemp(prefix="lmforge-sandbox-out-")  # 0700, the trainer's: the child gets fds only
    start = time.perf_counter()
    try:
        with open(os.path.join(scratch, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        for name, text in (files or {}).items():
            if os.path.basename(name) != name or name in ("main.py", ""):
                raise ValueError(f"sandbox file name {name!r}: a plain file name other than main.py")
            with open(os.path.join(scratch, name), "w", encoding="utf-8") as f:
                f.write(text)
        if drop:
            for dirpath, _, names in os.walk(scratch):
                os.chown(dirpath, NOBODY, NOBODY)
                for n in names:
                    os.chown(os.path.join(dirpath, n), NOBODY, NOBODY)
        reads = _stdlib_dirs() + tuple(os.path.realpath(p) for p in limits.python_paths) + (
            "/dev/null", "/dev/urandom", "/dev/zero")
        paths = "\x1f".join(os.path.realpath(p) for p in limits.python_paths)
        argv = [os.path.realpath(sys.executable), "-I", "-S", "-B", "-c"]  # the base interpreter: a venv may be private
        if _audit:  # the reads and paths lists travel in argv, joined by U+001F (argv cannot hold NUL)
            argv += [_BOOTSTRAP, str(limits.processes), "\x1f".join(reads), paths]
        else:
            argv += [_NO_AUDIT_BOOTSTRAP, str(limits.processes)]
        out_path, err_path = os.path.join(private, "stdout"), os.path.join(private, "stderr")
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                argv, cwd=scratch, env={},
                stdin=subprocess.DEVNULL, stdout=out, stderr=err, close_fds=True, start_new_session=True,
                preexec_fn=lambda: _preexec(limits, net_ns, libc, root, drop))
            timed_out = False
            try:
                proc.wait(timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                try:  # the whole group: anything it started goes with it, timed out or not
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
        seconds = time.perf_counter() - start
        stdout, cut = _read(out_path, limits.output_chars)
        stderr, _ = _read(err_path, limits.output_chars)
        rc = None if timed_out else proc.returncode
        error = ""
        if not timed_out and rc != 0:
            error = _last_line(stderr)
            if rc is not None and rc < 0:
                sig = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
                hint = {"SIGXCPU": "CPU time limit", "SIGKILL": "killed", "SIGXFSZ": "file size limit",
                        "SIGSEGV": "segmentation fault"}.get(sig, "")
                error = f"killed by {sig}" + (f" ({hint})" if hint else "")
        return SandboxResult(stdout.rstrip("\n"), stderr, rc, timed_out, seconds, error, cut)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(private, ignore_errors=True)
