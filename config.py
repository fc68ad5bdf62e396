"""Typed configuration for training, sampling and evaluation.

A run's configuration is four dataclasses (model, data, train, eval) whose field names are unique across
groups, so a config file and the command line can use flat names as in nanoGPT:

    python train.py configs/quickstart.py --batch_size=32 --learning_rate=3e-4

A config file is python that assigns fields (`n_layer = 6`), optionally after `include("configs/other.py")`;
`--key=value` overrides it. Values are checked
against the field's type; an unknown key or a bad value raises ConfigError naming the closest valid key, and
the entry points turn that into exit status 2 before anything is written. A variant's setting given on the
command line or in a config file named there is refused the same way when no mixer of attn_pattern reads it; a
run saves (config.json, checkpoints, wandb) only the settings its mixers read (Config.to_dict).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import io
import json
import os
import sys
import tokenize
import types
import typing
from dataclasses import dataclass, field

import attention  # noqa: F401  (imports every variant module: each registers its mixer and settings)
from attention import has_window_layers
from attention import validate_config as validate_attention
from attention.registry import MIXERS, SETTINGS, pattern_names, setting_readers, used_settings


class ConfigError(ValueError):
    pass


class ModelConfig:
    """The model: its shape, the attention settings every attention mixer shares, and (added below, from the
    registry) every setting a variant module declares (attention/*.py: Setting), e.g. swa_window."""

    arch: str = "gpt2"  # gpt2 (LayerNorm, GELU, learned positions) | llama (RMSNorm, SwiGLU, RoPE)
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    block_size: int = 1024  # training context length (and the size of the learned position table)
    vocab_size: int = 0  # 0: the prepared data's vocabulary, padded up to a multiple of 64
    bias: bool = True  # biases in linear layers and LayerNorm (gpt2); llama recipes set False
    dropout: float = 0.0
    mlp_hidden: int = 0  # 0: 4*n_embd for gpt2, floor(2.67*n_embd) for llama's SwiGLU (paper 000)
    gelu: str = "exact"  # gpt2's MLP activation: exact (erf) | tanh (the approximation OpenAI's GPT-2 trained with)
    pos_embedding: str = "auto"  # auto (learned for gpt2, rope for llama) | learned | rope | none
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02
    # attention shapes of pretrained Llama-family checkpoints (runtime/pretrained.py); attention mixers only
    n_kv_head: int = 0  # key/value heads, each shared by n_head / n_kv_head query heads (grouped-query); 0: n_head
    attn_head_dim: int = 0  # width of each q, k, v head; 0: n_embd // n_head (Qwen3's small models differ)
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (Qwen3)
    qkv_bias: bool = False  # biases on the q, k, v projections even with bias=False (Qwen2)
    # token mixers: a comma-separated list of registered names, repeated to fill n_layer
    # (e.g. "full", or "swa,swa,swa,full" for 3 local : 1 full); see attention/__init__.py
    attn_pattern: str = "full"
    attn_backend: str = "auto"  # auto (CUDA: span where every query's keys are one run, else flex; chunked on CPU;
    #                             sdpa for full) | dense | chunked | flex | sdpa | span
    attn_gate: bool = False  # sigmoid(W y) * y before the output projection (paper 000's recipe)
    # packed documents (docs/documents.md): no attention edge or recurrent state crosses an end-of-text token,
    # which begins the next document; positions stay the window's
    document_mask: bool = False
    eot_id: int = -1  # the end-of-text token that begins a document; -1: the data's (meta.json), set by train.py

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def resolved_pos_embedding(self) -> str:
        if self.pos_embedding != "auto":
            return self.pos_embedding
        return "learned" if self.arch == "gpt2" else "rope"

    @property
    def resolved_mlp_hidden(self) -> int:
        if self.mlp_hidden:
            return self.mlp_hidden
        return 4 * self.n_embd if self.arch == "gpt2" else int(2.67 * self.n_embd)


def _with_variant_settings(cls):
    """ModelConfig as a dataclass whose fields are its own plus every Setting the variants declare (the attention
    package registers them on import: a module dropped into attention/ adds its settings here)."""
    for setting in SETTINGS.values():
        if setting.name in cls.__annotations__:
            raise TypeError(f"setting {setting.name} is a ModelConfig field already: name it otherwise")
        cls.__annotations__[setting.name] = setting.type
        setattr(cls, setting.name, setting.default)
    return dataclass(cls)


ModelConfig = _with_variant_settings(ModelConfig)


@dataclass
class DataConfig:
    dataset: str = "embedded_byte"  # prepared data lives in data/<dataset> (see data/prepare.py)
    data_dir: str = ""  # overrides data/<dataset> when set
    # train and validate only on the targets that follow this text's token (a task corpus's answer marker,
    # e.g. ">" for the recall corpus); empty: every target, as usual
    loss_after: str = ""


@dataclass
class TrainConfig:
    out_dir: str = "out"
    # scratch | resume | gpt2 | gpt2-medium | gpt2-large | gpt2-xl (OpenAI's weights, as nanoGPT) |
    # hf:NAME_OR_PATH (a Hugging Face checkpoint: gpt2, llama, mistral, qwen2, qwen3); see runtime/pretrained.py
    init_from: str = "scratch"
    resume_from: str = "last"  # init_from=resume: continue from ckpt_last (where the run stopped) or ckpt_best
    replace_run: bool = False  # a fresh run in an out_dir that holds a run moves the old one whole to OUT_DIR.replaced-TIME
    allow_data_change: bool = False  # init_from=resume on data whose identity (meta.json) differs from the run's
    batch_size: int = 12  # micro-batch size per process
    gradient_accumulation_steps: int = 40  # global: divided among DDP processes, as in nanoGPT
    max_iters: int = 600000
    learning_rate: float = 6e-4
    min_lr: float = 6e-5
    warmup_iters: int = 2000
    lr_decay_iters: int = 0  # the step the cosine decay reaches min_lr; 0: max_iters (the decay follows it)
    decay_lr: bool = True
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 disables clipping
    log_interval: int = 10
    ckpt_interval: int = 0  # steps between ckpt_last.pt writes; 0: at every evaluation
    device: str = "auto"  # auto (cuda when available) | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bfloat16 on capable GPUs, float16 on older ones, float32 on CPU)
    compile: bool = False  # torch.compile each block (runtime/parallelize.py)
    # with compile: the blocks and the ends compiled with mode="reduce-overhead", so each step replays CUDA graphs
    # instead of launching hundreds of kernels from python. Pays where the host bounds the step: small micro-batches
    # (GPT-2 124M, one 8K sequence, swa: 23.0 ms a step against 29.7 without, H100). One micro-batch per process
    # (no gradient accumulation) and no FSDP; the CPU has no CUDA graphs (docs/training.md)
    cuda_graphs: bool = False
    # ddp: every process holds the whole model, gradients and AdamW state (16 bytes per parameter) |
    # fsdp: FSDP2 shards them over the processes (each block its own unit, then the root), computes in bf16
    # through its mixed-precision policy, and checkpoints sharded (folders ckpt_last/, ckpt_best/)
    parallelism: str = "ddp"
    # processes per sequence (context parallelism, docs/context_parallel.md): under torchrun each sequence of
    # block_size tokens is cut into context_parallel contiguous shards, one per process of a group, and the
    # processes form data parallel x context parallel groups; 1: every process trains whole sequences
    context_parallel: int = 1
    fsdp_reshard_after_forward: bool = True  # free each block's gathered weights after its forward (less memory)
    # activation memory: none | full (each block keeps only its input and recomputes the rest in backward) |
    # selective (keeps its matmul and attention outputs, recomputes norms, activations and elementwise work)
    activation_checkpointing: str = "none"
    # tokens per chunk of the LM head + cross-entropy, each recomputed in backward, so the logits (and their
    # float32 copy) never exist for a whole micro-batch; 0: the whole micro-batch at once
    loss_chunk: int = 0
    seed: int = 1337
    # sliding-window size per training step (paper 003): fixed (swa_window) or stochastic: each step uses
    # swax_short_window with probability swax_short_prob, else swa_window, and only swa_window in the last
    # swax_anneal_frac of max_iters. The window of each step is a function of (seed, step): resumable.
    window_schedule: str = "fixed"
    swax_short_window: int = 128
    swax_short_prob: float = 0.5
    swax_anneal_frac: float = 0.1
    wandb_log: bool = False
    wandb_project: str = "efficient-attention"
    wandb_run_name: str = ""  # empty: the out_dir's name
    wandb_mode: str = "online"  # online | offline (no network needed) | disabled
    # empty: the recipe folder, data and model size (bridges-openwebtext_gpt2-12x768): a run's variants and seeds
    wandb_group: str = ""
    # comma-separated; empty: the variants of attn_pattern and their papers (swa, paper-001, ...); +a,b adds to those
    wandb_tags: str = ""


@dataclass
class EvalConfig:
    eval_interval: int = 2000
    eval_iters: int = 200  # validation batches of batch_size windows: a fixed token budget
    eval_only: bool = False
    # probes during training (eval/probes.py): comma-separated tasks (ppl, niah) at eval_task_lengths
    # (default: block_size), every eval_tasks_interval steps (0: at every evaluation)
    eval_tasks: str = ""
    eval_task_lengths: str = ""
    eval_tasks_interval: int = 0


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self):
        # the variant settings given on the command line or in a config file named there, each with where it was
        # given (apply_args, apply_file): validate refuses those no mixer of the pattern reads. Not a field, so
        # never saved
        self.given: dict[str, str] = {}

    def to_dict(self) -> dict:
        """The config as a run saves it (config.json, checkpoints, the wandb config): every field but the variant
        settings no mixer of attn_pattern reads, so a swa run holds swa_window and no moba_block."""
        saved = dataclasses.asdict(self)
        unread = unread_settings(self.model)
        saved["model"] = {key: value for key, value in saved["model"].items() if key not in unread}
        return saved

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        """Rebuild a config saved by to_dict: a setting it lacks (one no mixer of its pattern reads, or one newer
        than the run) takes its default, and a run saved with every variant's settings (as runs were saved before
        they kept only their own) reads the same. Unknown keys from newer versions are ignored with a warning."""
        cfg = cls()
        for group in GROUPS:
            for key, value in d.get(group, {}).items():
                if key in _FIELDS and _FIELDS[key][0] == group:
                    setattr(getattr(cfg, group), key, value)
                else:
                    print(f"warning: ignoring unknown saved config key {group}.{key}", file=sys.stderr)
        return cfg


GROUPS = ("model", "data", "train", "eval")
_GROUP_TYPES = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig, "eval": EvalConfig}
# flat key -> (group, type); the assertion keeps flat names unambiguous
_FIELDS: dict[str, tuple[str, type]] = {}
for _group, _cls in _GROUP_TYPES.items():
    for _name, _type in typing.get_type_hints(_cls).items():
        assert _name not in _FIELDS, f"config key {_name} is defined in two groups"
        _FIELDS[_name] = (_group, _type)


def get_value(cfg: Config, key: str):
    return getattr(getattr(cfg, _FIELDS[key][0]), key)


def unread_settings(model) -> set[str]:
    """The declared variant settings (attention/registry.py: Setting) that no mixer of the model's attn_pattern
    reads; none for a pattern that cannot be read (validate refuses it before anything is saved)."""
    try:
        return set(SETTINGS) - used_settings(model)
    except ValueError:
        return set()


def _note_given(target, key: str, where: str) -> None:
    """Record that a variant setting was given explicitly (where: --KEY, or the config file's path)."""
    if key in SETTINGS and isinstance(getattr(target, "given", None), dict):
        target.given[key] = where


def unread_settings_problem(model, given: dict[str, str]) -> str:
    """Why variant settings given explicitly (setting -> where: --KEY, or a config file) cannot be taken, in one
    line with the fix; "" when every one is read by some mixer of attn_pattern (a setting several mixers read, such
    as swa_window, by any of them). A setting no layer reads would change nothing, silently."""
    unread = [key for key in given if key in unread_settings(model)]
    if not unread:
        return ""
    key, where = unread[0], given[unread[0]]
    value = getattr(model, key)
    readers = setting_readers(key)
    names = readers[0] if len(readers) == 1 else ", ".join(readers[:-1]) + " and " + readers[-1]
    expanded = ",".join(pattern_names(model.attn_pattern))
    pattern = f"attn_pattern={model.attn_pattern!r}" + (f" ({expanded})" if expanded != model.attn_pattern else "")
    if where.startswith("--"):
        subject, drop = f"--{key}={value}", f"drop --{key}"
    else:
        subject, drop = f"{key}={value!r} in {where}", f"drop it from {where}"
    others = f" ({', '.join(unread[1:])} likewise)" if len(unread) > 1 else ""
    one = len(readers) == 1
    return (f"{subject} is a setting of {names}, and {pattern} has {'no such layer' if one else 'none of them'}: "
            f"{drop}, or put {names if one else 'one of them'} in attn_pattern{others}")


def _closest(key: str, candidates) -> str:
    close = difflib.get_close_matches(key, list(candidates), n=3, cutoff=0.5)
    if close:
        return "did you mean " + " or ".join(f"'{c}'" for c in close) + "?"
    return "valid keys: " + ", ".join(sorted(candidates))


def coerce(key: str, value, typ: type, from_cli: bool = True):
    """Convert a command-line string to the field's type, or check a config file's python value."""
    if from_cli and isinstance(value, str) and typ is not str:
        text = value.strip()
        if typ is bool:
            if text.lower() in ("true", "1", "yes"):
                return True
            if text.lower() in ("false", "0", "no"):
                return False
            raise ConfigError(f"--{key}={value!r}: expected a boolean (True or False)")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise ConfigError(f"--{key}={value!r}: expected {typ.__name__}, got a string") from None
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if typ is int and isinstance(value, float) and value.is_integer():
        value = int(value)  # 1e6 written for an integer count
    if type(value) is not typ:
        raise ConfigError(f"{key}={value!r}: expected {typ.__name__}, got {type(value).__name__}")
    return value


def set_value(target, key: str, value, fields: dict[str, tuple[str, type]] | None = None,
              from_cli: bool = True) -> None:
    """Set a flat key on a Config (or on a single dataclass when fields maps its own keys)."""
    fields = _FIELDS if fields is None else fields
    if key not in fields:
        raise ConfigError(f"unknown config key '{key}': {_closest(key, fields)}")
    group, typ = fields[key]
    obj = getattr(target, group) if group else target
    setattr(obj, key, coerce(key, value, typ, from_cli))


def apply_file(target, path: str, fields=None, included: bool = False) -> None:
    """Execute a python config file and apply every top-level assignment it makes; or apply a run's saved
    config.json (its model, data, train and eval sections). The variant settings a python file named on the command
    line assigns count as given (refused when attn_pattern does not read them); those of a file it includes, a base
    shared by a family of recipes (its block and bridge sizes), and those of a saved config.json do not."""
    try:
        with open(path) as f:
            source = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    if path.endswith(".json"):
        try:
            saved = json.loads(source)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(saved, dict) or not any(group in saved for group in GROUPS):
            raise ConfigError(f"{path} is not a run's config.json (it has none of {', '.join(GROUPS)})")
        for group in GROUPS:
            for key, value in saved.get(group, {}).items():
                try:
                    set_value(target, key, value, fields, from_cli=False)
                except ConfigError as e:
                    raise ConfigError(f"{path}: {e}") from None
        if "run" in saved and "out_dir" in saved.get("train", {}):
            # a training run's own config.json: the run is the folder it lies in, wherever that folder has been
            # moved since (an --out_dir after it still chooses another)
            set_value(target, "out_dir", os.path.dirname(path) or ".", fields, from_cli=False)
        return
    # include("configs/base.py") applies another config file first; this file's assignments then override it
    # (a relative path is looked up from the working directory, then from the repository root)
    def include(other):
        repo_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), other)
        apply_file(target, other if os.path.exists(other) or not os.path.exists(repo_path) else repo_path, fields,
                   included=True)

    namespace: dict = {"include": include}
    try:
        exec(compile(source, path, "exec"), namespace)
    except Exception as e:
        raise ConfigError(f"config file {path} failed to run: {type(e).__name__}: {e}") from None
    for key, value in namespace.items():
        if key.startswith("_") or isinstance(value, (types.ModuleType, types.FunctionType, type)):
            continue
        try:
            set_value(target, key, value, fields, from_cli=False)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
        if not included:
            _note_given(target, key, path)


HELP_FLAGS = ("--help", "-h")


def field_help(cls) -> dict[str, str]:
    """The comment written after each field of a config dataclass (or, without one, the comment lines right above
    it), read from its source: the typed config documents itself, and --help prints it. Variant settings carry theirs
    (attention/registry.py: Setting.help)."""
    helps: dict[str, str] = {}
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        source = ""
    above: list[str] = []
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline)) if source else []
    line_comments: dict[int, str] = {}
    continued: set[int] = set()  # comment lines indented under the comment above them: its continuation
    names: dict[int, str] = {}
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.COMMENT:
            line_comments[tok.start[0]] = tok.string.lstrip("#").strip()
            if tok.string.startswith("#  ") and tok.line.strip().startswith("#"):
                continued.add(tok.start[0])
        elif tok.type == tokenize.NAME and tok.start[1] == 4 and i + 1 < len(tokens) \
                and tokens[i + 1].string == ":" and tok.start[0] not in names:
            names[tok.start[0]] = tok.string
    for line in range(1, source.count("\n") + 2):
        if line in names:
            # its own comment (with the indented comment lines under it that continue it); else the comment lines
            # right above it (above a commented field they head a section)
            text = line_comments.get(line) or " ".join(above)
            if line in line_comments:
                below = line + 1
                while below in continued:
                    text += " " + line_comments[below]
                    below += 1
            if text:
                helps[names[line]] = text
            above = []
        elif line in line_comments and line not in continued:
            above.append(line_comments[line])
        else:
            above = []
    helps.update({name: setting.help for name, setting in SETTINGS.items() if name in typing.get_type_hints(cls)})
    return helps


def options_text(target, fields=None) -> str:
    """Every option of an entry point: --name=TYPE (its default) and its help, by config group."""
    fields = _FIELDS if fields is None else fields
    lines, helps, last_group = [], {}, None
    for key, (group, typ) in fields.items():
        obj = getattr(target, group) if group else target
        if type(obj) not in helps:
            helps[type(obj)] = field_help(type(obj))
        if group != last_group and group:
            lines.append(f"\n{group}:")
            last_group = group
        default = getattr(obj, key)
        lines.append(f"  --{key}={getattr(typ, '__name__', typ)} (default {default!r})")
        if helps[type(obj)].get(key):
            lines.append(f"      {helps[type(obj)][key]}")
    return "\n".join(lines)


def print_help(target, fields=None, more: str = "", positional: str = "") -> None:
    """The entry point's usage (its module's docstring), options_text and `more`."""
    main = sys.modules.get("__main__")
    doc = (getattr(main, "__doc__", None) or "").strip()
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:  # python -m eval
        prog = "-m " + spec.name.removesuffix(".__main__")
    else:
        prog = os.path.relpath(sys.argv[0]) if sys.argv and sys.argv[0] not in ("", "-c") else "PROGRAM"
    items = f"[{positional.upper()} ...]" if positional else "[CONFIG.py ...]"
    print(f"usage: python {prog} {items} [--key=value ...]  (or --key value; a boolean's --key alone: True)")
    if doc:
        print("\n" + doc)
    first = f"Each positional argument is one of --{positional}" if positional else \
        "Config files (python assigning fields) apply in order"
    print(f"\n{first}, then --key=value overrides; options:")
    print(options_text(target, fields))
    if more:
        print("\n" + more)


def apply_args(target, argv: list[str], fields=None, positional: str = "") -> None:
    """Apply config files (positional) and overrides, in order: --key=value, --key value, and a boolean's bare
    --key (True). With `positional` (a comma-separated string field, such as a list of run folders) the
    positional arguments are appended to that field instead of applied as config files. --help (-h) prints the
    options and exits."""
    if any(arg in HELP_FLAGS for arg in argv):
        print_help(target, fields, positional=positional)
        raise SystemExit(0)
    known = _FIELDS if fields is None else fields
    i = 0
    while i < len(argv):
        arg, following = argv[i], argv[i + 1] if i + 1 < len(argv) else None
        i += 1
        if arg.startswith("--"):
            key, sep, value = arg[2:].partition("=")
            key = key.replace("-", "_")
            if not sep:
                if key not in known:
                    raise ConfigError(f"unknown config key '{key}': {_closest(key, known)}")
                boolean = known[key][1] is bool
                if boolean and (following or "").lower() not in ("true", "false", "1", "0", "yes", "no"):
                    value = "True"  # a bare flag
                elif following is None or following.startswith("--"):  # never another option taken as the value
                    raise ConfigError(f"'{arg}' needs a value: --{key}=VALUE")
                else:
                    value, i = following, i + 1
            set_value(target, key, value, fields)
            _note_given(target, key, f"--{key}")
        elif positional and not arg.startswith("-"):
            if "," in arg:  # the list is comma-separated: the name would be split, silently
                raise ConfigError(f"'{arg}': a name with a comma cannot be one of --{positional} (a comma-separated "
                                  "list): rename it")
            items = [item for item in (getattr(target, positional), arg) if item]
            set_value(target, positional, ",".join(items), fields)
        elif arg.endswith(".py") or not arg.startswith("-"):
            apply_file(target, arg, fields)
        else:
            raise ConfigError(f"'{arg}': expected a config file or --key=value")


def split_args(argv: list[str], fields) -> tuple[list[str], list[str]]:
    """argv split into the arguments of `fields` (a tool's own options, in apply_args' dialect: --key=value,
    --key value, a boolean's bare --key) and the rest (config files and train.py's --key=value overrides)."""
    own, rest, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        key, sep, _ = arg[2:].partition("=")
        key = key.replace("-", "_")
        if not arg.startswith("--") or key not in fields:
            rest.append(arg)
            i += 1
            continue
        takes_next = not sep and i + 1 < len(argv) and not argv[i + 1].startswith("--") and (
            fields[key][1] is not bool or argv[i + 1].lower() in ("true", "false", "1", "0", "yes", "no"))
        own.extend(argv[i:i + 1 + takes_next])
        i += 1 + takes_next
    return own, rest


def config_files(argv: list[str]) -> list[str]:
    """The config files among train.py-style arguments: the positional ones, not the value of a --key value."""
    files, i = [], 0
    while i < len(argv):
        arg, following = argv[i], argv[i + 1] if i + 1 < len(argv) else ""
        key, sep, _ = arg[2:].partition("=")
        key = key.replace("-", "_")
        if not arg.startswith("-"):
            files.append(arg)
        elif arg.startswith("--") and not sep and key in _FIELDS and not following.startswith("--") and (
                _FIELDS[key][1] is not bool or following.lower() in ("true", "false", "1", "0", "yes", "no")):
            i += 1  # its value
        i += 1
    return files


MAX_TAG, MAX_GROUP = 64, 128  # wandb's own limits (it refuses a longer tag; the server a longer group name)


def split_tags(text: str) -> list[str]:
    """wandb_tags as a list: comma-separated, a leading + (adding to the derived tags) removed."""
    text = text[1:] if text.startswith("+") else text
    return [tag.strip() for tag in text.split(",")] if text.strip() else []


def tags_problem(text: str) -> str:
    """Why a wandb_tags value cannot be used ("" when it can), with the fix."""
    if not text.strip():
        return ""
    tags = split_tags(text)
    if not tags:
        return "a lone '+' adds no tag: give the tags after it, e.g. +ablation,lr_sweep"
    if not all(tags):
        return "has an empty tag (two commas in a row, or one at an end): write the tags as a,b,c"
    long = next((tag for tag in tags if len(tag) > MAX_TAG), None)
    if long:
        return f"the tag {long[:24]!r}... is {len(long)} characters long; wandb takes at most {MAX_TAG}"
    return ""


def cuda_graphs_problem(t: TrainConfig) -> None:
    """cuda_graphs=True where it cannot work: a ConfigError naming the setting in the way and the fix. Gradient
    accumulation depends on the number of processes and is refused by train.py (one micro-batch per process)."""
    if not t.compile:
        raise ConfigError("cuda_graphs=True replays the compiled blocks as CUDA graphs (torch.compile "
                          "mode=reduce-overhead) and needs compile=True: add --compile=True, or drop --cuda_graphs")
    if t.parallelism == "fsdp":
        raise ConfigError("cuda_graphs=True with parallelism=fsdp: FSDP2 gathers and frees each block's weights "
                          "around its forward and backward, collectives and allocations outside the graphs that "
                          "CUDA graph trees do not replay (not supported here): use --parallelism=ddp, or "
                          "--cuda_graphs=False")


def context_parallel_check(m, t) -> None:
    """context_parallel's own refusals, before any process group or data: the length, the layers, the settings it
    does not compose with yet."""
    P = t.context_parallel
    if P < 1:
        raise ConfigError(f"context_parallel={P}: must be >= 1 (1: whole sequences on every process)")
    if P == 1:
        return
    if m.block_size % P:
        raise ConfigError(f"context_parallel={P}: block_size={m.block_size} does not cut into {P} equal shards; use a "
                          f"block_size divisible by {P}")
    served = {name: MIXERS[name].context_parallel for name in pattern_names(m.attn_pattern) if name in MIXERS}
    if not all(served.values()):
        unserved = ", ".join(sorted(name for name, ok in served.items() if not ok))
        raise ConfigError(f"context_parallel={P}: the {unserved} layers have no context-parallel form (their edges "
                          "are drawn over the whole sequence, or their kernel was not written for shards: "
                          "docs/context_parallel.md); train them with context_parallel=1")
    for key, on in (("cuda_graphs=True", t.cuda_graphs),):
        if on:
            raise ConfigError(f"context_parallel={P} with {key}: not supported yet (docs/context_parallel.md); "
                              f"drop {key.split('=')[0]} or use context_parallel=1")


def validate(cfg: Config) -> None:
    """Check values that a type alone does not constrain; raise ConfigError naming the fix."""
    m, t = cfg.model, cfg.train

    def choice(key, value, allowed):
        if value not in allowed:
            raise ConfigError(f"{key}={value!r}: expected one of {', '.join(map(repr, allowed))}")

    def positive(key, value, allow_zero=False):
        if value < 0 or (value == 0 and not allow_zero):
            raise ConfigError(f"{key}={value}: must be {'>= 0' if allow_zero else '> 0'}")

    choice("arch", m.arch, ("gpt2", "llama"))
    choice("pos_embedding", m.pos_embedding, ("auto", "learned", "rope", "none"))
    if t.init_from not in ("scratch", "resume", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl") \
            and not (t.init_from.startswith("hf:") and len(t.init_from) > 3):
        raise ConfigError(f"init_from={t.init_from!r}: expected scratch, resume, gpt2, gpt2-medium, gpt2-large, gpt2-xl "
                          "or hf:NAME_OR_PATH")
    choice("gelu", m.gelu, ("exact", "tanh"))
    choice("dtype", t.dtype, ("auto", "float32", "bfloat16", "float16"))
    choice("wandb_mode", t.wandb_mode, ("online", "offline", "disabled"))
    if len(t.wandb_group) > MAX_GROUP or t.wandb_group != t.wandb_group.strip():
        raise ConfigError(f"wandb_group={t.wandb_group[:40]!r}{'...' if len(t.wandb_group) > 40 else ''}: a group name "
                          f"has at most {MAX_GROUP} characters and no spaces at its ends (empty: the recipe, data and "
                          "model size)")
    if tags_problem(t.wandb_tags):
        raise ConfigError(f"wandb_tags={t.wandb_tags!r}: {tags_problem(t.wandb_tags)}")
    choice("resume_from", t.resume_from, ("last", "best"))
    choice("window_schedule", t.window_schedule, ("fixed", "stochastic"))
    choice("activation_checkpointing", t.activation_checkpointing, ("none", "full", "selective"))
    choice("parallelism", t.parallelism, ("ddp", "fsdp"))
    if t.init_from == "resume" and t.replace_run:
        raise ConfigError("init_from=resume continues the run in out_dir, and replace_run=True moves it aside to start "
                          "a fresh one there: pass one of them")
    context_parallel_check(m, t)
    if t.parallelism == "fsdp" and t.dtype == "float16":
        raise ConfigError("parallelism=fsdp trains in bfloat16 or float32 (float16 would need a sharded gradient "
                          "scaler): use --dtype=bfloat16, or --parallelism=ddp for float16")
    if t.cuda_graphs:
        cuda_graphs_problem(t)
    positive("swax_short_window", t.swax_short_window)
    for key in ("swax_short_prob", "swax_anneal_frac"):
        if not 0.0 <= get_value(cfg, key) <= 1.0:
            raise ConfigError(f"{key}={get_value(cfg, key)}: must be in [0, 1]")
    if t.window_schedule == "stochastic" and t.swax_short_window >= m.swa_window:
        raise ConfigError(f"swax_short_window={t.swax_short_window} must be smaller than swa_window={m.swa_window}, "
                          "the long window that stochastic training alternates it with (and evaluates with)")
    if not (t.device in ("auto", "cpu", "cuda", "mps") or t.device.startswith("cuda:")):
        raise ConfigError(f"device={t.device!r}: expected auto, cpu, cuda or cuda:N")
    for key in ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "gradient_accumulation_steps",
                "log_interval", "eval_interval", "eval_iters"):
        positive(key, get_value(cfg, key))
    for key in ("max_iters", "warmup_iters", "lr_decay_iters", "ckpt_interval", "vocab_size", "mlp_hidden",
                "eval_tasks_interval", "loss_chunk"):
        positive(key, get_value(cfg, key), allow_zero=True)
    positive("n_kv_head", m.n_kv_head, allow_zero=True)
    positive("attn_head_dim", m.attn_head_dim, allow_zero=True)
    if m.n_embd % m.n_head and not m.attn_head_dim:
        raise ConfigError(f"n_embd={m.n_embd} is not divisible by n_head={m.n_head}")
    if m.n_head % m.kv_heads:
        raise ConfigError(f"n_kv_head={m.n_kv_head} does not divide n_head={m.n_head}")
    if m.resolved_pos_embedding == "rope" and m.head_dim % 2:
        raise ConfigError(f"rope needs an even head dimension; the head dimension is {m.head_dim}")
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"dropout={m.dropout}: must be in [0, 1)")
    if t.learning_rate <= 0 or t.min_lr < 0 or t.min_lr > t.learning_rate:
        raise ConfigError(f"need 0 <= min_lr <= learning_rate and learning_rate > 0 "
                          f"(got learning_rate={t.learning_rate}, min_lr={t.min_lr})")
    unknown = {task for task in cfg.eval.eval_tasks.split(",") if task} - {"ppl", "niah"}
    if unknown:
        raise ConfigError(f"eval_tasks: unknown {', '.join(sorted(unknown))}; expected ppl and/or niah")
    try:
        [int(x) for x in cfg.eval.eval_task_lengths.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"eval_task_lengths={cfg.eval.eval_task_lengths!r}: expected integers, e.g. 256,1024") from None
    problem = unread_settings_problem(m, cfg.given)  # "" for a pattern that cannot be read: refused just below
    if problem:
        raise ConfigError(problem)
    try:
        validate_attention(m)  # variants check their own fields
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if t.window_schedule != "fixed" and not has_window_layers(m):
        raise ConfigError(f"window_schedule={t.window_schedule} changes the window of sliding-window layers, and "
                          f"attn_pattern={m.attn_pattern!r} has none: add swa layers (e.g. attn_pattern=swax) or use "
                          "window_schedule=fixed")


def process_device(name: str, local_rank: int = 0):
    """The torch.device one training process runs on, for a resolved --device name: a bare "cuda" becomes the
    process's own GPU (its local rank's, 0 without torchrun), since torch.cuda.set_device refuses a device
    without an index."""
    import torch

    device = torch.device(name)
    return torch.device("cuda", local_rank) if device.type == "cuda" and device.index is None else device


def resolve_device(name: str) -> str:
    """The device a --device setting names here: auto picks cuda when there is one; a device this machine does
    not have is a ConfigError naming the fix (a traceback from deep inside torch otherwise)."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={name} but CUDA is not available here (torch {torch.__version__}): use "
                          "--device=cpu or --device=auto")
    if name == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("device=mps but Apple's Metal (MPS) is not available here: use --device=cpu or --device=auto")
    if not (name in ("cpu", "cuda", "mps") or name.startswith("cuda:") and name[5:].isdigit()):
        raise ConfigError(f"device={name!r}: expected auto, cpu, cuda, cuda:N or mps")
    if name.startswith("cuda:") and int(name[5:]) >= torch.cuda.device_count():
        raise ConfigError(f"device={name}: this machine has {torch.cuda.device_count()} GPU(s)")
    return name


def load_config(argv: list[str]) -> Config:
    cfg = Config()
    apply_args(cfg, argv)
    validate(cfg)
    return cfg


def exit_on_config_error(fn, *args):
    """Run fn(*args); a ConfigError becomes a one-line message and exit status 2."""
    try:
        return fn(*args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)


def dataclass_fields(cls) -> dict[str, tuple[str, type]]:
    """Flat field table for a single dataclass (used by sample.py and the eval entry point)."""
    return {name: ("", typ) for name, typ in typing.get_type_hints(cls).items()}


def dumps(cfg: Config, **extra) -> str:
    return json.dumps({**cfg.to_dict(), **extra}, indent=2, sort_keys=False)
