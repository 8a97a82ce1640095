"""Config tree: defaults are the recipe's, YAML + dotted overrides, clear errors naming the key."""
import pytest

from megatron_rl.config import Config, ConfigError, config_from_dict, dump_config, load_config


def test_defaults_are_magistral_recipe():
    cfg = load_config()
    assert (cfg.algo.eps_low, cfg.algo.eps_high) == (0.2, 0.28)
    assert cfg.algo.kl_mode == "none" and cfg.algo.adv_norm == "minibatch"
    assert (cfg.reward.format_reward, cfg.reward.correct_reward) == (0.1, 0.9)
    assert (cfg.reward.overlong_penalty, cfg.reward.language_reward) == (0.1, 0.1)
    assert cfg.reward.code_test_timeout_s == 4.0 and cfg.reward.code_max_tests == 20
    assert cfg.reward.code_compile_timeout_s == 10.0


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algo:\n  eps_high: 0.26\nrollout:\n  group_size: 4\n  n_batch: 8\n  n_mini: 2\n")
    cfg = load_config(path, ["rollout.n_async=12", "generator.extra_args=[--foo, '1']", "algo.tis_cap=2"])
    assert cfg.algo.eps_high == 0.26 and cfg.rollout.group_size == 4
    assert cfg.rollout.n_async == 12 and cfg.generator.extra_args == ["--foo", "1"]
    assert cfg.algo.tis_cap == 2.0 and isinstance(cfg.algo.tis_cap, float)


def test_round_trip_through_yaml(tmp_path):
    cfg = load_config(None, ["trainer.lr=3e-6", "data.drop_solved_above=0.9"])
    path = tmp_path / "dump.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg


@pytest.mark.parametrize("tree, key", [
    ({"algo": {"eps_hihg": 0.3}}, "algo.eps_hihg"),
    ({"algorithm": {}}, "algorithm"),
    ({"algo": {"eps_low": "big"}}, "algo.eps_low"),
    ({"algo": {"eps_low": 1.5}}, "algo.eps_low"),
    ({"algo": {"adv_norm": "batch"}}, "algo.adv_norm"),
    ({"algo": {"kl_coef": 0.1}}, "algo.kl_coef"),
    ({"algo": {"kl_ref_refresh_every": -1}}, "algo.kl_ref_refresh_every"),
    ({"algo": {"proximal": "old"}}, "algo.proximal"),
    ({"rollout": {"stale_policy": "reweight"}}, "rollout.stale_policy"),
    ({"rollout": {"stale_policy": "reweight"}, "algo": {"tis_cap": 2.0}}, "rollout.stale_policy"),
    ({"rollout": {"n_batch": 10, "n_mini": 3}}, "rollout.n_mini"),
    ({"rollout": {"group_size": 1}}, "rollout.group_size"),
    ({"rollout": {"n_async": True}}, "rollout.n_async"),
    ({"reward": {"l_cache": 9000}}, "reward.l_cache"),
    ({"generator": {"extra_args": "--x"}}, "generator.extra_args"),
    ({"data": {"source": "jsonl"}}, "data.path"),
    ({"trainer": []}, "trainer"),
    ({"env": {"name": "echo", "extra_in_flight": -1}}, "env.extra_in_flight"),
    ({"env": {"extra_in_flight": 4}}, "env.extra_in_flight"),  # the single-turn task never waits on a tool
])
def test_invalid_values_name_the_key(tree, key):
    with pytest.raises(ConfigError) as err:
        config_from_dict(tree)
    assert str(err.value).startswith(key), str(err.value)


def test_bad_files_and_overrides(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("algo: [1, 2\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="dotted.key=value"):
        load_config(None, ["algo.eps_high"])


def test_every_section_is_a_dataclass_with_validate():
    import dataclasses

    for f in dataclasses.fields(Config):
        section = getattr(Config(), f.name)
        assert dataclasses.is_dataclass(section) and callable(section.validate)


@pytest.mark.parametrize("override, key", [
    ("algo.eps_high.x=1", "algo.eps_high.x"),
    ("algo.nope=1", "algo.nope"),
    ("nope.eps=1", "nope"),
    ("algo=1", "algo"),
])
def test_override_paths_are_checked_against_the_schema(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert str(err.value).startswith(key), str(err.value)
