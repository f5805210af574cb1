"""plumbing/energy.py, the meters behind joules per token: powermetrics' text parsed from
real captures of two macOS versions, RAPL's counters and their wrap-around in a powercap tree the test writes, and one
meter per device. (The live powermetrics, through sudo: test_macos.py.)"""
import pytest
import torch

from plumbing import energy

# Excerpts of real captures (whole lines, in order; runs of lines left out), from
# joular/joularjx's test resources. macOS 12.5 (build 21G72), MacBook Air M2 (Mac14,2),
# src/test/resources/powermetrics-monterey-m2.txt (also in joular/joularjx issue #51): a
# sample of tasks only, then one whose processor block has each cluster's own power line and
# no Combined line.
MONTEREY_M2 = """Machine model: Mac14,2
OS version: 21G72
Boot arguments:
Boot time: Mon Oct  2 10:37:21 2023



*** Sampled system activity (Mon Oct 23 16:51:12 2023 +0200) (1012.07ms elapsed) ***

*** Running tasks ***

ALL_TASKS                          -2     1222.65   1222.65    65.70  1161.97 15.81              2875.29 132.40            0.00

*** Sampled system activity (Tue Nov 28 11:28:55 2023 +0100) (1002.80ms elapsed) ***


**** Processor usage ****

E-Cluster Power: 6 mW
E-Cluster HW active frequency: 919 MHz
E-Cluster idle residency:  94.63%

P-Cluster Power: 4 mW
P-Cluster HW active frequency: 667 MHz
P-Cluster idle residency: 100.00%

System instructions retired: 1.17831e+08
System instructions per clock: 1.50979
ANE Power: 0 mW
DRAM Power: 19 mW
DCS Power: 36 mW
CPU Power: 10 mW
GPU Power: 0 mW
Package Power: 25 mW
"""

# macOS 13 (build 22G120), MacBook Pro M1 Max (MacBookPro18,4),
# src/test/resources/powermetrics-sonoma-m1max.txt: the processor block ends in CPU, GPU and
# ANE Power and a Combined line (359, not 211 + 147 = 358: summed before rounding). The
# file ends without a newline.
VENTURA_M1MAX = """Machine model: MacBookPro18,4
OS version: 22G120
Boot arguments:
Boot time: Sat Oct 21 19:09:01 2023



*** Sampled system activity (Mon Oct 23 16:51:12 2023 +0200) (1012.07ms elapsed) ***

**** Processor usage ****

E-Cluster Online: 100%
E-Cluster HW active frequency: 1499 MHz
P1-Cluster idle residency:  99.39%

System instructions retired: 1.64279e+09
System instructions per clock: 0.841601
CPU Power: 211 mW
GPU Power: 147 mW
ANE Power: 0 mW
Combined Power (CPU + GPU + ANE): 359 mW"""

# The GPU block (--samplers gpu_power) ends in GPU Power again; in published captures it
# repeats the processor block's value. A test construction, not a capture: the 22G120
# sample, then a GPU block whose line differs, to pin which one counts (the processor
# block's, the one Combined sums); then a sample in decimals and watts, which no capture shows.
WITH_GPU_BLOCK = VENTURA_M1MAX + """

**** GPU usage ****

GPU HW active frequency: 389 MHz
GPU idle residency:  91.02%
GPU Power: 150 mW


*** Sampled system activity (Mon Oct 23 16:51:13 2023 +0200) (500.00ms elapsed) ***

CPU Power: 2.5 W
GPU Power: 1500.5 mW
ANE Power: 0.25 W
"""


def parts():
    return dict(CPU=0.0, GPU=0.0, ANE=0.0)


def test_powermetrics_captures_are_watts_times_each_samples_time():
    # joules of each part: its power times its sample's own elapsed time, each part once a
    # sample. macOS 12: CPU 10 mW x 1.0028 s, not 20 (the clusters' 6 + 4 are parts of it);
    # DRAM, DCS and Package are none of the three; the tasks-only sample counts nothing.
    # macOS 13: 211, 147 and 0 mW x 1.01207 s. Products of short decimals: fp64, 1e-15 relative
    seen = []
    assert energy.read_samples(MONTEREY_M2.splitlines(True), parts(), lambda: seen.append(1)) == pytest.approx(
        dict(CPU=0.010028, GPU=0.0, ANE=0.0), rel=1e-15, abs=0)
    assert len(seen) == 3
    assert energy.read_samples(VENTURA_M1MAX.splitlines(True), parts()) == pytest.approx(
        dict(CPU=0.211 * 1.01207, GPU=0.147 * 1.01207, ANE=0.0), rel=1e-15, abs=0)
    # the processor block's GPU Power (147 mW), not the GPU block's (150); then 2.5 W,
    # 1.5005 W and 0.25 W for 0.5 s
    assert energy.read_samples(WITH_GPU_BLOCK.splitlines(True), parts()) == pytest.approx(
        dict(CPU=0.211 * 1.01207 + 1.25, GPU=0.147 * 1.01207 + 0.75025, ANE=0.125), rel=1e-15, abs=0)
    # a sample cut off by the end of the text counts what it printed, nothing more
    half = VENTURA_M1MAX[:VENTURA_M1MAX.index('GPU Power')]
    assert energy.read_samples(half.splitlines(True), parts()) == pytest.approx(
        dict(CPU=0.211 * 1.01207, GPU=0.0, ANE=0.0), rel=1e-15, abs=0)


def write_zone(root, name, energy_uj, max_uj=2**32 - 1):
    zone = root / name
    zone.mkdir(exist_ok=True)
    (zone / 'energy_uj').write_text(f"{energy_uj}\n")
    (zone / 'max_energy_range_uj').write_text(f"{max_uj}\n")


def test_rapl_counts_each_package_once_across_wraps(tmp_path):
    # two packages; package 0's core part (intel-rapl:0:0) and its second view through MMIO
    # (intel-rapl-mmio:0) are not added again. A counter runs 0..max_energy_range_uj and then 0
    # again: from max - 5 to 10 it moved 5 + 1 + 10 = 16 uJ
    write_zone(tmp_path, 'intel-rapl:0', 100, max_uj=999_999)
    write_zone(tmp_path, 'intel-rapl:0:0', 50)
    write_zone(tmp_path, 'intel-rapl:1', 7000)
    write_zone(tmp_path, 'intel-rapl-mmio:0', 100, max_uj=999_999)
    m = energy.RaplMeter(root=str(tmp_path))
    assert m.name == 'RAPL (2 CPU packages)' and m.joules() == 0.0
    write_zone(tmp_path, 'intel-rapl:0', 999_994, max_uj=999_999)  # +999,894 uJ
    write_zone(tmp_path, 'intel-rapl:1', 9000)                       # +2,000 uJ
    write_zone(tmp_path, 'intel-rapl:0:0', 10**9)
    write_zone(tmp_path, 'intel-rapl-mmio:0', 999_994, max_uj=999_999)
    assert m.joules() == pytest.approx((999_894 + 2000) / 1e6, rel=1e-15)
    write_zone(tmp_path, 'intel-rapl:0', 10, max_uj=999_999)  # wrapped: + 16 uJ
    assert m.joules() == pytest.approx((999_894 + 2000 + 16) / 1e6, rel=1e-15)


def test_rapl_unreadable_is_a_missing_meter(tmp_path, monkeypatch):
    # energy_uj is root's alone on recent kernels: the meter cannot start, and the run's
    # meter says which one is missing and why (the trainer prints it), without stopping
    write_zone(tmp_path, 'intel-rapl:0', 100)
    (tmp_path / 'intel-rapl:0' / 'energy_uj').unlink()
    (tmp_path / 'intel-rapl:0' / 'energy_uj').mkdir()  # (root reads any file: unreadable as a folder)
    with pytest.raises(OSError):
        energy.RaplMeter(root=str(tmp_path))

    class Rapl(energy.RaplMeter):
        def __init__(self):
            super().__init__(root=str(tmp_path))
    monkeypatch.setattr(energy, 'RaplMeter', Rapl)
    m = energy.EnergyMeter({torch.device('cpu')})
    assert m.meters == [] and m.name == 'none' and m.joules() is None
    assert len(m.missing) == 1 and m.missing[0].startswith('Rapl: ') and 'energy_uj' in m.missing[0]


def test_one_meter_per_device(monkeypatch):
    # --device cuda beside --ane_device cuda:0 is one GPU: one NVML meter, not two; cuda:1 is
    # another; the CPU's RAPL meter once; the sum of their joules
    made = []

    class Nvml:
        def __init__(self, index):
            self.index, self.name = index, f'NVML (GPU {index})'
            made.append(index)

        def joules(self):
            return 10.0 * (self.index + 1)

    class Rapl:
        name = 'RAPL (1 CPU packages)'

        def __init__(self):
            made.append('rapl')

        def joules(self):
            return 1.5
    monkeypatch.setattr(energy, 'NvmlMeter', Nvml)
    monkeypatch.setattr(energy, 'RaplMeter', Rapl)
    m = energy.EnergyMeter({torch.device('cuda'), torch.device('cuda', 0), torch.device('cuda', 1),
                            torch.device('cpu')})
    assert sorted(made, key=str) == [0, 1, 'rapl'] and m.joules() == 10.0 + 20.0 + 1.5
    assert m.name == 'NVML (GPU 0) + NVML (GPU 1) + RAPL (1 CPU packages)' and m.missing == []
