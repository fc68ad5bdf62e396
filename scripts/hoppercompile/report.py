"""The report's table: one row per compiled kernel, its registers, spills, shared memory and innermost loops."""

from common.outputs import markdown_table


def row_name(row: dict) -> str:
    """The kernel and the first configuration that launches it, as a file name."""
    return f"{row['kernel']}@{row['launched_by'][0]}".replace(", ", "+").replace(" ", "_")


def table(rows: list[dict]) -> str:
    header = ["kernel", "launched by", "registers", "spills (B, st/ld)", "shared (B)", "loop instructions", "MUFU",
              "HGMMA/HMMA", "atomics", "copies in flight", "MUFU per score"]
    lines = []
    for row in rows:
        name = [row["kernel"], "; ".join(row["launched_by"])]
        if "error" in row:
            lines.append(name + ["error: " + row["error"].splitlines()[0][:120]] + [""] * (len(header) - 3))
            continue
        # a kernel with several innermost loops: one value each, in the code's order
        per_loop = [" / ".join("-" if loop[key] is None else str(loop[key]) for loop in row["loops"]) or "-"
                    for key in ("instructions", "mufu", "mma", "atomics", "copies_in_flight")]
        per_score = " / ".join("-" if x is None else f"{x:.2f}" for x in row["mufu_per_score"]) or "-"
        lines.append(name + [row["registers"], f"{row['spill_stores']}/{row['spill_loads']}", row["shared"],
                             *per_loop, per_score])
    return markdown_table(header, lines, right=set(range(2, len(header))), aligned=True)
