"""Specification of torchplex.config: defaults < TOML file < command line, strict keys and types, TOML round trip."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path

import pytest

from torchplex.config import Config, ConfigError, config_from_dict, load_config, save_config, to_toml
from torchplex.models.qwen2_5_vl.args import FLAVORS

REPO = Path(__file__).resolve().parents[1]
TRAIN_CONFIGS = sorted((REPO / "train_configs").glob("*.toml"))


def write_toml(tmp_path: Path, text: str, name: str = "cfg.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def load_file(path: str, *overrides: str) -> Config:
    return load_config(["--job.config_file", path, *overrides])


# ---- defaults and the file -------------------------------------------------------------------------------------
def test_no_arguments_give_the_dataclass_defaults():
    cfg = load_config([])
    assert cfg == Config()
    # spot-check the documented CPU-debug defaults
    assert (cfg.model.flavor, cfg.model.dtype, cfg.runtime.mode) == ("debug", "float32", "serial")
    assert (cfg.rollout.n_samples, cfg.rollout.max_new_tokens, cfg.optimizer.lr) == (8, 32, 1e-5)
    assert (cfg.reward.functions, cfg.reward.weights) == (["accuracy", "format"], [1.0, 0.1])
    assert cfg.parallelism.dp_shard == -1 and cfg.job.config_file == ""


def test_toml_values_replace_defaults_and_other_keys_keep_theirs(tmp_path):
    path = write_toml(tmp_path, """
[training]
steps = 123
[optimizer]
lr = 3e-6
weight_decay = 1          # an int is accepted where a float is declared
[reward]
functions = ["accuracy"]
weights = [2]
[algorithm]
advantage = "rloo"
""")
    cfg = load_file(path)
    assert cfg.training.steps == 123
    assert cfg.optimizer.lr == 3e-6
    assert cfg.optimizer.weight_decay == 1.0 and isinstance(cfg.optimizer.weight_decay, float)
    assert (cfg.reward.functions, cfg.reward.weights) == (["accuracy"], [2.0])
    assert cfg.algorithm.advantage == "rloo"
    assert cfg.job.config_file == path
    assert cfg.training.sft_lr == Config().training.sft_lr  # untouched key keeps its default


# ---- command-line overrides ------------------------------------------------------------------------------------
FILE_FOR_OVERRIDES = """
[job]
name = "from_file"
[training]
steps = 5
[optimizer]
lr = 1e-4
[model]
compile = true
dtype = "bfloat16"
[reward]
functions = ["accuracy", "format"]
weights = [1.0, 0.1]
"""


@pytest.mark.parametrize("override, section, key, expected", [
    ("--training.steps=77", "training", "steps", 77),                        # int
    ("--optimizer.lr=2.5e-7", "optimizer", "lr", 2.5e-7),                    # float
    ("--model.compile=false", "model", "compile", False),                    # bool
    ("--job.name=from_cli", "job", "name", "from_cli"),                      # str
    ("--model.dtype=float32", "model", "dtype", "float32"),                  # enumerated str
    ("--reward.functions=format,accuracy", "reward", "functions", ["format", "accuracy"]),  # list, comma separated
    ("--reward.weights=[0.5, 2]", "reward", "weights", [0.5, 2.0]),          # list, TOML array
])
def test_command_line_override_wins_over_the_file(tmp_path, override, section, key, expected):
    path = write_toml(tmp_path, FILE_FOR_OVERRIDES)
    file_value = getattr(getattr(load_file(path), section), key)
    assert file_value != expected  # the override must change something to prove it won
    for argv in ([override], override.split("=", 1)):  # both --k=v and --k v spellings
        cfg = load_file(path, *argv)
        assert getattr(getattr(cfg, section), key) == expected


@pytest.mark.parametrize("text, expected", [("true", True), ("false", False), ("1", True), ("0", False),
                                            ("TRUE", True)])
def test_bool_override_accepts_true_false_1_0(text, expected):
    assert load_config(["--checkpoint.enable", text]).checkpoint.enable is expected


def test_bare_bool_flag_means_true_and_negative_numbers_are_values():
    cfg = load_config(["--checkpoint.enable", "--parallelism.dp_shard", "-1", "--training.steps", "3"])
    assert cfg.checkpoint.enable is True
    assert (cfg.parallelism.dp_shard, cfg.training.steps) == (-1, 3)


def test_later_override_of_the_same_key_wins():
    assert load_config(["--training.steps=1", "--training.steps=2"]).training.steps == 2


def test_config_file_is_read_before_overrides_wherever_it_appears(tmp_path):
    path = write_toml(tmp_path, "[training]\nsteps = 5\n")
    assert load_config(["--training.steps=9", "--job.config_file", path]).training.steps == 9


# ---- errors name the key, the value and where it came from -----------------------------------------------------
def test_unknown_key_in_file_names_key_file_and_suggestion(tmp_path):
    path = write_toml(tmp_path, "[model]\nflavour = \"7B\"\n")
    with pytest.raises(ConfigError) as e:
        load_file(path)
    assert "model.flavour" in str(e.value) and path in str(e.value)
    assert "did you mean model.flavor?" in str(e.value)


def test_unknown_section_in_file_suggests_the_closest_section(tmp_path):
    path = write_toml(tmp_path, "[optimiser]\nlr = 1e-6\n")
    with pytest.raises(ConfigError, match=r"unknown section \[optimiser\].*did you mean \[optimizer\]") as e:
        load_file(path)
    assert path in str(e.value)


def test_top_level_key_outside_a_section_is_rejected(tmp_path):
    path = write_toml(tmp_path, "lr = 1e-6\n")
    with pytest.raises(ConfigError, match=r"not inside a \[section\].*did you mean optimizer.lr"):
        load_file(path)


def test_unknown_key_on_command_line_names_command_line():
    with pytest.raises(ConfigError, match=r"unknown key rollout.n_sample in command line.*rollout.n_samples"):
        load_config(["--rollout.n_sample=4"])


def test_key_in_the_wrong_section_suggests_the_section_that_has_it():
    with pytest.raises(ConfigError, match=r"training.lr .*did you mean optimizer.lr\?"):
        load_config(["--training.lr=1e-6"])


def test_wrong_type_in_file_names_key_file_and_types(tmp_path):
    path = write_toml(tmp_path, "[training]\nsteps = \"many\"\n")
    with pytest.raises(ConfigError) as e:
        load_file(path)
    assert "training.steps" in str(e.value) and path in str(e.value)
    assert "expected int" in str(e.value) and "'many'" in str(e.value)


@pytest.mark.parametrize("argv", [["--training.steps=abc"], ["--optimizer.lr", "fast"],
                                  ["--model.compile=yes"], ["--reward.weights=1,heavy"],
                                  ["--training.steps=1.5"]])
def test_wrong_type_on_command_line_names_key_and_command_line(argv):
    key = argv[0][2:].split("=")[0]
    with pytest.raises(ConfigError, match=rf"{key}(\[\d\])? in command line: cannot parse"):
        load_config(argv)


def test_bool_is_not_accepted_for_an_int_in_the_file(tmp_path):
    path = write_toml(tmp_path, "[training]\nsteps = true\n")
    with pytest.raises(ConfigError, match="training.steps.*expected int, got bool"):
        load_file(path)


def test_bad_enum_value_names_key_value_allowed_values_and_file(tmp_path):
    path = write_toml(tmp_path, "[runtime]\nmode = \"parallel\"\n")
    with pytest.raises(ConfigError) as e:
        load_file(path)
    message = str(e.value)
    for expected in ("runtime.mode", "'parallel'", "'serial'", "'decomposed'", "'overlapped'", path):
        assert expected in message


def test_bad_enum_value_on_command_line():
    with pytest.raises(ConfigError, match=r"algorithm.kl_estimator in command line: 'k4' .*'k1', 'k2', 'k3'"):
        load_config(["--algorithm.kl_estimator=k4"])


def test_override_without_section_or_stray_argument_is_rejected():
    with pytest.raises(ConfigError, match=r"--lr .*not of the form --section.key.*optimizer.lr"):
        load_config(["--lr=1e-6"])
    with pytest.raises(ConfigError, match=r"unexpected argument 'train.toml'"):
        load_config(["train.toml"])


def test_non_bool_flag_without_value_is_rejected():
    with pytest.raises(ConfigError, match=r"--training.steps on the command line needs a value \(int\)"):
        load_config(["--training.steps"])


def test_reward_weights_must_match_functions():
    with pytest.raises(ConfigError, match=r"reward.weights .*one weight per entry of reward.functions"):
        load_config(["--reward.weights=1.0"])


def test_reference_in_window_and_managed_memory_exclude_each_other():
    assert load_config(["--runtime.reference_in_window"]).runtime.reference_in_window
    with pytest.raises(ConfigError, match=r"runtime.reference_in_window = True .*memory.managed"):
        load_config(["--runtime.reference_in_window", "--memory.managed"])


def test_missing_and_malformed_files_are_named(tmp_path):
    missing = str(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not found") as e:
        load_file(missing)
    assert missing in str(e.value)
    broken = write_toml(tmp_path, "[training\nsteps = 1\n", "broken.toml")
    with pytest.raises(ConfigError, match="not valid TOML") as e:
        load_file(broken)
    assert broken in str(e.value)


# ---- writing ---------------------------------------------------------------------------------------------------
def non_default_config() -> Config:
    """Every value type, with strings that need escaping and floats that need all their digits."""
    cfg = Config()
    # seed: numpy refuses negative seeds (job.seed is range-checked)
    cfg.job = replace(cfg.job, name='quote " back\\slash\ttab é \x7f', description="line1\nline2", seed=3)
    cfg.optimizer = replace(cfg.optimizer, lr=1 / 3 * 1e-6, eps=1e-12, name="adamw8bit")
    cfg.reward = replace(cfg.reward, functions=["format", "accuracy", "think_format"], weights=[0.1, 1.0, -0.25])
    cfg.model = replace(cfg.model, compile=True, dtype="bfloat16")
    cfg.rollout = replace(cfg.rollout, kv_pool_gib=float(2**40), top_k=50)
    return cfg


def test_save_then_load_gives_the_same_config(tmp_path):
    cfg = non_default_config()
    path = save_config(cfg, tmp_path / "run" / "config.toml")
    loaded = load_file(str(path))
    # load records where it read; paths are saved absolute (a relative one meant the working folder)
    absolute = replace(cfg, job=replace(cfg.job, config_file=str(path), output_dir=os.path.abspath(cfg.job.output_dir)),
                       data=replace(cfg.data, synthetic_dir=os.path.abspath(cfg.data.synthetic_dir)))
    assert loaded == absolute


def test_saved_empty_list_round_trips(tmp_path):
    cfg = Config()
    cfg.reward = replace(cfg.reward, functions=[], weights=[])
    assert load_file(str(save_config(cfg, tmp_path / "c.toml"))).reward.functions == []


def test_to_dict_and_from_dict_round_trip():
    cfg = non_default_config()
    data = cfg.to_dict()
    assert set(data) == {"job", "model", "data", "rollout", "algorithm", "reward", "optimizer", "lr_scheduler",
                         "training", "checkpoint", "metrics", "runtime", "parallelism", "memory"}
    assert config_from_dict(data) == cfg
    data["reward"]["functions"].append("mutated")  # to_dict hands out copies, not the config's own lists
    assert cfg.reward.functions == ["format", "accuracy", "think_format"]


def test_from_dict_validates_like_a_file():
    with pytest.raises(ConfigError, match=r"unknown key model.flavour in my dict"):
        config_from_dict({"model": {"flavour": "7B"}}, origin="my dict")


def test_to_toml_writes_sections_in_order_with_toml_literals():
    text = to_toml({"a": {"flag": True, "n": 3, "x": 0.5, "s": "hi", "xs": [1.0, 2.0]}, "b": {}})
    assert text == '[a]\nflag = true\nn = 3\nx = 0.5\ns = "hi"\nxs = [1.0, 2.0]\n\n[b]\n'


# ---- shipped configs and the launcher --------------------------------------------------------------------------
def test_train_configs_exist():
    assert {p.name for p in TRAIN_CONFIGS} >= {"debug.toml", "qwen2_5_vl_3b.toml", "qwen2_5_vl_7b.toml",
                                               "qwen2_5_vl_32b.toml"}


@pytest.mark.parametrize("path", TRAIN_CONFIGS, ids=[p.name for p in TRAIN_CONFIGS])
def test_every_train_config_loads_with_a_known_flavor(path):
    cfg = load_file(str(path))
    assert cfg.model.flavor in FLAVORS
    if not path.name.startswith("debug"):  # real models: bf16, a prefix-sharing runtime, long generations
        assert cfg.model.dtype == "bfloat16" and cfg.runtime.mode in ("decomposed", "overlapped")
        # overlapped where one GPU holds the model (measured fastest); 32B stays decomposed across GPUs
        assert cfg.runtime.mode == ("decomposed" if cfg.model.flavor == "32B" else "overlapped")
        assert cfg.rollout.max_new_tokens == 1024 and cfg.rollout.n_samples == 8
        assert cfg.model.make_tiny_if_missing is False


def test_debug_config_is_the_cpu_tiny_run():
    cfg = load_file(str(REPO / "train_configs" / "debug.toml"))
    assert (cfg.model.flavor, cfg.model.dtype, cfg.model.hf_checkpoint) == ("debug", "float32",
                                                                            str(REPO / "outputs/tiny-qwen2_5_vl"))
    assert cfg.job.run_dir == REPO / "runs" / "debug"


@pytest.mark.slow
def test_run_train_sh_launches_from_any_folder_with_overrides(tmp_path):
    """The launcher resolves its config, forwards overrides and runs the module under torchrun (a stub here)."""
    (tmp_path / "stub_train.py").write_text(
        "import os\nfrom torchplex.config import load_config\n"
        "cfg = load_config()\n"
        "print(f'STUB rank={os.environ.get(\"RANK\", \"0\")} file={cfg.job.config_file} steps={cfg.training.steps}')\n")
    user_config = write_toml(tmp_path, "[training]\nsteps = 4\n", "mine.toml")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "TRAIN_MODULE": "stub_train", "NGPU": "1",
           "PYTHON": sys.executable, "CONFIG_FILE": "mine.toml"}  # relative to the caller's folder
    result = subprocess.run([str(REPO / "run_train.sh"), "--training.steps", "6"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"STUB rank=0 file={user_config} steps=6" in result.stdout


# ---- issue 16 defect 5: values that train nothing, named algorithms -------------------------------------------

@pytest.mark.parametrize("key,value", [("rollout.n_samples", 1), ("algorithm.ppo_epochs", 0)])
def test_values_that_train_nothing_are_refused_naming_key_and_file(tmp_path, key, value):
    """Issue 16 defect 5: n_samples = 1 (no group baseline: every advantage 0) and ppo_epochs = 0 were accepted and
    trained nothing; refused at load with the key and the file named, from the file and from the command line."""
    section, name = key.split(".")
    path = write_toml(tmp_path, f"[{section}]\n{name} = {value}\n")
    with pytest.raises(ConfigError, match=rf"{key} = {value} must be >= .*config from {path}"):
        load_file(path)
    with pytest.raises(ConfigError, match=rf"{key} = {value} must be >= .*command line"):
        load_config([f"--{key}={value}"])
    with pytest.raises(ConfigError, match=rf"{key} = {value} must be >= .*config from my.toml"):
        config_from_dict({section: {name: value}}, origin="my.toml")


def test_named_algorithms_get_their_papers_loss_defaults(tmp_path):
    """Issue 16 defect 5: each named algorithm's defaults are its paper's (GRPO and GSPO seq-mean-token-mean,
    DAPO token-mean with clip-higher and dynamic sampling, Dr. GRPO seq-mean-token-sum-norm without the std); main's
    defaults were token-mean with clip 0.28 under any importance. Keys given in the file or on the command line win."""
    expected = {
        "grpo": ("grpo", "token", "seq-mean-token-mean", 0.2, 0.2, False),
        "dapo": ("grpo", "token", "token-mean", 0.2, 0.28, True),
        "dr_grpo": ("dr_grpo", "token", "seq-mean-token-sum-norm", 0.2, 0.2, False),
        "gspo": ("grpo", "sequence", "seq-mean-token-mean", 3e-4, 4e-4, False),
    }

    def settings(cfg):
        a = cfg.algorithm
        return a.advantage, a.importance, a.loss_agg, a.clip_low, a.clip_high, a.dynamic_sampling

    assert settings(Config()) == settings(load_config([])) == expected["grpo"]
    for name, want in expected.items():
        assert settings(load_config([f"--algorithm.name={name}"])) == want
        path = write_toml(tmp_path, f'[algorithm]\nname = "{name}"\nloss_agg = "seq-mean-token-sum"\n')
        cfg = load_file(path, "--algorithm.clip_high=0.5")
        assert settings(cfg) == (*want[:2], "seq-mean-token-sum", want[3], 0.5, want[5])
        assert settings(config_from_dict({"algorithm": {"name": name}})) == want
        saved = load_file(str(save_config(cfg, tmp_path / f"{name}.toml")))  # every key is written, so all are given
        assert saved.to_dict()["algorithm"] == cfg.to_dict()["algorithm"]


# ---- ranges of numeric keys (issue 21, defect 8) ----------------------------------------------------------------
@pytest.mark.parametrize("key,value", [
    ("metrics.log_interval", "0"), ("training.steps", "0"), ("rollout.max_new_tokens", "0"),
    ("data.prompts_per_step", "0"), ("data.max_prompt_tokens", "-1"), ("optimizer.lr", "0"),
    ("optimizer.lr", "nan"), ("optimizer.beta2", "1.0"), ("optimizer.eps", "0"), ("rollout.kv_pool_gib", "-1"), ("memory.budget_gib", "-2"),
    ("rollout.max_batch", "0"), ("training.sft_batch_size", "0"), ("training.sft_warmup_steps", "-1"),
    ("checkpoint.interval", "0"), ("checkpoint.keep_latest_k", "-1"), ("metrics.eval_interval", "-5"),
    ("lr_scheduler.min_lr_ratio", "1.5"), ("algorithm.kl_coef", "-0.1"), ("reward.weights", "1.0,inf"),
    ("job.seed", "-1"), ("data.eval_prompts", "-1"), ("lr_scheduler.warmup_steps", "-1"),
])
def test_out_of_range_numbers_fail_at_load_naming_the_key(key, value):
    """Defect 8: metrics.log_interval = 0 was a ZeroDivisionError after the warm-up, training.steps = 0 and
    rollout.max_new_tokens = 0 failed later without naming the key."""
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_file(str(REPO / "train_configs" / "debug.toml"), f"--{key}={value}")


def test_out_of_range_number_in_a_file_names_the_file(tmp_path):
    path = write_toml(tmp_path, "[metrics]\nlog_interval = 0\n")
    with pytest.raises(ConfigError, match=r"metrics\.log_interval = 0 must be >= 1.*cfg\.toml"):
        load_file(path)


# ---- --help and the start-up check (issue 21, defect 10) ---------------------------------------------------------
def test_help_shows_the_values_of_the_config_the_run_would_use(tmp_path, capsys):
    """Defect 10: --help printed the dataclass defaults, not those of the config file given, nor NGPU/CONFIG_FILE."""
    path = write_toml(tmp_path, "[training]\nsteps = 123\n")
    with pytest.raises(SystemExit) as done:
        load_config(["--job.config_file", path, "--optimizer.lr=0.5", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "NGPU" in out and "CONFIG_FILE" in out
    steps = next(line for line in out.splitlines() if "--training.steps " in line)
    lr = next(line for line in out.splitlines() if "--optimizer.lr " in line)
    assert steps.rstrip().endswith("123") and lr.rstrip().endswith("0.5")
    assert f"{path} + command line" in out


def test_config_check_module_prints_one_line_and_exits_2(tmp_path, capsys):
    from torchplex.config import main

    assert main(["--job.config_file", str(REPO / "train_configs" / "debug.toml")]) == 0
    assert main(["--job.config_file", str(REPO / "train_configs" / "debug.toml"), "--training.stepz=3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "training.stepz" in err and "did you mean training.steps" in err


# ---- relative paths (issue 21, defect 6) -------------------------------------------------------------------------
def test_relative_paths_mean_the_toml_folder_in_a_file_and_the_callers_folder_on_the_command_line(tmp_path,
                                                                                                   monkeypatch):
    """Defect 6: relative command-line paths resolved against the repo root (run_train.sh's folder), not the
    caller's; the config file's own path did. Now a TOML's paths are relative to the TOML, the command line's to
    the caller's folder (TORCHPLEX_CALLER_DIR, set by run_train.sh, else the working folder)."""
    conf = tmp_path / "conf"
    conf.mkdir()
    path = write_toml(conf, '[data]\ntrain_file = "data/train.jsonl"\n[job]\noutput_dir = "../runs"\n')
    caller = tmp_path / "me"
    caller.mkdir()
    monkeypatch.setenv("TORCHPLEX_CALLER_DIR", str(caller))
    cfg = load_config(["--job.config_file", path, "--data.eval_file", "e.jsonl", "--model.hf_checkpoint=~/ckpt"])
    assert cfg.data.train_file == str(conf / "data" / "train.jsonl")
    assert cfg.job.output_dir == str(tmp_path / "runs")
    assert cfg.data.eval_file == str(caller / "e.jsonl")
    assert cfg.model.hf_checkpoint == str(Path("~/ckpt").expanduser())
    assert cfg.data.synthetic_dir == "outputs/synthetic"  # a default is left as it is
    again = load_config(["--job.config_file", path, f"--job.output_dir={tmp_path / 'abs'}"])
    assert again.job.output_dir == str(tmp_path / "abs")
    monkeypatch.chdir(conf)
    monkeypatch.delenv("TORCHPLEX_CALLER_DIR")
    relative = load_config(["--job.config_file", "cfg.toml"])  # the config file itself: the caller's folder too
    assert relative.job.config_file == path and relative.data.train_file == str(conf / "data" / "train.jsonl")


def test_data_file_patterns_are_relative_to_the_toml_too(tmp_path, monkeypatch):
    """Issue 21 defect 6 for users' data files (issue 22's data.train_files / eval_files, lists of globs): relative
    patterns in a TOML mean its folder, on the command line the caller's."""
    conf = tmp_path / "conf"
    conf.mkdir()
    path = write_toml(conf, '[data]\ntrain_files = ["data/train-*.parquet", "/abs/x.jsonl"]\n')
    monkeypatch.setenv("TORCHPLEX_CALLER_DIR", str(tmp_path))
    cfg = load_config(["--job.config_file", path, "--data.eval_files", '["test.parquet"]'])
    assert cfg.data.train_files == [str(conf / "data" / "train-*.parquet"), "/abs/x.jsonl"]
    assert cfg.data.eval_files == [str(tmp_path / "test.parquet")]


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "train_configs").glob("*.toml")))
def test_shipped_configs_write_runs_and_outputs_at_the_repo_root(name):
    """Every shipped config's relative run folder and tiny checkpoint mean the repo's runs/ and outputs/ (a TOML's
    paths are relative to train_configs/, so "runs" there would be train_configs/runs)."""
    cfg = load_config(["--job.config_file", str(REPO / "train_configs" / name)])
    assert Path(cfg.job.output_dir) == REPO / "runs"
    if not cfg.model.hf_checkpoint.startswith("/path/to"):
        assert Path(cfg.model.hf_checkpoint).parent == REPO / "outputs"


def test_a_config_with_data_file_patterns_saves_and_loads_again(tmp_path):
    cfg = load_config([f"--data.train_files=[\"{tmp_path}/train-*.parquet\"]", "--data.eval_files=[\"e.jsonl\"]"])
    again = load_file(str(save_config(cfg, tmp_path / "saved.toml")))
    assert again.data.train_files == [f"{tmp_path}/train-*.parquet"] and Path(again.data.eval_files[0]).is_absolute()


# ---- reward functions, resolved and checked with the config (issue 47, defect 4) ----------------------------------
USER_REWARD = "def brevity(prompts, responses, answers, records):\n    return [1.0 for _ in responses]\n"


@pytest.fixture
def caller_with_rewards(tmp_path, monkeypatch):
    """A folder holding my_rewards.py that the command is run from, while the process works in the repo root (as
    run_train.sh does); my_rewards is not importable from there."""
    caller = tmp_path / "me"
    caller.mkdir()
    (caller / "my_rewards.py").write_text(USER_REWARD)
    monkeypatch.setenv("TORCHPLEX_CALLER_DIR", str(caller))
    monkeypatch.chdir(REPO)
    yield caller
    sys.modules.pop("my_rewards", None)


@pytest.mark.parametrize("entry", ["my_rewards.py:brevity", "my_rewards:brevity"])
def test_a_reward_on_the_command_line_is_found_in_the_callers_folder(caller_with_rewards, entry):
    """Issue 47, defect 4: `--reward.functions=math,my_rewards.py:f` from another folder was looked up in the repo
    root, and the module form `my_rewards:f` did not import; both mean the caller's folder, as paths do."""
    from torchplex.rl.reward_functions import get_reward

    cfg = load_config([f"--reward.functions=math,{entry}", "--reward.weights=1.0,0.5"])
    assert cfg.reward.functions == ["math", f"{caller_with_rewards / 'my_rewards.py'}:brevity"]
    assert list(get_reward(cfg.reward.functions[1])(prompts=["p"], responses=["r"], answers=["a"],
                                                    records=[None])) == [1.0]


def test_a_reward_file_in_a_toml_is_relative_to_the_toml(tmp_path, caller_with_rewards):
    """Issue 47, defect 4: a TOML's reward path means the TOML's folder, like its other paths."""
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "rewards.py").write_text(USER_REWARD)
    path = write_toml(conf, '[reward]\nfunctions = ["rewards.py:brevity"]\nweights = [1.0]\n'
                            'correct = "rewards.py:brevity"\n')
    cfg = load_config(["--job.config_file", path])
    assert cfg.reward.functions == [f"{conf / 'rewards.py'}:brevity"] and cfg.reward.correct == cfg.reward.functions[0]


@pytest.mark.parametrize("entry,reason", [
    ("nosuch", r"unknown reward function 'nosuch'; known: .*accuracy"),
    ("no_module_here:f", r"ModuleNotFoundError: No module named 'no_module_here'; a module must be importable"),
    ("missing.py:f", r"no file .*missing\.py"),
    ("my_rewards:nothing", r"has no 'nothing'"),
])
def test_a_reward_that_does_not_resolve_is_a_config_error_naming_the_key(caller_with_rewards, entry, reason):
    """Issue 47, defect 4: an unknown built-in was a KeyError traceback, and every reward was resolved only after
    the models had loaded; now the config check names the key, the value and why (one line, exit status 2)."""
    with pytest.raises(ConfigError, match=rf"^reward\.functions\[1\] = .*{reason}") as failed:
        load_config([f"--reward.functions=math,{entry}", "--reward.weights=1.0,0.5"])
    assert "command line" in str(failed.value) and "\n" not in str(failed.value)
    with pytest.raises(ConfigError, match=r"^reward\.correct = 'nosuch'"):
        load_config(["--reward.correct=nosuch"])


@pytest.mark.slow
def test_run_train_sh_refuses_an_unknown_reward_before_any_process_starts(tmp_path):
    """Issue 47, defect 4: `--reward.functions=nosuch` failed after 20-30 s of model loading with a traceback."""
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHON=sys.executable, TRAIN_MODULE="no_such_trainer_module")
    done = subprocess.run([str(REPO / "run_train.sh"), "--reward.functions=accuracy,nosuch"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "reward.functions[1] = 'nosuch'" in done.stderr, done.stderr


# ---- --help (issue 47, defect 11) -----------------------------------------------------------------------------------
def help_text(capsys, *args: str) -> str:
    with pytest.raises(SystemExit):
        load_config([*args, "--help"])
    return capsys.readouterr().out


def test_help_describes_every_key(capsys):
    """Issue 47, defect 11: --help gave no description of any key. Each key's line is followed by what it does, read
    from the comment of its dataclass field (the one place a key is described)."""
    lines = help_text(capsys).splitlines()
    keys = [i for i, line in enumerate(lines) if line.startswith("  --")]
    assert len(keys) == sum(len(fields(section)) for section in [type(getattr(Config(), f.name))
                                                                  for f in fields(Config)])
    for i in keys:
        following = lines[i + 1] if lines[i + 1].strip().startswith("'") else None  # a value under a wide type
        description = lines[i + 2 if following else i + 1]
        assert description.startswith("      ") and description.strip(), lines[i]
    text = "\n".join(lines)
    assert "  --job.name " in text and "the run's name: its folder is <output_dir>/<name>" in text
    assert "A run folder holds one run. true: a folder holding an earlier run" in text  # a comment block above a key


def test_help_keeps_values_in_their_column_after_long_types(capsys):
    """Issue 47, defect 11: a long enum type ran into the default column (`... 'seq-mean-token-sum-norm'
    'seq-mean-token-mean'`). Every value starts in the value column, on the key's line or the next one."""
    lines = help_text(capsys).splitlines()
    column = next(line for line in lines if line.startswith("  --training.steps ")).rindex(" 20") + 1
    cfg = Config().to_dict()
    for i, line in enumerate(lines):
        if line.startswith("  --"):
            section, key = line.split()[0].removeprefix("--").split(".")
            value = repr(cfg[section][key])
            shown = line if len(line) > column and line[column - 2:column] == "  " else lines[i + 1]
            assert shown[column:] == value and shown[:column].endswith("  "), (line, lines[i + 1])
