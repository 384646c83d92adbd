#!/bin/sh
# clang-libfuzzer.sh CLANG COMPILER ARGS...: a compiler/linker launcher (CMake's
# C_COMPILER_LAUNCHER, C_LINKER_LAUNCHER) that builds a target with clang's
# libFuzzer, ASan and UBSan instead of the project's compiler: it drops
# COMPILER and runs CLANG with ARGS. gcc-only warning flags are ignored and no
# warning fails the build (the project's compiler is the one that gates them).
clang="$1"
shift 2
exec "$clang" "$@" -fsanitize=fuzzer,address,undefined -fno-omit-frame-pointer -DCS_LIBFUZZER \
  -Wno-unknown-warning-option -Wno-error
