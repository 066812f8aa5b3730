"""TensorFlow workloads: a Keras model, its batches and loss, and the model spec extracted from it.

The papers' systems are TensorFlow systems (AutoDist §2, AutoSync §2 take a TF graph); this is
their frontend in our terms. :func:`keras_model_spec` runs one step of a Keras model under a
``GradientTape`` and lists its trainable variables in the order their gradients reach the
collectives: the reverse of ``model.trainable_variables``, which is the order TensorFlow's own
collective all-reduce assumes ("values follow the order in which they are calculated") and the
one it packs in. A gradient that arrives as ``tf.IndexedSlices`` (an embedding lookup) makes its
variable sparse, with the distinct rows the batch touched measured, not guessed.

The small zoo has Keras versions (``keras-cnn-small``, ``keras-ncf-small``); a user's own Keras
model is a :class:`KerasWorkload` built from module-level factories. Keras workloads run with the
``tensorflow`` runtime (``synctune.engine.tensorflow``). TensorFlow is an optional extra
(``pip install ".[tensorflow]"``) imported only when a Keras workload is used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .. import import_tensorflow
from ..spec.errors import SpecError
from ..spec.model import ModelSpec, VariableSpec
from .base import Workload

__all__ = ["KerasWorkload", "KERAS_ZOO", "keras_workload", "keras_model_spec", "tensorflow_available"]

INSTALL_HINT = 'install TensorFlow with: python3 -m pip install -c constraints.txt -e ".[tensorflow]"'


def tensorflow_available() -> str | None:
    """None when TensorFlow and Keras 3 import here, else why not."""
    try:
        import_tensorflow()
    except ImportError as exc:
        return f"TensorFlow is not installed ({exc}); {INSTALL_HINT}"
    return None


@dataclass(frozen=True, kw_only=True)
class KerasWorkload(Workload):
    """A Keras model as a workload. ``model_fn()`` builds a new ``keras.Model`` (seeded by the
    caller), ``batch_fn(n, rank, seed)`` returns replica ``rank``'s batch ``(x, y)`` as NumPy
    arrays, ``loss_fn(model, x, y)`` the mean loss of a batch. All three must be module-level
    functions: the workload travels to every worker process."""

    name: str
    model_fn: Callable[[], Any]
    batch_fn: Callable[[int, int, int], tuple]
    loss_fn: Callable[..., Any]
    batch_size: int = 32
    family: str = ""
    origin: str = ""

    framework = "tensorflow"

    @property
    def source(self) -> str:  # type: ignore[override]
        return self.origin or f"keras:{self.name}"

    def build_model(self) -> Any:
        return self.model_fn()

    def make_batch(self, batch_size: int, *, rank: int, generator: Any = None, device: Any = None,
                   seed: int = 0) -> tuple:
        return self.batch_fn(batch_size, rank, seed)

    def loss(self, model: Any, batch: tuple) -> Any:
        return self.loss_fn(model, *batch)

    def make_optimizer(self, params: list = (), *, name: str = "sgd", lr: float = 0.01) -> Any:
        """A Keras optimizer (``params`` is unused: Keras optimizers bind variables when applied)."""
        import_tensorflow()
        import keras

        return keras.optimizers.Adam(lr) if name == "adam" else keras.optimizers.SGD(lr)

    def spec(self) -> ModelSpec:
        return _cached_spec(self)

    def batches(self, batch_size: int, rank: int, world: int, seed: int = 0):
        step = 0
        while True:
            yield self.batch_fn(batch_size, rank, seed * 1_000_003 + step * 1009)
            step += 1


_SPECS: dict[tuple, ModelSpec] = {}


def _cached_spec(workload: KerasWorkload) -> ModelSpec:
    key = (workload.name, workload.model_fn, workload.batch_fn, workload.loss_fn, workload.batch_size)
    if key not in _SPECS:
        _SPECS[key] = keras_model_spec(workload)
    return _SPECS[key]


def keras_model_spec(workload: KerasWorkload, seed: int = 0) -> ModelSpec:
    """The model spec of a Keras workload from one real step on the CPU: variables in the order
    their gradients reach TensorFlow's collectives (reverse creation order), dtype and shape from
    the variables, ``IndexedSlices`` gradients as sparse with the distinct rows of the batch."""
    tf = import_tensorflow()
    import keras
    import numpy as np

    where = f"keras workload {workload.name!r}"
    # Keras names layers from process-wide counters (dense, dense_1, ...): start them afresh so
    # the spec's variable names, and the model hash, do not depend on what was built before.
    keras.backend.clear_session()
    keras.utils.set_random_seed(seed)
    try:
        model = workload.model_fn()
    except Exception as exc:  # noqa: BLE001 - the user's model code
        raise SpecError(f"{where}: building the model failed: {type(exc).__name__}: {str(exc)[:300]}") from None
    if not isinstance(model, keras.Model):
        raise SpecError(f"{where}: model() returned {type(model).__name__}, not a keras.Model")
    x, y = workload.batch_fn(workload.batch_size, 0, seed)
    try:
        with tf.GradientTape() as tape:
            loss = workload.loss_fn(model, x, y)
        variables = list(model.trainable_variables)
        grads = tape.gradient(loss, variables)
    except Exception as exc:  # noqa: BLE001 - the user's forward and loss
        raise SpecError(f"{where}: the forward and backward pass on a batch of {workload.batch_size} failed: "
                        f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}") from None
    specs, rows = [], []
    for var, grad in reversed(list(zip(variables, grads))):
        name = getattr(var, "path", None) or var.name
        if grad is None:
            raise SpecError(f"{where}: variable {name!r} gets no gradient from the loss; make it non-trainable "
                            f"(layer.trainable = False) or use it in the loss")
        sparse = isinstance(grad, tf.IndexedSlices)
        dtype = var.dtype if isinstance(var.dtype, str) else var.dtype.name
        specs.append(VariableSpec(name=name, shape=tuple(int(d) for d in var.shape), dtype=dtype, sparse=sparse))
        rows.append(int(np.unique(grad.indices.numpy()).size) if sparse else None)
    return ModelSpec(name=workload.name, variables=tuple(specs), batch_size=workload.batch_size,
                     family=workload.family, touched_rows=tuple(rows) if any(r is not None for r in rows) else None)


# The small zoo, in Keras (the same families and sizes as cnn-small and ncf-small).

def _cnn_small():
    import_tensorflow()
    import keras
    from keras import layers

    inputs = keras.Input((32, 32, 3))
    h = inputs
    for width, stride in ((16, 1), (32, 2), (64, 2)):
        h = layers.Conv2D(width, 3, strides=stride, padding="same")(h)
        h = layers.GroupNormalization(groups=4)(h)
        h = layers.ReLU()(h)
    h = layers.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, layers.Dense(10)(h), name="keras_cnn_small")


def _cnn_batch(n: int, rank: int, seed: int) -> tuple:
    import numpy as np

    rng = np.random.default_rng(seed * 100_003 + rank)
    return rng.standard_normal((n, 32, 32, 3), dtype=np.float32), rng.integers(0, 10, n).astype(np.int32)


def _cnn_loss(model, x, y):
    import keras

    logits = model(x, training=True)
    return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))


NCF_USERS, NCF_ITEMS = 2000, 1000


def _ncf_small():
    import_tensorflow()
    import keras
    from keras import layers

    users, items = keras.Input((), dtype="int32"), keras.Input((), dtype="int32")
    gmf = layers.Multiply()([layers.Embedding(NCF_USERS, 8, name="gmf_user")(users),
                             layers.Embedding(NCF_ITEMS, 8, name="gmf_item")(items)])
    h = layers.Concatenate()([layers.Embedding(NCF_USERS, 16, name="mlp_user")(users),
                              layers.Embedding(NCF_ITEMS, 16, name="mlp_item")(items)])
    for width in (16, 8):
        h = layers.Dense(width, activation="relu")(h)
    out = layers.Dense(1)(layers.Concatenate()([gmf, h]))
    return keras.Model([users, items], out, name="keras_ncf_small")


def _ncf_batch(n: int, rank: int, seed: int) -> tuple:
    import numpy as np

    rng = np.random.default_rng(seed * 100_003 + rank)
    x = (rng.integers(0, NCF_USERS, n).astype(np.int32), rng.integers(0, NCF_ITEMS, n).astype(np.int32))
    return x, rng.integers(0, 2, (n, 1)).astype(np.float32)


def _ncf_loss(model, x, y):
    import keras

    logits = model(list(x), training=True)
    return keras.ops.mean(keras.losses.binary_crossentropy(y, logits, from_logits=True))


#: Keras versions of the small zoo models, by name.
KERAS_ZOO: dict[str, KerasWorkload] = {
    w.name: w for w in (
        KerasWorkload(name="keras-cnn-small", model_fn=_cnn_small, batch_fn=_cnn_batch, loss_fn=_cnn_loss,
                      batch_size=16, family="cnn", origin="zoo:keras-cnn-small"),
        KerasWorkload(name="keras-ncf-small", model_fn=_ncf_small, batch_fn=_ncf_batch, loss_fn=_ncf_loss,
                      batch_size=64, family="ncf", origin="zoo:keras-ncf-small"),
    )
}


def keras_workload(name: str) -> KerasWorkload:
    """The Keras zoo workload ``name`` (the error lists them)."""
    if name not in KERAS_ZOO:
        raise SpecError(f"unknown Keras model {name!r}; the Keras zoo has {', '.join(KERAS_ZOO)}")
    return KERAS_ZOO[name]
