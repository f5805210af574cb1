"""
A double of macOS for the tests: only what Linux lacks, installed in every Python process
that has this folder on PYTHONPATH and HETERO_MACOS_DOUBLE=1 (spawned children included,
since they inherit both).

- The OS identity: sys.platform 'darwin' (what coremltools' models/utils.py _is_macos and
  _deps/__init__.py, the project's settings.ON_MAC and multiprocessing read),
  platform.mac_ver() (coremltools' _deps reads the version there), sw_vers (utils.py
  _macos_version runs `sw_vers -productVersion`) and sysctl on PATH.
- Core ML's native runtime under coremltools: the module coremltools.libcoremlpython
  (libcoremlpython.py beside this file). coremltools' own Python runs above it unchanged.
- powermetrics and sudo on PATH (bin/); system_profiler's GPU and pmset's power source.
- The machine's memory, as hw.memsize (bin/sysctl) and as os.sysconf's pages.
- ctypes.macholib where this Python lacks it (MacholibFallback).
- PyTorch's MPS backend, installed once torch is imported (torch_mps.py): the GPU engine on the CPU.

Switches, all environment variables:
  MACOS_DOUBLE_VERSION   the macOS version (default 15.5)
  MACOS_DOUBLE_MACHINE   arm64 (default) or x86_64 (an Intel Mac)
  MACOS_DOUBLE_ROSETTA   1: with x86_64, an Apple Silicon Mac running this Python under Rosetta
  MACOS_DOUBLE_NATIVE    0: no libcoremlpython, as coremltools installed from its sdist
  MACOS_DOUBLE_CPU_OPS   op types the compute plan puts on the CPU, comma-separated, besides
                         those the ANE has no unit for (gather, scatter, one_hot)
  MACOS_DOUBLE_FAIL      load: the Neural Engine compile fails at load with an exception;
                         sigkill: the load succeeds and the first predict kills the process
  MACOS_DOUBLE_LOAD_SECONDS  seconds each Neural Engine load takes (its compile)
  MACOS_DOUBLE_ANE_FALLBACK  1: a Neural Engine load runs the program on the CPU, silently;
                         hidden: the same, but the compute plan still says the Neural Engine
  MACOS_DOUBLE_CPU_SLOWDOWN  a program on the CPU predicts this many times slower (default 1)
  MACOS_DOUBLE_SUDO      1: sudo -n has rights (default: none, as on most Macs)
  MACOS_DOUBLE_SUDO_TS   a folder: sudo's tickets (`sudo -v`), each its terminal's (bin/sudo)
  MACOS_DOUBLE_SUDO_RELAY  old: sudo 1.9.12's signal relay rule; new (default): 1.9.13's
  MACOS_DOUBLE_MEMORY    GiB of memory (default: this machine's), e.g. 16 for a 16 GB Mac
  MACOS_DOUBLE_WATTS     CPU,GPU,ANE milliwatts powermetrics reports (default 3000,9000,1500)
  MACOS_DOUBLE_GPU_CORES the GPU cores system_profiler reports (default 20, an M4 Pro's)
  MACOS_DOUBLE_POWER     ac (default) or battery: what pmset -g batt says it draws from
  MACOS_DOUBLE_LOG       a folder: the double notes compiles, loads and powermetrics there
  MACOS_DOUBLE_MPS       0: no MPS (torch.backends.mps.is_available() False, as on Linux)
  MACOS_DOUBLE_MPS_COPY  retain: non-blocking copies keep their source (the fixed Copy.mm)
  MACOS_DOUBLE_ANE_LUT   knots (default) or hash: the tables' error shape (plumbing/programs.py)
  MACOS_DOUBLE_ANE_LUT_BIAS  a bias of one sign on every table (default 0)
  MACOS_DOUBLE_ANE_SUBNORMALS  matmul (default, M1), keep (M5) or all
  MACOS_DOUBLE_ANE_NAN   engine (default, M1: NaN in is +65504, NaN out is +0) or ieee
  MACOS_DOUBLE_MPS_SLOW  seconds of GPU work each backward pass on 'mps' queues; the next op or read
                         in any thread waits for it, deaf to signals as Metal's wait is
  MACOS_DOUBLE_MPS_SDPA  leaky: fp16/bf16 causal attention masked per group of four queries
                         (pytorch #195910; the default before torch 2.14); exact: never
"""
import importlib.abc
import importlib.machinery
import importlib.util
import os
import platform
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


class NativeFinder(importlib.abc.MetaPathFinder):
    """Serves coremltools.libcoremlpython from libcoremlpython.py here: Linux wheels of
    coremltools ship libmilstoragepython and libmodelpackage but not the Core ML bindings."""

    def find_spec(self, name, path=None, target=None):
        if name == 'coremltools.libcoremlpython':
            return importlib.util.spec_from_file_location(name, os.path.join(HERE, 'libcoremlpython.py'))
        return None


class AfterTorch(importlib.abc.MetaPathFinder):
    """Imports torch as usual, then installs the MPS double on it (torch_mps.py)."""

    def find_spec(self, name, path=None, target=None):
        if name != 'torch':
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            import torch_mps
            torch_mps.install()
        spec.loader.exec_module = exec_module
        return spec


class MacholibFallback(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """ctypes.macholib.dyld, where this Python lacks it: ctypes.util imports it when
    sys.platform is darwin, and Debian and Ubuntu leave it out of their Python. Last on
    sys.meta_path, so a Python that has the real one uses it."""

    def find_spec(self, name, path=None, target=None):
        if name in ('ctypes.macholib', 'ctypes.macholib.dyld'):
            return importlib.machinery.ModuleSpec(name, self, is_package=name == 'ctypes.macholib')
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        if module.__name__ == 'ctypes.macholib.dyld':
            module.dyld_find = dyld_find


def dyld_find(name, executable_path=None, env=None):
    """dyld's search on this file system, as the real ctypes.macholib.dyld does it: the name,
    DYLD_LIBRARY_PATH, then DYLD_FALLBACK_LIBRARY_PATH or its default (dyld(1)); frameworks
    in DYLD_FRAMEWORK_PATH and the framework folders. ValueError where none has it."""
    env = os.environ if env is None else env
    paths = lambda key, default=(): [p for p in env.get(key, '').split(':') if p] or list(default)
    home = os.path.expanduser('~')
    libraries = paths('DYLD_LIBRARY_PATH') + paths(
        'DYLD_FALLBACK_LIBRARY_PATH', [f'{home}/lib', '/usr/local/lib', '/lib', '/usr/lib'])
    places = [name] + [os.path.join(d, os.path.basename(name)) for d in libraries]
    if '.framework/' in name:
        frameworks = paths('DYLD_FRAMEWORK_PATH') + paths('DYLD_FALLBACK_FRAMEWORK_PATH', [
            f'{home}/Library/Frameworks', '/Library/Frameworks', '/Network/Library/Frameworks',
            '/System/Library/Frameworks'])
        places += [os.path.join(d, name) for d in frameworks]
    for place in places:
        if os.path.isfile(place):
            return place
    raise ValueError(f"dylib {name} could not be found")


def with_memory(sysconf, memory):
    """os.sysconf whose physical pages make `memory` bytes. The page size stays the kernel's
    (Apple Silicon's is 16 KiB), since /proc's counts of pages use it."""
    pages = memory // sysconf('SC_PAGE_SIZE')

    def patched(name):
        if name in ('SC_PHYS_PAGES', os.sysconf_names['SC_PHYS_PAGES']):
            return pages
        return sysconf(name)
    return patched


def install():
    # Two stdlib modules load macOS-only parts when sys.platform is darwin: urllib.request
    # (_scproxy) and sysconfig (_sysconfigdata__darwin_*); load them under the real identity
    import sysconfig
    import urllib.request  # noqa: F401
    sysconfig.get_config_vars()
    sys.platform = 'darwin'
    version, machine = os.environ.get('MACOS_DOUBLE_VERSION', '15.5'), os.environ.get('MACOS_DOUBLE_MACHINE', 'arm64')
    platform.mac_ver = lambda release='', versioninfo=('', '', ''), machine_='': (version, ('', '', ''), machine)
    bin_dir = os.path.join(HERE, 'bin')
    if not os.environ['PATH'].startswith(bin_dir + os.pathsep):
        os.environ['PATH'] = bin_dir + os.pathsep + os.environ['PATH']
    if os.environ.get('MACOS_DOUBLE_MEMORY'):
        os.sysconf = with_memory(os.sysconf, int(float(os.environ['MACOS_DOUBLE_MEMORY']) * 2**30))
    sys.meta_path.append(MacholibFallback())
    if os.environ.get('MACOS_DOUBLE_NATIVE', '1') == '1':
        sys.meta_path.insert(0, NativeFinder())
    if os.environ.get('MACOS_DOUBLE_MPS', '1') == '1':
        sys.meta_path.insert(0, AfterTorch())


if os.environ.get('HETERO_MACOS_DOUBLE') == '1':
    install()
