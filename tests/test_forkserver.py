"""tests/forkserver.py: a command run through the zygote does what the real interpreter does.

The oracle is the real interpreter: each command also runs as a plain `python ARGS`
(BVL_TEST_NO_FORKSERVER=1). The zygote here preloads only jax (cheap); the suite's zygotes
preload forkserver.PRELOAD.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

import forkserver

pytestmark = pytest.mark.skipif(
    not forkserver.enabled(), reason=f"{forkserver.DISABLE}=1"
)


def _env(**extra):
  return dict(
      os.environ,
      JAX_PLATFORMS="cpu",
      **{forkserver.PRELOAD_ENV: "jax"},
      **extra,
  )


def _script(tmp_path, name, body):
  path = tmp_path / name
  path.write_text(textwrap.dedent(body))
  return str(path)


def _run(args, *, real=False, **kwargs):
  env = kwargs.pop("env", _env())
  if real:
    env = dict(env, **{forkserver.DISABLE: "1"})
  return subprocess.run(
      forkserver.command([sys.executable, *args]),
      env=env,
      capture_output=True,
      text=True,
      timeout=120,
      **kwargs,
  )


REPORT = """
    import json, os, sys
    preloaded = "jax" in sys.modules
    line = sys.stdin.readline()
    print("to stderr", file=sys.stderr)
    print(json.dumps(dict(
        argv=sys.argv, cwd=os.getcwd(), path0=sys.path[0], name=__name__,
        env=os.environ.get("ASKED"),
        stdin=line, preloaded=preloaded)))
    sys.exit(3)
"""


def test_the_child_becomes_the_command(tmp_path):
  """Guards: a child that keeps the zygote's cwd, environment, argv, sys.path[0] or stdio,
  or loses the exit code."""
  script = _script(tmp_path, "report.py", REPORT)
  (tmp_path / "cwd").mkdir()
  runs = {}
  for real in (False, True):
    p = _run(
        [script, "a b", "--x=1"],
        real=real,
        cwd=tmp_path / "cwd",
        env=_env(ASKED="yes"),
        input="from stdin\n",
    )
    assert p.returncode == 3, p.stderr
    assert p.stderr.strip().splitlines()[-1] == "to stderr", p.stderr
    runs[real] = json.loads(p.stdout)
  assert runs[False].pop("preloaded") and not runs[True].pop("preloaded")
  assert runs[False] == runs[True]
  assert runs[True]["argv"] == [script, "a b", "--x=1"]
  assert runs[True]["env"] == "yes"
  # The same zygote, whose first child had ASKED: the environment is replaced.
  p = _run([script], cwd=tmp_path, input="\n")
  assert json.loads(p.stdout)["env"] is None


def test_a_module_runs_as_main_with_the_cwd_first(tmp_path):
  """Guards: `-m` run without __main__ or without the cwd on sys.path (python -m's)."""
  (tmp_path / "mymod.py").write_text(textwrap.dedent(REPORT))
  runs = [
      _run(["-m", "mymod", "z"], real=real, cwd=tmp_path, input="x\n")
      for real in (False, True)
  ]
  assert [p.returncode for p in runs] == [3, 3], runs[0].stderr
  ours, real = (json.loads(p.stdout) for p in runs)
  assert ours.pop("preloaded") and not real.pop("preloaded")
  assert ours == real and real["name"] == "__main__"


def test_exceptions_and_signals_end_the_caller_alike(tmp_path):
  """Guards: an uncaught exception or a death by signal reported as another exit status."""
  raises = _script(tmp_path, "raises.py", "raise ValueError('boom')\n")
  killed = _script(
      tmp_path,
      "killed.py",
      "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n",
  )
  for real in (False, True):
    p = _run([raises], real=real)
    assert p.returncode == 1 and "ValueError: boom" in p.stderr, p.stderr
    assert _run([killed], real=real).returncode == -signal.SIGTERM


ENDS = """
    import atexit, sys, threading, time
    done = sys.argv[1]

    def late():
      time.sleep(0.3)
      with open(done, "a") as f:
        f.write("thread joined;")

    threading.Thread(target=late).start()
    atexit.register(lambda: print("atexit ran", file=sys.stderr))
    sys.stdout.write("no newline, still buffered")
    if sys.argv[2] == "message":
      sys.exit("a message")
    if sys.argv[2] == "code":
      sys.exit(260)
"""


def test_a_child_ends_as_python_ends_a_program(tmp_path):
  """Guards the child's end without the interpreter's teardown (forkserver's
  _end_without_teardown): a non-daemon thread not waited for, atexit functions not
  run, a buffered stdout lost, or SystemExit's code (None, an int past 255, a
  message: printed, status 1) turned into another status; against the real
  interpreter's end of the same program.
  """
  script = _script(tmp_path, "ends.py", ENDS)
  for how in ("falls off the end", "message", "code"):
    results = []
    for real in (False, True):
      done = tmp_path / f"{how}-{real}.txt"
      p = _run([script, str(done), how], real=real)
      results.append((p.returncode, p.stdout, p.stderr, done.read_text()))
    assert results[0] == results[1], how
    assert results[0][1] == "no newline, still buffered"
    assert "atexit ran" in results[0][2]
    assert results[0][3] == "thread joined;"


def _wait_for(predicate, what, timeout=30):
  t0 = time.monotonic()
  while not predicate():
    assert time.monotonic() - t0 < timeout, what
    time.sleep(0.02)


def test_sigterm_reaches_the_child_and_sigkill_ends_it(tmp_path):
  """Guards: a client that does not forward SIGTERM, and a child left running (on its
  workdir) after its client was SIGKILLed."""
  script = _script(
      tmp_path,
      "waits.py",
      """
      import os, signal, sys, time
      signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
      open(sys.argv[1] + ".tmp", "w").write(str(os.getpid()))
      os.rename(sys.argv[1] + ".tmp", sys.argv[1])
      time.sleep(60)
      """,
  )
  pid_file = tmp_path / "pid"
  for how in ("terminate", "kill"):
    proc = subprocess.Popen(
        forkserver.command([sys.executable, script, str(pid_file)]),
        env=_env(),
    )
    _wait_for(pid_file.exists, "the child did not start")
    child = int(pid_file.read_text())
    pid_file.unlink()
    assert child != proc.pid  # it is the zygote's child
    getattr(proc, how)()
    returncode = proc.wait(timeout=30)
    if how == "terminate":
      assert returncode == 7

    def child_gone():
      try:
        os.kill(child, 0)
      except ProcessLookupError:
        return True
      return False

    _wait_for(child_gone, f"{how}: the child is still running")


def test_the_pid_file_names_the_process_that_runs_the_command(tmp_path):
  """Guards forkserver.PID_FILE (trainer_runs.start_train_to_kill SIGKILLs the pid it names):
  a file naming the client, so that the kill leaves the command running on its workdir, and
  a client whose child died of SIGKILL ending with another status (it raised setting
  SIGKILL's action: status 1)."""
  script = _script(
      tmp_path,
      "waits.py",
      """
      import os, sys, time
      open(sys.argv[1] + ".tmp", "w").write(str(os.getpid()))
      os.rename(sys.argv[1] + ".tmp", sys.argv[1])
      time.sleep(60)
      """,
  )
  for real in (False, True):
    own, told = tmp_path / f"own-{real}", tmp_path / f"told-{real}"
    env = _env(**{forkserver.PID_FILE: str(told)})
    if real:
      env[forkserver.DISABLE] = "1"
    proc = subprocess.Popen(
        forkserver.command([sys.executable, script, str(own)]), env=env
    )
    _wait_for(
        lambda: own.exists() and told.exists(),  # pylint: disable=cell-var-from-loop
        "the command did not start, or its pid was not told",
    )
    assert told.read_text() == own.read_text()
    os.kill(int(told.read_text()), signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL


def test_xla_flags_reach_a_forked_child(tmp_path):
  """Guards: a zygote that started jax's backend before the fork (XLA_FLAGS, read then, would
  be the zygote's: the multi-device tests would run on one device)."""
  script = _script(
      tmp_path,
      "devices.py",
      "import sys, jax\nprint(len(jax.devices()), 'jax' in sys.modules)\n",
  )
  for n in (2, 1):
    flags = f"--xla_force_host_platform_device_count={n}"
    p = _run([script], env=_env(XLA_FLAGS=flags))
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == [str(n), "True"]


def test_one_zygote_serves_each_tfds_data_dir_as_a_fresh_tfds_would(tmp_path):
  """Guards: a child that keeps the data dir its zygote's tfds import read (the zygote's first
  caller's TFDS_DATA_DIR) once TFDS_DATA_DIR no longer keys the zygote."""
  script = _script(
      tmp_path,
      "data_dir.py",
      "import sys\nfrom tensorflow_datasets.core import constants\n"
      "print(constants.DATA_DIR, 'tensorflow_datasets' in sys.modules)\n",
  )
  preload = {forkserver.PRELOAD_ENV: "tensorflow_datasets.core.constants"}
  envs = [dict(_env(TFDS_DATA_DIR=str(tmp_path / d)), **preload) for d in "ab"]
  envs.append({k: v for k, v in envs[0].items() if k != "TFDS_DATA_DIR"})
  paths = {forkserver.socket_path(env, False) for env in envs}
  assert len(paths) == 1, "TFDS_DATA_DIR keys the zygote again"
  for env in envs:
    p = _run([script], env=env)
    real = _run([script], env=env, real=True)
    assert p.returncode == real.returncode == 0, p.stderr + real.stderr
    assert p.stdout.split()[1] == "True", "not forked from the zygote"
    assert p.stdout.split()[0] == real.stdout.split()[0], env.get(
        "TFDS_DATA_DIR"
    )


def test_a_shadowing_folder_gets_a_real_interpreter(tmp_path):
  """Guards: a script beside its own copy of a preloaded module (a source tree) run with the
  zygote's copy."""
  os.makedirs(tmp_path / "jax")
  (tmp_path / "jax" / "__init__.py").write_text("WHO = 'the local copy'\n")
  script = _script(tmp_path, "who.py", "import jax\nprint(jax.WHO)\n")
  p = _run([script])
  assert p.returncode == 0 and p.stdout == "the local copy\n", p.stderr


def test_a_re_executed_interpreter_runs_in_the_zygote_of_its_environment(
    tmp_path,
):
  """Guards: os.execve of the interpreter (hostmem's huge pages) losing the new environment or
  the arguments."""
  script = _script(
      tmp_path,
      "again.py",
      """
      import os, sys
      if "AGAIN" not in os.environ:
        env = dict(os.environ, AGAIN="1")
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
      print(os.environ["AGAIN"], sys.argv[1:], "jax" in sys.modules)
      """,
  )
  for real in (False, True):
    p = _run([script, "x"], real=real)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["1", "['x']", str(not real)]


def test_what_the_imports_print_reaches_each_caller(tmp_path):
  """Guards: the start-up lines of a preloaded module (TensorFlow's) printed to the zygote's log
  only, where a test that checks the log for them cannot see them."""
  (tmp_path / "lib").mkdir()
  (tmp_path / "lib" / "noisy.py").write_text(
      "import os, sys\nos.write(2, b'C++ line\\n')\nprint('Python line')\n"
  )
  script = _script(tmp_path, "uses.py", "import noisy\nprint('main')\n")
  env = _env(
      PYTHONPATH=f"{tmp_path / 'lib'}:{os.environ.get('PYTHONPATH', '')}"
  )
  env[forkserver.PRELOAD_ENV] = "noisy"
  runs = [_run([script], real=real, env=env) for real in (False, True, False)]
  for p in runs:
    assert p.returncode == 0, p.stderr
    assert (p.stdout, p.stderr) == ("Python line\nmain\n", "C++ line\n")


def test_a_preloaded_module_with_absl_flags_runs_as_main(tmp_path):
  """Guards: `python -m MOD` of a preloaded module that defines absl flags at import failing
  with DuplicateFlagError (big_vit_lite.data.prepare did)."""
  (tmp_path / "lib").mkdir()
  (tmp_path / "lib" / "flagged.py").write_text(textwrap.dedent("""
      from absl import app, flags
      WHO = flags.DEFINE_string("who", "nobody", "who")
      WHERE = flags.DEFINE_string("where", "nowhere", "where")
      if __name__ == "__main__":
        app.run(lambda argv: print(WHO.value, WHERE.value))
      """))
  env = _env(
      PYTHONPATH=f"{tmp_path / 'lib'}:{os.environ.get('PYTHONPATH', '')}"
  )
  env[forkserver.PRELOAD_ENV] = "flagged"
  for real in (False, True):
    p = _run(["-m", "flagged", "--who=me"], real=real, env=env)
    assert (p.returncode, p.stdout) == (0, "me nowhere\n"), p.stderr


def test_a_client_that_dies_mid_request_leaves_the_zygote_serving(tmp_path):
  """Guards: a zygote that ends on a client killed before its request was whole (every later
  command would pay a new zygote's imports)."""
  script = _script(tmp_path, "parent.py", "import os\nprint(os.getppid())\n")
  zygote = _run([script]).stdout
  path = forkserver.socket_path(_env(), False)
  for partial in (b"", b"\0\0"):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
      sock.connect(path)
      sock.sendall(partial)
  p = _run([script])
  assert p.returncode == 0 and p.stdout == zygote, p.stderr
