"""Compute profiles in the data folder: where they are filed, writing one, measuring one a
search needs (the replay simulator's compute input; dPRO §4.1)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from ..data.paths import profiles_dir
from ..simulator import profile_key
from ..spec.cluster import ClusterSpec
from ..spec.model import ModelSpec
from ..spec.errors import SpecError
from ..spec.files import path_under, read_json
from ..spec.profile import ComputeProfile

__all__ = ["profile_path", "save_profile", "ensure_profile", "profiles_for_release", "profiles_in_folders",
           "file_release_profiles"]


def profile_path(model: str, device: str, workers: int) -> Path:
    """Where the profile of ``model`` on ``workers`` concurrent ``device`` workers is filed."""
    # A GPU's name has spaces ("NVIDIA H200"): not in file names, which travel in releases.
    return path_under(profiles_dir(), f"{profile_key(model, device.replace(' ', '_'), workers)}.json")


def save_profile(profile: ComputeProfile) -> Path:
    """File ``profile`` (atomically, replacing an earlier one of the same key); returns its path."""
    from ..spec.files import write_text_atomic

    path = profile_path(profile.model, profile.device, profile.workers)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(profile.to_dict(), indent=1) + "\n")
    return path


def ensure_profile(workload, model: ModelSpec, cluster: ClusterSpec, say: Callable[[str], None], *,
                   node_net: dict | None = None, pin_cpus: bool = False, recompute: bool = False) -> Path | None:
    """The compute profile the replay simulator needs for this domain (dPRO §4.1), measured once
    and filed in the data folder when missing: one short profiling pass with as many concurrent
    workers as the cluster has devices. Where the cluster's nodes are of several device types
    (a lab node's CPU quota), one profile per type, every worker in its node's namespace and
    CPU group (``node_net``), so each type is measured at its own speed under the trial's
    contention. CPU clusters only (their workers run on this machine); for GPU clusters the
    replay falls back on counted FLOPs unless a profile of the GPU type is filed. Returns the
    (first) profile's path, or None. ``recompute``: the profile must also say what checkpointed
    blocks' recomputation costs (``recompute_s``); one filed without it is measured again."""
    from ..engine.local import WorkerFailure, rank_networks
    from ..engine.profile import profile_compute, profile_per_device_type

    if cluster.device_kind != "cpu":
        return None
    types = sorted({n.device_model for n in cluster.nodes})
    paths = [profile_path(model.name, t, cluster.num_devices) for t in types]
    if all(p.is_file() for p in paths) and (not recompute or all(_has_recompute(p) for p in paths)):
        return paths[0]
    say(f"profiling {model.name}'s compute with {cluster.num_devices} concurrent workers"
        + (f", one profile per device type ({', '.join(types)})" if len(types) > 1 else "")
        + " (the replay simulator's input; once per model and worker count)")
    try:
        if len(types) > 1:
            nets = rank_networks(cluster, list(cluster.devices), node_net) if node_net else None
            profiles = profile_per_device_type(workload, cluster, nets=nets, pin_cpus=pin_cpus, recompute=recompute)
        else:
            profiles = [profile_compute(workload, workers=cluster.num_devices, device_type=types[0],
                                        pin_cpus=pin_cpus, recompute=recompute)]
    except WorkerFailure as exc:  # the trials will say what is wrong with the workload; score analytically
        say(f"profiling failed ({str(exc)[:200]}); the replay falls back on counted FLOPs")
        return None
    return [save_profile(p) for p in profiles][0]


def _has_recompute(path: Path) -> bool:
    """Whether the profile filed at ``path`` measured recomputation (``recompute_s``)."""
    try:
        return json.loads(path.read_text()).get("recompute_s") is not None
    except (OSError, ValueError):
        return False


def _release_name(data: dict) -> str:
    """The file name a profile travels under (and is filed by): its (model, device, workers)."""
    return f"{profile_key(data['model'], data['device'].replace(' ', '_'), data['workers'])}.json"


def profiles_for_release(models: set[str]) -> dict[str, dict]:
    """The data folder's compute profiles of ``models`` (file name -> mapping), to publish with
    a dataset release (the replay simulator's measured inputs for its domains). Two files of one
    (model, device, workers) that differ (a profile copied in by hand beside one measured here)
    are refused naming both."""
    folder = profiles_dir()
    out: dict[str, dict] = {}
    origin: dict[str, Path] = {}
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        raw = read_json(path, "compute profile")
        try:
            data = ComputeProfile.from_dict(raw, where=str(path)).to_dict()
        except (ValueError, TypeError, AttributeError):
            raise SpecError(f"{path}: not a compute profile; remove it or measure it again (synctune sim profile)") \
                from None
        if data.get("model") in models:
            name = _release_name(data)
            if name in out and out[name] != data:
                raise SpecError(f"{path}: a different profile of {data['model']} on {data['workers']} "
                                f"{data['device']} worker(s) than {origin[name]}; keep one")
            out[name], origin[name] = data, path
    return out


def profiles_in_folders(folders, into: dict[str, dict] | None = None) -> dict[str, dict]:
    """Every compute profile in each of ``folders`` (``*.json``), whatever its model, added to
    ``into`` (the data folder's, from :func:`profiles_for_release`) under the name the data folder
    files it by: profiles of a device measured apart from the trials (a GPU's,
    ``experiments/findings/gpu_profiles.py``) that a release should carry. A file that is not a
    profile is refused naming it; a second profile of one (model, device, workers) that differs from
    the first, naming both."""
    out = dict(into or {})
    origin: dict[str, str] = {}
    for folder in map(Path, folders):
        if not folder.is_dir():
            raise SpecError(f"profiles folder {folder}: not a folder")
        paths = sorted(folder.glob("*.json"))
        if not paths:
            raise SpecError(f"profiles folder {folder}: no compute profile (*.json) in it")
        for path in paths:
            raw = read_json(path, "compute profile")
            try:
                data = ComputeProfile.from_dict(raw, where=str(path)).to_dict()
            except (ValueError, TypeError, AttributeError) as exc:
                raise SpecError(f"{path}: not a compute profile ({str(exc).splitlines()[0][:200]})") from None
            name = _release_name(data)
            if name in out and out[name] != data:
                raise SpecError(f"{path}: a different profile of {data['model']} on {data['workers']} "
                                f"{data['device']} worker(s) than {origin.get(name, 'the data folder')}'s; keep one")
            out[name] = data
            origin[name] = str(path)
    return out


def file_release_profiles(profiles: dict[str, dict], where: str) -> list[str]:
    """File a pulled release's compute profiles in the data folder, each checked, none
    replacing a profile measured here; returns the names filed."""
    filed = []
    for name, data in profiles.items():
        profile = ComputeProfile.from_dict(data, where=f"{where}: profiles/{name}")
        if not profile_path(profile.model, profile.device, profile.workers).is_file():
            save_profile(profile)
            filed.append(name)
    return filed
