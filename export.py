"""Export a trained run as a Hugging Face folder (`save_pretrained`) with its tokenizer, which
`AutoModelForCausalLM`, `lm_eval --model hf` and the Hub take.

    python export.py --out_dir=out/quickstart                      # writes out/quickstart/hf
    python export.py --out_dir=out/run --ckpt=last --to=exports/run --format=project

Where transformers has a class that computes exactly what the run's layers compute, the folder is that class
(`--format=auto`, the default):
- gpt2 arch, full attention, learned positions -> `GPT2LMHeadModel`;
- llama arch, full attention -> `LlamaForCausalLM` (`Qwen3ForCausalLM` with qk_norm, `Qwen2ForCausalLM` with
  qkv_bias);
- llama arch, swa at one window -> `MistralForCausalLM` (Qwen3 / Qwen2 with every layer sliding, as above).
Every other run (sa, sa_swa, swat, mswa, moba, the bridges, linear, swax, mlstm, gated_deltanet, mixed
patterns, attn_gate, ...) is written as this project's model class (runtime/hf_gpt.py, model_type
`efficient_attention_gpt`): config.json carries `auto_map` to a small `modeling_efficient_attention_gpt.py`
that imports runtime.hf_gpt, so `from_pretrained(FOLDER, trust_remote_code=True)` works wherever this project is
importable, and `import runtime.hf_gpt` registers the class without trust_remote_code (docs/pretrained.md says why).

The tokenizer is the run's, as tokenizer.json + tokenizer_config.json: byte and tiktoken tokenizers are
converted to byte-level BPE; a Hugging Face tokenizer is copied without its post-processor (the run was
trained on text encoded without added BOS tokens). BOS and EOS are the run's end-of-text token, which
separates documents in training, so an evaluation that conditions on BOS (lm-eval) conditions on it.

Before the folder is put in place, the export reloads it with `AutoModelForCausalLM` and compares logits with
the run's model on a probe sequence (float32): a mismatch past 1e-4 is refused, and nothing is written.
`export.json` records the run, checkpoint, step, class and why, the git hash, the command and every file the
export wrote. `--overwrite=True` replaces only such an earlier export (a folder whose export.json lists every
file in it); a run folder, a folder holding one, or a folder with anything else in it is refused and left as it
is. The folder and its files get the user's umask, like every other file the project writes.

A variant's inference settings (those declared `Setting(..., inference=True)`, such as sa's `--sa_mode`) may be
given: the export takes them instead of the run's (`--sa_mode=deterministic`: fixed permutations, so the exported
model's outputs are not drawn per forward); `export.json` records them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from attention.registry import SETTINGS, layer_names, validate_config
from attention.stochastic import drawn_per_forward
from config import ConfigError, apply_args, coerce, dataclass_fields, exit_on_config_error, unread_settings_problem
from data.tokenizer import TokenizerUnavailable
from model import GPT
from runtime.checkpoint import CheckpointError, git_hash, load_model, run_tokenizer
from runtime.hf_gpt import EfficientAttentionConfig, EfficientAttentionForCausalLM
from runtime.hf_tokenizer import HFTokenizerError, hf_tokenizer
from common.run_folder import holds_run

MODELING_FILE = "modeling_efficient_attention_gpt.py"
MODELING_SOURCE = '''"""This folder's model is the efficient-attention codebase's own class (runtime/hf_gpt.py there): its attention
variants and their kernels live in that codebase, which must be importable (a clone of it on PYTHONPATH, or
the current directory). Loaded by transformers with trust_remote_code=True, through config.json's auto_map."""

try:
    from runtime.hf_gpt import EfficientAttentionConfig, EfficientAttentionForCausalLM  # noqa: F401
except ImportError as e:
    raise ImportError(
        f"this model needs the efficient-attention codebase importable ({e}): clone it and add its folder to "
        "PYTHONPATH (or run from it), with its requirements installed; export.json names the commit it was "
        "exported from"
    ) from e
'''
VERIFY_TOLERANCE = 1e-4  # max |logit difference| the export accepts (float32; in practice 1e-6)


class ExportError(Exception):
    pass


@dataclass
class ExportConfig:
    out_dir: str = "out/quickstart"  # the run folder
    ckpt: str = "best"  # best | last
    to: str = ""  # the folder to write; empty: OUT_DIR/hf
    format: str = "auto"  # auto (transformers' own class where one is exact, else project) | project
    verify: bool = True  # reload the folder and compare logits with the run's before putting it in place
    overwrite: bool = False  # replace an earlier export at --to (never a run folder or anything else)


# transformers' own classes -----------------------------------------------------------------------------------

def native_target(m) -> tuple[str | None, str]:
    """(transformers model_type that computes exactly this ModelConfig, or None; why, for export.json)."""
    layers = set(layer_names(m))
    if layers - {"full", "swa"} or len(layers) != 1:
        return None, f"layers {', '.join(sorted(layers))}: transformers has no class with this attention"
    if m.attn_gate:
        return None, "attn_gate: transformers' classes have no attention output gate"
    pos = m.resolved_pos_embedding
    if m.arch == "gpt2":
        if layers != {"full"} or pos != "learned" or m.kv_heads != m.n_head or m.attn_head_dim not in (0, m.n_embd // m.n_head) \
                or m.qk_norm or m.qkv_bias:
            return None, "gpt2 arch with other than full attention, learned positions and plain heads"
        return "gpt2", "gpt2 arch, full attention, learned positions: GPT2LMHeadModel computes the same" + (
            "; document_mask: it masks no documents, so it equals the run on inputs without an end-of-text token "
            "inside them" if m.document_mask else "")
    for problem, why in ((pos != "rope", f"{pos} positions (transformers' Llama-family classes use RoPE)"),
                         (m.bias, "bias=True (the Llama-family classes have no biases on their projections)"),
                         (m.qk_norm and m.qkv_bias, "both qk_norm and qkv_bias (Qwen3 has one, Qwen2 the other)")):
        if problem:
            return None, f"llama arch with {why}"
    family = "qwen3" if m.qk_norm else "qwen2" if m.qkv_bias else ("llama" if layers == {"full"} else "mistral")
    unmasked = "; document_mask: it masks no documents, so it equals the run on inputs without an end-of-text " \
               "token inside them" if m.document_mask else ""
    return family, f"llama arch, {'full attention' if layers == {'full'} else f'swa({m.swa_window})'}: " \
                   f"{family}'s class computes the same" + unmasked


def native_config(m, family: str, tokenizer_ids: dict):
    if family == "gpt2":
        return AutoConfig.for_model("gpt2", vocab_size=m.vocab_size, n_positions=m.block_size, n_embd=m.n_embd,
                                    n_layer=m.n_layer, n_head=m.n_head, n_inner=m.resolved_mlp_hidden,
                                    activation_function="gelu_new" if m.gelu == "tanh" else "gelu",
                                    layer_norm_epsilon=m.norm_eps, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                    tie_word_embeddings=m.tie_embeddings, **tokenizer_ids)
    sliding = "swa" in m.attn_pattern
    kwargs = dict(vocab_size=m.vocab_size, hidden_size=m.n_embd, intermediate_size=m.resolved_mlp_hidden,
                  num_hidden_layers=m.n_layer, num_attention_heads=m.n_head, num_key_value_heads=m.kv_heads,
                  head_dim=m.head_dim, hidden_act="silu", max_position_embeddings=m.block_size,
                  rms_norm_eps=m.norm_eps, rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
                  tie_word_embeddings=m.tie_embeddings, attention_dropout=0.0, **tokenizer_ids)
    if family == "llama":
        kwargs.update(attention_bias=False, mlp_bias=False)
    elif family == "mistral":
        kwargs.update(sliding_window=m.swa_window)
    else:  # qwen2 / qwen3: every layer full or every layer sliding
        kwargs.update(use_sliding_window=sliding, sliding_window=m.swa_window if sliding else None,
                      max_window_layers=0 if sliding else m.n_layer,
                      layer_types=["sliding_attention" if sliding else "full_attention"] * m.n_layer)
        if family == "qwen3":
            kwargs.update(attention_bias=False)
    return AutoConfig.for_model(family, **kwargs)


def native_state_dict(gpt, family: str) -> dict:
    """The run's weights under transformers' names (the inverse of runtime/pretrained.py's adapters)."""
    m = gpt.config
    state = {name: value.detach() for name, value in gpt.state_dict().items()}
    out = {}
    if family == "gpt2":
        conv1d = ("mixer.c_attn.weight", "mixer.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
        zeros = {"ln_1.weight": "ln_1.bias", "ln_2.weight": "ln_2.bias", "mixer.c_attn.weight": "mixer.c_attn.bias",
                 "mixer.c_proj.weight": "mixer.c_proj.bias", "mlp.c_fc.weight": "mlp.c_fc.bias",
                 "mlp.c_proj.weight": "mlp.c_proj.bias"}
        for name, value in state.items():
            if name.startswith("blocks."):
                _, index, rest = name.split(".", 2)
                hf_rest = rest.replace("mixer.", "attn.")
                out[f"transformer.h.{index}.{hf_rest}"] = value.t().contiguous() if rest in conv1d else value
                if rest in zeros and f"blocks.{index}.{zeros[rest]}" not in state:  # bias=False: zero biases
                    out[f"transformer.h.{index}.{zeros[rest].replace('mixer.', 'attn.')}"] = value.new_zeros(value.shape[0])
            elif name == "lm_head.weight":
                if not m.tie_embeddings:
                    out[name] = value
            else:
                out[f"transformer.{name}"] = value
        if "ln_f.bias" not in state:
            out["transformer.ln_f.bias"] = state["ln_f.weight"].new_zeros(m.n_embd)
        return out
    renamed = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm", "mixer.c_proj": "self_attn.o_proj",
               "mixer.q_norm": "self_attn.q_norm", "mixer.k_norm": "self_attn.k_norm", "mlp.c_gate": "mlp.gate_proj",
               "mlp.c_fc": "mlp.up_proj", "mlp.c_proj": "mlp.down_proj"}
    q_rows, kv_rows = m.n_head * m.head_dim, m.kv_heads * m.head_dim
    for name, value in state.items():
        if name == "wte.weight":
            out["model.embed_tokens.weight"] = value
        elif name == "ln_f.weight":
            out["model.norm.weight"] = value
        elif name == "lm_head.weight":
            if not m.tie_embeddings:
                out[name] = value
        else:
            _, index, rest = name.split(".", 2)
            module, _, leaf = rest.rpartition(".")
            if module == "mixer.c_attn":
                q, k, v = value.split([q_rows, kv_rows, kv_rows], dim=0)
                for part, tensor in zip("qkv", (q, k, v)):
                    out[f"model.layers.{index}.self_attn.{part}_proj.{leaf}"] = tensor.contiguous()
            elif module in renamed:
                out[f"model.layers.{index}.{renamed[module]}.{leaf}"] = value
            else:
                raise ExportError(f"{name} has no counterpart in {family}'s class")
    return out


def native_model(gpt, family: str, tokenizer_ids: dict):
    hf_config = native_config(gpt.config, family, tokenizer_ids)
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    state = native_state_dict(gpt, family)
    expected = set(hf_model.state_dict()) - ({"lm_head.weight"} if gpt.config.tie_embeddings else set())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ExportError(f"the run's weights do not fill {type(hf_model).__name__}: missing {missing[:4]}, "
                          f"unexpected {unexpected[:4]}")
    hf_model.load_state_dict(state, strict=False, assign=True)
    if gpt.config.tie_embeddings:
        hf_model.tie_weights()
    return hf_model.eval()


# this project's class -----------------------------------------------------------------------------------------

def project_model(gpt, tokenizer_ids: dict):
    config = EfficientAttentionConfig(gpt=dataclasses.asdict(gpt.config), **tokenizer_ids)
    config.auto_map = {"AutoConfig": f"{MODELING_FILE[:-3]}.EfficientAttentionConfig",
                       "AutoModelForCausalLM": f"{MODELING_FILE[:-3]}.EfficientAttentionForCausalLM"}
    config.architectures = ["EfficientAttentionForCausalLM"]
    with torch.device("meta"):
        wrapper = EfficientAttentionForCausalLM(config)
    wrapper.model = gpt
    return wrapper.eval()


# the folder ---------------------------------------------------------------------------------------------------

def export_model(gpt, tokenizer, fmt: str = "auto"):
    """(transformers model, its tokenizer, the export record) for a GPT and its data.tokenizer."""
    hf_tok = hf_tokenizer(tokenizer)
    ids = {"bos_token_id": hf_tok.bos_token_id, "eos_token_id": hf_tok.eos_token_id}
    family, why = native_target(gpt.config) if fmt == "auto" else (None, "--format=project")
    model = native_model(gpt, family, ids) if family else project_model(gpt, ids)
    return model, hf_tok, {"class": type(model).__name__, "model_type": model.config.model_type, "why": why}


def probe_ids(config, vocab_size: int, packed: bool = False) -> torch.Tensor:
    """A sequence long enough to pass every window and block of the run (at most its block_size). A run that masks
    documents is probed without an end-of-text token inside the sequence (what lm-eval and generate send, and all a
    transformers class without a document mask can match), or, packed, with three (this project's class honours
    the mask)."""
    n = min(config.block_size, 512)
    ids = torch.randint(0, vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    if config.document_mask:
        ids[ids == config.eot_id] = (config.eot_id + 1) % vocab_size
        if packed:
            ids[0, [n // 5, n // 2, n // 2 + 1]] = config.eot_id
    return ids


def verify(folder: Path, gpt, trust_remote_code: bool) -> float:
    """Max |logit difference| between the folder reloaded by AutoModelForCausalLM and the run's model."""
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, trust_remote_code=trust_remote_code).eval()
    gpt = gpt.float()
    ids = probe_ids(gpt.config, gpt.config.vocab_size, packed=trust_remote_code)
    with torch.no_grad():  # the same seed for both: sa draws its permutations from torch's generator
        torch.manual_seed(0)
        ours, _ = gpt(ids)
        torch.manual_seed(0)
        theirs = hf(ids).logits
    return float((ours - theirs).abs().max())


EXPORT_RECORD = "export.json"


def written_files(folder: Path) -> list[str]:
    """Every file under folder, as paths relative to it (sorted)."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if not p.is_dir())


def destination_problem(to: Path, run_dir: Path, overwrite: bool) -> str:
    """Why the export may not be written at `to` ("" when it may): a file there, a folder that is not empty (without
    --overwrite), or, with --overwrite, a folder that is not an earlier export (the run's folder, a folder holding
    a run, anything with files export.json does not list). Checked before anything is loaded or written."""
    if to.exists() and not to.is_dir():
        return f"--to={to} is a file, not a folder: give --to a folder's path"
    for parent in to.parents:
        if parent.exists() and not parent.is_dir():
            return f"--to={to} lies under {parent}, which is a file: give --to a folder's path"
    if not to.exists() or not any(to.iterdir()):
        return ""
    if not overwrite:
        return f"{to} exists and is not empty: give another --to, or --overwrite=True to replace an earlier export there"
    resolved, run = to.resolve(), run_dir.resolve()
    if resolved == run or resolved in run.parents:
        return (f"--to={to} is {'the run folder' if resolved == run else 'a folder holding the run ' + str(run_dir)}: "
                "--overwrite replaces only an earlier export, never a run. Give --to a folder of its own, such as "
                f"{run_dir / 'hf'}")
    run_files = [name for name in holds_run(to) if name != "config.json"]  # an export has a config.json too
    if run_files:
        return (f"--to={to} holds a training run ({', '.join(run_files)}): --overwrite replaces only an earlier "
                "export, never a run. Give --to a folder of its own")
    record_path = to / EXPORT_RECORD
    try:
        record = json.loads(record_path.read_text())
        listed = set(record["files"])
    except (OSError, ValueError, KeyError, TypeError):
        why = "has no export.json" if not record_path.exists() else "has an export.json without the list of its files"
        return (f"--to={to} {why}, so it is not an export this tool wrote (or one from before exports listed their "
                "files): --overwrite replaces nothing else. Give another --to, or move or remove that folder yourself")
    others = [name for name in written_files(to) if name not in listed]
    if others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        return (f"--to={to} is an earlier export with other files in it ({shown}): --overwrite would delete them, "
                "so it replaces nothing. Move them out, or give another --to")
    return ""


def apply_umask(folder: Path) -> None:
    """Give the folder and everything in it the permissions the user's umask gives new files (mkdtemp makes a
    private 0700 folder, and some writers private 0600 files)."""
    mask = os.umask(0)
    os.umask(mask)
    for path in [folder, *folder.rglob("*")]:
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)


def export_run(cfg: ExportConfig, command: str = "", settings: dict | None = None) -> Path:
    to = Path(cfg.to or Path(cfg.out_dir) / "hf")
    problem = destination_problem(to, Path(cfg.out_dir), cfg.overwrite)
    if problem:
        raise ExportError(problem)
    gpt, _, raw = load_model(cfg.out_dir, cfg.ckpt, "cpu")
    gpt = gpt.float()
    if settings:  # the variants' inference settings (sa_mode): the same weights
        config = dataclasses.replace(gpt.config, **settings)
        problem = unread_settings_problem(config, {key: f"--{key}" for key in settings})
        if problem:
            raise ExportError(problem)
        try:
            validate_config(config)
        except ValueError as e:
            raise ExportError(str(e)) from None
        weights, gpt = gpt.state_dict(), GPT(config).eval()
        gpt.load_state_dict(weights)
    tokenizer = run_tokenizer(raw)
    model, hf_tok, record = export_model(gpt, tokenizer, cfg.format)
    to.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{to.name}.", dir=to.parent))
    old = None
    try:
        model.save_pretrained(tmp)
        hf_tok.save_pretrained(tmp)
        project = record["model_type"] == "efficient_attention_gpt"
        if project:
            (tmp / MODELING_FILE).write_text(MODELING_SOURCE)
        if cfg.verify:
            diff = verify(tmp, gpt, trust_remote_code=project)
            if not diff <= VERIFY_TOLERANCE:
                raise ExportError(f"the exported {record['class']} differs from the run by {diff:.3g} in the logits "
                                  f"(tolerance {VERIFY_TOLERANCE}): nothing was written")
            record["verified_max_logit_diff"] = diff
        if drawn_per_forward(gpt.config):
            record["drawn_per_forward"] = drawn_per_forward(gpt.config)
        if settings:
            record["inference_settings"] = settings
        record.update({"run": str(cfg.out_dir), "ckpt": raw.get("path"), "step": raw.get("step"),
                       "best_val_loss": raw.get("best_val_loss"), "tokenizer": tokenizer.identity(),
                       "git": git_hash(), "command": command,
                       "files": sorted([*written_files(tmp), EXPORT_RECORD])})
        (tmp / EXPORT_RECORD).write_text(json.dumps(record, indent=2, default=str) + "\n")
        apply_umask(tmp)
        problem = destination_problem(to, Path(cfg.out_dir), cfg.overwrite)  # again: it may have changed meanwhile
        if problem:
            raise ExportError(problem)
        if to.exists():  # an empty folder, or an earlier export: moved aside, removed once the new one is in place
            old = Path(tempfile.mkdtemp(prefix=f".{to.name}.old.", dir=to.parent))
            os.replace(to, old / to.name)
        os.replace(tmp, to)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not to.exists():
            os.replace(old / to.name, to)  # put the earlier export back
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return to


def parse(argv) -> tuple[ExportConfig, dict]:
    """The export's options, and the variants' inference settings given (Setting.inference: --sa_mode=...), which
    the exported model takes instead of the run's."""
    inference = {name: setting for name, setting in SETTINGS.items() if setting.inference}
    is_setting = lambda arg: arg.startswith("--") and arg[2:].partition("=")[0].replace("-", "_") in inference  # noqa: E731
    cfg = ExportConfig()
    apply_args(cfg, [arg for arg in argv if not is_setting(arg)], dataclass_fields(ExportConfig))
    if cfg.ckpt not in ("best", "last"):
        raise ConfigError(f"ckpt={cfg.ckpt}: must be best or last")
    if cfg.format not in ("auto", "project"):
        raise ConfigError(f"format={cfg.format}: must be auto or project")
    settings = {}
    for arg in filter(is_setting, argv):
        key, _, value = arg[2:].partition("=")
        key = key.replace("-", "_")
        settings[key] = coerce(key, value, inference[key].type)
    return cfg, settings


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg, settings = exit_on_config_error(parse, argv)
    try:
        folder = export_run(cfg, " ".join(["python export.py", *argv]), settings)
    except CheckpointError as e:  # missing or damaged: 1, as sample, eval and a resume say it
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (ExportError, HFTokenizerError, TokenizerUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a destination that cannot be written (read-only, full): nothing was put in place
        where = e.filename or cfg.to or Path(cfg.out_dir) / "hf"
        print(f"error: cannot write the export at {where}: {e.strerror or e}; nothing was written. Give --to a "
              "folder you can write", file=sys.stderr)
        return 2
    record = json.loads((folder / "export.json").read_text())
    print(f"wrote {folder}: {record['class']} ({record['why']})")
    if "drawn_per_forward" in record:
        print(f"note: the exported model's outputs are drawn per forward: {record['drawn_per_forward']}")
    if "verified_max_logit_diff" in record:
        print(f"reloaded with AutoModelForCausalLM: logits within {record['verified_max_logit_diff']:.2g} of the run's")
    if record["model_type"] == "efficient_attention_gpt":
        print(f"load it with this codebase importable: AutoModelForCausalLM.from_pretrained({str(folder)!r}, "
              "trust_remote_code=True), or `import runtime.hf_gpt` first")
    return 0


if __name__ == "__main__":
    sys.exit(main())
