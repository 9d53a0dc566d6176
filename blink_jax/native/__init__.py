"""The native library: loading `ffi/`'s compiled scheduler and KV manager, its XLA FFI targets
and scheduler configuration (`ffi`), the step's batch descriptor (`batch`), host memory the GPU
maps, and a mailbox kept in GPU memory (`device_region`)."""
