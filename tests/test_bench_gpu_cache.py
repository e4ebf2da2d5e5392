"""bench/gpu_cache.py through its CLI: the caches packed into parts and restored byte for byte,
Inductor's entries left out first when the archive is over the cap, and a restore with no parts
is a cold start, not an error."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "gpu_cache.py")


def run(root, *argv):
    env = {**os.environ, "LATENTSERVE_GPU_CACHE_ROOT": str(root)}
    return subprocess.run([sys.executable, SCRIPT, *argv], env=env, capture_output=True, text=True, timeout=120)


def write(path, data: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def test_save_then_restore_round_trips_and_drops_inductor_first(tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "out"
    kernel = os.urandom(3 << 20)  # incompressible: the cap below holds it and not the next entry
    write(cache / "triton" / "abc" / "k.cubin", kernel)
    write(cache / "triton" / "abc" / "k.json", b'{"name": "k"}')
    write(cache / "inductor" / "fxgraph" / "big", os.urandom(4 << 20))
    write(cache / "inductor" / "zz" / "small.py", b"print(1)\n")
    assert "TRITON_CACHE_DIR=" + str(cache / "triton") in run(cache, "dirs").stdout
    r = run(cache, "save", str(out), "--max-mib", "5")
    assert r.returncode == 0, r.stderr
    assert "saved 2 of 3 entries" in r.stderr
    restored = tmp_path / "restored"
    r = run(restored, "restore", str(out))
    assert r.returncode == 0, r.stderr
    assert (restored / "triton" / "abc" / "k.cubin").read_bytes() == kernel
    assert (restored / "inductor" / "zz" / "small.py").read_bytes() == b"print(1)\n"
    assert not (restored / "inductor" / "fxgraph").exists()


def test_restore_without_parts_is_a_cold_start(tmp_path):
    r = run(tmp_path / "cache", "restore", str(tmp_path / "nothing"))
    assert r.returncode == 0 and "compiling cold" in r.stderr
