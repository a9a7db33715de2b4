"""--device: the device is checked bit-identical to eager on the CPU before it converts anything, in
every process, and falls back to the CPU kernels on any difference. There is no device
here: tests/support/fake_device.py supplies device kernel sets through the documented hook
kernels.fastest.DEVICE_KERNEL_FACTORIES (a conversion hands the factory to its worker processes),
and the device name is "meta" (torch accepts it; eager numerics cannot run on it)."""

import itertools
import os
from fractions import Fraction

import pytest
import torch

from mla_convert.conversion.pipeline import convert
from mla_convert.kernels import fastest as kernels
from mla_convert.kernels import numerics, probes
from mla_convert.kernels.fastest import DEVICE_KERNEL_FACTORIES, select_kernels
from mla_convert.settings import Options
from mla_convert.verification import verify
from support import fake_device

FP8, BF16 = "channel-fp8", "bf16"
DIFFERED = "meta differed from eager on the CPU, on the probe set: "
FALLBACK = "; converting on the CPU instead"


@pytest.fixture
def device_kernels(monkeypatch):
    """device_kernels(NAME): the fake device kernel set support.fake_device.NAME, in this process
    and in the worker processes it starts, with no kernel choice cached."""
    kernels.forget()

    def use(name: str) -> None:
        monkeypatch.setitem(DEVICE_KERNEL_FACTORIES, "meta", getattr(fake_device, name))

    return use


def _exact_midpoints() -> set[Fraction]:
    """Every point halfway between two adjacent finite e4m3fn values, from the format itself:
    subnormals m * 2^-9 (m = 0..7), normals (1 + m/8) * 2^(e-7) for e = 1..15 (e = 15 stops at 448)."""
    values = [Fraction(m, 2**9) for m in range(8)]
    values += [Fraction(8 + m, 8) * Fraction(2) ** (e - 7) for e in range(1, 16) for m in range(8)][:-1]
    assert len(values) == 127 and values[-1] == 448 and values == sorted(values)
    return {(a + b) / 2 for a, b in itertools.pairwise(values)}


def _differed(device_reason: str) -> dict[str, str]:
    """{op: 'N of M weights and ...'} from a device_reason of a device that differed."""
    assert device_reason.startswith(DIFFERED) and device_reason.endswith(FALLBACK), device_reason
    parts = device_reason[len(DIFFERED) : -len(FALLBACK)].split("; ")
    return dict(part.split(" in ", 1) for part in parts)


@pytest.mark.parametrize("fp8_max", [448.0, 240.0])
def test_midpoint_probes_sit_exactly_on_midpoints(fp8_max, reference):
    """In exact arithmetic, every non-zero element of the midpoint probes outside a row's max divided
    by its channel scale is a midpoint of two e4m3 values; so is every quotient of the bf16 probe.
    And a one-ulp change of the scale moves them: fl(max|row| * fl(1/fp8_max)) misses the scale
    for some of them, as torch on CUDA computed it."""
    midpoints = _exact_midpoints()
    on_midpoint, scales_missed = 0, 0
    for w, s in probes.midpoint_block_probes((128, 128), fp8_max):
        x = reference.dequant_block(w, s)
        _, scale = reference.channel_fp8(x, fp8_max)
        for row, sc in zip(x, scale[:, 0], strict=True):
            amax = row.abs().max()
            assert Fraction(amax.item()) / Fraction(fp8_max) == Fraction(sc.item())  # the scale is exact
            reciprocal = torch.tensor(1.0) / torch.tensor(fp8_max)
            scales_missed += bool((amax * reciprocal) != sc)
            for v in row.tolist():
                if v != 0 and abs(v) != amax.item():
                    assert Fraction(abs(v)) / Fraction(sc.item()) in midpoints, v
                    on_midpoint += 1
    assert on_midpoint > 1000 and scales_missed >= 8
    (w,) = probes.midpoint_float_probes(fp8_max)[0]
    _, scale = reference.channel_fp8(w.float(), fp8_max)
    on_midpoint = 0
    for row, sc in zip(w.float(), scale[:, 0], strict=True):
        for v in row.tolist():
            if v != 0 and abs(v) != row.abs().max().item():
                assert Fraction(abs(v)) / Fraction(sc.item()) in midpoints, v
                on_midpoint += 1
    assert on_midpoint > 500


def test_probe_catches_a_device_that_divides_by_reciprocal_multiply(device_kernels):
    device_kernels("reciprocal_division")
    k = select_kernels((128, 128), 448.0, "meta", "eager", ("fp8", "bf16", "quant"))
    assert (k.name, k.device, k.device_check) == ("eager", "cpu", "differed")
    differed = _differed(k.device_reason)
    assert set(differed) == {"fp8", "quant"}  # bf16, the dequant and the split divide nothing
    for counts in differed.values():
        weights, scales = counts.split(" and ")
        assert int(weights.split()[0]) > 0 and weights.endswith("weights")
        assert int(scales.split()[0]) > 0 and scales.endswith("scales")
    assert k.reason == "meta did not pass its check (device_reason), the CPU converts: requested"


def test_probe_would_have_caught_issue_16_and_passes_its_fix(device_kernels, monkeypatch):
    """Under torch-on-CUDA's rule (a Python-number divisor is a reciprocal multiply) the channel
    scale as numerics computed it before the fix differs on the probe, in the scales and hence in
    weights; as numerics computes it now, with a 0-dim tensor divisor, the device passes."""
    device_kernels("cuda_scalar_division")
    k = select_kernels((128, 128), 448.0, "meta", "eager", ("fp8", "quant"))
    assert (k.device, k.device_check) == ("meta", "passed"), k.device_reason
    assert k.device_reason.startswith("meta: fp8, quant, dequant, mla bit-identical to eager on the CPU, on the probe")
    assert k.reason == "eager numerics on meta"

    def channel_scales_before_the_fix(dequant, fp8_max):
        scale = dequant.abs().amax(dim=1) / fp8_max
        return torch.where(scale > 0, scale, torch.ones_like(scale))

    monkeypatch.setattr(numerics, "channel_scales", channel_scales_before_the_fix)
    kernels.forget()
    k = select_kernels((128, 128), 448.0, "meta", "eager", ("fp8", "quant"))
    assert k.device_check == "differed" and k.device == "cpu"
    differed = _differed(k.device_reason)
    assert set(differed) == {"fp8", "quant"} and all(" scales" in counts for counts in differed.values())


@pytest.mark.parametrize(
    ("fake", "ops", "differing"),
    [
        ("unsigned_zero_ignored", ("fp8", "quant"), {"fp8", "quant"}),  # gaudi2 writing -0
        ("subnormals_flushed", ("fp8", "bf16"), {"fp8", "bf16", "dequant", "mla"}),  # E8M0 2^-127...
        ("bf16_truncated", ("fp8", "bf16"), {"bf16"}),
    ],
)
def test_probe_catches_minus_zero_flushed_subnormals_and_truncation(device_kernels, fake, ops, differing):
    device_kernels(fake)
    k = select_kernels((128, 128), 240.0, "meta", "eager", ops, signed_zero=False)
    assert k.device_check == "differed" and k.device == "cpu"
    assert set(_differed(k.device_reason)) == differing


def test_a_device_that_cannot_run_the_numerics_falls_back(monkeypatch):
    """No device kernel set injected: eager numerics on "meta" cannot produce values."""
    kernels.forget()
    monkeypatch.delitem(DEVICE_KERNEL_FACTORIES, "meta", raising=False)
    k = select_kernels((128, 128), 448.0, "meta", "eager", ("fp8",))
    assert (k.device, k.device_check) == ("cpu", "failed")
    assert k.device_reason.startswith("meta failed on the probe (NotImplementedError: ")


def test_the_cpu_needs_no_device_check():
    k = select_kernels((128, 128), 448.0, "cpu", "eager", ("fp8",))
    assert (k.device, k.device_check, k.device_reason) == ("cpu", "not needed", "the arithmetic runs on the CPU")


def test_conversion_on_a_device_that_differs_writes_the_cpu_bytes(
    tiny_src, converted, tmp_path, device_kernels, tree_hashes
):
    device_kernels("reciprocal_division")
    summary = convert(tiny_src, tmp_path / "o", Options(), device="meta")
    assert (summary.device, summary.compute_device, summary.device_check) == ("meta", "cpu", "differed")
    assert set(_differed(summary.device_reason)) == {"fp8"}
    assert summary.kernels_reason == "meta did not pass its check (device_reason), the CPU converts: requested"
    assert tree_hashes(tmp_path / "o") == tree_hashes(converted[FP8])


def test_only_the_ops_a_run_uses_decide(tiny_src, converted, tmp_path, device_kernels, tree_hashes):
    """A bf16 conversion divides nothing: the same device passes and converts, to the same bytes."""
    device_kernels("reciprocal_division")
    summary = convert(tiny_src, tmp_path / "o", Options(format=BF16), device="meta")
    assert (summary.compute_device, summary.device_check) == ("meta", "passed"), summary.device_reason
    assert summary.device_reason.startswith("meta: bf16, dequant, mla bit-identical to eager on the CPU")
    assert tree_hashes(tmp_path / "o") == tree_hashes(converted[BF16])


def test_conversion_on_a_device_that_passes_writes_the_cpu_bytes(
    tiny_src, converted, tmp_path, device_kernels, monkeypatch, tree_hashes
):
    monkeypatch.delenv("MLA_CONVERT_KERNELS")  # --kernels auto: its CPU policy is not the reason
    device_kernels("cuda_scalar_division")
    summary = convert(tiny_src, tmp_path / "o", Options(), device="meta")
    assert (summary.compute_device, summary.device_check, summary.kernels) == ("meta", "passed", "eager")
    assert summary.kernels_reason == "eager numerics on meta"
    assert tree_hashes(tmp_path / "o") == tree_hashes(converted[FP8])


@pytest.mark.slow
def test_each_process_checks_the_device_once_before_it_writes(
    tiny_src, converted, tmp_path, device_kernels, monkeypatch, tree_hashes
):
    """--workers 2: the main process checks the device before the output directory holds a file,
    and each worker checks it once, in its first shard job before that job opens its writer, and
    before any of its conversions."""
    log, out = tmp_path / "device.log", tmp_path / "o"
    monkeypatch.setenv("MLA_TEST_DEVICE_LOG", str(log))
    monkeypatch.setenv("MLA_TEST_DEVICE_OUT", str(out))
    device_kernels("cuda_scalar_division")
    summary = convert(tiny_src, out, Options(), device="meta", workers=2)
    assert summary.device_check == "passed"
    assert tree_hashes(out) == tree_hashes(converted[FP8])
    events: dict[int, list[tuple[str, str]]] = {}
    for line in log.read_text().splitlines():
        pid, event, detail = line.split()
        events.setdefault(int(pid), []).append((event, detail))
    main = events.pop(os.getpid())
    assert main[0] == ("factory", "files=0") and {e for e, _ in main[1:]} == {"probe"}
    assert events, "no worker converted anything"
    for pid, ev in events.items():
        kinds = [e for e, _ in ev]
        assert ev[0] == ("factory", "job-not-writing"), (pid, ev[:3])
        assert kinds.count("factory") == 1 and "convert" in kinds
        first_convert = kinds.index("convert")
        assert set(kinds[1:first_convert]) == {"probe"} and set(kinds[first_convert:]) == {"convert"}


@pytest.mark.parametrize(("fake", "fmt"), [("bf16_truncated", BF16), ("reciprocal_division", FP8)])
def test_what_verify_holds_a_device_to(
    tiny_src, converted, tmp_path, device_kernels, monkeypatch, tree_hashes, fake, fmt
):
    """verify computes its references on the CPU whatever device converted. Past a (disabled)
    device check: a bf16 output that is not the CPU's bytes fails bf16-exact, as would copies and
    the MLA split; a channel-FP8 output that is not the CPU's bytes passes, as its check is the
    e4m3 accuracy bound, which a reciprocal-multiply division meets. Byte identity of channel FP8
    across devices rests on the device check alone."""
    device_kernels(fake)
    monkeypatch.setattr(kernels, "_check_against_eager", lambda *a: 0)
    out = tmp_path / "o"
    assert convert(tiny_src, out, Options(format=fmt), device="meta").compute_device == "meta"
    cpu = tree_hashes(converted[fmt])
    differing = [rel for rel, h in tree_hashes(out).items() if h != cpu[rel]]
    assert any(rel.endswith(".safetensors") and not rel.startswith("mla/") for rel in differing)
    report = verify(out, source=tiny_src)
    found = {(f.group, f.check) for f in report.failures()}
    assert found == ({("source", "bf16-exact")} if fmt == BF16 else set())
