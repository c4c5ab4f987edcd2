"""The caches the CPU templates block for, read from the OS, and the defaults derived from them (issue 45): a faked
CPU description (sysfs trees with a 32 or 48 KiB L1d and a 1 or 2 MiB L2, AVX2 or AVX-512 code) must move
the defaults the way the rules say, and only those, on whatever machine the suite runs."""
from __future__ import annotations

import pytest
import tvm

from kerneltune.targets import caches, host
from kerneltune.task import make_task
from kerneltune.templates import cpu, cpu_nchwc
from kerneltune.templates.conv_nchwc import ConvSpec, make_task as conv_task

KIB, MIB = 2**10, 2**20


def write_sysfs(root, l1d: str, l2: str, l3: str = "32M", l3_cpus: str = "0-7"):
    """A sysfs cache tree of one core as Linux writes it (``index*/{level,type,size,shared_cpu_list}``)."""
    for i, (level, kind, size, cpus) in enumerate([("1", "Data", l1d, "0"), ("1", "Instruction", "32K", "0"),
                                                   ("2", "Unified", l2, "0"), ("3", "Unified", l3, l3_cpus)]):
        d = root / f"index{i}"
        d.mkdir(parents=True)
        for name, text in (("level", level), ("type", kind), ("size", size), ("shared_cpu_list", cpus)):
            (d / name).write_text(text + "\n")
    return root


@pytest.fixture
def fake_cpu(tmp_path, monkeypatch):
    """``use(l1d, l2)``: from now on this machine's caches are the faked ones, and every llvm target counts as
    running here (so an AVX-512 target gets them on an AVX2 machine too)."""
    monkeypatch.setattr(host, "runs_here", lambda target: True)

    def use(l1d: str, l2: str) -> None:
        monkeypatch.setattr(caches, "CACHE_DIR", write_sysfs(tmp_path / f"{l1d}-{l2}", l1d, l2))
        caches._host.cache_clear()

    yield use
    caches._host.cache_clear()


def _target(mcpu: str) -> tvm.target.Target:
    return tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2})


AVX512, AVX2 = _target("skylake-avx512"), _target("x86-64-v3")


def test_sysfs_sizes_and_sharing_are_read_per_core(tmp_path):
    root = write_sysfs(tmp_path, "48K", "2048K", "260M", "0-3,8-11")
    assert caches.host_caches(root) == {"L1d": 48 * KIB, "L1i": 32 * KIB, "L2": 2 * MIB, "L3": 260 * MIB}
    # the L3 is shared by 8 CPUs: a core counts on an eighth of it
    assert caches.read_caches(root) == caches.Caches(l1d=48 * KIB, l2=2 * MIB, l3=260 * MIB // 8)
    assert caches.host_caches(tmp_path / "nowhere") == {} and caches.read_caches(tmp_path / "nowhere") is None


def test_a_build_for_another_machine_gets_the_portable_caches():
    cross = tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "cortex-a72"})
    assert caches.target_caches(cross) == caches.PORTABLE


@pytest.mark.parametrize("target", [AVX512, AVX2], ids=["avx512", "avx2"])
def test_the_matmul_k_block_follows_the_l1(fake_cpu, target):
    """The k-block (R1 of ``k``) fills a third of L1d with the widest panel: 64 deep on 48 KiB, 32 (the
    divisor of 768 under 42) on 32 KiB; the register tile follows the ISA's registers, not the caches."""
    task = make_task("matmul", "128,768,768")
    tiles = {}
    for l1d, depth in (("48K", 64), ("32K", 32)):
        fake_cpu(l1d, "2048K")
        assert caches.k_block_depth(target) == caches.l1_block_bytes(target) // 256
        cfg = dict(zip(cpu.space(task).names, cpu.default_config(task, target, row_repeat=1)))
        assert cfg["tile_k"] == (768 // depth, depth)
        tiles[l1d] = cfg["tile_i"][3] * cfg["tile_j"][3]  # accumulator lanes of the register tile
    lanes = 16 if target is AVX512 else 8
    registers = 32 if target is AVX512 else 16
    assert tiles["48K"] == tiles["32K"] <= (registers - cpu.OPERAND_REGISTERS) * lanes


def test_the_conv_channel_chunk_follows_the_l1(fake_cpu):
    """ResNet-50's 1024 -> 256 1x1 at 14x14 reads its weights in L1-sized chunks of input channels (ic_order
    outer): 8 blocks of 16 channels on a 48 KiB L1d (16 KiB of weights), 4 on 32 KiB."""
    task = conv_task(ConvSpec(1, 1024, 14, 14, 256, 1, 1, ic_block=16, oc_block=16))
    chunks = {}
    for l1d in ("48K", "32K"):
        fake_cpu(l1d, "2048K")
        cfg = cpu_nchwc._default_dict(task, AVX512)
        assert cfg["ic_order"] == "outer"
        chunks[l1d] = cfg["tile_ic"][1]
    assert chunks == {"48K": 8, "32K": 4}


@pytest.mark.parametrize("target", [AVX512, AVX2], ids=["avx512", "avx2"])
def test_the_cores_split_rows_whatever_the_l2(fake_cpu, target):
    """ResNet-50's 64 -> 256 1x1 at 56x56 writes 1.6 MB a core: over a 1 MiB L2, under 2 MiB.  The cores split
    its rows on both: channels split where a core's share overflowed a 2 MiB L2 ran ResNet-50 and
    MobileNet-v2 slower on an Intel Xeon (cpu_nchwc._default_dict), so no default follows the L2 yet."""
    task = conv_task(ConvSpec(1, 64, 56, 56, 256, 1, 1, ic_block=16, oc_block=16))
    for l2 in ("2048K", "1024K"):
        fake_cpu("48K", l2)
        assert caches.target_caches(target).l2 == int(l2[:-1]) * KIB
        assert cpu_nchwc._default_dict(task, target)["s0_order"] == "y_outer"


def test_the_int8_k_block_follows_the_l1(fake_cpu):
    """The VNNI template's k-block keeps the B panel in a quarter of the L1 block: 16 groups of 4 (64 deep) for
    4 vectors of columns on a 48 KiB L1d, 8 on 32 KiB."""
    from kerneltune.templates import int8, space_for
    from tests.test_int8 import _fused_int8_task, _matmul

    task = _fused_int8_task(_matmul(m=64, k=768, n=64))
    vnni = _target("sapphirerapids")
    blocks = {}
    for l1d in ("48K", "32K"):
        fake_cpu(l1d, "2048K")
        cfg = dict(zip(space_for(task, vnni).names, int8.default_config(task, vnni)))
        assert cfg["tile_j"][2] == 4  # the register tile's 4 vectors of 16 columns
        blocks[l1d] = cfg["tile_k"][1]
    assert blocks == {"48K": 16, "32K": 8}
