import os
import re
import socket
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
os.environ.setdefault("WANDB_MODE", "offline")  # tests never reach the network
os.environ.setdefault("OMP_NUM_THREADS", "1")  # xdist workers (one per core) and their subprocesses share the cores

# ---- GPU tests: the `gpu` marker, the `device` fixture and the device guard --------------------------------
#
# A test of a GPU path is marked `gpu` and takes the `device` fixture. Where CUDA exists, device is "cuda" and
# the test runs for real (scripts/gpu_check.py selects these tests with `-m gpu`). Elsewhere device is "cpu"
# and the test's body runs on the CPU under DeviceGuard: every tensor that code in tests/ makes without naming
# a device becomes a meta tensor, which no real tensor can be combined with. A test that would build a CPU
# tensor beside its CUDA tensors on a GPU (a gradient probe made with torch.randn and no device, positions
# from torch.arange) therefore fails here too, on a machine without a GPU.

CUDA = torch.cuda.is_available()
# without a GPU, the project's Triton kernels (attention/ops) run on CPU tensors under Triton's interpreter, which
# Triton reads when a kernel is defined: set before any of them is imported, so the tests of the kernels and the
# CPU standing in for CUDA run the kernels' own code
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
FACTORIES = {torch.randn, torch.rand, torch.randint, torch.randperm, torch.zeros, torch.ones, torch.empty,
             torch.full, torch.arange, torch.linspace, torch.logspace, torch.tensor, torch.eye}
_TORCH_DIR = str(Path(torch.__file__).resolve().parent)


def _caller_in_tests() -> bool:
    """Whether the code that called the torch function (past torch's own frames) lies in tests/."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH_DIR):
        frame = frame.f_back
    return frame is not None and Path(frame.f_code.co_filename).resolve().is_relative_to(TESTS)


class DeviceGuard(TorchFunctionMode):
    """Tensors made by tests/ code without a device (or with device=None) are made on the meta device."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None and _caller_in_tests():
            kwargs = {**kwargs, "device": "meta"}
        return func(*args, **kwargs)


# ---- the two tiers: `-m "not e2e"` (unit: no process started) and the rest (end-to-end) ---------------------

_current_item = {"item": None}


def _refuse_processes_outside_e2e() -> None:
    """In the unit tier, starting a process (subprocess or multiprocessing, in a test or a fixture it sets up)
    fails the test that did it: the tier stays fast and stays what it says. torch.compile's own C++ compiler calls
    are not the test's (and depend on inductor's cache)."""
    import multiprocessing.process
    import subprocess
    import traceback

    def guarded(start):
        def start_process(self, *args, **kwargs):
            item = _current_item["item"]
            if item is not None and item.get_closest_marker("e2e") is None and \
                    not any("torch/_inductor/" in frame.filename for frame in traceback.extract_stack()):
                raise RuntimeError(f"{item.nodeid} starts a process: mark it @pytest.mark.e2e (the unit tier, -m "
                                   "'not e2e', starts none)")
            return start(self, *args, **kwargs)
        return start_process

    subprocess.Popen.__init__ = guarded(subprocess.Popen.__init__)
    multiprocessing.process.BaseProcess.start = guarded(multiprocessing.process.BaseProcess.start)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current_item["item"] = item
    yield
    _current_item["item"] = None


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: a test of a GPU path (scripts/gpu_check.py runs them with -m gpu); it "
                                       "takes the device fixture: cuda where CUDA exists, else cpu under the "
                                       "device guard (tests/conftest.py)")
    config.addinivalue_line("markers", "gpu_sim: the CUDA path executed on the CPU (attention/simulate_cuda.py); "
                                       "part of every run of the suite, -m gpu_sim alone")
    config.addinivalue_line("markers", "e2e: starts processes (training runs, command lines, torchrun, worker "
                                       "pools): the end-to-end tier. -m 'not e2e' is the unit tier, where a test "
                                       "that starts a process fails, naming this marker")
    if re.search(r"\bnot e2e\b", config.getoption("markexpr") or ""):
        _refuse_processes_outside_e2e()
    if config.getoption("results_log") and not hasattr(config, "workerinput"):  # the controller writes
        _results_log["path"] = config.getoption("results_log")


# ---- --results-log=PATH: one JSON line per test as it finishes ---------------------------------------------
#
# scripts/gpu_check.py runs the gpu tests under a time limit; pytest's own reports (JUnit) are written at the end,
# so a run killed at its limit would leave nothing. With --results-log the collected ids and then every test's
# outcome are appended as they happen (by the controller under xdist): a killed run leaves what finished.

_results_log = {"path": ""}


def pytest_addoption(parser):
    parser.addoption("--results-log", default="", help="append the collected test ids, then one JSON line per "
                                                       "test as it finishes, to this file")


def _log_result(record: dict) -> None:
    import json

    with open(_results_log["path"], "a") as f:
        f.write(json.dumps(record) + "\n")


def pytest_collection_finish(session):  # without xdist (under xdist the controller collects nothing)
    if _results_log["path"] and session.items:
        _log_result({"collected": [item.nodeid for item in session.items]})


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):  # the controller, once per worker: the same ids
    if _results_log["path"] and not _results_log.get("collected"):
        _results_log["collected"] = True
        _log_result({"collected": list(ids)})


def pytest_runtest_logreport(report):
    if not _results_log["path"] or not (report.when == "call" or report.failed or report.skipped):
        return
    outcome = report.outcome if report.when == "call" else ("error" if report.failed else "skipped")
    message = ""
    if report.failed or report.skipped:
        message = (report.longreprtext.strip().splitlines() or [""])[-1][:500]
    _log_result({"test": report.nodeid, "outcome": outcome, "when": report.when,
                 "seconds": round(report.duration, 2), "message": message})


def pytest_collection_modifyitems(config, items):
    for item in items:  # a gpu test that made its tensors without the device fixture would escape the guard
        if item.get_closest_marker("gpu") and "device" not in getattr(item, "fixturenames", ()):
            raise pytest.UsageError(f"{item.nodeid} is marked gpu but does not take the device fixture")


@pytest.fixture
def device(request):
    """The device of a gpu test: cuda where CUDA exists, else cpu with the device guard on."""
    if request.node.get_closest_marker("gpu") is None:
        raise pytest.UsageError("the device fixture is for tests marked gpu")
    if CUDA:
        yield "cuda"
        return
    with DeviceGuard():
        yield "cpu"


def assert_models_agree_in_bf16(config, reference_config, device, tolerance: float) -> None:
    """Two models with the same weights (one config's GPU kernel, the other's built-in form) give the same loss
    and parameter gradients under bf16 autocast: ||a - b|| / ||b|| <= tolerance for the logits and for every
    gradient, on a batch of 2 x 200 tokens."""
    from model import GPT

    torch.manual_seed(0)
    models = [GPT(config).to(device)]
    models.append(GPT(reference_config).to(device))
    models[1].load_state_dict(models[0].state_dict())
    idx = torch.randint(0, config.vocab_size, (2, 200), generator=generator(1, device), device=device)
    outputs = []
    for model in models:
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            logits, loss = model(idx, idx)
        loss.backward()
        outputs.append([logits.float()] + [p.grad.float() for p in model.parameters()])
    for a, b in zip(*outputs):
        error = ((a - b).norm() / b.norm().clamp(min=1e-12)).item()
        assert error <= tolerance, (tuple(a.shape), error)


def take_ctrl_c():
    """A child's SIGINT as a terminal gives it (Popen's preexec_fn): a test worker may run with SIGINT ignored,
    which its children would inherit, and then a Ctrl-C sent to them would do nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def generator(seed: int, device=None) -> torch.Generator:
    """A seeded generator on device (the CPU's when None): factories given generator= and device= need both to
    be on the same device."""
    return torch.Generator(device=device or "cpu").manual_seed(seed)


def load_script(name: str):
    """The command line scripts.NAME (scripts/NAME.py; NAME may be dotted: bridges.sweep) as a fresh module, to
    call its functions in this process."""
    import importlib.util

    path = REPO / "scripts" / (name.replace(".", "/") + ".py")
    spec = importlib.util.spec_from_file_location(f"scripts.{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses (the scripts' typed configs) look their module up there
    spec.loader.exec_module(module)
    return module


def launcher(processes: int) -> list:
    """python, or torchrun starting that many processes on this machine."""
    return [sys.executable] if processes == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]


def train_subprocess(args, timeout=300, check=True, processes=1):
    """python train.py ARGS as a user runs it, or under torchrun with several processes on this machine."""
    import subprocess

    proc = subprocess.run(launcher(processes) + ["train.py", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def read_metrics(out_dir, key="train_loss") -> dict:
    """{step: value} of one key in a run's metrics.jsonl."""
    import json

    records = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    return {r["step"]: r[key] for r in records if key in r}


def sigterm_after_two_steps(args, out_dir, processes=1):
    """Start python train.py ARGS --out_dir=OUT_DIR (under torchrun with several processes, which passes the
    signal on to them), send SIGTERM once it has logged two steps, and return (returncode, stdout, stderr)
    after it has saved and exited."""
    import signal
    import subprocess
    import time

    proc = subprocess.Popen([*launcher(processes), "train.py", *args, f"--out_dir={out_dir}"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = Path(out_dir) / "metrics.jsonl"
    while not (log.exists() and len(read_metrics(out_dir)) >= 2):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


# ---- no network: the offline fixture (Hugging Face and lm_eval tests) --------------------------------------


@pytest.fixture
def offline(monkeypatch):
    """No network: the hub libraries are told so, and any TCP/UDP connection attempt fails the test."""
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    for attr in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if hasattr(datasets.config, attr):
            monkeypatch.setattr(datasets.config, attr, True)
    attempts = []
    real_connect = socket.socket.connect

    def connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            attempts.append(address)
            raise OSError(f"network access during an offline test: {address}")
        return real_connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    yield
    assert not attempts, f"tried to reach {attempts}"


# ---- small runs and data several test modules check against --------------------------------------------------

TINY = ["configs/quickstart.py", "--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=4",
        "--eval_iters=2", "--log_interval=1", "--warmup_iters=2"]


def run_python(command, *args, timeout=300):
    """python COMMAND ARGS in the repository, its output captured."""
    return subprocess.run([sys.executable, *command, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


# ---- entry points run in the test's own process ------------------------------------------------------------
#
# Starting python costs far more than a tiny run (importing torch and the project takes 10-30 s on a busy
# 2-core machine). Where the process itself is not what a test checks (signals, kills, torchrun, a fresh
# interpreter's imports or environment), the command runs in the test's process instead, as `python COMMAND
# ARGS` runs it: its file or module executed as __main__ (runpy: the same `if __name__ == "__main__"` block)
# from the repository with that sys.argv, one torch thread per OMP_NUM_THREADS, a fresh interpreter's warning
# filters and empty compiler caches, its stdout and stderr captured at the file descriptors (torch's C++
# messages too), its exit status from SystemExit (an uncaught exception: its traceback on stderr and status 1).
# What it registered to run at exit runs as it ends (a run folder's lock is released then), and what it changed in
# the process is put back: the environment (train.py sets OMP_WAIT_POLICY, which later subprocesses would
# inherit), signal handlers, RNG states, logging handlers, a process group left open.

# a fresh interpreter's warning filters (python -W and PYTHONWARNINGS aside)
FRESH_WARNING_FILTERS = [("default", None, DeprecationWarning, "__main__", 0),
                         ("ignore", None, DeprecationWarning, None, 0),
                         ("ignore", None, PendingDeprecationWarning, None, 0),
                         ("ignore", None, ImportWarning, None, 0), ("ignore", None, ResourceWarning, None, 0)]


class _Captured:
    """stdout and stderr of this process redirected, at the file descriptors, into two temporary files; .text
    holds what was written once the block ends."""

    def __enter__(self):
        import io
        import tempfile

        sys.stdout.flush()
        sys.stderr.flush()
        self.files = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
        self.saved_fds = [os.dup(1), os.dup(2)]
        self.saved_streams = sys.stdout, sys.stderr
        for fd, f in zip((1, 2), self.files):
            os.dup2(f.fileno(), fd)
        # unbuffered writers on the descriptors: Python's and C's writes land in the order they are made
        sys.stdout, sys.stderr = (io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8",
                                                   errors="backslashreplace", write_through=True) for fd in (1, 2))
        # logging handlers made earlier in this process (a library's, at its import) write to the streams of that
        # time: pointed at the new ones meanwhile, so that what a fresh process would print is captured too
        import logging

        self.handlers = []
        streams = {id(self.saved_streams[0]): sys.stdout, id(sys.__stdout__): sys.stdout,
                   id(self.saved_streams[1]): sys.stderr, id(sys.__stderr__): sys.stderr}
        loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
        for handler in {h for logger in loggers for h in getattr(logger, "handlers", ())}:
            if isinstance(handler, logging.StreamHandler) and id(getattr(handler, "stream", None)) in streams:
                self.handlers.append((handler, handler.setStream(streams[id(handler.stream)])))
        return self

    def __exit__(self, *exc):
        for handler, stream in self.handlers:
            handler.setStream(stream)
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = self.saved_streams
        for fd, saved in zip((1, 2), self.saved_fds):
            os.dup2(saved, fd)
            os.close(saved)
        self.text = []
        for f in self.files:
            f.seek(0)
            self.text.append(f.read().decode("utf-8", errors="replace"))
            f.close()


class _FreshProcessState:
    """The process as a fresh `python` has it for the command (cwd, sys.argv, threads, dtype, warnings, compiler
    caches), and on exit as it was before (with what the command changed undone)."""

    def __enter__(self):
        import logging
        import random
        import warnings

        import numpy as np

        self.cwd, self.sys_argv, self.environ = os.getcwd(), sys.argv, dict(os.environ)
        self.handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        self.wakeup_fd = signal.set_wakeup_fd(-1)
        signal.set_wakeup_fd(self.wakeup_fd)
        self.rng = torch.get_rng_state(), random.getstate(), np.random.get_state()
        self.threads, self.dtype = torch.get_num_threads(), torch.get_default_dtype()
        self.grad = torch.is_grad_enabled()
        root = logging.getLogger()
        self.logging = root.handlers[:], root.level
        self.warnings = warnings.catch_warnings()
        self.warnings.__enter__()
        warnings.filters[:] = FRESH_WARNING_FILTERS
        warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: sys.stderr.write(
            warnings.formatwarning(message, category, filename, lineno, line))
        os.chdir(REPO)
        if os.environ.get("OMP_NUM_THREADS", "").isdigit():
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
        torch._dynamo.reset()  # compiled code and recompile counts of earlier tests: a fresh process has none
        # what the project's code registers to run at exit (a run folder's lock released, a folder the run made
        # and never wrote into removed) runs when the command ends, as at its process's exit
        import atexit

        self.at_exit, self.register = [], atexit.register

        def register(function, *args, **kwargs):
            caller = Path(sys._getframe(1).f_code.co_filename).resolve()
            if not caller.is_relative_to(REPO) or "site-packages" in caller.parts:
                return self.register(function, *args, **kwargs)
            self.at_exit.append((function, args, kwargs))
            return function

        atexit.register = register
        return self

    def __exit__(self, *exc):
        import atexit
        import logging
        import random
        import traceback

        import numpy as np
        import torch.distributed as dist

        atexit.register = self.register
        for function, args, kwargs in reversed(self.at_exit):
            try:
                function(*args, **kwargs)
            except Exception:  # noqa: BLE001 - said, as the interpreter says it at exit
                print(f"Exception ignored in atexit callback {function!r}:", file=sys.stderr)
                traceback.print_exc(file=sys.stderr)
        if dist.is_available() and dist.is_initialized():  # a run that exited between set-up and its end
            dist.destroy_process_group()
        torch._dynamo.reset()
        self.warnings.__exit__(*exc)
        root = logging.getLogger()
        root.handlers[:], root.level = self.logging
        torch.set_grad_enabled(self.grad)
        torch.set_default_dtype(self.dtype)
        torch.set_num_threads(self.threads)
        torch.set_rng_state(self.rng[0])
        random.setstate(self.rng[1])
        np.random.set_state(self.rng[2])
        # a training run's stop-signal watcher thread stays blocked on its own pipe, which no signal reaches now
        signal.set_wakeup_fd(self.wakeup_fd)
        for signum, handler in self.handlers.items():
            signal.signal(signum, handler)
        os.environ.clear()
        os.environ.update(self.environ)
        sys.argv = self.sys_argv
        os.chdir(self.cwd)


def run_in_process(command, *args) -> subprocess.CompletedProcess:
    """`python COMMAND ARGS` (COMMAND a file, ["train.py"], or a module, ["-m", "eval"]) run in this process (see
    above): its return code, stdout and stderr as run_python gives them."""
    import runpy
    import traceback
    import warnings

    with _Captured() as captured, _FreshProcessState():
        try:
            if command[0] == "-m":
                sys.argv = ["-m", *command[2:], *args]  # runpy puts the module's path first, as python -m does
                # a module this process imported before: runpy warns, which python -m (importing it first) never does
                warnings.filterwarnings("ignore", r".* found in sys\.modules after import of package", RuntimeWarning)
                runpy.run_module(command[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = [*command, *args]
                runpy.run_path(command[0], run_name="__main__")
            status = 0
        except SystemExit as e:
            status = e.code
            if status is not None and not isinstance(status, int):  # sys.exit("message"): said, status 1
                print(status, file=sys.stderr)
                status = 1
        except Exception:  # noqa: BLE001 - as the interpreter ends on it
            traceback.print_exc(file=sys.stderr)
            status = 1
    return subprocess.CompletedProcess([sys.executable, *command, *args], status or 0, *captured.text)


@pytest.fixture
def python_children_in_process(monkeypatch):
    """A tool under test that runs `python COMMAND ...` with subprocess.run (a sweep's training runs, evaluations
    and comparison) has that command run in this process (run_in_process) and gets back what subprocess.run
    gives: the exit status (CalledProcessError with check=True), the output captured with capture_output=True
    (text or bytes), else written on as a child's would be. Calls with other arguments (env, stdin, input, ...),
    another working directory or another program start their process as before."""
    real, handled = subprocess.run, {"cwd", "check", "capture_output", "text", "timeout"}

    def python_here(command, args, kwargs) -> bool:
        return (not args and not set(kwargs) - handled and isinstance(command, (list, tuple)) and len(command) > 1
                and command[0] == sys.executable and (command[1] == "-m" or str(command[1]).endswith(".py"))
                and Path(kwargs.get("cwd") or os.getcwd()).resolve() == REPO)

    def run(command, *args, **kwargs):
        if not python_here(command, args, kwargs):
            return real(command, *args, **kwargs)
        proc = run_in_process([str(part) for part in command[1:]])
        if not kwargs.get("capture_output"):
            sys.stdout.write(proc.stdout)
            sys.stderr.write(proc.stderr)
            proc.stdout = proc.stderr = None
        elif not kwargs.get("text"):
            proc.stdout, proc.stderr = proc.stdout.encode(), proc.stderr.encode()
        proc.args = command
        if kwargs.get("check"):
            proc.check_returncode()
        return proc

    monkeypatch.setattr(subprocess, "run", run)


def train_in_process(args, check=True):
    """python train.py ARGS in this process (run_in_process): the run train_subprocess starts, without starting
    python."""
    proc = run_in_process(["train.py"], *args)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """Text, two different BPE tokenizer.json files (300 tokens each) and data prepared with the first."""
    from data.embedded import documents
    from data.prepare import prepare
    from scripts.gpucheck import tiny_hf

    root = tmp_path_factory.mktemp("bpe")
    text = "\n\n".join(documents(40, seed=0))
    (root / "corpus.txt").write_text(text)
    make = tiny_hf.train_byte_bpe_tokenizer
    (root / "a").mkdir()
    (root / "b").mkdir()
    make(text, root / "a" / "tokenizer.json")
    make(text.upper(), root / "b" / "tokenizer.json")  # the same size, other tokens
    prepare(str(root / "corpus.txt"), tokenizer=str(root / "a" / "tokenizer.json"), out_dir=str(root / "data_a"),
            val_fraction=0.2, num_proc=1, quiet=True)
    return root


@pytest.fixture(scope="module")
def byte_run(tmp_path_factory):
    """A tiny run trained on the embedded corpus (byte tokenizer), with checkpoints at steps 4 and 8."""
    out = tmp_path_factory.mktemp("byte_run") / "run"
    train_in_process([*TINY, f"--out_dir={out}", "--max_iters=8", "--eval_interval=4"])
    return out
