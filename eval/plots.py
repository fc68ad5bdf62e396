"""The comparison's figures: loss curves, perplexity by length, retrieval by length (a seed group as its mean
over seeds) and the NLL gain by window position, written as PNGs."""

from __future__ import annotations

from pathlib import Path

from eval.compare import CompareError, is_number, warn
from eval.results import data_label, setting_items, standing_setting
from eval.stats import mean_std
from eval.summaries import weighted_mean
from eval.tables import group_name
from common.outputs import save_figure


def _pyplot():
    try:
        import matplotlib  # optional, and slow to import: only --plot needs it
    except ImportError:
        raise CompareError("--plot needs matplotlib: pip install matplotlib") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, axes, path):
    """Grid, legend, layout, then write the figure as a PNG and close it; returns the path."""
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


def _colors(plt, n):
    cmap = plt.get_cmap("tab10" if n <= 10 else "tab20")
    return [cmap(i % cmap.N) for i in range(n)]


def _log2_lengths(ax, lengths):
    ax.set_xscale("log", base=2)
    ticks = sorted(set(lengths))
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{t // 1024}K" if t >= 1024 and t % 1024 == 0 else str(t) for t in ticks])
    ax.minorticks_off()


def unigram_baseline(record: dict) -> float | None:
    """The validation text's unigram entropy, which train.py saves with the data's meta in config.json."""
    meta = record["config"].get("data_meta") if isinstance(record["config"].get("data_meta"), dict) else {}
    value = meta.get("unigram_entropy")
    return float(value) if is_number(value) else None


def _mean_curve(curves: list[list]) -> tuple[list, list]:
    """[(step, mean)] and [std] over the steps every curve has (sample std over the curves)."""
    common = set.intersection(*(set(step for step, _ in c) for c in curves)) if curves else set()
    values = [dict(c) for c in curves]
    stats = [(step, *mean_std([v[step] for v in values])) for step in sorted(common)]
    return [(step, m) for step, m, _ in stats], [sd for _, _, sd in stats]


def ppl_series(result: dict) -> tuple[list[dict], dict]:
    """A run's perplexity rows as plotted, and the labels of its series: the trained window's rows are the
    model as trained (one series, said once: "(as trained, window W)"), and results on other data than the run's
    own validation split are named ("data": " (data NAME)")."""
    rows = [row for row in standing_rows(result) if is_number(row.get("length")) and is_number(row.get("ppl"))]
    if "series_label" in result:  # a seed group's mean rows, already as plotted
        return rows, result["series_label"]
    trained = result.get("trained_window")
    plain = {row["length"] for row in rows if row.get("window") is None}
    rows = [{**row, "window": None} if trained is not None and row.get("window") == trained else row for row in rows
            if not (trained is not None and row.get("window") == trained and row["length"] in plain)]
    label = {}
    if trained is not None and any(row.get("window") is not None for row in rows):
        label[None] = f" (as trained, window {trained})"
    if standing_data(result):
        label["data"] = standing_data(result)
    return rows, label


def standing_data(result: dict) -> str:
    """" (data NAME)" when a task's standing setting was computed on other data than the run's own validation
    split, else ""."""
    data = data_label((result.get("settings") or {}).get(standing_setting(result)) or {})
    return f" ({data.replace('=', ' ')})" if data else ""


def standing_rows(result: dict) -> list[dict]:
    """The rows that stand for a task's result in plots: those of its standing setting (all rows of a result from
    before settings were recorded)."""
    return setting_items({"results": result}, "rows", standing_setting(result))


def seed_group_records(records: list[dict], tables: dict) -> list[dict]:
    """What the plots draw: a seed group of several runs as one record (its name and seed count; loss curves
    and perplexities as means over the seeds, with their sample std for a band), other runs as they are."""
    by_name = {r["name"]: r for r in records}
    out = []
    for g in tables["groups"]:
        members = [by_name[n] for n in g["runs"]]
        if len(members) == 1:
            out.append(members[0])
            continue
        train, train_std = _mean_curve([m["train"] for m in members])
        val, val_std = _mean_curve([m["val"] for m in members])
        cells: dict = {}
        for m in members:
            for row in ppl_series(m["evals"].get("ppl", {}))[0]:
                cells.setdefault((row["length"], row.get("window")), []).append(row["ppl"])
        ppl_rows = [{"length": length, "window": window, "ppl": mean, "ppl_std": std}
                    for (length, window), values in cells.items() if len(values) == len(members)
                    for mean, std in [mean_std(values)]]
        niah_rows = [row for m in members for row in standing_rows(m["evals"].get("niah", {}))]  # equal weights
        out.append({**members[0], "name": f"{group_name(g)} ({len(members)} seeds)", "train": train,
                    "val": val, "train_std": train_std, "val_std": val_std,
                    "evals": {"ppl": {"rows": ppl_rows, "series_label": ppl_series(members[0]["evals"].get("ppl", {}))[1]},
                              "niah": {"rows": niah_rows}}})
    return out


def plot_all(records: list[dict], out_dir: Path) -> list[Path]:
    plt = _pyplot()
    from matplotlib import ticker  # matplotlib is optional: imported only once a plot is asked for

    colors = _colors(plt, len(records))
    written = []

    def after_step_0(record, key):  # validation from the first evaluation after step 0 (the untrained model)
        stds = record.get(f"{key}_std") or [None] * len(record[key])  # std: a seed group's spread
        points = [(step, v, sd) for (step, v), sd in zip(record[key], stds)]
        return [p for p in points if p[0] > 0] if key == "val" else points

    curves = [(r, c, after_step_0(r, "train"), after_step_0(r, "val")) for r, c in zip(records, colors)]
    if not any(train or val for _, _, train, val in curves):  # no curve to draw: no empty figure
        warn("no training or validation losses to plot: loss_curves.png not written")
        curves = []
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for record, color, *pair in curves:
        for ax, curve in zip(axes, pair):
            if curve:
                steps, values, stds = zip(*curve)
                ax.plot(steps, values, color=color, label=record["name"], marker="o" if len(curve) < 15 else None,
                        markersize=3)
                if stds[0] is not None:  # a seed group: mean +- std over its seeds
                    ax.fill_between(steps, [v - sd for v, sd in zip(values, stds)],
                                    [v + sd for v, sd in zip(values, stds)], color=color, alpha=0.2, linewidth=0)
    baselines = {round(b, 6) for b in (unigram_baseline(r) for r, *_ in curves) if b is not None}
    for baseline in sorted(baselines):  # the loss of predicting token frequencies alone
        for ax in axes:
            ax.axhline(baseline, color="gray", linestyle=":", linewidth=1,
                       label="unigram baseline" if len(baselines) == 1 else f"unigram {baseline:.3f}")
    band = " (shaded: ± 1 std over seeds)" if any(r.get("val_std") for r in records) else ""
    for ax, title in zip(axes if curves else [], ("Training loss", "Validation loss")):
        ax.set_title(title + band)
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats per token)")
        ax.set_yscale("log")  # early losses are several times the final ones
        ax.yaxis.set_major_locator(ticker.MaxNLocator(8))
        ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%.3g"))
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
    if curves:
        written.append(_save(fig, axes, out_dir / "loss_curves.png"))
    else:
        plt.close(fig)

    ppl = [(r, c, ppl_series(r["evals"].get("ppl", {}))) for r, c in zip(records, colors)]
    if any(rows for _, _, (rows, _) in ppl):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        styles, markers = ["-", "--", ":", "-."], ["o", "s", "^", "D"]
        windows = sorted({row.get("window") for _, _, (rows, _) in ppl for row in rows},
                         key=lambda w: (w is not None, w or 0))
        series = [(record, color, i, window, label, rows) for record, color, (rows, label) in ppl
                  for i, window in enumerate(windows) if any(row.get("window") == window for row in rows)]
        # every point at its own length; series that meet at one length stay visible as nested hollow markers,
        # the first series' largest (never shifted along the axis, which would misplace them)
        sizes = [max(3.0, 10.0 - 6.0 * k / max(1, len(series) - 1)) for k in range(len(series))]
        for k, (record, color, i, window, label, rows) in enumerate(series):
            points = sorted((row["length"], row["ppl"], row.get("ppl_std")) for row in rows if row.get("window") == window)
            name = record["name"] + (f" (window {window})" if window is not None else label.get(None, "")) \
                + label.get("data", "")
            lengths, values, stds = zip(*points)
            ax.plot(lengths, values, color=color, linestyle=styles[i % 4], marker=markers[i % 4],
                    markersize=sizes[k], fillstyle="none", markeredgewidth=1.5, label=name)
            if stds[0] is not None:  # a seed group: mean +- std over its seeds
                ax.fill_between(lengths, [v - sd for v, sd in zip(values, stds)],
                                [v + sd for v, sd in zip(values, stds)], color=color, alpha=0.2, linewidth=0)
        _log2_lengths(ax, [row["length"] for _, _, (rows, _) in ppl for row in rows])
        trained = sorted({r["config"].get("model", {}).get("block_size") for r, _, (rows, _) in ppl if rows} - {None})
        for i, length in enumerate(trained):  # where extrapolation begins
            ax.axvline(length, color="0.5", linestyle=":", linewidth=1,
                       label="training length" + (f"s ({', '.join(map(str, trained))})" if len(trained) > 1 else
                                                  f" ({length})") if i == 0 else None)
        ax.set_title("Perplexity vs evaluation length" + band)
        ax.set_xlabel("evaluation length (tokens)")
        ax.set_ylabel("perplexity")
        written.append(_save(fig, [ax], out_dir / "ppl_vs_length.png"))

    niah = [(r, c, standing_rows(r["evals"].get("niah", {}))) for r, c in zip(records, colors)]
    if any(rows for _, _, rows in niah):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        all_lengths = []
        for record, color, rows in niah:
            lengths = sorted({row["length"] for row in rows if is_number(row.get("length"))})
            points = [(n, weighted_mean([row for row in rows if row.get("length") == n and row.get("kind") != "average"],
                                          "acc_rank")) for n in lengths]
            points = [(n, v) for n, v in points if v is not None]
            if points:
                all_lengths += [n for n, _ in points]
                ax.plot(*zip(*points), color=color, marker="o",
                        label=record["name"] + standing_data(record["evals"].get("niah", {})))
        _log2_lengths(ax, all_lengths)
        ax.set_ylim(-0.02, 1.02)
        ax.set_title("Needle retrieval vs context length (rank accuracy, mean over depth and kind)")
        ax.title.set_fontsize(10)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("accuracy (acc_rank)")
        written.append(_save(fig, [ax], out_dir / "retrieval_vs_distance.png"))
    return written


def plot_position_gain(result: dict, out_dir: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    size = result["bin"]
    labels = [label for label in result["groups"] if label != result["reference"]]
    for label, color in zip(labels, _colors(plt, len(labels))):
        bins = result["groups"][label]["bins"]
        starts = [i * size for i in range(len(bins))]
        ax.errorbar(starts, [m for m, _ in bins], yerr=[sd for _, sd in bins], color=color, marker="o",
                    markersize=3, capsize=2, label=label)
    for boundary in range(result["block"], result["length"], result["block"]):
        ax.axvline(boundary, color="gray", linestyle="--", linewidth=0.8)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_title(f"NLL gain over {result['reference']} by window position ({size}-token bins; dashed: block "
                 f"boundaries)")
    ax.title.set_fontsize(9)
    ax.set_xlabel("position in the evaluation window (bin start)")
    ax.set_ylabel("reference NLL - model NLL")
    return _save(fig, [ax], out_dir / "position_gain.png")
