"""step_flops (jaxhistory._hlo): the FLOPs of a compiled step, over every device."""

import numpy as np

import jaxhistory as jh

# ----- step_flops -------------------------------------------------------------------


def test_step_flops_counts_the_work_of_every_device(mesh):
    """The same global matmul gives the same count on one device or with its
    batch sharded over 8; work repeated on every device counts on each."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    a, b = np.ones((1024, 256), np.float32), np.ones((256, 512), np.float32)
    matmul = 2 * 1024 * 256 * 512
    assert matmul == 268_435_456
    fn = jax.jit(lambda x, y: x @ y)
    assert jh.step_flops(fn, a, b) == matmul  # one device
    batch = jax.device_put(a, NamedSharding(mesh, P("data")))
    whole = jax.device_put(b, NamedSharding(mesh, P()))
    assert jh.step_flops(fn, batch, whole) == matmul  # 8 devices, 1/8 each
    copies = jax.device_put(a, NamedSharding(mesh, P()))
    assert jh.step_flops(fn, copies, whole) == 8 * matmul  # each device all of it
    # shard_map: each device's block, plus the all-reduce's additions
    summed = jax.shard_map(
        lambda x, y: jax.lax.psum(x @ y, "data"),
        mesh=mesh,
        in_specs=(P(None, "data"), P("data")),
        out_specs=P(),
    )
    cols = jax.device_put(a, NamedSharding(mesh, P(None, "data")))
    rows = jax.device_put(b, NamedSharding(mesh, P("data")))
    assert jh.step_flops(summed, cols, rows) == matmul + 8 * 1024 * 512


def test_step_flops_counts_the_devices_from_the_shardings_too(mesh, monkeypatch):
    """Where the compiled module's header names no device count (a JAX version
    that words it otherwise), the shardings of the arguments still give it."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxhistory import _hlo

    assert _hlo.devices_in_hlo("HloModule m, is_scheduled=true") == 1
    assert _hlo.devices_in_hlo("HloModule m, num_partitions=4, replica_count=2") == 8
    monkeypatch.setattr(_hlo, "devices_in_hlo", lambda text: 1)
    a = np.ones((1024, 256), np.float32)
    batch = jax.device_put(a, NamedSharding(mesh, P("data")))
    whole = jax.device_put(np.ones((256, 512), np.float32), NamedSharding(mesh, P()))
    fn = jax.jit(lambda x, y: x @ y)
    assert jh.step_flops(fn, batch, whole) == 2 * 1024 * 256 * 512
    assert jh.step_flops(fn, a, np.ones((256, 512), np.float32)) == 2 * 1024 * 256 * 512
