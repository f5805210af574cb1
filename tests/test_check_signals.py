"""The self-check under the macOS double when it is stopped (Ctrl-C, SIGTERM, SIGHUP), and the
MPS double's slow GPU work that such tests stop."""
import json
import textwrap

import pytest

pytest.importorskip('coremltools')
from test_macos import mac  # noqa: E402

SLOW_BACKWARD = """
    import json, os, signal, threading, time, torch
    w = torch.nn.Parameter(torch.ones(3).to('mps'))
    t0 = time.monotonic()
    (w * 2).sum().backward()  # queued: returns at once
    queued = time.monotonic() - t0
    g = w.grad.sum().item()  # waits for the queued work
    waited = time.monotonic() - t0
    (w * 2).sum().backward()
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
    t0 = time.monotonic()
    try:
        torch.mps.synchronize()
        stopped = None
    except KeyboardInterrupt:
        stopped = time.monotonic() - t0
    print(json.dumps(dict(queued=queued, waited=waited, grad=g, stopped=stopped)))
"""


def test_slow_mps_backward_queues_work_that_the_next_read_waits_for(tmp_path):
    # MACOS_DOUBLE_MPS_SLOW=1.5: each backward queues 1.5 s; a read waits for it, and a Ctrl-C
    # meanwhile is handled after the wait, as after Metal's waitUntilCompleted
    r = mac(['-c', textwrap.dedent(SLOW_BACKWARD)], tmp_path, mps_slow=1.5)
    assert r.returncode == 0, r.stderr[-3000:]
    f = json.loads(r.stdout.splitlines()[-1])
    assert f['grad'] == 6.0 and f['queued'] < 0.5  # 3 ones times 2; the backward only queues
    assert f['waited'] >= 1.5  # at least the queued work, as the switch promises
    assert f['stopped'] is not None and f['stopped'] >= 1.5 - 0.2  # the signal came 0.2 s in
