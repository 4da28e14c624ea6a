"""The launch and setup scripts: shell syntax (bash -n, shellcheck); the commands they generate,
run against a fake gcloud / srun.

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
SCRIPTS = (
    [
        "launch/" + n
        for n in (
            "local.sh",
            "multi_gpu.sh",
            "slurm.sbatch",
            "tpu_vm.sh",
            "tpu_worker_setup.sh",
        )
    ]
    + sorted(
        "scripts/" + n
        for n in os.listdir(os.path.join(REPO, "scripts"))
        if n.endswith(".sh")
    )
    + [".ci/run"]
)

# A stand-in for `gcloud compute tpus tpu-vm`, as strict as the real one where
# tpu_vm.sh could go wrong: the flags of each subcommand and the gcloud-wide
# ones (gcloud reference, SYNOPSIS of create / ssh / scp / delete), the required
# ones, the runtime images Google lists (TPU software versions page) and the
# accelerator-type form. What it rejects exits 2 with gcloud's kind of message.
# It records its arguments and, for `ssh --command=...`, runs the command here
# with HOME in a temporary directory (standing in for a worker).
FAKE_GCLOUD = r"""
import json, os, re, subprocess, sys
args = sys.argv[1:]
with open(os.environ["FAKE_GCLOUD_LOG"], "a") as f:
  f.write(json.dumps(args) + "\n")
WIDE = {"access-token-file", "account", "billing-project", "configuration", "flags-file", "flatten",
        "format", "help", "impersonate-service-account", "log-http", "project", "quiet",
        "trace-token", "user-output-enabled", "verbosity"}
SSH_KEYS = {"dry-run", "force-key-file-overwrite", "internal-ip", "plain", "ssh-key-file",
            "strict-host-key-checking", "worker", "zone", "ssh-key-expiration", "ssh-key-expire-after"}
FLAGS = {
    "create": {"zone", "version", "async", "boot-disk", "data-disk", "description", "internal-ips",
               "labels", "metadata", "metadata-from-file", "network", "preemptible", "queue-count",
               "range", "reserved", "scopes", "service-account", "shielded-secure-boot", "spot",
               "subnetwork", "tags", "accelerator-type", "topology", "type"},
    "delete": {"zone", "async"},
    "ssh": SSH_KEYS | {"ssh-flag", "command", "output-directory"},
    "scp": SSH_KEYS | {"compress", "recurse", "scp-flag"},
}
RUNTIMES = {"tpu-ubuntu2204-base", "v2-alpha-tpuv5-lite", "v2-alpha-tpuv5", "v2-alpha-tpuv6e",
            "v2-alpha", "tpu-vm-base"}
def fail(sub, msg):
  sys.stderr.write(f"ERROR: (gcloud.compute.tpus.tpu-vm.{sub}) {msg}\n")
  sys.exit(2)
if args[:3] != ["compute", "tpus", "tpu-vm"] or len(args) < 4 or args[3] not in FLAGS:
  sys.stderr.write(f"ERROR: (gcloud) Invalid choice: {args[:4]}\n")
  sys.exit(2)
sub, rest = args[3], args[4:]
flags, positional = {}, []
for a in rest:
  if a.startswith("--"):
    name, _, value = a[2:].partition("=")
    if name not in FLAGS[sub] | WIDE:
      fail(sub, f"unrecognized arguments: {a}")
    flags[name] = value
  else:
    positional.append(a)
if len(positional) != (1 if sub != "scp" else 2):
  fail(sub, f"wrong positional arguments: {positional}")
if "zone" not in flags:
  fail(sub, "argument --zone: must be specified (no compute/zone property here)")
if sub == "create":
  if "version" not in flags:
    fail(sub, "argument --version: Must be specified.")
  v = flags["version"]
  if v not in RUNTIMES and not re.fullmatch(r"tpu-vm-tf-\d+\.\d+\.\d+(-pod)?(-pjrt|-se)?", v):
    fail(sub, f"INVALID_ARGUMENT: runtime version '{v}' is not available")
  if not re.fullmatch(r"v(2|3|4|5litepod|5p|6e)-\d+", flags.get("accelerator-type", "v2-8")):
    fail(sub, f"INVALID_ARGUMENT: accelerator type '{flags['accelerator-type']}' is not available")
if sub in ("ssh", "scp") and "worker" in flags and not re.fullmatch(r"all|\d+(,\d+)*", flags["worker"]):
  fail(sub, f"invalid --worker '{flags['worker']}'")
if sub == "ssh" and os.environ.get("FAKE_GCLOUD_EXEC") == "1" and "command" in flags:
  sys.exit(subprocess.run(["bash", "-c", flags["command"]], cwd=os.environ["HOME"]).returncode)
"""


@pytest.mark.parametrize("name", SCRIPTS)
def test_scripts_parse(name):
  path = os.path.join(REPO, name)
  if name.startswith("launch/"):
    assert os.access(path, os.X_OK), f"{name} is not executable"
  subprocess.run(["bash", "-n", path], check=True)
  # SC1091: the sourced .venv/bin/activate is not ours to lint.
  if shutil.which("shellcheck"):
    proc = subprocess.run(
        ["shellcheck", "-s", "bash", "-e", "SC1091", path],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout


@pytest.fixture
def fake_tpu(tmp_path):
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  gcloud = bin_dir / "gcloud"
  gcloud.write_text(f"#!{sys.executable}" + FAKE_GCLOUD)
  gcloud.chmod(0o755)
  home = tmp_path / "worker_home"
  (home / "big_vit_lite").mkdir(parents=True)
  (home / "bvl_venv" / "bin").mkdir(parents=True)
  (home / "bvl_venv" / "bin" / "activate").write_text(
      "export BVL_VENV_ACTIVE=1\n"
  )
  log = tmp_path / "gcloud.log"
  env = dict(
      os.environ,
      PATH=f"{bin_dir}:{os.environ['PATH']}",
      HOME=str(home),
      FAKE_GCLOUD_LOG=str(log),
      TPU_NAME="bvl-test",
      ZONE="us-central2-b",
  )
  env.pop("PROJECT", None)

  def run(*args, exec_remote=False, **extra_env):
    e = dict(env, FAKE_GCLOUD_EXEC="1" if exec_remote else "0", **extra_env)
    return subprocess.run(
        ["bash", os.path.join(LAUNCH, "tpu_vm.sh"), *args],
        env=e,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

  def calls():
    return (
        [json.loads(l) for l in log.read_text().splitlines()]
        if log.exists()
        else []
    )

  return run, calls, home


@pytest.mark.timeout(60)
def test_tpu_create_and_delete_commands(fake_tpu):
  run, calls, _ = fake_tpu
  proc = run("create", ACCELERATOR_TYPE="v4-256", SPOT="1", PROJECT="my-proj")
  assert proc.returncode == 0, proc.stderr
  assert run("delete").returncode == 0, proc.stderr
  create, delete = calls()
  assert create[:5] == ["compute", "tpus", "tpu-vm", "create", "bvl-test"]
  for flag in (
      "--accelerator-type=v4-256",
      "--version=tpu-ubuntu2204-base",
      "--spot",
      "--zone=us-central2-b",
      "--project=my-proj",
  ):
    assert flag in create, create
  assert (
      delete[:5] == ["compute", "tpus", "tpu-vm", "delete", "bvl-test"]
      and "--quiet" in delete
  )


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "accelerator,image",
    [
        ("v5litepod-16", "v2-alpha-tpuv5-lite"),
        ("v5p-128", "v2-alpha-tpuv5"),
        ("v6e-8", "v2-alpha-tpuv6e"),
        ("v3-32", "tpu-ubuntu2204-base"),
    ],
)
def test_tpu_create_picks_the_image_listed_for_the_accelerator(
    fake_tpu, accelerator, image
):
  run, calls, _ = fake_tpu
  proc = run("create", ACCELERATOR_TYPE=accelerator)
  assert proc.returncode == 0, proc.stderr
  assert f"--version={image}" in calls()[0]


@pytest.mark.timeout(60)
def test_tpu_create_errors_pass_through(fake_tpu):
  run, _, _ = fake_tpu
  # no such image (the fake, like gcloud)
  proc = run("create", RUNTIME_VERSION="tpu-ubuntu2404-base")
  assert (
      proc.returncode == 2
      and "runtime version 'tpu-ubuntu2404-base' is not available"
      in proc.stderr
  )
  proc = run("create", ACCELERATOR_TYPE="v5e-8")  # Google calls it v5litepod-8
  assert (
      proc.returncode == 2 and "unknown ACCELERATOR_TYPE 'v5e-8'" in proc.stderr
  )


def test_fake_gcloud_rejects_what_gcloud_rejects(fake_tpu, tmp_path):
  """The fake is only a check if it refuses unknown flags, missing required ones and bad images."""
  gcloud = str(tmp_path / "bin" / "gcloud")
  env = dict(os.environ, FAKE_GCLOUD_LOG=str(tmp_path / "log"))
  base = ["compute", "tpus", "tpu-vm"]
  for args, message in [
      (
          [
              "create",
              "t",
              "--zone=z",
              "--version=v2-alpha-tpuv5-lite",
              "--accelerator=v5litepod-8",
          ],
          "unrecognized arguments: --accelerator=v5litepod-8",
      ),
      (
          ["create", "t", "--zone=z", "--accelerator-type=v4-8"],
          "--version: Must be specified",
      ),
      (
          ["create", "t", "--zone=z", "--version=ubuntu-22.04"],
          "runtime version 'ubuntu-22.04'",
      ),
      (
          ["ssh", "t", "--zone=z", "--workers=all", "--command=true"],
          "unrecognized arguments: --workers=all",
      ),
      (["scp", "a", "t:b", "--worker=all"], "--zone: must be specified"),
      (
          ["delete", "t", "--zone=z", "--force"],
          "unrecognized arguments: --force",
      ),
  ]:
    proc = subprocess.run(
        [gcloud, *base, *args],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr)
  ok = subprocess.run(
      [
          gcloud,
          *base,
          "create",
          "t",
          "--zone=z",
          "--version=tpu-vm-tf-2.16.0-pod-pjrt",
          "--accelerator-type=v4-32",
          "--quiet",
      ],
      env=env,
      check=False,
  )
  assert ok.returncode == 0


@pytest.mark.timeout(60)
def test_tpu_run_executes_on_all_workers_with_env_and_quoting(fake_tpu):
  run, calls, home = fake_tpu
  code = "import os, sys; print('ARGS', os.environ['BVL_DISTRIBUTED'], os.environ['TFDS_DATA_DIR'], sys.argv[1:])"
  proc = run(
      "run",
      "--",
      sys.executable,
      "-c",
      code,
      "a b",
      "it's",
      exec_remote=True,
      TFDS_DATA_DIR="gs://bucket/tensorflow datasets",
  )
  assert proc.returncode == 0, proc.stderr
  (call,) = calls()
  assert (
      call[:5] == ["compute", "tpus", "tpu-vm", "ssh", "bvl-test"]
      and "--worker=all" in call
  )
  host = socket.gethostname()
  expected = (
      f"[{host}] ARGS auto gs://bucket/tensorflow datasets ['a b', \"it's\"]"
  )
  assert expected in proc.stdout, proc.stdout
  # The worker keeps a log.
  assert "ARGS auto" in (home / "bvl_logs" / "run.log").read_text()


@pytest.mark.timeout(60)
def test_tpu_run_fails_when_the_command_fails(fake_tpu):
  run, _, _ = fake_tpu
  proc = run(
      "run", "--", sys.executable, "-c", "raise SystemExit(3)", exec_remote=True
  )
  assert proc.returncode != 0


@pytest.mark.timeout(60)
def test_tpu_detached_run_logs_and_collect(fake_tpu, tmp_path):
  run, calls, home = fake_tpu
  proc = run(
      "run",
      "--",
      sys.executable,
      "-c",
      "print('detached ok')",
      exec_remote=True,
      DETACH="1",
  )
  assert proc.returncode == 0 and "started on" in proc.stdout, proc.stderr
  log = home / "bvl_logs" / "run.log"
  for _ in range(100):
    if log.exists() and "detached ok" in log.read_text():
      break
    time.sleep(0.1)
  assert "detached ok" in log.read_text()
  out_dir = tmp_path / "collected"
  assert run("collect", str(out_dir), exec_remote=True).returncode == 0
  assert (
      out_dir / f"{socket.gethostname()}.log"
  ).read_text() == "detached ok\n"
  assert run("stop").returncode == 0
  assert any(a.startswith("--command=pkill -TERM") for a in calls()[-1])


@pytest.mark.timeout(60)
def test_tpu_install_copies_the_tree_to_all_workers(fake_tpu):
  run, calls, _ = fake_tpu
  proc = run("install", LOCK="0")
  assert proc.returncode == 0, proc.stderr
  scp, ssh = calls()
  assert scp[3] == "scp" and "--worker=all" in scp
  assert "bvl-test:~/big_vit_lite.tar.gz" in scp
  command = next(a for a in ssh if a.startswith("--command="))
  assert (
      "LOCK=0 bash ~/big_vit_lite/launch/tpu_worker_setup.sh ~/big_vit_lite ~/bvl_venv"
      in command
  )
  assert "--worker=all" in ssh


@pytest.mark.timeout(60)
def test_tpu_worker_setup_installs_python311_on_the_ubuntu2204_images(tmp_path):
  """On a worker whose python3 is 3.10 (the TPU images), the setup asks apt for python3.11 + venv."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "python3").write_text(
      "#!/bin/sh\n[ \"$1\" = --version ] && echo 'Python 3.10.12'\nexit 1\n"
  )
  # apt-get fails
  (bin_dir / "sudo").write_text(
      '#!/bin/sh\necho "$*" >> "$SUDO_LOG"\nexit 100\n'
  )
  for f in bin_dir.iterdir():
    f.chmod(0o755)
  (bin_dir / "hostname").symlink_to(shutil.which("hostname"))
  # Only the fakes: no python3.11-13 of this machine may be found.
  path = str(bin_dir)
  proc = subprocess.run(
      [
          shutil.which("bash"),
          os.path.join(LAUNCH, "tpu_worker_setup.sh"),
          str(tmp_path / "p"),
          str(tmp_path / "venv"),
      ],
      env=dict(os.environ, PATH=path, SUDO_LOG=str(tmp_path / "sudo.log")),
      capture_output=True,
      text=True,
      check=False,
  )
  assert proc.returncode == 1, proc.stderr
  assert (
      "python3 is Python 3.10.12 and apt-get could not install python3.11 python3.11-venv"
      in proc.stderr
  )
  assert "apt-get update -qq" in (tmp_path / "sudo.log").read_text()


@pytest.mark.timeout(30)
def test_tpu_needs_name_and_zone(fake_tpu):
  run, _, _ = fake_tpu
  proc = run("create", TPU_NAME="")
  assert proc.returncode == 2 and "TPU_NAME" in proc.stderr
  proc = run("frobnicate")
  assert proc.returncode == 2 and "unknown subcommand" in proc.stderr


@pytest.mark.timeout(60)
def test_multi_gpu_sets_global_process_ids(tmp_path):
  code = (
      "import os; print('ENV', os.environ['JAX_PROCESS_ID'], os.environ['JAX_NUM_PROCESSES'], "
      "os.environ['JAX_COORDINATOR_ADDRESS'], os.environ.get('JAX_LOCAL_DEVICE_IDS'))"
  )
  env = dict(os.environ, LOG_DIR=str(tmp_path), LOCAL_PREFIX_OUTPUT="0")
  proc = subprocess.run(
      [
          "bash",
          os.path.join(LAUNCH, "multi_gpu.sh"),
          "--coordinator=10.1.2.3:1234",
          "--num_hosts=3",
          "--host_id=1",
          "--gpus=2",
          "--",
          sys.executable,
          "-c",
          code,
      ],
      env=env,
      capture_output=True,
      text=True,
      timeout=50,
      check=False,
  )
  assert proc.returncode == 0, proc.stderr
  # Host 1 of 3 with 2 GPUs: global processes 2 and 3 of 6, one GPU each.
  assert (
      tmp_path / "proc2.log"
  ).read_text().strip() == "ENV 2 6 10.1.2.3:1234 0"
  assert (
      tmp_path / "proc3.log"
  ).read_text().strip() == "ENV 3 6 10.1.2.3:1234 1"
  bad = subprocess.run(
      [
          "bash",
          os.path.join(LAUNCH, "multi_gpu.sh"),
          "--coordinator=x",
          "--num_hosts=1",
          "--host_id=0",
          "--gpus=1",
          "--",
          "true",
      ],
      capture_output=True,
      text=True,
      check=False,
  )
  assert bad.returncode == 2 and "HOST:PORT" in bad.stderr


@pytest.mark.timeout(60)
def test_slurm_script_runs_trainer_under_srun(tmp_path):
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  srun = bin_dir / "srun"
  srun.write_text('#!/usr/bin/env bash\necho "SRUN $*" > "$FAKE_SRUN_LOG"\n')
  srun.chmod(0o755)
  # A python whose jax sees a GPU, as on a GPU node (this machine's says "cpu").
  gpu_python = bin_dir / "gpu_python"
  gpu_python.write_text(
      '#!/bin/sh\ncase "$*" in *default_backend*) echo gpu ;; esac\n'
  )
  gpu_python.chmod(0o755)
  env = dict(
      os.environ,
      PATH=f"{bin_dir}:{os.environ['PATH']}",
      FAKE_SRUN_LOG=str(tmp_path / "srun.log"),
      SLURM_JOB_ID="42",
      LOG_DIR=str(tmp_path / "logs"),
      PYTHON=str(gpu_python),
  )
  args = [
      "bash",
      os.path.join(LAUNCH, "slurm.sbatch"),
      "--config=configs/demo.py",
      "--workdir=/shared/run",
  ]
  proc = subprocess.run(
      args, env=env, capture_output=True, text=True, timeout=50, check=False
  )
  assert proc.returncode == 0, proc.stderr
  line = (tmp_path / "srun.log").read_text()
  assert "--kill-on-bad-exit=1" in line
  assert (
      f"{gpu_python} -m big_vit_lite.train --config=configs/demo.py --workdir=/shared/run"
      in line
  )
  # This machine's jax (CPU only): one line saying to install the CUDA extra,
  # and no srun.
  (tmp_path / "srun.log").unlink()
  proc = subprocess.run(
      args,
      env=dict(env, PYTHON=sys.executable),
      capture_output=True,
      text=True,
      timeout=50,
      check=False,
  )
  assert (
      proc.returncode == 2
      and "default backend: cpu" in proc.stderr
      and "'.[cuda]'" in proc.stderr
  )
  assert not (tmp_path / "srun.log").exists()


@pytest.mark.parametrize("script", ["local.sh", "multi_gpu.sh", "tpu_vm.sh"])
def test_launch_scripts_help_is_their_documentation_and_exits_0(script):
  proc = subprocess.run(
      ["bash", os.path.join(LAUNCH, script), "--help"],
      capture_output=True,
      text=True,
      timeout=30,
      check=False,
  )
  assert proc.returncode == 0 and not proc.stderr, proc.stderr
  assert (
      "Environment" in proc.stdout or "--coordinator" in proc.stdout
  ), proc.stdout[:200]


def test_multi_gpu_empty_num_hosts_is_named():
  proc = subprocess.run(
      [
          "bash",
          os.path.join(LAUNCH, "multi_gpu.sh"),
          "--num_hosts=",
          "--host_id=1",
          "--coordinator=h:1",
          "--gpus=1",
          "--",
          "true",
      ],
      capture_output=True,
      text=True,
      timeout=30,
      check=False,
  )
  assert proc.returncode == 2
  assert "must be integers, got '' and '1'" in proc.stderr, proc.stderr
