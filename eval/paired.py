"""Runs compared beyond the table: paired statistics of two runs on the same examples of a task, and each seed
group's NLL gain over a reference group by position in the evaluation window."""

from __future__ import annotations

import numpy as np

from eval.compare import CompareError, is_number, warn
from eval.results import (describe_settings, own_data, reads_validation_text, setting_items, setting_options,
                          standing_setting)
from eval.stats import format_p, mean_std, paired_comparison
from eval.tables import group_name, markdown_table


def _sort_key(value):
    return (0, value, "") if is_number(value) else (1, 0, str(value))


def paired(run_a: dict, run_b: dict, task: str, key: str = "correct", by: str | None = None,
           n_boot: int = 10000, seed: int = 0) -> dict:
    """Paired statistics of two run records on one task's per_example results (overall, and per value of by),
    under an evaluation setting both were evaluated with (the same examples)."""
    results = []
    for record in (run_a, run_b):
        result = record["evals"].get(task)
        if result is None:
            raise CompareError(f"{record['source']} has no eval/{task}.json (run: python -m eval "
                               f"--out_dir={record['source']} --tasks={task})")
        if not result.get("per_example"):
            raise CompareError(f"{result.get('path', record['source'])} has no per_example results to pair")
        results.append(result)
    # a setting both were evaluated under (the same examples), else each one's own, said; the example ids must
    # then still be the same on both sides
    shared = set(results[0].get("settings") or {}) & set(results[1].get("settings") or {})
    chosen = [standing_setting(r) for r in results]
    if shared:  # one setting on both sides: the one both were most recently evaluated under, on their own
        #         validation split and full ones first
        both = lambda sid: (all(own_data(r["settings"][sid]) for r in results),  # noqa: E731
                            not results[0]["settings"][sid].get("limit"),
                            min(r["settings"][sid].get("evaluated_at") or 0 for r in results))
        chosen = [max(sorted(shared), key=both)] * 2
        if len(shared) > 1:
            labels = describe_settings({sid: results[0]["settings"][sid] for sid in shared})
            warn(f"{run_a['name']} and {run_b['name']} share {len(shared)} evaluation settings on {task}; pairing "
                 f"under {labels[chosen[0]]} ({chosen[0]}), the one both were most recently evaluated under")
    elif all(r.get("settings") for r in results):
        a, b = (setting_options(r["settings"][sid]) for r, sid in zip(results, chosen))
        data = [r["settings"][sid].get("data") or {} for r, sid in zip(results, chosen)]
        if reads_validation_text(task, a) and all(d.get("val_sha256") for d in data) \
                and data[0]["val_sha256"] != data[1]["val_sha256"]:  # windows of different text never pair
            raise CompareError(f"{run_a['name']} and {run_b['name']} were evaluated on {task} on different text "
                               f"({data[0].get('name')}, {data[0].get('val_tokens'):,} validation tokens; "
                               f"{data[1].get('name')}, {data[1].get('val_tokens'):,}): their examples share ids but "
                               "not text, so pairing them would be meaningless; evaluate both with the same --data_dir")
        differ = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        warn(f"{run_a['name']} and {run_b['name']} were evaluated on {task} under different settings "
             f"({', '.join(differ)} differ): pairing their examples by id")
    examples = [[x for x in r["per_example"] if x.get("setting") == sid] for r, sid in zip(results, chosen)]
    cells = sorted({str(x.get("cell")) for x in examples[0] if x.get("cell") is not None}, key=_sort_key)
    # perplexity scores the same validation text once per cell (each length, each window): windows of several
    # cells are not independent units, so pooling them is no test; each cell is one
    overlapping = task == "ppl" and len(cells) > 1
    if overlapping and not by:
        by = "cell"
    try:
        out = {"task": task, "key": key, "a": {"name": run_a["name"], "source": run_a["source"],
                                               "provenance": run_a["evals"][task].get("provenance")},
               "b": {"name": run_b["name"], "source": run_b["source"],
                     "provenance": run_b["evals"][task].get("provenance")},
               "all": paired_comparison(*examples, key=key, n_boot=n_boot, seed=seed)}
        if overlapping:
            out["all"]["not_a_test"] = (f"the cells {', '.join(cells)} score the same text: their windows pooled are "
                                        "not independent, so this row is a description, not a test")
        if by:
            values = sorted({e.get(by) for e in examples[0]}, key=_sort_key)
            if None in values:
                raise CompareError(f"--by {by}: some per_example items of {run_a['source']} lack '{by}'")
            out["by"] = by
            out["groups"] = {str(v): paired_comparison([e for e in examples[0] if e.get(by) == v],
                                                       [e for e in examples[1] if e.get(by) == v],
                                                       key=key, n_boot=n_boot, seed=seed) for v in values}
    except ValueError as e:
        raise CompareError(f"{run_a['name']} vs {run_b['name']} on {task}: {e}") from None
    return out


def render_paired(result: dict) -> str:
    if result["all"].get("binary", True):
        headers = ["A", "B", "task", "subset", "n", "acc A", "acc B", "A only", "B only", "McNemar p", "A - B [95% CI]"]
    else:  # continuous values (e.g. per-window NLL): means, the sign test, the mean difference
        headers = ["A", "B", "task", "subset", "n", "mean A", "mean B", "A lower", "B lower", "sign test p",
                   "A - B [95% CI]"]
    digits = 3 if result["all"].get("binary", True) else 4  # losses differ in the third decimal
    items = [("all", result["all"])] + [(f"{result['by']}={k}", v) for k, v in result.get("groups", {}).items()]
    rows, notes = [], []
    for subset, r in items:
        bs = r["bootstrap"]
        level = round(100 * (1 - bs["alpha"]))
        headers[-1] = f"A - B [{level}% CI]"
        test = [format_p(r["mcnemar"]["p_value"]),
                f"{bs['diff']:+.{digits}f} [{bs['ci_low']:+.{digits}f}, {bs['ci_high']:+.{digits}f}]"]
        if r.get("not_a_test"):
            test = ["not a test ‡", f"{bs['diff']:+.{digits}f}"]
            notes.append(f"‡ {subset}: {r['not_a_test']}; the rows below, one cell each, are the tests")
        rows.append([result["a"]["name"], result["b"]["name"], result["task"], subset, str(r["n"]),
                     f"{r['acc_a']:.{digits}f}", f"{r['acc_b']:.{digits}f}", str(r["a_only"]), str(r["b_only"]), *test])
    table = markdown_table(headers, rows, right=set(range(4, len(headers))))
    return table + "".join(f"\n\n{note}" for note in notes)


# ---- NLL by window position -------------------------------------------------------------------------------

def position_gain(tables: dict, records: list[dict], reference: str, length: int | None = None,
                  block: int | None = None, bin_size: int = 16) -> dict:
    """Each seed group's NLL gain over the reference's group by position in the evaluation window (paper
    004's Fig. 5 on held-out text: where blocks lose context, just after a block boundary, is where a bridge
    should gain).

    The profiles are the ppl eval's mean NLL at each window position (eval/ppl.py) at `length` (default: the
    reference's training length) with the models as trained; a group's profile is the mean over its seeds.
    gain = reference NLL - group NLL (positive: better than the reference), reported in bins of `bin_size`
    over the whole window (`bins`) and by offset from the last block boundary at multiples of `block`
    (default: the reference's block_len) for the positions after the first block (`offsets`), each as
    mean +- sample std over the group's seeds.
    """
    by_name = {r["name"]: r for r in records}
    if reference not in by_name:
        raise CompareError(f"--position_gain {reference}: no such run (runs: {', '.join(sorted(by_name))})")
    model = by_name[reference]["config"].get("model", {})
    length = length or model.get("block_size")
    block = block or model.get("block_len")
    if not (isinstance(block, int) and block > 0 and isinstance(length, int) and length > block):
        raise CompareError(f"--position_gain needs a block length below the evaluation length (block {block}, "
                           f"length {length}): set --position_block and --position_length")

    def profile(record) -> np.ndarray:
        result = record["evals"].get("ppl", {})
        for entry in setting_items({"results": result}, "positions", standing_setting(result)):
            if entry.get("length") == length and entry.get("window") is None:
                return np.array([np.nan if v is None else v for v in entry["nll"]], dtype=np.float64)
        raise CompareError(f"{record['source']} has no NLL by position at L={length} (run: python -m eval "
                           f"--out_dir={record['source']} --tasks=ppl --ppl_lengths={length})")

    groups = {group_name(g): [profile(by_name[n]) for n in g["runs"]] for g in tables["groups"]}
    ref_label = next(group_name(g) for g in tables["groups"] if reference in g["runs"])
    ref_profile = np.nanmean(groups[ref_label], axis=0)
    positions = np.arange(length)
    offset_bins = list(range(0, block, bin_size))
    out = {"reference": ref_label, "length": length, "block": block, "bin": bin_size, "groups": {}}
    for label, profiles in groups.items():
        gains = [ref_profile - p for p in profiles]  # one per seed

        def summary(mask):
            values = [float(np.nanmean(g[mask])) for g in gains]
            return mean_std(values)

        out["groups"][label] = {
            "all": summary(positions >= block),
            "offsets": [summary((positions >= block) & (positions % block >= o) & (positions % block < o + bin_size))
                        for o in offset_bins],
            "bins": [summary((positions >= s) & (positions < s + bin_size)) for s in range(0, length, bin_size)]}
    out["offset_bins"] = offset_bins
    return out


def render_position_gain(result: dict) -> str:
    b, size = result["block"], result["bin"]
    headers = ["model", "all after the first block"] + [f"offset [{o}, {o + size})" for o in result["offset_bins"]]
    rows = [[label] + [f"{m:+.4f} ± {sd:.4f}" for m, sd in [g["all"], *g["offsets"]]]
            for label, g in result["groups"].items() if label != result["reference"]]
    return (f"NLL gain over {result['reference']} (nats per token, reference minus model: positive is better) at "
            f"L={result['length']}, by offset from the last block boundary (multiples of {b}), mean ± std over "
            f"seeds:\n\n" + markdown_table(headers, rows, right=set(range(1, len(headers)))))
