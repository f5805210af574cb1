"""
Energy meters for HeteroEngine: joules() is the energy used so far (None where nothing is
readable). hetero_gpt.py logs joules per token with them; bench.py compares modes.
powermetrics on macOS (coreml_and_ane.md section 6), NVML on NVIDIA GPUs, RAPL on Linux CPUs.
"""
import atexit
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

from .settings import ON_MAC  # the one check for macOS


class NvmlMeter:
    """NVIDIA GPUs: NVML's total-energy counter (millijoules), read through ctypes."""

    def __init__(self, index=0):
        import ctypes
        self.ct = ctypes
        self.lib = ctypes.CDLL('libnvidia-ml.so.1')
        if self.lib.nvmlInit_v2() != 0:
            raise OSError("nvmlInit failed")
        self.handle = ctypes.c_void_p()
        try:
            if self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self.handle)) != 0:
                raise OSError(f"no NVML device {index}")
            self.name = f"NVML (GPU {index})"
            self.joules()
        except BaseException:
            self.close()
            raise

    def joules(self):
        mj = self.ct.c_ulonglong()
        if self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle, self.ct.byref(mj)) != 0:
            raise OSError("NVML energy counter unsupported")
        return mj.value / 1000.0

    def close(self):
        """nvmlShutdown, once for each nvmlInit (NVML counts them)."""
        if self.handle is not None:
            self.handle = None
            self.lib.nvmlShutdown()


class RaplMeter:
    """Linux CPUs: RAPL package counters in /sys/class/powercap, microjoules. A counter runs
    from 0 to max_energy_range_uj, then wraps to 0 (kernel docs, powercap.rst)."""
    # the packages only: intel-rapl:0:0 is a part of package 0, and intel-rapl-mmio:0 is
    # package 0 again, read through MMIO
    PACKAGE = re.compile(r'intel-rapl:\d+$')

    def __init__(self, root='/sys/class/powercap'):
        self.zones = [os.path.join(root, z) for z in sorted(os.listdir(root)) if self.PACKAGE.match(z)]
        if not self.zones:
            raise OSError("no RAPL zones")
        self.last = [self._read(z, 'energy_uj') for z in self.zones]  # raises if unreadable (root only)
        self.wrap = [self._read(z, 'max_energy_range_uj') + 1 for z in self.zones]
        self.total, self.name = 0.0, f"RAPL ({len(self.zones)} CPU packages)"

    @staticmethod
    def _read(zone, f):
        with open(os.path.join(zone, f)) as fh:
            return int(fh.read())

    def joules(self):
        for i, z in enumerate(self.zones):
            now = self._read(z, 'energy_uj')
            self.total += ((now - self.last[i]) % self.wrap[i]) / 1e6
            self.last[i] = now
        return self.total


POWERMETRICS = ['sudo', '-n', 'powermetrics', '--samplers', 'cpu_power,gpu_power,ane_power']
# sudo in a process group of its own, in this session and terminal: a sudo -v ticket is the
# terminal's, and sudo relays signals from our group (coreml_and_ane.md section 6)
OWN_GROUP = dict(process_group=0) if sys.version_info >= (3, 11) else dict(preexec_fn=os.setpgrp)


def start_powermetrics(interval_ms, stdout, stderr, count=None):
    """sudo -n powermetrics, as the meter and its probe both start it. -b 1: line-buffered,
    or a pipe would hold samples back. stdin: not the terminal, which sudo's pty relays."""
    args = POWERMETRICS + ['-i', str(interval_ms), '-b', '1']
    if count:
        args += ['-n', str(count)]
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, text=True,
                            **OWN_GROUP)


def stop_powermetrics(proc):
    """SIGTERM to sudo, which relays it to powermetrics; SIGKILL would leave root's running."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def first_line(text, proc):
    return (text.strip().splitlines() or [f'exit code {proc.returncode}'])[0]


def powermetrics_readable():
    """(True, '') if powermetrics runs here through sudo -n, else (False, why): one sample,
    asked before anything is measured, started as the meter starts it. Most Macs have no
    NOPASSWD rule, and sudo's ticket lapses after 5 minutes (coreml_and_ane.md section 6)."""
    try:
        proc = start_powermetrics(100, subprocess.PIPE, subprocess.PIPE, count=1)
    except OSError as e:
        return False, str(e)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        return False, 'powermetrics gave no sample within 30 s'
    finally:
        stop_powermetrics(proc)  # (a no-op once it has ended)
        proc.stdout.close()
        proc.stderr.close()
    return (True, '') if proc.returncode == 0 else (False, first_line(err, proc))


class PowermetricsMeter:
    """macOS: CPU, GPU and ANE power sampled by powermetrics (root: sudo -n), each sample's
    watts times its own elapsed time, summed in a background thread. Each part counts once
    a sample, at its first line: the GPU block repeats GPU Power, and macOS 12 adds each
    cluster's own line (coreml_and_ane.md section 6). A refusal by sudo is remembered: later
    meters in this process fail at once with it."""
    HEADER = re.compile(r'^\*\*\* Sampled system activity .*\(([\d.]+)\s*ms elapsed\)')
    POWER = re.compile(r'^(CPU|GPU|ANE) Power: ([\d.]+) (mW|W)$')
    refused = None  # sudo's answer, once it has refused

    def __init__(self, interval_ms=200, wait_s=10.0):
        if PowermetricsMeter.refused:
            raise OSError(f"powermetrics gave no samples ({PowermetricsMeter.refused})")
        self.err = tempfile.TemporaryFile('w+')  # (a pipe nobody reads could fill and stop it)
        self.proc = start_powermetrics(interval_ms, subprocess.PIPE, self.err)
        self.name = "powermetrics (CPU+GPU+ANE)"
        self.parts = dict(CPU=0.0, GPU=0.0, ANE=0.0)  # joules of each so far
        first = threading.Event()
        self.reader = threading.Thread(target=read_samples, daemon=True,
                                       args=(self.proc.stdout, self.parts, first.set))
        self.reader.start()
        atexit.register(self.close)  # (if nobody closes it: sudo and powermetrics end with us)
        try:
            self._wait_for_power(first, wait_s)
        except BaseException:  # a refusal, a timeout, Ctrl-C: nothing left running
            self.close()
            raise

    def _wait_for_power(self, first, wait_s):
        deadline = time.monotonic() + wait_s
        while not first.wait(0.1):
            if self.proc.poll() is not None:
                self.err.seek(0)
                why = first_line(self.err.read(), self.proc)
                if why.startswith('sudo:'):
                    PowermetricsMeter.refused = why
                raise OSError(f"powermetrics gave no samples ({why})")
            if time.monotonic() > deadline:
                raise OSError(f"powermetrics printed no power lines within {wait_s:.0f} s")

    def joules(self):
        return sum(self.parts.values())

    def close(self):
        """Ends sudo and powermetrics, reaps them, and joins the reader (at the pipe's end)."""
        atexit.unregister(self.close)
        stop_powermetrics(self.proc)
        self.reader.join(5)  # EOF once powermetrics is gone
        if not self.reader.is_alive():  # (closing under a blocked reader would block)
            self.proc.stdout.close()
        self.err.close()


def read_samples(lines, parts, seen_power=lambda: None):
    """powermetrics' text output, line by line, into parts: joules of CPU, GPU and ANE, each
    sample's power times its own elapsed ms. Each part counts once a sample, at its first
    line: the processor block's GPU Power, not the GPU block's. seen_power() is called at
    each power line counted."""
    dt, seen = 0.0, set()
    for line in lines:
        if m := PowermetricsMeter.HEADER.match(line):
            dt, seen = float(m.group(1)) / 1000, set()
        elif (m := PowermetricsMeter.POWER.match(line.rstrip())) and m.group(1) not in seen:
            seen.add(m.group(1))
            watts = float(m.group(2)) / (1000 if m.group(3) == 'mW' else 1)
            parts[m.group(1)] += watts * dt
            seen_power()
    return parts


def spent(meter, start):
    """The joules meter counted since its reading start (0.0 without a meter: start None)."""
    return 0.0 if start is None else meter.joules() - start


class EnergyMeter:
    """The sum of every meter that works here: powermetrics on macOS, NVML for each CUDA
    device in use, RAPL when any engine runs on the CPU."""

    def __init__(self, devices):
        self.meters, self.missing = [], []
        kinds = []
        if ON_MAC:
            kinds.append(PowermetricsMeter)
        for i in sorted({d.index or 0 for d in devices if d.type == 'cuda'}):  # cuda and cuda:0: one GPU
            kinds.append(lambda i=i: NvmlMeter(i))
        if any(d.type == 'cpu' for d in devices) and not ON_MAC:
            kinds.append(RaplMeter)
        try:
            for make in kinds:
                try:
                    self.meters.append(make())
                except Exception as e:
                    self.missing.append(f"{getattr(make, '__name__', 'NVML')}: {e}")
        except BaseException:  # Ctrl-C while a meter starts: close those made
            self.close()
            raise
        self.name = ' + '.join(m.name for m in self.meters) or 'none'

    def joules(self):
        return sum(m.joules() for m in self.meters) if self.meters else None

    def close(self):
        """Ends every thread and process the meters started: each meter's close, even if one
        before it fails. Only powermetrics has any (sudo, powermetrics, the reader)."""
        try:
            while self.meters:
                m = self.meters.pop()
                if hasattr(m, 'close'):
                    m.close()
        finally:
            if self.meters:  # one raised: close the rest
                self.close()
