"""Training configuration: one dataclass per TOML section (schema.py), read from a file and then overridden on the
command line (loader.py), checked (checks.py) and described by `--help` (help.py).

    python -m torchplex.train --job.config_file train_configs/debug.toml --optimizer.lr=3e-6 --model.compile true
    python -m torchplex.config --job.config_file my.toml    # check a config: one line naming the key, exit 2
"""

from .checks import check_rewards
from .help import format_help
from .loader import caller_dir, config_from_dict, load_config, load_toml, main, save_config, to_toml
from .schema import ALGORITHM_DEFAULTS, PATH_KEYS, Config, ConfigError

__all__ = ["ALGORITHM_DEFAULTS", "PATH_KEYS", "Config", "ConfigError", "caller_dir", "check_rewards",
           "config_from_dict", "format_help", "load_config", "load_toml", "main", "save_config", "to_toml"]
