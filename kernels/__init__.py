"""Device-specific compute behind one import boundary.

Import-light on purpose: transformers imports any top-level `kernels` package it finds
(to read its version), so nothing here may raise or pull in optional GPU libraries.

Hugging Face's `kernels` distribution has the same import name. Where it is installed,
transformers imports names from it (`from kernels import CUDAProperties, ...`) and gets this
package instead; `__getattr__` turns that into an error that says so and how to fix it.
"""
import importlib.metadata


def _shadowed_hf_kernels_version():
    """The version of Hugging Face's `kernels` distribution, if one is installed, else None."""
    try:
        dist = importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return None
    return dist.version


def __getattr__(name):
    hf_version = None if name.startswith("__") else _shadowed_hf_kernels_version()
    if hf_version is None:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    raise ImportError(
        f"cannot import name {name!r} from 'kernels': Hugging Face's `kernels` {hf_version} is "
        f"installed, and this project's top-level `kernels` package ({__file__}) has the same "
        "import name and shadows it. transformers >= 5.25 requires Hugging Face's package and "
        "imports it; this project supports transformers < 5.25. Fix: "
        "pip install 'transformers>=5.17,<5.25' && pip uninstall -y kernels",
        name=name,
    )
