"""Print one of README.md's two quick-start commands, so CI runs exactly what users read.

    python3 .ci/readme_command.py tests|train README.md

The commands are the first line of the ```bash blocks that follow the paragraphs starting
"Run the tests" and "Train".
"""
import re
import sys

HEADINGS = {"tests": "Run the tests", "train": "Train"}


def command(text, which):
    start = text.index("\n" + HEADINGS[which])
    block = re.search(r"```bash\n(.+?)\n```", text[start:], re.S)
    lines = [ln for ln in block.group(1).splitlines() if ln.strip()]
    if len(lines) != 1:
        raise SystemExit(f"README.md: the {which} block must hold exactly one command")
    return lines[0]


if __name__ == "__main__":
    with open(sys.argv[2]) as f:
        print(command(f.read(), sys.argv[1]))
