"""The attention variants of the registry as a markdown table: name, paper, which keys a query attends to, and
the settings each declares (with their defaults). README.md's table is this output (a test checks it).

    python -m scripts.variants
"""

import sys

if not __package__:  # run as a file, the project's modules cannot be imported: say how to run it
    sys.exit("run it from the repository root as a module: python -m scripts.variants ...")

from attention.registry import MIXERS, PATTERN_ALIASES, Setting  # noqa: E402
from common.outputs import markdown_table  # noqa: E402


def variants_table() -> str:
    """One row per documented variant (a mixer with a summary; mixers that share their paper and summary, such as
    the MSWA family, share a row), then the pattern aliases. A variant without a summary (one being written, such
    as docs/adding_a_variant.md's) is left out: adding it edits nothing else."""
    rows = {}
    for name, cls in MIXERS.items():
        if not cls.summary:
            continue
        row = rows.setdefault((cls.paper, cls.summary), {"names": [], "settings": {}})
        row["names"].append(name)
        for setting in cls.settings:
            if isinstance(setting, Setting):
                row["settings"].setdefault(setting.name, setting.default)
    table = []
    for (paper, summary), row in rows.items():
        names = ", ".join(f"`{n}`" for n in row["names"])
        settings = ", ".join(f"`{key}` ({value!r})" if isinstance(value, str) else f"`{key}` ({value})"
                             for key, value in row["settings"].items())
        table.append([names, paper, summary, settings])
    table += [[f"`{alias}`", "", f"the pattern `{pattern}`", ""] for alias, pattern in PATTERN_ALIASES.items()]
    return markdown_table(["name", "paper", "query i attends to key j when", "settings (default)"], table)


if __name__ == "__main__":
    if sys.argv[1:]:  # no options: --help says so, anything else is refused
        print(__doc__.strip())
        raise SystemExit(0 if sys.argv[1:] in (["--help"], ["-h"]) else f"unexpected arguments {sys.argv[1:]}: "
                         "this script takes none")
    print(variants_table())
