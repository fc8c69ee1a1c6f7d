"""The signal listener alone; a signalled two-process run is in tests/distributed_test.py."""
import os
import signal

import pytest

from stabledrl_jax import preemption


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_is_noted_not_fatal_and_the_handlers_are_restored_after(signum):
  before = {s: signal.getsignal(s) for s in preemption.SIGNALS}
  with preemption.Listener() as listener:
    assert not listener.agreed()
    os.kill(os.getpid(), signum)  # delivered to this (main) thread before kill returns
    os.kill(os.getpid(), signal.SIGTERM)  # a second signal changes nothing
    assert listener.signalled == signum.name and listener.agreed()
  assert {s: signal.getsignal(s) for s in preemption.SIGNALS} == before
