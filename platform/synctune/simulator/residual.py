"""A learned correction on top of the calibrated replay: the physics first, then what it misses.

AutoSync's learned rankers (§3.1) start from raw and predefined features and must learn the
physics too; dPRO's replay (§4.3) has the physics but no way to learn the costs it leaves out.
This model keeps the calibrated replay's prediction and learns only a multiplicative residual,

    predicted = replay_calibrated(s) * exp(clip(w . x(s)))

where ``x(s)`` are scale-free features of the replay's own timeline (the shares of the
iteration spent in backward, in communication after it and in PS broadcasts, units per kind per
second, MB compressed per second), of the strategy (units, partitions, the bytes on PS and on
shard units) and of the model (its share of sparse bytes, its number of variables). ``w`` is ridge regression
on ``log(measured / replayed)``, each domain weighing alike. Its penalty is chosen by
cross-validation over groups of training domains, and the choices include an infinite penalty
(no correction): where the correction does not improve held-out domains' error, the model
*is* the calibrated replay, so on domains like those it trained on it does no worse than the
physics by construction of the choice (the remaining risk is only that the cross-validation
folds are not like the test domains).

Two corrections are learned: one for domains the replay was calibrated on (the residual of the
domain's own constants; a held-out strategy of a measured domain) and one for domains never
measured (the residual under constants calibrated without that domain's group: an unseen model
or cluster), and each prediction uses the one that matches how its domain is replayed. A
feature outside the range the correction was fitted on is taken at the range's edge: the linear
fit is not extrapolated beyond what it saw.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..spec.errors import SpecError
from ..spec.files import read_json
from ..spec.profile import ComputeProfile
from ..strategy.columns import StrategyColumns
from .features import KIND_AG, KIND_AR, KIND_PS, KIND_SHARD, DomainContext
from .replay import CalibratedReplay, ReplayConstants, constants_from_file

__all__ = ["ResidualReplay", "RESIDUAL_FEATURES"]

#: The correction's inputs, in order (every one scale-free: shares, rates, logs of counts).
RESIDUAL_FEATURES = ("comm_after_backward_share", "backward_share", "broadcast_share", "ps_units_per_s", "ar_units_per_s", "ag_units_per_s", "shard_units_per_s",
                     "mb_compressed_per_s", "log_units", "log_partitions", "ps_share", "shard_share",
                     "sparse_share", "log_variables", "bias")
#: Ridge penalties tried (per unit of domain weight); inf: no correction.
PENALTIES = (0.01, 0.1, 1.0, 10.0, 100.0, np.inf)
#: How much smaller a penalty's held-out error must be to be chosen over a stronger one.
MARGIN = 0.05
#: The largest correction, a factor of e**0.7 ~ 2 either way: the replay stays the anchor.
MAX_CORRECTION = 0.7


def residual_features(sim: CalibratedReplay, b: StrategyColumns, ctx: DomainContext) -> tuple[np.ndarray, np.ndarray]:
    """(replayed seconds (n,), features (n, len(RESIDUAL_FEATURES))) of ``b`` under ``sim``."""
    ev = sim.timeline(b, ctx)
    n = b.size
    it = np.maximum(ev["iteration_s"], 1e-9)
    usid, ukind = ev["unit_sid"], ev["unit_kind"]
    units = {k: np.bincount(usid, weights=(ukind == k).astype(float), minlength=n)
             for k in (KIND_PS, KIND_AR, KIND_AG, KIND_SHARD)}
    exposed = np.maximum(ev["comm_end"] - ev["backward_end"], 0.0)
    mb = np.bincount(b.sid, weights=np.where(b.comp > 0, ctx.var_bytes[b.var] * b.frac, 0.0), minlength=n) / 1e6
    rows = np.bincount(b.sid, minlength=n).astype(float)
    bytes_of = ctx.var_bytes[b.var] * b.frac
    total = np.maximum(np.bincount(b.sid, weights=bytes_of, minlength=n), 1.0)
    ps = np.bincount(b.sid, weights=np.where(b.kind == KIND_PS, bytes_of, 0.0), minlength=n) / total
    shard = np.bincount(b.sid, weights=np.where(b.kind == KIND_SHARD, bytes_of, 0.0), minlength=n) / total
    x = np.stack([exposed / it, ev["backward_end"] / it, ev["broadcast_s"] / it, units[KIND_PS] / it / 1e3, units[KIND_AR] / it / 1e3, units[KIND_AG] / it / 1e3,
                  units[KIND_SHARD] / it / 1e3, mb / it / 1e3, np.log1p(sum(units.values())),
                  np.log(rows / max(1, len(ctx.model.variables))), ps, shard,
                  np.full(n, float(ctx.var_bytes[ctx.var_sparse].sum()) / max(ctx.model_bytes, 1.0)),
                  np.full(n, np.log(len(ctx.model.variables))), np.ones(n)], axis=1)
    return it, x


def _ridge(x: np.ndarray, y: np.ndarray, weight: np.ndarray, penalty: float) -> np.ndarray:
    if not np.isfinite(penalty):
        return np.zeros(x.shape[1])
    xw = x * weight[:, None]
    return np.linalg.solve(x.T @ xw + penalty * np.eye(x.shape[1]), xw.T @ y)


class _Correction:
    """Standardised ridge with its penalty chosen by grouped cross-validation (median absolute
    log error over the held-out groups' rows, each group's rows weighing alike)."""

    def __init__(self) -> None:
        self.mean = np.zeros(len(RESIDUAL_FEATURES))
        self.std = np.ones(len(RESIDUAL_FEATURES))
        self.w = np.zeros(len(RESIDUAL_FEATURES))
        self.penalty = np.inf
        self.cv: dict[str, float] = {}
        # The training rows' range of every feature: a domain outside it gets the correction at
        # the range's edge, not an extrapolation of a linear fit beyond what it saw.
        self.low = np.full(len(RESIDUAL_FEATURES), -np.inf)
        self.high = np.full(len(RESIDUAL_FEATURES), np.inf)

    def fit(self, x: np.ndarray, y: np.ndarray, group: np.ndarray, weight: np.ndarray) -> "_Correction":
        self.mean, self.std = x.mean(0), x.std(0) + 1e-9
        self.mean[-1], self.std[-1] = 0.0, 1.0  # the bias column stays a column of ones
        self.low, self.high = x.min(0), x.max(0)
        z = (x - self.mean) / self.std
        groups = np.unique(group)
        scores = {}
        for penalty in PENALTIES:
            errs = []
            for g in groups if len(groups) > 1 else []:
                train, test = group != g, group == g
                w = _ridge(z[train], y[train], weight[train], penalty)
                errs.append(np.median(np.abs(y[test] - np.clip(z[test] @ w, -MAX_CORRECTION, MAX_CORRECTION))))
            scores[penalty] = float(np.mean(errs)) if errs else np.inf
        # The strongest penalty whose held-out error is within MARGIN of the smallest (the
        # one-standard-error rule's spirit: a gain inside the folds' noise is no gain); no
        # groups to judge by: no correction.
        low = min(scores.values())
        best = max((p for p in PENALTIES if scores[p] <= low * (1 + MARGIN)), default=np.inf)
        if not np.isfinite(low):
            best = np.inf
        self.penalty, self.cv = best, {str(k): v for k, v in scores.items()}
        self.w = _ridge(z, y, weight, best)
        return self

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = np.clip(x, self.low, self.high)
        return np.clip(((x - self.mean) / self.std) @ self.w, -MAX_CORRECTION, MAX_CORRECTION)

    def to_dict(self) -> dict:
        return {"mean": self.mean.tolist(), "std": self.std.tolist(), "w": self.w.tolist(),
                "low": self.low.tolist(), "high": self.high.tolist(),
                "penalty": None if not np.isfinite(self.penalty) else self.penalty, "cv": self.cv}

    @classmethod
    def from_dict(cls, data: dict) -> "_Correction":
        c = cls()
        c.mean, c.std, c.w = (np.asarray(data[k], float) for k in ("mean", "std", "w"))
        if c.w.shape != (len(RESIDUAL_FEATURES),):
            raise SpecError(f"replay-residual file: expected {len(RESIDUAL_FEATURES)} weights, got {c.w.shape}")
        if "low" in data:  # files saved before the range was kept extrapolate as they did
            c.low, c.high = np.asarray(data["low"], float), np.asarray(data["high"], float)
        c.penalty = np.inf if data.get("penalty") is None else float(data["penalty"])
        c.cv = dict(data.get("cv") or {})
        return c


class ResidualReplay(CalibratedReplay):
    """The calibrated replay times a learned correction (the module docstring). Seconds, like
    the replay: usable wherever a simulator predicts seconds, and its timeline, critical path
    and calibration on a search's own trials are the replay's."""

    kind = "replay-residual"

    def __init__(self, profiles: dict[str, ComputeProfile] | None = None,
                 constants: ReplayConstants = ReplayConstants(), *, min_trials: int = 10, groups: int = 5,
                 seed: int = 0) -> None:
        super().__init__(profiles, constants, min_trials=min_trials)
        self.groups, self.seed = groups, seed
        self._uncalibrated = constants  # what the held-out calibrations start from
        self.seen = _Correction()
        self.unseen = _Correction()

    def fit(self, domains: list) -> "ResidualReplay":
        """Calibrate the replay (:meth:`CalibratedReplay.fit`), then learn both corrections."""
        super().fit(domains)
        if not domains:
            return self
        weight_of = {d.key: 1.0 / max(1, len(d.times_s)) for d in domains}
        # Seen domains: each domain's residual under its own constants; cross-validated over
        # random groups of strategies (the test strategies of a seen domain are new strategies).
        rng = np.random.default_rng(self.seed)
        xs, ys, gs, ws = [], [], [], []
        for d in domains:
            pred, x = residual_features(self, d.encoded(), d.ctx)
            xs.append(x)
            ys.append(np.log(np.asarray(d.times_s, float) / pred))
            gs.append(rng.integers(0, self.groups, len(pred)))
            ws.append(np.full(len(pred), weight_of[d.key]))
        self.seen.fit(np.concatenate(xs), np.concatenate(ys), np.concatenate(gs), np.concatenate(ws))
        # Unseen domains: constants calibrated without the domain's group, as an unseen domain is
        # replayed (with its cluster's or the general constants of domains that are not it).
        order = rng.permutation(len(domains))
        group_of = {domains[i].key: j % self.groups for j, i in enumerate(order)}
        xs, ys, gs, ws = [], [], [], []
        held = CalibratedReplay(self.profiles, self._uncalibrated)
        for g in sorted(set(group_of.values())):
            others = [d for d in domains if group_of[d.key] != g]
            if not others:
                continue
            held.fit_unseen(others, self._uncalibrated)  # from the uncalibrated constants, as fit's
            for d in (d for d in domains if group_of[d.key] == g):
                pred, x = residual_features(held, d.encoded(), d.ctx)
                xs.append(x)
                ys.append(np.log(np.asarray(d.times_s, float) / pred))
                gs.append(np.full(len(pred), g))
                ws.append(np.full(len(pred), weight_of[d.key]))
        if xs:
            self.unseen.fit(np.concatenate(xs), np.concatenate(ys), np.concatenate(gs), np.concatenate(ws))
        return self

    def use_profiles(self, replay) -> None:
        super().use_profiles(replay)
        self._uncalibrated = replay.constants

    def _predict_batch(self, batch: StrategyColumns, ctx: DomainContext) -> np.ndarray:
        pred, x = residual_features(self, batch, ctx)
        seen = f"{ctx.model.name}@{ctx.cluster.name}" in self.per_domain
        return pred * np.exp((self.seen if seen else self.unseen)(x))

    def save(self, path: str | Path) -> None:
        from ..spec.files import write_text_atomic

        write_text_atomic(Path(path), json.dumps({
            "format": "synctune-replay-residual", "version": 1, "profiles": [p.to_dict() for p in self.profiles.values()],
            "general": self.general.__dict__, "per_domain": {k: c.__dict__ for k, c in self.per_domain.items()},
            "per_cluster": {k: c.__dict__ for k, c in self.per_cluster.items()},
            "min_trials": self.min_trials, "features": list(RESIDUAL_FEATURES),
            "seen": self.seen.to_dict(), "unseen": self.unseen.to_dict()}, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "ResidualReplay":
        data = read_json(Path(path), "replay-residual simulator")
        if data.get("format") != "synctune-replay-residual" or data.get("version") != 1:
            raise SpecError(f"{path}: not a replay-residual simulator file (format synctune-replay-residual, version 1)")
        if data.get("features") != list(RESIDUAL_FEATURES):
            raise SpecError(f"{path}: written with other features ({data.get('features')}); retrain it")
        sim = cls(min_trials=int(data.get("min_trials", 10)))
        for p in data.get("profiles", []):
            sim.add_profile(ComputeProfile.from_dict(p, where=str(path)))
        sim.general = constants_from_file(data["general"])
        sim.per_domain = {k: constants_from_file(v) for k, v in data.get("per_domain", {}).items()}
        # A file from before per-cluster constants replays unseen models with the general ones.
        sim.per_cluster = {k: constants_from_file(v) for k, v in data.get("per_cluster", {}).items()}
        sim.set_constants(sim.general)
        sim.seen, sim.unseen = _Correction.from_dict(data["seen"]), _Correction.from_dict(data["unseen"])
        return sim
