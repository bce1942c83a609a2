"""What every benchmark script prints last: its table, headed by the command that made it.

``--markdown PATH`` writes the report to a file; ``--markdown PATH#SECTION`` writes it as the
section ``SECTION`` of a shared page (``docs/benchmarks.md``), between the lines
``<!-- section: SECTION -->`` and ``<!-- end: SECTION -->``, leaving the rest of the page as
it is (a section not yet on the page is appended under a ``## SECTION`` heading, anchored
``#SECTION``). A report that does not name its source gets a ``Source:`` line after its first
paragraph: the commit of the numbafuse tree it measured.
"""
import os
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def command(script):
    """The command line that ran ``script`` (``benchmarks/<name>.py``), arguments included."""
    return shlex.join(["python", f"benchmarks/{script}", *sys.argv[1:]])


def source():
    """``numbafuse at <commit>`` (``, with uncommitted changes`` when the package differs)."""
    def git(*args):
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT,
                              check=False).stdout.strip()
    commit = git("rev-parse", "--short", "HEAD") or "an unknown commit"
    dirty = git("status", "--porcelain", "--", "numbafuse")
    return f"numbafuse at {commit}" + (", with uncommitted changes" if dirty else "")


def write(markdown, text):
    """Write ``text`` to ``markdown``: a path, or ``path#section`` (that section of the page)."""
    path, _, section = markdown.partition("#")
    if not section:
        with open(path, "w") as f:
            f.write(text)
        return
    if "Source:" not in text:
        first, _, rest = text.partition("\n\n")
        text = f"{first}\n\nSource: {source()}.\n" + (f"\n{rest}" if rest else "")
    begin, end = f"<!-- section: {section} -->\n", f"<!-- end: {section} -->\n"
    page = ""
    if os.path.exists(path):
        with open(path) as f:
            page = f.read()
    if begin in page and end in page:
        head, rest = page.split(begin, 1)
        tail = rest.split(end, 1)[1]
    else:
        head = page.rstrip("\n") + "\n\n" if page.strip() else ""
        head, tail = head + f'<a id="{section}"></a>\n\n## {section}\n\n', ""
    with open(path + ".tmp", "w") as f:
        f.write(head + begin + text.rstrip("\n") + "\n" + end + tail)
    os.replace(path + ".tmp", path)


def emit(lines, markdown=None):
    """Print the report and, with ``markdown`` (a path or ``path#section``), write it there."""
    text = "\n".join(lines) + "\n"
    print(text)
    if markdown:
        write(markdown, text)
