"""Checks of a command line before Hydra runs it, each failing with one line (a ConfigError)
where Hydra would print a traceback or a message with no way out: an override Hydra cannot
parse (a path the shell split at a space, an unquoted accent), a YAML file with a syntax
error or a renamed key, a run directory that cannot be made; and Hydra's composition errors as
one line."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import yaml

from rlhf.config import RENAMED_KEYS, ConfigError, unknown_key
from rlhf.config.schema import ASYNC_KEY

QUOTE_HINT = (
    "quote the value inside the argument, as in \"data.sources.local.path='/my data/x.jsonl'\" "
    "(Hydra reads an unquoted value as plain ASCII, without spaces)"
)


def check_override_syntax(overrides: list[str]) -> None:
    """Each override Hydra's grammar refuses, named with the reason and how to quote it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for index, override in enumerate(overrides):
        try:
            parser.parse_override(override)
        except HydraException as err:
            reason = str(err).strip().splitlines()[0]
            previous = overrides[index - 1] if index > 0 else ""
            if "=" not in override and "=" in previous:  # the shell split a value at a space
                raise ConfigError(
                    f"{override!r} is not an override (key=value): if it is the rest of "
                    f"{previous!r} (a path with a space), quote the whole override: "
                    f"'{previous} {override}'"
                ) from None
            raise ConfigError(
                f"{override}: Hydra cannot parse it ({reason}); {QUOTE_HINT}"
            ) from None


MODES = {"run": "--run", "multirun": "-m", "cfg": "--cfg", "info": "--info"}


def check_modes(parsed) -> None:
    """Hydra takes one of --run, -m, --cfg, --info (it raises a ValueError with a traceback
    for more); ``parsed``: its argument parser's answer."""
    given = [flag for name, flag in MODES.items() if getattr(parsed, name, None)]
    if len(given) > 1:
        raise ConfigError(
            f"{' and '.join(given)} together: Hydra takes one of --run, -m, --cfg, --info "
            "(a sweep job's config: drop -m and give that job's values with --cfg job)"
        )


# Hydra's sweepers that come in an extra of rlhf's: option -> (its plugin module, the extra)
SWEEPER_EXTRAS = {"optuna": ("hydra_plugins.hydra_optuna_sweeper", "search")}


def check_sweeper_installed(parsed, conf_dir: Path) -> None:
    """hydra/sweeper=optuna (on the command line, or as the -cn file's override) without its
    plugin installed: Hydra would list the sweepers it has; this names the extra to install.
    ``conf_dir``: where the primary config is when -cd is not given."""
    import importlib.util
    import re

    chosen = [o.split("=", 1)[1] for o in parsed.overrides if o.startswith("hydra/sweeper=")]
    primary = Path(parsed.config_dir or conf_dir) / f"{parsed.config_name or 'config'}.yaml"
    if primary.is_file():
        chosen += re.findall(r"override hydra/sweeper:\s*(\w+)", primary.read_text())
    for name in chosen:
        module, extra = SWEEPER_EXTRAS.get(name, (None, None))
        if module is not None and importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"hydra/sweeper={name}: Hydra's {name} sweeper is not installed; pip install "
                f"-e '.[{extra}]' in the checkout (or pip install 'rlhf[{extra}]')"
            )


def check_yaml_files(config_dirs: list[Path]) -> None:
    """Every YAML file under ``config_dirs`` parses (the shipped conf/ and sweeps/, in tests)."""
    for config_dir in config_dirs:
        for path in sorted(config_dir.rglob("*.yaml")) if config_dir.is_dir() else []:
            check_yaml_file(path)


def check_yaml_file(path: Path) -> None:
    """A YAML syntax error as one line: file, line, the parser's message (Hydra reports it as
    a 75-line traceback); a renamed key as one line naming the new key (Hydra's own error is
    several naming the schema's class)."""
    try:
        content = yaml.safe_load(path.read_text())
    except yaml.MarkedYAMLError as err:
        mark, start = err.problem_mark or err.context_mark, err.context_mark
        where = f"{path}, line {mark.line + 1}" if mark else str(path)
        context = err.context or ""
        if start is not None and mark is not None and start.line != mark.line:
            context += f" (from line {start.line + 1})"
        message = ": ".join(part for part in (context, err.problem) if part)
        raise ConfigError(f"{where}: YAML syntax error: {message}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: YAML error: {err}") from None
    keys = _dotted_keys(content)
    for key in keys:  # ppo.async.X: ppo.asynchronous.X, named at its leaf
        at = _async_at(key)
        if at is not None and not any(k.startswith(key + ".") for k in keys):
            raise ConfigError(f"{path}: {key}: {unknown_key(at)}")
    for key in keys:
        # under whatever package the file lands (actor: {twin_path: ...} in a _global_ file),
        # or as a sweep's axis (hydra.sweeper.params: {critic.offload_twin: ...})
        old = next((o for o in RENAMED_KEYS if key == o or key.endswith("." + o)), None)
        # a key that became a section of its name (ppo.ema -> ppo.ema.enabled) is the section
        # where it holds a mapping
        became_section = old is not None and RENAMED_KEYS[old].startswith(old + ".")
        if old is not None and not (became_section and isinstance(_at(content, key), dict)):
            raise ConfigError(f"{path}: {key}: {unknown_key(old)}")


def _async_at(key: str) -> str | None:
    """The part of a dotted key from ``ppo.async`` on (ppo.async.min_finished, under whatever
    package or sweep axis), or None."""
    parts = key.split(".")
    for i in range(len(parts) - 1):
        if parts[i : i + 2] == ASYNC_KEY.split("."):
            return ".".join(parts[i:])
    return None


def _at(node, key: str):
    """The value at the dotted ``key`` of a parsed YAML mapping (None: a name with a dot)."""
    for name in key.split("."):
        if not isinstance(node, dict) or name not in node:
            return None
        node = node[name]
    return node


def _dotted_keys(node, prefix: str = "") -> list[str]:
    """Every key of a parsed YAML mapping, nested ones dotted (``actor.model.path``)."""
    if not isinstance(node, dict):
        return []
    out = []
    for name, value in node.items():
        out += [f"{prefix}{name}", *_dotted_keys(value, f"{prefix}{name}.")]
    return out


_on_yaml_error: list[Callable[[ConfigError], None] | None] = [None]


def check_composed_yaml(fail: Callable[[ConfigError], None] | None = None) -> None:
    """Each YAML file Hydra reads is checked as it reads it, and only those: a broken file
    elsewhere in a -cd directory blocks nothing that does not compose it. ``fail`` reports a
    problem (a run: one line, exit status 2); None: the ConfigError is raised."""
    from hydra._internal.sources_registry import SourcesRegistry
    from hydra.core.plugins import Plugins

    Plugins.instance()  # its scan re-executes the plugin modules: patch the class it registers
    source_class = SourcesRegistry.instance().resolve("file")
    _on_yaml_error[0] = fail
    load = source_class.load_config
    if getattr(load, "checked", False):
        return

    def checked(self, config_path: str):
        path = Path(self.path) / self._normalize_file_name(config_path)
        if path.is_file():
            try:
                check_yaml_file(path)
            except ConfigError as err:
                if _on_yaml_error[0] is None:
                    raise
                _on_yaml_error[0](err)
        return load(self, config_path)

    checked.checked = True
    source_class.load_config = checked


def check_output_dir(key: str, value: str) -> None:
    """``hydra.run.dir`` / ``hydra.sweep.dir`` as given on the command line (or, resolved, as
    a job is about to get it: :func:`check_job_dir`): made now (Hydra makes it next, and
    answers a failure with a traceback), and writable. A value with an interpolation is left
    to Hydra."""
    if "${" in value:
        return
    path = Path(value).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{key}={value}: that is a file; expected a directory (made if missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(
            f"{key}={value}: cannot make the directory ({err.strerror}: {err.filename}); "
            f"choose another {key}"
        ) from None
    problem = _cannot_write_in(path)
    if problem is not None:
        raise ConfigError(
            f"{key}={value}: the directory is not writable ({problem}); choose another {key}"
        )


def _cannot_write_in(path: Path) -> str | None:
    """Why no file can be made in ``path`` (None: one can). A file is made and removed: the
    permission bits do not tell (root passes os.access where sysfs or an ACL refuses it)."""
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        return err.strerror or type(err).__name__
    return None


def check_job_dir(config, job_dir_key: str, job_subdir_key: str | None) -> None:
    """The directory Hydra's run_job is about to make and log into, resolved as it resolves
    it: a value set in a config file (-cd), which the command-line pre-flight cannot see.
    With Hydra's file log opened lazily, an unwritable one would otherwise fail later, in
    the run's own first write, with a traceback."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    hydra_config = HydraConfig.instance()
    previous = hydra_config.cfg
    hydra_config.set_config(config)  # ${hydra:...} in the value resolves
    try:
        where = str(OmegaConf.select(config, job_dir_key))
        if job_subdir_key is not None:
            where = os.path.join(where, str(OmegaConf.select(config, job_subdir_key)))
    finally:
        hydra_config.cfg = previous
    check_output_dir(job_dir_key, where)


def check_default_outputs(outputs: Path = Path("outputs")) -> None:
    """Without a hydra.run.dir / sweep.dir, runs go under ./outputs: it must be a directory
    this user can write, or a directory this user can make."""
    where = outputs.absolute()
    if where.exists() and not where.is_dir():
        raise ConfigError(
            f"{where} is a file: runs go under ./outputs/ by default; move it, or give "
            "hydra.run.dir=DIR (hydra.sweep.dir=DIR with -m)"
        )
    writable = where if where.exists() else where.parent
    if not os.access(writable, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{writable} is not writable: runs go under ./outputs/ by default; run from a "
            "writable directory, or give hydra.run.dir=DIR (hydra.sweep.dir=DIR with -m)"
        )


def composition_error(err: Exception) -> str:
    """One line for an error Hydra raised while composing (a missing option, a value of the
    wrong type, an override it could not apply)."""
    from hydra.errors import MissingConfigException

    if isinstance(err, MissingConfigException) and err.missing_cfg_file:
        group, _, option = err.missing_cfg_file.rpartition("/")
        options = ", ".join(err.options or [])
        if group and options:
            return f"{group}={option}: no such option; {group}'s options: {options}"
        return f"no config named {err.missing_cfg_file!r}"
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    cause = err.__cause__
    if cause is not None and str(cause).strip():
        lines.append(str(cause).strip().splitlines()[0])
    return "; ".join(dict.fromkeys(lines[:2] + lines[-1:])) or type(err).__name__
