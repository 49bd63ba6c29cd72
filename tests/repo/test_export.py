"""`export` of Hugging Face checkpoint folders: the weights under their own names, or everything with --all."""

import json
import os

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ckptstore import Repository
from ckptstore.cli import cli
from ckptstore.errors import CkptError
from ckptstore.repo import export
from tests.conftest import ckpt_here


def _training_files(folder):
    torch.save({"state": {0: {"exp_avg": torch.randn(4, 3)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
               folder / "optimizer.pt")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    (folder / "config.json").write_text(json.dumps({"model_type": "tiny"}))


def test_a_pytorch_model_bin_folder_exports_its_state_dict_names_and_bits(tmp_path):
    folder = tmp_path / "checkpoint-3"
    folder.mkdir()
    embed = torch.randn(8, 3)
    weights = {"embed.weight": embed, "head.weight": embed, "norm.bias": torch.randn(3).to(torch.bfloat16),
               "steps": torch.arange(5)}  # head tied to embed: one storage in the file
    torch.save(weights, folder / "pytorch_model.bin")
    _training_files(folder)
    with Repository.init(tmp_path / "repo") as repo:
        cid = repo.commit(folder, step=3)
        report = export(repo, "main", "safetensors", tmp_path / "w.safetensors")
        assert report.commit == cid and report.tensors == 4
        assert report.skipped == ["config.json", "optimizer.pt", "trainer_state.json"] and "--all" in report.why_skipped
        export(repo, "main", "torch", tmp_path / "w.pt")
        everything = export(repo, "main", "safetensors", tmp_path / "all.safetensors", everything=True)
    for loaded in (load_file(tmp_path / "w.safetensors"), torch.load(tmp_path / "w.pt", weights_only=True)):
        assert list(loaded) == list(weights)
        assert all(loaded[k].dtype == v.dtype and torch.equal(loaded[k], v) for k, v in weights.items())
    with safe_open(tmp_path / "w.safetensors", "pt") as handle:
        assert handle.metadata() == {"format": "pt"}  # what transformers before 4.40 requires
    every = load_file(tmp_path / "all.safetensors")  # by path; the tied pair under both of its keys
    assert sorted(every) == ["optimizer.pt/state/0/exp_avg", "pytorch_model.bin/embed.weight",
                             "pytorch_model.bin/head.weight", "pytorch_model.bin/norm.bias",
                             "pytorch_model.bin/steps"] and everything.tensors == 5


def test_sharded_safetensors_weights_are_exported_as_one_file(tmp_path):
    folder = tmp_path / "checkpoint-7"
    folder.mkdir()
    first, second = {"a.weight": torch.randn(4, 4)}, {"b.weight": torch.randn(2), "c.bias": torch.zeros(3)}
    save_file(first, folder / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file(second, folder / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    index = {"weight_map": {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002."
                            "safetensors", "c.bias": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    _training_files(folder)
    with Repository.init(tmp_path / "repo") as repo:
        repo.commit(folder)
    written = CliRunner().invoke(cli, ["--repo", str(tmp_path / "repo"), "export", "main", "-o",
                                       str(tmp_path / "w.safetensors")])
    assert written.exit_code == 0, written.output
    assert "3 tensors" in written.output and "model.safetensors.index.json" in written.output
    loaded = load_file(tmp_path / "w.safetensors")
    assert list(loaded) == ["a.weight", "b.weight", "c.bias"]
    assert all(torch.equal(loaded[k], v) for k, v in {**first, **second}.items())
    written = CliRunner().invoke(cli, ["--repo", str(tmp_path / "repo"), "export", "main", "--all", "-o",
                                       str(tmp_path / "all.safetensors")])
    assert written.exit_code == 0, written.output
    assert "model-00001-of-00002.safetensors/a.weight" in load_file(tmp_path / "all.safetensors")


def test_a_folder_without_model_weights_exports_every_tensor_by_path(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    torch.save({"w": torch.randn(3)}, folder / "state.pt")
    _training_files(folder)
    with Repository.init(tmp_path / "repo") as repo:
        repo.commit(folder)
        report = export(repo, "main", "safetensors", tmp_path / "w.safetensors")
    loaded = load_file(tmp_path / "w.safetensors")
    assert sorted(loaded) == ["optimizer.pt/state/0/exp_avg", "state.pt/w"] and report.tensors == 2


def test_an_export_path_without_its_folder_or_naming_a_folder_is_one_line(tmp_path):
    with Repository.init(tmp_path) as repo:
        torch.save({"w": torch.arange(12.0), "b": torch.ones(3), "step": 3, "names": ["a", "b"]}, tmp_path / "c.pt")
        repo.commit(tmp_path / "c.pt")
        assert export(repo, "HEAD", "torch", tmp_path / "x.pt").tensors == 2  # the file's other entries: no tensors
    for output, words in ((tmp_path / "nowhere" / "x.pt", "does not exist"), (tmp_path, "is a folder"),
                          (tmp_path / ".ckpt", "own .ckpt/ folder")):
        result = CliRunner().invoke(cli, ["--repo", str(tmp_path), "export", "HEAD", "-o", str(output)])
        assert result.exit_code == 1 and words in str(result.exception), result.output


def test_a_committed_file_exports_under_its_own_tensor_names(tmp_path):
    names = {"encoder/layer_0/kernel": torch.ones(2), "50%_sparse": torch.zeros(3), "0": torch.arange(4.0)}
    save_file(names, tmp_path / "w.safetensors", metadata={"format": "pt", "author": "me"})
    torch.save({"a": {"b": torch.ones(1)}, "a/b": torch.zeros(1)}, tmp_path / "clash.pt")  # would read alike
    with Repository.init(tmp_path / "repo") as repo:
        repo.commit(tmp_path / "w.safetensors")
        assert export(repo, "main", "safetensors", tmp_path / "back.safetensors").skipped == []  # header: no item
        repo.commit(tmp_path / "clash.pt")
        export(repo, "main", "safetensors", tmp_path / "clash.safetensors")
    back = load_file(tmp_path / "back.safetensors")
    with safe_open(tmp_path / "back.safetensors", "pt") as handle:
        assert handle.metadata() == {"format": "pt", "author": "me"}  # the file's own, kept
    assert sorted(back) == sorted(names) and all(torch.equal(back[k], v) for k, v in names.items())
    assert sorted(load_file(tmp_path / "clash.safetensors")) == ["a%2Fb", "a/b"]  # by path: both kept


def test_a_tensor_whose_name_holds_a_literal_percent_2f_exports_under_that_name(tmp_path):
    """The name "enc%2Fw" came out of the export as "enc/w": its stored path's escapes undone in the wrong order
    (mutation audit)."""
    names = {"enc%2Fw": torch.arange(4.0), "plain": torch.ones(2)}
    save_file(names, tmp_path / "model.safetensors")
    with Repository.init(tmp_path / "repo") as repo:
        repo.commit(tmp_path / "model.safetensors")
        export(repo, "main", "safetensors", tmp_path / "out.safetensors")
    back = load_file(tmp_path / "out.safetensors")
    assert sorted(back) == ["enc%2Fw", "plain"] and all(torch.equal(back[k], v) for k, v in names.items())


def test_tied_weights_export_under_every_key_that_holds_them(tmp_path):
    """`head.weight` is `embed.weight`: one entry in two places; the export had the first only (strict loads failed)."""
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight
    torch.save({"model": model.state_dict(), "layers": [model[0].weight, model[1].weight]}, tmp_path / "tied.pt")
    with Repository.init(tmp_path / "repo") as repo:
        repo.commit(tmp_path / "tied.pt")
        report = export(repo, "main", "safetensors", tmp_path / "tied.safetensors")
    back = load_file(tmp_path / "tied.safetensors")
    assert sorted(back) == ["layers/0", "layers/1", "model/0.weight", "model/1.weight"] and report.tensors == 4
    assert report.skipped == []  # the zip's own records are no item of the state
    assert all(torch.equal(tensor, model[0].weight) for tensor in back.values())
    strict = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    strict.load_state_dict({k.removeprefix("model/"): v for k, v in back.items() if k.startswith("model/")})


def test_an_output_that_is_a_device_or_pipe_is_refused_and_a_link_is_written_through(tmp_path):
    """-o /dev/null, written beside and renamed over, replaced the machine's /dev/null with a file (auditor, high);
    a pipe got a file in its place, and a link became a file of its own."""
    import os
    import stat

    from ckptstore.errors import CkptError

    with Repository.init(tmp_path) as repo:
        torch.save({"w": torch.arange(12.0)}, tmp_path / "c.pt")
        cid = repo.commit(tmp_path / "c.pt")
        specials = {tmp_path / "pipe": "a named pipe"}
        os.mkfifo(tmp_path / "pipe")
        try:
            os.mknod(tmp_path / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
            specials[tmp_path / "null"] = "a character device"
        except PermissionError:  # not root: the pipe stands for every special file
            pass
        for path, kind in specials.items():
            with pytest.raises(CkptError, match=f"{path} is {kind}, not a file"):
                export(repo, "HEAD", "safetensors", path)
            with pytest.raises(CkptError, match=f"{path} is {kind}, not a file"):
                repo.checkout_to(cid, path, force=True)
            assert not stat.S_ISREG(os.lstat(path).st_mode)
        (tmp_path / "real.safetensors").write_bytes(b"old")
        (tmp_path / "link.safetensors").symlink_to("real.safetensors")
        export(repo, "HEAD", "safetensors", tmp_path / "link.safetensors")
        assert (tmp_path / "link.safetensors").is_symlink()
        assert torch.equal(load_file(tmp_path / "real.safetensors")["w"], torch.arange(12.0))


def test_an_output_naming_a_descriptor_or_a_loop_of_links_is_one_line_and_writes_nothing(tmp_path):
    """-o /dev/stdout with stdout sent to a file: renamed over, /dev/stdout itself became a file as root (reader);
    a loop of links was an unexpected OSError."""
    from ckptstore.errors import CkptError

    with Repository.init(tmp_path) as repo:
        torch.save({"w": torch.arange(12.0)}, tmp_path / "c.pt")
        repo.commit(tmp_path / "c.pt")
        (tmp_path / "loop").symlink_to("loop")
        for output, said in (("/dev/stdout", "names an open descriptor|is a character device|is a named pipe"),
                             ("/proc/self/fd/1", "names an open descriptor|is a character device|is a named pipe"),
                             (tmp_path / "loop", "cannot be written: Too many levels of symbolic links")):
            with pytest.raises(CkptError, match=said):
                export(repo, "HEAD", "torch", output)
        assert os.path.islink("/dev/stdout") and (tmp_path / "loop").is_symlink()


def test_a_weights_file_wrapped_in_a_dict_is_refused_and_a_torch_name_exports_torch(tmp_path):
    """`{"module": state}` in pytorch_model.bin exported an empty file with exit 0; `-o model.bin` without --format
    wrote safetensors under a torch name that torch.load refused (interop auditor)."""
    folder = tmp_path / "checkpoint-5"
    folder.mkdir()
    weights = {"embed.weight": torch.randn(8, 3)}
    torch.save({"module": weights}, folder / "pytorch_model.bin")
    with Repository.init(tmp_path / "repo") as repo:
        repo.commit(folder, step=5)
        with pytest.raises(CkptError, match="pytorch_model.bin in this folder is no flat map .* with --all"):
            export(repo, "main", "torch", tmp_path / "w.pt")
        assert not (tmp_path / "w.pt").exists()
        (folder / "pytorch_model.bin").unlink()
        torch.save(weights, folder / "pytorch_model.bin")
        repo.commit(folder, step=6)
    result = CliRunner().invoke(cli, ["--repo", str(tmp_path / "repo"), "export", "main", "-o",
                                      str(tmp_path / "pytorch_model.bin")])
    assert result.exit_code == 0 and result.output.endswith("1 tensors (torch)\n"), result.output
    assert torch.equal(torch.load(tmp_path / "pytorch_model.bin", weights_only=True)["embed.weight"],
                       weights["embed.weight"])


def test_a_folders_safetensors_weights_keep_their_own_metadata_in_the_export(tmp_path):
    """A Trainer folder's model.safetensors lost its `__metadata__` on export, keeping only format=pt (auditor)."""
    folder = tmp_path / "checkpoint-1"
    folder.mkdir()
    save_file({"w": torch.randn(4, 4)}, folder / "model.safetensors", metadata={"modality": "text", "run": "r7"})
    _training_files(folder)
    with Repository.init(tmp_path / "repo") as repo:
        repo.commit(folder, step=1)
        export(repo, "main", "safetensors", tmp_path / "w.safetensors")
    with safe_open(tmp_path / "w.safetensors", "pt") as handle:
        assert handle.metadata() == {"modality": "text", "run": "r7", "format": "pt"}


def test_an_empty_key_exports_under_its_own_empty_name(tmp_path):
    """The key "" came out of a safetensors export as '%22%22' (its stored component), not as itself (auditor)."""
    torch.save({"": torch.ones(2), "w": torch.zeros(2)}, tmp_path / "ck.pt")
    with Repository.init(tmp_path / "repo") as repo:
        repo.commit(tmp_path / "ck.pt")
        export(repo, "main", "safetensors", tmp_path / "e.safetensors")
    exported = load_file(tmp_path / "e.safetensors")
    assert sorted(exported) == ["", "w"] and torch.equal(exported[""], torch.ones(2))


def test_a_torch_export_of_bin_weights_keeps_tied_weights_one_storage_and_the_metadata(tmp_path):
    """The export wrote each tensor on its own: twice the bytes for tied weights, and no `_metadata` (auditor)."""
    folder = tmp_path / "checkpoint-2"
    folder.mkdir()
    model = torch.nn.Sequential(torch.nn.Embedding(64, 8), torch.nn.Linear(8, 64, bias=False))
    model[1].weight = model[0].weight  # tied, as GPT-2's lm_head and wte
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    _training_files(folder)
    with Repository.init(tmp_path / "repo") as repo:
        repo.commit(folder, step=2)
        report = export(repo, "main", "torch", tmp_path / "w.bin")
    back = torch.load(tmp_path / "w.bin", weights_only=True)
    assert report.tensors == 2 and list(back) == ["0.weight", "1.weight"]
    assert back["0.weight"].untyped_storage().data_ptr() == back["1.weight"].untyped_storage().data_ptr()
    assert back._metadata == model.state_dict()._metadata and torch.equal(back["1.weight"], model[0].weight)


def test_an_items_name_in_the_left_out_note_is_the_path_show_lists_and_only_takes(tmp_path):
    """The note said `config.json/%blob`, which `--only` refused; `show` lists `config.json/%25blob` (docs auditor)."""
    folder = tmp_path / "run"
    folder.mkdir()
    torch.save({"w": torch.randn(10)}, folder / "model.pt")
    (folder / "config.json").write_text('{"a": 1}')
    assert ckpt_here(tmp_path, "init").returncode == 0 and ckpt_here(tmp_path, "commit", "run").returncode == 0
    note = ckpt_here(tmp_path, "export", "HEAD", "--all", "-o", "all.safetensors").stdout
    assert "left out 1 item (config.json/%25blob)" in note, note
    assert ckpt_here(tmp_path, "checkout", "HEAD", "--only", "config.json/%25blob", "-o", "part").returncode == 0


def test_a_folders_bin_weight_safetensors_has_no_type_for_is_left_out_and_named(tmp_path):
    """A complex128 weight in pytorch_model.bin (safetensors has no C128) failed the whole export (mutation audit)."""
    folder = tmp_path / "checkpoint-1"
    folder.mkdir()
    torch.save({"w": torch.arange(2.0), "rot": torch.ones(2, dtype=torch.complex128)}, folder / "pytorch_model.bin")
    (folder / "config.json").write_text("{}")
    with Repository.init(tmp_path / "repo") as repo:
        repo.commit(folder)
        report = export(repo, "main", "safetensors", tmp_path / "w.safetensors")
    assert report.tensors == 1 and report.skipped == ["rot", "config.json"]
    back = load_file(tmp_path / "w.safetensors")
    assert list(back) == ["w"] and torch.equal(back["w"], torch.arange(2.0))


class _Opaque:
    """A class no safe loader takes: a weights file holding it is committed as file bytes."""


def test_a_weights_file_committed_as_bytes_is_refused_not_exported_without_its_weights(tmp_path):
    """pytorch_model.bin that needed full unpickling was kept as bytes, and export wrote a "model" of the optimizer's
    tensors alone with exit 0 (auditor)."""
    folder = tmp_path / "checkpoint-3"
    folder.mkdir()
    torch.save({"embed.weight": torch.randn(8, 3), "extra": _Opaque()}, folder / "pytorch_model.bin")
    _training_files(folder)
    with Repository.init(tmp_path / "repo") as repo:
        repo.commit(folder, step=3)
        for fmt in ("safetensors", "torch"):
            with pytest.raises(CkptError, match="pytorch_model.bin holds the model's weights but was committed as "
                                                "file bytes"):
                export(repo, "main", fmt, tmp_path / f"w.{fmt}")
            assert not (tmp_path / f"w.{fmt}").exists()
        assert export(repo, "main", "safetensors", tmp_path / "all.safetensors", everything=True).tensors == 1
    result = ckpt_here(tmp_path, "--repo", "repo", "export", "main", "-o", "w.safetensors")
    assert result.returncode == 1 and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_numbers_and_text_left_out_of_a_safetensors_export_are_named(tmp_path):
    """A step, an epoch and an architecture's name were dropped with "1 tensors" and no note (auditor)."""
    model = torch.nn.Linear(3, 2)
    torch.save({"model": model.state_dict(), "step": 1000, "epoch": 3.5, "arch": "resnet", "seen": (1, "a"),
                "dtype": torch.float16, "device": torch.device("cpu"), "z": 1 + 2j}, tmp_path / "ck.pt")
    with Repository.init(tmp_path / "repo") as repo:
        repo.commit(tmp_path / "ck.pt")
        report = export(repo, "main", "safetensors", tmp_path / "w.safetensors")
    assert report.tensors == 2 and sorted(report.skipped) == ["arch", "device", "dtype", "epoch", "seen/0", "seen/1",
                                                              "step", "z"]
    assert "numbers, text" in report.why_skipped  # a module's _metadata (versions) is not named


def test_an_export_over_a_file_keeps_its_mode_and_removes_a_killed_exports_leftover(tmp_path):
    """An owner-only file became world-readable (the umask's mode), and a killed export's temporary file, as large
    as the checkpoint, stayed for ever: checkouts swept theirs, exports did not (auditor helper 301)."""
    with Repository.init(tmp_path / "repo") as repo:
        save_file({"w": torch.arange(12.0)}, tmp_path / "m.safetensors")
        repo.commit(tmp_path / "m.safetensors")
        out = tmp_path / "out.safetensors"
        out.write_bytes(b"old")
        out.chmod(0o600)
        stale = tmp_path / ".out.safetensors.0123456789abcdef.ckpt-tmp"
        fresh = tmp_path / ".out.safetensors.fedcba9876543210.ckpt-tmp"  # another export may be writing it now
        for leftover in (stale, fresh):
            leftover.write_bytes(bytes(100))
        os.utime(stale, (0, 0))
        export(repo, "HEAD", "safetensors", out)
    assert (out.stat().st_mode & 0o777) == 0o600
    assert load_file(out)["w"].equal(torch.arange(12.0))
    assert not stale.exists() and fresh.exists()


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_a_forged_safetensors_header_with_names_swapped_is_refused_not_exported_under_the_wrong_names(tmp_path, fmt):
    """A received manifest whose model.safetensors skeleton swaps two tensors' names (the header says otherwise) was
    exported with each name's values under the other's: export ran none of checkout's header check (fixer helper
    325 left it open). It is the one-line damaged-manifest error naming the commit, and nothing is written."""
    from ckptstore.repo import manifest as manifests

    folder = tmp_path / "checkpoint-1"
    folder.mkdir()
    save_file({"a": torch.arange(4, dtype=torch.float32), "b": torch.ones(4)}, folder / "model.safetensors")
    written = manifests.Manifest.to_record

    def forged(self):
        record = written(self)
        (weights,) = [f for f in record["files"] if f["name"] == "model.safetensors"]
        weights["digest"] = None  # a forger drops what would tell the written bytes wrong
        order = weights["skeleton"][2]
        order[0][0], order[1][0] = order[1][0], order[0][0]
        return record

    out = tmp_path / "w.out"
    with Repository.init(tmp_path / "repo") as repo:
        with pytest.MonkeyPatch.context() as forging:
            forging.setattr(manifests.Manifest, "to_record", forged)
            liar = repo.commit(folder)
        with pytest.raises(manifests.UnreadableManifestError, match=f"stored structure .* commits {liar[:12]}") as info:
            export(repo, liar, fmt, out)
        assert "\n" not in str(info.value)
    assert not out.exists() and list(tmp_path.glob(".w.out.*")) == []
    said = ckpt_here(tmp_path / "repo", "export", liar, "-o", str(out), "--format", fmt)
    assert said.returncode == 1 and liar[:12] in said.stdout + said.stderr, said
    assert "Traceback" not in said.stdout + said.stderr and not out.exists()


def test_a_torch_export_of_tied_weights_counts_each_key_it_writes_as_the_safetensors_export_does(tmp_path):
    """`emb.weight` is `head.weight`: the torch export said 2 tensors for a file holding 3, the safetensors one 3
    (auditor helper 369)."""
    shared = torch.randn(50, 8)
    torch.save({"emb.weight": shared, "head.weight": shared, "b": torch.zeros(8)}, tmp_path / "tied.pt")
    with Repository.init(tmp_path / "repo") as repo:
        repo.commit(tmp_path / "tied.pt")
        as_torch = export(repo, "main", "torch", tmp_path / "x.pt")
        as_safetensors = export(repo, "main", "safetensors", tmp_path / "x.safetensors")
    written = torch.load(tmp_path / "x.pt", weights_only=True)
    assert as_torch.tensors == as_safetensors.tensors == len(written) == len(load_file(tmp_path / "x.safetensors"))


def _safetensors_with_a_dtype_torch_lacks(path):
    """A safetensors file holding an F6_E2M3 tensor (no torch dtype: ckptstore keeps its bytes) beside an F32 one."""
    import struct

    header = {"__metadata__": {"format": "pt"}, "a.weight": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "q.weight": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [8, 11]}}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + struct.pack("<2f", 1.0, 1.0) + b"\x01\x02\x03")
    return header


def _entries(path):
    import struct

    data = path.read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + size])
    return {name: (entry["dtype"], entry["shape"], data[8 + size + entry["data_offsets"][0]:
                                                      8 + size + entry["data_offsets"][1]])
            for name, entry in header.items() if name != "__metadata__"}


def test_a_tensor_of_a_dtype_torch_lacks_is_exported_and_checked_out_in_part_under_its_own(tmp_path):
    """An F6_E2M3 weight was left out of a Hugging Face export as 'weights only; --all exports every tensor' (wrong
    and no help), `--only` refused it with advice for export, and a torch export named no reason (auditor 420)."""
    (tmp_path / "hf").mkdir()
    _safetensors_with_a_dtype_torch_lacks(tmp_path / "hf" / "model.safetensors")
    (tmp_path / "hf" / "config.json").write_text("{}")
    _safetensors_with_a_dtype_torch_lacks(tmp_path / "lone.safetensors")
    original = _entries(tmp_path / "hf" / "model.safetensors")
    assert original["q.weight"] == ("F6_E2M3", [4], b"\x01\x02\x03")
    with Repository.init(tmp_path) as repo:
        folder, lone = repo.commit(tmp_path / "hf"), repo.commit(tmp_path / "lone.safetensors")
        for ref, out in ((folder, "w.safetensors"), (lone, "lone-out.safetensors")):
            report = export(repo, ref, "safetensors", tmp_path / out)
            assert _entries(tmp_path / out) == original and "q.weight" not in report.skipped, report
        repo.checkout_to(folder, tmp_path / "part", keys=["model.safetensors/q.weight"])
        assert _entries(tmp_path / "part" / "model.safetensors") == {"q.weight": original["q.weight"]}
        report = export(repo, folder, "torch", tmp_path / "w.pt")
        assert report.skipped == ["q.weight", "config.json"] and "safetensors dtype torch has none for" in \
            report.why_skipped and "--all exports every tensor" in report.why_skipped


def test_a_torch_export_of_a_lone_safetensors_file_leaves_out_a_dtype_torch_lacks_and_says_why(tmp_path):
    """The F6_E2M3 weight was written into the torch file as a bytes value, with no word (stop 69's left defect)."""
    _safetensors_with_a_dtype_torch_lacks(tmp_path / "lone.safetensors")
    with Repository.init(tmp_path) as repo:
        report = export(repo, repo.commit(tmp_path / "lone.safetensors"), "torch", tmp_path / "lone.pt")
    assert report.skipped == ["q.weight"] and "safetensors dtype torch has none for" in report.why_skipped
    written = torch.load(tmp_path / "lone.pt", weights_only=True)
    assert list(written) == ["a.weight"] and torch.equal(written["a.weight"], torch.ones(2)) and report.tensors == 1


def test_a_torch_export_of_a_folder_leaves_out_its_files_tensors_of_a_dtype_torch_lacks(tmp_path):
    """A folder of safetensors files (no Hugging Face weights, or one exported --all) wrote its F6_E2M3 tensors as
    bytes values with no word, as a lone file did (reviewer 435)."""
    (tmp_path / "plain").mkdir()
    for name in ("a", "b"):
        _safetensors_with_a_dtype_torch_lacks(tmp_path / "plain" / f"{name}.safetensors")
    with Repository.init(tmp_path) as repo:
        report = export(repo, repo.commit(tmp_path / "plain"), "torch", tmp_path / "plain.pt")
    assert report.skipped == ["a.safetensors/q.weight", "b.safetensors/q.weight"], report
    assert "safetensors dtype torch has none for" in report.why_skipped
    written = torch.load(tmp_path / "plain.pt", weights_only=True)
    assert {name: list(tensors) for name, tensors in written.items()} == {"a.safetensors": ["a.weight"],
                                                                         "b.safetensors": ["a.weight"]}


def test_an_export_of_a_lossy_commit_says_it_is_lossy_as_checkout_does(tmp_path):
    """The exported weights carried the level's errors with no word of them (auditor 420)."""
    generator = torch.Generator().manual_seed(0)
    torch.save({"model": {"w": torch.randn(256, 256, generator=generator)}}, tmp_path / "c.pt")
    assert ckpt_here(tmp_path, "init").returncode == 0
    for args in (("commit", "c.pt", "--lossy", "extreme"), ("commit", "c.pt", "-m", "exact", "--allow-empty")):
        assert ckpt_here(tmp_path, *args).returncode == 0
    lossy = ckpt_here(tmp_path, "export", "HEAD~1", "-o", "lossy.safetensors")
    exact = ckpt_here(tmp_path, "export", "HEAD", "-o", "exact.safetensors")
    assert lossy.returncode == 0 and "is a lossy commit (level extreme)" in lossy.stdout, lossy.stdout
    assert exact.returncode == 0 and "lossy" not in exact.stdout, exact.stdout


def test_a_refused_checkout_to_an_output_path_advises_another_path_not_the_option_given(tmp_path):
    """'write elsewhere with -o PATH' was the advice where -o had been given (auditor 420)."""
    assert ckpt_here(tmp_path, "init").returncode == 0
    for value in (1.0, 2.0):
        torch.save({"w": torch.full((4,), value), "v": torch.zeros(2)}, tmp_path / "c.pt")
        assert ckpt_here(tmp_path, "commit", "c.pt").returncode == 0
    assert ckpt_here(tmp_path, "checkout", "HEAD", "--only", "w", "-o", "part.pt").returncode == 0
    refused = ckpt_here(tmp_path, "checkout", "HEAD~1", "--only", "w", "-o", "part.pt")
    assert refused.returncode == 1 and "commit it first, give -o another path, or pass --force" in refused.stderr
    assert "with -o PATH" not in refused.stderr
    torch.save({"w": torch.full((4,), 3.0)}, tmp_path / "c.pt")  # not committed: an in-place checkout is refused
    in_place = ckpt_here(tmp_path, "checkout", "HEAD~1")
    assert in_place.returncode == 1 and "write elsewhere with -o PATH" in in_place.stderr, in_place.stderr
