// A stand-in for asmjit's x86 header (see core.h): the register types fbgemm's headers name, left empty.
#pragma once
namespace asmjit {
namespace x86 {
struct Xmm {};
struct Ymm {};
struct Zmm {};
}  // namespace x86
}  // namespace asmjit
