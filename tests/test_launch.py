"""The launch scripts: shell syntax, and the commands they generate, with fake gcloud/srun.

The fake `gcloud` records its arguments and, for `tpu-vm ssh --command=...`, runs the command
here with HOME in a temporary directory (standing in for a worker), so the quoting of what
would run on the TPU workers is tested by executing it.
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(REPO, "launch")
SCRIPTS = ["local.sh", "multi_gpu.sh", "slurm.sbatch", "tpu_vm.sh"]

FAKE_GCLOUD = r'''#!/usr/bin/env bash
python3 -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "$@" >> "$FAKE_GCLOUD_LOG"
if [ "${FAKE_GCLOUD_EXEC:-0}" = 1 ]; then
  for a in "$@"; do
    case "$a" in --command=*) cd "$HOME" && exec bash -c "${a#--command=}" ;; esac
  done
fi
'''


@pytest.mark.parametrize("name", SCRIPTS)
def test_scripts_parse(name):
  path = os.path.join(LAUNCH, name)
  assert os.access(path, os.X_OK), f"{name} is not executable"
  subprocess.run(["bash", "-n", path], check=True)
  if shutil.which("shellcheck"):
    proc = subprocess.run(["shellcheck", "-s", "bash", path], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


@pytest.fixture
def fake_tpu(tmp_path):
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  gcloud = bin_dir / "gcloud"
  gcloud.write_text(FAKE_GCLOUD)
  gcloud.chmod(0o755)
  home = tmp_path / "worker_home"
  (home / "big_vit_lite").mkdir(parents=True)
  (home / "bvl_venv" / "bin").mkdir(parents=True)
  (home / "bvl_venv" / "bin" / "activate").write_text("export BVL_VENV_ACTIVE=1\n")
  log = tmp_path / "gcloud.log"
  env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", HOME=str(home),
             FAKE_GCLOUD_LOG=str(log), TPU_NAME="bvl-test", ZONE="us-central2-b")
  env.pop("PROJECT", None)

  def run(*args, exec_remote=False, **extra_env):
    e = dict(env, FAKE_GCLOUD_EXEC="1" if exec_remote else "0", **extra_env)
    return subprocess.run(["bash", os.path.join(LAUNCH, "tpu_vm.sh"), *args], env=e,
                          capture_output=True, text=True, timeout=60, check=False)

  def calls():
    return [json.loads(l) for l in log.read_text().splitlines()] if log.exists() else []

  return run, calls, home


@pytest.mark.timeout(60)
def test_tpu_create_and_delete_commands(fake_tpu):
  run, calls, _ = fake_tpu
  assert run("create", ACCELERATOR_TYPE="v4-256", SPOT="1", PROJECT="my-proj").returncode == 0
  assert run("delete").returncode == 0
  create, delete = calls()
  assert create[:5] == ["compute", "tpus", "tpu-vm", "create", "bvl-test"]
  for flag in ("--accelerator-type=v4-256", "--version=tpu-ubuntu2204-base", "--spot",
               "--zone=us-central2-b", "--project=my-proj"):
    assert flag in create, create
  assert delete[:5] == ["compute", "tpus", "tpu-vm", "delete", "bvl-test"] and "--quiet" in delete


@pytest.mark.timeout(60)
def test_tpu_run_executes_on_all_workers_with_env_and_quoting(fake_tpu):
  run, calls, home = fake_tpu
  code = "import os, sys; print('ARGS', os.environ['BVL_DISTRIBUTED'], os.environ['TFDS_DATA_DIR'], sys.argv[1:])"
  proc = run("run", "--", sys.executable, "-c", code, "a b", "it's", exec_remote=True,
             TFDS_DATA_DIR="gs://bucket/tensorflow datasets")
  assert proc.returncode == 0, proc.stderr
  (call,) = calls()
  assert call[:5] == ["compute", "tpus", "tpu-vm", "ssh", "bvl-test"] and "--worker=all" in call
  host = socket.gethostname()
  expected = f"[{host}] ARGS auto gs://bucket/tensorflow datasets ['a b', \"it's\"]"
  assert expected in proc.stdout, proc.stdout
  assert "ARGS auto" in (home / "bvl_logs" / "run.log").read_text()  # The worker keeps a log.


@pytest.mark.timeout(60)
def test_tpu_run_fails_when_the_command_fails(fake_tpu):
  run, _, _ = fake_tpu
  proc = run("run", "--", sys.executable, "-c", "raise SystemExit(3)", exec_remote=True)
  assert proc.returncode != 0


@pytest.mark.timeout(60)
def test_tpu_detached_run_logs_and_collect(fake_tpu, tmp_path):
  run, calls, home = fake_tpu
  proc = run("run", "--", sys.executable, "-c", "print('detached ok')", exec_remote=True, DETACH="1")
  assert proc.returncode == 0 and "started on" in proc.stdout, proc.stderr
  log = home / "bvl_logs" / "run.log"
  for _ in range(100):
    if log.exists() and "detached ok" in log.read_text():
      break
    time.sleep(0.1)
  assert "detached ok" in log.read_text()
  out_dir = tmp_path / "collected"
  assert run("collect", str(out_dir), exec_remote=True).returncode == 0
  assert (out_dir / f"{socket.gethostname()}.log").read_text() == "detached ok\n"
  assert run("stop").returncode == 0
  assert any(a.startswith("--command=pkill -TERM") for a in calls()[-1])


@pytest.mark.timeout(60)
def test_tpu_install_copies_the_tree_to_all_workers(fake_tpu):
  run, calls, _ = fake_tpu
  proc = run("install")
  assert proc.returncode == 0, proc.stderr
  scp, ssh = calls()
  assert scp[3] == "scp" and "--worker=all" in scp
  assert "bvl-test:~/big_vit_lite.tar.gz" in scp
  command = next(a for a in ssh if a.startswith("--command="))
  assert "pip install" in command and "jax\\[tpu\\]==0.10.2" in command and "--worker=all" in ssh


@pytest.mark.timeout(30)
def test_tpu_needs_name_and_zone(fake_tpu):
  run, _, _ = fake_tpu
  proc = run("create", TPU_NAME="")
  assert proc.returncode == 2 and "TPU_NAME" in proc.stderr
  proc = run("frobnicate")
  assert proc.returncode == 2 and "unknown subcommand" in proc.stderr


@pytest.mark.timeout(60)
def test_multi_gpu_sets_global_process_ids(tmp_path):
  code = ("import os; print('ENV', os.environ['JAX_PROCESS_ID'], os.environ['JAX_NUM_PROCESSES'], "
          "os.environ['JAX_COORDINATOR_ADDRESS'], os.environ.get('JAX_LOCAL_DEVICE_IDS'))")
  env = dict(os.environ, LOG_DIR=str(tmp_path), LOCAL_PREFIX_OUTPUT="0")
  proc = subprocess.run(["bash", os.path.join(LAUNCH, "multi_gpu.sh"), "--coordinator=10.1.2.3:1234",
                         "--num_hosts=3", "--host_id=1", "--gpus=2", "--", sys.executable, "-c", code],
                        env=env, capture_output=True, text=True, timeout=50, check=False)
  assert proc.returncode == 0, proc.stderr
  # Host 1 of 3 with 2 GPUs: global processes 2 and 3 of 6, one GPU each.
  assert (tmp_path / "proc2.log").read_text().strip() == "ENV 2 6 10.1.2.3:1234 0"
  assert (tmp_path / "proc3.log").read_text().strip() == "ENV 3 6 10.1.2.3:1234 1"
  bad = subprocess.run(["bash", os.path.join(LAUNCH, "multi_gpu.sh"), "--coordinator=x",
                        "--num_hosts=1", "--host_id=0", "--gpus=1", "--", "true"],
                       capture_output=True, text=True, check=False)
  assert bad.returncode == 2 and "HOST:PORT" in bad.stderr


@pytest.mark.timeout(60)
def test_slurm_script_runs_trainer_under_srun(tmp_path):
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  srun = bin_dir / "srun"
  srun.write_text('#!/usr/bin/env bash\necho "SRUN $*" > "$FAKE_SRUN_LOG"\n')
  srun.chmod(0o755)
  env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_SRUN_LOG=str(tmp_path / "srun.log"),
             SLURM_JOB_ID="42", LOG_DIR=str(tmp_path / "logs"))
  proc = subprocess.run(["bash", os.path.join(LAUNCH, "slurm.sbatch"), "--config=configs/demo.py",
                         "--workdir=/shared/run"], env=env, capture_output=True, text=True,
                        timeout=50, check=False)
  assert proc.returncode == 0, proc.stderr
  line = (tmp_path / "srun.log").read_text()
  assert "--kill-on-bad-exit=1" in line
  assert "-m big_vit_lite.train --config=configs/demo.py --workdir=/shared/run" in line
