"""Our top-level `kernels` and `srt` packages share names with unrelated PyPI projects.

transformers probes for a top-level `kernels` package (Hugging Face's kernel hub) and trusts its
version; these tests keep ours from being mistaken for it or from breaking `import transformers`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version
from transformers.utils import import_utils

REPO_ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
OUR_PACKAGES = ("srt", "mem_cache", "managers", "kernels")


def _run_python(code: str) -> dict:
    """Run `code` in a fresh interpreter with the repo first on the path; it prints one JSON line."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_kernels_pulls_in_no_gpu_or_torch_modules_and_has_no_version() -> None:
    result = _run_python(
        """
        import json, sys
        import kernels
        heavy = [m for m in sys.modules if m.split(".")[0] in ("torch", "flashinfer", "triton", "transformers")]
        print(json.dumps({"file": kernels.__file__, "has_version": hasattr(kernels, "__version__"), "heavy": heavy}))
        """
    )
    assert Path(result["file"]).resolve().is_relative_to(REPO_ROOT)
    assert result["has_version"] is False
    assert result["heavy"] == []


def test_transformers_imports_and_runs_a_model_with_our_packages_first_on_the_path(llama_model: Path) -> None:
    result = _run_python(
        f"""
        import importlib.util, json
        origins = {{name: importlib.util.find_spec(name).origin for name in {OUR_PACKAGES!r}}}
        import torch, transformers
        from transformers.utils.import_utils import is_kernels_available
        model = transformers.AutoModelForCausalLM.from_pretrained({str(llama_model)!r})
        with torch.no_grad():
            logits = model(torch.tensor([[1, 2, 3]])).logits
        print(json.dumps({{"origins": origins, "hub_kernels": is_kernels_available(),
                           "shape": list(logits.shape), "finite": bool(torch.isfinite(logits).all())}}))
        """
    )
    for name, origin in result["origins"].items():
        assert Path(origin).resolve().is_relative_to(REPO_ROOT), f"{name} resolves to {origin}"
    assert result["hub_kernels"] is False
    assert result["shape"][:2] == [1, 3]
    assert result["finite"] is True


def test_project_version_is_outside_the_hub_kernels_range_transformers_accepts() -> None:
    version = Version(PYPROJECT["project"]["version"])
    assert not Version("0.18.2") <= version < Version("0.19")
    low, high = Version(import_utils.KERNELS_MIN_VERSION), Version(import_utils.KERNELS_MAX_VERSION)
    assert not low <= version < high, f"transformers now accepts kernels in [{low}, {high})"


def test_dependencies_never_name_the_pypi_srt_or_kernels_projects() -> None:
    project = PYPROJECT["project"]
    specs = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        specs.extend(extra)
    names = {canonicalize_name(Requirement(spec).name) for spec in specs}
    assert names, "pyproject lists no dependencies at all"
    assert not names & {"srt", "kernels"}


def test_setuptools_lists_our_packages_explicitly() -> None:
    include = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    for name in OUR_PACKAGES:
        assert f"{name}*" in include or name in include, f"{name} missing from packages.find.include"


def test_transformers_is_pinned_below_the_release_that_requires_hub_kernels() -> None:
    # transformers 5.25 lists Hugging Face's `kernels` as a hard requirement and imports it when
    # installed; ours shadows it (CI broke on exactly that when 5.25 came out).
    (spec,) = [Requirement(s) for s in PYPROJECT["project"]["dependencies"] if Requirement(s).name == "transformers"]
    assert spec.specifier.contains("5.24.0")
    assert not spec.specifier.contains("5.25.0")
    installed = Version(import_utils.importlib.metadata.version("transformers"))
    assert spec.specifier.contains(installed), f"set-up installed transformers {installed}, outside {spec}"


def test_a_shadowed_hub_kernels_install_fails_with_an_error_that_names_the_cause(tmp_path: Path) -> None:
    # A fake Hugging Face `kernels` distribution (metadata only) next to our package of the same
    # import name: what transformers >= 5.25 does then (`from kernels import CUDAProperties`) must
    # say what is shadowing what and how to fix it, not just "cannot import name".
    dist_info = tmp_path / "kernels-0.19.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 0.19.1\n")
    result = _run_python(
        f"""
        import json, sys
        sys.path.append({str(tmp_path)!r})
        import kernels
        try:
            from kernels import CUDAProperties
            error = None
        except ImportError as exc:
            error = str(exc)
        print(json.dumps({{"error": error, "has_version": hasattr(kernels, "__version__")}}))
        """
    )
    assert result["error"] is not None
    for part in ("'CUDAProperties'", "Hugging Face's `kernels` 0.19.1", "shadows it", "transformers>=5.17,<5.25"):
        assert part in result["error"], result["error"]
    assert result["has_version"] is False


def test_without_hub_kernels_a_missing_name_is_a_plain_attribute_error() -> None:
    result = _run_python(
        """
        import json, kernels
        try:
            kernels.CUDAProperties
            kind = None
        except Exception as exc:
            kind = type(exc).__name__
        print(json.dumps({"kind": kind}))
        """
    )
    assert result["kind"] == "AttributeError"
