"""FID protocols: the paper configs default to the release's, results and tables name them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from uvic.cli import fid_table
from uvic.config import apply_overrides, load_config
from uvic.evaluation.protocols import (
    NOT_FID,
    OLD_SAMPLERS,
    RELEASE,
    Protocol,
    protocol_from_result,
    protocol_of,
    protocol_table,
)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("name", ["cifar10_uvit", "cifar10_uvic", "mscoco_uvit", "mscoco_uvic"])
def test_paper_configs_default_to_the_release_protocol(name: str) -> None:
    cfg = load_config(CONFIGS / f"{name}.py")
    assert protocol_of(cfg) == RELEASE[cfg.data.name]
    fast = apply_overrides(cfg, ["sample.scheduler=dpm_solver++", "eval.mode=clean"])
    assert protocol_of(fast) != RELEASE[cfg.data.name]


def test_protocol_labels() -> None:
    assert RELEASE["cifar10"].label() == (
        "euler_maruyama 1000 steps, 50000 samples, legacy_pytorch, ref cifar10/train/32")
    assert RELEASE["mscoco"].label() == (
        "dpm_solver++_fast_time_uniform 50 steps, guidance 1, 30000 samples, legacy_pytorch, "
        "ref mscoco_val2014_256/val/256")
    cfg = apply_overrides(load_config(CONFIGS / "cifar10_uvit.py"), [
        "sample.scheduler=dpm_solver++", "sample.steps=50",
        'sample.scheduler_kwargs={"use_lu_lambdas": false}'])
    p = protocol_of(cfg, n=1000, features="tiny16")
    assert p.label() == ("dpm_solver++ order 3 (use_lu_lambdas=False) 50 steps, 1000 samples, "
                         "legacy_pytorch, ref cifar10/train/32, features tiny16 (stand-in: "
                         "NOT comparable with Inception FID)")
    assert protocol_from_result({"protocol": p.as_dict()}) == p
    assert p.as_dict()["comparable_with_inception_fid"] is False
    assert RELEASE["cifar10"].as_dict()["comparable_with_inception_fid"] is True


def test_projection_features_are_a_protocol_labelled_not_fid() -> None:
    """eval.features=projection (the download-free stand-in) is part of the protocol and
    its label says the number is not an FID; Inception's label is unchanged."""
    cfg = load_config(CONFIGS / "cifar10_uvic.py", ["eval.features=projection"])
    p = protocol_of(cfg)
    assert p.features == "projection" and not p.inception and p != RELEASE["cifar10"]
    assert p.label() == (f"{RELEASE['cifar10'].label()}, features projection (stand-in: "
                         f"{NOT_FID})")


def result(model: str, dataset: str, fid: float, protocol: Protocol) -> dict:
    return {"model": model, "dataset": dataset, "fid": fid, "checkpoint": f"{model}.pth",
            "protocol": protocol.as_dict(), "_path": "r.json"}


def test_table_never_mixes_protocols_in_a_column() -> None:
    fast = Protocol("dpm_solver++ order 3", 50, 0.0, 50_000, "clean", "cifar10/train/32")
    results = [result("U-ViT", "cifar10", 3.30, RELEASE["cifar10"]),
               result("U-ViT", "cifar10", 3.20, RELEASE["cifar10"]),  # best of a protocol
               result("U-ViC", "cifar10", 2.90, fast),  # better, but another protocol
               result("U-ViC", "mscoco", 6.10, RELEASE["mscoco"])]
    table = protocol_table(results)
    lines = table.splitlines()
    header = [c.strip() for c in lines[0].split("|")[1:-1]]
    assert header == ["Model", "CIFAR-10 (P1)", "CIFAR-10 (P2)", "CIFAR-10 (paper)",
                      "MS-COCO 256 (P3)", "MS-COCO 256 (paper)"]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in lines if line.startswith("| U-Vi")}
    assert rows["U-ViT"] == ["3.20", "—", "3.39 (release 3.11)", "—", "5.99 (release 5.95)"]
    assert rows["U-ViC"] == ["—", "2.90", "3.27", "6.10", "5.85"]
    assert f"- P1: {RELEASE['cifar10'].label()} — *release protocol*" in lines
    assert f"- P2: {fast.label()}" in lines
    assert f"- P3: {RELEASE['mscoco'].label()} — *release protocol*" in lines


def test_results_of_the_old_mscoco_sampler_keep_their_own_protocol() -> None:
    """A result measured with uvic's old `dpm_solver_fast` (not the release's protocol)
    is read back under a name saying so: its own column, never the release's."""
    old = {**RELEASE["mscoco"].as_dict(), "sampler": "dpm_solver_fast",
           "label": "dpm_solver_fast 50 steps, guidance 1, 30000 samples, legacy_pytorch, "
                    "ref mscoco_val2014_256/val/256"}  # as eval/fid.py wrote it then
    p = protocol_from_result({"protocol": old})
    assert p != RELEASE["mscoco"] and p.sampler == OLD_SAMPLERS["dpm_solver_fast"]
    assert p.label().startswith("old dpm_solver_fast (uvic's former MS-COCO sampler, "
                                "not the release's protocol) 50 steps, guidance 1, 30000")
    table = protocol_table([result("U-ViC", "mscoco", 6.10, RELEASE["mscoco"]),
                            {**result("U-ViT", "mscoco", 5.90, RELEASE["mscoco"]),
                             "protocol": old}])
    lines = table.splitlines()
    header = [c.strip() for c in lines[0].split("|")[1:-1]]
    assert header[-3:] == ["MS-COCO 256 (P1)", "MS-COCO 256 (P2)", "MS-COCO 256 (paper)"]
    assert f"- P1: {RELEASE['mscoco'].label()} — *release protocol*" in lines
    assert f"- P2: {p.label()}" in lines
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in lines if line.startswith("| U-Vi")}
    assert rows["U-ViT"][-3:] == ["—", "5.90", "5.99 (release 5.95)"]
    assert rows["U-ViC"][-3:] == ["6.10", "—", "5.85"]


def test_table_marks_stand_in_columns() -> None:
    stand_in = Protocol("euler_maruyama", 1000, 0.0, 50_000, "legacy_pytorch",
                        "cifar10/train/32", "projection")
    table = protocol_table([result("U-ViT", "cifar10", 3.30, RELEASE["cifar10"]),
                            result("U-ViC", "cifar10", 0.12, stand_in)])
    header = [c.strip() for c in table.splitlines()[0].split("|")[1:-1]]
    assert header == ["Model", "CIFAR-10 (P1)", "CIFAR-10 (P2, stand-in: not FID)",
                      "CIFAR-10 (paper)", "MS-COCO 256 (paper)"]
    assert f"their numbers are {NOT_FID}" in table
    assert "- U-ViC / CIFAR-10 (P2): stand-in FID (projection features) 0.120" in table
    assert "- U-ViT / CIFAR-10 (P1): FID 3.300" in table
    # Inception only: no stand-in wording anywhere
    assert "stand-in" not in protocol_table([result("U-ViT", "cifar10", 3.3, RELEASE["cifar10"])])


def test_table_refuses_results_without_protocol() -> None:
    with pytest.raises(ValueError, match="names no protocol"):
        protocol_table([{"model": "U-ViT", "dataset": "cifar10", "fid": 3.0, "_path": "old.json"}])


def scored(model: str, fid: float, path: str, digest: str | None) -> dict:
    """A CIFAR-10 result under the release protocol, scored against reference `digest`."""
    r = {**result(model, "cifar10", fid, RELEASE["cifar10"]), "_path": path}
    return r if digest is None else {**r, "reference_digest": digest}


def table_rows(table: str) -> dict[str, list[str]]:
    return {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in table.splitlines() if line.startswith("| U-Vi")}


def test_table_keeps_results_of_different_references_apart() -> None:
    """One protocol, two reference digests: two columns, each marked with its digest, the
    best picked within each only, and a note naming the files of each."""
    a, b = "abcdef0123456789", "0123456789abcdef"
    table = protocol_table([scored("U-ViT", 3.30, "fid/a.json", a),
                            scored("U-ViT", 3.10, "fid/b.json", b),  # better, other reference
                            scored("U-ViC", 3.00, "fid/c.json", a)])
    header = [c.strip() for c in table.splitlines()[0].split("|")[1:-1]]
    assert header[1:3] == ["CIFAR-10 (P1, ref 01234567)", "CIFAR-10 (P1, ref abcdef01)"]
    assert table_rows(table)["U-ViT"][:2] == ["3.10", "3.30"]
    assert table_rows(table)["U-ViC"][:2] == ["—", "3.00"]
    assert "scored against different reference statistics" in table
    assert "- CIFAR-10, P1: ref 01234567: fid/b.json; ref abcdef01: fid/a.json, fid/c.json" \
        in table.splitlines()
    assert "- U-ViT / CIFAR-10 (P1, ref abcdef01): FID 3.300" in table


def test_table_marks_an_unknown_reference_beside_a_known_one() -> None:
    table = protocol_table([scored("U-ViT", 3.30, "fid/new.json", "abcdef0123456789"),
                            scored("U-ViT", 3.10, "fid/old.json", None)])
    header = [c.strip() for c in table.splitlines()[0].split("|")[1:-1]]
    assert header[1:3] == ["CIFAR-10 (P1, ref abcdef01)", "CIFAR-10 (P1, ref unknown)"]
    assert table_rows(table)["U-ViT"][:2] == ["3.30", "3.10"]
    assert "- CIFAR-10, P1: ref abcdef01: fid/new.json; ref unknown: fid/old.json" \
        in table.splitlines()


@pytest.mark.parametrize("digest", [None, "abcdef0123456789"])
def test_one_reference_leaves_the_table_as_it_was(digest: str | None) -> None:
    """All results of a column with one digest, or none: no mark, no note, the same table."""
    plain = [result("U-ViT", "cifar10", 3.3, RELEASE["cifar10"]),
             result("U-ViC", "cifar10", 3.1, RELEASE["cifar10"])]
    same = [r if digest is None else {**r, "reference_digest": digest} for r in plain]
    assert protocol_table(same) == protocol_table(plain)
    assert "ref abcdef01" not in protocol_table(same) and "reference statistics" not in \
        protocol_table(same)


def test_fid_table_names_the_files_of_each_reference(tmp_path: Path, capsys) -> None:
    """uvic-fid-table on a folder of result JSONs: the note names the files as found."""
    for name, digest in [("a", "abcdef0123456789"), ("b", "0123456789abcdef")]:
        r = {k: v for k, v in scored("U-ViT", 3.0, "", digest).items() if k != "_path"}
        (tmp_path / f"{name}.json").write_text(json.dumps(r))
    assert fid_table.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"ref 01234567: {tmp_path / 'b.json'}; ref abcdef01: {tmp_path / 'a.json'}" in out
    (tmp_path / "c.json").write_text(json.dumps({**r, "reference_digest": 12}))
    assert fid_table.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {tmp_path / 'c.json'}: reference_digest 12 is not a hex digest " \
                  "(a result JSON of eval/fid.py writes one)\n"


def test_results_shown_in_protocol_number_order() -> None:
    """"Results shown" lists P2 before P10 (by number, not as text)."""
    protocols = [Protocol("euler_maruyama", steps, 0.0, 50_000, "clean", "cifar10/train/32")
                 for steps in range(10, 22)]
    table = protocol_table([result("U-ViT", "cifar10", 3.0 + i, p)
                            for i, p in enumerate(protocols)])
    shown = table.split("Results shown:")[1]
    order = [shown.index(f"(P{i})") for i in range(1, 13)]
    assert order == sorted(order)


def test_cells_of_several_seeds_carry_their_interval() -> None:
    """Three seeds (each its best of two checkpoints): FIDs 3.0, 3.2, 3.7 -> mean 3.3, sd
    sqrt(0.13), half-width t(0.975, 2) sqrt(0.13 / 3) = 0.896 (t by its closed form)."""
    def seeded(model: str, fid: float, seed: int) -> dict:
        return {**result(model, "cifar10", fid, RELEASE["cifar10"]),
                "config": {"train": {"seed": seed}}}

    results = [seeded("U-ViT", 3.0, 1), seeded("U-ViT", 3.2, 2), seeded("U-ViT", 3.7, 3),
               seeded("U-ViT", 4.5, 3),  # seed 3's other checkpoint: not its best
               seeded("U-ViC", 3.1, 1)]  # one seed: its number, no interval
    table = protocol_table(results)
    half = 0.95 / math.sqrt(2 * 0.975 * 0.025) * math.sqrt(0.13 / 3)
    assert table_rows(table)["U-ViT"][0] == f"3.30 ± {half:.2f} (3 seeds)" == \
        "3.30 ± 0.90 (3 seeds)"
    assert table_rows(table)["U-ViC"][0] == "3.10"
    assert "mean of each seed's best FID ± the half-width of its 95% Student-t" in table
    assert table.count("- U-ViT / CIFAR-10") == 3  # each seed's result shown


def test_table3_pairs_the_twins_by_seed() -> None:
    """Table 3 with 3 seeds of both twins: U-ViC − U-ViT FID paired by training seed under
    it, with the difference it could detect; one shared seed gives no such line."""
    from uvic.evaluation.paired import paired_difference

    def seeded(model: str, fid: float, seed: int) -> dict:
        return {**result(model, "cifar10", fid, RELEASE["cifar10"]),
                "config": {"train": {"seed": seed}}}

    uvit, uvic = {1: 3.0, 2: 3.2, 3: 3.7}, {1: 2.9, 2: 3.25, 3: 3.5}
    table = protocol_table([*(seeded("U-ViT", f, s) for s, f in uvit.items()),
                            *(seeded("U-ViC", f, s) for s, f in uvic.items())])
    d = paired_difference(uvit, uvic, ("U-ViT", "U-ViC"))
    assert (f"- CIFAR-10, P1: {d.mean:+.3f} ± {d.t_half_width:.3f} over 3 seeds (paired t p "
            f"{d.t_p:.2g}): inconclusive: MDE {d.mde:.3g} at 80% power") in table
    one = protocol_table([seeded("U-ViT", 3.0, 1), seeded("U-ViC", 2.9, 1)])
    assert "paired by training seed" not in one


def test_protocol_records_autoguidance_and_older_results_still_read(tmp_path: Path) -> None:
    """Two results differing only in their autoguidance never share a label; without it
    the record has no autoguidance keys (results before them read back the same)."""
    from uvic.evaluation.fid import _check_samples_meta, _samples_meta

    base = load_config(CONFIGS / "quickstart.py")
    guide = base.sample.autoguidance_ckpt
    auto, half = (protocol_of(apply_overrides(base, [f"sample.autoguidance_scale={w}"]))
                  for w in (1.0, 0.5))
    plain = protocol_of(apply_overrides(base, ["sample.autoguidance_scale=0"]))
    assert len({auto, half, plain}) == 3 and len({auto.label(), half.label(), plain.label()}) == 3
    assert f"autoguidance 1 (guide {guide})" in auto.label() and guide
    assert (auto.autoguidance, auto.guide) == (1.0, guide) and plain.guide == ""
    assert "autoguidance" not in plain.label()
    assert not {"autoguidance", "guide"} & plain.as_dict().keys()
    for p in (auto, plain):  # a result JSON's round trip
        assert protocol_from_result(json.loads(json.dumps({"protocol": p.as_dict()}))) == p

    def meta(w: float) -> dict:
        cfg = apply_overrides(base, [f"sample.autoguidance_scale={w}"])
        return _samples_meta(cfg, "sha", 0, "fp32", None)

    path = tmp_path / "samples.json"
    path.write_text(json.dumps(meta(0)))
    _check_samples_meta(tmp_path, meta(0), write=False)  # a folder without: matches
    for w in (1.0, 0.5):
        with pytest.raises(ValueError, match="autoguidance"):
            _check_samples_meta(tmp_path, meta(w), write=False)
    path.write_text(json.dumps(meta(1.0)))
    _check_samples_meta(tmp_path, meta(1.0), write=False)
    for w in (0.5, 0.0):
        with pytest.raises(ValueError, match="autoguidance"):
            _check_samples_meta(tmp_path, meta(w), write=False)


def test_fid_table_shows_the_metrics_beside_fid(tmp_path: Path, capsys) -> None:
    """uvic-fid-table: a column with FD-DINOv2 / precision / recall results gets their
    columns (of the result the FID cell shows: each seed's lowest FID), blank for a result
    without them; the other columns and a table of FID-only results are unchanged."""
    fast = Protocol("dpm_solver++ order 3", 50, 0.0, 50_000, "clean", "cifar10/train/32")
    plain = [result("U-ViT", "cifar10", 3.2, RELEASE["cifar10"]),
             result("U-ViC", "cifar10", 3.1, RELEASE["cifar10"]),
             result("U-ViT", "cifar10", 2.9, fast)]
    metrics = {"fd_dinov2": 250.123, "precision": 0.6789, "recall": 0.5012}
    worse = {**plain[1], "fid": 3.5, "fd_dinov2": 1.0, "precision": 0.0, "recall": 0.0}
    results = [plain[0], {**plain[1], **metrics}, worse, plain[2]]
    for i, r in enumerate(results):
        (tmp_path / f"{i}.json").write_text(json.dumps({k: v for k, v in r.items()
                                                       if k != "_path"}))
    assert fid_table.main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = [c.strip() for c in lines[0].split("|")[1:-1]]
    assert header == ["Model", "CIFAR-10 (P1)", "CIFAR-10 (P1) FD-DINOv2",
                      "CIFAR-10 (P1) precision", "CIFAR-10 (P1) recall", "CIFAR-10 (P2)",
                      "CIFAR-10 (paper)", "MS-COCO 256 (paper)"]
    rows = table_rows("\n".join(lines))
    assert rows["U-ViC"][:5] == ["3.10", "250.12", "0.679", "0.501", "—"]
    assert rows["U-ViT"][:5] == ["3.20", "", "", "", "2.90"]
    assert any(line.startswith("Beside FID: FD-DINOv2") for line in lines)
    assert "FD-DINOv2" not in protocol_table(plain) and "Beside FID" not in protocol_table(plain)
    assert protocol_table(plain).splitlines()[0] == (
        "| Model | CIFAR-10 (P1) | CIFAR-10 (P2) | CIFAR-10 (paper) | MS-COCO 256 (paper) |")


def test_metric_cell_of_several_seeds_is_their_interval() -> None:
    """Precision 0.5, 0.6, 0.7 of three seeds' best-FID results (a worse checkpoint's 0.0
    left out): mean 0.6 ± t(0.975, 2) 0.1 / sqrt(3) = 0.248; none recorded: blank."""
    from uvic.evaluation.cells import metric_cell

    def seeded(fid: float, seed: int, precision: float) -> dict:
        return {**result("U-ViT", "cifar10", fid, RELEASE["cifar10"]), "precision": precision,
                "config": {"train": {"seed": seed}}}

    cell = metric_cell([seeded(3.0, 1, 0.5), seeded(3.1, 2, 0.6), seeded(3.2, 3, 0.7),
                        seeded(4.0, 3, 0.0)], "precision")
    mean, half = (float(x) for x in cell.removesuffix(" (3 seeds)").split(" ± "))
    t = 0.95 / math.sqrt(2 * 0.975 * 0.025)
    assert mean == 0.6 and half == pytest.approx(t * 0.1 / math.sqrt(3), abs=0.005)
    assert metric_cell([seeded(3.0, 1, 0.5)], "recall") == ""
