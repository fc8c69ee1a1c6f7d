r"""Start the `N` processes of one run on this machine: the multi-host code path without a cluster
(CPU devices, gloo collectives, coordinator on 127.0.0.1).

  python launch/local.py --processes=2 --devices_per_process=2 -- \
      --config=configs/sdar.py:smoke --workdir=runs/local2

Everything after `--` goes to `python -m stabledrl_jax.main` on every process. Only process 0
prints. SIGTERM or SIGINT (Ctrl-C) to the launcher goes on to the processes, which save at the
next step boundary and exit (docs/preemption.md). If a process fails, the others are stopped and
the launcher exits with its code; rerun the same command to resume from the last checkpoint.
"""
import argparse
import os
import signal
import socket
import subprocess
import sys
import time


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def commands(processes: int, port: int, heartbeat_timeout: int, main_args: list[str]) -> list[list[str]]:
  return [[sys.executable, "-m", "stabledrl_jax.main", "--distributed",
           f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={processes}",
           f"--process_id={i}", f"--heartbeat_timeout={heartbeat_timeout}", *main_args]
          for i in range(processes)]


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--processes", type=int, default=2)
  parser.add_argument("--devices_per_process", type=int, default=2, help="fake CPU devices each")
  parser.add_argument("--port", type=int, default=0, help="coordinator port (default: a free one)")
  parser.add_argument("--heartbeat_timeout", type=int, default=30,
                      help="seconds until the others notice a dead process")
  parser.add_argument("main_args", nargs=argparse.REMAINDER, help="-- then the flags of main")
  args = parser.parse_args()
  if args.processes < 1 or args.devices_per_process < 1:
    parser.error(f"--processes={args.processes} and --devices_per_process="
                 f"{args.devices_per_process} must be >= 1")
  main_args = args.main_args[1:] if args.main_args[:1] == ["--"] else args.main_args
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.devices_per_process}"}
  port = args.port or free_port()
  procs = [subprocess.Popen(cmd, env=env)
           for cmd in commands(args.processes, port, args.heartbeat_timeout, main_args)]

  def stop_all(*_):
    for p in procs:
      if p.poll() is None:
        p.terminate()
    deadline = time.time() + 10
    for p in procs:
      try:
        p.wait(max(deadline - time.time(), 0.1))
      except subprocess.TimeoutExpired:
        p.kill()

  def forward(signum, _):  # the processes save at their next step boundary and exit 0
    for p in procs:
      if p.poll() is None:
        p.send_signal(signum)

  signal.signal(signal.SIGTERM, forward)
  signal.signal(signal.SIGINT, forward)
  while True:
    codes = [p.poll() for p in procs]
    failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
    if failed:
      i, code = failed[0]
      print(f"launch: process {i} exited with code {code}; stopping the others", file=sys.stderr,
            flush=True)
      stop_all()
      return code if code > 0 else 128 - code
    if all(c == 0 for c in codes):
      return 0
    time.sleep(0.2)


if __name__ == "__main__":
  sys.exit(main())
