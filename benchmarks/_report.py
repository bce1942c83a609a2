"""What every benchmark script prints last: its table, headed by the command that made it."""
import shlex
import sys


def command(script):
    """The command line that ran ``script`` (``benchmarks/<name>.py``), arguments included."""
    return shlex.join(["python", f"benchmarks/{script}", *sys.argv[1:]])


def emit(lines, markdown=None):
    """Print the report and, with ``markdown`` (a path), write it there too."""
    text = "\n".join(lines) + "\n"
    print(text)
    if markdown:
        with open(markdown, "w") as f:
            f.write(text)
