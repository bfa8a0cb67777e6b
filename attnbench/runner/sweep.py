"""Sweep definitions: axes from flags, a TOML file or a named preset, expanded into cells.

Axis values are lists; integer axes also accept ranges: ``128..2048x2`` (geometric: 128, 256, ...,
2048), ``64..512+64`` (arithmetic) and ``1,8``. The variant axes: ``num_kv_heads`` (``1,2,mha``; ``mha``
= as many as heads), ``window`` (``none,64``) and ``causal`` (``true``/``false``). Combinations that cannot run (d_model not divisible
by heads, a dtype or backend unavailable on the device) stay in the sweep and become ``skipped``
rows with the reason, so a results table always shows what was asked for.
"""

from __future__ import annotations

import itertools
import re
import tomllib
from dataclasses import dataclass, field, fields, replace
from importlib import resources
from pathlib import Path

from attnbench.devices import dtype_name
from attnbench.errors import SweepError
from attnbench.results.schema import AXES, CACHE_STATES, INPUTS, INT_AXES, MODEL_AXES, MODES, Cell, display_name
from attnbench.runner.masks import apply_mask, parse_masks
from attnbench.runner.mixed import mixed_cells, parse_batch_specs
from attnbench.runner.positional import KEYS as POSITIONAL_KEYS
from attnbench.runner.positional import compose, parse_positional
from attnbench.runner.setup import check_policy
from attnbench.runner.varlen import parse_lengths


@dataclass(frozen=True)
class Settings:
    """How each cell is measured (see :func:`attnbench.measure.timing.time_fn`)."""

    budget_s: float = 1.0  # sampling time per cell, after warm-up
    target_rel_ci: float = 0.02  # stop when the median's 95% CI half-width is below this fraction
    warmup_calls: int = 3
    warmup_s: float = 0.05
    min_samples: int = 10
    max_samples: int = 10_000
    # a cell running longer is recorded as `timeout`: "auto" (from its predicted cost, attnbench.runner.budget),
    # seconds, or None (no timeout)
    cell_timeout_s: float | str | None = "auto"
    memory_guard: bool = True  # skip a cell predicted to need more memory than is available (attnbench.runner.budget)
    threads: int | None = None  # torch.set_num_threads for CPU cells (None: torch's default)
    cuda_graph: bool = False  # replay inference cells from a CUDA graph
    isolate: bool = False  # each cell in a fresh subprocess (survives segfaults and aborts)
    rounds: int = 1  # measure every cell this many times, in a shuffled order each round, and pool the samples
    processes: int = 1  # measuring worker processes; every cell is measured `rounds` times in each
    cpu_allocator: str = "pinned"  # pinned | system | jemalloc | tcmalloc (attnbench.measure.cpu_env)
    cpu_bind: bool = True  # OpenMP binding and wait policy in the measuring processes
    drift: float | None = None  # between-run term added to every CI (None: calibrated or default; attnbench.measure.drift)
    seed: int = 0
    flop_check: bool = True  # cross-check FLOPs with torch.utils.flop_counter
    baseline: str | None = None  # the implementation speed-ups are against (None: default_baseline of the sweep)
    # how a comparison group's bursts pair with the baseline's (attnbench.measure.interleave.PAIRINGS): adjacent (a
    # baseline burst between every two members: each ratio from bursts milliseconds apart) or cycle (one burst each)
    pairing: str = "adjacent"
    work_pass: bool = True  # measure peak memory and count FLOPs (the first round does; later ones reuse it: for_round)
    accuracy: str = "on"  # issue 38: on | off, each ok row's error against the float64 reference (measure.accuracy)
    setup: str = "per-call"  # issue 37: per-call | once, whether the timed call includes prepare() (runner.setup)
    # cells whose first call also measures peak memory: predicted long calls (attnbench.measure.long_call), set by
    # runner.group.plan_unit; their memory pass would repeat a call of seconds to minutes
    first_call_memory: tuple[str, ...] = ()


def for_round(settings: Settings, round_index: int) -> Settings:
    """The settings of a unit of round ``round_index``: the first round measures peak memory and counts FLOPs; later
    rounds skip that pass (issue 30: it cost as much as a third of the timed cycles), and their rows take the first
    round's figures when the rounds are merged (:func:`attnbench.runner.cell.merge_rounds`: the largest peak seen)."""
    if round_index == 0 or not settings.work_pass:
        return settings
    return replace(settings, work_pass=False)


def default_baseline(impls) -> str:
    """The baseline of a sweep that names none: ``sdpa`` when it is in the sweep, otherwise the first implementation."""
    impls = list(impls)
    return "sdpa" if "sdpa" in impls else impls[0]


@dataclass(frozen=True)
class Sweep:
    """The axes of a sweep and its measurement settings."""

    impl: tuple[str, ...]
    device: tuple[str, ...] = ("cpu",)
    dtype: tuple[str, ...] = ("float32",)
    batch: tuple[int, ...] = (2,)
    seq_len: tuple[int, ...] = (128,)
    num_heads: tuple[int, ...] = (4,)
    d_model: tuple[int, ...] = (256,)
    mode: tuple[str, ...] = ("forward",)
    cache: tuple[str, ...] = ("warm",)
    num_kv_heads: tuple[int | None, ...] = (None,)  # None: as many kv heads as heads (MHA)
    window: tuple[int | None, ...] = (None,)  # None: full attention
    causal: tuple[bool, ...] = (True,)
    positional: tuple[str, ...] = ("",)  # RoPE / QK-norm / scale / softcap: attnbench.runner.positional
    scope: tuple[str, ...] = ("layer",)  # issue 27: layer | block | model (attnbench.models)
    layers: tuple[int, ...] = (2,)  # model scope: blocks
    vocab: tuple[int, ...] = (512,)  # model scope: vocabulary
    new_tokens: tuple[int, ...] = (16,)  # generate modes: tokens generated after the prompt
    inputs: tuple[str, ...] = ("normal",)  # issue 38: normal | outliers | large-logits (attnbench.runner.stress)
    mask: tuple[str, ...] = ("",)  # issue 37: masks (attnbench.runner.masks); "" = the window / causal axes alone
    page_size: tuple[int, ...] = (0,)  # issue 37: decode through paged KV caches of these page sizes (0: none)
    lengths: tuple[str, ...] = ("",)  # issue 37: length distributions ("" = rectangular; attnbench.runner.varlen)
    batch_spec: tuple[str, ...] = ("",)  # issue 48: mixed serving steps ("" = none; attnbench.runner.mixed)
    settings: Settings = field(default_factory=Settings)
    name: str = "custom"

    def __post_init__(self) -> None:
        if not self.impl:
            raise SweepError("the sweep names no implementation; pass --impl NAME[,NAME...] (see `attnbench list`)")
        for axis in AXES[1:]:
            if not getattr(self, axis):
                raise SweepError(f"axis {axis!r} is empty; give at least one value")
        for axis in INT_AXES:
            for v in getattr(self, axis):
                if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                    raise SweepError(f"{axis} values must be positive integers, got {v!r}")
        object.__setattr__(self, "dtype", tuple(dtype_name(d) for d in self.dtype))
        object.__setattr__(self, "mode", expand_modes(self.mode))
        for m in self.mode:
            if m not in MODES:
                raise SweepError(f"unknown mode {m!r}; use one of {', '.join(MODES)}")
        for kind in self.inputs:  # issue 38
            if kind not in INPUTS:
                raise SweepError(f"unknown inputs {kind!r}; use {', '.join(INPUTS)} (docs/accuracy.md)")
        for c in self.cache:
            if c not in CACHE_STATES:
                raise SweepError(f"unknown cache state {c!r}; use warm or cold (cold flushes the GPU L2)")
        for d in self.device:
            if not (d == "cpu" or d == "cuda" or (d.startswith("cuda:") and d[5:].isdigit())):
                raise SweepError(f"unknown device {d!r}; use cpu, cuda or cuda:N")
        from attnbench.models.scope import check_scopes

        check_scopes(self.scope, self.mode, MODEL_AXES, {a: getattr(self, a) for a in MODEL_AXES})
        baseline = self.settings.baseline
        if baseline is not None and baseline not in self.impl and baseline not in [display_name(i) for i in self.impl]:
            raise SweepError(f"--baseline {baseline!r} is not one of the sweep's implementations; use one of "
                             f"{', '.join(display_name(i) for i in self.impl)} or add it to --impl")
        object.__setattr__(self, "num_kv_heads", parse_kv_heads(self.num_kv_heads))
        object.__setattr__(self, "window", parse_windows(self.window))
        object.__setattr__(self, "causal", parse_bools(self.causal))
        object.__setattr__(self, "positional", parse_positional(self.positional))
        object.__setattr__(self, "mask", parse_masks(self.mask))
        object.__setattr__(self, "page_size", parse_page_sizes(self.page_size))
        object.__setattr__(self, "batch_spec", parse_batch_specs(self.batch_spec))  # issue 48
        if any(self.page_size) and "decode" not in self.mode and not any(self.batch_spec):  # issue 37: a decode cache's
            raise SweepError(f"--page-size {','.join(map(str, self.page_size))} applies to decode cells (a paged KV "
                             "cache), and the sweep has none: add decode to --mode (docs/paged.md)")
        object.__setattr__(self, "lengths", parse_lengths(self.lengths))  # issue 37
        check_policy(self.settings.setup)
        if not any(d % h == 0 for h in self.num_heads for d in self.d_model):
            # no cell could run: a usage error before anything runs (a grid where only some pairs fit keeps the others
            # and records the rest as skipped rows that say why)
            d, heads = self.d_model[0], self.num_heads[0]
            fits = ",".join(str(h) for h in range(1, min(d, 64) + 1) if d % h == 0)
            raise SweepError(f"--d-model {d} is not divisible by --heads {heads}: each head gets d_model / heads "
                             f"features; use a --d-model that is a multiple of {heads} (e.g. "
                             f"{heads * max(1, round(d / heads))}) or --heads from {fits}")
        for heads in self.num_heads:
            for kv in self.num_kv_heads:
                if kv is not None and heads % kv:
                    divisors = ",".join(str(h) for h in range(1, heads + 1) if heads % h == 0)
                    raise SweepError(f"--kv-heads {kv} does not divide --heads {heads}: query heads are shared in "
                                     f"equal groups; use --kv-heads from {divisors}")

    @property
    def baseline(self) -> str:
        """The implementation every speed-up is against: ``settings.baseline``, or :func:`default_baseline`."""
        return self.settings.baseline or default_baseline(self.impl)

    def cells(self) -> list[Cell]:
        """Every cell of the grid; CPU cells only get the ``warm`` cache state (no L2 flush on CPU)."""
        out: list[Cell] = []
        seen: set[str] = set()
        from attnbench.models.scope import scope_cells

        for impl, device, dtype, batch, seq, heads, d_model, mode, cache, kv, window, causal, pos, scope, mask in \
                itertools.product(self.impl, self.device, self.dtype, self.batch, self.seq_len, self.num_heads,
                                  self.d_model, self.mode, self.cache, self.num_kv_heads, self.window, self.causal,
                                  self.positional, self.scope, self.mask):
            if device == "cpu":
                cache = "warm"
            layer = apply_mask(Cell(impl, device, dtype, batch, seq, heads, d_model, mode, cache, kv, window, causal,
                                    pos), mask)
            for cell in (replace(c, inputs=kind, page_size=page if c.mode == "decode" else 0, lengths=dist)
                         for c in scope_cells(layer, scope, self.layers, self.vocab, self.new_tokens)
                         for kind in self.inputs for page in self.page_size for dist in self.lengths):
                for one in mixed_cells(cell, self.batch_spec, self.page_size):  # issue 48
                    if one.cell_id not in seen:
                        seen.add(one.cell_id)
                        out.append(one)
        return out


FLAG_NAMES = {"seq_len": "seq", "num_heads": "heads", "d_model": "d-model", "num_kv_heads": "kv-heads",
              "new_tokens": "new-tokens", "page_size": "page-size"}
"""The CLI flag of each integer axis, for error messages."""


def parse_ints(text: str | int | list, axis: str) -> tuple[int, ...]:
    """``"1,8"``, ``"128..2048x2"``, ``"64..512+64"`` or a list -> a tuple of positive ints."""
    if isinstance(text, int) and not isinstance(text, bool):
        items: list = [text]
    elif isinstance(text, list | tuple):
        items = list(text)
    else:
        items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise SweepError(f"--{FLAG_NAMES.get(axis, axis)} is empty; give values like 1,8 or 128..2048x2")
    values: list[int] = []
    for item in items:
        if isinstance(item, int) and not isinstance(item, bool):
            values.append(item)
            continue
        item = str(item)
        flag = FLAG_NAMES.get(axis, axis)

        def to_int(text: str, item=item, flag=flag) -> int:
            try:
                return int(text)
            except ValueError:
                raise SweepError(f"--{flag} {item!r} is not an integer, a list (1,8) or a range "
                                 "(128..2048x2 geometric, 64..512+64 arithmetic)") from None

        if ".." in item:
            lo_text, rest = item.split("..", 1)
            geometric = "+" not in rest
            hi_text, _, step_text = rest.partition("x" if geometric else "+")
            lo, hi, step = to_int(lo_text), to_int(hi_text), to_int(step_text or "2")
            if lo <= 0:
                raise SweepError(f"--{flag} {item}: the start must be >= 1")
            if hi < lo:
                raise SweepError(f"--{flag} {item}: the end {hi} is below the start {lo}; write {hi}..{lo}")
            if (geometric and step < 2) or (not geometric and step < 1):
                raise SweepError(f"--{flag} {item}: the step must be >= {'2 (a factor)' if geometric else '1'}")
            v = lo
            while v <= hi:
                values.append(v)
                v = v * step if geometric else v + step
        else:
            values.append(to_int(item))
    for v in values:
        if v <= 0:
            raise SweepError(f"--{FLAG_NAMES.get(axis, axis)} {v}: values must be >= 1")
    return tuple(dict.fromkeys(values))


def expand_modes(modes) -> tuple[str, ...]:
    """The modes with ``generate`` expanded to ``generate-cache`` and ``generate-nocache`` (issue 27)."""
    out: list[str] = []
    for m in modes:
        out += ["generate-cache", "generate-nocache"] if m == "generate" else [m]
    return tuple(dict.fromkeys(out))


def parse_strs(text: str | list | tuple) -> tuple[str, ...]:
    """``"a,b"`` or a list -> a tuple of stripped strings."""
    items = text if isinstance(text, list | tuple) else str(text).split(",")
    return tuple(dict.fromkeys(s.strip() for s in items if str(s).strip()))


def _none_or(text, what: str) -> list:
    """Items of a list-like axis value, with ``none``/``mha``/``full`` (any case) read as ``None``."""
    items = list(text) if isinstance(text, list | tuple) else [t.strip() for t in str(text).split(",") if t.strip()]
    return [None if item is None or (isinstance(item, str) and item.strip().lower() in ("none", what)) else item
            for item in items]


def parse_kv_heads(text) -> tuple[int | None, ...]:
    """``--kv-heads``: ``1,2,4`` (or ``mha``/``none`` for as many kv heads as heads) -> a tuple."""
    values: list[int | None] = []
    for item in _none_or(text, "mha"):
        values += [None] if item is None else list(parse_ints([item], "num_kv_heads"))
    return tuple(dict.fromkeys(values)) or (None,)


def parse_windows(text) -> tuple[int | None, ...]:
    """``--window``: ``none,64`` -> ``(None, 64)``; a window is >= 1 (w = the token and the previous w - 1)."""
    values: list[int | None] = []
    for item in _none_or(text, "full"):
        if item is None:
            values.append(None)
            continue
        try:
            w = None if isinstance(item, bool) or isinstance(item, float) else int(str(item).strip())
        except ValueError:
            w = None
        if w is None or w < 1:
            raise SweepError(f"--window {item!r} is not a window: give none (full attention) or an integer >= 1 "
                             "(each token sees itself and the previous w-1 tokens), e.g. --window none,64")
        values.append(w)
    return tuple(dict.fromkeys(values)) or (None,)


def parse_page_sizes(text) -> tuple[int, ...]:
    """``--page-size``: ``16,64,256`` (``none``/``0``: no paging) -> a tuple of ints (0 = a contiguous cache only);
    a page size applies to decode cells (other modes get 0)."""
    values: list[int] = []
    for item in _none_or(text, "0"):
        values += [0] if item is None or item == 0 else list(parse_ints([item], "page_size"))
    return tuple(dict.fromkeys(values)) or (0,)


def parse_bools(text) -> tuple[bool, ...]:
    """``causal``: ``true``/``false`` (or a list of them) -> a tuple of bools."""
    items = list(text) if isinstance(text, list | tuple) else [t.strip() for t in str(text).split(",") if t.strip()]
    out = []
    for item in items:
        word = str(item).strip().lower()
        if isinstance(item, bool) or word in ("true", "false", "1", "0", "causal", "non-causal", "noncausal"):
            out.append(item if isinstance(item, bool) else word in ("true", "1", "causal"))
        else:
            raise SweepError(f"causal value {item!r} is not true or false (use --causal or --no-causal)")
    return tuple(dict.fromkeys(out)) or (True,)


def parse_axis(axis: str, value) -> tuple:
    """The tuple of values of one sweep axis, parsed from a flag's text or a TOML value."""
    if axis in INT_AXES or axis in MODEL_AXES:
        return parse_ints(value, axis)
    parsers = {"num_kv_heads": parse_kv_heads, "window": parse_windows, "causal": parse_bools,
               "positional": parse_positional, "mask": parse_masks, "page_size": parse_page_sizes,
               "lengths": parse_lengths, "batch_spec": parse_batch_specs}
    return parsers[axis](value) if axis in parsers else parse_strs(value)


AXIS_KEYS = {"impl": "impl", "device": "device", "dtype": "dtype", "batch": "batch", "seq": "seq_len",
             "seq_len": "seq_len", "heads": "num_heads", "num_heads": "num_heads", "d_model": "d_model",
             "d-model": "d_model", "mode": "mode", "cache": "cache", "kv_heads": "num_kv_heads",
             "kv-heads": "num_kv_heads", "num_kv_heads": "num_kv_heads", "window": "window", "causal": "causal",
             "positional": "positional",
             "scope": "scope", "layers": "layers", "vocab": "vocab", "new_tokens": "new_tokens", "new-tokens": "new_tokens",
             "inputs": "inputs", "mask": "mask", "page_size": "page_size", "page-size": "page_size",
             "lengths": "lengths", "batch_spec": "batch_spec", "batch-spec": "batch_spec"}


def sweep_from_dict(data: dict, name: str = "custom", available_impls: list[str] | None = None) -> Sweep:
    """A :class:`Sweep` from a TOML-like dict: ``[sweep]`` axes and an optional ``[measure]`` table.

    ``impl = "available"`` (or omitted, or the token ``"available"`` inside a list) means every
    implementation available on the sweep's devices.
    """
    known = {"sweep", "measure", "name", "description"}
    unknown = set(data) - known
    if unknown:
        raise SweepError(f"unknown table(s) {sorted(unknown)} in sweep {name!r}; use [sweep] and [measure]")
    axes_in = dict(data.get("sweep", {}))
    axes: dict = {}
    composed = compose({k: axes_in.pop(k) for k in list(axes_in) if k in POSITIONAL_KEYS})  # rope_theta = 500000, ...
    if composed is not None:
        if "positional" in axes_in:
            raise SweepError(f"sweep {name!r} gives both positional and {', '.join(POSITIONAL_KEYS)} keys; use one")
        axes["positional"] = (composed,)
    for key, value in axes_in.items():
        if key not in AXIS_KEYS:
            raise SweepError(f"unknown sweep axis {key!r} in {name!r}; known: "
                             f"{', '.join(sorted(set(AXIS_KEYS) | set(POSITIONAL_KEYS)))}")
        axis = AXIS_KEYS[key]
        try:
            axes[axis] = parse_axis(axis, value)
        except SweepError as exc:  # the message names the flag; the user wrote a key of the file
            raise SweepError(f"[sweep] {key} = {value!r} in {name!r}: {re.sub(r'^--[a-z-]+ ', '', str(exc))}") from None
        if axis == "impl" and not axes[axis]:
            raise SweepError(f"[sweep] impl in {name!r} is empty; name implementations (attnbench list), or leave "
                             "the key out (or write \"available\") for every implementation available here")
    impls = axes.get("impl") or ("available",)
    if "available" in impls:  # the token stands for every implementation available on the sweep's devices
        if available_impls is None:
            raise SweepError(f"sweep {name!r} does not name implementations")
        expanded: list[str] = []
        for item in impls:
            expanded += list(available_impls) if item == "available" else [item]
        axes["impl"] = tuple(dict.fromkeys(expanded))
    measure = dict(data.get("measure", {}))
    valid = {f.name for f in fields(Settings)}
    bad = set(measure) - valid
    if bad:
        raise SweepError(f"unknown [measure] setting(s) {sorted(bad)} in {name!r}; known: {', '.join(sorted(valid))}")
    if isinstance(measure.get("cell_timeout_s"), str):  # "auto", "none" (TOML has no null) or seconds as text
        from attnbench.runner.budget import parse_timeout

        measure["cell_timeout_s"] = parse_timeout(measure["cell_timeout_s"], "[measure] cell_timeout_s")
    _check_measure_types(measure, name)
    return Sweep(**axes, settings=replace(Settings(), **measure), name=str(data.get("name", name)))


_TOML_TYPES = {"float": (int, float), "int": (int,), "bool": (bool,), "str": (str,)}


def _check_measure_types(measure: dict, name: str) -> None:
    """A ``[measure]`` value of the wrong TOML type is an error naming the key (not the CLI flag of the setting)."""
    declared = {f.name: str(f.type) for f in fields(Settings)}
    for key, value in measure.items():
        base = declared[key].removesuffix(" | None")
        ok = _TOML_TYPES.get(base)
        if ok is None:  # a setting of another type: checked where it is used
            continue
        if not isinstance(value, ok) or (isinstance(value, bool) and base != "bool"):
            raise SweepError(f"[measure] {key} = {value!r} in {name!r} must be a TOML {base}"
                             f"{' (true or false)' if base == 'bool' else ''}, not a {type(value).__name__}")


def load_toml(path: str | Path) -> dict:
    """Read a sweep TOML file (a :class:`SweepError` naming the line when it does not parse)."""
    p = Path(path)
    if not p.is_file():
        raise SweepError(f"sweep file {path} does not exist")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise SweepError(f"sweep file {path} is not valid TOML: {exc}") from exc
    if not data:  # not "run everything": a file that says nothing is a mistake (a wrong path, an unsaved editor)
        raise SweepError(f"sweep file {path} is empty; give a [sweep] table (impl, seq, ...; docs/sweeps.md), or "
                         "no file to run the default sweep")
    return data


def preset_names() -> list[str]:
    """Names of the presets shipped with the package."""
    return sorted(p.name.removesuffix(".toml") for p in resources.files("attnbench.runner.presets").iterdir()
                  if p.name.endswith(".toml"))


def load_preset(name: str) -> dict:
    """The dict of a shipped preset (``default``, ``gpt2-small``, ``long-context``, ``smoke``, ``gqa-llama``, ``decode``)."""
    if name not in preset_names():
        raise SweepError(f"unknown preset {name!r}; shipped presets: {', '.join(preset_names())}")
    return tomllib.loads(resources.files("attnbench.runner.presets").joinpath(f"{name}.toml").read_text())
