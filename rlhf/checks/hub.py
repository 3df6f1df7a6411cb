"""Hub ids (models, datasets) a step loads, checked for whether they can load here: in the local
cache, or the hub answers that they exist. Nothing is downloaded; an unreachable hub is probed
once per process."""

from __future__ import annotations

from pathlib import Path

from rlhf.checks.model_dirs import frozen_paths, trained_models
from rlhf.config import Config
from rlhf.data.sources import ADAPTERS, GENERATED, reads_local
from rlhf.runtime.paths import looks_local

_HUB = {"reachable": None}  # one probe per process: an unreachable hub is not asked again


def _hub_ids(config: Config) -> list[tuple[str, str, str]]:
    """(key, hub id, "model" | "dataset") of what the step loads from the hub."""
    pairs = []
    for prefix, model, _ in trained_models(config):
        pairs += [
            (f"{prefix}model.path", model.path),
            (f"{prefix}model.tokenizer", model.tokenizer),
        ]
    if config.step.name == "reward":
        pairs.append(("reward.gold_policy", config.reward.gold_policy))
    if config.step.name == "ppo":
        pairs += frozen_paths(config)
    out = [(key, value, "model") for key, value in pairs if value and not looks_local(value)]
    for name, source in config.data.sources.items():
        if (
            source.adapter in ADAPTERS
            and source.adapter not in GENERATED
            and not reads_local(source)
        ):
            hub_id = source.path or ADAPTERS[source.adapter].hub_id
            out.append((f"data.sources.{name}.path", hub_id, "dataset"))
    return out


def _hub_cached(repo_id: str, kind: str) -> bool:
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.file_download import repo_folder_name

    if kind == "model":
        try:
            found = [
                try_to_load_from_cache(repo_id, f) for f in ("config.json", "tokenizer_config.json")
            ]
        except ValueError:
            return False
        return any(isinstance(f, str) for f in found)
    import datasets.config

    hub_copy = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="dataset")
    prepared = Path(datasets.config.HF_DATASETS_CACHE) / repo_id.replace("/", "___")
    return hub_copy.is_dir() or prepared.is_dir()


def _hub_answer(repo_id: str, kind: str) -> str:
    """'ok', 'missing', 'invalid' or 'unreachable' for a hub id that is not cached here."""
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, RepositoryNotFoundError

    if huggingface_hub.is_offline_mode() or _HUB["reachable"] is False:
        return "unreachable"
    info = huggingface_hub.model_info if kind == "model" else huggingface_hub.dataset_info
    try:
        info(repo_id, timeout=5)
    except RepositoryNotFoundError:
        return "missing"
    except HFValidationError:
        return "invalid"
    except HfHubHTTPError:
        return "ok"  # gated, rate-limited ...: loading says more
    except Exception:  # any network failure: connection, DNS, timeout, proxy
        _HUB["reachable"] = False
        return "unreachable"
    _HUB["reachable"] = True
    return "ok"


def hub_problems(config: Config) -> list[str]:
    """Hub ids that cannot load here: offline and not cached, unknown, or not ids at all (a
    relative path that does not exist looks like an id: "mysft/model")."""
    why = {
        "unreachable": "not a local directory, and the hub is not reachable (offline)",
        "missing": "not a local directory, and no {kind} of that name on the hub (a private one "
        "needs HF_TOKEN)",
        "invalid": "not a local directory, nor a hub id (owner/name)",
    }
    out = []
    for key, repo_id, kind in _hub_ids(config):
        if _hub_cached(repo_id, kind):
            continue
        answer = _hub_answer(repo_id, kind)
        if answer != "ok":
            out.append(f"{key}={repo_id!r}: {why[answer].format(kind=kind)}")
    return out
