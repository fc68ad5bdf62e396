"""Reading a kernel's machine code (SASS): its innermost loops and what each holds (instructions, special-function
operations, tensor-core instructions, atomics, the copies it keeps in flight)."""

import re

INSTRUCTION = re.compile(r"/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
LABEL = re.compile(r"^\s*(\.L_x_\d+):")
BRANCH_TARGET = re.compile(r"\bBRA\b.*?`\((\.L_x_\d+)\)")
MMA = ("HMMA", "HGMMA")
ATOMICS = ("RED", "REDG", "REDS", "ATOM", "ATOMG", "ATOMS")


def opcode(instruction: str) -> str:
    """The operation of a SASS instruction without its predicate and modifiers: MUFU of @!P0 MUFU.EX2 R1, R2."""
    words = instruction.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def innermost_loops(sass: str) -> list[list[str]]:
    """The instructions of each innermost loop of a kernel's SASS (nvdisasm's, with labels), from its label to its
    backward branch, in the code's order: a loop is a label and the last branch back to it, and one whose span
    holds another loop is not innermost. A kernel may walk its blocks in several loops one after another (a
    window's edges and its interior): each is a loop of its own. The branch-to-itself after EXIT is no loop."""
    instructions, labels = [], {}
    for line in sass.splitlines():
        if label := LABEL.match(line):
            labels[label.group(1)] = len(instructions)
        elif match := INSTRUCTION.search(line):
            instructions.append(match.group(2))
    ends = {}
    for i, instruction in enumerate(instructions):
        target = BRANCH_TARGET.search(instruction)
        if target and target.group(1) in labels and labels[target.group(1)] < i:
            ends[labels[target.group(1)]] = i
    loops = sorted(ends.items())
    return [instructions[s:e + 1] for s, e in loops
            if not any(s <= s2 and e2 <= e and (s2, e2) != (s, e) for s2, e2 in loops)]


COPY_WAIT = re.compile(r"\bDEPBAR\.LE SB0, (0x[0-9a-f]+|\d+)")


def copies_in_flight(loop: list[str]) -> int | None:
    """The cp.async groups a loop's tightest wait (DEPBAR.LE SB0, n) lets stay in flight, None without a wait: 0
    means each iteration waits for every copy it has issued, so the rows it prefetches arrive no earlier than
    loads in the iteration would (Triton's pipeliner leaves such a loop when a copy's address comes from a load
    in the same iteration)."""
    waits = [int(m.group(1), 0) for m in map(COPY_WAIT.search, loop) if m]
    return min(waits) if waits else None


def loop_counts(loop: list[str]) -> dict:
    ops = [opcode(instruction) for instruction in loop]
    return {"instructions": len(ops), "mufu": ops.count("MUFU"), "mma": sum(op in MMA for op in ops),
            "atomics": sum(op in ATOMICS for op in ops), "copies_in_flight": copies_in_flight(loop)}


def mufu_per_score(loop: dict, row: dict) -> float | None:
    """A loop's MUFU count over the scores a thread computes per iteration: a tile of BLOCK_M rows by BLOCK_N keys
    (BLOCK_C blocks for MoBA's choice) over 32 x num_warps threads; None for a kernel without such a tile."""
    constexprs = row["constexprs"]
    rows, cols = constexprs.get("BLOCK_M"), constexprs.get("BLOCK_N", constexprs.get("BLOCK_C"))
    if not isinstance(rows, int) or not isinstance(cols, int):
        return None
    return loop["mufu"] / (rows * cols / (32 * row["num_warps"]))
