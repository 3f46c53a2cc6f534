"""Scoring leaves the policy exactly as it found it, and can prove it.

Every scorer and engine entry point runs inside ``unchanged(policy)``: the pass runs in eval mode
(BatchNorm uses its running statistics, so rows are independent, and dropout is off) and
afterwards every module keeps its training flag, the same Parameter objects in the same slots with
the same ``requires_grad`` and values, the same buffers with the same values (BatchNorm running
statistics included) and the same hooks, whatever aliasing or tying the network has.

With ``CHECK_MODULE_STATE`` true (environment ``RLINFLUENCE_CHECK_MODULE_STATE=1``; the test
suite turns it on in ``tests/conftest.py``) every such pass compares the policy's state before and
after and raises RuntimeError on any difference.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

CHECK_MODULE_STATE: bool = os.environ.get("RLINFLUENCE_CHECK_MODULE_STATE", "") == "1"
"""Debug/test mode: ``unchanged`` verifies that a scoring pass left the policy exactly as it was."""


def _module_state(policy: nn.Module) -> list[tuple]:
    """Everything of ``policy`` that scoring must not change, per module under every name it has:
    training flag, hook counts, each parameter slot (object, type, requires_grad, version counter
    of its values, gradient object) and each buffer slot (object, version counter)."""

    def param(p: torch.Tensor | None) -> tuple:
        return (None,) if p is None else (id(p), type(p), p.requires_grad, p._version, id(p.grad))

    def buffer(b: torch.Tensor | None) -> tuple:
        return (None,) if b is None else (id(b), b._version)

    return [
        (name, id(m), m.training, len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks),
         tuple((k, *param(p)) for k, p in m._parameters.items()),
         tuple((k, *buffer(b)) for k, b in m._buffers.items()))
        for name, m in policy.named_modules(remove_duplicate=False)
    ]


@contextmanager
def unchanged(policy: nn.Module) -> Iterator[None]:
    """Run a scoring pass in eval mode and leave ``policy`` exactly as it was found.

    Every submodule's training flag is set to False for the pass and restored one by one after it
    (``Module.train`` is not called: no override runs); with ``CHECK_MODULE_STATE`` the state of
    ``_module_state`` is compared before and after and any difference raises RuntimeError.
    Nesting is harmless.
    """
    before = _module_state(policy) if CHECK_MODULE_STATE else None
    modes = [(m, m.training) for m in policy.modules()]
    try:
        for m, _ in modes:
            m.training = False
        yield
    finally:
        for m, mode in modes:
            m.training = mode
    if before is not None:
        after = _module_state(policy)
        if after != before:
            b, a = next(((b, a) for b, a in zip(before, after, strict=False) if b != a), (len(before), len(after)))
            raise RuntimeError(f"scoring changed the policy: before {b}, after {a}")
