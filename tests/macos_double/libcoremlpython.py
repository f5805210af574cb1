"""
The double of coremltools' native module, coremltools.libcoremlpython: the pybind11
bindings of Core ML (coremlpython/CoreMLPython.mm, CoreMLPythonArray.mm and
CoreMLPythonUtils.mm in apple/coremltools, tags 8.3 and 9.0). Its classes and methods are
the ones PYBIND11_PLUGIN(libcoremlpython) declares; each behaviour cites what it follows.
coremltools' Python (CompiledMLModel, MLModel, utils.compile_model, compute_plan) runs
above it unchanged. Core ML itself is imitated by the project's NumPy evaluator of MIL
programs, in its ANE mode (plumbing.programs.numpy_predict(ane=True)); CPU_ONLY runs it plainly.
"""
import collections
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import weakref

import numpy as np


def _macos():
    return tuple(int(v) for v in os.environ.get('MACOS_DOUBLE_VERSION', '15.5').split('.'))


def _note(*words):
    """One line in MACOS_DOUBLE_LOG/coreml.log: what Core ML was asked to do (tests read it)."""
    folder = os.environ.get('MACOS_DOUBLE_LOG')
    if folder:
        with open(os.path.join(folder, 'coreml.log'), 'a') as f:
            f.write(' '.join(str(w) for w in (os.getpid(),) + words) + '\n')


def _nserror(description):
    """A Core ML failure as coremltools raises it: Utils::handleError formats the NSError's
    userInfo with %@, a dictionary over several lines (CoreMLPythonUtils.mm)."""
    return RuntimeError('{\n    NSLocalizedDescription = "' + description + '";\n}')


def _is_compiled_path(path):  # Utils::isCompiledModelPath: the name ends in .mlmodelc
    return path.rstrip('/').endswith('.mlmodelc')


def _compile(source):
    """[MLModel compileModelAtURL:] compiles into a new .mlmodelc under the temporary folder
    and returns it (Model::compileModel); coremltools moves it to a destination itself
    (models/utils.py compile_model: shutil.move). This double's .mlmodelc holds the spec
    (coremldata.bin) and the weights."""
    from coremltools.models import MLModel
    try:
        model = MLModel(source, skip_model_load=True)
        spec = model.get_spec()
    except Exception as e:  # Model::Model's wording for a failed compile
        raise RuntimeError(f'Error compiling model: "{e}".') from None
    name = os.path.basename(source.rstrip('/')).rsplit('.', 1)[0] + '.mlmodelc'
    dest = os.path.join(tempfile.mkdtemp(prefix='coreml-double-'), name)
    os.makedirs(dest)
    if model.weights_dir:
        shutil.copytree(model.weights_dir, os.path.join(dest, 'weights'))
    with open(os.path.join(dest, 'coremldata.bin'), 'wb') as f:
        f.write(spec.SerializeToString())
    _note('compile', source)
    return dest


def _load_program(compiled):
    """The MIL program of a compiled model; a damaged one fails to load as Core ML's does,
    with the error's description (Utils::handleError raises it as a RuntimeError)."""
    from coremltools.converters.mil.frontend.milproto.load import load
    from coremltools.proto import Model_pb2
    try:
        spec = Model_pb2.Model()
        with open(os.path.join(compiled, 'coremldata.bin'), 'rb') as f:
            spec.ParseFromString(f.read())
        return load(spec, specification_version=spec.specificationVersion,
                    file_weights_dir=os.path.join(compiled, 'weights'))
    except Exception as e:
        raise _nserror(f"Error opening the compiled model at {compiled}: {type(e).__name__}") from None


class _LateRelease:
    """Core ML keeps predict's input arrays and releases them about a second later, on its
    own queue, without the GIL (coremltools PRs #2827, #2829). Where that release drops the
    last reference, CPython frees the array off the GIL and the heap is corrupted: the
    double makes that a certain crash (SIGSEGV) instead of a possible one."""

    def __init__(self):
        self.held, self.lock, self.thread = collections.deque(), threading.Lock(), None

    def check_not_held(self, name, a):
        """An object Core ML still holds, passed again: two threads then change its reference
        count, the caller's with the GIL and Core ML's queue without it (PR #2827)."""
        with self.lock:
            if any(a is b for _, arrays in self.held for b in arrays.values()):
                sys.stderr.write(f"macOS double: input {name!r} is still held by Core ML from an earlier call: its "
                                 "reference count races with Core ML's late release (coremltools PR #2827)\n")
                sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGSEGV)

    def hold(self, arrays):
        with self.lock:
            self.held.append((time.monotonic() + 1.0, arrays))
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, daemon=True, name='MLE5ExecutionStream')
                self.thread.start()

    def _run(self):
        while True:
            time.sleep(0.05)
            with self.lock:
                due = []
                while self.held and self.held[0][0] <= time.monotonic():
                    due.append(self.held.popleft()[1])
            for arrays in due:
                names = {k: weakref.ref(a) for k, a in arrays.items()}
                arrays.clear()  # Core ML's release: was it the last reference?
                for name, ref in names.items():
                    if ref() is None:
                        sys.stderr.write(f"macOS double: Core ML released input {name!r} after the caller had freed "
                                         "it: off the GIL that frees it (coremltools PRs #2827, #2829)\n")
                        sys.stderr.flush()
                        os.kill(os.getpid(), signal.SIGSEGV)


_RELEASE = _LateRelease()


class _MLModelProxy:
    """Model in CoreMLPython.mm."""

    def __init__(self, path, compute_units, function_name, optimization_hints, asset=None):
        if asset is not None:
            raise RuntimeError("the macOS double loads models from paths only")
        if compute_units == 'CPU_AND_NE' and _macos() < (13, 0):  # setComputeUnit
            raise RuntimeError("MLComputeUnitsCPUAndNeuralEngine is only available on macOS >= 13.0")
        # a path that is not a .mlmodelc is compiled to a temporary one, deleted with the model
        self.delete = not _is_compiled_path(path)
        self.compiled = _compile(path) if self.delete else path
        self.units, self.last_ns, self.predicts = compute_units, None, 0
        t0 = time.perf_counter_ns()
        self.program = _load_program(self.compiled)
        on_ane = compute_units in ('CPU_AND_NE', 'ALL')
        if on_ane and os.environ.get('MACOS_DOUBLE_FAIL') == 'load':
            raise _nserror(f"Failed to build the model execution plan for the Neural Engine using {self.compiled}: "
                           "the ANE compiler service failed (the double's MACOS_DOUBLE_FAIL=load)")
        from plumbing import programs  # the project's NumPy evaluator stands for Core ML's execution
        self.run = programs.numpy_predict(self.program, ane=on_ane)
        self.load_ns = time.perf_counter_ns() - t0
        _note('load', self.compiled, compute_units)

    def __del__(self):  # ~Model: a model compiled at load deletes its temporary .mlmodelc
        if getattr(self, 'delete', False):
            shutil.rmtree(os.path.dirname(self.compiled), ignore_errors=True)

    def predict(self, data, state=None):
        if state is not None:
            raise RuntimeError("the macOS double has no stateful models")
        if self.units in ('CPU_AND_NE', 'ALL') and os.environ.get('MACOS_DOUBLE_FAIL') == 'sigkill' and not self.predicts:
            os.kill(os.getpid(), signal.SIGKILL)  # coremltools #2758: the load "succeeded"
        self.predicts += 1
        f = self.program.functions['main']
        for name, v in data.items():
            # Utils::dictToFeatures converts every entry; convertValueToArray and
            # PybindCompatibleArray take int32, fp32 or fp64, writeable (mutable_data); anything
            # else is reported as "value type not convertible"
            if not (isinstance(v, np.ndarray) and v.dtype in (np.int32, np.float32, np.float64) and v.flags.writeable):
                print("Error: value type not convertible:")
                print(type(v).__name__, getattr(v, 'dtype', ''), getattr(getattr(v, 'flags', None), 'writeable', ''))
                raise RuntimeError("value type not convertible")
            _RELEASE.check_not_held(name, v)
        held = {}
        for name, var in f.inputs.items():
            if name not in data:  # Core ML checks the inputs against the model's description
                raise _nserror(f"Required input feature not passed to the model: {name}")
            if data[name].shape != tuple(var.shape):
                raise _nserror(f"MultiArray shape {data[name].shape} of input {name} does not match the shape "
                               f"{tuple(var.shape)} specified in the model description")
            held[name] = data[name]  # wrapped without a copy (deallocator:nil)
        t0 = time.perf_counter_ns()
        out = self.run(held)  # converts each input to the program's declared type (fp16)
        self.last_ns = time.perf_counter_ns() - t0
        _RELEASE.hold(held)
        # fp16 outputs come back as new fp32 arrays (CoreMLPythonUtils.mm convertArrayToPython)
        return {k: np.array(v, dtype=np.float32) if v.dtype == np.float16 else np.array(v) for k, v in out.items()}

    def batchPredict(self, batch):
        return [self.predict(d) for d in batch]

    def get_compiled_model_path(self):
        return self.compiled

    def get_load_duration_in_nano_seconds(self):
        return self.load_ns

    def get_last_predict_duration_in_nano_seconds(self):
        return self.last_ns

    @staticmethod
    def compileModel(path):
        if not os.path.exists(path):  # compileModelAtURL's error, through handleError
            raise _nserror(f"no model at {path}")
        return _compile(path)

    @staticmethod
    def maximum_supported_specification_version():  # the SDK's newest, fixed at build time (9.0: macOS 15)
        return 9

    @staticmethod
    def auto_set_specification_version(spec):
        return spec

    @staticmethod
    def get_compute_plan(path, compute_units):
        """Model::getComputePlan: MLComputePlan needs macOS 14.4; its Python objects are
        coremltools' own classes, built as toPythonObject builds them."""
        if _macos() < (14, 4):
            raise RuntimeError("MLComputePlan is only available on macOS >= 14.4")
        from coremltools.models import compute_plan as cp
        program = _load_program(path)
        f = program.functions['main']
        typed = lambda names: [cp.MLModelStructureProgramNamedValueType(n, cp.MLModelStructureProgramValueType())
                               for n in names]
        ops = [cp.MLModelStructureProgramOperation({}, op.op_type, typed(o.name for o in op.outputs), [],
                                                   _MLModelStructureProgramOperationProxy(op.op_type))
               for op in f.operations]
        block = cp.MLModelStructureProgramBlock(typed(f.inputs), ops, [v.name for v in f.outputs])
        structure = cp.MLModelStructure(None, cp.MLModelStructureProgram(
            {'main': cp.MLModelStructureProgramFunction(typed(f.inputs), block)}), None)
        return cp.MLComputePlan(_MLComputePlanProxy(structure, compute_units,
                                                    sum(op.op_type != 'const' for op in f.operations)))

    @staticmethod
    def get_model_structure(path):
        return _MLModelProxy.get_compute_plan(path, 'ALL').model_structure

    @staticmethod
    def get_available_compute_devices():
        return _devices()

    @staticmethod
    def get_all_compute_devices():
        return _devices()

    @staticmethod
    def create_model_asset_from_path(path):
        raise RuntimeError("the macOS double has no model assets")

    @staticmethod
    def create_model_asset_from_memory(spec, blobs):
        raise RuntimeError("the macOS double has no model assets")


def _cpu_ops():
    return {t for t in os.environ.get('MACOS_DOUBLE_CPU_OPS', '').split(',') if t}


class _MLCPUComputeDeviceProxy:
    pass


class _MLGPUComputeDeviceProxy:
    pass


class _MLNeuralEngineComputeDeviceProxy:
    def get_total_core_count(self):
        return 16


def _devices():
    """The compute devices as coremltools' classes (MLComputeDevice needs macOS 14.0)."""
    if _macos() < (14, 0):
        raise RuntimeError("MLComputeDevice is only available on macOS >= 14.0")
    from coremltools.models import compute_device as cd
    return [cd.MLCPUComputeDevice(_MLCPUComputeDeviceProxy()), cd.MLGPUComputeDevice(_MLGPUComputeDeviceProxy()),
            cd.MLNeuralEngineComputeDevice(_MLNeuralEngineComputeDeviceProxy())]


class _MLModelStructureProgramOperationProxy:
    def __init__(self, op_type):
        self.op_type = op_type


class _MLModelStructureNeuralNetworkLayerProxy:
    pass


class _MLComputePlanProxy:
    """ComputePlan: each op's device (MACOS_DOUBLE_CPU_OPS on the CPU, the rest on the
    Neural Engine; CPU_ONLY all on the CPU) and an equal share of the estimated cost."""

    def __init__(self, structure, compute_units, n_ops):
        self.model_structure, self.units, self.n_ops = structure, compute_units, n_ops

    def get_compute_device_usage_for_mlprogram_operation(self, operation):
        from coremltools.models import compute_plan as cp
        op_type = operation.__proxy__.op_type
        if op_type == 'const':
            return None
        cpu, _, ane = _devices()
        on_cpu = self.units == 'CPU_ONLY' or op_type in _cpu_ops()
        return cp.MLComputePlanDeviceUsage(cpu if on_cpu else ane, [cpu] if self.units == 'CPU_ONLY' else [cpu, ane])

    def get_compute_device_usage_for_neuralnetwork_layer(self, layer):
        return None

    def get_estimated_cost_for_mlprogram_operation(self, operation):
        from coremltools.models import compute_plan as cp
        return None if operation.__proxy__.op_type == 'const' else cp.MLComputePlanCost(1.0 / self.n_ops)


class _State:
    pass


class _MLModelAssetProxy:
    pass
