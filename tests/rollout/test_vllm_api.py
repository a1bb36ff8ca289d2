"""The vLLM surface the engine code calls (mmrlhf.rollout.vllm_api.SURFACE) is all there in the installed vLLM, the
check would say what a release moved, and the list covers every vLLM import of the package: a vLLM that moves an
API fails here, by name, rather than in a run."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from mmrlhf.rollout import vllm_api
from mmrlhf.rollout.vllm_api import Api

PACKAGE = Path(__file__).resolve().parents[2] / "mmrlhf"


@pytest.mark.vllm
def test_the_installed_vllm_has_every_entry_of_the_surface():
    pytest.importorskip("vllm")
    assert vllm_api.missing() == []


@pytest.mark.vllm
def test_the_check_names_what_a_release_lacks():
    """The control: entries that no vLLM has, one of each kind, each reported with what is missing."""
    pytest.importorskip("vllm")
    fake = (
        Api("vllm.entrypoints.llm", "LLM", ("generate(prompts, no_such_keyword)", "no_such_method()",
                                            ".no_such_attribute", "~no such text anywhere")),
        Api("vllm.sampling_params", "SamplingParams", fields=("n", "no_such_field")),
        Api("vllm.config.model", "LogprobsMode", ("=processed_logprobs|no_such_mode",)),
        Api("vllm.envs", "environment_variables", ("[VLLM_NO_SUCH_VARIABLE]",)),
        Api("vllm.no_such_module"),
    )
    gaps = vllm_api.missing(fake)
    expected = ["generate() takes no ['no_such_keyword']", "no 'no_such_method'",
                "no instance attribute 'no_such_attribute'", "its source never mentions 'no such text anywhere'",
                "no field(s) ['no_such_field']", "does not allow ['no_such_mode']", "no key 'VLLM_NO_SUCH_VARIABLE'",
                "vllm.no_such_module: ModuleNotFoundError"]
    assert len(gaps) == len(expected), gaps
    for gap, want in zip(gaps, expected):
        assert want in gap, (gap, want)


def _vllm_imports() -> set[tuple[str, str]]:
    """``(module, name)`` of every ``import vllm...`` / ``from vllm... import name`` in the package."""
    found: set[tuple[str, str]] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {(a.name, "") for a in node.names if a.name.split(".")[0] == "vllm"}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
                found |= {(node.module, a.name) for a in node.names}
    return found


def test_every_vllm_import_of_the_package_is_in_the_surface():
    imports = _vllm_imports()
    assert ("vllm", "SamplingParams") in imports and len(imports) > 10  # the scan sees the package's imports

    def covered(module: str, name: str) -> bool:
        for api in vllm_api.SURFACE:
            members = {m.split("(")[0] for m in api.members}
            if api.module == module and (not name or api.name == name or name in members):
                return True
            if name and api.module == f"{module}.{name}":  # ``from package import module``
                return True
        return False

    assert sorted(i for i in imports if not covered(*i)) == []
