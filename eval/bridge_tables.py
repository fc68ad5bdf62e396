"""Paper 004's tables and figures from a sweep's finished runs (scripts/bridges/sweep.py runs the sweep): Table 3
(means over seeds), Table 4 (bridge-window recovery), Tables 6-8 (per seed), Table 9 (paired comparisons) and
Figs. 2-5."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from config import ModelConfig
from eval.results import setting_items, setting_results, standing_setting
from eval.stats import format_p, paired_comparison
from model import GPT
from common.outputs import save_figure
from common.run_folder import read_metrics

FAMILIES = ["full", "swa", "se_bridge", "pbb", "bridge", "block"]  # Table 3's row order
LOCAL = FAMILIES[1:]
COLUMNS = [("needle", "Needle"), ("bridge_window", "Bridge-window"), ("semantic_exact", "Semantic exact"),
           ("semantic_paraphrase", "Semantic paraphrase"), ("clean_semantic", "Clean sem. avg"),
           ("semantic_distractor", "Semantic distractor"), ("semantic_boundary", "Semantic boundary"),
           ("boundary_tail", "Boundary tail"), ("boundary_sweep", "Boundary sweep")]
PER_SEED = [("Table 6: per-seed perplexity and standard needle retrieval", ["needle"]),
            ("Table 7: per-seed boundary-local diagnostics", ["bridge_window", "boundary_tail", "semantic_boundary"]),
            ("Table 8: per-seed semantically cued single-fact retrieval",
             ["semantic_exact", "semantic_paraphrase", "semantic_distractor"])]
PAIRS = [("clean_semantic", "se_bridge", "swa"), ("bridge_window", "bridge", "block"),
         ("bridge_window", "pbb", "block"), ("bridge_window", "se_bridge", "block"),
         ("bridge_window", "se_bridge", "swa"), ("needle", "swa", "se_bridge")]


def load_run(path: Path) -> dict:
    """Best validation perplexity, per-probe accuracy and per-example results of one finished run."""
    metrics = read_metrics(path / "metrics.jsonl")
    best = min(r["val_loss"] for r in metrics if "val_loss" in r)
    diag = json.loads((path / "eval" / "diagnostics.json").read_text())
    setting = standing_setting(diag)  # the full evaluation, not a --limit check beside it
    examples = setting_items(diag, "per_example", setting)
    results = setting_results(diag, setting)
    accuracy = {row["probe"]: row["accuracy"] for row in setting_items(diag, "rows", setting) if row["cell"] == "all"}
    semantic = [e for e in examples if e["probe"] in ("semantic_exact", "semantic_paraphrase")]
    if semantic:
        accuracy["clean_semantic"] = sum(e["correct"] for e in semantic) / len(semantic)
    for e in semantic:
        e["clean_semantic"] = True
    config = json.loads((path / "config.json").read_text())
    return {"ppl": math.exp(best), "accuracy": accuracy, "examples": examples,
            "prompt_nll": results.get("prompt_nll", []),
            "prompt_nll_boundary": results.get("prompt_nll_boundary", []), "model": config["model"],
            "answers_only": bool(config.get("data", {}).get("loss_after")),
            "geometry": results.get("geometry")}


def write_back(model_config: dict, family: str, n: int) -> int | None:
    """Positions given a bridge output (Table 2's coverage), from the layer itself."""
    if family not in ("bridge", "pbb", "se_bridge"):
        return None
    cfg = ModelConfig(**{**model_config, "attn_pattern": family, "n_layer": 1, "vocab_size": 64})
    with torch.device("meta"):  # the layer's rule only: no weights
        mixer = GPT(cfg).blocks[0].mixer
    return mixer.write_back_coverage(n)


def tables(runs: dict[str, dict[int, dict]]) -> tuple[str, dict]:
    families = [f for f in FAMILIES if runs.get(f)]
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    summary = {f: {"ppl": mean([r["ppl"] for r in runs[f].values()]),
                   **{key: mean([r["accuracy"][key] for r in runs[f].values()])
                      for key, _ in COLUMNS if all(key in r["accuracy"] for r in runs[f].values())}}
               for f in families}
    seeds = sorted({s for f in families for s in runs[f]})
    columns = [(key, name) for key, name in COLUMNS if any(key in summary[f] for f in families)]  # probes asked
    answers_only = any(r.get("answers_only") for f in families for r in runs[f].values())
    ppl_name = "Best PPL (answers)" if answers_only else "Best PPL"  # validation loss on the answers alone
    lines = ["## Table 3: perplexity and diagnostics (mean over seeds " + ", ".join(map(str, seeds)) + ")", "",
             f"| Architecture | {ppl_name} | " + " | ".join(name for _, name in columns) + " |",
             "|---|---|" + "---|" * len(columns)]
    local = [f for f in families if f in LOCAL]
    best = {key: (min if key == "ppl" else max)(summary[f].get(key, float("nan")) for f in local)
            for key in ["ppl"] + [k for k, _ in columns]} if local else {}
    for f in families:
        cells = []
        for key in ["ppl"] + [k for k, _ in columns]:
            value = summary[f].get(key)
            text = "-" if value is None else (f"{value:.2f}" if key == "ppl" else f"{value:.3f}")
            cells.append(f"**{text}**" if f in local and value is not None and value == best.get(key) else text)
        lines.append(f"| {f} | " + " | ".join(cells) + " |")
    lines += ["", "Four-candidate ranking accuracies (chance 0.25); bold: the best local model (Full excluded).", ""]

    if "bridge_window" in summary.get("block", {}) and "bridge_window" in summary.get("swa", {}):
        lines += ["## Table 4: bridge-window recovery", "",
                  "| Model | Bridge-window acc. | Gain over Block (Eq. 42) | SWA gap recovered (Eq. 43) | "
                  "Gain / 100 write-back positions |", "|---|---|---|---|---|"]
        block_acc, swa_acc = summary["block"]["bridge_window"], summary["swa"]["bridge_window"]
        any_run = next(iter(runs["block"].values()))
        n = any_run["geometry"]["length"] if any_run["geometry"] else any_run["model"]["block_size"]
        for f in ("bridge", "pbb", "se_bridge", "swa"):
            if "bridge_window" not in summary.get(f, {}):
                continue
            gain = summary[f]["bridge_window"] - block_acc
            gap = swa_acc - block_acc
            covered = write_back(next(iter(runs[f].values()))["model"], f, n)
            lines.append(f"| {f} | {summary[f]['bridge_window']:.3f} | {gain:+.3f} | "
                         + (f"{100 * gain / gap:.1f}%" if gap else "-") + " | "
                         + (f"{100 * gain / covered:+.3f} ({covered} of {n})" if covered else "-") + " |")
        lines.append("")

    for title, probes in PER_SEED:
        probes = [p for p in probes if any(p in summary[f] for f in families)]
        if not probes:
            continue
        with_ppl = title.startswith("Table 6")
        names = dict(COLUMNS)
        lines += [f"## {title}", "", "| Architecture | Seed | " + ("PPL | " if with_ppl else "")
                  + " | ".join(names[p] for p in probes) + " |", "|---|---|" + "---|" * (len(probes) + with_ppl)]
        for f in families:
            for seed, r in sorted(runs[f].items()):
                cells = ([f"{r['ppl']:.2f}"] if with_ppl else []) + \
                    [f"{r['accuracy'][p]:.3f}" if p in r["accuracy"] else "-" for p in probes]
                lines.append(f"| {f} | {seed} | " + " | ".join(cells) + " |")
        lines.append("")

    lines += ["## Table 9: paired comparisons (identical prompts per seed, pooled over seeds)", "",
              "| Probe | A - B | Pairs | Acc. A | Acc. B | Diff | Boot. 95% CI | A/B-only wins | McNemar p |",
              "|---|---|---|---|---|---|---|---|---|"]
    paired = []
    for probe, a, b in PAIRS:
        if a not in runs or b not in runs:
            continue
        common = sorted(set(runs[a]) & set(runs[b]))
        pick = lambda fam: [{**e, "id": f"s{s}/{e['id']}"} for s in common for e in runs[fam][s]["examples"]  # noqa: E731
                            if e.get(probe) or e["probe"] == probe]
        if not pick(a) or not pick(b):  # a probe these runs were not asked (the semantic ones in the recall format)
            continue
        result = paired_comparison(pick(a), pick(b))
        paired.append({"probe": probe, "a": a, "b": b, **result})
        ci = result["bootstrap"]
        lines.append(f"| {probe} | {a} - {b} | {result['n']:,} | {result['acc_a']:.3f} | {result['acc_b']:.3f} | "
                     f"{ci['diff']:+.3f} | [{ci['ci_low']:+.3f}, {ci['ci_high']:+.3f}] | "
                     f"{result['a_only']}/{result['b_only']} | {format_p(result['mcnemar']['p_value'])} |")
    lines.append("")

    nll = {}
    if answers_only:  # the other tokens' predictions were never trained: their NLL says nothing
        lines += ["Fig. 5 (prompt-token NLL) is not tabulated: these runs were trained on the answers alone.", ""]
    elif "block" in runs:
        lines += ["## Fig. 5: prompt-token NLL improvement over Block (needle prompts, 16-token bins)", "",
                  "| Model | mean gain, bins starting in a write-back region [p, p + h) | mean gain, other bins |",
                  "|---|---|---|"]
        geometry = next(iter(runs["block"].values()))["geometry"]
        block_bins = {}
        for r in runs["block"].values():
            for row in r["prompt_nll"]:
                block_bins.setdefault(row["bin_start"], []).append(row["nll"])
        for f in families:
            if f == "block":
                continue
            gains = {}
            for r in runs[f].values():
                for row in r["prompt_nll"]:
                    gains.setdefault(row["bin_start"], []).append(mean(block_bins[row["bin_start"]]) - row["nll"])
            nll[f] = {start: mean(values) for start, values in gains.items()}
            repaired = lambda start: start >= geometry["block"] and start % geometry["block"] < geometry["half"]  # noqa: E731
            inside = [g for start, g in nll[f].items() if repaired(start)]
            outside = [g for start, g in nll[f].items() if not repaired(start)]
            lines.append(f"| {f} | {mean(inside):+.4f} | {mean(outside):+.4f} |" if inside and outside else f"| {f} | - | - |")
        lines.append("")
    return "\n".join(lines), {"summary": summary, "paired": paired, "prompt_nll_gain_over_block": nll}


def cell_accuracy(examples: list[dict], probes: tuple, key: str) -> dict:
    """{cell value: accuracy} over the examples of the given probes, by example field `key` (distance d, offset)."""
    cells = {}
    for e in examples:
        if e["probe"] in probes and key in e:
            cells.setdefault(e[key], []).append(e["correct"])
    return {value: sum(c) / len(c) for value, c in sorted(cells.items())}


def figures(runs: dict[str, dict[int, dict]], out: Path) -> list[Path]:
    """Figs. 2-5 of paper 004 from the runs' per-example results and prompt NLL (PNGs in out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    families = [f for f in FAMILIES if runs.get(f)]
    colors = dict(zip(FAMILIES, ["black", "tab:blue", "tab:red", "tab:orange", "tab:green", "tab:gray"]))
    written = []

    def save(fig, name):
        path = out / name
        fig.tight_layout()
        save_figure(fig, path)
        written.append(path)

    def curves(ax, probes, key, title, xlabel):
        drawn = False
        for f in families:
            per_seed = [cell_accuracy(r["examples"], probes, key) for r in runs[f].values()]
            xs = sorted(set.intersection(*(set(c) for c in per_seed))) if per_seed else []
            if not xs:
                continue
            values = np.array([[c[x] for x in xs] for c in per_seed])
            mean, std = values.mean(0), values.std(0)
            ax.plot(xs, mean, marker="o", markersize=3, color=colors[f], label=f)
            if len(per_seed) > 1:
                ax.fill_between(xs, mean - std, mean + std, color=colors[f], alpha=0.15)
            drawn = True
        ax.axhline(0.25, color="gray", linestyle=":", linewidth=1)  # four-candidate chance
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("accuracy")
        ax.set_ylim(-0.02, 1.02)
        return drawn

    fig, ax = plt.subplots(figsize=(6, 4))
    if curves(ax, ("needle",), "d", "Fig. 2: standard needle retrieval by distance", "distance (tokens)"):
        ax.legend(fontsize=8)
        save(fig, "fig2_needle_by_distance.png")
    else:
        plt.close(fig)
    semantic = ("semantic_exact", "semantic_paraphrase", "semantic_distractor")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    drawn = [curves(ax, (p,), "d", f"Fig. 3: {p.replace('_', ' ')}", "distance (tokens)")
             for ax, p in zip(axes, semantic)]
    if any(drawn):
        axes[0].legend(fontsize=8)
        save(fig, "fig3_semantic_by_distance.png")
    else:
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4))
    if curves(ax, ("boundary_sweep",), "offset", "Fig. 4: accuracy by offset from the block boundary",
              "offset of the answer from the boundary (tokens; positive: after it)"):
        ax.axvline(0, color="gray", linestyle="--", linewidth=1)
        ax.legend(fontsize=8)
        save(fig, "fig4_boundary_offset.png")
    else:
        plt.close(fig)
    if "block" in runs and not any(r.get("answers_only") for f in families for r in runs[f].values()):
        geometry = next(iter(runs["block"].values()))["geometry"]
        panels = [(key, title) for key, title in (("prompt_nll", "(a) standard needle prompts"),
                                                  ("prompt_nll_boundary", "(b) boundary-focused prompts"))
                  if all(r.get(key) for r in runs["block"].values())]
        others = [f for f in families if f != "block"]
        if panels and others:
            fig, axes = plt.subplots(len(panels), 1, figsize=(12, 1.2 + 0.45 * len(others) * len(panels) + 1),
                                     squeeze=False)
            for ax, (key, title) in zip(axes[:, 0], panels):
                block = {}
                for r in runs["block"].values():
                    for row in r[key]:
                        block.setdefault(row["bin_start"], []).append(row["nll"])
                starts = sorted(block)
                grid = []
                for f in others:
                    gain = {}
                    for r in runs[f].values():
                        for row in r.get(key, []):
                            gain.setdefault(row["bin_start"], []).append(np.mean(block[row["bin_start"]]) - row["nll"])
                    grid.append([max(0.0, float(np.mean(gain[s]))) if s in gain else 0.0 for s in starts])
                image = ax.imshow(grid, aspect="auto", cmap="Reds", vmin=0,
                                  extent=(starts[0] - 1, starts[-1] - 1 + 16, len(others) - 0.5, -0.5))
                for boundary in range(geometry["block"], geometry["length"], geometry["block"]):
                    ax.axvline(boundary, color="gray", linestyle="--", linewidth=0.8)
                ax.set_yticks(range(len(others)), others)
                ax.set_title(f"Fig. 5 {title}: NLL improvement over Block, 16-token bins", fontsize=10)
                ax.set_xlabel("prompt position")
                fig.colorbar(image, ax=ax, label="nats")
            save(fig, "fig5_prompt_nll.png")
    return written
