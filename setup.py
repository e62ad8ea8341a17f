"""The package layout, which pyproject.toml cannot spell: one import package, `kvrelay`, whose
root is the repository's services/ folder and whose `kvrelay.kernels` is its kernels/ folder.

The folders keep the design card's names; what lands in site-packages is `kvrelay` alone, so
nothing of ours is named `services` or `kernels` beside a user's other packages (Hugging Face's
`kernels`, which transformers needs, among them). Metadata and dependencies: pyproject.toml."""
from setuptools import find_packages, setup

SERVICE_PACKAGES = ["kvrelay"] + [f"kvrelay.{name}" for name in find_packages("services")]

setup(
    # kvrelay.kernels and its csrc/ (C++ sources compiled on first use) have no __init__.py
    packages=SERVICE_PACKAGES + ["kvrelay.kernels", "kvrelay.kernels.csrc"],
    package_dir={"kvrelay": "services", "kvrelay.kernels": "kernels"},
    package_data={"kvrelay.kernels.csrc": ["*.cpp", "*.h"]},
)
