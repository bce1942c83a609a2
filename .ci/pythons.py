"""Print the supported Python interpreters found on this machine, oldest first, one per line.

Supported: from the floor of ``requires-python`` in pyproject.toml up to the newest minor
version its classifiers list. Interpreters are looked up as pyenv's versions
(``$PYENV_ROOT/versions/X.Y.*``, newest patch release) and as ``pythonX.Y`` on PATH.
"""
import glob
import os
import re
import shutil
import sys


def supported_minors(pyproject_text):
    floor = re.search(r'requires-python\s*=\s*">=\s*3\.(\d+)"', pyproject_text)
    listed = [int(m) for m in re.findall(r"Programming Language :: Python :: 3\.(\d+)",
                                         pyproject_text)]
    lo = int(floor.group(1))
    return list(range(lo, max(listed + [lo]) + 1))


def find(minor):
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    found = []
    for path in glob.glob(os.path.join(root, "versions", f"3.{minor}.*", "bin", "python3")):
        patch = re.search(rf"3\.{minor}\.(\d+)", path)
        if patch:
            found.append((int(patch.group(1)), path))
    if found:
        return max(found)[1]
    return shutil.which(f"python3.{minor}")


def main(path):
    with open(path) as f:
        minors = supported_minors(f.read())
    for minor in minors:
        interpreter = find(minor)
        if interpreter:
            print(interpreter)


if __name__ == "__main__":
    main(sys.argv[1])
