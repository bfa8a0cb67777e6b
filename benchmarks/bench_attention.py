"""The asv suite: a thin view over the attnbench registry, not a second harness.

Every benchmark builds the same :class:`attnbench.runner.workload.Workload` that ``attnbench run`` times, so
the implementations (and their history) live in the package; editing this file does not reset it.

Nothing here runs a torch kernel or touches CUDA at import: ``asv.conf.json`` uses the forkserver
launch method, which imports this module once and forks a child per benchmark and parameter set, and
neither OpenMP thread pools nor a CUDA context survive a fork. Probes and availability checks that
execute kernels happen in ``setup`` (in the child).

asv's ``peakmem_`` benchmarks are not used: they report the process's peak RSS, which is dominated by
the torch import and the CPU allocator's caching, not by the attention's tensors.
``track_peak_bytes`` reports the tensor memory of one step instead (:func:`attnbench.measure.peak_memory`).

Module-level names must not start with ``time_``/``track_``/``mem_``/``peakmem_``: asv would collect them.

The measuring environment is ``attnbench run``'s (:mod:`attnbench.measure.cpu_env`): OpenMP binding set
here before torch loads OpenMP (unless the caller set those variables, as the gate does), and glibc's
malloc thresholds pinned with ``mallopt`` in every benchmark process (``ATTNBENCH_ASV_ALLOCATOR=system``
leaves glibc alone). asv.conf.json cannot carry environment variables for an ``existing`` environment.

Every benchmark holds the machine's measurement lock (:mod:`attnbench.measure.machine_lock`) from the end of
``setup`` to ``teardown``, so it never times next to an ``attnbench run`` (it waits; asv's ``timeout`` counts the
wait). Under the asv gate, which holds the lock for its whole measurement, the benchmarks measure under the gate's.
"""

from __future__ import annotations

import os
import shutil
import tempfile

# Before torch (and so OpenMP) loads; the same values as attnbench.measure.cpu_env.OMP_BINDING (a test checks).
OMP_BINDING = {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores", "OMP_WAIT_POLICY": "active"}
for _key, _value in OMP_BINDING.items():
    os.environ.setdefault(_key, _value)

import torch  # noqa: E402
import torch._inductor  # noqa: E402, F401  (imported once in the forkserver: the profiler and compile import it lazily, 3-5 s)

from attnbench import measure, registry  # noqa: E402

try:  # the layout since the architecture move
    from attnbench.results.schema import Cell
    from attnbench.runner.cell import run_cell, skip_reason
    from attnbench.runner.sweep import Settings
    from attnbench.runner.workload import build_workload
except ImportError:  # older commits, which the asv gate benchmarks with today's suite
    from attnbench.cell import run_cell, skip_reason
    from attnbench.schema import Cell
    from attnbench.sweep import Settings
    from attnbench.workload import build_workload
try:
    from attnbench.measure.cpu_env import pin_glibc_malloc
except ImportError:  # commits before the controlled environment: the gate pins malloc through the environment

    def pin_glibc_malloc() -> bool:
        return False


try:  # the machine's measurement lock (since attnbench.measure.machine_lock)
    from attnbench.measure import machine_lock as _machine_lock
except ImportError:  # older commits: the asv gate holds the lock around them
    _machine_lock = None


def _lock_machine():
    """Take this machine's measurement lock for the benchmark's timing (None on commits without it)."""
    return _machine_lock.acquire([DEVICE], purpose="asv benchmark") if _machine_lock is not None else None


def _unlock_machine(held) -> None:
    if held is not None:
        held.release()


try:  # one resolver decides what can run (since attnbench.resolve); given names through the registry's (every
    from attnbench.registry import resolve  # commit with attnbench.resolve re-exports it there)
except ImportError:  # older commits: the cell module's own check
    resolve = None


def _skip_reason(cell) -> str | None:
    """Why ``cell`` cannot run here, or None (metadata and, on CUDA, PyTorch's SDPA checks: call it in setup)."""
    return resolve(cell.impl, cell).reason if resolve is not None else skip_reason(cell)


DEVICE = os.environ.get("ATTNBENCH_ASV_DEVICE", "cpu")
# One intra-op thread by default: on a shared or busy machine (CI) OpenMP threads contending for cores
# make CPU timings 10-50x slower and wildly noisy. ATTNBENCH_ASV_THREADS=N sets N; 0 keeps torch's default.
THREADS = int(os.environ.get("ATTNBENCH_ASV_THREADS", "1"))
BATCH, HEADS = 2, 4
MODES = ("inference", "forward", "forward+backward")
SEQ_LENS = (64, 256)
D_MODELS = (256,)
COMPILED = "compiled:sdpa"  # the one compiled implementation: compiling costs seconds per shape


ALLOCATOR = os.environ.get("ATTNBENCH_ASV_ALLOCATOR", "pinned")


def _set_threads() -> None:
    """Called in setup (in the forked child), never at import: threads, and the pinned malloc thresholds."""
    if THREADS > 0:
        torch.set_num_threads(THREADS)
    if ALLOCATOR == "pinned":
        pin_glibc_malloc()


def _builtins(device: str) -> list[str]:
    """Built-in multi-head implementations that declare ``device`` (metadata only: probes run later, in setup).

    The variant implementations (GQA, KV caches, the rope family, variable-length batches) are tracked by :class:`GQA`,
    :class:`Decode`, :class:`Rope` and :class:`Varlen` only,
    which keeps this grid small."""
    kind = device.split(":")[0]
    return [n for n in registry.names() if registry.get(n).origin == "builtin" and kind in registry.get(n).devices
            and not (getattr(registry.get(n), "gqa", False) or getattr(registry.get(n), "kv_cache", False)
                     or getattr(registry.get(n), "varlen", False))]


def _prepare(**cell_axes):
    """The cell's workload after its first call; NotImplementedError (asv's skip) when it cannot run here."""
    try:
        cell = Cell(device=DEVICE, batch=BATCH, num_heads=HEADS, **cell_axes)
    except TypeError as exc:  # a commit older than the axis (e.g. num_kv_heads): nothing to measure there
        raise NotImplementedError(f"this commit's Cell has no such axis: {exc}") from exc
    reason = _skip_reason(cell)
    if reason:
        raise NotImplementedError(reason)  # asv's way to skip a combination
    try:
        workload = build_workload(cell)
        workload.step()  # first call outside the timings (lazy init, kernel selection)
    except NotImplementedError as exc:  # from torch: a failure to report, not a combination to skip
        raise RuntimeError(f"{cell.cell_id}: {type(exc).__name__}: {exc}") from exc
    return workload


class Attention:
    """One step of each built-in implementation, per mode, sequence length and width."""

    params = (_builtins(DEVICE), list(MODES), list(SEQ_LENS), list(D_MODELS))
    param_names = ("impl", "mode", "seq_len", "d_model")
    # asv's timer: a few short repeats per round are plenty for millisecond steps on 2 cores
    number = 0  # calibrate calls per sample to sample_time
    sample_time = 0.01
    repeat = (5, 20, 2.0)  # (min, max, max seconds)
    rounds = 2
    warmup_time = 0.05
    min_run_count = 2
    timeout = 120

    def setup(self, impl, mode, seq_len, d_model):
        _set_threads()
        self.workload = _prepare(impl=impl, seq_len=seq_len, d_model=d_model, mode=mode)
        self.cell = self.workload.cell
        self._held = _lock_machine()

    def teardown(self, impl, mode, seq_len, d_model):
        _unlock_machine(getattr(self, "_held", None))

    def time_step(self, impl, mode, seq_len, d_model):
        self.workload.step()
        if self.workload.device.type == "cuda":
            torch.cuda.synchronize(self.workload.device)

    def track_peak_bytes(self, impl, mode, seq_len, d_model):
        return measure.peak_memory(self.workload.step, self.workload.device).peak_bytes

    track_peak_bytes.unit = "bytes"

    def track_gflops(self, impl, mode, seq_len, d_model):
        """Useful GFLOP/s (analytic causal FLOP model / median step time). Higher is better."""
        timing = measure.time_fn(self.workload.step, self.workload.device, warmup_calls=1, warmup_s=0.0,
                                 budget_s=0.2, min_samples=5, target_rel_ci=0.05)
        flops = measure.analytic_flops(BATCH, seq_len, d_model, d_model, mode)
        return flops / timing.stats()["median_s"] / 1e9

    track_gflops.unit = "GFLOP/s"


class _Timer:
    """asv's timer settings of :class:`Attention`, shared by the variant benchmarks (no benchmark itself)."""

    number = Attention.number
    sample_time = Attention.sample_time
    repeat = Attention.repeat
    rounds = Attention.rounds
    warmup_time = Attention.warmup_time
    min_run_count = Attention.min_run_count
    timeout = Attention.timeout


def _step(workload) -> None:
    """One timed step (synchronised on CUDA)."""
    workload.step()
    if workload.device.type == "cuda":
        torch.cuda.synchronize(workload.device)


class GQA(_Timer):
    """Grouped-query attention through SDPA's enable_gqa (inference), MQA and GQA against MHA."""

    params = (["sdpa_gqa"], [1, 2, 4], [256])
    param_names = ("impl", "num_kv_heads", "seq_len")
    mode = "inference"

    def setup(self, impl, num_kv_heads, seq_len):
        _set_threads()
        self.workload = _prepare(impl=impl, seq_len=seq_len, d_model=256, mode=self.mode, num_kv_heads=num_kv_heads)
        self._held = _lock_machine()

    def teardown(self, impl, num_kv_heads, seq_len):
        _unlock_machine(getattr(self, "_held", None))

    def time_step(self, impl, num_kv_heads, seq_len):
        _step(self.workload)


class Decode(GQA):
    """One decode step (a new token against seq_len cached ones) of a KV cache, the cache's bytes, and the step's
    memory bandwidth (a decode step is bound by memory)."""

    params = (["kv_prealloc"], [2], [512])
    mode = "decode"

    def track_kv_cache_bytes(self, impl, num_kv_heads, seq_len):
        return self.workload.kv_cache_bytes

    track_kv_cache_bytes.unit = "bytes"

    def track_gbytes_per_s(self, impl, num_kv_heads, seq_len):
        """GB/s: the bytes one step must read (KV cache + projection weights, measure.decode_bytes) / median step
        time. Higher is better. The cache is restored outside the timed region for classes without rewind_cache."""
        if not hasattr(measure, "decode_bytes"):  # commits before the bandwidth model
            raise NotImplementedError("this commit has no decode bytes model")
        w = self.workload
        timing = measure.time_fn(getattr(w, "timed_step", None) or w.step, w.device, warmup_calls=1, warmup_s=0.0,
                                 budget_s=0.2, min_samples=5, target_rel_ci=0.05, between=getattr(w, "restore", None))
        read = measure.decode_bytes(BATCH, seq_len, 256, 256, num_heads=HEADS, num_kv_heads=num_kv_heads,
                                    element_bytes=w.x.element_size())
        return read / timing.stats()["median_s"] / 1e9

    track_gbytes_per_s.unit = "GB/s"

    def track_frac_peak_bw(self, impl, num_kv_heads, seq_len):
        """The fraction of the machine's measured STREAM-like bandwidth peak that track_gbytes_per_s reaches."""
        if not hasattr(measure, "peak_gbytes_per_s"):
            raise NotImplementedError("this commit has no bandwidth peak")
        return self.track_gbytes_per_s(impl, num_kv_heads, seq_len) / measure.peak_gbytes_per_s(str(self.workload.device))

    track_frac_peak_bw.unit = "fraction"


class PagedDecode(_Timer):
    """Issue 37: one decode step through a paged KV cache (pages shuffled in one pool, a block table per sequence)
    beside the contiguous sdpa_cache at the same shape, per page size; the cache's bytes and pages tracked too."""

    params = (["sdpa_cache", "paged_sdpa"], [16, 256], [512])
    param_names = ("impl", "page_size", "seq_len")

    def setup(self, impl, page_size, seq_len):
        _set_threads()
        self.workload = _prepare(impl=impl, seq_len=seq_len, d_model=256, mode="decode", num_kv_heads=2,
                                 page_size=page_size)
        self._held = _lock_machine()

    def teardown(self, impl, page_size, seq_len):
        _unlock_machine(getattr(self, "_held", None))

    def time_step(self, impl, page_size, seq_len):
        _step(self.workload)

    def track_kv_cache_bytes(self, impl, page_size, seq_len):
        return self.workload.kv_cache_bytes

    track_kv_cache_bytes.unit = "bytes"


class Rope(_Timer):
    """The rope family (issue 26) as a Llama-3-style layer: GQA with RoPE (base 500000, Llama-3 scaling) and per-head
    QK-norm, a prefill (inference) and one decode step; the decode cell also tracks its cache's bytes."""

    params = (["rope_sdpa", "rope_math"], ["inference", "decode"], [256])
    param_names = ("impl", "mode", "seq_len")
    positional = "rope_theta=500000;rope_scaling=llama3;qk_norm=head"

    def setup(self, impl, mode, seq_len):
        _set_threads()
        self.workload = _prepare(impl=impl, seq_len=seq_len, d_model=256, mode=mode, num_kv_heads=2,
                                 positional=self.positional)
        self._held = _lock_machine()

    def teardown(self, impl, mode, seq_len):
        _unlock_machine(getattr(self, "_held", None))

    def time_step(self, impl, mode, seq_len):
        _step(self.workload)



class Masks(_Timer):
    """The mask collection (issue 37): ALiBi, and documents with attention sinks, in eager math and in SDPA with an
    explicit bias (inference; the setup step, building the mask, is inside the timed forward as a model does it)."""

    params = (["mask_math", "mask_sdpa"], ["alibi", "document:8+sink"], [256])
    param_names = ("impl", "mask", "seq_len")

    def setup(self, impl, mask, seq_len):
        _set_threads()
        self.workload = _prepare(impl=impl, seq_len=seq_len, d_model=256, mode="inference", mask=mask)
        self._held = _lock_machine()

    def teardown(self, impl, mask, seq_len):
        _unlock_machine(getattr(self, "_held", None))

    def time_step(self, impl, mask, seq_len):
        _step(self.workload)


class RopeCache:
    """The bytes of the rope family's KV cache after a prefill of ``seq_len`` tokens (the decode cell of :class:`Rope`;
    a class of its own, since asv counts a benchmark that raises for some parameters as failed)."""

    params = (["rope_sdpa", "rope_math"], [256])
    param_names = ("impl", "seq_len")

    def setup(self, impl, seq_len):
        _set_threads()
        self.workload = _prepare(impl=impl, seq_len=seq_len, d_model=256, mode="decode", num_kv_heads=2,
                                 positional=Rope.positional)

    def track_kv_cache_bytes(self, impl, seq_len):
        return self.workload.kv_cache_bytes

    track_kv_cache_bytes.unit = "bytes"


class Compile:
    """Seconds ``torch.compile`` adds to the first call of one tiny compiled cell, with cold on-disk caches.

    Inductor caches compiled graphs under ``TORCHINDUCTOR_CACHE_DIR``; a warm cache would make the number
    depend on what ran before (about 3x less when warm), so each measurement gets an empty one.
    """

    timeout = 300
    rounds = 1

    def setup(self):
        self._previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        self._cache = tempfile.mkdtemp(prefix="attnbench-asv-inductor-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = self._cache  # read at compile time, in this (forked) process
        self._held = _lock_machine()

    def teardown(self):
        _unlock_machine(getattr(self, "_held", None))
        if self._previous is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = self._previous
        shutil.rmtree(self._cache, ignore_errors=True)

    def track_compile_s(self):
        cell = Cell(impl=COMPILED, device=DEVICE, batch=1, seq_len=32, num_heads=2, d_model=64, mode="inference")
        row = run_cell(cell, Settings(budget_s=0.05, min_samples=3, warmup_calls=1, warmup_s=0.0, flop_check=False,
                                      threads=THREADS or None))
        if row["status"] == "skipped":
            raise NotImplementedError(row["error"])
        if row["status"] != "ok":
            raise RuntimeError(f"{COMPILED}: {row['status']}: {row['error']}")
        return row["compile_s"]

    track_compile_s.unit = "seconds"


class Generate:
    """Greedy generation by a small GPT (2 blocks, d 128, vocab 512; 16-token prompt, 32 new tokens) with the book's
    KV cache and without it: end-to-end tokens/s (new tokens / generation seconds). Higher is better."""

    params = (["kv_concat"], ["generate-cache", "generate-nocache"])
    param_names = ("impl", "mode")
    timeout = Attention.timeout

    def setup(self, impl, mode):
        _set_threads()
        # a commit before scopes has no such Cell axis: _prepare skips it
        self.workload = _prepare(impl=impl, mode=mode, seq_len=16, d_model=128, scope="model", layers=2, vocab=512,
                                 new_tokens=32)
        self._held = _lock_machine()

    def teardown(self, impl, mode):
        _unlock_machine(getattr(self, "_held", None))

    def track_tokens_per_s(self, impl, mode):
        w = self.workload
        timing = measure.time_fn(w.step, w.device, warmup_calls=1, warmup_s=0.0, budget_s=0.5, min_samples=5,
                                 target_rel_ci=0.05)
        return BATCH * w.cell.new_tokens / timing.stats()["median_s"]

    track_tokens_per_s.unit = "tokens/s"


class Accuracy:
    """Issue 38: the error of one low-precision cell against the float64 reference (relative RMS, the ``error_rms`` of
    ``attnbench run``), sdpa in bfloat16 on its own input: lower is better. asv tracks it per commit; a kernel or
    torch change that loses accuracy shows as a step, reported by the gate (track_ figures never fail it)."""

    params = (["sdpa"], ["bfloat16"], [256])
    param_names = ("impl", "dtype", "seq_len")
    timeout = Attention.timeout

    def setup(self, impl, dtype, seq_len):
        _set_threads()
        try:
            from attnbench.measure import accuracy
        except ImportError as exc:  # commits before issue 38 measure no error
            raise NotImplementedError(f"this commit measures no error against float64: {exc}") from exc
        self._accuracy = accuracy
        self.workload = _prepare(impl=impl, dtype=dtype, seq_len=seq_len, d_model=256, mode="inference")

    def track_error_rms(self, impl, dtype, seq_len):
        return self._accuracy.measure(self.workload, seed=0)["error_rms"]

    track_error_rms.unit = "relative RMS error"


class Instructions:
    """Instructions per call of tiny inference cells, counted under valgrind's callgrind in a process of their own
    (:func:`attnbench.measure.instructions.count_cell`: one thread, ASLR off, one vector ISA). A count repeats to a few
    parts per million whatever the machine's load, so the asv gate fails on it past ``--instr-threshold`` (1%),
    without the timed benchmarks' factor and confirmation pass. Skipped without valgrind and on commits before
    instruction counts."""

    params = (["sdpa"], [64])  # one count: asv --quick in .ci/run runs each once (tens of seconds under valgrind)
    param_names = ("impl", "seq_len")
    timeout = 900  # one count: tens of seconds (the counted process imports torch under valgrind)
    rounds = 1
    repeat = 1

    def setup(self, impl, seq_len):
        try:
            from attnbench.measure.instructions import unavailable_reason
        except ImportError:
            raise NotImplementedError("this commit cannot count instructions (no attnbench.measure.instructions)") from None
        reason = unavailable_reason(DEVICE)
        if reason:
            raise NotImplementedError(reason)

    def track_instructions(self, impl, seq_len):
        from attnbench.measure.instructions import count_cell

        cell = Cell(impl=impl, device=DEVICE, batch=1, seq_len=seq_len, num_heads=HEADS, d_model=128, mode="inference")
        return count_cell(cell)["instructions"]

    track_instructions.unit = "instructions"


class Varlen(_Timer):
    """Issue 37: one long-tail batch of sequences of different lengths (mean 128 tokens) run padded, packed and per
    sequence (inference), each with its setup in the call (``--setup per-call``); ``track_setup_s`` times the setup
    alone (the implementation's ``prepare``; NaN for the loop, which has none)."""

    params = (["varlen_padded", "varlen_packed", "varlen_loop"], ["longtail"])
    param_names = ("impl", "lengths")

    def setup(self, impl, lengths):
        _set_threads()
        self.workload = _prepare(impl=impl, seq_len=128, d_model=256, mode="inference", lengths=lengths)
        self._held = _lock_machine()

    def teardown(self, impl, lengths):
        _unlock_machine(getattr(self, "_held", None))

    def time_step(self, impl, lengths):
        _step(self.workload)

    def track_setup_s(self, impl, lengths):
        """Seconds of the implementation's setup alone (its mask built from the lengths), median per call."""
        prepare = getattr(self.workload, "prepare", None)
        if prepare is None:
            return float("nan")
        timing = measure.time_fn(prepare, self.workload.device, warmup_calls=1, warmup_s=0.0, budget_s=0.2,
                                 min_samples=5, target_rel_ci=0.05)
        return timing.stats()["median_s"]

    track_setup_s.unit = "seconds"
