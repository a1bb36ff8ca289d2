"""Rollout kinds (mmrlhf.experience.kinds): the registry resolves names, ``module:Class`` and ``file.py:Class`` and
refuses what is not a kind; the config's key picks one; the worked example of docs/experience.md runs through the
maker (transformers engine, tiny model) and drops exactly the groups a plain single-turn run would."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers import AutoProcessor

from mmrlhf.config import build_config
from mmrlhf.data.processor import MultimodalDataProcessor
from mmrlhf.experience.builder import rollout_kind_class
from mmrlhf.experience.fast_maker import FastExperienceMaker
from mmrlhf.experience.kinds import (
    ROLLOUT_KINDS, AgentKind, KindSetup, SingleTurn, build_rollout_kind, kind_class, resolve_kind_name,
)
from mmrlhf.experience.settings import ExperienceSettings
from mmrlhf.models.actor import ActorVL
from mmrlhf.models.adapters import get_adapter
from mmrlhf.registry import RegistryError
from mmrlhf.rollout.hf_engine import HFGenerateEngine
from mmrlhf.rollout.types import SamplingSettings
from mmrlhf.testing.tiny_models import tiny_model_dir
from maker_helpers import RecordingReward, reward_engine

DOC = Path(__file__).resolve().parents[2] / "docs" / "experience.md"
N = 4

NOT_A_KIND = '''
class Half:
    multi_turn = False

    def generate(self, call):
        raise NotImplementedError
'''


# ---- the registry ----------------------------------------------------------------------------------------------
def test_built_in_kinds_are_registered_by_name():
    assert set(ROLLOUT_KINDS) == {"single_turn", "agent"}
    assert kind_class("single_turn") is SingleTurn and kind_class("agent") is AgentKind
    assert (SingleTurn.multi_turn, AgentKind.multi_turn) == (False, True)


def test_an_unknown_kind_names_the_key_and_the_choices():
    with pytest.raises(RegistryError, match=r"rollout\.kind: unknown rollout kind 'singel_turn' \(did you mean "
                                            r"'single_turn'\?\); valid names: agent, single_turn"):
        kind_class("singel_turn")


def test_module_and_file_specs_resolve_through_the_registry(tmp_path):
    assert kind_class("mmrlhf.experience.kinds.single_turn:SingleTurn") is SingleTurn
    path = tmp_path / "my_kind.py"
    path.write_text("from mmrlhf.experience.kinds import SingleTurn\n\n"
                    "class Mine(SingleTurn):\n"
                    "    def __init__(self, setup, tag='x'):\n"
                    "        super().__init__(setup)\n"
                    "        self.tag = tag\n")
    kind = build_rollout_kind(f"{path}:Mine", KindSetup(), {"tag": "y"})
    assert type(kind).__name__ == "Mine" and kind.tag == "y"
    with pytest.raises(TypeError, match=r"rollout\.kind .*Mine.* \(rollout\.kind_options\): options \['colour'\] "
                                        r"do not fit"):
        build_rollout_kind(f"{path}:Mine", KindSetup(), {"colour": "red"})
    with pytest.raises(RegistryError, match="has no attribute 'Missing'"):
        kind_class(f"{path}:Missing")


def test_what_is_not_a_kind_is_refused(tmp_path):
    path = tmp_path / "half.py"
    path.write_text(NOT_A_KIND)
    with pytest.raises(TypeError, match=r"rollout\.kind: .*\(Half\) is not a rollout kind: it lacks responses, "
                                        r"after_rewards"):
        kind_class(f"{path}:Half")
    with pytest.raises(TypeError, match="resolved to a function; a rollout kind is a class"):
        kind_class("mmrlhf.experience.kinds:resolve_kind_name")
    other = tmp_path / "stringly.py"  # another file: a loaded file stays loaded under its path
    other.write_text(NOT_A_KIND.replace("multi_turn = False", "multi_turn = 'yes'") +
                     "    def responses(self, rows, tokenizer): ...\n    def after_rewards(self, rows, result): ...\n")
    with pytest.raises(TypeError, match=r"multi_turn must be a bool"):
        kind_class(f"{other}:Half")


def test_the_agent_kind_needs_the_turn_loop():
    with pytest.raises(ValueError, match="needs the turn loop"):
        build_rollout_kind("agent", KindSetup())


# ---- the config key --------------------------------------------------------------------------------------------
def test_auto_picks_agent_when_the_agent_section_is_on():
    assert resolve_kind_name("auto", agent_enabled=False) == "single_turn"
    assert resolve_kind_name("auto", agent_enabled=True) == "agent"
    assert resolve_kind_name("pkg.mod:Kind", agent_enabled=True) == "pkg.mod:Kind"
    assert not rollout_kind_class(build_config({})).multi_turn
    assert rollout_kind_class(build_config({"agent": {"tools": ["calculator"]}})).multi_turn


def test_the_config_refuses_a_kind_that_contradicts_the_agent_section():
    with pytest.raises(ValueError, match="rollout.kind=agent needs agent.tools or agent.environment"):
        build_config({"rollout": {"kind": "agent"}})
    with pytest.raises(ValueError, match="rollout.kind=single_turn contradicts agent.tools"):
        build_config({"rollout": {"kind": "single_turn"}, "agent": {"tools": ["calculator"]}})


# ---- the documented example through the maker ------------------------------------------------------------------
@pytest.fixture(scope="module")
def parts():
    path = str(tiny_model_dir("qwen2_vl"))
    processor = AutoProcessor.from_pretrained(path)
    actor = ActorVL.from_pretrained(path, dtype=torch.float32).eval()
    return get_adapter(path), processor, actor


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Path:
    text = DOC.read_text()
    code = re.search(r"```python\n(.*?)```", text[text.index("### Your own rollout kind"):], re.S).group(1)
    path = tmp_path_factory.mktemp("kinds") / "distinct_groups.py"
    path.write_text(code)
    return path


def _maker(parts, kind=None) -> FastExperienceMaker:
    """n = 4 one-token responses from three allowed tokens: no group can hold four different ones."""
    adapter, processor, actor = parts
    tok = processor.tokenizer
    allowed = {tok.convert_tokens_to_ids(t) for t in ("red", "blue", "green")}
    vocab = int(actor.model.get_output_embeddings().weight.shape[0])
    sampling = SamplingSettings(max_new_tokens=1, seed=3,
                                forbidden_token_ids=tuple(i for i in range(vocab) if i not in allowed))
    engine = HFGenerateEngine(actor.model, adapter, eos_token_id=tok.convert_tokens_to_ids(tok.eos_token),
                              pad_token_id=tok.pad_token_id, tokenizer=tok, max_model_len=1024)
    return FastExperienceMaker(actor, engine, MultimodalDataProcessor(processor, 2048, adapter),
                               reward_engine(RecordingReward()), tok,
                               ExperienceSettings(n_samples_per_prompt=N, micro_batch_size=8), sampling, kind=kind)


PROMPTS = ["Name a colour.", "Say a colour.", "Which colour?", "Pick one colour.", "A colour, please."]


def test_the_documented_kind_drops_the_groups_a_plain_run_would(parts, example):
    plain = _maker(parts).generate_rollout(PROMPTS).rows
    distinct: dict[int, set] = {}
    for group, response in zip(plain.group, plain.response_ids):
        distinct.setdefault(group, set()).add(tuple(response))
    kept = [i for i, g in enumerate(plain.group) if len(distinct[g]) >= 3]
    assert len(plain) == N * len(PROMPTS)
    assert 0 < len(kept) < len(plain)  # this seed samples groups of both sorts (2 of 5 use only two colours)

    kind = build_rollout_kind(f"{example}:DistinctGroups", KindSetup(), {"min_distinct": 3})
    maker = _maker(parts, kind)
    rollout = maker.generate_rollout(PROMPTS)  # the same seed and call count: the same samples as the plain run
    assert rollout.rows.response_ids == [plain.response_ids[i] for i in kept]
    assert rollout.rows.sample_index == [plain.sample_index[i] for i in kept]
    assert rollout.metrics["distinct/dropped_groups"] == len(PROMPTS) - len(kept) // N
    assert rollout.metrics["samples"] == len(kept) and rollout.metrics["prompts"] == len(PROMPTS)
    experiences = maker.experiences_from(rollout)  # the kept rows train as any others
    assert sum(e.sequences.shape[0] for e in experiences) == len(kept)

    strict = _maker(parts, build_rollout_kind(f"{example}:DistinctGroups", KindSetup(),
                                                         {"min_distinct": N + 1}))
    empty = strict.generate_rollout(PROMPTS)  # every group dropped: an empty share, whose caller decides
    assert len(empty) == 0 and empty.metrics["samples"] == 0 and empty.metrics["prompts"] == len(PROMPTS)
    from mmrlhf.experience.skips import NothingToScoreError

    with pytest.raises(NothingToScoreError, match=r"the rollout kind DistinctGroups made no sample of the "
                                                  rf"{len(PROMPTS)} prompt\(s\) left"):
        strict.experiences_from(empty)
