"""run.resume decides what a run does with a checkpoint already in run.output_dir (rank 0's prepare_run)."""
import pytest
import yaml

from megatron_rl.cli import rank as rank_cli
from megatron_rl.config import ConfigError, load_config
from megatron_rl.control import main as control_main
from megatron_rl.plan.layout import RankLayout


@pytest.fixture
def prepare(tmp_path, monkeypatch):
    """prepare_run for run.output_dir=tmp_path/run under run.resume=mode (no model conversion)."""
    monkeypatch.setattr("megatron_rl.control.model_files.generator_model_dir", lambda model, precision: tmp_path)

    def run(mode: str) -> dict:
        cfg = load_config(None, [f"run.output_dir={tmp_path / 'run'}", f"run.resume={mode}"])
        return control_main.prepare_run(cfg, RankLayout(trainers=1, generators=1, verifiers=0))
    return run


def _checkpoint(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    (root / "iter_0000003").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("3")
    return root


@pytest.mark.parametrize("mode", ["fresh", "auto"])
def test_without_a_checkpoint_fresh_and_auto_start_a_new_run(prepare, tmp_path, mode):
    setup = prepare(mode)
    assert setup["resume_root"] is None
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["run"]["resume"] == mode


def test_without_a_checkpoint_require_fails_naming_the_key(prepare, tmp_path):
    with pytest.raises(ConfigError, match=r"^run\.resume: require .*no checkpoint under"):
        prepare("require")
    assert not (tmp_path / "run").exists()  # nothing written


def test_with_a_checkpoint_fresh_protects_the_run(prepare, tmp_path):
    _checkpoint(tmp_path)
    with pytest.raises(ConfigError, match=r"^run\.resume: fresh, but .* already holds a run; pass --resume"):
        prepare("fresh")
    assert not (tmp_path / "run" / "config.yaml").exists()


@pytest.mark.parametrize("mode", ["auto", "require"])
def test_with_a_checkpoint_auto_and_require_continue_from_it(prepare, tmp_path, mode):
    root = _checkpoint(tmp_path)
    assert prepare(mode)["resume_root"] == str(root)


def test_resume_flag_means_require_over_the_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"run": {"resume": "auto"}}))
    args = rank_cli.parse_args([str(path), "run.resume=fresh", "--resume"])
    assert control_main.run_config(args.config, args.overrides, args.resume).run.resume == "require"
    args = rank_cli.parse_args([str(path)])
    assert control_main.run_config(args.config, args.overrides, args.resume).run.resume == "auto"
    assert load_config().run.resume == "fresh"


@pytest.mark.parametrize("value", ["yes", "true", "on", "resume"])
def test_a_boolean_or_unknown_mode_is_a_one_line_error_naming_the_key(value):
    with pytest.raises(ConfigError, match=r"^run\.resume: must be one of \['fresh', 'auto', 'require'\]"):
        load_config(None, [f"run.resume={value}"])
