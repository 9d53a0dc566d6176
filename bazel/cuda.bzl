"""The CUDA handlers as one shared object built by nvcc (a genrule), where nvcc exists.

Where @local_cuda found no nvcc the target is an empty filegroup, so `bazel build //...`
passes and builds the CPU library only (as CMakeLists.txt does without nvcc).
"""

load("@local_cuda//:defs.bzl", "HAS_NVCC", "NVCC")

def blink_nvcc_shared_library(name, out, srcs, hdrs = [], xla_ffi_h = None, xla_hdrs = None,
                              nvcc_flags = [], **kwargs):
    """`out` (a .so) from the .cu `srcs`; `hdrs` lie in the directory of the first one.

    xla_ffi_h: the label of xla/ffi/api/ffi.h (its include root is passed to nvcc);
    xla_hdrs: a filegroup of all the XLA FFI headers (so the genrule's sandbox has them).
    """
    if not HAS_NVCC:
        native.filegroup(name = name, srcs = [], **kwargs)
        return
    cmd = " ".join([
        "'%s'" % NVCC,
        "-shared -std=c++17 -Xcompiler=-fPIC",
        " ".join(nvcc_flags),
        # Our own headers (beside the first source) and XLA's (three levels above ffi.h).
        "-I $$(dirname $(execpath %s))" % srcs[0],
        "-I $$(dirname $(execpath %s))/../../.." % xla_ffi_h,
        " ".join(["$(execpath %s)" % s for s in srcs]),
        "--cudart shared",
        "-o $@",
    ])
    native.genrule(
        name = name,
        srcs = srcs + hdrs + [xla_ffi_h, xla_hdrs],
        outs = [out],
        cmd = cmd,
        message = "nvcc: compiling %s" % out,
        **kwargs
    )
