"""The GPU staging tool of bench/gpu (issue 27): which wheels travel, how they are repacked, split into
call-sized parts, stashed and joined with sha256 checks, and the H200 config it serves. All on CPU, in
milliseconds: tiny files stand in for the 208 MiB payload."""

from __future__ import annotations

import tarfile
import zipfile
from pathlib import Path

import pytest

from bench.gpu.device import unpack_wheels
from bench.gpu.packages import (
    VLLM_SERVER_PACKAGES,
    carried_conflicts,
    device_packages,
    pinned_specs,
    requirement_closure,
    version_conflicts,
)
from bench.gpu.parts import Manifest, join_parts, missing_parts, part_ranges, sha256_file, split_file, stash_parts
from bench.gpu.trim import is_trimmed, record_without, repack_wheel
from eagle3_core.config import load_config

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("kinds", ["nvidia-h200, nvidia-h200-x2", "nvidia-h100-x1, nvidia-h200, nvidia-h100-x2"])
def test_device_packages_reads_the_kinds_list(kinds: str) -> None:
    """The H200's line wherever KINDS.md lists nvidia-h200 among its kinds (2026-12-05 it came second)."""
    other = "nvidia-h200-x8: another image. Packages: numpy.\n"
    text = f"## x\n\n{other}{kinds}: their image holds these. Packages: absl-py, Typing_Extensions, zipp.\n"
    assert device_packages(text) == {"absl-py", "typing-extensions", "zipp"}
    with pytest.raises(ValueError, match="Packages"):
        device_packages("no list here")


def test_closure_stops_at_the_device_and_follows_extras_and_markers() -> None:
    requires = {
        "eagle3-pipeline": ["app"],
        "app": ["lib[fast]>=1", "torch", "winonly; sys_platform == 'win32'", "old; python_version < '3.12'"],
        "lib": ["numpy", "speedup; extra == 'fast'"],
        "speedup": [],
        "torch": ["never-walked"],
    }
    needed = requirement_closure(["eagle3-pipeline"], requires.get, frozenset({"numpy"}))
    assert needed == ["app", "lib", "speedup"]  # the project travels as the tree; torch's needs are never walked


def test_pins_win_over_local_versions() -> None:
    specs = pinned_specs(["Pydantic", "distro", "gone"], {"pydantic": "2.14.4", "distro": None}, {"distro": "1.9"}.get)
    assert specs == ["distro==1.9", "gone", "pydantic==2.14.4"]


def test_the_tvm_pin_that_failed_on_the_h200_is_refused() -> None:
    """vLLM's own pin apache-tvm-ffi 0.1.10 broke xgrammar 0.2.9 on the H200 (`load_lib_module() got an
    unexpected keyword argument 'extra_lib_paths'`): the staging now refuses such a set before sending it."""
    requires = {"xgrammar": ["apache-tvm-ffi>=0.1.11"], "vllm": ["apache-tvm-ffi==0.1.10", "torch==2.11.0"]}
    broken = {"xgrammar": "0.2.9", "apache-tvm-ffi": "0.1.10", "vllm": "0.26.0"}
    assert carried_conflicts(requires, broken) == ["xgrammar: apache-tvm-ffi>=0.1.11 (found 0.1.10)"]
    pinned = {**broken, "apache-tvm-ffi": VLLM_SERVER_PACKAGES["apache-tvm-ffi"]}
    assert carried_conflicts(requires, pinned) == []  # vLLM's own ==0.1.10 is the one allowed break


def test_version_conflicts_skip_absent_and_inapplicable_requirements() -> None:
    requires = {"a": ["b>=2", "c", "d<1; sys_platform == 'win32'", "e>=1 ; extra == 'test'"]}
    versions = {"b": "1.5", "d": "3", "e": "0.1"}
    assert version_conflicts(requires, versions.get) == ["a: b>=2 (found 1.5)"]
    assert version_conflicts({"v": ["torch==2.11.0"]}, {"torch": "2.11.0+cu130"}.get) == []


def make_wheel(path: Path, members: dict[str, bytes]) -> Path:
    record = "".join(f"{name},sha256=x,{len(data)}\n" for name, data in members.items())
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
        archive.writestr("vllm-0.26.0.dist-info/RECORD", record)
    return path


def test_repack_stores_and_trims_with_record_mended(tmp_path: Path) -> None:
    members = {
        "vllm/__init__.py": b"x" * 100,
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": b"fa2",
        "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": b"fa3",
        "vllm/third_party/deep_gemm/a.py": b"dg",
        "vllm/_moe_C_stable_libtorch.abi3.so": b"moe",
    }
    wheel = make_wheel(tmp_path / "vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl", members)
    for keep_moe, expected_moe in ((False, False), (True, True)):
        out = repack_wheel(wheel, tmp_path / f"out-{keep_moe}", keep_moe)
        with zipfile.ZipFile(out) as archive:
            names = set(archive.namelist())
            assert all(info.compress_type == zipfile.ZIP_STORED for info in archive.infolist())
            record = archive.read("vllm-0.26.0.dist-info/RECORD").decode()
        assert "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so" in names  # vLLM's worker imports FA3 at warm-up
        assert not {"vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/third_party/deep_gemm/a.py"} & names
        assert ("vllm/_moe_C_stable_libtorch.abi3.so" in names) is expected_moe
        assert ("fa2" in record, "moe" in record) == (False, expected_moe)
    assert is_trimmed("vllm/vllm-rs", keep_moe=True) and not is_trimmed("vllm/vllm_rs.py", keep_moe=False)
    # SGLang's kernels: its FlashAttention build and Blackwell ops go, the Hopper ops its triton backend uses stay.
    assert is_trimmed("sgl_kernel/flash_ops.abi3.so", False) and is_trimmed(
        "sgl_kernel/sm100/common_ops.abi3.so", False
    )
    assert not is_trimmed("sgl_kernel/sm90/common_ops.abi3.so", False)
    assert record_without("a,1\nb,2\n", {"a"}) == "b,2\n"


def test_split_stash_join_round_trip(tmp_path: Path) -> None:
    payload = tmp_path / "payload.bin"
    payload.write_bytes(bytes(range(256)) * 40)  # 10,240 bytes in parts of 4,096
    manifest = split_file(payload, tmp_path / "stage", {"w.whl": "0" * 64}, part_bytes=4096)
    assert [p.size for p in manifest.parts] == [4096, 4096, 2048]
    assert Manifest.from_json((tmp_path / "stage/call-02/manifest.json").read_text()) == manifest
    stash = tmp_path / "stash"
    for index in range(2):  # one call per part; the last one is missing: the machine went back
        assert stash_parts([tmp_path / f"stage/call-{index:02d}"], stash) == [f"part-{index:02d}"]
    assert missing_parts(manifest, stash) == ["part-02"]
    with pytest.raises(FileNotFoundError, match="part-02"):
        join_parts(manifest, stash, tmp_path / "joined")
    assert stash_parts([tmp_path / "stage/call-02"], stash) == ["part-02"]
    assert stash_parts([tmp_path / "stage/call-02"], stash) == []  # already stashed intact
    joined = join_parts(manifest, stash, tmp_path / "joined")
    assert joined.read_bytes() == payload.read_bytes()
    assert part_ranges(0) == [(0, 0)]


def test_a_damaged_part_is_refused(tmp_path: Path) -> None:
    payload = tmp_path / "payload.bin"
    payload.write_bytes(b"abc" * 1000)
    split_file(payload, tmp_path / "stage", {}, part_bytes=1024)
    part = tmp_path / "stage/call-01/part-01"
    part.write_bytes(b"X" + part.read_bytes()[1:])
    with pytest.raises(ValueError, match="damaged in transfer"):
        stash_parts([tmp_path / "stage/call-01"], tmp_path / "stash")


def test_unpack_checks_every_wheel_and_refuses_strangers(tmp_path: Path) -> None:
    wheel = tmp_path / "a-1-py3-none-any.whl"
    wheel.write_bytes(b"wheel")
    tar_path = tmp_path / "wheels.tar"
    with tarfile.open(tar_path, "w") as tar:
        tar.add(wheel, arcname=wheel.name)
    assert unpack_wheels(tar_path, tmp_path / "ok", {wheel.name: sha256_file(wheel)}) == [tmp_path / "ok" / wheel.name]
    with pytest.raises(ValueError, match="sha256 differs"):
        unpack_wheels(tar_path, tmp_path / "bad", {wheel.name: "0" * 64})
    with pytest.raises(ValueError, match="not in the manifest"):
        unpack_wheels(tar_path, tmp_path / "other", {"b-1-py3-none-any.whl": "0" * 64})


def test_h200_config_disables_the_flashinfer_sampler() -> None:
    """The staged wheels carry no flashinfer, and vLLM 0.26's GPU sampler imported it at engine start on the
    H200 (`ModuleNotFoundError: No module named 'flashinfer'`) unless VLLM_USE_FLASHINFER_SAMPLER=0."""
    config = load_config(ROOT / "bench/gpu/configs/h200-smollm2.yaml")
    assert config.server.env.get("VLLM_USE_FLASHINFER_SAMPLER") == "0"
    assert not config.server.enforce_eager and config.server.dtype == "float32"
