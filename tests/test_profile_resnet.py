"""benchmarks/profile_resnet.py --host: the fused Functions' time split into their launches
and the rest (the host path), on a small ResNet-18 step: every Function and direction that
the fused model calls has a row, and each row's parts add up."""
import pathlib
import re
import sys

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'numbafuse[torch]'); "
                    ".ci/run's torch leg has it")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import profile_resnet  # noqa: E402

pytestmark = pytest.mark.torch


def test_host_rows_split_each_function_into_launches_and_the_rest(capsys):
    profile_resnet.main(["--host", "--batch", "2", "--size", "32", "--steps", "1",
                         "--recompute", "auto"])
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (Conv-BN(?:-Add)?-ReLU (?:forward|backward)) \| (\S+) \| (\S+) "
                      r"\| (\S+) \| (\S+) \| (\S+) \|$", out, re.MULTILINE)
    # ResNet-18: 9 Conv-BN-ReLU (the stem, each block's first conv) and 3 Conv-BN (the
    # downsample branches: the same Function, no ReLU), 8 Conv-BN-Add-ReLU block tails
    assert {r[0]: float(r[1]) for r in rows} == {
        "Conv-BN-Add-ReLU backward": 8, "Conv-BN-Add-ReLU forward": 8,
        "Conv-BN-ReLU backward": 12, "Conv-BN-ReLU forward": 12}
    for name, calls, total, launches, rest, per_call in rows:
        total, launches, rest = float(total), float(launches), float(rest)
        assert 0 < launches < total, name
        assert abs(total - launches - rest) <= 0.02, name
        assert abs(rest / float(calls) * 1e3 - float(per_call)) <= 1, name
    assert "The fused Functions' host path:" in out
    parts = re.search(r"host path: (\S+) ms a step \(\d+% of the step\): (\S+) ms in the ops "
                      r"layer .* (\S+) ms in the Functions' own torch layer", out, re.DOTALL)
    assert parts, out
    rest, in_ops, torch_layer = map(float, parts.groups())
    assert 0 < in_ops < rest and 0 < torch_layer < rest
    assert abs(in_ops + torch_layer - rest) <= 0.11


def test_direct_macs_of_a_pass():
    # N*P*Q*K*(C/groups)*R*S; dx and dw twice the forward's
    from numbafuse.validate import conv_geometry
    g = conv_geometry("t", (2, 64, 16, 16), (64, 64, 3, 3), 1, 1)
    assert profile_resnet.direct_macs("forward 3x3/1 64->64 at 16x16", g) == \
        2 * 16 * 16 * 64 * 64 * 9
    g = conv_geometry("t", (2, 64, 16, 16), (128, 64, 3, 3), 2, 1)
    assert profile_resnet.direct_macs("backward (dx+dw) 3x3/2 64->128 at 16x16", g) == \
        2 * 2 * 8 * 8 * 128 * 64 * 9
    g = conv_geometry("t", (2, 3, 64, 64), (64, 3, 7, 7), 2, 3)
    assert profile_resnet.direct_macs("backward (dw) 7x7/2 3->64 at 64x64", g) == \
        2 * 32 * 32 * 64 * 3 * 49
    g = conv_geometry("t", (2, 96, 28, 28), (96, 1, 7, 7), 2, 3, groups=96)    # depthwise
    assert profile_resnet.direct_macs("forward 7x7/2 96->96 at 28x28", g) == \
        2 * 14 * 14 * 96 * 49


def test_layers_replay_rows_compare_each_pass_with_its_call_again(capsys, monkeypatch):
    geometries = {}
    replayed_of = profile_resnet._replayed

    def replayed(captured, repeats):         # (the geometries the table's GMAC/s divide)
        geometries.update({k: entry[2] for k, entry in captured.items()})
        return replayed_of(captured, repeats)
    monkeypatch.setattr(profile_resnet, "_replayed", replayed)
    profile_resnet.main(["--layers", "--replay", "3", "--batch", "2", "--size", "32",
                         "--steps", "1", "--recompute", "auto"])
    out = capsys.readouterr().out
    assert all(g.N == 2 for g in geometries.values())
    # each captured geometry is the one its key names (the pass's own call, whatever its
    # arguments' order: _conv_and_stats, _conv_forward, _conv_backward)
    for key, g in geometries.items():
        assert key.endswith(f" {g.R}x{g.S}/{g.sh} {g.C}->{g.K} at {g.H}x{g.W}"), key
    rows = re.findall(r"^\| ((?:forward|backward)[^|]*?) \| (\S+) \| (\S+) \| (\S+) \| (\S+) "
                      r"\| (\S+) \|$", out, re.MULTILINE)
    names = {r[0] for r in rows}
    # every conv of ResNet-18 has its forward (the 3x3 128s at 8x8: with the statistics) and
    # its backward: the stem's dw alone (its input needs no gradient)
    assert "backward (dw) 7x7/2 3->64 at 32x32" in names
    assert "forward 7x7/2 3->64 at 32x32" in names
    assert sum(n.startswith("backward (dx+dw)") for n in names) == 10, names
    # the step whose arguments were copied is not among the timed ones (its copies made the
    # first timed step's passes ~10x slower): a step's calls as one step makes them ("auto"
    # runs the stem's forward again in its backward; its input needs no gradient)
    calls = {r[0]: float(r[1]) for r in rows}
    assert calls["forward 7x7/2 3->64 at 32x32"] == 2
    assert calls["backward (dw) 7x7/2 3->64 at 32x32"] == 1
    in_step = replayed = 0.0
    for name, calls, mean, warm, ratio, gmacs in rows:
        calls, mean, warm = float(calls), float(mean), float(warm)
        assert mean > 0 and warm > 0, name
        # (the columns as printed: ms to 3 decimals, the ratio to 2, GMAC/s to units)
        slack = 0.0006 / warm + 0.0006 / mean
        assert abs(mean / warm - float(ratio)) <= 0.006 + mean / warm * slack, name
        expect = profile_resnet.direct_macs(name, geometries[name]) / (warm * 1e-3) / 1e9
        assert abs(expect - float(gmacs)) <= 0.6 + expect * 0.0006 / warm, name
        in_step, replayed = in_step + mean * calls, replayed + warm * calls
    total = re.search(r"The conv passes: (\S+) ms a step in the steps, (\S+) replayed", out)
    assert total, out
    assert abs(float(total.group(1)) - in_step) <= 0.05 * in_step + 0.1
    assert abs(float(total.group(2)) - replayed) <= 0.05 * replayed + 0.1


@pytest.mark.parametrize("argv", [["--replay", "3"], ["--layers", "--replay", "-1"]])
def test_replay_needs_layers_and_a_count(argv, capsys):
    with pytest.raises(SystemExit):
        profile_resnet.main(argv)
    assert "--replay" in capsys.readouterr().err


def test_exclusive_rows_count_each_call_once_and_the_wrappers_are_undone(capsys):
    import numbafuse.kernels.cpu.buffers as buffers
    import numbafuse.ops.conv_batchnorm as cbn
    import numbafuse.torch.conv_batchnorm as tcb
    before = (buffers.OutputCache.empty, cbn.forward, cbn.backward,
              tcb.ConvBatchNormReLUFunction.__dict__["forward"])
    profile_resnet.main(["--exclusive", "--batch", "2", "--size", "32", "--steps", "1",
                         "--recompute", "auto", "--top", "100000"])
    out = capsys.readouterr().out
    rows = {r[0]: (float(r[1]), float(r[2]), float(r[3])) for r in re.findall(
        r"^\| `([^`]+)` \| (\S+) \| (\S+) \| (\S+) \|$", out, re.MULTILINE)}
    # the Functions as autograd calls them: ResNet-18's 12 Conv-BN(-ReLU) and 8
    # Conv-BN-Add-ReLU sites, forward and backward once a step each
    assert rows["conv_batchnorm.ConvBatchNormReLUFunction.forward"][1] == 12
    assert rows["conv_batchnorm.ConvBatchNormReLUFunction.backward"][1] == 12
    assert rows["conv_batchnorm.ConvBatchNormAddReLUFunction.forward"][1] == 8
    assert rows["conv_batchnorm.ConvBatchNormAddReLUFunction.backward"][1] == 8
    assert rows["conv_batchnorm.forward"][1] == 12 and rows["conv_batchnorm.add_backward"][1] == 8
    assert rows["launch.launch"][1] > 0 and rows["buffers.OutputCache.empty"][1] > 0
    for name, (ms, calls, us) in rows.items():
        assert ms >= 0 and calls > 0, name
        assert abs(ms / calls * 1e3 - us) <= 0.06 + 5 / calls + us * 0.01, name  # (rounding)
    head = re.search(r"numbafuse's Python functions (\S+) ms exclusive of the launches "
                     r"\(launch, launch_all, concurrently: (\S+) ms", out)
    assert head, out
    units = sum(rows.get(f"launch.{u}", (0,))[0] for u in ("launch", "launch_all",
                                                             "concurrently"))
    assert abs(float(head.group(2)) - units) <= 0.02 + 0.01 * units
    host = sum(ms for name, (ms, _, _) in rows.items()) - units
    assert abs(float(head.group(1)) - host) <= 0.05 + 0.01 * host
    # exclusive: the times partition the step's wall time on each of its (two) threads, where
    # inclusive times would count each nesting level again
    wrapped = float(re.search(r"ms unwrapped, (\S+) wrapped", out).group(1))
    assert 0 < host + units <= 2 * wrapped + 0.1
    assert (buffers.OutputCache.empty, cbn.forward, cbn.backward,
            tcb.ConvBatchNormReLUFunction.__dict__["forward"]) == before


def test_gaps_add_up_to_the_functions_host_time_and_the_wrappers_are_undone(capsys):
    import numbafuse.kernels.cpu.launch as launch_mod
    import numbafuse.torch.conv_batchnorm as tcb
    before = (launch_mod.launch, tcb.ConvBatchNormReLUFunction.__dict__["forward"],
              tcb.ConvBatchNormAddReLUFunction.__dict__["backward"])
    profile_resnet.main(["--gaps", "--batch", "2", "--size", "32", "--steps", "2",
                         "--recompute", "auto", "--top", "100000"])
    out = capsys.readouterr().out
    head = re.search(r"step (\S+) ms \(mean of 2 steps\); inside the fused Functions, outside "
                     r"their launches (\S+) ms a step: forward (\S+) ms in (\S+) calls \((\S+) "
                     r"us a call\), backward (\S+) ms in (\S+) \((\S+) us a call\)", out)
    assert head, out
    step, total, fwd, fwd_calls, fwd_us, bwd, bwd_calls, bwd_us = map(float, head.groups())
    assert (fwd_calls, bwd_calls) == (20, 20)          # ResNet-18's 12 + 8 fused sites
    assert abs(fwd + bwd - total) <= 0.011 and 0 < total < step
    assert abs(fwd / fwd_calls * 1e3 - fwd_us) <= 1 and abs(bwd / bwd_calls * 1e3 - bwd_us) <= 1
    rows = re.findall(r"^\| (.+?) \| (\S+) \| (\S+) \| (\S+) \|$", out, re.MULTILINE)
    rows = [r for r in rows if r[0] != "the gap ends at" and not r[0].startswith("---")]
    ends = {r[0]: float(r[2]) for r in rows if r[0].startswith("end of ")}
    assert ends == {"end of ConvBatchNormReLUFunction.forward": 12,
                    "end of ConvBatchNormReLUFunction.backward": 12,
                    "end of ConvBatchNormAddReLUFunction.forward": 8,
                    "end of ConvBatchNormAddReLUFunction.backward": 8}
    launches = [r for r in rows if not r[0].startswith("end of ")]
    assert launches and all(r[0].startswith("launch at ") and ".py:" in r[0] for r in launches)
    # every gap is one row's and its Function's: the rows add up to the head's total
    assert abs(sum(float(r[1]) for r in rows) - total) <= 0.001 * len(rows) + 0.011
    assert (launch_mod.launch, tcb.ConvBatchNormReLUFunction.__dict__["forward"],
            tcb.ConvBatchNormAddReLUFunction.__dict__["backward"]) == before
