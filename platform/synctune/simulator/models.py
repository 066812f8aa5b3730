"""Simulators behind one interface (AutoSync §3.1, AutoDist §2.4): ``fit(records)``,
``predict`` (runtime-like, lower is faster), ``score`` (higher is better), ``save``/``load``.

- ``analytic``: the training-free estimate T = max(T_comp, T_sync), seconds;
- ``linear``: a linear ranker over the global predefined features;
- ``rnn``: per-shard MLP over raw + predefined features, a bidirectional LSTM in backward
  order, and an MLP head (with the global features);
- ``gat``: graph attention over the shards (edges: backward-order neighbours, same merge
  group, same PS server), pooled, and an MLP head.

Learned models train with the pairwise logistic ranking loss of AutoSync Eq. 3, including the
partition penalty sigma. Pairs are only formed within a domain: iteration times of different
(model, cluster) pairs are not comparable. Saved files hold tensors and a JSON config only
and load with ``torch.load(weights_only=True)``: loading never executes code from the file.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np

from ..spec.errors import SpecError
from ..spec.profile import ComputeProfile
from ..spec.files import check_regular, write_via
from ..strategy.compressors import compressor_vocabulary
from ..strategy.columns import StrategyColumns
from ..strategy.schema import SYNCHRONIZER_KINDS
from .base import AnalyticSimulator, Domain, Simulator, domains_from_records
from .features import GLOBAL_NAMES, PRE_NAMES, RAW_NAMES, DomainContext, kind_blocks, kind_inputs, per_shard_inputs

__all__ = ["Domain", "domains_from_records", "Simulator", "AnalyticSimulator", "LinearSimulator",
           "RNNSimulator", "GATSimulator", "SIMULATORS", "make_simulator", "load_simulator", "FORMAT"]

FORMAT = "synctune-simulator"
#: 2: group_order counts merge groups; the compressor vocabulary is recorded. 3: the replay's
#: features (and the compute profiles it replayed) are inputs. 4: the ``shard`` kind's features
#: are appended after version 3's inputs, and the synchronizer vocabulary is recorded. A version-3
#: file still loads: it reads the inputs it was trained on (the same positions and values) and
#: refuses strategies with shard plans, which it never saw.
FORMAT_VERSION = 4
#: The versions :func:`load_simulator` reads.
_READS = (3, 4)
#: Widest hidden layer a simulator file may ask for (the shipped ones use 32).
MAX_HIDDEN = 1024
#: Most bytes a simulator file may hold once unpacked (torch's archives may be compressed: a
#: few KB can declare gigabytes of tensors); the shipped one holds a few hundred KB.
MAX_SIMULATOR_BYTES = 512 * 1024**2


def _check_archive(path: Path) -> None:
    """Refuse a simulator file that is not one of torch's zip archives, or whose members unpack
    to more than :data:`MAX_SIMULATOR_BYTES`, before ``torch.load`` allocates anything."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            declared = sum(info.file_size for info in archive.infolist())
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        raise SpecError(f"{path}: not a readable synctune simulator file (not a torch archive)") from None
    if declared > MAX_SIMULATOR_BYTES:
        raise SpecError(f"{path}: unpacks to {declared} bytes; a simulator file holds at most {MAX_SIMULATOR_BYTES}")
#: The synchronizer kinds of version 3 (before ``shard``).
_KINDS_V3 = ["ps", "allreduce", "allgather", "sfb"]


def _widths(kinds: list[str]) -> tuple[int, int]:
    """(per-shard, per-strategy) input widths of a learned simulator trained with the synchronizer
    kinds ``kinds``: the features every simulator reads, then those of the kinds among them with
    features of their own (:func:`~synctune.simulator.features.kind_blocks`)."""
    from .replay import REPLAY_GLOBAL_NAMES, REPLAY_SHARD_NAMES

    raw = len(RAW_NAMES) + len(PRE_NAMES) + len(REPLAY_SHARD_NAMES)
    glob = len(GLOBAL_NAMES) + len(REPLAY_GLOBAL_NAMES)
    blocks = [block for _name, block in kind_blocks(kinds)]
    return raw + sum(len(b.raw_names) for b in blocks), glob + sum(len(b.global_names) for b in blocks)


# ------------------------------------------------------------------------------- learned rankers


def _torch():
    import torch

    return torch


def ranking_loss(pred, times_s, partitions, sigma: float):
    """AutoSync Eq. 3: sum over pairs with f_i + sigma*I1(P_i, P_j) > f_j of log(1 + exp(f^_j - f^_i)),
    averaged over those pairs (f: mean iteration times; f^: predictions; P: partition counts)."""
    torch = _torch()
    f = times_s
    penalty = sigma * torch.sign(partitions[:, None] - partitions[None, :])
    target = (f[:, None] + penalty) > f[None, :]
    diff = pred[None, :] - pred[:, None]  # f^_j - f^_i at [i, j]
    losses = torch.nn.functional.softplus(diff)[target]
    return losses.mean() if losses.numel() else pred.sum() * 0.0


class _Learned(Simulator):
    learned = True
    hidden = 32

    def __init__(self, *, epochs: int = 150, lr: float = 3e-3, batch: int = 48, partition_penalty: float = 0.01,
                 seed: int = 0, hidden: int | None = None) -> None:
        from .replay import ReplaySimulator

        raw, glob = _widths(list(SYNCHRONIZER_KINDS))
        self.config = {"epochs": epochs, "lr": lr, "batch": batch, "partition_penalty": partition_penalty,
                       "seed": seed, "hidden": hidden or self.hidden, "raw": raw, "global": glob,
                       "compressors": compressor_vocabulary(), "synchronizers": list(SYNCHRONIZER_KINDS)}
        self.net = None
        self.norm: dict[str, Any] = {}
        #: The physics under the learned correction: its replay of each strategy is an input.
        self.replay = ReplaySimulator()

    def use_profiles(self, replay) -> None:
        """Replay with the measured compute profiles of ``replay`` (a ReplaySimulator) too, and
        with its constants."""
        for profile in replay.profiles.values():
            self.replay.add_profile(profile)
        self.replay.set_constants(replay.constants)

    def _features(self, batch: StrategyColumns, ctx: DomainContext) -> tuple[np.ndarray, np.ndarray]:
        """AutoSync's inputs with the replay's prediction and per-unit timeline beside them."""
        from .replay import replay_features

        kinds = self.config.get("synchronizers", _KINDS_V3)
        for code, name in enumerate(SYNCHRONIZER_KINDS):
            if name not in kinds and batch.pattern_mask(code).any():
                raise SpecError(f"this {self.kind} simulator was trained before the {name} synchronizer existed (it "
                                f"knows {', '.join(kinds)}): it cannot score strategies with {name} plans; retrain it "
                                f"(synctune sim train) or score them with the analytic or replay simulator")
        x, g = per_shard_inputs(batch, ctx)
        rx, rg = replay_features(self.replay.timeline(batch, ctx), batch)
        # The features of kinds with features of their own come last: a simulator trained before
        # such a kind existed reads the inputs it was trained on.
        kx, kg = kind_inputs(batch, ctx, kinds)
        return np.concatenate([x, rx, *kx], axis=1), np.concatenate([g, rg, *kg], axis=1)

    # subclasses: _build() -> nn.Module; _forward(net, x, g, offsets, batch) -> (n,)
    def _inputs(self, batch: StrategyColumns, ctx: DomainContext):
        torch = _torch()
        x, g = self._features(batch, ctx)
        x = (torch.as_tensor(x, dtype=torch.float32) - self.norm["x_mean"]) / self.norm["x_std"]
        g = (torch.as_tensor(g, dtype=torch.float32) - self.norm["g_mean"]) / self.norm["g_std"]
        return x, g

    def fit(self, domains: list[Domain], *, log=None, **_: Any) -> "_Learned":
        """Train from scratch on ``domains``: normalisation from their features, new weights."""
        torch = _torch()
        if not domains:
            raise SpecError("no training data: the records hold no successful trials")
        torch.manual_seed(self.config["seed"])
        xs, gs = [], []
        self.config["profiles"] = [p.to_dict() for p in self.replay.profiles.values()]
        self.config["replay_constants"] = dict(self.replay.constants.__dict__)
        for d in domains:
            x, g = self._features(d.encoded(), d.ctx)
            xs.append(x)
            gs.append(g)
        x_all, g_all = np.concatenate(xs), np.concatenate(gs)
        self.norm = {"x_mean": torch.as_tensor(x_all.mean(0), dtype=torch.float32),
                     "x_std": torch.as_tensor(x_all.std(0) + 1e-6, dtype=torch.float32),
                     "g_mean": torch.as_tensor(g_all.mean(0), dtype=torch.float32),
                     "g_std": torch.as_tensor(g_all.std(0) + 1e-6, dtype=torch.float32)}
        self.net = self._build()
        return self._train(domains, self.config["epochs"], self.config["lr"], log)

    def fine_tune(self, domains: list[Domain], *, epochs: int | None = None, log=None) -> "_Learned":
        """Go on training the current weights (and normalisation) on ``domains``: how a
        simulator learned elsewhere adapts to a new domain (AutoSync §3.3)."""
        if self.net is None:
            return self.fit(domains, log=log)
        if not domains:
            return self
        _torch().manual_seed(self.config["seed"] + 1)
        return self._train(domains, epochs or max(1, self.config["epochs"] // 5), self.config["lr"] / 3, log)

    def _train(self, domains: list[Domain], epochs: int, lr: float, log) -> "_Learned":
        torch = _torch()
        rng = random.Random(self.config["seed"])
        opt = torch.optim.Adam(self.net.parameters(), lr=lr, weight_decay=1e-5)
        prepared = []
        for d in domains:
            f = torch.as_tensor(d.times_s, dtype=torch.float32)
            sigma = self.config["partition_penalty"] * float(np.median(d.times_s))
            prepared.append((d, f, torch.as_tensor(d.partitions(), dtype=torch.float32), sigma))
        self.net.train()
        for epoch in range(epochs):
            total = 0.0
            for d, f, parts, sigma in rng.sample(prepared, len(prepared)):
                idx = list(range(len(d.strategies)))
                rng.shuffle(idx)
                for start in range(0, len(idx), self.config["batch"]):
                    chosen = idx[start:start + self.config["batch"]]
                    if len(chosen) < 2:
                        continue
                    sub = d.subset(chosen)
                    pred = self._forward_batch(sub.encoded(), sub.ctx)
                    loss = ranking_loss(pred, f[chosen], parts[chosen], sigma)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    total += float(loss.detach())
            if log and (epoch + 1) % max(1, epochs // 10) == 0:
                log(epoch + 1, total)
        self.net.eval()
        return self

    def _forward_batch(self, batch: StrategyColumns, ctx: DomainContext):
        x, g = self._inputs(batch, ctx)
        return self._forward(x, g, batch, ctx)

    def _predict_batch(self, batch, ctx):
        torch = _torch()
        if self.net is None:
            raise SpecError(f"the {self.kind} simulator is not trained")
        with torch.no_grad():
            return self._forward_batch(batch, ctx).numpy().astype(np.float64)

    def save(self, path: str | Path) -> None:
        """Write tensors + JSON config (loadable with weights_only=True)."""
        torch = _torch()
        if self.net is None:
            raise SpecError(f"the {self.kind} simulator is not trained")
        # One trained before shard (loaded from a version-3 file, perhaps fine-tuned since) stays version 3.
        version = FORMAT_VERSION if self.config.get("synchronizers") == list(SYNCHRONIZER_KINDS) else 3
        config = {k: v for k, v in self.config.items() if version >= 4 or k != "synchronizers"}
        payload = {"format": FORMAT, "version": version, "kind": self.kind, "config": json.dumps(config),
                   "state": self.net.state_dict(), "norm": dict(self.norm)}
        write_via(path, lambda fh: torch.save(payload, fh))

    def _restore(self, state: dict, norm: dict) -> None:
        """Rebuild the network of a saved simulator from its state, once the sizes its config
        asks for are known to be the state's: a file of a few KB whose config says ``hidden:
        3000`` would otherwise allocate gigabytes before the state was compared with it. The
        network is built first on the ``meta`` device (no memory) and compared there."""
        torch = _torch()
        hidden = self.config.get("hidden")
        if not (isinstance(hidden, int) and not isinstance(hidden, bool) and 1 <= hidden <= MAX_HIDDEN):
            raise ValueError(f"config hidden: expected an integer from 1 to {MAX_HIDDEN}, got {str(hidden)[:20]!r}")
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise ValueError("state: expected a mapping of tensors")
        with torch.device("meta"):
            expected = {k: tuple(v.shape) for k, v in self._build().state_dict().items()}
        found = {k: tuple(v.shape) for k, v in state.items()}
        if expected != found:
            wrong = sorted(set(expected) ^ set(found)) or [k for k in expected if expected[k] != found[k]]
            raise ValueError(f"its state does not match its config (hidden {hidden}): {wrong[0]} is "
                             f"{found.get(wrong[0], 'missing')}, the config makes it {expected.get(wrong[0], 'absent')}")
        self.norm = norm
        self.net = self._build()
        self.net.load_state_dict(state)
        self.net.eval()


def _padded(x, offsets: np.ndarray):
    """(S, F) -> (n, L, F) zero-padded, and a (n, L) validity mask."""
    torch = _torch()
    lengths = torch.as_tensor(np.diff(offsets))
    n, longest = len(lengths), int(lengths.max())
    pos = torch.arange(x.shape[0]) - torch.as_tensor(np.repeat(offsets[:-1], np.diff(offsets)))
    row = torch.as_tensor(np.repeat(np.arange(n), np.diff(offsets)))
    out = x.new_zeros(n, longest, x.shape[1])
    out[row, pos] = x
    mask = torch.arange(longest)[None, :] < lengths[:, None]
    return out, mask, lengths


def _pool(h, mask=None):
    """Mean and max over the sequence axis of (n, L, d), ignoring padded positions: (n, 2d)."""
    torch = _torch()
    if mask is None:
        return torch.cat([h.mean(1), h.max(1).values], dim=1)
    m = mask[..., None].float()
    mean = (h * m).sum(1) / m.sum(1)
    return torch.cat([mean, h.masked_fill(~mask[..., None], -1e9).max(1).values], dim=1)


class LinearSimulator(_Learned):
    """f^ = z_pre . theta over the global predefined features."""

    kind = "linear"

    def _build(self):
        return _torch().nn.Linear(self.config["global"], 1)

    def _forward(self, x, g, batch, ctx):
        return self.net(g).squeeze(-1)


class RNNSimulator(_Learned):
    """Per-shard MLP; shard features averaged into one feature per model variable; a bidirectional
    LSTM over the variables in backward order; an MLP head with the global features (AutoSync
    §3.1.2: "aggregated into |V| features corresponding to the variables ... a bidirectional
    LSTM scans them following the forward-backward propagation order")."""

    kind = "rnn"

    def _build(self):
        torch = _torch()
        nn = torch.nn
        raw, glob, hidden = self.config["raw"], self.config["global"], self.config["hidden"]

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.encode = nn.Sequential(nn.Linear(raw, hidden * 2), nn.ReLU(), nn.Linear(hidden * 2, hidden * 2))
                self.lstm = nn.LSTM(hidden * 2, hidden, batch_first=True, bidirectional=True)
                self.head = nn.Sequential(nn.Linear(hidden * 4 + glob, hidden * 2), nn.ReLU(), nn.Linear(hidden * 2, 1))

        return Net()

    def _forward(self, x, g, batch, ctx):
        torch = _torch()
        net = self.net
        h = net.encode(x)
        n, v = batch.size, ctx.num_vars
        key = torch.as_tensor(batch.sid * v + batch.var)
        sums = h.new_zeros(n * v, h.shape[1]).index_add_(0, key, h)
        counts = torch.bincount(key, minlength=n * v).clamp(min=1).to(h.dtype)
        seq = (sums / counts[:, None]).view(n, v, -1)  # every strategy of a domain has all v variables
        out, _ = net.lstm(seq)
        return net.head(torch.cat([_pool(out), g], dim=1)).squeeze(-1)


class GATSimulator(_Learned):
    """Graph attention over the shards of a strategy (AutoSync §3.1.2, Velickovic et al. 2018)."""

    kind = "gat"

    def _build(self):
        torch = _torch()
        nn = torch.nn
        raw, glob, hidden = self.config["raw"], self.config["global"], self.config["hidden"]

        class Layer(nn.Module):
            def __init__(self, d_in, d_out, heads=2):
                super().__init__()
                self.heads, self.d_out = heads, d_out
                self.proj = nn.Linear(d_in, d_out * heads, bias=False)
                self.a_src = nn.Parameter(torch.randn(heads, d_out) * 0.1)
                self.a_dst = nn.Parameter(torch.randn(heads, d_out) * 0.1)

            def forward(self, h, adj):  # h (n, L, d_in), adj (n, L, L)
                n, L, _ = h.shape
                z = self.proj(h).view(n, L, self.heads, self.d_out)
                e = (z * self.a_src).sum(-1)[:, :, None, :] + (z * self.a_dst).sum(-1)[:, None, :, :]
                e = nn.functional.leaky_relu(e, 0.2).masked_fill(~adj[..., None], -1e9)
                att = torch.softmax(e, dim=2)
                return torch.einsum("nijh,njhd->nihd", att, z).reshape(n, L, self.heads * self.d_out)

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.encode = nn.Linear(raw, hidden * 2)
                self.g1 = Layer(hidden * 2, hidden)
                self.g2 = Layer(hidden * 2, hidden)
                self.head = nn.Sequential(nn.Linear(hidden * 4 + glob, hidden * 2), nn.ReLU(), nn.Linear(hidden * 2, 1))

        return Net()

    def _forward(self, x, g, batch, ctx):
        torch = _torch()
        net = self.net
        h, mask, _ = _padded(net.encode(x), batch.offsets)
        adj = self._adjacency(batch, h.shape[1]) & mask[:, None, :] & mask[:, :, None]
        h = torch.relu(net.g1(h, adj))
        h = torch.relu(net.g2(h, adj)) + h
        return net.head(torch.cat([_pool(h, mask), g], dim=1)).squeeze(-1)

    @staticmethod
    def _adjacency(batch: StrategyColumns, longest: int):
        torch = _torch()
        n = batch.size
        node_key = np.full((n, longest), -2, dtype=np.int64)
        group_key = np.full((n, longest), -2, dtype=np.int64)
        lengths = np.diff(batch.offsets)
        row = np.repeat(np.arange(n), lengths)
        pos = np.arange(len(batch.sid)) - np.repeat(batch.offsets[:-1], lengths)
        # Shards sent to one server node (the column ``node`` holds it, -1 off the kinds with a server).
        node_key[row, pos] = np.where(batch.node >= 0, batch.node.astype(np.int64), -1 - 10**6)
        group_key[row, pos] = np.where(batch.group_order >= 0, batch.group_order, -1 - 10**6)
        nk, gk = torch.as_tensor(node_key), torch.as_tensor(group_key)
        idx = torch.arange(longest)
        chain = (idx[:, None] - idx[None, :]).abs() <= 1
        same_node = (nk[:, :, None] == nk[:, None, :]) & (nk[:, :, None] >= 0)
        same_group = (gk[:, :, None] == gk[:, None, :]) & (gk[:, :, None] >= 0)
        return chain[None] | same_node | same_group


SIMULATORS = {"analytic": AnalyticSimulator, "linear": LinearSimulator, "rnn": RNNSimulator, "gat": GATSimulator}


def make_simulator(kind: str, **options: Any) -> Simulator:
    """A new simulator of ``kind`` (analytic, linear, rnn, gat)."""
    if kind not in SIMULATORS:
        raise SpecError(f"unknown simulator {kind!r}; valid: {', '.join(SIMULATORS)}")
    return SIMULATORS[kind]() if kind == "analytic" else SIMULATORS[kind](**options)


#: The simulator shipped with synctune (``simulator: pretrained``): trained on the dataset release
#: its metadata file names (``pretrained.json`` beside it), fine-tuned by each search on its own
#: trials (transfer, AutoSync §3.3).
PRETRAINED = "pretrained"


def pretrained_path() -> Path:
    """Where the shipped simulator is."""
    return Path(__file__).resolve().parent / "pretrained" / "simulator.pt"


def pretrained_info() -> dict:
    """What the shipped simulator was trained on, and how it scored (``pretrained.json``)."""
    meta = pretrained_path().with_name("pretrained.json")
    return json.loads(meta.read_text()) if meta.is_file() else {}


def load_simulator(path: str | Path) -> Simulator:
    """Load a saved simulator (``analytic`` needs no file; ``pretrained`` is the shipped one).
    Refuses anything else with a clear message."""
    torch = _torch()
    if str(path) == "analytic":
        return AnalyticSimulator()
    if str(path) == PRETRAINED:
        path = pretrained_path()
        if not path.is_file():
            raise SpecError(f"simulator: pretrained: this installation has no shipped simulator ({path} is missing; "
                            f"reinstall synctune, or name a kind such as rnn or a simulator file)")
    path = check_regular(path, "simulator")
    with open(path, "rb") as fh:
        head = fh.read(4096)
    if head.lstrip().startswith(b"{") and b"synctune-replay-residual" in head:
        from .residual import ResidualReplay  # a JSON file: the calibrated replay and its correction

        return ResidualReplay.load(path)
    if path.stat().st_size > MAX_SIMULATOR_BYTES:
        raise SpecError(f"{path}: {path.stat().st_size} bytes; a simulator file holds at most {MAX_SIMULATOR_BYTES}")
    _check_archive(path)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - corrupted, truncated, or not a torch file
        raise SpecError(f"{path}: not a readable synctune simulator file ({type(exc).__name__})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise SpecError(f"{path}: not a synctune simulator file (format {FORMAT!r} expected)")
    if payload.get("version") not in _READS or payload.get("kind") not in ("linear", "rnn", "gat"):
        raise SpecError(f"{path}: unsupported simulator version {str(payload.get('version'))[:20]!r} or kind "
                        f"{str(payload.get('kind'))[:20]!r} (this synctune reads versions "
                        f"{', '.join(map(str, _READS))}; retrain with synctune sim train)")
    try:
        config = json.loads(payload["config"])
        if not isinstance(config, dict):
            raise TypeError("config is not a mapping")
        vocabulary = config.get("compressors")
        if vocabulary != compressor_vocabulary():
            raise SpecError(f"{path}: trained with compressors {vocabulary}, this synctune has "
                            f"{compressor_vocabulary()}; its features mean other things now: retrain it "
                            f"(synctune sim train)")
        kinds = config.get("synchronizers") if payload["version"] >= 4 else _KINDS_V3
        if payload["version"] >= 4 and kinds != list(SYNCHRONIZER_KINDS):
            raise SpecError(f"{path}: trained with synchronizers {str(kinds)[:200]}, this synctune has "
                            f"{list(SYNCHRONIZER_KINDS)}; its features mean other things now: retrain it "
                            f"(synctune sim train)")
        sim = SIMULATORS[payload["kind"]](**{k: config[k] for k in ("epochs", "lr", "batch", "partition_penalty",
                                                                    "seed", "hidden")})
        sim.config.update(config)
        sim.config["synchronizers"] = kinds  # a version-3 file: the kinds before shard, its inputs without them
        for profile in config.get("profiles") or []:
            sim.replay.add_profile(ComputeProfile.from_dict(profile, where=f"{path}: profile"))
        if config.get("replay_constants"):
            from .replay import constants_from_file

            sim.replay.set_constants(constants_from_file(config["replay_constants"]))
        norm = payload["norm"]
        widths = {"x_mean": config["raw"], "x_std": config["raw"], "g_mean": config["global"],
                  "g_std": config["global"]}
        for key, width in widths.items():
            value = norm.get(key) if isinstance(norm, dict) else None
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != (width,):
                raise ValueError(f"normalisation {key!r} missing or not {width} numbers")
        if (config["raw"], config["global"]) != _widths(kinds):
            raise ValueError("its feature widths differ from this synctune's")
        sim._restore(payload["state"], norm)
    except SpecError:
        raise
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError, json.JSONDecodeError) as exc:
        raise SpecError(f"{path}: damaged simulator file ({type(exc).__name__}: {str(exc)[:200]})") from None
    return sim
