// A stand-in for asmjit's core header. fbgemm's public fp16 GEMM headers include asmjit only to name the JIT
// register types of its other kernels, which fp16_linear.cpp never uses; torch ships fbgemm's headers but
// not asmjit's. An old version number selects fbgemm's plain type aliases.
#pragma once
#define ASMJIT_LIBRARY_MAKE_VERSION(major, minor, patch) (((major) << 16) | ((minor) << 8) | (patch))
#define ASMJIT_LIBRARY_VERSION ASMJIT_LIBRARY_MAKE_VERSION(1, 0, 0)
