"""A config loaded from a preset carries the preset's name, so generate() reads a drafter spec as
`jspec generate` does: SpeculativeConfig(drafter="eagle3") runs the head the preset ships, with
the constants `jspec calibrate` fit beside it and LDLP's predictor from beside it."""

import json

import jax
import numpy as np
import pytest

import spec_tiny
from jspec import presets
from jspec.cards import card_key
from jspec.checkpoint.eagle_format import save_eagle_head
from jspec.checkpoint.orbax_io import save_params
from jspec.generate import SpeculativeConfig, generate
from jspec.speculative.drafters.base import DrafterError
from jspec.speculative.factory import policy_for_drafter
from jspec.speculative.policies import make_policy
from jspec.speculative.policies.calibration import calibration_path, save_calibration
from jspec.speculative.policies.ldlp import init_ldlp, save_ldlp

CALIBRATED_THRESHOLD = 100.0  # never stops a draft; the paper's 0.3 stops the random head's at once


@pytest.fixture(scope="module")
def tiny_preset(tmp_path_factory):
    """models/tiny: spec_tiny's target as an Orbax checkpoint, shipping its EAGLE-3 head with an
    SVIP calibration for this card and LDLP weights in the head's jspec/ folder."""
    root = tmp_path_factory.mktemp("models")
    target = spec_tiny.make_target()
    save_params(root / "tiny" / "weights", target, spec_tiny.CFG)
    drafter, head_params = spec_tiny._drafters(target)["eagle3"]
    head = root / "tiny" / "heads" / "eagle3"
    save_eagle_head(str(head), drafter.head, head_params)
    save_calibration(calibration_path(head), card_key(), {"policies": {"svip": {"constants": {"threshold": CALIBRATED_THRESHOLD}}}})
    save_ldlp(str(head / "jspec"), init_ldlp(spec_tiny.CFG.hidden_size, jax.random.PRNGKey(5), hidden=16),
              {"d_model": spec_tiny.CFG.hidden_size})
    (root / "tiny" / "preset.json").write_text(json.dumps(
        {"name": "tiny", "source": {"type": "path", "path": "weights"}, "drafters": {"eagle3": "heads/eagle3"}}))
    return root, head


@pytest.fixture
def loaded(tiny_preset, monkeypatch):
    root, head = tiny_preset
    monkeypatch.setenv("JSPEC_MODELS_DIR", str(root))
    cfg, params, _ = presets.resolve_model("tiny")
    return cfg, params, head


def run(cfg, params, **spec):
    return generate(params, cfg, spec_tiny._prompts(0, batch=2), max_new_tokens=spec_tiny.MAX_NEW,
                    speculative=SpeculativeConfig(k_max=spec_tiny.K, **spec))


def same(a, b) -> bool:
    return all(a.row(i) == b.row(i) for i in range(2)) and np.array_equal(a.drafted, b.drafted)


def test_a_preset_config_knows_its_name_and_compiles_as_any_other(loaded, tiny_preset):
    cfg, _, _ = loaded
    assert cfg.preset == "tiny" and presets.resolve_config("tiny").preset == "tiny"
    assert presets.resolve_config(tiny_preset[0] / "tiny" / "weights").preset is None  # a path names no preset
    anonymous = cfg.replace(preset=None)
    assert cfg == anonymous and hash(cfg) == hash(anonymous)  # jit caches: one program for both
    assert "preset" not in cfg.to_dict()  # where a model was loaded from is not saved with it


def test_generate_runs_the_head_the_preset_ships(loaded):
    cfg, params, head = loaded
    shipped = run(cfg, params, drafter="eagle3")
    assert same(shipped, run(cfg, params, drafter=f"eagle3:{head}"))
    assert all(shipped.row(i) == generate(params, cfg, spec_tiny._prompts(0, batch=2),
                                          max_new_tokens=spec_tiny.MAX_NEW).row(i) for i in range(2))
    with pytest.raises(DrafterError, match="none shipped for model None"):
        run(cfg.replace(preset=None), params, drafter="eagle3")


def test_generate_takes_the_calibrated_constants_and_ldlp_weights_beside_the_head(loaded):
    cfg, params, head = loaded
    policy, _ = policy_for_drafter("svip", None, "eagle3", cfg.preset, spec_tiny.K)
    assert policy.threshold == CALIBRATED_THRESHOLD
    assert policy_for_drafter("svip:paper", None, "eagle3", cfg.preset, spec_tiny.K)[0].threshold == 0.3
    calibrated = run(cfg, params, drafter="eagle3", policy="svip")
    assert same(calibrated, run(cfg, params, drafter="eagle3", policy=policy))
    assert not same(calibrated, run(cfg, params, drafter="eagle3", policy=make_policy("svip", k_max=spec_tiny.K)))
    ldlp = run(cfg, params, drafter="eagle3", policy="ldlp")  # no policy_params: the head's jspec/ folder
    assert ldlp.drafted.sum() > 0
