"""What the benchmarks share: the right-aligned text table they print last."""

from __future__ import annotations


def text_table(head: list[str], body: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    return "\n".join("  ".join(str(c).rjust(w) for c, w in zip(line, widths)) for line in [head, *body])
