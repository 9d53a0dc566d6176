"""GPU: a mailbox in GPU memory (DeviceRegion) reads back what was written, through copies
that run beside other work; bounds are checked."""
from __future__ import annotations

import numpy as np
import pytest

from blink_jax.client import mailbox as M
from blink_jax.client import protocol as P


def _gpu():
  try:
    import jax
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _gpu(), reason="no CUDA GPU")]


def test_device_region_round_trip_and_header():
  from blink_jax.native.device_region import DeviceRegion
  geo = P.Geometry(8, 16, 16, 0)
  region = DeviceRegion(geo.total_bytes)
  try:
    assert region.read(0, 64) == bytes(64)  # zeroed
    M.init_header(region, geo, vocab_size=100, max_context=64, num_workers=1, eos_id=1)
    h = M.read_header(region)
    assert int(h["num_slots"]) == 8
    region.write(100, b"\x01\x02\x03")
    assert region.read(100, 3) == b"\x01\x02\x03"
    image = np.arange(geo.total_bytes, dtype=np.uint8)
    region.upload(image)
    assert region.read(geo.total_bytes - 4, 4) == image[-4:].tobytes()
    with pytest.raises(ValueError, match="outside"):
      region.read(geo.total_bytes - 2, 4)
  finally:
    region.free()
