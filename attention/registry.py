"""The mixer interface and the name -> mixer registry."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from attention.cache import RecurrentState
from attention.call import MixerCall
from attention.capabilities import WindowSchedule, check_variants, example_settings
from attention.edges import Causal


@dataclass(frozen=True)
class Setting:
    """A model setting a variant declares in its own module: a ModelConfig field (config.py adds every declared
    setting to it), so --NAME=value on the command line, NAME = value in config files, the saved config.json and
    scripts/compare.py's setting columns all take it. Mixers list the settings they read in `settings`; one
    setting several variants read (swa_window) is declared once and imported by the others.

    check(value) -> "" or why the value is wrong (with the fix): run for the settings some layer reads.
    inference: the setting changes only how a trained model infers, never its weights (sa_mode): a run may be
    evaluated and exported under another value."""

    name: str
    type: type
    default: object
    help: str
    check: Callable | None = None
    inference: bool = False

    def __post_init__(self):
        if self.type not in (int, float, str, bool) or type(self.default) is not self.type:
            raise TypeError(f"setting {self.name}: type must be int, float, str or bool, and the default of that type")


def choice(*allowed) -> Callable:
    """A Setting check: one of the allowed values."""
    return lambda value: "" if value in allowed else f"expected {' or '.join(map(repr, allowed))}"


def at_least(lowest) -> Callable:
    """A Setting check: a number no smaller than lowest."""
    return lambda value: "" if value >= lowest else f"must be >= {lowest}"


def setting_name(setting) -> str:
    """A Mixer.settings entry's name: a Setting, or a core ModelConfig key the mixer reads (attn_backend, ...)."""
    return setting if isinstance(setting, str) else setting.name


class Mixer(nn.Module):
    """A token mixer (attention variant or recurrent layer): the runtime core the model, training and generation
    use. Everything a tool asks beyond it is an optional capability (attention/capabilities.py).

    forward(x, call) -> y
        x: (B, T, C) normalised block input; call: a MixerCall (attention/call.py) with the tokens' absolute
        positions, the generation cache, this forward's plan and, for a mixer that declares takes_documents,
        where each token's document begins.
    plan(batch_size, seq_len, device) -> what forward needs that depends only on the shape and device (masks,
        tiles, block masks) or is drawn once per forward (sa's permutation). GPT.forward calls it before the
        blocks run, outside compiled code, so compiled blocks get their masks as inputs (built once per shape
        and shared by the layers) and recomputation under activation checkpointing reuses the same draws.
    init_cache(batch_size, max_len, device, dtype) -> per-layer generation state (KV cache, recurrent state).
    supports_cache (declared): whether init_cache gives a generation state: a mixer without one (or whose edges
        are redrawn at every forward, sa) generates by re-running the context for each new token.
    takes_documents (declared): whether forward honours call.docs (no edge and no state crosses an end-of-text
        token): a model with document_mask refuses a mixer that does not declare it.
    settings, check_config(config) -> what the mixer reads besides the model's shape (its Settings and core
        ModelConfig keys by name), and a ValueError when the config cannot build it.
    init_weights() -> variant-specific initialisation, run after the model's generic one.
    mixing_flops(seq_len) -> forward FLOPs per token spent mixing positions, beyond the parameter matmuls
        (e.g. QK^T and AV for attention), so that MFU reflects the variant's real cost.
    compile_key(), compile_problem(seq_len, device, dtype) -> how compiled blocks share graphs, and why this
        layer should not be compiled at this length.
    """

    # the README's variant table (scripts/variants.py): the paper of papers/ the variant comes from ("000" ..
    # "004", or a citation), and which keys a query attends to, in one line
    paper = ""
    summary = ""
    # whether the mixer takes the pretrained attention shapes (n_kv_head, attn_head_dim, qk_norm, qkv_bias)
    pretrained_attention_shapes = False
    # what this mixer reads besides the model's shape: its own Settings and core ModelConfig keys by name
    # (scripts/compare.py leaves the others out of a run's settings)
    settings: tuple = ()
    # whether a position's output is independent of the sequence's length (how far it was padded): false for sa,
    # whose permutation is drawn over the whole length
    length_independent = True
    # declared, never inspected: whether init_cache gives a generation state, whether forward honours call.docs,
    # and whether a position's output depends on relative positions alone (a document's outputs are the same
    # wherever it starts: windows and recurrences under RoPE, not blocks at fixed boundaries or sa's permutation)
    supports_cache = False
    takes_documents = False
    translation_invariant = False
    # whether forward honours call.shard (context parallelism, attention/ops/shard.py): a shard of the sequence,
    # exact against the whole sequence in one process
    context_parallel = False

    @classmethod
    def check_config(cls, config) -> None:
        pass

    def init_cache(self, batch_size: int, max_len: int, device, dtype):
        raise NotImplementedError(f"{type(self).__name__} does not support cached generation")

    def mixing_flops(self, seq_len: int) -> float:
        return 0.0

    def plan(self, batch_size: int, seq_len: int, device):
        return None

    def compile_key(self) -> tuple:
        """What a compiled block specialises on besides shapes: blocks whose mixers have equal keys share one
        compiled graph, and each new key is one more (scripts/compile_check.py counts graphs against keys)."""
        return (type(self).__name__,)

    def compile_problem(self, seq_len: int, device, dtype) -> str:
        """Why this layer should not be torch.compiled at this length, device and dtype ("" when it can)."""
        return ""

    def init_weights(self) -> None:
        pass

    def context_parallel_received(self, shard) -> int:
        """The positions whose keys and values this shard's process receives per layer (a recurrence: none, its
        state's summaries travel instead)."""
        return 0

    def context_parallel_exchange(self, shard, bytes_per_element: int) -> str:
        """What one process of a context-parallel group receives for this layer in a forward, per sequence, for the
        start-up log (attention/ops/shard.py). A recurrent mixer on the core: its state's summaries."""
        return "one state summary per head from each other process of the group, whatever the length"

    def context_parallel_problem(self) -> str:
        """Why this layer cannot run a shard of a sequence under context parallelism ("" when it can)."""
        if not self.context_parallel:
            return (f"{type(self).__name__} has no context-parallel form (it declares no context_parallel: "
                    "docs/context_parallel.md says what a mixer does for it)")
        return ""

    def describe(self) -> str:
        """A line for the start-up summary (e.g. per-head windows); empty when there is nothing to add."""
        return ""

    def forward(self, x: torch.Tensor, call: MixerCall) -> torch.Tensor:
        raise NotImplementedError


class RecurrentMixer(Mixer):
    """A mixer that carries a fixed-size state from token to token (linear attention, mLSTM, Gated DeltaNet):
    every earlier token can reach every later one, and generation keeps only the state."""

    supports_cache = True
    # the recurrence core's forms (attention/ops/recurrence: FORMS) a mixer built on it declares; its training and
    # prompts run `form`, which the conformance tests switch to hold the forms to each other (empty: its own forms)
    forms: tuple = ()
    form = "chunked"

    def init_cache(self, batch_size, max_len, device, dtype):
        return RecurrentState()

    def edge_mask(self, seq_len, device="cpu"):
        return Causal().dense_mask(torch.arange(seq_len, device=device))


# torch.compile unrolls python loops: a chunk loop longer than this takes too long to compile (hours at 256)
MAX_COMPILED_CHUNKS = 64


def chunk_loop_problem(layer: str, seq_len: int, chunk: int, fast_path: str) -> str:
    """compile_problem of a layer whose training form loops over chunks in python (the native mLSTM and Gated
    DeltaNet forms): fine for short sequences, refused beyond MAX_COMPILED_CHUNKS chunks."""
    chunks = -(-seq_len // chunk)
    if chunks <= MAX_COMPILED_CHUNKS:
        return ""
    return (f"{layer}'s built-in chunked form loops in python over {chunks} chunks at length {seq_len}, and "
            f"torch.compile would unroll them (compiling would take hours): {fast_path}, or train with compile=False")


def refuse_whole_context(config, setting: str, size: int, what: str) -> None:
    """Refuse a window or block longer than the training length (block_size): the layer would train exactly as
    full attention under another name, at a variant's cost. One equal to it is allowed: paper 001's vanilla
    models train so (full attention at length T = w) and are evaluated with the window at longer lengths.
    Evaluation may use longer windows (python -m eval --window, --ppl_windows), which never come through here."""
    if size > config.block_size:
        raise ValueError(f"{setting}={size} exceeds block_size={config.block_size}: {what} every training position, "
                         f"so these layers would train exactly as full attention. Use {setting} <= {config.block_size}, "
                         "a longer block_size, or attn_pattern=full (a longer window can still be evaluated: python "
                         "-m eval --window / --ppl_windows)")


MIXERS: dict[str, type[Mixer]] = {}
SETTINGS: dict[str, Setting] = {}  # every declared setting by name: config.py makes them ModelConfig fields


def register(name: str):
    """Class decorator: the mixer `name` of attn_pattern, and the Settings it declares."""
    def decorator(cls: type[Mixer]) -> type[Mixer]:
        if name in MIXERS:
            raise ValueError(f"mixer '{name}' is registered twice")
        if name in PATTERN_ALIASES:
            raise ValueError(f"mixer '{name}' has the name of a pattern alias (register_pattern): name it otherwise")
        for setting in cls.settings:
            if isinstance(setting, Setting):
                if SETTINGS.setdefault(setting.name, setting) is not setting:
                    raise ValueError(f"setting '{setting.name}' is declared twice (by {name} and another mixer): "
                                     "declare it once and import it where another mixer reads it")
        MIXERS[name] = cls
        return cls

    return decorator


@dataclass(frozen=True)
class PatternAlias:
    """A named layer pattern (a hybrid such as SWAX, paper 003: swa and mlstm alternating): attn_pattern takes the
    name, and the README's variant table lists it with its paper and summary."""

    pattern: str  # one period of the pattern, comma-separated mixer names
    paper: str = ""
    summary: str = ""


# every pattern alias by name, filled by register_pattern from the variant modules that declare them
PATTERN_ALIASES: dict[str, PatternAlias] = {}


def register_pattern(name: str, pattern: str, paper: str = "", summary: str = "") -> PatternAlias:
    """Declare `name` as attn_pattern's name for `pattern` (comma-separated mixer names), from the variant module
    it belongs to (attention/swax.py), so that a named hybrid needs no edit here. Its mixers are looked up when a
    model is built (the module that registers them may be imported after this one)."""
    entries = [entry.strip() for entry in pattern.split(",")]
    if not all(entries):
        raise ValueError(f"pattern alias '{name}': {pattern!r} has an empty entry; give mixer names, e.g. 'swa,mlstm'")
    if name in PATTERN_ALIASES or name in MIXERS:
        raise ValueError(f"pattern alias '{name}' is declared twice, or names a mixer: name it otherwise")
    if set(entries) & set(PATTERN_ALIASES):
        raise ValueError(f"pattern alias '{name}': {pattern!r} names another alias; write out its mixers")
    PATTERN_ALIASES[name] = PatternAlias(",".join(entries), paper, summary)
    return PATTERN_ALIASES[name]


def pattern_names(attn_pattern: str) -> list[str]:
    """The mixer names of one period of a pattern, aliases expanded (not checked against the registry)."""
    entries = [name.strip() for name in attn_pattern.split(",")]
    if not any(entries):
        raise ValueError("attn_pattern is empty: give a mixer name such as 'full'")
    if not all(entries):
        raise ValueError(f"attn_pattern={attn_pattern!r} has an empty entry: give a mixer name for every "
                         "position of the pattern, e.g. 'swa,swa,full'")
    return [name for entry in entries
            for name in (PATTERN_ALIASES[entry].pattern if entry in PATTERN_ALIASES else entry).split(",")]


def layer_names(config) -> list[str]:
    """The mixer name of every layer: attn_pattern (aliases expanded) repeated to n_layer."""
    pattern = pattern_names(config.attn_pattern)
    for name in pattern:
        if name not in MIXERS:
            close = difflib.get_close_matches(name, list(MIXERS), n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ValueError(f"unknown mixer '{name}' in attn_pattern: {hint}registered: {', '.join(sorted(MIXERS))}")
    if config.n_layer % len(pattern):
        raise ValueError(f"attn_pattern has {len(pattern)} entries, which does not divide n_layer={config.n_layer}")
    return pattern * (config.n_layer // len(pattern))


def example_cases(window: int) -> dict[str, dict]:
    """The tools' small models, one per registered mixer (and per each of its check_variants, named
    MIXER_LABEL, and per pattern alias): case name -> settings, attn_pattern and each mixer's
    example_settings(window) among them (attention/capabilities.py). Tests, benchmarks, the compile and GPU
    checks all take their cases from here, so a new variant is in every one of them."""
    cases = {}
    for name, cls in MIXERS.items():
        cases[name] = {"attn_pattern": name, **example_settings(cls, window)}
        for label, extra in check_variants(cls).items():
            cases[f"{name}_{label}"] = {**cases[name], **extra}
    for alias, declared in PATTERN_ALIASES.items():
        settings = {"attn_pattern": alias}
        for name in declared.pattern.split(","):
            settings.update(example_settings(MIXERS[name], window))
        cases[alias] = settings
    return cases


def used_settings(config) -> set[str]:
    """The names of the mixer settings (Mixer.settings) some layer of this config reads."""
    return {setting_name(s) for name in set(layer_names(config)) for s in MIXERS[name].settings}


def pattern_settings(attn_pattern: str) -> set[str]:
    """The names of the mixer settings the mixers of a pattern read (aliases expanded), before any config exists:
    what a command may pass for it (a run refuses the others)."""
    return {setting_name(s) for name in set(pattern_names(attn_pattern)) if name in MIXERS for s in MIXERS[name].settings}


def mixer_settings() -> set[str]:
    return {setting_name(s) for cls in MIXERS.values() for s in cls.settings}


def setting_readers(setting: str) -> list[str]:
    """The registered mixers that read a setting (swa_window: swa, swat, sa, mswa, ...), in registration order."""
    return [name for name, cls in MIXERS.items() if setting in {setting_name(s) for s in cls.settings}]


def has_window_layers(config) -> bool:
    """Whether any layer's mixer has a sliding window that set_window changes."""
    return any(issubclass(MIXERS[name], WindowSchedule) for name in set(layer_names(config)))


PRETRAINED_SHAPES = ("n_kv_head", "attn_head_dim", "qk_norm", "qkv_bias")


def validate_config(config) -> None:
    shaped = [key for key in PRETRAINED_SHAPES if getattr(config, key)]
    for name in sorted(set(layer_names(config))):
        if shaped and not MIXERS[name].pretrained_attention_shapes:
            raise ValueError(f"{', '.join(shaped)}: only attention mixers take these (pretrained Llama-family shapes), "
                             f"not {name}")
        for setting in MIXERS[name].settings:
            if isinstance(setting, Setting) and setting.check is not None:
                problem = setting.check(getattr(config, setting.name))
                if problem:
                    raise ValueError(f"{setting.name}={getattr(config, setting.name)!r}: {problem}")
        MIXERS[name].check_config(config)


def build_mixer(config, layer_idx: int) -> Mixer:
    return MIXERS[layer_names(config)[layer_idx]](config, layer_idx)
