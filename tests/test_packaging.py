"""What `pip install .` puts in site-packages: the one `kvrelay` package, nothing named
`services` or `kernels` (Hugging Face's `kernels`, which transformers imports, must stay
importable beside ours)."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_wheel_holds_kvrelay_alone(tmp_path):
    # The wheel is what `pip install .` unpacks into site-packages; reading its file list is
    # the same check as listing a fresh venv's site-packages, without installing.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(REPO)], check=True, timeout=600)
    (wheel,) = tmp_path.glob("kvrelay-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    assert {name for name in top_level if not name.endswith(".dist-info")} == {"kvrelay"}
    assert "kvrelay/__init__.py" in names and "kvrelay/engine/__init__.py" in names
    assert "kvrelay/kernels/native_cpu.py" in names
    assert any(name.startswith("kvrelay/kernels/csrc/") and name.endswith(".cpp")
               for name in names)
    assert "kvrelay/kernels/__init__.py" not in names  # a namespace package, as in the tree


def test_hugging_face_kernels_and_kvrelay_kernels_import_in_one_process():
    # Run from the repository root, where a kernels/ folder sits on sys.path: it must not
    # shadow Hugging Face's package, and kvrelay.kernels must still be ours.
    check = ("import kernels, kvrelay.kernels, kvrelay.kernels.native_cpu, transformers; "
             "assert 'site-packages' in kernels.__file__, kernels.__file__; "
             "assert callable(kernels.get_kernel); "
             "print(kvrelay.kernels.native_cpu.__name__)")
    result = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "kvrelay.kernels.native_cpu"
