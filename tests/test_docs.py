"""The user documentation stays true to the code, cheaply (no model, no engine; well under a second).

Four checks over README.md and docs/*.md:

1. every config key written in code (``section.key`` in an inline code span, or a ``section.key=value`` override
   in a fenced block) exists in the schema (``mmrlhf/config``); keys under a dict-valued field (e.g.
   ``data.generator_options.task``) are accepted below that field;
2. every relative Markdown link points to an existing file (and, for a ``#anchor`` into a Markdown file, to one of
   its headings);
3. every ``mmrlhf <subcommand>`` written in code exists in the CLI, with the ``--flags`` written after it;
4. every ``examples/...`` path named anywhere (prose, code spans, fenced commands, links) exists in the repository:
   a recipe path in a command line is not a Markdown link, so check 2 never sees it.

Each checker is a plain function of a text, so the controls below can show it catches a wrong key, a dead link, an
unknown command and a made-up example path in synthetic text.
"""

from __future__ import annotations

import argparse
import re
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from mmrlhf.cli import build_parser
from mmrlhf.config.schema import MMRLHFConfig

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])

SECTIONS = tuple(MMRLHFConfig.model_fields)  # model, data, rollout, reward, algorithm, trainer, distributed, agent
# Dotted names in code spans that start like a config key but are not one. Keep it short and explain each.
NOT_CONFIG_KEYS = {
    "model.language_model.embed_tokens.weight",  # a transformers parameter name (environment.md, weight push)
    "model.load_weights",  # vLLM's model method (environment.md, weight push)
}
FILE_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".json", ".jsonl", ".html", ".png", ".txt", ".safetensors", ".pt")

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
_INLINE = re.compile(r"(`+)(.+?)\1", re.S)
_KEY = re.compile(r"(?<![\w./:-])(" + "|".join(SECTIONS) + r")((?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
_OVERRIDE = re.compile(r"(?<![\w./:-])((?:" + "|".join(SECTIONS) + r")(?:\.[A-Za-z_][A-Za-z0-9_]*)+)=")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_COMMAND = re.compile(r"(?<![\w./-])mmrlhf[ \t]+([^\n|;&#`]*)")
# A path under the repository's examples/ folder: at a word start or after ``../`` (a link from docs/), never inside
# another path (``tests/examples/...``); it ends on a word character, so a sentence's full stop or a ``:fn`` suffix
# is not part of it, and the bare folder (``examples/``) or a glob (``examples/*.yaml``) names no file.
_EXAMPLE_PATH = re.compile(r"(?:(?<=\.\./)|(?<![\w./-]))examples/[\w./-]*\w")


# ---- splitting Markdown into prose, inline code and fenced code ------------------------------------------------
def fenced_blocks(text: str) -> list[str]:
    return [m.group(0) for m in _FENCE.finditer(text)]


def inline_spans(text: str) -> list[str]:
    """Inline code spans outside fenced blocks."""
    return [m.group(2) for m in _INLINE.finditer(_FENCE.sub("", text))]


# ---- 1. config keys ----------------------------------------------------------------------------------------------
def _dict_valued(annotation: typing.Any) -> bool:
    return typing.get_origin(annotation) is dict or annotation is dict


def key_exists(dotted: str) -> bool:
    """Whether ``section.key[.sub...]`` names a config field (anything below a dict-valued field counts)."""
    node: type[BaseModel] = MMRLHFConfig
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        field = node.model_fields.get(part)
        if field is None:
            return False
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            node = ann
            continue
        if _dict_valued(ann):
            return True  # free-form below (generator_options, label_map, recipe, ...)
        return i == len(parts) - 1  # a leaf: nothing may follow it
    return len(parts) > 1  # a nested section (``model.lora``) is a key; a top-level section alone is not


def config_keys_in(text: str) -> set[str]:
    """Config-key-like names written in code: inline spans (any ``section.key``), fenced blocks (overrides)."""
    found = set()
    for span in inline_spans(text):
        for m in _KEY.finditer(span):
            name = m.group(1) + m.group(2)
            if not name.endswith(FILE_SUFFIXES):
                found.add(name)
    for block in fenced_blocks(text):
        found.update(m.group(1) for m in _OVERRIDE.finditer(block))
    return found


def unknown_config_keys(text: str) -> list[str]:
    return sorted(k for k in config_keys_in(text) if k not in NOT_CONFIG_KEYS and not key_exists(k))


# ---- 2. links ----------------------------------------------------------------------------------------------------
def heading_anchors(markdown: str) -> set[str]:
    """GitHub-style anchors of a Markdown file's headings (lower case, punctuation dropped, spaces -> '-')."""
    anchors = set()
    for line in _FENCE.sub("", markdown).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            anchors.add(slug)
    return anchors


def broken_links(text: str, base: Path) -> list[str]:
    """Relative links of ``text`` (a file in folder ``base``) whose target file or heading does not exist."""
    bad = []
    for target in _LINK.findall(_FENCE.sub("", text)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http:, https:, mailto: ...; in-page anchors are not checked
        path, _, anchor = target.partition("#")
        resolved = (base / path).resolve()
        if not resolved.exists():
            bad.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in heading_anchors(resolved.read_text()):
            bad.append(target)
    return bad


# ---- 3. commands -------------------------------------------------------------------------------------------------
def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {opt for action in parser._actions for opt in action.option_strings}


def unknown_commands(text: str) -> list[str]:
    """``mmrlhf ...`` command lines written in code whose subcommand (or ``config`` action, or ``--flag``) the CLI
    does not have."""
    root = build_parser()
    bad = []
    code = inline_spans(text) + fenced_blocks(text)
    for snippet in code:
        for m in _COMMAND.finditer(snippet):
            words = [w.strip("[](),.:") for w in m.group(1).split()]
            if not words:
                continue
            if words[0] in ("-h", "--help"):
                continue
            parser, rest = root, words
            # Walk down the subcommands (``config show``); the first word must be one.
            subs = _subparsers(parser)
            if rest[0] not in subs:
                bad.append(f"mmrlhf {rest[0]}")
                continue
            parser, rest = subs[rest[0]], rest[1:]
            nested = _subparsers(parser)
            if nested:
                if not rest or rest[0] not in nested:
                    bad.append(f"mmrlhf {words[0]} {rest[0] if rest else ''}".strip())
                    continue
                parser, rest = nested[rest[0]], rest[1:]
            allowed = _options(parser)
            for word in rest:
                flag = word.split("=")[0]
                if flag.startswith("--") and flag not in allowed:
                    bad.append(f"mmrlhf {words[0]} {flag}")
    return bad


# ---- 4. example paths -------------------------------------------------------------------------------------------
def example_paths_in(text: str) -> set[str]:
    """Every ``examples/...`` path named in ``text``, relative to the repository root."""
    return set(_EXAMPLE_PATH.findall(text))


def missing_example_paths(text: str, root: Path = ROOT) -> list[str]:
    return sorted(p for p in example_paths_in(text) if not (root / p).exists())


# ---- the checks over the real docs -------------------------------------------------------------------------------
def test_the_docs_exist_and_the_readme_links_every_doc():
    readme = (ROOT / "README.md").read_text()
    assert len(DOC_FILES) > 10
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in _LINK.findall(readme)}
    missing = [p.name for p in DOC_FILES if p.name != "README.md" and p.resolve() not in linked]
    assert not missing, f"README.md does not link: {missing}"


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: p.name)
def test_config_keys_written_in_the_docs_exist(path):
    unknown = unknown_config_keys(path.read_text())
    assert unknown == [], f"{path.name}: not config keys (fix them, or explain them in NOT_CONFIG_KEYS)"


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: p.name)
def test_relative_links_resolve(path):
    assert broken_links(path.read_text(), path.parent) == []


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: p.name)
def test_mmrlhf_commands_in_the_docs_exist(path):
    assert unknown_commands(path.read_text()) == []


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: p.name)
def test_example_paths_in_the_docs_exist(path):
    assert missing_example_paths(path.read_text()) == [], f"{path.name} names files that examples/ does not hold"


def test_the_example_path_check_reads_the_docs_recipes():
    """Not vacuous: the extraction finds the recipes the README's table and the docs' commands name."""
    named = set().union(*(example_paths_in(p.read_text()) for p in DOC_FILES))
    assert len(named) >= 15, sorted(named)
    assert {"examples/grpo_toy_shapes_cpu.yaml", "examples/rewards/custom_reward.py"} <= named


def test_the_allow_list_holds_only_names_that_are_not_config_keys():
    assert not [k for k in NOT_CONFIG_KEYS if key_exists(k)]


# ---- controls: the checkers catch what they are for --------------------------------------------------------------
def test_control_a_wrong_config_key_is_caught():
    text = (
        "Set `trainer.lr` and `rollout.n_samples_per_prompt`; `data.generator_options.task=count` is fine.\n"
        "But `trainer.learning_rate` and `rollout.n_samples` are not keys, nor `trainer.lr.value` (below a leaf).\n"
        "```bash\nmmrlhf train x.yaml algorithm.kl_coef=0.1 trainer.max_steps=3\n```\n"
        "Paths are not keys: `mmrlhf/trainer/loop.py`, `docs/data.md`, `trainer.py`; nor attributes `cfg.trainer.x`.\n"
    )
    assert unknown_config_keys(text) == [
        "algorithm.kl_coef", "rollout.n_samples", "trainer.learning_rate", "trainer.lr.value"]


def test_control_a_dead_link_is_caught(tmp_path):
    (tmp_path / "there.md").write_text("# Title\n\n## Some `code` heading, with punctuation!\n")
    text = ("[ok](there.md) [ok](there.md#some-code-heading-with-punctuation) [web](https://example.com) "
            "[gone](missing.md) [bad anchor](there.md#nope) [page](#local)\n"
            "```\n[in a code block](ignored.md)\n```\n")
    assert broken_links(text, tmp_path) == ["missing.md", "there.md#nope"]


def test_control_an_unknown_command_or_flag_is_caught():
    text = ("`mmrlhf train CONFIG [--resume]` `mmrlhf config show CONFIG` `mmrlhf smoke --family all` "
            "`mmrlhf --help`\n```bash\nmmrlhf serve-reward --reward math --port 0\nmmrlhf launch --nodes 2\n"
            "mmrlhf config explain\nmmrlhf train x.yaml --resume-from 3\n```\n")
    assert unknown_commands(text) == ["mmrlhf launch", "mmrlhf config explain", "mmrlhf train --resume-from"]


def test_control_a_made_up_example_path_is_caught():
    text = ("Run `mmrlhf train examples/grpo_toy_shapes_cpu.yaml` or "
            "[the 7B](../examples/grpo_geometry3k_qwen2_5_vl_7b.yaml).\n"
            "```bash\ntorchrun --nproc-per-node 8 -m mmrlhf train examples/grpo_geometry3k_qwen25vl_7b.yaml \\\n"
            "    reward.x=examples/rewards/custom_reward.py:score\n```\n"
            "A [gone link](../examples/gone/reward.py), a sentence ending in examples/no_such_recipe.yaml. "
            "Not paths here: [the folder](examples/), `examples/*.yaml`, `tests/examples/fixture.yaml`.\n")
    assert example_paths_in(text) == {
        "examples/grpo_toy_shapes_cpu.yaml", "examples/grpo_geometry3k_qwen2_5_vl_7b.yaml",
        "examples/grpo_geometry3k_qwen25vl_7b.yaml", "examples/rewards/custom_reward.py", "examples/gone/reward.py",
        "examples/no_such_recipe.yaml"}
    assert missing_example_paths(text) == [
        "examples/gone/reward.py", "examples/grpo_geometry3k_qwen25vl_7b.yaml", "examples/no_such_recipe.yaml"]
