#!/bin/sh
echo "bazel coverage is not available in this offline build (see bazel/remote_coverage_tools)" >&2
exit 1
