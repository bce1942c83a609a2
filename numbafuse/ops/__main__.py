"""``python -m numbafuse.ops``: print the op table of ``docs/ops.md`` from ``OPS``."""
import inspect

from . import OPS
from .spec import dtype_table


def table() -> str:
    lines = ["# Ops", "",
             "Generated from `numbafuse.ops.OPS` by `python -m numbafuse.ops > docs/ops.md`;",
             "a test checks that this file is up to date. Array arguments come first (positional);",
             "the others are keywords, with the public function's defaults.", "",
             "| op | call | fuses | reference | NumPy-style backward | what it does |",
             "|---|---|---|---|---|---|"]
    for name in sorted(OPS):
        spec = OPS[name]
        signature = str(inspect.signature(spec.function)).replace("|", "\\|")
        fuses = " -> ".join(spec.fuses) or ""
        reference = f"`reference.{spec.reference.__name__}`" if spec.reference else ""
        backward = f"`{spec.backward.__name__}` -> ({', '.join('d' + a for a in spec.arrays)})" \
            if spec.backward else ""
        lines.append(f"| `{name}` | `{spec.function.__name__}{signature}` | {fuses} | "
                     f"{reference} | {backward} | {spec.summary()} |")
    return "\n".join(lines) + "\n\n" + dtype_table(OPS)


if __name__ == "__main__":
    print(table(), end="")
