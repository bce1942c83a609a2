"""benchmarks/_report.py: ``--markdown PATH#SECTION`` rewrites one section of the shared
benchmark page and nothing else (docs/benchmarks.md is built from such sections); and
``_runner.round_ratios``, the round-by-round spread a table prints under its best-of ratios."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import _report  # noqa: E402


def _section(page, name):
    begin, end = f"<!-- section: {name} -->\n", f"<!-- end: {name} -->\n"
    assert page.count(begin) == 1 and page.count(end) == 1, name
    return page.split(begin, 1)[1].split(end, 1)[0]


def test_a_section_is_replaced_and_the_rest_of_the_page_kept(tmp_path):
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n\nintro\n")
    _report.write(f"{page}#a", "Command: `one`\n\nSource: x.\n\n| a |\n")
    _report.write(f"{page}#b", "Command: `two`\n\nSource: y.\n")
    text = page.read_text()
    assert text.startswith("# Benchmarks\n\nintro\n\n")
    assert '<a id="a"></a>\n\n## a\n\n' in text and '<a id="b"></a>\n\n## b\n\n' in text
    before_b = text.split("<!-- section: b -->")[0]

    _report.write(f"{page}#a", "Command: `three`\n\nSource: z.\n")
    text = page.read_text()
    assert _section(text, "a") == "Command: `three`\n\nSource: z.\n"
    assert _section(text, "b") == "Command: `two`\n\nSource: y.\n"
    assert text.split("<!-- section: b -->")[0] == before_b.replace(
        "Command: `one`\n\nSource: x.\n\n| a |\n", "Command: `three`\n\nSource: z.\n")
    assert text.count("## a") == 1


def test_a_report_without_a_source_gets_one(tmp_path):
    page = tmp_path / "p.md"
    _report.write(f"{page}#s", "Command: `c`\n\n| t |\n")
    body = _section(page.read_text(), "s")
    first, source, rest = body.split("\n\n", 2)
    assert first == "Command: `c`"
    assert source.startswith("Source: numbafuse at ") and source.endswith(".")
    assert rest == "| t |\n"


def test_a_plain_path_is_written_whole(tmp_path):
    out = tmp_path / "out.md"
    out.write_text("old\n")
    _report.write(str(out), "new\n")
    assert out.read_text() == "new\n"


def test_round_ratios_pair_each_round_with_the_same_round():
    import _runner
    info = {"rounds": {"numbafuse": [{"a": 1.0, "b": 2.0}, {"a": 2.0, "b": 2.0}],
                       "torch": [{"a": 1.5, "b": 2.0}, {"a": 2.0, "b": 3.0}]}}
    assert _runner.round_ratios(info, "a") == (1.0, 1.5)
    assert _runner.round_ratios(info, "b") == (1.0, 1.5)
    info["rounds"]["torch"][1].pop("b")                   # a round without the case
    assert _runner.round_ratios(info, "b") is None
    assert _runner.round_ratios({"rounds": {"numbafuse": [], "torch": []}}, "a") is None
