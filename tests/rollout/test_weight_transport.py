"""What ``VLLMEngine.update_weights`` sends to vLLM's workers must survive plain ``pickle`` (vLLM's multiprocess
executor, used with tensor parallelism, pickles ``apply_model``'s callable with it), and load the same weights once
unpickled; the IPC-handle payload of the tensor-parallel CUDA path is rebuilt on the worker's side."""

from __future__ import annotations

import pickle

import torch

from mmrlhf.models.adapters import get_adapter
from mmrlhf.rollout.vllm_engine import VLLMEngine
from mmrlhf.rollout.vllm_weight_transport import BucketPayload, bucket_loader, choose_transport, pack_bucket
from mmrlhf.testing.tiny_models import tiny_model_dir


class _Model(torch.nn.Module):
    """The engine model's surface the loader uses: named parameters and ``load_weights``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(3))
        self.b = torch.nn.Parameter(torch.zeros(2, 2))

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        names = set()
        for name, tensor in weights:
            params[name].data.copy_(tensor)
            names.add(name)
        return names


class _RecordingLLM:
    """Records what ``apply_model`` is given, as a worker process would receive it: pickled and unpickled."""

    def __init__(self) -> None:
        self.model, self.sent = _Model(), []
        self.llm_engine = self

    def apply_model(self, fn):
        blob = pickle.dumps(fn)  # plain pickle, as vLLM's message queue
        self.sent.append(blob)
        return [pickle.loads(blob)(self.model)]

    def reset_prefix_cache(self):
        return True

    def reset_mm_cache(self):
        return None

    def reset_encoder_cache(self):
        return None


def test_update_weights_sends_a_plainly_picklable_loader_that_loads_the_weights():
    engine = VLLMEngine.__new__(VLLMEngine)  # no vLLM: only the state update_weights reads
    engine.llm, engine._asleep, engine.supports_sleep = _RecordingLLM(), False, False
    engine._cpu, engine.bucket_bytes = False, 16  # 16 bytes: one tensor per bucket
    engine.adapter = get_adapter(tiny_model_dir("qwen2_vl"))  # its weights go under their own names
    weights = [("a", torch.arange(3.0)), ("b", torch.full((2, 2), 7.0))]
    assert engine.update_weights(iter(weights)) == 2
    assert len(engine.llm.sent) == 2  # two buckets, each pickled
    assert torch.equal(engine.llm.model.a, weights[0][1]) and torch.equal(engine.llm.model.b, weights[1][1])


def test_transport_choice():
    assert choose_transport(1, "cuda") == "inline"
    assert choose_transport(1, "cpu") == "inline"
    assert choose_transport(4, "cpu") == "inline"  # the CPU engine drops tensor parallelism
    assert choose_transport(2, "cuda") == "cuda_ipc"


def _rebuild(value: float, shape: tuple[int, ...]) -> torch.Tensor:
    """Stands in for torch's ``rebuild_cuda_tensor`` (module-level, as it is)."""
    return torch.full(shape, value)


def test_ipc_payload_pickles_and_rebuilds_each_tensor_on_the_worker():
    """The cuda_ipc payload carries (rebuild, args) handles, never the tensors; CPU tensors travel inline."""
    cpu = torch.ones(2)
    payload = pack_bucket([("a", cpu)], "cuda_ipc", reduce=lambda t: (_rebuild, (0.0, (9,))))
    assert payload.items[0] is not None and torch.equal(payload.items[0], cpu)  # not on CUDA: inline
    handles = BucketPayload("cuda_ipc", ("a", "b"), ((_rebuild, (2.0, (3,))), (_rebuild, (5.0, (2, 2)))))
    blob = pickle.dumps(bucket_loader(handles))
    assert len(blob) < 1000  # handles, not tensor bytes
    model = _Model()
    names, held = pickle.loads(blob)(model)
    assert names == {"a", "b"} and held == {}
    assert torch.equal(model.a, torch.full((3,), 2.0)) and torch.equal(model.b, torch.full((2, 2), 5.0))
