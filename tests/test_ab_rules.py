"""benchmarks/ab_rules.py: variants parsed as written, refused before any step where a field
is not a rule, and a small ResNet-18 run that prints a row a variant, with the matching
sites' time only where sites match."""
import pathlib
import re
import sys

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'numbafuse[torch]'); "
                    ".ci/run's torch leg has it")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import ab_rules  # noqa: E402

pytestmark = pytest.mark.torch


def test_variants_and_sites_parse_as_written():
    assert ab_rules.parse_variant("off: pointwise_chunked_pixels=0, shared_backward=False") == (
        "off", {"pointwise_chunked_pixels": 0, "shared_backward": False})
    assert ab_rules.parse_variant(" s : strided='im2col' ") == ("s", {"strided": "im2col"})
    assert ab_rules.parse_variant("none:") == ("none", {})
    for bad in ("no colon", ": k_block=1", "x: k_block"):
        with pytest.raises(ValueError):
            ab_rules.parse_variant(bad)
    assert ab_rules.parse_sites("R=1, H=8") == {"R": 1, "H": 8}
    assert ab_rules.parse_sites(None) is None


def test_a_variant_sets_its_rules_and_module_attributes_for_the_block_only():
    from numbafuse.kernels.conv import cpu_plan
    from numbafuse.torch import conv_batchnorm as tcb
    line, k_block = tcb.KEEP_H_MIN_MACS, cpu_plan.current_rules().k_block
    changes = {"k_block": k_block + 7, "numbafuse.torch.conv_batchnorm.KEEP_H_MIN_MACS": 3}
    with ab_rules.applied(changes):
        assert cpu_plan.current_rules().k_block == k_block + 7
        assert tcb.KEEP_H_MIN_MACS == 3
    assert tcb.KEEP_H_MIN_MACS == line and cpu_plan.current_rules().k_block == k_block
    with pytest.raises(ValueError, match="no attribute 'NOPE'"):
        with ab_rules.applied({"numbafuse.torch.conv_batchnorm.NOPE": 1}):
            pass
    with pytest.raises(RuntimeError):                     # restored when the block raises
        with ab_rules.applied(changes):
            raise RuntimeError
    assert tcb.KEEP_H_MIN_MACS == line


def test_an_unknown_rule_is_refused_before_any_step():
    with pytest.raises(TypeError, match="no rule named nope"):
        ab_rules.main(["--variant", "x: nope=1", "--batch", "2", "--size", "32"])


def _rows(out):
    return {m[0]: [float(v) for v in m[1:]] for m in re.findall(
        r"^\| (\w+) \| .*? \| (\S+) \| (\S+) \| (\S+) \| (\S+) \|$", out, re.MULTILINE)}


@pytest.mark.parametrize("sites, timed", [("H=8,R=3", True), ("H=5", False)])
def test_a_small_run_prints_each_variant_and_times_only_matching_sites(capsys, sites, timed):
    # ResNet-18 at 32x32: its l1 3x3 convs see 8x8 maps (a 5x5 map nowhere)
    ab_rules.main(["--variant", "off: concurrent_max_elements=0", "--batch", "2", "--size",
                   "32", "--rounds", "1", "--block", "2", "--drop", "1", "--sites", sites])
    out = capsys.readouterr().out
    assert "1 rounds of blocks of 2 (1 dropped): 1 steps kept a variant" in out
    rows = _rows(out)
    assert set(rows) == {"default", "off"}
    for best, median, site_best, site_median in rows.values():
        assert 0 < best <= median
        assert (site_best > 0) == timed and site_best <= site_median
        assert site_median < median
