"""`--help`: every key with its type, the value a run would use and its description."""

from __future__ import annotations

import textwrap

from .schema import Config, key_descriptions, section_types, type_name


HELP_HEAD = """usage: [NGPU=n] [CONFIG_FILE=file.toml] ./run_train.sh [--section.key=value ...]
       python -m torchplex.train --job.config_file file.toml [--section.key=value ...]

run_train.sh environment: NGPU (processes per node, default 1), CONFIG_FILE (default train_configs/debug.toml),
NNODES and RDZV_ENDPOINT (several nodes), LOG_RANK (local ranks shown, default 0), PYTHON, OMP_NUM_THREADS.
Overrides win over the file. Values shown: {origin}."""


HELP_KEY_WIDTH, HELP_TYPE_WIDTH, HELP_WIDTH = 38, 40, 120


def format_help(cfg: Config | None = None, origin: str = "built-in defaults") -> str:
    """Every key with its type, the value this run would use (`cfg`: its config file plus overrides) and what it
    does. A type wider than its column puts the value on the next line, under the values."""
    lines = [HELP_HEAD.format(origin=origin)]
    values, descriptions = (cfg or Config()).to_dict(), key_descriptions()
    value_column = 4 + HELP_KEY_WIDTH + 1 + HELP_TYPE_WIDTH + 1
    for section, keys in section_types().items():
        lines.append(f"[{section}]")
        for key, annotation in keys.items():
            name, value = f"--{section}.{key}", repr(values[section][key])
            shown = type_name(annotation)
            if len(shown) < HELP_TYPE_WIDTH:  # at least two spaces between type and value
                lines.append(f"  {name:<{HELP_KEY_WIDTH + 2}} {shown:<{HELP_TYPE_WIDTH}} {value}")
            else:
                lines += [f"  {name:<{HELP_KEY_WIDTH + 2}} {shown}", " " * value_column + value]
            lines += textwrap.wrap(descriptions[section][key], HELP_WIDTH, initial_indent=" " * 6,
                                   subsequent_indent=" " * 6)
    return "\n".join(lines)


