"""The disk tier over several drives, from the user's side: engine.nvme.dir as a list, machine files that list
drives, each folder planned at its drive's rates, a run striped over two folders, and the plan's figures."""

from __future__ import annotations

import json
import pathlib

import pytest
from conftest import save_tiny_model, write_token_rows
from test_equivalence import ACCUM, MICRO, STEPS, make_rows, slide_config
from test_machines import cache  # noqa: F401 (a fixture: an empty cache and counting stand-ins for the probes)

from slide_scheduler import Disk, Machine, drive_shares
from slide_train import disk_tier
from slide_train.cli import main
from slide_train.config import load_config
from slide_train.disk_tier import on_drives
from slide_train.errors import ConfigError
from slide_train.export import hf_tensors
from slide_train.machines import load_machine, save_machine
from slide_train.trainer import Trainer

DOCS = pathlib.Path(__file__).resolve().parents[3] / "docs" / "machines"
MISTRAL = ["--model=mistral-large-2", "--seq_len=4096", "--micro_batch_size=1", "--grad_accum=8",
           "--max_grad_norm=1.0"]


def plan_json(capsys, machine: str, *args: str) -> dict:
    assert main(["plan", *MISTRAL, *args, "--machine", str(DOCS / machine), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_mistral_large_2_on_two_drives_takes_at_most_0_67_of_one_drives_step(capsys):
    """The disk-bound run of docs/placement.md: a second drive like the first stripes the tier in two halves,
    each drive's bytes and wear in the plan, together the tier's."""
    one = plan_json(capsys, "rtx4090-pc.yaml")
    two = plan_json(capsys, "rtx4090-pc-two-drives.yaml")
    assert one["bottleneck"] == "disk" and one["fits"] and two["fits"]
    assert two["predicted_step_s"] <= 0.67 * one["predicted_step_s"], (two["predicted_step_s"],
                                                                       one["predicted_step_s"])
    drives = two["drives"]
    assert [d["dir"] for d in drives] == ["/mnt/nvme0", "/mnt/nvme1"] and "drives" not in one
    assert sum(d["bytes"] for d in drives) == two["disk_bytes"]
    read, written = two["disk_traffic"]
    assert sum(d["read_bytes"] for d in drives) == read and sum(d["written_bytes"] for d in drives) == written
    assert drives[0]["bytes"] == pytest.approx(drives[1]["bytes"], rel=0.05)
    for d in drives:  # each drive's busy time at its own rates, and its rating over what it writes
        assert d["busy_s"] == pytest.approx(d["read_bytes"] / 7e9 + d["written_bytes"] / 6e9)
        assert d["steps_to_tbw"] == pytest.approx(2400e12 / d["written_bytes"])
    assert two["lanes_s"]["disk"] == pytest.approx(max(d["busy_s"] for d in drives))
    assert main(["plan", *MISTRAL, "--machine", str(DOCS / "rtx4090-pc-two-drives.yaml")]) == 0
    text = capsys.readouterr().out
    assert "the disk tier striped over 2 drives" in text and "drive 1 (/mnt/nvme1)" in text and "TBW lasts" in text


def test_a_machine_file_with_drives_loads_and_round_trips_and_a_bad_one_is_one_clear_line(tmp_path):
    machine = load_machine(DOCS / "rtx4090-pc-two-drives.yaml")
    assert len(machine.drives) == 2 and machine.drives[1].dir == "/mnt/nvme1" and machine.drives[1].tbw == 2400
    save_machine(machine, tmp_path / "copy.yaml")
    assert load_machine(tmp_path / "copy.yaml") == machine
    single = load_machine(DOCS / "rtx4090-pc-raid0.yaml")
    save_machine(single, tmp_path / "single.yaml")
    assert load_machine(tmp_path / "single.yaml") == single and single.drives == (single.disk,)
    assert "disks" not in (tmp_path / "single.yaml").read_text()
    for body, words in (
            ("disks:\n  - {read_gbps: 7.0}\n", "disks[0] needs dir"),
            ("disks:\n  - {dir: /a, read_gbps: -7.0}\n", "disks[0].read_gbps must be a number of at least 0"),
            ("disks:\n  - {dir: /a, read_gbps: .nan}\n", "disks[0].read_gbps must be a finite number")):
        (tmp_path / "bad.yaml").write_text(body)
        with pytest.raises(ConfigError, match=r"machine file .*bad\.yaml: " + words.replace("[", r"\[")) as error:
            load_machine(tmp_path / "bad.yaml")
        assert "\n" not in str(error.value)


def test_nvme_dir_takes_a_folder_or_a_list_and_refuses_anything_else():
    assert load_config(None, ["--engine.nvme.dir=/a"]).engine.nvme.dir == "/a"
    assert load_config(None, ["--engine.nvme.dir=[/a, /b]"]).engine.nvme.dir == ["/a", "/b"]
    for value, words in (("[]", "non-empty list"), ("[/a, /a]", "names a folder twice"), ("[/a, 3]", "string"),
                         ("['']", "a folder or a list of folders")):
        with pytest.raises(ConfigError, match=words) as error:
            load_config(None, [f"--engine.nvme.dir={value}"])
        assert "engine.nvme.dir" in str(error.value) and "\n" not in str(error.value)


def test_each_folder_is_planned_at_the_rates_of_the_drive_it_is_on(tmp_path, recwarn, monkeypatch):
    """The longest prefix among the drives' folders names the drive, else the filesystem; a folder on none of
    them takes the first drive's rates and says so."""
    fast, slow = (Disk(dir=str(tmp_path / name), read_gbps=r, write_gbps=r, free_gib=100) for name, r in
                  (("fast", 7.0), ("fast/slow", 2.0)))
    machine = Machine(disks=(fast, slow))
    got = on_drives(machine, [tmp_path / "fast" / "slow" / "run", tmp_path / "fast" / "run"])
    assert [d.read_gbps for d in got.drives] == [2.0, 7.0]
    assert [d.dir for d in got.drives] == [str(tmp_path / "fast" / "slow" / "run"), str(tmp_path / "fast" / "run")]
    assert not recwarn.list
    got = on_drives(machine, [tmp_path / "elsewhere"])  # (the same filesystem as the first drive's folder)
    assert got.drives[0].read_gbps == 7.0 and not recwarn.list
    # each path its own filesystem: a folder under none of the drives' folders is on none of them
    monkeypatch.setattr(disk_tier, "_device_of", lambda path: hash(str(path)))
    nowhere = Machine(disks=(Disk(dir="/drive-a", read_gbps=3.0), Disk(dir="/drive-b", read_gbps=5.0)))
    with pytest.warns(UserWarning, match="on none of the machine file's drives"):
        assert on_drives(nowhere, [tmp_path / "x"]).drives[0].read_gbps == 3.0
    assert on_drives(nowhere, ["/drive-b/run"]).drives[0].read_gbps == 5.0


def test_a_run_over_two_folders_gives_one_folders_weights_and_each_holds_its_share(tmp_path):
    """Masters, moments and boundary activations on disk, striped over two folders by the plan: the same losses
    and weights bit for bit as one folder, and each folder holds the bytes the placement puts on its drive."""
    save_tiny_model(tmp_path / "model", "llama")
    rows, labels = make_rows(seed=5, n=STEPS * MICRO * ACCUM)
    write_token_rows(tmp_path / "data.jsonl", rows, labels)
    on_disk = {"engine.nvme.fraction": 1.0, "engine.activation_offload": "disk"}
    runs = {}
    for name, folders in (("one", [tmp_path / "d0"]), ("two", [tmp_path / "d1", tmp_path / "d2"])):
        for folder in folders:
            folder.mkdir()
        cfg = slide_config(tmp_path / name, tmp_path / "model", tmp_path / "data.jsonl", **on_disk,
                           **{"engine.nvme.dir": "[" + ", ".join(map(str, folders)) + "]"})
        trainer = Trainer(cfg, progress=False)
        losses = [trainer.step()["loss"] for _ in range(STEPS)]
        trainer.engine.synchronize()
        p = trainer.memory_plan.placement
        held = [sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) for folder in folders]
        runs[name] = (losses, dict(hf_tensors(trainer.engine.named_masters())), p, held)
        trainer.close()
    (ref_losses, ref, _, _), (losses, got, p, held) = runs["one"], runs["two"]
    assert p.drive_count == 2 and {p.drive_of(u) for u in p.on_disk} == {0, 1}
    assert losses == ref_losses and all(got[name].equal(t) for name, t in ref.items())
    assert held == [s.size for s in drive_shares(p, 2)] and all(held)


def test_probe_measures_each_folder_it_is_given_and_lists_them_as_disks(cache, tmp_path, capsys):  # noqa: F811
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert main(["probe", "--disk", a, "--disk", b, "--out", str(tmp_path / "box.yaml")]) == 0
    machine = load_machine(tmp_path / "box.yaml")
    assert [d.dir for d in machine.drives] == [a, b] and machine.drives[1].read_gbps == 2.0
    assert [c[0] for c in cache["probe"]] == [a] and [c[0] for c in cache["probe_disk"]] == [b]
    assert "disks:" in capsys.readouterr().out
    assert main(["probe", "--disk", a, "--out", str(tmp_path / "one.yaml")]) == 0
    assert "disks" not in (tmp_path / "one.yaml").read_text() and len(load_machine(tmp_path / "one.yaml").drives) == 1
