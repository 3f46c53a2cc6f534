"""``PPOConfig.compile``: the compiled minibatch loss trains to the eager update's parameters up
to float rounding, and refuses TracIn (which records the eager update's layers)."""

import shutil

import pytest

from rlinfluence.errors import UserError
from rlinfluence.ppo import PPO

from .conftest import tiny_config


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("clang++") is None,
                    reason="torch.compile on the CPU needs a C++ compiler")
def test_a_compiled_update_trains_to_the_eager_parameters_up_to_rounding():
    trained = {}
    for compiled in (False, True):
        trainer = PPO(tiny_config(compile=compiled, n_epochs=4), run_dir=False)
        for _ in range(2):
            trainer.train_round()
        trained[compiled] = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    start = {n: p.detach() for n, p in PPO(tiny_config(), run_dir=False).policy.named_parameters()}
    for name, eager in trained[False].items():
        moved = float((eager - start[name]).abs().max())
        assert moved > 0, name
        assert float((trained[True][name] - eager).abs().max()) <= 1e-3 * moved, name


def test_compile_with_tracin_is_one_clear_error():
    with pytest.raises(UserError, match="compile and tracin"):
        tiny_config(compile=True, tracin=True).validate()
