"""A fork server ("zygote") for the Python processes the tests start.

Each `python -m big_vit_lite.X` the suite starts spends ~5-7 s of CPU importing
TensorFlow, jax, flax and this package before it does anything. A zygote is a
Python process that has made those imports (PRELOAD), initialised no backend
and run nothing; each command forks it, and the child becomes the command:
the caller's cwd, environment (os.environ replaced), stdin/stdout/stderr (the
caller's own fds, passed over a unix socket), sys.argv and sys.orig_argv, then
runpy runs the module (`-m`) or the file as `__main__`. The exit status
(SystemExit's code, an exception's traceback and 1, a signal) comes back to
the caller, which exits with it.

The client is this file run as `python -I -S tests/forkserver.py ARGS...` in
place of `python ARGS...` (`command(argv)`, and the `python`/`python3` shims of
`bin_dir()` for commands run by bash). It execs the real interpreter instead
where the zygote cannot stand in: `-c`, interpreter flags, no argument,
BVL_TEST_NO_FORKSERVER=1, no pytest run around it (BVL_TEST_BUILT_DIR unset), a
process of a multi-process job (JAX_COORDINATOR_ADDRESS set: alone with its
JAX_PROCESS_ID), a module or script folder that would shadow a preloaded module
with another file, or a zygote that failed to start.

What is read at import time, and so keys the zygote (one per distinct value,
started on first use by the client, reused, gone when the pytest run that made
BVL_TEST_BUILT_DIR ends or after IDLE_S unused): the environment variables
whose names start with IMPORT_TIME (jax reads its JAX_* options and TensorFlow
its TF_* ones at import, PYTHON* and LD_*, GLIBC_TUNABLES and the thread-pool
variables act at start-up), and whether the command is one of this package's
(`-m big_vit_lite.X`: the package's __init__ sets TensorFlow's log level for
those before TensorFlow loads). Except READ_AGAIN: TFDS_DATA_DIR, which tfds keeps
in a module constant at import (its only use of the variable), is read again in
the child as a fresh tfds would, so one zygote serves every data dir. The variables the imports set
(JAX_PLATFORMS=cpu, TF_CPP_MIN_LOG_LEVEL, ...) are set in the child too,
unless its environment has them, and what they printed (TensorFlow's start-up
lines) is printed again at the start of each child, where the caller sees it
(tests/test_console.py looks for such noise). Everything else is read later
and passes through: XLA_FLAGS is read when jax starts a backend, after the fork
(tests/test_forkserver.py checks that a forked child gets the devices it asks
for).

Signals: the client forwards SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 to the
child, and a child killed by a signal kills its client with the same one; a
client that dies (SIGKILL included) closes its socket, and the zygote kills the
child's process group. A child also dies with its zygote. The child is in a
process group of its own, so a test that signals its process's group reaches
only the client: tests of that keep real processes. A test that sends the
command's process a signal the client cannot forward (SIGKILL, SIGSTOP) sends
it to the child itself, whose pid the client writes to the file $PID_FILE
names: its client then dies of the same signal.

Fork safety: the zygote's imports leave two idle native threads (OpenBLAS's
worker, which re-forms after a fork, and one of TensorFlow's, waiting on a
futex); jax's and TensorFlow's runtimes start in the child, which runs the
demo's training (the `trained` run of tests/test_docs_commands.py) and the
kill/resume tests' reference runs, whose losses and params match a real
process's bit for bit (tests/test_grad_accum.py).

A command that re-executes the interpreter (hostmem.use_huge_pages: the same
command with GLIBC_TUNABLES set) is served by the zygote of its new
environment: the child turns into a client of that one.
"""

import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time

DISABLE = "BVL_TEST_NO_FORKSERVER"
# A comma-separated list of modules instead of PRELOAD (tests/test_forkserver.py: "jax").
PRELOAD_ENV = "BVL_TEST_FORKSERVER_PRELOAD"
HERE = os.path.abspath(__file__)
IMPORT_TIME = (
    "JAX_",
    "TF_",
    "TFDS_",
    "PYTHON",
    "LD_",
    "GLIBC_",
    "MALLOC_",
    "OMP_",
    "OPENBLAS_",
    "MKL_",
    "KERAS_",
    "LANG",
    "LC_",
)
# Variables read at import that the child reads again (become: _read_again): not keys.
READ_AGAIN = ("TFDS_DATA_DIR",)
PRELOAD = (
    "jax",
    # Before TensorFlow, as in the package's commands: TensorFlow's import then
    # skips its eager Keras (and scikit-learn) load, ~1.5 s of CPU a zygote.
    "big_vit_lite.data",
    "tensorflow",
    "tensorflow_datasets",
    "jax.numpy",
    "flax.linen",
    "optax",
    "orbax.checkpoint",
    "big_vit_lite.train",
    "big_vit_lite.evaluate",
    "big_vit_lite.plan",
    "big_vit_lite.bench",
    "big_vit_lite.predict",
    "big_vit_lite.export",
    "big_vit_lite.report",
    "big_vit_lite.data.prepare",
    # (evaluate imports each evaluator type's module when it reads the evals)
    "big_vit_lite.evaluators.classification",
    "big_vit_lite.evaluators.fewshot",
    "big_vit_lite.evaluators.linear_probe",
    "big_vit_lite.evaluators.multilabel",
)
FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
# A file where the client writes the pid of the process that runs the command (the zygote's
# child, or itself where it execs the interpreter): for a test that signals that process
# itself (SIGKILL or SIGSTOP, which the client cannot forward; tests/trainer_runs.py).
PID_FILE = "BVL_TEST_FORKSERVER_PID_FILE"
IDLE_S = 600
START_TIMEOUT_S = 180


def enabled():
  return os.environ.get(DISABLE) != "1" and "BVL_TEST_BUILT_DIR" in os.environ


def command(argv):
  """`argv` (a subprocess's) with `sys.executable ARGS` run through the zygote."""
  if not enabled() or not argv or argv[0] != sys.executable:
    return list(argv)
  return [sys.executable, "-I", "-S", HERE, *argv[1:]]


def bin_dir():
  """A folder whose `python` and `python3` run through the zygote: first on a bash command's PATH."""
  folder = os.path.join(os.environ["BVL_TEST_BUILT_DIR"], "forkserver_bin")
  os.makedirs(folder, exist_ok=True)
  for name in ("python", "python3"):
    path = os.path.join(folder, name)
    if not os.path.exists(path):
      tmp = f"{path}.{os.getpid()}"
      with open(tmp, "w") as f:
        f.write(f'#!/bin/sh\nexec {sys.executable} -I -S {HERE} "$@"\n')
      os.chmod(tmp, 0o755)
      os.replace(tmp, path)
  return folder


# -- The client.


def _target(args):
  """('module' | 'path', name) of `python ARGS`, or None where the zygote cannot run it."""
  if len(args) >= 2 and args[0] == "-m":
    return "module", args[1]
  if args and not args[0].startswith("-") and args[0].endswith(".py"):
    return "path", args[0]
  return None


def _key_env(env, ours):
  key = {
      k: v
      for k, v in env.items()
      if k.startswith((*IMPORT_TIME, PRELOAD_ENV)) and k not in READ_AGAIN
  }
  key["<big_vit_lite command>"] = str(ours)
  key["<python>"] = sys.executable
  return key


def socket_path(env, ours):
  """Where the zygote for `env` listens (`ours`: for a `-m big_vit_lite.X`)."""
  import hashlib  # pylint: disable=import-outside-toplevel

  key = json.dumps(_key_env(env, ours), sort_keys=True)
  digest = hashlib.sha1(key.encode()).hexdigest()
  folder = os.path.join(os.environ["BVL_TEST_BUILT_DIR"], "forkserver")
  os.makedirs(folder, exist_ok=True)
  return os.path.join(folder, digest[:16] + ".sock")


def _connect(path):
  sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  try:
    sock.connect(path)
  except OSError:
    sock.close()
    return None
  return sock


def _zygote(env, ours):
  """A socket connected to the zygote of `env`, started first if none is; None if it cannot start."""
  import fcntl  # pylint: disable=import-outside-toplevel

  path = socket_path(env, ours)
  sock = _connect(path)
  if sock:
    return sock
  with open(path + ".lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    sock = _connect(path)
    if sock:
      return sock
    if os.path.exists(path):
      os.unlink(path)
    # What keyed it, for a reader counting the zygotes of a run.
    with open(path + ".key", "w") as f:
      json.dump(_key_env(env, ours), f, sort_keys=True, indent=1)
    with open(path + ".log", "ab") as log:
      server = subprocess.Popen(
          [sys.executable, HERE, "--serve", path, str(ours)],
          env=env,
          stdin=subprocess.DEVNULL,
          stdout=log,
          stderr=log,
          start_new_session=True,
      )
    t0 = time.monotonic()
    while server.poll() is None and time.monotonic() - t0 < START_TIMEOUT_S:
      sock = _connect(path)
      if sock:
        return sock
      time.sleep(0.05)
  return None


def _read_line(sock):
  line = b""
  while not line.endswith(b"\n"):
    chunk = sock.recv(1)
    if not chunk:
      return None
    line += chunk
  return line.decode().split()


def _exec_real(args):
  sys.stdout.flush()
  sys.stderr.flush()
  os.execv(sys.executable, [sys.executable, *args])


def _tell_pid(env, pid):
  """Writes `pid` to the file PID_FILE names, if the command's environment names one."""
  path = env.get(PID_FILE)
  if path:
    with open(path + ".tmp", "w") as f:
      f.write(str(pid))
    os.replace(path + ".tmp", path)


def _die_like(status):
  """Exits as the child did: its exit code, or killed by its signal."""
  if os.WIFSIGNALED(status):
    sig = os.WTERMSIG(status)
    if sig != signal.SIGKILL:  # (whose action cannot be set: it is the default)
      signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(os.waitstatus_to_exitcode(status))


def run_client(args, env):
  """Runs `python ARGS` in a child of the zygote for `env` and exits with its status (or execs)."""
  target = _target(args)
  # A process of a multi-process job (launch/local.sh) is alone with its
  # JAX_PROCESS_ID, and its launcher stops it by process group.
  if target is None or not enabled() or "JAX_COORDINATOR_ADDRESS" in env:
    _tell_pid(env, os.getpid())
    _exec_real(args)
  kind, name = target
  ours = kind == "module" and name.startswith("big_vit_lite.")
  sock = _zygote(env, ours)
  if sock is None:
    _tell_pid(env, os.getpid())
    _exec_real(args)
  request = json.dumps(dict(args=args, cwd=os.getcwd(), env=env)).encode()
  try:
    socket.send_fds(sock, [struct.pack("!Q", len(request))], [0, 1, 2])
    sock.sendall(request)
    reply = _read_line(sock)
  except OSError:  # e.g. a closed stdin
    reply = None
  if not reply or reply[0] == "exec":
    sock.close()
    _tell_pid(env, os.getpid())
    _exec_real(args)
  child = int(reply[1])
  _tell_pid(env, child)

  def forward(sig, _):
    try:
      os.kill(child, sig)
    except ProcessLookupError:
      pass

  for sig in FORWARDED:
    signal.signal(sig, forward)
  reply = _read_line(sock)
  if not reply:
    print(
        "forkserver: the zygote ended before its child; rerun with"
        f" {DISABLE}=1",
        file=sys.stderr,
    )
    sys.exit(1)
  _die_like(int(reply[1]))


# -- The zygote.


def _shadowed(first):
  """Whether sys.path[0] = `first` holds another copy of a module the zygote has loaded."""
  try:
    names = os.listdir(first)
  except OSError:
    return False
  for name in names:
    if name.endswith(".py"):
      here = os.path.join(first, name)
    elif os.path.exists(os.path.join(first, name, "__init__.py")):
      here = os.path.join(first, name, "__init__.py")
    else:
      continue
    module = sys.modules.get(name.removesuffix(".py"))
    if module is None:
      continue
    loaded = getattr(module, "__file__", None) or ""
    if os.path.realpath(loaded) != os.path.realpath(here):
      return True
  return False


def _first_path(request):
  """sys.path[0] of the real `python ARGS`: the cwd for -m, the script's folder for a file."""
  kind, name = _target(request["args"])
  if kind == "module":
    return request["cwd"]
  return os.path.dirname(os.path.realpath(os.path.join(request["cwd"], name)))


def _die_with_parent():
  import ctypes  # pylint: disable=import-outside-toplevel

  pr_set_pdeathsig = 1
  ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGKILL)


def serve(path, ours):
  """Preloads, listens on `path` and forks a child per request; returns the request in the child."""
  if ours:
    # What `python -m big_vit_lite.X` has when the package's __init__ runs.
    sys.orig_argv = [sys.executable, "-m", "big_vit_lite.train"]
  before = dict(os.environ)
  preload = PRELOAD
  if PRELOAD_ENV in os.environ:
    preload = [m for m in os.environ[PRELOAD_ENV].split(",") if m]
  if ours:
    # The package's __init__ first, as in `python -m big_vit_lite.X`: it sets
    # TensorFlow's start-up settings (TF_ENABLE_ONEDNN_OPTS=0: no oneDNN, and no
    # banner) before anything imports TensorFlow.
    preload = ["big_vit_lite", *preload]
  printed = _printed_by(lambda: [__import__(name) for name in preload])
  set_by_imports = {k: v for k, v in os.environ.items() if before.get(k) != v}
  wake_r, wake_w = os.pipe()
  os.set_blocking(wake_w, False)
  signal.set_wakeup_fd(wake_w)
  signal.signal(signal.SIGCHLD, lambda *_: None)
  listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  listener.bind(path)
  listener.listen(64)
  owner_dir = os.environ["BVL_TEST_BUILT_DIR"]
  children = {}  # conn -> the child's pid
  orphans = set()  # the children whose client went away, killed
  last_used = time.monotonic()
  while True:
    ready, _, _ = select.select([listener, wake_r, *children], [], [], 2.0)
    if children or orphans:
      last_used = time.monotonic()
    if not os.path.exists(owner_dir) or (time.monotonic() - last_used > IDLE_S):
      for pid in (*children.values(), *orphans):
        _kill_group(pid)
      return None
    for r in ready:
      if r is wake_r:
        os.read(wake_r, 512)
        _reap(children, orphans)
      elif r is listener:
        conn, _ = listener.accept()
        request = _receive(conn)
        if request is None:  # a client that died before its request
          conn.close()
          continue
        if _shadowed(_first_path(request)):
          for fd in request["fds"]:
            os.close(fd)
          conn.sendall(b"exec\n")
          conn.close()
          continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
          signal.set_wakeup_fd(-1)
          signal.signal(signal.SIGCHLD, signal.SIG_DFL)
          for fd in (wake_r, wake_w):
            os.close(fd)
          for c in (listener, conn, *children):
            c.close()
          os.setpgid(0, 0)
          _die_with_parent()
          for i, fd in enumerate(request.pop("fds")):
            os.dup2(fd, i)
            os.close(fd)
          for fd, text in enumerate(printed, start=1):
            os.write(fd, text)  # what the imports printed, as they would have
          request["set_by_imports"] = set_by_imports
          return request
        for fd in request["fds"]:
          os.close(fd)
        conn.sendall(f"pid {pid}\n".encode())
        children[conn] = pid
      else:
        # The client went away (it sends nothing after its request): its child
        # goes too.
        pid = children.pop(r)
        r.close()
        _kill_group(pid)
        orphans.add(pid)


def _printed_by(run):
  """(stdout, stderr) bytes that `run()` printed, Python's and C++'s (TensorFlow's start-up lines)."""
  import tempfile  # pylint: disable=import-outside-toplevel

  printed = []
  saved = [os.dup(1), os.dup(2)]
  files = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
  try:
    for fd, f in enumerate(files, start=1):
      os.dup2(f.fileno(), fd)
    run()
  finally:
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, f in enumerate(files, start=1):
      os.dup2(saved[fd - 1], fd)
      os.close(saved[fd - 1])
      f.seek(0)
      printed.append(f.read())
      f.close()
  return printed


def _kill_group(pid):
  try:
    os.killpg(pid, signal.SIGKILL)
  except ProcessLookupError:
    pass


def _reap(children, orphans):
  while True:
    try:
      pid, status = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
      return
    if pid == 0:
      return
    orphans.discard(pid)
    for conn, child in list(children.items()):
      if child == pid:
        try:
          conn.sendall(f"exit {status}\n".encode())
        except OSError:
          pass
        conn.close()
        del children[conn]


def _receive(conn):
  """The client's request (args, cwd, env) with its fds, or None if it sent none whole."""
  header, fds, _, _ = socket.recv_fds(conn, 8, 3)
  data = b""
  if len(header) == 8:
    (size,) = struct.unpack("!Q", header)
    while len(data) < size:
      chunk = conn.recv(size - len(data))
      if not chunk:
        break
      data += chunk
  if len(fds) != 3 or not data or len(data) != size:
    for fd in fds:
      os.close(fd)
    return None
  request = json.loads(data)
  request["fds"] = fds
  return request


def become(request):
  """In the forked child: turns this process into `python ARGS` and runs it."""
  import runpy  # pylint: disable=import-outside-toplevel
  import tempfile  # pylint: disable=import-outside-toplevel

  args = request["args"]
  os.chdir(request["cwd"])
  env = dict(request["env"])
  for k, v in request["set_by_imports"].items():
    env.setdefault(k, v)
  os.environ.clear()
  os.environ.update(env)
  tempfile.tempdir = None  # TMPDIR is read again
  _read_again()
  # (a pipe or file as the zygote's were; a terminal is line-buffered)
  sys.stdout.reconfigure(line_buffering=sys.stdout.isatty())
  sys.orig_argv = [sys.executable, *args]
  sys.path.insert(0, _first_path(request))
  os.execve = _execve_via_zygote
  kind, name = _target(args)
  sys.argv = [name, *args[2 if kind == "module" else 1 :]]
  if kind == "module":
    # Run afresh as __main__, as `python -m` does (its absl flags defined again).
    sys.modules.pop(name, None)
    _forget_flags_of(name)
    runpy.run_module(name, run_name="__main__", alter_sys=True)
  else:
    runpy.run_path(name, run_name="__main__")


def _read_again():
  """READ_AGAIN's variables, from the child's environment, where the zygote's imports kept them."""
  constants = sys.modules.get("tensorflow_datasets.core.constants")
  if constants is not None:
    # tfds' default data dir, as its import computes it.
    constants.DATA_DIR = constants.get_default_data_dir()


def _forget_flags_of(module_name):
  """Drops the absl flags that the preloaded `module_name` defined at import."""
  flags = sys.modules.get("absl.flags")
  if flags is None:
    return
  for flag in list(flags.FLAGS.flags_by_module_dict().get(module_name, [])):
    delattr(flags.FLAGS, flag.name)


def _end_without_teardown(run):
  """Runs the child's program, then ends it as Python ends a program, less the teardown.

  After a program's last line (or its SystemExit) Python waits for its non-daemon
  threads, runs the atexit functions and flushes stdout and stderr; then it tears the
  interpreter down, freeing every module: ~1.8 s of CPU in a process that imported
  TensorFlow and jax (0.04 s with os._exit), paid by every child the suite forks.
  The child does the first three as Python does and skips the teardown. Any other
  exception leaves as it would from a real interpreter (its traceback, status 1,
  the teardown included). The real processes of the suite (the SIGTERM and Ctrl-C tests,
  the multi-process launches, the docs row run with BVL_TEST_NO_FORKSERVER=1) keep
  Python's own ending, exit-time hangs and noise included.
  """
  import atexit  # pylint: disable=import-outside-toplevel
  import threading  # pylint: disable=import-outside-toplevel

  try:
    run()
    code = 0
  except SystemExit as e:
    code = e.code
  if code is None:
    code = 0
  elif not isinstance(code, int):
    print(code, file=sys.stderr)  # sys.exit("message"): printed, status 1
    code = 1
  for thread in threading.enumerate():
    if thread is not threading.main_thread() and not thread.daemon:
      thread.join()
  atexit._run_exitfuncs()  # pylint: disable=protected-access
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code & 0xFF)


_real_execve = os.execve


def _execve_via_zygote(path, argv, env):
  """os.execve in a child: the same interpreter again runs in the zygote of `env` instead."""
  if os.path.realpath(path) != os.path.realpath(sys.executable):
    _real_execve(path, argv, env)
  sys.stdout.flush()
  sys.stderr.flush()
  run_client(list(argv[1:]), dict(env))


def main():
  if sys.argv[1:2] == ["--serve"]:
    sys.path.pop(0)  # tests/: the child's sys.path[0] is set by become()
    request = serve(sys.argv[2], sys.argv[3] == "True")
    if request is None:
      return
    _end_without_teardown(lambda: become(request))
  else:
    run_client(sys.argv[1:], dict(os.environ))


if __name__ == "__main__":
  main()
