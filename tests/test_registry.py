"""Registry: the single dispatch path (duplicates, unknown names, user plug-ins by import path)."""

from __future__ import annotations

import pytest

from mmrlhf.registry import Registry, RegistryError, import_object


def test_register_get_alias_and_duplicates():
    reg: Registry = Registry("estimator")

    @reg.register("grpo", aliases=("group_norm",))
    def grpo():
        return "g"

    assert reg.get("grpo") is grpo and reg.get("group_norm") is grpo
    assert reg.names() == ["group_norm", "grpo"]
    with pytest.raises(RegistryError, match="already registered"):
        reg.add("grpo", lambda: None)
    with pytest.raises(RegistryError, match="already registered"):
        reg.add("other", lambda: None, aliases=("group_norm",))


def test_unknown_name_lists_valid_ones():
    reg: Registry = Registry("loss")
    reg.add("ppo", object())
    reg.add("gspo", object())
    with pytest.raises(RegistryError) as info:
        reg.get("ppoo")
    msg = str(info.value)
    assert "unknown loss 'ppoo'" in msg and "gspo, ppo" in msg and "did you mean 'ppo'" in msg


def test_import_by_module_and_by_file(tmp_path):
    assert import_object("os.path:join") is __import__("os").path.join
    plugin = tmp_path / "my_reward.py"
    plugin.write_text("def score(x):\n    return x * 2\n")
    fn = Registry("reward").get(f"{plugin}:score")
    assert fn(21) == 42


@pytest.mark.parametrize(
    "spec, match",
    [
        ("no_colon", "not of the form"),
        ("os.path:", "must be given"),
        ("definitely_missing_mod:f", "cannot import module"),
        ("os.path:nope", "has no attribute"),
        ("/nonexistent/file.py:f", "file not found"),
    ],
)
def test_import_errors_name_the_spec(spec, match):
    with pytest.raises(RegistryError, match=match):
        import_object(spec)
