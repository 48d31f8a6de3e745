"""Reading a config: dataclass defaults < TOML file < command line (left to right), every key checked against the
schema, so a typo fails at start-up naming the key, where it came from and the closest valid key, instead of
silently training with a default. Writing one: `save_config` records the resolved config as TOML, so a run folder
holds exactly what ran and can be re-launched with `--job.config_file <run>/config.toml`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from .checks import apply_algorithm_defaults, check_rewards, check_values
from .help import format_help
from .schema import PATH_KEYS, REWARD_KEYS, Config, ConfigError, section_types, suggest, type_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

COMMAND_LINE = "command line"


# ---- value checking ---------------------------------------------------------------------------------------------
def _coerce(value: Any, annotation: Any, key: str, origin: str) -> Any:
    """Return `value` as `annotation` (ints widen to float), or raise naming the key and its origin."""
    where = f"{key} in {origin}"
    kind = get_origin(annotation)
    if kind is Literal:
        allowed = get_args(annotation)
        if not isinstance(value, str) or value not in allowed:
            raise ConfigError(f"{where}: {value!r} is not allowed; expected one of {', '.join(map(repr, allowed))}")
        return value
    if kind is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a {type_name(annotation)}, got {value!r}")
        return [_coerce(v, get_args(annotation)[0], f"{key}[{i}]", origin) for i, v in enumerate(value)]
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }[annotation]
    if not ok:
        raise ConfigError(f"{where}: expected {annotation.__name__}, got {type(value).__name__} {value!r}")
    return float(value) if annotation is float else value


def _parse_text(text: str, annotation: Any, key: str, origin: str) -> Any:
    """Parse a command-line string into `annotation` (then checked by `_coerce`)."""
    kind = get_origin(annotation)
    try:
        if kind is list:
            if text.strip().startswith("["):  # a TOML array: --reward.weights '[1.0, 0.5]'
                value = tomllib.loads(f"v = {text}")["v"]
            else:  # comma separated: --reward.functions accuracy,format
                items = [t.strip() for t in text.split(",") if t.strip()]
                value = [_parse_text(t, get_args(annotation)[0], f"{key}[{i}]", origin) for i, t in enumerate(items)]
        elif annotation is bool:
            lowered = text.strip().lower()
            if lowered not in ("true", "false", "1", "0"):
                raise ValueError("expected true, false, 1 or 0")
            value = lowered in ("true", "1")
        elif annotation is int:
            value = int(text)
        elif annotation is float:
            value = float(text)
        else:  # str and Literal
            value = text
    except ConfigError:  # a list element already named itself
        raise
    except (ValueError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{key} in {origin}: cannot parse {text!r} as {type_name(annotation)} ({e})") from None
    return _coerce(value, annotation, key, origin)


def _annotation(section: str, key: str, origin: str) -> Any:
    """The declared type of section.key, or a ConfigError naming the unknown section/key and a close valid one."""
    sections = section_types()
    if section not in sections:
        raise ConfigError(f"unknown section [{section}] in {origin}{suggest(section, None)}; "
                          f"valid sections: {', '.join(sections)}")
    if key not in sections[section]:
        raise ConfigError(f"unknown key {section}.{key} in {origin}{suggest(section, key)}")
    return sections[section][key]


def _set(cfg: Config, section: str, key: str, value: Any, origin: str, from_text: bool = False) -> str:
    """Set section.key and return that name."""
    annotation, name = _annotation(section, key, origin), f"{section}.{key}"
    value = _parse_text(value, annotation, name, origin) if from_text else _coerce(value, annotation, name, origin)
    setattr(getattr(cfg, section), key, value)
    return name


def _apply_tables(cfg: Config, data: dict[str, Any], origin: str) -> set[str]:
    """Set every key of {section: {key: value}}; return the names set."""
    given = set()
    for section, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{section} = {table!r} in {origin} is not inside a [section]{suggest('', section)}")
        for key, value in table.items():
            given.add(_set(cfg, section, key, value, origin))
    return given




# ---- loading ----------------------------------------------------------------------------------------------------
def _split_argv(argv: list[str]) -> list[tuple[str, str, str | None]]:
    """`--section.key=value` / `--section.key value` / bare `--section.key` (booleans) -> (section, key, text)."""
    out, i = [], 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--"):
            raise ConfigError(f"unexpected argument {token!r} on the {COMMAND_LINE}; "
                              f"overrides look like --section.key=value or --section.key value")
        name, has_eq, text = token[2:].partition("=")
        if not has_eq:
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                text, i = argv[i + 1], i + 1
            else:
                text = None
        section, dot, key = name.partition(".")
        if not dot:
            raise ConfigError(f"--{name} on the {COMMAND_LINE} is not of the form --section.key"
                              f"{suggest('', name)}")
        out.append((section, key, text))
        i += 1
    return out


def load_toml(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} not found (cwd: {Path.cwd()})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from None


def load_config(argv: list[str] | None = None) -> Config:
    """Defaults, then the TOML named by `--job.config_file`, then every other `--section.key` override."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        # The defaults shown are those of the run these arguments would start (its config file and overrides).
        rest = [a for a in argv if a not in ("-h", "--help")]
        try:
            cfg, origin = _load(rest), _origin_of(rest)
        except ConfigError as err:
            cfg, origin = Config(), f"built-in defaults; the given config does not load: {err}"
        print(format_help(cfg, origin))
        raise SystemExit(0)
    return _load(argv)


def _origin_of(argv: list[str]) -> str:
    overrides = _split_argv(argv)
    files = [text for section, key, text in overrides if (section, key) == ("job", "config_file") and text]
    origin = files[-1] if files else "built-in defaults"
    if any((section, key) != ("job", "config_file") for section, key, _ in overrides):
        origin += f" + {COMMAND_LINE}"
    return origin



def caller_dir() -> Path:
    return Path(os.environ.get("TORCHPLEX_CALLER_DIR") or os.getcwd())


def _absolute(value: str | list[str], base: Path) -> str | list[str]:
    if isinstance(value, list):  # data.train_files / eval_files: glob patterns
        return [_absolute(v, base) for v in value]
    path = Path(value).expanduser()
    return os.path.normpath(path if path.is_absolute() else base / path)


def _resolve_paths(cfg: Config, bases: dict[str, Path]) -> None:
    """Make the path keys that were set absolute (`bases`: key -> folder it is relative to); defaults are left."""
    from ..rl.reward_functions import locate_reward

    for key, base in bases.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if key in PATH_KEYS and value:
            setattr(getattr(cfg, section), name, _absolute(value, base))
        elif key in REWARD_KEYS and value:
            located = [locate_reward(v, base) for v in value] if isinstance(value, list) else locate_reward(value, base)
            setattr(getattr(cfg, section), name, located)




def _load(argv: list[str]) -> Config:
    overrides = _split_argv(argv)
    cfg, origin, given = Config(), COMMAND_LINE, set()
    bases: dict[str, Path] = {}
    config_files = [text for section, key, text in overrides if (section, key) == ("job", "config_file")]
    if config_files and config_files[-1]:
        origin = _absolute(config_files[-1], caller_dir())
        tables = load_toml(origin)
        given = _apply_tables(cfg, tables, origin)
        cfg.job.config_file = origin
        bases = {f"{section}.{key}": Path(origin).parent for section, table in tables.items()
                 if isinstance(table, dict) for key in table}
    for section, key, text in overrides:
        bases[f"{section}.{key}"] = caller_dir()  # set on the command line: relative to the caller's folder
        if text is None:  # a bare flag switches a boolean on
            annotation = _annotation(section, key, COMMAND_LINE)
            if annotation is not bool:
                raise ConfigError(f"--{section}.{key} on the {COMMAND_LINE} needs a value ({type_name(annotation)})")
            text = "true"
        if (section, key) == ("job", "config_file"):
            continue  # read above
        given.add(_set(cfg, section, key, text, COMMAND_LINE, from_text=True))
    apply_algorithm_defaults(cfg, given)
    _resolve_paths(cfg, bases)
    check_values(cfg, origin if origin == COMMAND_LINE else f"{origin} + {COMMAND_LINE}")
    check_rewards(cfg, origin if origin == COMMAND_LINE else f"{origin} + {COMMAND_LINE}")
    return cfg




def config_from_dict(data: dict[str, Any], origin: str = "dict") -> Config:
    """Defaults overridden by `data` ({section: {key: value}}), checked as a file is; missing keys keep their
    default."""
    cfg = Config()
    apply_algorithm_defaults(cfg, _apply_tables(cfg, data, origin))
    check_values(cfg, origin)
    return cfg


def save_config(cfg: Config, path: str | Path) -> Path:
    """Write the resolved config as TOML (loadable with `--job.config_file path`). Paths are written absolute (a
    relative one left is relative to the working folder), since a TOML's relative paths mean its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = cfg.to_dict()
    for key in PATH_KEYS:
        section, name = key.split(".")
        if data[section][name]:
            data[section][name] = _absolute(data[section][name], Path.cwd())
    path.write_text("# resolved torchplex config\n" + to_toml(data))
    return path


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):  # before int: bool is an int subclass
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # repr round-trips floats exactly; inf/nan spell the same in TOML
    if isinstance(value, str):
        # JSON string escapes are a subset of TOML basic-string escapes; TOML also forbids a raw DEL.
        return json.dumps(value).replace("\x7f", "\\u007f")
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as TOML")


def to_toml(data: dict[str, dict[str, Any]]) -> str:
    """{section: {key: scalar or list}} as TOML; only the flat types the config uses."""
    blocks = []
    for section, table in data.items():
        blocks.append(f"[{section}]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in table.items()))
    return "\n".join(blocks)


def main(argv: list[str] | None = None) -> int:
    """`python -m torchplex.config ARGS`: check a config (run_train.sh does, before torchrun starts any process), so
    a mistake prints its one-line message and nothing else; exit status 2 when it does not load."""
    try:
        load_config(argv)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    return 0
